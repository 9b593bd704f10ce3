"""The batched lockstep frame engine: one thread owns the device and advances every live conversation per tick.

Every 80 ms (wall clock) the tick takes one 1920-sample frame from each live realtime slot's source (silence, and
an underrun counted, when the source has none), runs one batched step — Mimi encode, temporal transformer,
depformer, Mimi decode — over the smallest padded batch that covers the live slots, and hands each slot its
audio and text piece. The model runs one call ahead of the reference's order (token for token the same), so the
frame a tick hands out is the one whose input it just took, not the one before: 80 ms less latency.
Input-clocked slots (offline files) are stepped on their own between ticks whenever a frame is ready. Admission,
prompt prefill, restarts and closes run on the same thread between ticks, so the step never races with
bookkeeping; the asyncio side only enqueues work and receives callbacks.

A session's start is a job of steps (its prompt planned, prefilled on a scratch row by replayed CUDA graphs
(model/prompt_prefill.py) or copied from the prompt cache), one per gap between ticks where the step's recent
duration fits; one that fits no gap runs at a gap's start, and none waits longer than JOB_MAX_WAIT_S. On CUDA a
cached prompt's copy also runs while a tick is in flight on the device, queued behind it on its stream, so a
cached open does not wait for a tick (_serve_in_flight). A realtime session's open returns with its prompt in
place; its first model half follows as a one-row step in a gap, or, when a tick comes first, right before that
tick's batch (its client's audio already waits) or in the batch (none does). An input-clocked session's is the
last step of its open.

The step itself lives in `model/batch_step.py` (CUDA graphs per padded batch size, and per row for one-row steps);
inputs and outputs move once per tick through pinned host memory.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import itertools
import logging
import queue
import secrets
import threading
import time
import uuid
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from model import fused
from model.batch_step import BatchBuffers, BatchStep, PartTimer, bucket, prefill_chunks
from model.config import FRAME_SAMPLES, SAMPLE_RATE
from model.lm import LMState
from model.loading import PersonaPlex
from model.prompt_prefill import PromptPrefill
from model.prompts import PromptPlan, VoicePrompt, finish_prompt, persona_text, persona_tokens, plan_prompt
from model.sampling import SamplingParams, row_sampling
from model.step import MAX_TOP_K_AUDIO, MAX_TOP_K_TEXT, StepConstants

log = logging.getLogger(__name__)

__all__ = [
    "Engine", "EngineConfig", "Slot", "SessionParams", "SamplingParams", "FrameOutput", "FrameSource", "EngineError",
    "ResourceExhausted", "InvalidSessionParams", "SessionFailed", "EngineStats", "SlotStats",
]

TICK_MS_BUCKETS = (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 100.0, 160.0)
# A session start's step that never fits between ticks (ticks longer than planned, a slow first run) runs anyway,
# at the start of a gap, once it has waited this long: at worst one late tick, never an open that waits forever.
JOB_MAX_WAIT_S = 0.5
# Sessions whose first model half may run as a one-row step right before a tick (see _start_leads).
LEADS_BEFORE_TICK = 2
# A session start's steps, and a first guess at each one's seconds until it has run: "plan" (voice and text to
# prompt embeddings), "prefill" (the whole prompt on the scratch row, model/prompt_prefill.py), "chunk" (one piece
# of a prompt too long for it, eager), "copy" (a cached prompt into the slot), "lead" (the first model half).
JOB_STEP_KINDS = {"plan": 0.05, "prefill": 0.02, "chunk": 0.03, "copy": 0.005, "lead": 0.03}


class EngineError(Exception):
    """An engine failure with a protocol error code."""

    code = "engine_error"

    def __init__(self, message: str, code: str | None = None, cause: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.cause = cause or self.code  # where it came from, for the error counts


class ResourceExhausted(EngineError):
    code = "resource_exhausted"


class InvalidSessionParams(EngineError):
    code = "invalid_session_config"


class SessionFailed(EngineError):
    """The engine failed one conversation; `cause` says where (input, step, non_finite_output, output_callback)."""

    code = "runtime_failed"

    def __init__(self, message: str, cause: str):
        super().__init__(message, cause=cause)


@dataclass(frozen=True)
class SessionParams:
    voice: str | None = None
    persona: str = ""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pacing: str = "realtime"


@dataclass(frozen=True)
class FrameOutput:
    index: int  # 0-based conversation frame index
    audio: np.ndarray  # float32 [1920] at 24 kHz
    text: str  # this frame's text piece ("" for PAD/EPAD)
    tokens: np.ndarray  # int64 [17]: text, 8 agent codes, 8 user codes


class FrameSource(Protocol):
    def read_frame(self) -> np.ndarray | None: ...

    def frames_ready(self) -> int: ...


@dataclass
class EngineConfig:
    max_sessions: int = 4
    tick_ms: float = 80.0
    cuda_graphs: bool = True
    prefill_chunk: int = 128
    prompt_cache_entries: int = 32
    fp8_kv: bool = False  # e4m3 KV cache: half the memory and bytes read per tick, not bit-exact with bf16
    fuse_kernels: bool = True  # on CUDA: torch.compile the elementwise helpers (model/fused.py)
    # On CUDA, a cached prompt's copy may run while a tick is in flight if it ends within this share of the tick's
    # recent shortest time from launch to outputs; above 1 it may hold up the tick's delivery (_serve_in_flight).
    in_flight_copy_share: float = 0.9


@dataclass
class SlotStats:
    frames_in: int = 0
    frames_out: int = 0
    underruns: int = 0
    state: str = "reserved"


@dataclass
class EngineStats:
    ticks: int
    late_ticks: int
    batch: int
    tick_ms: float
    tick_ms_p50: float
    tick_ms_p99: float
    parts_ms: dict[str, float]
    # The last tick's host work outside the device step: "prepare" (batch, input upload, graph launches),
    # "deliver" (from its outputs reaching the host to the last callback), and "leads" when the tick ran sessions'
    # first model halves before its batch (_start_leads).
    host_ms: dict[str, float]
    sessions_in_use: int
    max_sessions: int
    tick_ms_buckets: list[tuple[float, int]]
    tick_ms_sum: float
    errors: int  # conversations failed and loop passes that raised
    errors_by_cause: dict[str, int]  # input, step, non_finite_output, output_callback, engine_stopped, loop
    offline_frames: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    open_work_ms_last: float  # engine-thread time of the last session start (prompt prefill or cache copy)
    open_step_ms: dict[str, float]  # recent ms of one session-start step, by kind (JOB_STEP_KINDS), once one ran
    prompt_copies_in_flight: int  # cached prompts copied while a tick ran on the device (_serve_in_flight)


_collector_lock = threading.Lock()
_collector_owners = 0


def _collector_owned(running: bool) -> None:
    """While an engine runs, its thread starts the garbage collector (_collect_garbage), not allocation counts:
    an automatic collection falls inside a tick as often as not, and one of the older generations takes
    milliseconds over a loaded server."""
    global _collector_owners
    with _collector_lock:
        _collector_owners += 1 if running else -1
        if _collector_owners > 0:
            gc.disable()
        else:
            gc.enable()


def _collect_garbage() -> None:
    """What the automatic collector would do at this point, run right after a tick (the gap before the next is
    ~55 ms at 64 full sessions): the youngest generation once its allocation count passes the threshold, an older
    one when enough younger collections have passed."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if counts[0] < thresholds[0]:
        return
    generation = 0
    if counts[1] >= thresholds[1]:
        generation = 2 if counts[2] >= thresholds[2] else 1
    gc.collect(generation)


@dataclass
class TickRecord:
    """One realtime tick: its engine-thread ms, batch, lateness, device parts and host phases (EngineStats)."""

    ms: float
    batch: int
    late: bool
    parts_ms: dict[str, float]
    host_ms: dict[str, float]


def _row_to_host(frame: Tensor, emitted: Tensor, audio: Tensor) -> tuple[np.ndarray, bool, np.ndarray, bool]:
    """A one-row step's outputs on the host, copies of the step's buffers, as `_deliver` takes them."""
    samples = audio[0].float().to("cpu", copy=True).numpy()
    return frame[0].to("cpu", copy=True).numpy(), bool(emitted[0]), samples, bool(np.isfinite(samples).all())


@dataclass
class _Job:
    """Work run on the engine thread between ticks, one step at a time (a session's start)."""

    steps: Iterator[str]  # each step yields the kind of the next one
    done: Callable[[BaseException | None], None]
    next_kind: str
    row: int | None  # the slot it starts
    waiting_since: float = field(default_factory=time.monotonic)  # since its last step ran, or it was queued


@dataclass
class _Runtime:
    """Engine-side record of one slot's session."""

    index: int
    id: str
    stats: SlotStats = field(default_factory=SlotStats)
    params: SessionParams | None = None
    source: FrameSource | None = None
    on_output: Callable[[FrameOutput], None] | None = None
    on_error: Callable[[EngineError], None] | None = None
    seed: int = 0
    out_index: int = 0
    lead_pending: bool = False  # a realtime session's first model half is still to run, in or before its first tick

    @property
    def live(self) -> bool:
        return self.stats.state == "live"

    @property
    def offline(self) -> bool:
        return self.params is not None and self.params.pacing == "input"


@dataclass
class _CachedPrompt:
    """A prompt's effect on a fresh row: the KV slots it filled, its positions, ring and counter."""

    kv: list[Tensor]  # each KV tensor's [layers, heads, slots(, head_dim)] for the slots the prompt filled
    kpos: Tensor  # [slots]
    pos: int
    ring: Tensor
    offset: int
    forced: Tensor


class Slot:
    """The asyncio side's handle on one reserved slot."""

    def __init__(self, engine: Engine, runtime: _Runtime):
        self._engine = engine
        self._rt = runtime
        self.id = runtime.id
        self.index = runtime.index

    async def start(self, params: SessionParams, source: FrameSource, on_output: Callable[[FrameOutput], None],
                    on_error: Callable[[EngineError], None]) -> None:
        """Validate, run the voice + persona prompt between ticks, and go live."""
        engine = self._engine
        engine.validate(params)
        if self._rt.stats.state != "reserved":
            raise EngineError(f"slot {self.id} is {self._rt.stats.state}, not reserved", "invalid_state")
        self._rt.params, self._rt.source, self._rt.on_output, self._rt.on_error = params, source, on_output, on_error
        seed = params.sampling.seed
        self._rt.seed = seed if seed is not None else secrets.randbits(63)
        await engine.submit(lambda: engine.begin(self._rt), self.index)

    async def restart(self) -> None:
        """A fresh context with the same parameters; output indices restart at 0."""
        engine = self._engine
        if self._rt.params is None:
            raise EngineError("session not started", "invalid_state")
        await engine.submit(lambda: engine.begin(self._rt), self.index)

    def close(self) -> None:
        self._engine.release(self._rt)

    def stats(self) -> SlotStats:
        return SlotStats(**vars(self._rt.stats))


class Engine:
    """Slots, the tick thread, prompt prefill and its cache. See the module docstring."""

    def __init__(self, model: PersonaPlex, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        if self.config.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        B = self.config.max_sessions
        self.device = model.device
        if self.device.type == "cuda":
            # Mimi runs in fp32: TF32 puts its GEMMs on tensor cores, as cuDNN already does for its convolutions.
            torch.backends.cuda.matmul.allow_tf32 = True
        if self.config.fuse_kernels and self.device.type == "cuda":
            if fused.available():
                fused.enable()
            else:
                log.warning("Triton is not installed: running without fused kernels (slower ticks)")
        lm = model.lm
        self.lm_state = lm.init_state(B, self.device, fp8_kv=self.config.fp8_kv)
        self._prompt_prefill = PromptPrefill(lm, self.device, self.config.fp8_kv)
        model.text_piece(0)  # builds the token-text table now, not in the first tick
        self.mimi_state = model.mimi.init_state(B, self.device)
        self.const = StepConstants.make(lm, self.device)
        self.text_sampling, self.audio_sampling = row_sampling([SamplingParams(greedy=True)] * B, [0] * B, self.device)
        self.pcm_in = torch.zeros(B, FRAME_SAMPLES, device=self.device)
        self.active = torch.zeros(B, dtype=torch.bool, device=self.device)
        self.takes_input = torch.zeros(B, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        self._pcm_host = torch.zeros(B, FRAME_SAMPLES, pin_memory=pin)
        self._active_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._takes_input_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._frames_host = torch.zeros(B, lm.cfg.num_rows, dtype=torch.long, pin_memory=pin)
        self._emitted_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._audio_host = torch.zeros(B, FRAME_SAMPLES, pin_memory=pin)
        # numpy views of the pinned inputs: per-slot writes from numpy cost a fraction of torch's per-op overhead.
        self._pcm_np, self._active_np = self._pcm_host.numpy(), self._active_host.numpy()
        self._takes_input_np = self._takes_input_host.numpy()
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._steps: dict[int, BatchStep] = {}
        self._row_steps: dict[int, BatchStep] = {}
        self._slots: list[_Runtime | None] = [None] * B
        self._lock = threading.RLock()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._prompt_cache: OrderedDict[tuple, _CachedPrompt] = OrderedDict()
        self._voice_cache: OrderedDict[str, VoicePrompt | Tensor] = OrderedDict()
        self._timer = PartTimer(self.device)
        self._ticks_log: deque[TickRecord] = deque(maxlen=2000)
        self._parts_ms: dict[str, float] = {}
        self._step_marks = (0.0, 0.0)  # perf_counter when the last step was launched and when its outputs landed
        self._buckets = [0] * (len(TICK_MS_BUCKETS) + 1)
        self._ticks = self._late = self._offline_frames = 0
        self._errors: Counter[str] = Counter()  # by cause
        self._tick_ms_sum = 0.0
        self._open_ms = 0.0
        self._cache_hits = self._cache_misses = 0
        self._batch = 0
        self._offline_rr = 0
        self._jobs: deque[_Job] = deque()
        # Recent seconds per kind of job step, to run one only where it fits before the next tick. The median of
        # the last few: one slow run (a first use, a busy host) must not keep every later step waiting.
        self._job_step_s: dict[str, deque[float]] = {kind: deque(maxlen=5) for kind in JOB_STEP_KINDS}
        self._pending: set[Callable[[BaseException | None], None]] = set()
        # Per row, an upper bound on the KV slots written since its last reset, so that resetting a row needs no
        # read of its position from the device (which would wait for a tick in flight).
        self._kv_extent = np.zeros(B, dtype=np.int64)
        # Per padded batch size, recent seconds from a tick's launch to its outputs on the host: how long a cached
        # prompt's copy may be served while the tick is in flight (_serve_in_flight).
        self._in_flight_s: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=8))
        self._outputs_ready = torch.cuda.Event() if self.device.type == "cuda" else None
        self._copies_in_flight = 0

    # ----- public, any thread ------------------------------------------------------------------------------

    @property
    def max_sessions(self) -> int:
        return self.config.max_sessions

    @property
    def running(self) -> bool:
        """Whether the tick thread is up (for health checks)."""
        return self._thread is not None and self._thread.is_alive()

    def sessions_in_use(self) -> int:
        with self._lock:
            return sum(s is not None for s in self._slots)

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._graphs():
            # Each bucket's convolution shapes are fixed, so cuDNN may time its algorithms once, before capture.
            # Only here: eager convolutions of arbitrary length (a .wav voice) would time every new length.
            with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=True):
                for n in sorted({bucket(i, self.max_sessions) for i in range(1, self.max_sessions + 1)}):
                    self._device_step(n)
                # One row's step, graphed per row: a session's first model half, and input-clocked frames.
                # Eager, one row of the full model is ~80-100 ms of launches, more than a gap between ticks.
                for row in range(self.max_sessions):
                    self._row_step(row)
            self._prompt_prefill.capture(self.graph_pool)
        if fused.enabled():
            self._warm_prefill()
        self._warm_lead()
        # A full garbage collection walks every live object with the GIL held: ~100 ms over a loaded model and
        # server, which would stall a tick. What exists now lives while the engine runs, so take it out of the
        # collector's view (after collecting what is already garbage); later collections walk only what sessions
        # create. stop() hands it all back.
        gc.collect()
        gc.freeze()
        _collector_owned(True)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="engine-tick", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            _collector_owned(False)
            gc.unfreeze()
        # Work queued for the thread will never run: answer everyone who waits on it.
        stopped = EngineError("the engine stopped", "engine_stopped")
        for done in list(self._pending):
            done(stopped)
        self._jobs.clear()
        with self._lock:
            for rt in self._slots:
                if rt is not None and rt.live:
                    self._fail(rt, EngineError("the engine stopped", "engine_stopped"))

    def reserve(self) -> Slot:
        with self._lock:
            for i, rt in enumerate(self._slots):
                if rt is None:
                    runtime = _Runtime(index=i, id=f"slot-{uuid.uuid4().hex[:12]}")
                    self._slots[i] = runtime
                    return Slot(self, runtime)
        raise ResourceExhausted(f"duplex_session_capacity_exhausted: limit={self.max_sessions}")

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
        try:
            params.sampling.validate(MAX_TOP_K_TEXT, MAX_TOP_K_AUDIO)
        except ValueError as exc:
            raise InvalidSessionParams(str(exc)) from exc
        if params.pacing not in ("realtime", "input"):
            raise InvalidSessionParams(f"pacing must be 'realtime' or 'input', got {params.pacing!r}")
        if params.voice is not None:
            try:
                self.model.resolve_voice(params.voice)
            except ValueError as exc:
                raise InvalidSessionParams(str(exc), "invalid_voice") from exc

    async def submit(self, fn: Callable[[], Iterator[str] | None], row: int | None = None) -> None:
        """Run `fn` (work on slot `row`) on the engine thread between ticks; its exception is raised here.

        A generator function runs one step per gap between ticks, where the step fits before the next tick
        (prompt prefill in chunks), so long work does not make ticks late. It yields the kind of its next step
        (JOB_STEP_KINDS) before each one, the first time before doing any work: steps are scheduled by the
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
                self._jobs.append(_Job(steps, done, kind, row))

        if self._thread is None:
            raise EngineError("the engine is not running", "engine_stopped")
        self._pending.add(done)
        self._commands.put(run)
        self._wake.set()
        try:
            await future
        finally:
            self._pending.discard(done)

    def release(self, rt: _Runtime) -> None:
        with self._lock:
            if rt.stats.state not in ("closed",):
                rt.stats.state = "closed"
            if self._slots[rt.index] is rt:
                self._slots[rt.index] = None

    def stats(self) -> EngineStats:
        # Copied under the lock, summarised outside it: the tick thread takes the same lock to hand out frames.
        with self._lock:
            ms = [record.ms for record in self._ticks_log]
            last = self._ticks_log[-1] if self._ticks_log else None
            counts = list(self._buckets)
            steps = {kind: list(runs) for kind, runs in self._job_step_s.items() if runs}
            stats = EngineStats(
                ticks=self._ticks, late_ticks=self._late, batch=self._batch, tick_ms=last.ms if last else 0.0,
                tick_ms_p50=0.0, tick_ms_p99=0.0, parts_ms=dict(last.parts_ms) if last else {},
                host_ms=dict(last.host_ms) if last else {}, sessions_in_use=sum(s is not None for s in self._slots),
                max_sessions=self.max_sessions, tick_ms_buckets=[], tick_ms_sum=self._tick_ms_sum,
                errors=sum(self._errors.values()), errors_by_cause=dict(self._errors),
                offline_frames=self._offline_frames, prompt_cache_hits=self._cache_hits,
                prompt_cache_misses=self._cache_misses, open_work_ms_last=self._open_ms, open_step_ms={},
                prompt_copies_in_flight=self._copies_in_flight,
            )
        if ms:
            stats.tick_ms_p50, stats.tick_ms_p99 = (float(v) for v in np.percentile(ms, [50, 99]))
        stats.tick_ms_buckets = list(zip((*TICK_MS_BUCKETS, float("inf")), itertools.accumulate(counts)))
        stats.open_step_ms = {kind: 1000.0 * float(np.median(runs)) for kind, runs in steps.items()}
        return stats

    def recent_ticks(self, count: int) -> list[TickRecord]:
        """The last `count` realtime ticks (at most the last 2000), oldest first: for benchmarks, which read them
        once after a run instead of polling stats() every tick beside the tick thread."""
        with self._lock:
            records = list(self._ticks_log)
        return records[max(len(records) - count, 0) :]

    def step_timings(self, n: int, iterations: int) -> list[dict[str, float]]:
        """Run the batched step over rows [0, n) with every row active, before start(): per-part ms per run.

        For benchmarks and warm-up; it advances those rows' state like real ticks would.
        """
        if self._thread is not None:
            raise EngineError("step_timings runs only while the engine is stopped", "invalid_state")
        n = bucket(n, self.max_sessions)
        self._active_np[:n] = self._takes_input_np[:n] = True
        runs = []
        for _ in range(iterations):
            self._run_batch(n, [])
            runs.append(self._parts_ms)
        self._active_np[:n] = self._takes_input_np[:n] = False
        return runs

    def fill_context(self, rows: slice, frames: int) -> None:
        """Mark `frames` past frames as present in the KV of `rows` (their values left as they are).

        For benchmarks: attention then costs what a conversation of that length costs.
        """
        state, context = self.lm_state, self.model.config.context
        held = min(frames, context)
        positions = torch.arange(frames - held, frames, device=self.device)
        kpos = torch.full((context,), -1, dtype=torch.long, device=self.device)
        kpos[positions % context] = positions
        state.kpos[rows] = kpos
        state.pos[rows] = frames
        state.offset[rows] = frames + 1
        np.maximum(self._kv_extent[rows], held, out=self._kv_extent[rows])

    # ----- engine thread -----------------------------------------------------------------------------------

    def begin(self, rt: _Runtime) -> Iterator[str]:
        """A session's start, one step per gap between ticks: its prompt from the prompt cache ("copy"), or
        planned ("plan") and prefilled, whole on the scratch row ("prefill") or, when longer than it, one eager
        chunk per step on the row ("chunk"); then, for an input-clocked session, its first model half ("lead").

        Engine thread only; `_open_ms` gets the time spent working, not the ticks in between.
        """
        with self._lock:
            if self._slots[rt.index] is not rt or rt.stats.state in ("closed", "failed"):
                raise EngineError("the session was closed", "session_closed")
            rt.stats.state = "prefill"
        params, row = rt.params, rt.index
        key = (params.voice, persona_text(params.persona))
        yield "copy" if key in self._prompt_cache else "plan"
        work = 0.0
        segment = time.perf_counter()
        cached = self._prompt_cache.get(key)

        def spent(since: float) -> float:
            # A cached prompt's copy may run while a tick is in flight (_serve_in_flight): waiting for the device
            # would wait for the tick. Its time is then the host's, which is most of it (~130 small copies).
            return time.perf_counter() - since if cached is not None else self._sync_elapsed(since)

        def next_step(kind: str) -> Iterator[str]:
            nonlocal work, segment
            work += spent(segment)
            yield kind
            segment = time.perf_counter()
            if rt.stats.state != "prefill":
                raise EngineError("the session was closed", "session_closed")

        lm, state = self.model.lm, self.lm_state
        scratch = self._prompt_prefill
        with torch.no_grad():
            self._reset_lm_row(row)
            if cached is None:
                self._cache_misses += 1
                plan = self._plan(params)
                if scratch.fits(plan.embeddings.shape[0]):
                    yield from next_step("prefill")
                    scratch.run(plan.embeddings)
                    finish_prompt(lm, scratch.state, 0, plan)
                    self._copy_prompt(self._store_prompt(key, scratch.state, 0), row)
                else:  # longer than the scratch ring: eagerly on the row, one chunk per step
                    for chunk in prefill_chunks(plan.embeddings, self.config.prefill_chunk):
                        yield from next_step("chunk")
                        lm.prefill(chunk, state, row)
                        self._kv_extent[row] += chunk.shape[0]
                    finish_prompt(lm, state, row, plan)
                    self._store_prompt(key, state, row)
            else:
                self._cache_hits += 1
                self._prompt_cache.move_to_end(key)
                self._copy_prompt(cached, row)
        sampling = params.sampling
        self.text_sampling.set_row(row, sampling.greedy, sampling.temp_text, sampling.topk_text, rt.seed)
        self.audio_sampling.set_row(row, sampling.greedy, sampling.temp_audio, sampling.topk_audio, rt.seed)
        # Ticks between the prompt's steps ran Mimi over this (inactive) row: it starts fresh only now.
        self._reset_mimi_row(row)
        # The first model half needs no input (model/step.py); from then on every step completes the frame whose
        # input it just received, instead of the one before. A realtime session's runs at its first tick
        # (_start_leads), so the open returns once the prompt is in place; an input-clocked session's runs now.
        first = None
        if rt.offline:
            yield from next_step("lead")
            first = self._first_half(row)
        self._open_ms = (work + spent(segment)) * 1000.0
        with self._lock:
            if rt.stats.state == "prefill":
                rt.out_index = 0
                rt.lead_pending = not rt.offline
                rt.stats.state = "live"
        if first is not None:
            self._deliver(rt, *first)
        if rt.lead_pending:  # in a gap before the first tick if one fits: then the tick neither waits nor skips input
            lead = self._early_lead(rt)
            self._jobs.append(_Job(lead, lambda exc: None, next(lead), row))  # a job stands before its first step

    def _early_lead(self, rt: _Runtime) -> Generator[str, None, bool]:
        """A job of one step: the session's first model half, unless its first tick ran it already (or the session
        ended): then it returns False, and the no-op is not taken for a lead's duration."""
        yield "lead"
        if not (rt.lead_pending and rt.live):
            return False
        self._lead(rt)
        return True

    def _warm_prefill(self) -> None:
        """Compile the fused helpers for the shapes of a session's start now, not in the first open (seconds, seen
        as 2.1 s of engine work in the first cold open on the H200): prefill chunks, and a .wav voice's one-shot
        Mimi encode (two lengths, so the compiled code is the one for any length)."""
        lm = self.model.lm
        with torch.no_grad():
            for frames in (self.config.prefill_chunk, 2):
                x = torch.zeros(frames, lm.cfg.dim, device=self.device, dtype=lm.text_linear.weight.dtype)
                lm.prefill(x, self.lm_state, 0)
            lm.reset_row(self.lm_state, 0)
        noise = 0.05 * np.random.default_rng(0).standard_normal(2 * SAMPLE_RATE).astype(np.float32)
        for seconds in (1.0, 1.5):
            self.model.encode_wav_voice(noise[: int(seconds * SAMPLE_RATE)], SAMPLE_RATE)

    def _warm_lead(self) -> None:
        """Pay a first model half's first-use costs now, not in the first open, and time one for the schedule."""
        for _ in range(2):
            started = time.perf_counter()
            self._first_half(0)
            elapsed = time.perf_counter() - started  # the second run's is kept: the first pays first-use costs
            self.active[0] = False
            self._reset_lm_row(0)
            self._reset_mimi_row(0)
        self._job_step_s["lead"].append(elapsed)

    def _first_half(self, row: int) -> tuple[np.ndarray, bool, np.ndarray, bool]:
        """A session's first model half (and its decode) as a one-row step; its outputs on the host."""
        self.active[row] = True
        self._kv_extent[row] += 1
        return _row_to_host(*self._row_step(row).lead())

    def _reset_lm_row(self, row: int) -> None:
        self.model.lm.reset_row(self.lm_state, row, used=int(self._kv_extent[row]))
        self._kv_extent[row] = 0

    def _reset_mimi_row(self, row: int, decoder: bool = True) -> None:
        state = self.mimi_state.rows(slice(row, row + 1))
        fresh = torch.ones(1, dtype=torch.bool, device=self.device)
        state.encoder.reset_rows(fresh)
        if decoder:
            state.decoder.reset_rows(fresh)

    def _sync_elapsed(self, since: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - since

    def _copy_prompt(self, cached: _CachedPrompt, row: int) -> None:
        state = self.lm_state
        filled = cached.kpos.shape[0]
        for tensor, saved in zip(state.kv.tensors(), cached.kv):
            tensor[:, row, :, :filled] = saved
        state.kpos[row, :filled] = cached.kpos
        # fill_, not `x[row] = int`: that copies a host scalar, which waits for the stream (a tick in flight).
        state.pos[row].fill_(cached.pos)
        state.ring[row] = cached.ring
        state.offset[row].fill_(cached.offset)
        state.forced[row] = cached.forced
        self._kv_extent[row] = max(int(self._kv_extent[row]), filled)

    def _plan(self, params: SessionParams) -> PromptPlan:
        voice = None
        if params.voice is not None:
            voice = self._voice_cache.get(params.voice)
            if voice is None:
                try:
                    voice = self.model.load_voice(params.voice)
                except ValueError as exc:  # a file that resolves but does not load (unreadable, too short)
                    raise InvalidSessionParams(str(exc), "invalid_voice") from exc
                self._voice_cache[params.voice] = voice
                while len(self._voice_cache) > 64:
                    self._voice_cache.popitem(last=False)
        return plan_prompt(self.model.lm, voice, persona_tokens(self.model.tokenizer, params.persona))

    def _store_prompt(self, key: tuple, state: LMState, row: int) -> _CachedPrompt:
        """Cache the prompt that `row` of `state` holds (a fresh row after its prefill)."""
        filled = int(min(int(state.pos[row]), self.model.config.context))
        entry = _CachedPrompt(
            kv=[t[:, row, :, :filled].clone() for t in state.kv.tensors()],
            kpos=state.kpos[row, :filled].clone(), pos=int(state.pos[row]), ring=state.ring[row].clone(),
            offset=int(state.offset[row]), forced=state.forced[row].clone(),
        )
        self._prompt_cache[key] = entry
        while len(self._prompt_cache) > self.config.prompt_cache_entries:
            self._prompt_cache.popitem(last=False)
        return entry

    def _device_step(self, n: int) -> BatchStep:
        step = self._steps.get(n)
        if step is None:
            pool = self.graph_pool if self._graphs() else None
            step = self._steps[n] = BatchStep(self.model, self._buffers(), self.const, slice(0, n), graph_pool=pool)
        return step

    def _graphs(self) -> bool:
        return self.device.type == "cuda" and self.config.cuda_graphs

    def _row_step(self, row: int) -> BatchStep:
        """The step over one row: a session's first model half, and input-clocked sessions between ticks."""
        step = self._row_steps.get(row)
        if step is None:
            pool = self.graph_pool if self._graphs() else None
            # Every row's step has the shapes of the first's: one warm-up run is enough after it.
            step = self._row_steps[row] = BatchStep(self.model, self._buffers(), self.const, slice(row, row + 1),
                                                    graph_pool=pool, warmups=1 if self._row_steps else 2)
        return step

    def _buffers(self) -> BatchBuffers:
        return BatchBuffers(self.lm_state, self.mimi_state, self.text_sampling, self.audio_sampling, self.pcm_in,
                            self.active, self.takes_input)

    def _loop(self) -> None:
        tick_s = self.config.tick_ms / 1000.0
        deadline = time.monotonic() + tick_s
        while self._running:
            try:
                deadline = self._iterate(deadline, tick_s)
            except Exception:  # a bug must not stop every conversation: log it, count it, keep ticking
                log.exception("engine loop error")
                with self._lock:
                    self._errors["loop"] += 1
                time.sleep(0.001)

    def _iterate(self, deadline: float, tick_s: float) -> float:
        """One pass of the loop: commands, then the tick when due, else prefill work, offline frames or a wait."""
        self._drain_commands()
        now = time.monotonic()
        if now >= deadline:
            self._realtime_tick(started_late=now - deadline > tick_s / 2)
            _collect_garbage()
            deadline += tick_s
            if time.monotonic() > deadline:  # never burst to catch up: re-anchor on the clock
                deadline = time.monotonic() + tick_s
            return deadline
        if self._jobs and self._job_step(deadline - now):
            return deadline
        if self._offline_step():
            return deadline
        self._wake.wait(timeout=min(deadline - now, 0.002 if self._has_offline() else 1.0))
        self._wake.clear()
        return deadline

    def _job_step(self, time_left: float) -> bool:
        """One step of a session start, if one fits in `time_left` or may not wait longer. True if one ran.

        A step that waited JOB_MAX_WAIT_S runs at the next gap's start. Otherwise the oldest job whose next step
        fits runs, so a short step (a cached prompt's copy) does not queue behind a long one; a step longer than
        any gap between ticks (a prompt chunk of the full model, beside many sessions) runs at the start of a gap,
        where it makes the next tick the least late. With no realtime session live, every step runs at once.
        """
        if not self._live(offline=False):
            return self._run_job_step(self._jobs[0])
        gap = self.config.tick_ms / 1000.0 - (self._ticks_log[-1].ms / 1000.0 if self._ticks_log else 0.0)
        gap_start = time_left >= gap - 0.005  # where a step that does not fit makes the next tick the least late
        now = time.monotonic()
        overdue = [job for job in self._jobs if now - job.waiting_since >= JOB_MAX_WAIT_S]
        if overdue and gap_start:
            return self._run_job_step(overdue[0])
        needed = [1.5 * self._job_step_estimate(job.next_kind) + 0.002 for job in self._jobs]
        for job, seconds in zip(self._jobs, needed):
            if time_left >= seconds:
                return self._run_job_step(job)
        if gap_start:  # the oldest step that no gap would fit
            for job, seconds in zip(self._jobs, needed):
                if seconds > gap:
                    return self._run_job_step(job)
        return False

    def _run_job_step(self, job: _Job) -> bool:
        kind = job.next_kind
        started = time.perf_counter()
        worked = True
        try:
            job.next_kind = next(job.steps)
        except StopIteration as stop:  # a last step that found nothing to do returns False
            worked = stop.value is not False
            self._jobs.remove(job)
            job.done(None)
        except BaseException as exc:  # handed to the awaiting coroutine
            self._jobs.remove(job)
            job.done(exc)
        if worked:
            with self._lock:  # stats() reads these from other threads
                self._job_step_s[kind].append(time.perf_counter() - started)
        job.waiting_since = time.monotonic()
        return True

    def _job_step_estimate(self, kind: str) -> float:
        runs = self._job_step_s[kind]
        return float(np.median(runs)) if runs else JOB_STEP_KINDS[kind]

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _live(self, offline: bool) -> list[_Runtime]:
        with self._lock:
            return [rt for rt in self._slots if rt is not None and rt.live and rt.offline == offline]

    def _has_offline(self) -> bool:
        return bool(self._live(offline=True))

    def _read_input(self, rt: _Runtime) -> bool:
        """Put the slot's next frame (or silence) into the host input row; False if the slot failed."""
        row = self._pcm_np[rt.index]
        try:
            frame = rt.source.read_frame()
            if frame is None:
                row[:] = 0.0
                rt.stats.underruns += 1
                return True
            data = np.asarray(frame, dtype=np.float32)
            if data.shape != (FRAME_SAMPLES,) or not np.isfinite(data).all():
                raise ValueError(f"the input frame must be {FRAME_SAMPLES} finite samples")
            row[:] = data
            rt.stats.frames_in += 1
            return True
        except Exception as exc:
            self._fail(rt, SessionFailed(f"input failed: {exc}", "input"))
            return False

    def _start_leads(self, realtime: list[_Runtime]) -> float:
        """First model halves that no gap ran (_early_lead): those of sessions whose client audio already waits run
        as one-row steps before the batch, so that this tick takes their first frame (at most LEADS_BEFORE_TICK,
        ~8 ms each on the H200: the tick starts that much later). Other pending ones run in the batch, which then
        takes no input from them: free, and no later for a client whose first frame has not arrived. Seconds
        spent."""
        started = time.perf_counter()
        waiting = []
        for rt in realtime:
            if len(waiting) == LEADS_BEFORE_TICK:
                break
            if not rt.lead_pending:
                continue
            try:
                if rt.source.frames_ready() > 0:
                    waiting.append(rt)
            except Exception as exc:
                self._fail(rt, SessionFailed(f"input failed: {exc}", "input"))
        for rt in waiting:
            self._lead(rt)
        return time.perf_counter() - started if waiting else 0.0

    def _lead(self, rt: _Runtime) -> None:
        """A realtime session's first model half as a one-row step; its frame goes out at once."""
        try:
            first = self._first_half(rt.index)
        except Exception as exc:
            log.exception("first model half failed")
            self._fail(rt, SessionFailed(f"step failed: {exc}", "step"))
            return
        rt.lead_pending = False
        self._deliver(rt, *first)

    def _realtime_tick(self, started_late: bool) -> None:
        realtime = self._live(offline=False)
        lead_s = self._start_leads(realtime)
        live = [rt for rt in realtime if rt.live and (rt.lead_pending or self._read_input(rt))]
        if not live:
            self._batch = 0
            return
        t0 = time.perf_counter() - lead_s  # the tick's own one-row steps count in its time
        n = bucket(max(rt.index for rt in live) + 1, self.max_sessions)
        leads = [rt for rt in live if rt.lead_pending]
        self._active_np[:n] = self._takes_input_np[:n] = False
        self._active_np[[rt.index for rt in live]] = True
        self._takes_input_np[[rt.index for rt in live if not rt.lead_pending]] = True
        offline_rows = [rt.index for rt in self._live(offline=True) if rt.index < n]
        try:
            outputs = self._run_batch(n, offline_rows)
            self._kv_extent[:n] += self._active_np[:n]  # the rows that stepped wrote one slot each
        except Exception as exc:  # a failure of the whole step: every session in it fails, the engine goes on
            log.exception("tick failed")
            for rt in live:
                self._fail(rt, SessionFailed(f"step failed: {exc}", "step"))
            return
        frames, emitted, audio = outputs
        # One copy of the tick's outputs (the pinned buffers are the next tick's), handed out as row views; the
        # per-row flags as Python lists, and the lock taken once for the tick rather than once per session.
        frames, audio = frames.copy(), audio.copy()
        finite, emitted_rows = np.isfinite(audio).all(axis=1).tolist(), emitted.tolist()
        with self._lock:
            for rt in live:
                i = rt.index
                self._deliver(rt, frames[i], emitted_rows[i], audio[i], finite[i])
        for rt in leads:  # their encoder ran on no input this tick: it meets the first frame fresh
            self._reset_mimi_row(rt.index, decoder=False)
            rt.lead_pending = False
        end = time.perf_counter()
        elapsed = (end - t0) * 1000.0
        launched, returned = self._step_marks
        host_ms = {"prepare": (launched - t0 - lead_s) * 1000.0, "deliver": (end - returned) * 1000.0}
        if lead_s:
            host_ms["leads"] = lead_s * 1000.0
        self._record_tick(elapsed, n, started_late or elapsed > self.config.tick_ms, host_ms)

    def _run_batch(self, n: int, protected_rows: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step over rows [0, n); `protected_rows` (input-clocked sessions) keep their Mimi state."""
        step = self._device_step(n)
        saved = [(r, self.mimi_state.encoder.rows(slice(r, r + 1)).clone(),
                  self.mimi_state.decoder.rows(slice(r, r + 1)).clone()) for r in protected_rows]
        self.pcm_in[:n].copy_(self._pcm_host[:n], non_blocking=True)
        self.active[:n].copy_(self._active_host[:n], non_blocking=True)
        self.takes_input[:n].copy_(self._takes_input_host[:n], non_blocking=True)
        self._timer.start()
        frame, emitted, audio = step.run(self._timer)
        for r, enc, dec in saved:
            self.mimi_state.encoder.rows(slice(r, r + 1)).copy_(enc)
            self.mimi_state.decoder.rows(slice(r, r + 1)).copy_(dec)
        # Outputs come back in one transfer wait per tick, through pinned buffers.
        self._frames_host[:n].copy_(frame, non_blocking=True)
        self._emitted_host[:n].copy_(emitted, non_blocking=True)
        self._audio_host[:n].copy_(audio, non_blocking=True)
        launched = time.perf_counter()
        if self._outputs_ready is not None:
            self._outputs_ready.record()
            self._serve_in_flight(n, launched)
            self._outputs_ready.synchronize()  # not the stream: copies served in flight queue behind the outputs
        returned = time.perf_counter()
        self._parts_ms = self._timer.parts_ms()
        self._step_marks = (launched, returned)
        self._in_flight_s[n].append(returned - launched)
        return self._frames_host[:n].numpy(), self._emitted_host[:n].numpy(), self._audio_host[:n].numpy()

    def _serve_in_flight(self, n: int, launched: float) -> None:
        """While the tick over rows [0, n) runs on the device, copy cached prompts into their slots.

        A copy is ~3 ms of host work (small launches) and a tick ~25 ms of device work, so an open that arrives
        during a tick need not wait for it. The copies queue on the tick's stream, behind its writes to the
        (inactive) row and behind its outputs, so they change nothing the tick computes; a copy runs only where
        its recent duration ends before the tick's outputs are expected (within `in_flight_copy_share` of the
        shortest recent launch-to-outputs time of this batch size), so delivery is not held up.
        """
        recent = self._in_flight_s.get(n)
        if not recent:
            return
        until = launched + self.config.in_flight_copy_share * min(recent)
        while True:
            self._drain_commands()
            now = time.perf_counter()
            # Not a row the tick steps (a live session's restart): its frame is yet to be delivered.
            job = next((job for job in self._jobs
                        if job.next_kind == "copy" and job.row is not None
                        and (job.row >= n or not self._active_np[job.row])), None)
            if job is not None and now + 1.5 * self._job_step_estimate("copy") <= until:
                self._run_job_step(job)
                self._copies_in_flight += 1
                continue
            if now >= until or self._outputs_ready.query():
                return
            self._wake.wait(timeout=until - now)
            self._wake.clear()

    def _deliver(self, rt: _Runtime, frame: np.ndarray, emitted: bool, audio: np.ndarray, finite: bool) -> None:
        """Hand one slot its frame (arrays it may keep). The lock makes close() wait for a callback in flight, so
        none follows it."""
        if not finite:
            self._fail(rt, SessionFailed("the model produced non-finite audio", "non_finite_output"))
            return
        if not emitted:
            return
        with self._lock:
            if self._slots[rt.index] is not rt or not rt.live:
                return
            out = FrameOutput(index=rt.out_index, audio=audio, text=self.model.text_piece(int(frame[0])),
                              tokens=frame)
            rt.out_index += 1
            rt.stats.frames_out += 1
            try:
                rt.on_output(out)
            except Exception as exc:
                self._fail(rt, SessionFailed(f"output callback failed: {exc}", "output_callback"))

    def _offline_step(self) -> bool:
        """Step one input-clocked session that has a frame ready (round robin). True if one ran."""
        ready = []
        for rt in self._live(offline=True):
            try:
                if rt.source.frames_ready() > 0:
                    ready.append(rt)
            except Exception as exc:
                self._fail(rt, SessionFailed(f"input failed: {exc}", "input"))
        if not ready:
            return False
        rt = ready[self._offline_rr % len(ready)]
        self._offline_rr += 1
        if not self._read_input(rt):
            return True
        r = rt.index
        try:
            # The row's active flag and input go straight into the device buffers; the next realtime tick
            # rewrites both for its own rows.
            self.pcm_in[r].copy_(self._pcm_host[r])
            self.active[r] = self.takes_input[r] = True
            self._kv_extent[r] += 1
            outputs = _row_to_host(*self._row_step(r).run(PartTimer(self.device)))
        except Exception as exc:
            log.exception("offline step failed")
            self._fail(rt, SessionFailed(f"step failed: {exc}", "step"))
            return True
        self._offline_frames += 1
        self._deliver(rt, *outputs)
        return True

    def _record_tick(self, ms: float, n: int, late: bool, host_ms: dict[str, float]) -> None:
        with self._lock:
            self._ticks += 1
            self._late += int(late)
            self._batch = n
            self._ticks_log.append(TickRecord(ms, n, late, self._parts_ms, host_ms))
            self._tick_ms_sum += ms
            self._buckets[bisect.bisect_left(TICK_MS_BUCKETS, ms)] += 1

    def _fail(self, rt: _Runtime, error: EngineError) -> None:
        with self._lock:
            if rt.stats.state in ("closed", "failed"):
                return
            rt.stats.state = "failed"
            self._errors[error.cause] += 1
            if self._slots[rt.index] is rt:
                self._slots[rt.index] = None
            callback = rt.on_error
        if callback is not None:
            try:
                callback(error)
            except Exception:
                log.exception("on_error callback failed")

