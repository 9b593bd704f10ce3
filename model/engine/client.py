"""A worker process's handle on the engine process: the Engine interface the doors use, over the channel.

`RemoteEngine` answers what the doors ask of an engine (`reserve_wait`, `validate`, `stats`, `running`,
`max_sessions`) and gives `RemoteSlot`s with the `Slot` interface. Input crosses once per tick: shortly before each
tick (`input_lead_s` ahead of the engine's deadline) one `Frames` message carries the next frame of every realtime
session of this worker whose previous frame the engine has taken; a session that has none ready sends nothing and
the engine counts an underrun, as it would in one process. A frame that reaches the engine after its tick costs that
tick silence and puts the session's input one frame behind (its jitter buffer keeps the frame it could not send
until a silence drains it), so the lead adapts: the engine reports late frames with each tick, and how late the
latest came; the lead grows at once by that and LEAD_STEP_S more, and shrinks by a tenth of the step after
LEAD_CALM_TICKS ticks without one. Input-clocked
sessions send as soon as frames are ready, up to `OFFLINE_CREDIT` ahead of the engine. Outputs arrive batched per
tick and are handed to each slot's callback on this loop.

If the engine process goes away, every session fails with `engine_stopped`, `running` turns false, and the client
reconnects when an engine is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from model.config import FRAME_SAMPLES
from model.engine import (
    EngineError,
    EngineStats,
    FrameOutput,
    FrameSource,
    InvalidSessionParams,
    ResourceExhausted,
    SessionFailed,
    SessionParams,
    SlotStats,
)
from model.engine.api import check_params
from model.engine.channel import (
    FRAME_BYTES,
    AddPrompt,
    Close,
    Counters,
    Failed,
    Frames,
    Hello,
    MessageReader,
    ModelInfo,
    Reply,
    Reserve,
    Restart,
    Start,
    Stats,
    StatsRequest,
    Tick,
    ToWorker,
    Welcome,
    WorkerCounters,
    WorkerCounterSet,
    WorkerInfo,
    encode,
    tail,
)
from model.sampling_params import MAX_TOP_K_AUDIO, MAX_TOP_K_TEXT

log = logging.getLogger(__name__)

OFFLINE_CREDIT = 4      # input-clocked frames sent ahead of the engine's consumption
OFFLINE_POLL_S = 0.01   # how often input-clocked sources are checked for new frames
TICK_S = 0.08
LEAD_STEP_S = 0.002     # input lead growth on a late frame, beyond how late it was
LEAD_MAX_S = 0.040
LEAD_CALM_TICKS = 250   # 20 s without a late frame: the lead may shrink (never below the configured one)
ERRORS = {cls.code: cls for cls in (ResourceExhausted, InvalidSessionParams)}


def _error(code: str, message: str, cause: str) -> EngineError:
    """The engine's error as it was raised there, from what crossed the channel."""
    if code == SessionFailed.code:
        return SessionFailed(message, cause or "step")
    cls = ERRORS.get(code)
    return cls(message) if cls is not None else EngineError(message, code, cause or None)


class RemoteSlot:
    """A slot of the engine process, with the interface of `model.engine.Slot`."""

    def __init__(self, engine: RemoteEngine, sid: str, index: int) -> None:
        self._engine = engine
        self.id = sid
        self.index = index
        self.state = "reserved"
        self.source: FrameSource | None = None
        self.offline = False
        self.sent = 0
        self.counters = Counters(sid, 0, 0, 0)
        self._on_output: Callable[[FrameOutput], None] | None = None
        self._on_error: Callable[[EngineError], None] | None = None

    async def start(self, params: SessionParams, source: FrameSource, on_output: Callable[[FrameOutput], None],
                    on_error: Callable[[EngineError], None]) -> None:
        self._engine.validate(params)
        if self.state != "reserved":
            raise EngineError(f"slot {self.id} is {self.state}, not reserved", "invalid_state")
        self.source, self._on_output, self._on_error = source, on_output, on_error
        self.offline = params.pacing == "input"
        self.state = "prefill"
        try:
            await self._engine.request(Start(self._engine.next_req(), self.id, params))
        except BaseException:
            if self.state == "prefill":
                self.state = "reserved"
            raise
        if self.state == "prefill":
            self.state = "live"

    async def restart(self) -> None:
        if self.source is None:
            raise EngineError("session not started", "invalid_state")
        await self._engine.request(Restart(self._engine.next_req(), self.id))

    async def add_prompt(self, text: str, persona: str | None = None) -> None:
        if self.source is None:
            raise EngineError("session not started", "invalid_state")
        await self._engine.request(AddPrompt(self._engine.next_req(), self.id, text, persona))

    def close(self) -> None:
        if self.state in ("closed", "failed"):
            return
        self.state = "closed"
        self._engine.forget(self, tell_engine=True)

    def stats(self) -> SlotStats:
        c = self.counters
        return SlotStats(frames_in=c.frames_in, frames_out=c.frames_out, underruns=c.underruns, state=self.state,
                         window_shrinks=c.window_shrinks, window_frames=c.window_frames)

    # ---- from the channel -------------------------------------------------------------------------------------

    def deliver(self, frame: FrameOutput) -> None:
        # A session's first frame may come before the answer to its start (the engine hands it out as it goes live).
        if self.state in ("prefill", "live") and self._on_output is not None:
            self._on_output(frame)

    def fail(self, error: EngineError) -> None:
        if self.state in ("closed", "failed"):
            return
        self.state = "failed"
        self._engine.forget(self, tell_engine=False)
        if self._on_error is not None:
            self._on_error(error)

    def next_frame(self) -> bytes | None:
        """The next input frame to send, if the engine has taken the last one (realtime) or has credit left."""
        credit = OFFLINE_CREDIT if self.offline else 1
        if self.source is None or self.sent - self.counters.frames_in >= credit:
            return None
        frame = self.source.read_frame()
        if frame is None:
            return None
        data = np.asarray(frame, dtype=np.float32)
        if data.shape != (FRAME_SAMPLES,):  # as the engine refuses it; here, as frames cross in one block
            self._engine.forget(self, tell_engine=True)
            self.fail(SessionFailed(f"input failed: the input frame must be {FRAME_SAMPLES} finite samples",
                                    "input"))
            return None
        self.sent += 1
        return data.tobytes()


class RemoteEngine:
    """The engine process seen from a worker; `await run()` keeps the connection up (start it as a task)."""

    def __init__(self, path: str, worker: int, input_lead_s: float = 0.008) -> None:
        self.path = path
        self.worker = worker
        self.min_input_lead_s = self.input_lead_s = input_lead_s
        self._calm_ticks = 0
        self.model: ModelInfo | None = None
        self.note = ""
        self.engine_pid = 0
        self._max_sessions = 0
        self._connected = asyncio.Event()
        self._writer: asyncio.StreamWriter | None = None
        self._stats: EngineStats | None = None
        self.workers: dict[str, WorkerInfo] = {}
        self._slots: dict[str, RemoteSlot] = {}
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._req = 0
        self._next_tick_at = 0.0
        self._pump: asyncio.TimerHandle | None = None
        self.counters_source: Callable[[], WorkerCounterSet] | None = None
        self.connects = 0

    # ---- what the doors use -----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Connected, and the engine ticked lately (a stuck engine process counts as down)."""
        if self._writer is None or self._stats is None:
            return False
        return time.monotonic() - self._stats.last_tick_at < self._stats.stalled_after_s

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._stats is not None

    @property
    def sessions_here(self) -> int:
        """This worker's sessions on this engine now."""
        return len(self._slots)

    async def wait_connected(self, timeout_s: float) -> bool:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._connected.wait(), timeout_s)
        return self._connected.is_set()

    def stats(self) -> EngineStats:
        if self._stats is None:
            raise EngineError("the engine process is not connected", "engine_stopped")
        return self._stats

    async def fresh_stats(self) -> EngineStats:
        """Stats asked of the engine now (health checks), not the last pushed ones."""
        reply = await self.request(StatsRequest(self.next_req()))
        assert reply.stats is not None
        self._take_stats(reply.stats)
        return self.stats()

    def validate(self, params: SessionParams) -> None:
        check_params(params, MAX_TOP_K_TEXT, MAX_TOP_K_AUDIO)

    async def reserve_wait(self, timeout_s: float) -> RemoteSlot:
        reply = await self.request(Reserve(self.next_req(), timeout_s))
        slot = RemoteSlot(self, reply.sid, reply.index)
        self._slots[slot.id] = slot
        return slot

    # ---- requests ---------------------------------------------------------------------------------------------

    def next_req(self) -> int:
        self._req += 1
        return self._req

    async def request(self, message: Reserve | Start | Restart | AddPrompt | StatsRequest) -> Reply:
        if self._writer is None:
            raise EngineError("the engine process is not running", "engine_stopped")
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[message.req] = future
        try:
            self._writer.write(encode(message))
            reply = await future
        finally:
            self._pending.pop(message.req, None)
        if not reply.ok:
            raise _error(reply.code, reply.message, reply.cause)
        return reply

    def forget(self, slot: RemoteSlot, tell_engine: bool) -> None:
        if self._slots.pop(slot.id, None) is not None and tell_engine and self._writer is not None:
            self._writer.write(encode(Close(slot.id)))

    # ---- the connection ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, serve, and reconnect after a loss, until cancelled."""
        offline = asyncio.ensure_future(self._offline_pump())
        try:
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(self.path, limit=1 << 22)
                except OSError:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    await self._serve(reader, writer)
                except (ConnectionError, OSError) as exc:
                    log.warning("engine channel error: %s", exc)
                finally:
                    self._lost()
                    writer.close()
                await asyncio.sleep(0.2)
        finally:
            offline.cancel()
            self._lost()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        messages = MessageReader(reader, ToWorker)
        writer.write(encode(Hello(self.worker, os.getpid())))
        welcome = await messages.read()
        if not isinstance(welcome, Welcome):
            raise ConnectionError(f"the engine answered {type(welcome).__name__}, not Welcome")
        self.model, self._max_sessions, self.engine_pid = welcome.model, welcome.max_sessions, welcome.engine_pid
        self.note = welcome.note
        self._writer = writer
        self.connects += 1
        self._take_stats(welcome.stats)
        self._connected.set()
        self._schedule_pump(welcome.stats.next_tick_at)
        while (message := await messages.read()) is not None:
            self._dispatch(message)

    def _lost(self) -> None:
        if self._writer is None:
            return
        self._writer = None
        self._stats = None
        self._connected.clear()
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        stopped = EngineError("the engine process stopped", "engine_stopped")
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(stopped)
        for slot in list(self._slots.values()):
            slot.fail(EngineError("the engine process stopped", "engine_stopped"))
        self._slots.clear()

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Tick):
            self._take_tick(message)
        elif isinstance(message, Reply):
            future = self._pending.get(message.req)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, Failed):
            slot = self._slots.get(message.sid)
            if slot is not None:
                slot.fail(_error(message.code, message.message, message.cause))
        elif isinstance(message, Stats):
            self._take_stats(message)
            self._send_counters()

    def _take_stats(self, stats: Stats) -> None:
        self._stats, self.workers = stats.engine, stats.workers

    def _send_counters(self) -> None:
        if self.counters_source is not None and self._writer is not None:
            self._writer.write(encode(WorkerCounters(self.counters_source())))

    def _take_tick(self, tick: Tick) -> None:
        slots = self._slots
        if tick.counted:
            counts = np.frombuffer(tick.counts, dtype=np.int64).reshape(len(tick.counted), -1).tolist()
            for sid, row in zip(tick.counted, counts, strict=True):
                slot = slots.get(sid)
                if slot is not None:
                    slot.counters = Counters(sid, *row)
        if tick.sids:
            rows = len(tick.sids)
            audio = np.frombuffer(tick.audio, dtype=np.float32).reshape(rows, FRAME_SAMPLES)
            tokens = np.frombuffer(tick.tokens, dtype=np.int64).reshape(rows, -1)
            for k, sid in enumerate(tick.sids):
                slot = slots.get(sid)
                if slot is not None:  # each row its own copy: a frame kept holds no other session's block
                    slot.deliver(FrameOutput(tick.indices[k], audio[k].copy(), tick.texts[k], tokens[k].copy()))
        if tick.next_tick_at:
            self._adapt_lead(tick.late_frames, tick.late_by_s)
            self._schedule_pump(tick.next_tick_at)
        else:
            self._send_offline()

    def _adapt_lead(self, late_frames: int, late_by_s: float) -> None:
        if late_frames:
            # At once as far as the frames were late, and a step more: a worker whose loop lagged 20 ms behind an
            # 8 ms lead was late on ~7 ticks while it grew 2 ms a time, and each late tick put every session of the
            # worker one frame behind (H200 impaired run, worker 0: 491 late frames).
            self.input_lead_s = min(self.input_lead_s + late_by_s + LEAD_STEP_S, LEAD_MAX_S)
            self._calm_ticks = 0
            return
        self._calm_ticks += 1
        if self._calm_ticks >= LEAD_CALM_TICKS:
            self.input_lead_s = max(self.input_lead_s - LEAD_STEP_S / 10, self.min_input_lead_s)
            self._calm_ticks = 0

    # ---- input ------------------------------------------------------------------------------------------------

    def _schedule_pump(self, next_tick_at: float) -> None:
        """Send input `input_lead_s` before the engine's next tick; each pump schedules the one after, and every
        tick message re-anchors the schedule on the engine's own clock (monotonic time is one clock per host)."""
        self._next_tick_at = next_tick_at
        loop = asyncio.get_running_loop()
        if self._pump is not None:
            self._pump.cancel()
        at = next_tick_at - self.input_lead_s
        while at < loop.time() - TICK_S / 2:  # missed: aim at the next one
            at += TICK_S
            self._next_tick_at += TICK_S
        self._pump = loop.call_at(at, self._pump_realtime)

    def _pump_realtime(self) -> None:
        self._pump = None
        sids, audio = [], []
        for slot in list(self._slots.values()):
            if slot.state == "live" and not slot.offline:
                data = slot.next_frame()
                if data is not None:
                    sids.append(slot.id)
                    audio.append(data)
        self._send_frames(sids, audio, self._next_tick_at)
        if self._writer is not None:
            self._schedule_pump(self._next_tick_at + TICK_S)

    def _send_offline(self) -> None:
        sids, audio = [], []
        for slot in list(self._slots.values()):
            if slot.offline and slot.state == "live":
                while (data := slot.next_frame()) is not None:
                    sids.append(slot.id)
                    audio.append(data)
        self._send_frames(sids, audio, 0.0)

    def _send_frames(self, sids: list[str], audio: list[bytes], deadline: float) -> None:
        """One Frames message: its frames, in the order of `sids`, are its tail."""
        if sids and self._writer is not None:
            size = len(audio) * FRAME_BYTES
            self._writer.writelines([encode(Frames(sids=sids, deadline=deadline, audio=tail(size)), size), *audio])

    async def _offline_pump(self) -> None:
        while True:
            await asyncio.sleep(OFFLINE_POLL_S)
            self._send_offline()
