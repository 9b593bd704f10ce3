"""What the engine's users see: session parameters, frame outputs, errors, the config and the stats records.

No torch here: processes that never touch the model (the network workers) import these to speak to an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from model.sampling_params import SamplingParams

__all__ = [
    "SessionParams", "SamplingParams", "FrameOutput", "OutputRows", "FrameSource", "EngineError", "ResourceExhausted",
    "InvalidSessionParams", "SessionFailed", "KVCacheTooSmall", "EngineConfig", "EngineStats", "SlotStats",
    "TickRecord",
]


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


class KVCacheTooSmall(ValueError):
    """The KV cache an engine may take holds no session's full context: what it holds and needs, in one line."""


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


@dataclass
class OutputRows:
    """A tick's frames for the sessions of one output group (`Engine.add_output_group`) in one call, or one
    session's frame between ticks as one row: session `ids[k]`'s frame `indices[k]`, with text piece `texts[k]`, is
    row k of `frames` [len(ids), 17] and `audio` [len(ids), 1920], blocks the group may keep."""

    ids: list[str]
    indices: list[int]
    texts: list[str]
    frames: np.ndarray
    audio: np.ndarray


class FrameSource(Protocol):
    def read_frame(self) -> np.ndarray | None: ...

    def frames_ready(self) -> int: ...


# By default, an engine whose last tick is older than this is not running, whatever its thread or process says (a
# tick stuck in a step, a source that blocks): health checks report it down (EngineConfig.stalled_after_s).
ENGINE_STALLED_S = 2.0
# How long before each tick the engine thread wakes to warm the tick's first host calls (EngineConfig.warm_lead_ms).
WARM_LEAD_MS = 0.5


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
    # recent shortest time from launch to outputs; above 1 it may hold up the tick's delivery (scheduler.py).
    in_flight_copy_share: float = 0.9
    # A realtime session whose client audio already waits when its first tick comes runs its first half as a
    # one-row step right before that tick, so the tick takes its first frame; in the batch instead (free) its input
    # starts one frame later, an 80 ms backlog its jitter buffer keeps until the client's next silence. Each one
    # before a tick makes that tick ~8 ms longer on the H200, so only as many run as keep the tick (its recent
    # duration plus theirs) within this share of the tick period; in a burst of opens at full load that is none.
    first_half_tick_budget: float = 0.5
    stalled_after_s: float = ENGINE_STALLED_S  # this long without a tick and health checks report the engine down
    # The temporal transformer's KV in pages (model/engine/pages.py). Frames per page: the largest divisor of the
    # context not above this. 75 (6 s) divides the 7B's 3000 and holds a whole block of the decode kernel's keys
    # (64 in bf16); every size from 75 to 250 read as fast (bench/attention_kernel.py --pages), and smaller pages
    # waste less of a session's last page (37 frames on average, 2 % of the mean call's context).
    kv_page_frames: int = 75
    # Pages in the pool; None: as many as the free device memory holds beside `kv_free_gib` (CUDA), or every
    # session's full window (CPU).
    kv_pages: int | None = None
    # Device memory left free when the pool is sized from it, for the captured graphs and a session start's eager
    # steps. On the H200 (7B, fp8, 290 sessions) the graphs and workspaces take 4.3 GiB and 0.8 GB stays free
    # through a call mix and the worst case; cuDNN's algorithm search before the capture takes what is free and
    # needs none of it.
    kv_free_gib: float = 5.0
    # The pool at most this many GiB (a GPU shared with another service; a test's small pool); None: as above.
    kv_cache_gib: float | None = None
    # Admission by memory: a session is admitted while the free pages cover this many seconds of growth for it and
    # for every session still growing, and no session's window is shrunk.
    kv_reserve_s: float = 5.0
    # Under pressure a session's window shrinks, oldest frames first, to no less than this many frames.
    kv_floor_frames: int = 750
    # On CUDA, Mimi's streaming encoder or decoder in bf16 instead of float32 (TF32 products); the quantizer stays
    # float32. The encoder's codes feed the model, so bf16 there changes tokens (every row diverged from frame 1 at
    # full size); the decoder only makes the audio, so its tokens stay the float32 path's, and its audio is 37.7 dB
    # from float32's, about a mu-law line's own noise (docs/fidelity.md). CPU runs stay float32.
    mimi_encoder_bf16: bool = False
    mimi_decoder_bf16: bool = True
    # On CUDA, Mimi's SEANet steps where its activations are largest as one Triton kernel each: the residual units
    # of 32-128 channels, the encoder's first two downsampling convolutions, the decoder's last two upsampling ones,
    # and the convolutions from and to audio (`Mimi.with_fused_seanet`, model/seanet_kernels.py). Not bit-exact
    # (other sum orders, fewer roundings). The encoder's codes feed the model, so its kernels move tokens (1-2 % of
    # its codes at 250 rows: a flag). The decoder's only move the audio, 43.4 dB from the torch path's (closer than
    # bf16 is to float32), for 0.74 ms less a tick at 250 rows on the H200 and the same at one (docs/benchmarks.md).
    mimi_fused_encoder: bool = False
    mimi_fused_decoder: bool = True
    # The temporal transformer's products with e4m3 weights (a scale per output channel) and inputs quantized per
    # row (`LM.with_fp8_weights`): half the bytes of the weights a tick reads, at the fp8 tensor-core rate (CUDA
    # compute capability 8.9+; on the CPU it runs, slowly, for tests). Greedy tokens move (docs/fidelity.md), and
    # on the H200 torch._scaled_mm's per-row kernel reads a product of few rows at half bf16's bandwidth: a tick
    # gains 0.6-1.3 ms at 250 rows and loses 0.2-1.0 ms at 1 and 160 (docs/benchmarks.md). A bench flag, to
    # measure a skinny-product kernel with. The fp8 copy is kept beside the model's own weights (6.7 GB more for
    # the 7B), which the page pool then leaves out.
    fp8_weights: bool = False
    # On CUDA, each audio codebook's draw as one Triton kernel (`model.sampling.draw_triton`): no sort of the 2048
    # logits a row, one launch instead of five; a draw 38.9 -> 9.5 us at one row, 68.9 -> 20.9 at 250, the depformer
    # 0.26 ms shorter a tick at one row and 0.46 at 250 (H100, docs/benchmarks.md). The same tokens as torch's path:
    # equal logits at a row's top_k boundary are taken lowest index first, as CUDA's topk turned out to take them
    # (bf16-valued logits tied everywhere: every token equal; 38,336 sampled frames of the 7B shape: all equal).
    # Off runs torch's path (the CPU always does: the kernel needs CUDA).
    fused_draw: bool = True
    # A lone row's depformer products as Triton GEMVs with the residual adds, RMS norms and SiLU gates fused in
    # (model/depformer_kernels.py; FUSED_ROWS_MAX): five launches a layer instead of eight; the one-session tick
    # 0.41-0.45 ms shorter in two runs (H100, H200), not in a third (docs/benchmarks.md: to settle). Other sum orders
    # than cuBLAS's, so tokens move (2.8 % of frames equal at one row): a flag (docs/fidelity.md). CUDA only.
    fused_depformer: bool = False
    # On CUDA sm_90 on, every Triton kernel of the engine (ours and Inductor's compiled helpers) launched as a
    # programmatic dependent of the kernel before it (model/launch.py): its programs start while that kernel
    # finishes and wait for it before touching memory. The same arithmetic in the same order: the same tokens.
    # Process-wide, like the compiled helpers: an engine's start sets it for all. Off: measured on an H100, the
    # one-row temporal step 0.17 ms faster, every part at 8 and 250 rows 0.1-0.5 ms slower (docs/benchmarks.md).
    pdl_launches: bool = False
    # On the CPU (the tiny model in tests, a laptop), the threads torch gives the engine's operations; None: half
    # the cores this process may use, at least one. A tick there is hundreds of tiny operations: on every core, each
    # one waits on a hand-off between threads, and they fight the server's own loops for the cores (a 2-core
    # machine: 4 tiny sessions tick in 45 ms on one thread, 96 on two; bench.engine_bench --tiny).
    cpu_threads: int | None = None
    # An engine process writes each realtime session's input frame into its input row as it arrives between ticks
    # (model/engine/staging.py), so the tick only takes it; off, every frame queues and the tick copies it. Read at
    # every offer: a bench compares the two on one engine (bench.engine_bench --compare-staging).
    stage_inputs: bool = True
    # How long before each tick's deadline the engine thread wakes to make the tick's first host calls once on a
    # sample of their own (Runner.warm_tick_calls), 0: not. A thread that slept most of a period finds their code
    # cold: on the 2-core CI machine a copy took 91 us after 50 ms asleep and 1.6 us at once. On an H100's host a
    # 0.5 ms lead took 0.15-0.26 ms off the tick's host share at 1 and 250 rows, in process and over the channel;
    # 0.25 ms was sometimes too short to wake in time, 1-2 ms took no more (docs/benchmarks.md; bench.engine_bench
    # --warm-lead-ms 0 0.5). The server's --engine-warm-lead-ms.
    warm_lead_ms: float = WARM_LEAD_MS


@dataclass
class SlotStats:
    frames_in: int = 0
    frames_out: int = 0
    underruns: int = 0
    state: str = "reserved"  # reserved, prefill, live, closed or failed (slots.py)
    window_shrinks: int = 0  # times the page pool shrank this session's context window (pages.py)
    window_frames: int = 0  # its window after the last shrink or grow-back (0: never changed, the full context)


@dataclass
class TickRecord:
    """One realtime tick: its engine-thread ms, batch, lateness, device parts and host phases (EngineStats)."""

    ms: float
    batch: int
    late: bool
    parts_ms: dict[str, float]
    host_ms: dict[str, float]


@dataclass
class EngineStats:
    ticks: int
    late_ticks: int
    batch: int
    tick_ms: float
    tick_ms_p50: float
    tick_ms_p99: float
    parts_ms: dict[str, float]
    # The last tick's host work outside the device step: "prepare" (reading the inputs, batch, input upload, graph
    # launches; its parts "prepare_inputs" and "prepare_launch", and the latter's "prepare_uploads", "prepare_steps"
    # and "prepare_outputs", stats.py), "deliver" (from its outputs reaching the host to the last callback), and
    # "leads" when the tick ran sessions' first halves before its batch (the external name of that phase).
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
    # Recent ms of one session-start step, by kind (scheduler.STEP_KINDS; the first half's is named "lead"), once
    # one ran.
    open_step_ms: dict[str, float]
    prompt_copies_in_flight: int  # cached prompts copied while a tick ran on the device
    last_tick_at: float  # time.monotonic() of the last tick's end (start() before the first; 0.0 before that)
    # Recent session starts (quantiles over the last 500): from the start's request to the session live, and to its
    # first frame handed out. What a burst of opens costs the callers, as the engine sees it.
    start_ms: dict[str, float] = field(default_factory=dict)
    first_frame_ms: dict[str, float] = field(default_factory=dict)
    stalled_after_s: float = ENGINE_STALLED_S  # the engine's EngineConfig.stalled_after_s, for its remote users
    # The KV page pool (pages.py): its pages, those free, context windows shrunk and grown back, and sessions
    # refused because the free pages would not cover the live sessions' growth.
    kv_pages: int = 0
    kv_pages_free: int = 0
    kv_window_shrinks: int = 0
    kv_window_grows: int = 0
    kv_refused: int = 0
    # The engine thread's garbage collections between ticks, and the longest (ms): one holds the GIL, so the writes
    # of a tick's outputs to the workers wait for it.
    gc_collections: int = 0
    gc_ms_max: float = 0.0
    # Input frames an engine process wrote into their rows as they arrived (staging.py), of all the ticks read.
    input_frames_staged: int = 0
    # An engine process's time on each worker's input frames message (quantiles, ms, over the last 4,096): its
    # event loop thread shares the GIL with the tick, and a tick's frames must be staged before its reads begin.
    frames_dispatch_ms: dict[str, float] = field(default_factory=dict)


def check_params(params: SessionParams, max_top_k_text: int, max_top_k_audio: int) -> None:
    """Raise InvalidSessionParams for sampling or pacing a session could not run with (its voice is the engine's
    to check: only the engine's process can load it)."""
    try:
        params.sampling.validate(max_top_k_text, max_top_k_audio)
    except ValueError as exc:
        raise InvalidSessionParams(str(exc)) from exc
    if params.pacing not in ("realtime", "input"):
        raise InvalidSessionParams(f"pacing must be 'realtime' or 'input', got {params.pacing!r}")
