"""The Engine: one thread owns the device and advances every live conversation per tick; this wires the parts.

Every 80 ms (wall clock) the tick takes one 1920-sample frame from each live realtime session's source (silence,
and an underrun counted, when the source has none), runs one batched step — Mimi encode, temporal transformer,
depformer, Mimi decode — over the smallest padded batch that covers the live slots (runner.py), and hands each
session its audio and text piece. The model runs one call ahead of the reference's order (token for token the
same), so the frame a tick hands out is the one whose input it just took, not the one before: 80 ms less latency.
Input-clocked sessions (offline files) are stepped on their own between ticks whenever a frame is ready. Admission,
prompt prefill, restarts and closes run on the same thread between ticks, so the step never races with
bookkeeping; the asyncio side only enqueues work and receives callbacks (on this thread).

A session's start is a job of steps (its prompt planned, prefilled on a scratch row or copied from the prompt
cache, prompt_cache.py), placed between ticks by scheduler.py. On CUDA a cached prompt's copy also runs while a
tick is in flight on the device, queued behind it on its stream, so a cached open does not wait for a tick. A
realtime session's open returns with its prompt in place; its first half (the first model half, which needs no
input) follows as a one-row step in a gap, or, when a tick comes first, right before that tick's batch (its
client's audio already waits) or in the batch (none does). An input-clocked session's is the last step of its open.
Each session's state machine lives in slots.py; the counters in stats.py.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace

import numpy as np
import torch

from model.batch_step import bucket
from model.config import FRAME_SAMPLES
from model.engine.api import (
    EngineConfig,
    EngineError,
    EngineStats,
    FrameOutput,
    InvalidSessionParams,
    OutputRows,
    ResourceExhausted,
    SessionFailed,
    SessionParams,
    SlotStats,
    TickRecord,
    check_params,
)
from model.engine.prompt_cache import PromptCache
from model.engine.runner import RowOutputs, Runner, make_current
from model.engine.scheduler import Scheduler
from model.engine.slots import (
    ENDED,
    FRAMES_IN,
    UNDERRUNS,
    Session,
    Slot,
    SlotTable,
)
from model.engine.staging import StagedInputs
from model.engine.stats import (
    FIRST_HALF_HOST_PHASE,
    HAND_OFF_HOST_PHASE,
    PREPARE_INPUTS_HOST_PHASE,
    PREPARE_LAUNCH_HOST_PHASE,
    PREPARE_LAUNCH_PARTS,
    EngineCounters,
)
from model.loading import PersonaPlex
from model.prompts import PromptPlan, persona_tokens, plan_prompt
from model.sampling_params import MAX_TOP_K_AUDIO, MAX_TOP_K_TEXT, SamplingParams

log = logging.getLogger(__name__)

TickListener = Callable[[TickRecord, float], None]

# While an engine runs, a thread that waits for the GIL asks its holder to drop it after this long (Python's default:
# 5 ms). Each torch op of a CPU tick releases the GIL and takes it back (~150 a tick on the tiny model); beside a
# busy Python thread of the same process (the event loop under a burst of clients) every take waited a whole
# interval: a 14 ms tick took ~750 ms, and over 2 s on a loaded 2-core machine, where health then reported the
# engine stalled. At 0.5 ms that tick takes ~60 ms; the cost is more frequent switches between busy threads.
ENGINE_SWITCH_INTERVAL_S = 0.0005
# The engine thread's garbage collection waits this long after a tick's listeners: the worker processes' outputs
# leave through the host's asyncio thread (model/engine/process.py), which needs the GIL that a collection holds
# throughout. Run straight after the tick (as it was), a collection held that tick's outputs for every worker at
# once; the likely cause of what the H200 showed at 144 calls: 26 of 29 WebRTC and 6 of 29 Twilio calls, on four
# workers, heard one frame of silence at the same instant of a run, with no tick over 40 ms.
COLLECT_AFTER_TICK_S = 0.010

_owners_lock = threading.Lock()
_owners = 0
_switch_interval_before = 0.0


def _process_owned(running: bool) -> None:
    """While an engine runs, its thread starts the garbage collector (_collect_garbage), not allocation counts:
    an automatic collection falls inside a tick as often as not, and one of the older generations takes
    milliseconds over a loaded server. And threads hand over the GIL every ENGINE_SWITCH_INTERVAL_S."""
    global _owners, _switch_interval_before
    with _owners_lock:
        _owners += 1 if running else -1
        if running and _owners == 1:
            gc.disable()
            _switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        elif not running and _owners == 0:
            gc.enable()
            sys.setswitchinterval(_switch_interval_before)


def _collect_garbage() -> float | None:
    """What the automatic collector would do at this point, run in the gap after a tick (COLLECT_AFTER_TICK_S after
    its outputs went out; the gap is ~55 ms at 64 full sessions): the youngest generation once its allocation count
    passes the threshold, an older one when enough younger collections have passed. Its ms, if it ran."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if counts[0] < thresholds[0]:
        return None
    generation = 0
    if counts[1] >= thresholds[1]:
        generation = 2 if counts[2] >= thresholds[2] else 1
    started = time.perf_counter()
    gc.collect(generation)
    return (time.perf_counter() - started) * 1000.0


class Engine:
    """Slots, the tick thread, prompt prefill and its cache. See the module docstring."""

    def __init__(self, model: PersonaPlex, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        if self.config.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.runner = Runner(model, self.config)
        self.scheduler = Scheduler(self.config.tick_ms / 1000.0, self.config.in_flight_copy_share,
                                   self.config.first_half_tick_budget)
        self.slots = SlotTable(self.config.max_sessions)
        self.prompts = PromptCache(self.config.prompt_cache_entries)
        self.counters = EngineCounters()
        self.runner.pages.on_window = self._window_changed
        self._pages_of = np.zeros(self.config.max_sessions, dtype=np.int64)  # engine thread: whose pages (serial)
        self.inputs = StagedInputs(self.runner.pcm_np)
        self._output_groups: dict[int, Callable[[OutputRows], None]] = {}
        self._next_output_group = 0
        # Each row's session's next output frame index (its count of frames out since its start), kept by row so a
        # tick counts an output group's frames in one array operation.
        self._out_index = np.zeros(len(self.runner.pcm_np), dtype=np.int64)
        # The realtime sessions gone live whose first half is still to run, by row (engine thread): a tick finds
        # them here, not by a pass over every session.
        self._first_halves: dict[int, Session] = {}
        self._lock = self.slots.lock
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._pending: set[Callable[[BaseException | None], None]] = set()
        self._tick_listeners: tuple[TickListener, ...] = ()
        self._collect_at: float | None = None  # when the engine thread collects garbage next (after a tick)
        self._warmed_for: float | None = None  # the tick deadline whose lead warmed the tick's calls

    # ----- public, any thread ------------------------------------------------------------------------------

    @property
    def max_sessions(self) -> int:
        return self.config.max_sessions

    @property
    def running(self) -> bool:
        """Whether the tick thread is up and ticking (for health checks): a tick stuck for the config's
        stalled_after_s counts as down."""
        if self._thread is None or not self._thread.is_alive():
            return False
        return time.monotonic() - self.counters.last_tick_at < self.config.stalled_after_s

    @property
    def next_tick_at(self) -> float:
        """time.monotonic() of the next tick's deadline (0.0 before start())."""
        return self.scheduler.deadline

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def lm_state(self):
        return self.runner.lm_state

    def sessions_in_use(self) -> int:
        return self.slots.in_use()

    def add_tick_listener(self, listener: TickListener) -> None:
        """Call `listener(record, next_tick_at)` on the engine thread after every realtime tick that stepped a
        session, once its frames are handed out: the tick's record and the monotonic deadline of the next tick."""
        self._tick_listeners = (*self._tick_listeners, listener)

    def start(self) -> None:
        if self._thread is not None:
            return
        make_current(self.runner.device)
        self.scheduler.step_s["first_half"].append(self.runner.warm_up())
        # The loudness meter (model/audio.py imports it on first use: 1.3 s of scipy) before the loop: a .wav
        # voice's first open runs between ticks and would otherwise hold every session that long.
        import pyloudnorm  # noqa: F401
        # A full garbage collection walks every live object with the GIL held: ~100 ms over a loaded model and
        # server, which would stall a tick. What exists now lives while the engine runs, so take it out of the
        # collector's view (after collecting what is already garbage); later collections walk only what sessions
        # create. stop() hands it all back.
        gc.collect()
        gc.freeze()
        _process_owned(True)
        self._running = True
        self.scheduler.start_clock()
        self.counters.last_tick_at = time.monotonic()  # a first tick that never ends is a stall too
        self._thread = threading.Thread(target=self._loop, name="engine-tick", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            _process_owned(False)
            gc.unfreeze()
        # Work queued for the thread will never run: answer everyone who waits on it.
        stopped = EngineError("the engine stopped", "engine_stopped")
        for done in list(self._pending):
            done(stopped)
        self.scheduler.jobs.clear()
        for session in self.slots.held():
            if session.live:
                self._fail(session, EngineError("the engine stopped", "engine_stopped"))

    def reserve(self) -> Slot:
        """A slot for a new session, if one is free and the KV pages cover the growth of those in use (pages.py)."""
        with self._lock:
            held = [s.index for s in self.slots.held()]
            if len(held) < self.max_sessions and not self.runner.pages.admits(held):
                self.counters.count_refusal()
                raise ResourceExhausted("kv_pages_exhausted: the free KV pages would not cover the live sessions")
            return Slot(self, self.slots.reserve())

    async def reserve_wait(self, timeout_s: float) -> Slot:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.reserve()
            except ResourceExhausted:
                if time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(0.02)

    def validate(self, params: SessionParams) -> None:
        """Raise InvalidSessionParams for anything the session could not run with."""
        check_params(params, MAX_TOP_K_TEXT, MAX_TOP_K_AUDIO)
        if params.voice is not None:
            try:
                self.model.resolve_voice(params.voice)
            except ValueError as exc:
                raise InvalidSessionParams(str(exc), "invalid_voice") from exc

    async def start_session(self, session: Session) -> None:
        """A session's start (or restart) on the engine thread; returns once it is live (slots.SessionHost)."""
        session.start_requested_at = time.monotonic()
        await self.submit(lambda: self._start_steps(session), session.index)

    async def add_prompt(self, session: Session, text: str, persona: str | None) -> None:
        """Prefill `text` as a `<system>` prompt into a live session's context between ticks (slots.SessionHost)."""
        await self.submit(lambda: self._prompt_steps(session, text, persona), session.index)

    async def submit(self, fn: Callable[[], Iterator[str] | None], row: int | None = None) -> None:
        """Run `fn` (work on slot `row`) on the engine thread between ticks; its exception is raised here.

        A generator function runs one step per gap between ticks, where the step fits before the next tick
        (prompt prefill in chunks), so long work does not make ticks late. It yields the kind of its next step
        (scheduler.STEP_KINDS) before each one, the first time before doing any work: steps are scheduled by the
        recent duration of their kind.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)

        def done(exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, exc)

        def run() -> None:
            try:
                steps = fn()
                kind = None if steps is None else next(steps)
            except BaseException as exc:  # handed to the awaiting coroutine
                done(exc)
                return
            if steps is None:
                done(None)
            else:
                self.scheduler.add_job(steps, done, kind, row)

        if self._thread is None:
            raise EngineError("the engine is not running", "engine_stopped")
        self._pending.add(done)
        self._commands.put(run)
        self._wake.set()
        try:
            await future
        finally:
            self._pending.discard(done)

    def add_output_group(self, deliver: Callable[[OutputRows], None]) -> int:
        """A group of sessions (`Slot.start(output_group=...)`) whose frames go to `deliver` on the engine thread,
        a tick's in one call as rows of its outputs (a frame between ticks, a first half's or an input-clocked
        step's, as one row): no FrameOutput or call per session (an engine process hands each worker's frames on
        this way). Its key."""
        key = self._next_output_group
        self._next_output_group += 1
        self._output_groups[key] = deliver
        return key

    def remove_output_group(self, key: int) -> None:
        """The group's sessions' frames go nowhere from now on (they are closing)."""
        self._output_groups.pop(key, None)

    def offer_inputs(self, sessions: list[Session], frames: np.ndarray) -> list[bool]:
        """Stage realtime sessions' next input frames (`frames[k]` is `sessions[k]`'s) in their rows as they arrive
        (slots.SessionHost, staging.py): for each, True if the next tick will take it from there; False, and the
        caller queues it in the session's source."""
        if not self.config.stage_inputs:
            return [False] * len(sessions)
        holds = self.slots.holds

        def admits(k: int) -> bool:
            session = sessions[k]
            return (session.live and not session.offline and not session.first_half_pending and holds(session)
                    and session.source.frames_ready() == 0)

        return self.inputs.offer([s.index for s in sessions], frames, admits)

    def session_stats(self, session: Session) -> SlotStats:
        """The session's record with its counts so far (slots.SessionHost)."""
        return self.slots.stats(session)

    def counts_of(self, rows: np.ndarray, serials: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The counts (slots.ROW_COUNTS) in `rows` as of one moment, int64 [len(rows), 5], and whether each row is
        still held by the session of the serial given for it (one that is not has ended since: its record holds its
        counts, slots.SlotTable.move)."""
        slots = self.slots
        with slots.lock:
            return slots.counts[rows], slots.holders[rows] == serials

    def release(self, session: Session) -> None:
        ended = session.state in ENDED
        if self.slots.move(session, "closed") and not ended:
            self._return_pages(session.index)

    def _return_pages(self, row: int) -> None:
        """A session left `row`: its KV pages go back to the pool on the engine thread, before any later start
        (commands run in order) and between ticks."""
        self._commands.put(lambda: self._reset_row(row))
        self._wake.set()

    def _reset_row(self, row: int, owner: int = 0) -> None:
        """The row's model state and pages back to a fresh row's (engine thread), its pages now the session of
        serial `owner`'s (0: no session's)."""
        self.runner.reset_lm_row(row)
        self._pages_of[row] = owner

    def stats(self) -> EngineStats:
        stats = self.counters.snapshot(self.slots.in_use(), self.max_sessions, self.prompts.hits, self.prompts.misses,
                                       self.scheduler.step_seconds(), self.runner.pages.counts())
        stats.stalled_after_s = self.config.stalled_after_s
        stats.input_frames_staged = self.inputs.staged
        return stats

    def recent_ticks(self, count: int) -> list[TickRecord]:
        """The last `count` realtime ticks (at most the last 2000), oldest first: for benchmarks, which read them
        once after a run instead of polling stats() every tick beside the tick thread."""
        return self.counters.recent(count)

    def step_timings(self, n: int, iterations: int) -> list[dict[str, float]]:
        """Run the batched step over rows [0, n) with every row active, before start(): per-part ms per run.

        For benchmarks and warm-up; it advances those rows' state like real ticks would.
        """
        if self._thread is not None:
            raise EngineError("step_timings runs only while the engine is stopped", "invalid_state")
        runs = []
        for _ in range(iterations):
            self.step_rows(bucket(n, self.max_sessions))
            runs.append(self.runner.parts_ms)
        return runs

    def step_rows(self, rows: int, pcm: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One batched step with rows [0, rows) active (in the padded batch a tick of that many sessions runs),
        before start(): with `pcm` [rows, 1920] as their input frames (else the last ones written), their token
        frames and audio (blocks of their own) and emitted flags (a view the next step overwrites). For benchmarks;
        it advances those rows like a real tick."""
        if self._thread is not None:
            raise EngineError("step_rows runs only while the engine is stopped", "invalid_state")
        runner = self.runner
        n = bucket(rows, self.max_sessions)
        if pcm is not None:
            runner.pcm_np[:rows] = pcm
        runner.active_np[:n] = runner.takes_input_np[:n] = False
        runner.active_np[:rows] = runner.takes_input_np[:rows] = True
        try:
            runner.prepare_batch(n)
            frames, emitted, audio, _ = self._run_batch(n, [], np.arange(rows))
            return frames, emitted[:rows], audio
        finally:
            runner.active_np[:n] = runner.takes_input_np[:n] = False

    def sample_rows(self, rows: int, sampling: SamplingParams) -> None:
        """Rows [0, rows) draw with `sampling` from now on, row r seeded r (step_rows' rows start greedy). For
        benchmarks, before start()."""
        if self._thread is not None:
            raise EngineError("sample_rows runs only while the engine is stopped", "invalid_state")
        for row in range(rows):
            self.runner.set_sampling(row, sampling, row)

    def fill_context(self, rows: slice, frames: int) -> None:
        """Mark `frames` past frames as present in the KV of `rows` (their values left as they are).

        For benchmarks: attention then costs what a conversation of that length costs.
        """
        self.runner.fill_context(rows, frames)

    # ----- engine thread: a session's start ----------------------------------------------------------------

    def _start_steps(self, session: Session) -> Iterator[str]:
        """A session's start, one step per gap between ticks: its prompt from the prompt cache ("copy"), or
        planned ("plan") and prefilled, whole on the scratch row ("prefill") or, when longer than it, one eager
        chunk per step on the row ("chunk"); then, for an input-clocked session, its first half ("first_half").

        The open's work time (stats' open_work_ms_last) counts the time spent working, not the ticks in between.
        """
        if not self.slots.move(session, "prefill"):
            raise EngineError("the session was closed", "session_closed")
        runner, params, row = self.runner, session.params, session.index
        key = self.prompts.key(params.voice, params.persona)
        yield "copy" if key in self.prompts.prompts else "plan"
        work = 0.0
        segment = time.perf_counter()
        cached = self.prompts.lookup(key)

        def spent(since: float) -> float:
            # A cached prompt's copy may run while a tick is in flight: waiting for the device would wait for the
            # tick. Its time is then the host's, which is most of it (~130 small copies).
            return time.perf_counter() - since if cached is not None else runner.sync_elapsed(since)

        def next_step(kind: str) -> Iterator[str]:
            nonlocal work, segment
            work += spent(segment)
            yield kind
            segment = time.perf_counter()
            if session.state != "prefill":
                raise EngineError("the session was closed", "session_closed")

        self._reset_row(row, session.serial)
        if cached is None:
            plan = self._plan(params)
            if runner.scratch.fits(plan.embeddings.shape[0]):
                yield from next_step("prefill")
                prompt = runner.prefill_on_scratch(plan)
                self.prompts.prompts.put(key, prompt)
                runner.copy_prompt(prompt, row)
            else:  # longer than the scratch ring: eagerly on the row, one chunk per step
                for chunk in runner.prompt_chunks(plan):
                    yield from next_step("chunk")
                    runner.prefill_chunk(chunk, row)
                self.prompts.prompts.put(key, runner.finish_prompt(plan, row))
        else:
            runner.copy_prompt(cached, row)
        runner.set_sampling(row, params.sampling, session.seed)
        # Ticks between the prompt's steps ran Mimi over this (inactive) row: it starts fresh only now.
        runner.reset_mimi_row(row)
        # The first half needs no input (model/step.py); from then on every step completes the frame whose input it
        # just received, instead of the one before. A realtime session's runs at its first tick at the latest
        # (_realtime_tick), so the open returns once the prompt is in place; an input-clocked session's runs now.
        first = None
        if session.offline:
            yield from next_step("first_half")
            first = runner.first_half(row)
        with self.counters.lock:
            self.counters.open_ms = (work + spent(segment)) * 1000.0
        with self._lock:
            if self.slots.move(session, "live"):
                self.inputs.discard(row)
                self._out_index[row] = 0
                self._set_first_half_pending(session, not session.offline)
                self.counters.record_start(time.monotonic() - session.start_requested_at)
        if first is not None:
            self._deliver(session, *first)
        if session.first_half_pending:
            # In a gap before its first tick if one fits: then the tick neither waits nor skips its input.
            steps = self._first_half_step(session)
            self.scheduler.add_job(steps, lambda exc: None, next(steps), row)  # a job stands before its first step

    def _prompt_steps(self, session: Session, text: str, persona: str | None) -> Iterator[str]:
        """A prompt added to a live session's context, one chunk per gap between ticks (most prompts are one).

        The row leaves the ticks while it runs (`prefill`), its context goes on from where it is (prompts.py,
        `plan_continuation`), and it comes back as a session's start does: its first half runs before or in its
        next tick, so the caller's next frame of audio meets the model one call ahead again. A prompt of one chunk
        runs between two ticks and the caller misses no frame; a longer one misses the ticks it spans, after which
        the row's codec state starts fresh (the ticks in between ran Mimi over the inactive row).
        """
        yield "chunk"
        if not session.live:
            raise EngineError(f"the session is {session.state}, not live", "invalid_state")
        runner, row = self.runner, session.index
        pending = not session.first_half_pending
        plan = runner.continuation(row, persona_tokens(self.model.tokenizer, text), pending)
        if not self.slots.move(session, "prefill"):
            raise EngineError("the session was closed", "session_closed")
        for i, chunk in enumerate(runner.prompt_chunks(plan)):
            if i:
                yield "chunk"
                if session.state != "prefill":
                    raise EngineError("the session was closed", "session_closed")
                runner.reset_mimi_row(row)
            runner.prefill_chunk(chunk, row)
        runner.end_prompt(plan, row)
        if persona is not None:
            session.params = replace(session.params, persona=persona)
        first = None
        if session.offline:
            yield "first_half"
            first = runner.first_half(row)
        with self._lock:
            if self.slots.move(session, "live"):
                self._set_first_half_pending(session, not session.offline)
        if first is not None:
            self._deliver(session, *first)

    def _first_half_step(self, session: Session) -> Generator[str, None, bool]:
        """A job of one step: the session's first half, unless its first tick ran it already (or the session
        ended): then it returns False, and the no-op is not taken for a first half's duration."""
        yield "first_half"
        if not (session.first_half_pending and session.live):
            return False
        self._run_first_half(session)
        return True

    def _run_first_half(self, session: Session) -> None:
        """A realtime session's first half as a one-row step; its frame goes out at once."""
        try:
            first = self.runner.first_half(session.index)
        except Exception as exc:
            log.exception("first model half failed")
            self._fail(session, SessionFailed(f"step failed: {exc}", "step"))
            return
        self._set_first_half_pending(session, False)
        self._deliver(session, *first)

    def _set_first_half_pending(self, session: Session, pending: bool) -> None:
        session.first_half_pending = pending
        if pending:
            self._first_halves[session.index] = session
        elif self._first_halves.get(session.index) is session:
            del self._first_halves[session.index]

    def _first_halves_due(self) -> list[Session]:
        """The live realtime sessions whose first half is still to run, in row order (those that left forgotten)."""
        due = self._first_halves
        for row, session in list(due.items()):
            if not (session.first_half_pending and session.live and self.slots.holds(session)):
                del due[row]
        return [due[row] for row in sorted(due)]

    def _plan(self, params: SessionParams) -> PromptPlan:
        voice = None
        if params.voice is not None:
            try:
                voice = self.prompts.voice(params.voice, self.model.load_voice)
            except ValueError as exc:  # a file that resolves but does not load (unreadable, too short)
                raise InvalidSessionParams(str(exc), "invalid_voice") from exc
        return plan_prompt(self.model.lm, voice, persona_tokens(self.model.tokenizer, params.persona))

    # ----- engine thread: the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        make_current(self.runner.device)  # per thread
        # On the CPU a tick is thousands of tiny ops whose dispatch is the cost: inference mode takes ~10 % off the
        # tiny model's tick (bench.engine_bench --tiny). CUDA replays graphs, and its compiled helpers were traced
        # under no_grad at warm-up, which inference mode would make them trace again in the first session's start.
        with torch.inference_mode(self.runner.device.type == "cpu"):
            while self._running:
                try:
                    self._iterate()
                except Exception:  # a bug must not stop every conversation: log it, count it, keep ticking
                    log.exception("engine loop error")
                    self.counters.count_error("loop")
                    time.sleep(0.001)

    def _iterate(self) -> None:
        """One pass of the loop: commands, then the tick when due, else a start's step, an offline frame or a wait."""
        self._drain_commands()
        scheduler = self.scheduler
        now = time.monotonic()
        if scheduler.tick_due(now):
            if self._collect_at is not None:  # the last tick's collection found no gap before this one
                self._collect()
            record = self._realtime_tick(started_late=scheduler.started_late(now))
            self.counters.last_tick_at = time.monotonic()
            next_tick_at = scheduler.tick_done(time.monotonic(), None if record is None else record.ms / 1000.0)
            if record is not None and self._tick_listeners:
                started = time.perf_counter()
                for listener in self._tick_listeners:
                    try:
                        listener(record, next_tick_at)
                    except Exception:
                        log.exception("tick listener failed")
                        self.counters.count_error("tick_listener")
                # Outside the tick's time, and still on the path of every frame it made: the engine process hands
                # each worker its outputs here.
                with self.counters.lock:
                    record.host_ms[HAND_OFF_HOST_PHASE] = (time.perf_counter() - started) * 1000.0
            self._collect_at = time.monotonic() + COLLECT_AFTER_TICK_S
            return
        if self._collect_at is not None and now >= self._collect_at:
            self._collect()
            return
        if scheduler.jobs:
            job = scheduler.job_to_run(now, realtime_live=bool(self.slots.live(offline=False)))
            if job is not None:
                scheduler.run_step(job)
                return
        if self._offline_step():
            return
        wait_s = scheduler.wait_s(now, offline_live=bool(self.slots.live(offline=True)))
        if self._collect_at is not None:
            wait_s = min(wait_s, self._collect_at - now)
        wait_s = self._warm_before_tick(now, wait_s)
        self._wake.wait(timeout=max(0.0, wait_s))
        self._wake.clear()

    def _warm_before_tick(self, now: float, wait_s: float) -> float:
        """With EngineConfig.warm_lead_ms, the wait cut to end that long before the tick's deadline and, in that
        lead, the tick's first host calls warmed once (Runner.warm_tick_calls); the wait left."""
        lead = self.config.warm_lead_ms / 1000.0
        until_tick = self.scheduler.deadline - now
        if lead <= 0.0 or until_tick <= 0.0:
            return wait_s
        if until_tick > lead:
            return min(wait_s, until_tick - lead)
        if self._warmed_for != self.scheduler.deadline:
            self._warmed_for = self.scheduler.deadline
            self.runner.warm_tick_calls()
        return wait_s

    def _collect(self) -> None:
        self._collect_at = None
        ms = _collect_garbage()
        if ms is not None:
            self.counters.record_collection(ms)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _audio_waiting(self, session: Session) -> bool:
        """Whether the session's source has a frame ready (False, and the session failed, if it raised)."""
        try:
            return session.source.frames_ready() > 0
        except Exception as exc:
            self._fail(session, SessionFailed(f"input failed: {exc}", "input"))
            return False

    def _read_input(self, session: Session) -> bool:
        """Put the session's next frame (or silence) into its host input row; False if the session failed."""
        copied = self._copy_input(session)
        if copied and not np.isfinite(self.runner.pcm_np[session.index]).all():
            return self._refuse_input(session)
        if copied:
            self.slots.count(FRAMES_IN, session)
        return copied is not None

    def _read_inputs(self, sessions: Sequence[Session], rows: np.ndarray, serials: np.ndarray
                     ) -> tuple[Sequence[Session], np.ndarray]:
        """_read_input for a tick's sessions (`sessions[k]` in `rows[k]`, of `serials[k]`), with one finiteness check
        over their rows instead of one per frame (250 checks of 1920 samples were ~0.4 ms of the tick's host time),
        the frames staged in their rows as they arrived only taken (staging.py); the sessions that did not fail, and
        their rows."""
        staged = self.inputs.take(rows)
        if staged.all():  # the engine process's usual tick: every frame came before it, its finiteness checked then
            self.slots.count_rows(FRAMES_IN, rows, serials)
            return sessions, rows
        self.slots.count_rows(FRAMES_IN, rows, serials, staged)
        read, copied = [], []
        for session, was_staged in zip(sessions, staged.tolist(), strict=True):
            if was_staged:
                read.append(session)
                continue
            frame = self._copy_input(session)
            if frame is not None:
                read.append(session)
                if frame:
                    copied.append(session)
        if copied:
            pcm = self.runner.pcm_np
            finite = np.isfinite(pcm[: max(s.index for s in copied) + 1]).all(axis=1).tolist()
            failed = {s.index for s in copied if not finite[s.index] and not self._refuse_input(s)}
            counted = [s for s in copied if s.index not in failed]
            self.slots.count_rows(FRAMES_IN, np.array([s.index for s in counted], dtype=np.int64),
                                  np.array([s.serial for s in counted], dtype=np.int64))
            read = [s for s in read if s.index not in failed]
        return read, np.array([s.index for s in read], dtype=np.int64)

    def _copy_input(self, session: Session) -> bool | None:
        """The session's next frame into its host input row (True; its finiteness not checked yet), or silence on
        an underrun (False); None if the session failed."""
        row = self.runner.pcm_np[session.index]
        try:
            frame = session.source.read_frame()
            if frame is None:
                row[:] = 0.0
                self.slots.count(UNDERRUNS, session)
                return False
            data = np.asarray(frame, dtype=np.float32)
            if data.shape != (FRAME_SAMPLES,):
                raise ValueError(f"the input frame must be {FRAME_SAMPLES} finite samples")
            row[:] = data
            return True
        except Exception as exc:
            self._fail(session, SessionFailed(f"input failed: {exc}", "input"))
            return None

    def _refuse_input(self, session: Session) -> bool:
        """A frame with non-finite samples fails its session; False."""
        self._fail(session, SessionFailed(f"input failed: the input frame must be {FRAME_SAMPLES} finite samples",
                                          "input"))
        return False

    def _first_halves_before_tick(self) -> float:
        """Run the first halves that the scheduler puts before this tick's batch; seconds spent."""
        started = time.perf_counter()
        due = self._first_halves_due()
        if not due:
            return 0.0
        chosen = self.scheduler.first_halves_before_tick(due, self._audio_waiting)
        for session in chosen:
            self._run_first_half(session)
        return time.perf_counter() - started if chosen else 0.0

    def _realtime_tick(self, started_late: bool) -> TickRecord | None:
        """One tick over the live realtime sessions; its record, or None when none was live."""
        runner = self.runner
        first_halves_s = self._first_halves_before_tick()
        # The tick's own one-row steps count in its time, and so does reading its inputs (a host phase of ~1 ms at
        # 250 sessions on a 2-core CPU that the tick's time and its "prepare" left out).
        t0 = time.perf_counter() - first_halves_s
        plan = self.slots.realtime()  # after the first halves: a session one of them failed is not in it
        pending = self._first_halves_due()  # the first halves this tick runs, in its batch
        if pending:  # the sessions that take a frame: the others
            due = {s.index for s in pending}
            takes = np.array([s.index not in due for s in plan.sessions], dtype=bool)
            ready: Sequence[Session] = [s for s in plan.sessions if s.index not in due]
            ready_rows, ready_serials = plan.rows[takes], plan.serials[takes]
        else:
            ready, ready_rows, ready_serials = plan.sessions, plan.rows, plan.serials
        pending_rows = np.array([s.index for s in pending], dtype=np.int64)
        self.inputs.hold()  # until the step's outputs, and so its upload of the input rows, have landed
        try:
            read, read_rows = self._read_inputs(ready, ready_rows, ready_serials)
            live = [*pending, *read]
            live_rows = np.concatenate((pending_rows, read_rows))
            inputs_read = time.perf_counter()
            if not live:
                with self.counters.lock:
                    self.counters.batch = 0
                return None
            n = bucket(int(max(read_rows.max(initial=-1), pending_rows.max(initial=-1))) + 1, self.max_sessions)
            runner.active_np[:n] = runner.takes_input_np[:n] = False
            runner.active_np[pending_rows] = True
            runner.active_np[read_rows] = runner.takes_input_np[read_rows] = True
            offline_rows = [s.index for s in self.slots.live(offline=True) if s.index < n]
            starved = set(runner.prepare_batch(n))
            if starved:  # no page, and no context left to shrink: those sessions end, the others step
                for session in live:
                    if session.index in starved:
                        self._fail(session, SessionFailed("no KV page is free and no context can shrink", "kv_pages"))
                live = [s for s in live if s.index not in starved]
                live_rows = np.array([s.index for s in live], dtype=np.int64)
            # The tick's frames come back in the order they go out (the plan's), those of rows it steps.
            gathered = plan.out.rows if plan.out.rows.max(initial=-1) < n else plan.out.rows[plan.out.rows < n]
            try:
                frames, emitted, audio, finite = self._run_batch(n, offline_rows, gathered)
            except Exception as exc:  # a failure of the whole step: every session in it fails, the engine goes on
                log.exception("tick failed")
                for session in live:
                    self._fail(session, SessionFailed(f"step failed: {exc}", "step"))
                return None
        finally:
            self.inputs.release()
        self._hand_out(live, live_rows, gathered, frames, emitted, audio, finite)
        # Their encoder ran on no input this tick: it meets the first frame fresh.
        for session in pending:
            runner.reset_mimi_row(session.index, decoder=False)
            self._set_first_half_pending(session, False)
        end = time.perf_counter()
        elapsed = (end - t0) * 1000.0
        marks = runner.step_marks
        host_ms = {"prepare": (marks.launched - t0 - first_halves_s) * 1000.0,
                   "deliver": (end - marks.returned) * 1000.0,
                   PREPARE_INPUTS_HOST_PHASE: (inputs_read - t0 - first_halves_s) * 1000.0,
                   PREPARE_LAUNCH_HOST_PHASE: (marks.launched - marks.entered) * 1000.0}
        for name, (a, b) in zip(PREPARE_LAUNCH_PARTS, itertools.pairwise(marks[:4]), strict=True):
            host_ms[name] = (b - a) * 1000.0
        if first_halves_s:
            host_ms[FIRST_HALF_HOST_PHASE] = first_halves_s * 1000.0
        return self.counters.record_tick(elapsed, n, started_late or elapsed > self.config.tick_ms, runner.parts_ms,
                                         host_ms)

    def _run_batch(self, n: int, protected_rows: list[int], out_rows: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The runner's step over rows [0, n) (`Runner.run_batch`), serving cached prompts' copies while it is in
        flight."""
        outputs = self.runner.run_batch(n, protected_rows, out_rows,
                                        lambda launched: self._serve_in_flight(n, launched))
        marks = self.runner.step_marks
        self.scheduler.record_in_flight(n, marks.returned - marks.launched)
        return outputs

    def _serve_in_flight(self, n: int, launched: float) -> None:
        """While the tick over rows [0, n) runs on the device, copy cached prompts into their slots.

        A copy is ~3 ms of host work (small launches) and a tick ~25 ms of device work, so an open that arrives
        during a tick need not wait for it. The copies queue on the tick's stream, behind its writes to the
        (inactive) row and behind its outputs, so they change nothing the tick computes; the scheduler places one
        only where it ends before the tick's outputs are expected, so delivery is not held up.
        """
        until = self.scheduler.in_flight_until(n, launched)
        if until is None:
            return
        active = self.runner.active_np
        stepped = lambda row: row < n and bool(active[row])
        while True:
            self._drain_commands()
            now = time.perf_counter()
            job = self.scheduler.in_flight_copy(now, until, stepped)
            if job is not None:
                self.scheduler.run_step(job)
                with self.counters.lock:
                    self.counters.copies_in_flight += 1
                continue
            if now >= until or self.runner.outputs_landed():
                return
            self._wake.wait(timeout=until - now)
            self._wake.clear()

    def _deliver(self, session: Session, frame: np.ndarray, emitted: bool, audio: np.ndarray, finite: bool) -> None:
        """Hand one session its frame (arrays it may keep). The lock makes close() wait for a callback in flight,
        so none follows it."""
        if not finite:
            self._fail(session, SessionFailed("the model produced non-finite audio", "non_finite_output"))
            return
        if not emitted:
            return
        with self._lock:
            if self.slots.holds(session) and session.live:
                text = self.model.text_piece(int(frame[0]))
                if session.output_group is None:
                    self._emit(session, FrameOutput(self._count_out(session), audio, text, frame))
                else:
                    rows = OutputRows([session.id], [self._count_out(session)], [text], frame[None], audio[None])
                    self._deliver_rows(session.output_group, rows, [session])

    def _hand_out(self, stepped: list[Session], stepped_rows: np.ndarray, gathered: np.ndarray, frames: np.ndarray,
                  emitted: np.ndarray, audio: np.ndarray, finite: np.ndarray) -> None:
        """A tick's frames to the sessions it stepped (in `stepped_rows`), the lock taken once. `frames` and `audio`
        are the rows `gathered` (the plan's output order at the tick's start, `OutputOrder`), blocks the tick owns;
        `emitted` and `finite` are by row. Counted and named by array operations over all of them, each output
        group's slice to its call, and one FrameOutput to the callback of each session of its own. (A pass over the
        sessions took ~0.25 ms more of a tick of 250 on a 2-core CPU; the same array operations per group ~0.3 ms
        more at 8 groups.)"""
        handed = np.zeros(len(self._out_index), dtype=bool)  # rows stepped whose frame goes out
        handed[stepped_rows] = True  # by an array: a list of 250 rows took ~60 us of a tick on a 2-core CPU
        handed[: len(emitted)] &= emitted & finite
        with self._lock:
            if not finite.all():
                for session in stepped:
                    if not finite[session.index]:
                        self._fail(session, SessionFailed("the model produced non-finite audio", "non_finite_output"))
            # The live sessions now: one that left, or went live while the step was in flight, is not handed a row.
            order = self.slots.realtime().out.handed(handed)
            rows, members, ids = order.rows, order.members, order.ids
            if not rows.size:
                return
            # The plan moved, or a row is not handed: each handed row from where it was gathered (every stepped row
            # was: rows do not change hands while a step is in flight).
            positions = order.positions_in(gathered)
            if positions is not None:
                frames, audio = frames[positions], audio[positions]
            indices = self._count_rows_out(rows, members)
            texts = self.model.text_pieces(frames[:, 0])
            bounds = order.starts.tolist()
            for k, key in enumerate(order.keys):
                start, stop = bounds[k], bounds[k + 1]
                if start < stop:
                    self._deliver_rows(key, OutputRows(ids[start:stop], indices[start:stop], texts[start:stop],
                                                       frames[start:stop], audio[start:stop]), members[start:stop])
            first = bounds[-1]  # the sessions of their own
            if first < len(members):
                own_frames, own_audio = frames[first:], audio[first:]
                if self.runner.pinned_outputs:
                    # Sessions of their own keep frames as long as they like: not in pinned blocks, kept pinned.
                    own_frames, own_audio = own_frames.copy(), own_audio.copy()
                for session, index, text, frame, samples in zip(members[first:], indices[first:], texts[first:],
                                                                own_frames, own_audio, strict=True):
                    self._emit(session, FrameOutput(index, samples, text, frame))

    def _deliver_rows(self, key: int, rows: OutputRows, members: Sequence[Session]) -> None:
        """An output group's rows to its call (engine thread, lock held); its sessions fail if it raises."""
        deliver = self._output_groups.get(key)
        try:
            if deliver is not None:
                deliver(rows)
        except Exception as exc:
            log.exception("output group failed")
            for session in members:
                self._fail(session, SessionFailed(f"output callback failed: {exc}", "output_callback"))

    def _count_out(self, session: Session) -> int:
        """The index of the session's next frame out, counted as out (engine thread, lock held)."""
        return self._count_rows_out(np.array([session.index]), (session,))[0]

    def _count_rows_out(self, rows: np.ndarray, sessions: tuple[Session, ...]) -> list[int]:
        """The indices of the next frames out of `sessions` (in `rows`), counted as out (engine thread, lock
        held)."""
        indices = self._out_index[rows]
        self._out_index[rows] += 1
        self.slots.frames_out[rows] += 1
        if not indices.all():
            now = time.monotonic()
            for session, index in zip(sessions, indices.tolist(), strict=True):
                if index == 0:
                    self.counters.record_first_frame(now - session.start_requested_at)
        return indices.tolist()

    def _emit(self, session: Session, out: FrameOutput) -> None:
        """The session's next frame, counted out already, to its callback (engine thread, lock held, session live)."""
        try:
            session.on_output(out)
        except Exception as exc:
            self._fail(session, SessionFailed(f"output callback failed: {exc}", "output_callback"))

    def _offline_step(self) -> bool:
        """Step one input-clocked session that has a frame ready (round robin). True if one ran."""
        ready = [s for s in self.slots.live(offline=True) if self._audio_waiting(s)]
        if not ready:
            return False
        session = self.scheduler.next_offline(ready)
        if not self._read_input(session):
            return True
        try:
            outputs: RowOutputs = self.runner.row_step(session.index)
        except Exception as exc:
            log.exception("offline step failed")
            self._fail(session, SessionFailed(f"step failed: {exc}", "step"))
            return True
        with self.counters.lock:
            self.counters.offline_frames += 1
        self._deliver(session, *outputs)
        return True

    def _window_changed(self, row: int, frames: int, shrunk: bool) -> None:
        """The page pool shrank (or grew back) the context window in `row` (engine thread): the session's whose
        pages they are, if it still holds the row (it may have closed as the step ran, its pages not yet returned,
        and another reserved the row)."""
        self.slots.window_changed(row, int(self._pages_of[row]), frames, shrunk)

    def _fail(self, session: Session, error: EngineError) -> None:
        with self._lock:
            if not self.slots.move(session, "failed"):
                return
            self._return_pages(session.index)
            self.counters.count_error(error.cause)
            callback = session.on_error
        if callback is not None:
            try:
                callback(error)
            except Exception:
                log.exception("on_error callback failed")
