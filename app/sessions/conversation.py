"""One live conversation, independent of the transport: an engine `Slot`, its input jitter buffer, an output fan-out.

Every session (each WebSocket dialect, each bridge, a WebRTC call) holds one `Conversation` per connection:

    slot = await engine.reserve_wait(timeout_s)       # admission (raises ResourceExhausted)
    conv = Conversation(slot, metrics=metrics, input_policy=InputPolicy(backlog_s=2.0))
    remove = conv.add_listener(on_frame, on_error)    # called on the event loop, in frame order
    conv.add_input_tap(tap)                           # each input frame the engine takes (a recording)
    conv.start(SessionParams(...))                    # -> asyncio.Task (prefill, then live); makes `conv.input` now
    conv.push(None, samples_24k)                      # or hand `conv.input` (a JitterBuffer, a PtsSink) to a receiver
    await conv.restart()                              # fresh context, same params; indices restart at 0
    await conv.add_prompt("Speak French.")            # a <system> prompt into the live context; indices go on
    conv.close()                                      # frees the slot at once; idempotent; no callbacks afterwards

`on_frame(frame: FrameOutput)` gets every output frame of the current context; frames the engine made for a context
that `restart()` ended are dropped here, so listeners see one clean index sequence per context (`conv.epoch` counts
contexts). `on_error(error: EngineError)` is called once if the engine fails the conversation; the conversation is
then `failed` and its slot already freed.

`InputPolicy` says what a push beyond the bound does: `backlog_s=None` keeps the jitter buffer's network policy
(realtime: the oldest audio is dropped past its cap; right for WebRTC, where late audio is worthless); a number
makes `push` raise `Backpressure` instead and store nothing (right for WebSocket appends, which must lose nothing).

Threading: the engine calls back on its own thread; those calls only post to the loop (`call_soon_threadsafe`).
Everything else runs on the loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from app.shell.metrics import Metrics
from media.jitter import BufferFull, JitterBuffer, JitterConfig
from model.engine import EngineError, FrameOutput, SessionParams, Slot

logger = logging.getLogger(__name__)

FrameListener = Callable[[FrameOutput], None]
ErrorListener = Callable[[EngineError], None]
InputTap = Callable[[np.ndarray], None]


class Backpressure(Exception):
    """The input backlog is full; the pushed audio was not stored."""


class State(str, enum.Enum):
    IDLE = "idle"            # reserved, not started
    STARTING = "starting"    # prompt prefill running
    LIVE = "live"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(frozen=True)
class InputPolicy:
    backlog_s: float | None = None    # None: the jitter buffer's own bounds; else refuse pushes past this backlog
    input_backlog_s: float = 30.0     # pacing="input": the refusal bound (the buffer never drops there)


class Conversation:
    def __init__(self, slot: Slot, *, metrics: Metrics | None = None, input_policy: InputPolicy = InputPolicy(),
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.slot = slot
        self.id: str = slot.id
        self.state = State.IDLE
        self.params: SessionParams | None = None
        self.input: JitterBuffer | None = None
        self.epoch = 0
        self.failure: EngineError | None = None
        self._policy = input_policy
        self._loop = loop or asyncio.get_running_loop()
        self._metrics = metrics
        self._frame_listeners: list[FrameListener] = []
        self._error_listeners: list[ErrorListener] = []
        self._input_taps: list[InputTap] = []
        self._last_index = -1           # last frame index delivered in this context
        self._restarting: int | None = None  # last index of the context being ended, while restart() runs
        self._final_counters: dict[str, int] | None = None
        self.backpressure_refusals = 0
        if metrics is not None:
            metrics.conversation_opened(self)

    # ---- listeners -------------------------------------------------------------------------------------------

    def add_listener(self, on_frame: FrameListener, on_error: ErrorListener | None = None) -> Callable[[], None]:
        self._frame_listeners.append(on_frame)
        if on_error is not None:
            self._error_listeners.append(on_error)

        def remove() -> None:
            if on_frame in self._frame_listeners:
                self._frame_listeners.remove(on_frame)
            if on_error is not None and on_error in self._error_listeners:
                self._error_listeners.remove(on_error)
        return remove

    def add_input_tap(self, tap: InputTap) -> None:
        """Before `start`: `tap(frame)` gets each input frame the engine takes (1920 samples at 24 kHz), in order; in
        one process on the engine's thread, so it must only hand the frame on (a call's recording)."""
        self._input_taps.append(tap)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self.state in (State.STARTING, State.LIVE)

    def start(self, params: SessionParams) -> asyncio.Task[None]:
        """Create the input buffer now and run the prefill in a task (it raises `InvalidSessionParams` on bad
        params, leaving the conversation idle so corrected params can be tried)."""
        if self.state is not State.IDLE:
            raise RuntimeError(f"conversation {self.id} is {self.state.value}, not idle")
        realtime = params.pacing == "realtime"
        self.params = params
        self.input = JitterBuffer(realtime=realtime, config=self._jitter_config(realtime))
        self.state = State.STARTING
        return self._loop.create_task(self._start(params))

    def _jitter_config(self, realtime: bool) -> JitterConfig:
        base = JitterConfig()
        if not realtime:
            return replace(base, backlog_s=self._policy.input_backlog_s)
        if self._policy.backlog_s is None:
            return base
        cap_ms = self._policy.backlog_s * 1000.0
        # Our own check refuses pushes past cap_ms, so the buffer's hard cut and hard cap never fire.
        return replace(base, hard_cap_ms=cap_ms + 2 * base.headroom_ms, headroom_ms=cap_ms + base.headroom_ms)

    async def _start(self, params: SessionParams) -> None:
        assert self.input is not None
        try:
            source = _TappedInput(self.input, self._input_taps) if self._input_taps else self.input
            await self.slot.start(params, source, self._on_output_engine, self._on_error_engine)
        except BaseException:
            if self.state is State.STARTING:
                self.state = State.IDLE
                self.input = None
            raise
        if self.state is State.STARTING:
            self.state = State.LIVE

    async def restart(self) -> None:
        """Fresh model context with the same params (OpenAI `response.cancel`); the input buffer is kept."""
        if not self.started:
            raise RuntimeError(f"conversation {self.id} is {self.state.value}")
        self._restarting = self._last_index
        try:
            await self.slot.restart()
        except BaseException:
            self._restarting = None
            raise
        if self._restarting is not None:  # no frame of the new context delivered yet
            self._restarting = None
            self.epoch += 1
            self._last_index = -1

    async def add_prompt(self, text: str, persona: str | None = None) -> None:
        """Prefill `text` as a `<system>` prompt into the live context at the next frame boundary: the model keeps
        what it heard and said, frame indices go on; `persona` (given when the instructions changed) is what a
        later `restart()` prompts with."""
        if self.state is not State.LIVE:
            raise RuntimeError(f"conversation {self.id} is {self.state.value}, not live")
        await self.slot.add_prompt(text, persona)
        if persona is not None and self.params is not None:
            self.params = replace(self.params, persona=persona)

    def close(self) -> None:
        if self.state is State.CLOSED:
            return
        self._final_counters = self.counters()
        self.state = State.CLOSED
        self.slot.close()
        self._frame_listeners.clear()
        self._error_listeners.clear()
        if self._metrics is not None:
            self._metrics.conversation_closed(self)

    # ---- input -----------------------------------------------------------------------------------------------

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        """24 kHz float32 audio into the jitter buffer; raises `Backpressure` (nothing stored) past the bound."""
        if self.input is None:
            raise RuntimeError("push before start()")
        bound = self._policy.backlog_s
        if self.input.realtime and bound is not None:
            depth_s = self.input.stats().depth_ms / 1000.0
            if depth_s + samples.size / 24000 > bound:
                self.backpressure_refusals += 1
                raise Backpressure(f"input backlog full: {depth_s * 1000:.0f} ms queued, bound {bound * 1000:.0f} "
                                   f"ms; send audio at the pace it plays (80 ms per 80 ms)")
        try:
            self.input.push(pts, samples, now)
        except BufferFull as e:
            self.backpressure_refusals += 1
            raise Backpressure(str(e)) from None

    def clear_input(self) -> None:
        if self.input is not None:
            self.input.clear()

    # ---- output (engine thread -> loop) ----------------------------------------------------------------------

    def _on_output_engine(self, frame: FrameOutput) -> None:
        self._loop.call_soon_threadsafe(self._deliver, frame)

    def _on_error_engine(self, error: EngineError) -> None:
        self._loop.call_soon_threadsafe(self._fail, error)

    def _deliver(self, frame: FrameOutput) -> None:
        if self.state is State.CLOSED or self.state is State.FAILED:
            return
        if self._restarting is not None:
            # While restart() runs, frames of the ended context keep counting up from its last index; the new
            # context starts again at 0. (If the old context had sent nothing yet, its frames are dropped too.)
            if self._restarting < 0 or frame.index > self._restarting:
                return
            self._restarting = None
            self.epoch += 1
            self._last_index = -1
        self._last_index = frame.index
        for listener in list(self._frame_listeners):
            try:
                listener(frame)
            except Exception:
                logger.exception("conversation %s: frame listener failed", self.id)

    def _fail(self, error: EngineError) -> None:
        if self.state is State.CLOSED or self.state is State.FAILED:
            return
        self.failure = error
        listeners = list(self._error_listeners)
        self.close()
        self.state = State.FAILED
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("conversation %s: error listener failed", self.id)

    # ---- counters --------------------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        if self._final_counters is not None:
            return dict(self._final_counters)
        s = self.slot.stats()
        return {"frames_in": s.frames_in, "frames_out": s.frames_out, "underruns": s.underruns}


class _TappedInput:
    """The input buffer as the engine reads it, each frame it takes handed to the taps as well."""

    def __init__(self, source: JitterBuffer, taps: list[InputTap]) -> None:
        self._source = source
        self._taps = taps

    def read_frame(self) -> np.ndarray | None:
        frame = self._source.read_frame()
        if frame is not None:
            for tap in self._taps:
                tap(frame)
        return frame

    def frames_ready(self) -> int:
        return self._source.frames_ready()
