"""The device side of the engine, the only part that touches it: the batch buffers and their pinned host twins,
the batched step per padded batch size and the one-row steps (CUDA graphs when enabled), warm-up, prompt prefill
and copies into a row, row resets, and the event that says a tick's outputs reached the host.

Inputs and outputs move once per tick through pinned host memory; the host writes per-row inputs into numpy
views of it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from model import fused, launch
from model.batch_step import BatchBuffers, BatchStep, PartTimer, bucket, prefill_chunks
from model.config import FRAME_SAMPLES, SAMPLE_RATE
from model.engine.api import EngineConfig, KVCacheTooSmall, ResourceExhausted
from model.engine.pages import PagePool, upload
from model.engine.prompt_cache import CachedPrompt
from model.lm import LM, LMState
from model.loading import PersonaPlex
from model.mimi import Mimi
from model.prompt_prefill import PromptPrefill
from model.prompts import PromptPlan, finish_prompt, plan_continuation
from model.sampling import SamplingParams, row_sampling
from model.step import StepConstants

log = logging.getLogger(__name__)


class StepMarks(NamedTuple):
    """perf_counter marks of the last batch step on the host: when it began; when its pages, inputs and flags were
    queued for the device; when its parts were launched (on CUDA their graphs; on the CPU they run there and then);
    when its outputs' gathers and copies to the host were queued; and when those outputs landed."""

    entered: float
    uploaded: float
    stepped: float
    launched: float
    returned: float


# One row's outputs on the host: its token frame [17], whether it emitted, its audio [1920], whether that is finite.
RowOutputs = tuple[np.ndarray, bool, np.ndarray, bool]


def _row_to_host(frame: Tensor, emitted: Tensor, audio: Tensor) -> RowOutputs:
    """A one-row step's outputs on the host, copies of the step's buffers."""
    samples = audio[0].float().to("cpu", copy=True).numpy()
    return frame[0].to("cpu", copy=True).numpy(), bool(emitted[0]), samples, bool(np.isfinite(samples).all())


def make_current(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Triton launches its kernels on the current device,
    not on their tensors': an engine on cuda:1 failed its first fused kernel while cuda:0 was current."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def streaming_mimi(mimi: Mimi, config: EngineConfig, device: torch.device) -> Mimi:
    """The codec the engine's steps stream through: `mimi` itself, or on CUDA a copy with a side in bf16 and perhaps
    its SEANet steps fused (EngineConfig)."""
    if device.type != "cuda":
        return mimi
    bf16 = torch.bfloat16
    mimi = mimi.with_precision(bf16 if config.mimi_encoder_bf16 else mimi.encoder_dtype,
                               bf16 if config.mimi_decoder_bf16 else mimi.decoder_dtype)
    if config.mimi_fused_encoder or config.mimi_fused_decoder:
        return mimi.with_fused_seanet(encoder=config.mimi_fused_encoder, decoder=config.mimi_fused_decoder)
    return mimi


class Runner:
    """Device state of `max_sessions` rows and the steps over them."""

    def __init__(self, model: PersonaPlex, config: EngineConfig):
        self.model, self.config = model, config
        B = self.rows = config.max_sessions
        # Row B, past the sessions' rows, is the spare row that one-row steps run on (`_on_spare_row`).
        self.spare_row = B
        rows = B + 1  # device state: the sessions' rows and the spare row
        self.device = model.device
        make_current(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads or max(1, len(os.sched_getaffinity(0)) // 2))
        if self.device.type == "cuda":
            # Mimi runs in fp32: TF32 puts its GEMMs on tensor cores, as cuDNN already does for its convolutions.
            torch.backends.cuda.matmul.allow_tf32 = True
        launch.enable(config.pdl_launches and self.device.type == "cuda")  # before any kernel compiles
        if config.fuse_kernels and self.device.type == "cuda":
            if fused.available():
                fused.enable()
            else:
                log.warning("Triton is not installed: running without fused kernels (slower ticks)")
        lm = self.lm = self._stepping_lm()
        self.scratch = PromptPrefill(lm, self.device, config.fp8_kv)
        model.text_pieces(np.zeros(1, dtype=np.int64))  # builds the token-text table now, not in the first tick
        self.mimi = streaming_mimi(self.model.mimi, self.config, self.device)
        self.mimi_state = self.mimi.init_state(rows, self.device)
        page = page_frames(lm.cfg.context, config.kv_page_frames)
        self.lm_state = lm.init_state(rows, self.device, fp8_kv=config.fp8_kv, page=page,
                                      pool_pages=self._pool_pages(page))
        self.pages = PagePool(self.lm_state, round(config.kv_reserve_s * 1000.0 / config.tick_ms),
                              config.kv_floor_frames)
        self.const = StepConstants.make(lm, self.device, fused_draw=config.fused_draw,
                                        fused_depformer=config.fused_depformer and self.device.type == "cuda")
        self.text_sampling, self.audio_sampling = row_sampling([SamplingParams(greedy=True)] * rows, [0] * rows,
                                                                   self.device)
        self.pcm_in = torch.zeros(rows, FRAME_SAMPLES, device=self.device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.takes_input = torch.zeros(rows, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        self._pcm_host = torch.zeros(B, FRAME_SAMPLES, pin_memory=pin)
        self._active_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._takes_input_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._emitted_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._finite_host = torch.zeros(B, dtype=torch.bool, pin_memory=pin)
        self._gather: tuple[np.ndarray, Tensor] | None = None  # the last out_rows, and on the device
        # run_batch's gathered frames and audio are pinned host memory (on CUDA): the caching host allocator keeps a
        # block pinned, and not reused, while anything refers to it.
        self.pinned_outputs = pin
        # numpy views of the pinned inputs: per-slot writes from numpy cost a fraction of torch's per-op overhead.
        self.pcm_np, self.active_np = self._pcm_host.numpy(), self._active_host.numpy()
        self.takes_input_np = self._takes_input_host.numpy()
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._steps: dict[int, BatchStep] = {}
        self._spare_step: BatchStep | None = None
        self._timer = PartTimer(self.device)
        self.parts_ms: dict[str, float] = {}  # the last batch step's device parts
        self.step_marks = StepMarks(0.0, 0.0, 0.0, 0.0, 0.0)
        self._outputs_ready = torch.cuda.Event() if self.device.type == "cuda" else None
        self._warm_host = torch.zeros(1, pin_memory=pin)
        self._warm_device = torch.zeros(1, device=self.device)
        self.tick_warm_ups = 0

    def _stepping_lm(self) -> LM:
        """The language model the steps and prompts run through: the model's, or a sibling with its temporal
        products in fp8 (EngineConfig.fp8_weights)."""
        if not self.config.fp8_weights:
            return self.model.lm
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise RuntimeError("fp8_weights needs fp8 tensor cores (compute capability 8.9 or later)")
        return self.model.lm.with_fp8_weights()

    def _pool_pages(self, page: int) -> int:
        """The pool's pages: the configured count, else what the free device memory holds beside kv_free_gib
        (CUDA) or every row's full window (CPU), at most kv_cache_gib's worth."""
        config, cfg = self.config, self.lm.cfg
        if config.kv_pages is not None:
            return config.kv_pages
        window, every_window = cfg.context // page, self.rows * (cfg.context // page)
        element = 1 if config.fp8_kv else self.lm.text_linear.weight.element_size()
        page_bytes = page * 2 * cfg.num_layers * cfg.num_heads * (cfg.head_dim * element + (4 if config.fp8_kv else 0))
        if config.kv_cache_gib is not None:
            capped = int(config.kv_cache_gib * 2**30 // page_bytes)
            if capped < window:
                raise KVCacheTooSmall(f"a KV cache of {config.kv_cache_gib:g} GiB holds no full context "
                                      f"window ({window * page_bytes / 2**30:.3g} GiB)")
            every_window = min(every_window, capped)
        if self.device.type != "cuda":
            return every_window
        free, _ = torch.cuda.mem_get_info(self.device)
        pages = int((free - config.kv_free_gib * 2**30) // page_bytes) - 1
        if pages < window:
            raise KVCacheTooSmall(f"{free / 2**30:.1f} GiB free on {self.device} hold no full KV context window "
                                  f"({window * page_bytes / 2**30:.3g} GiB) beside {config.kv_free_gib:g} GiB for "
                                  f"the rest")
        return min(pages, every_window)

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda" and self.config.cuda_graphs

    @property
    def runs_in_flight(self) -> bool:
        """Whether a tick's device work runs while the host does other things (CUDA)."""
        return self._outputs_ready is not None

    def buffers(self) -> BatchBuffers:
        return BatchBuffers(self.lm_state, self.mimi_state, self.text_sampling, self.audio_sampling, self.pcm_in,
                            self.active, self.takes_input)

    # ----- warm-up ------------------------------------------------------------------------------------------

    def warm_up(self) -> float:
        """Capture the graphs, compile what a session's start compiles, and pay a first half's first-use costs;
        the seconds of a warm first half, for the schedule."""
        if self.graphs:
            # cuDNN's heuristics choose each convolution's algorithm, not its timing of them: timed choices differ
            # from one process to the next, and with them a session's codes (H200, Mimi alone, the same tree in two
            # processes: 98.7-99.6 % of codes equal timed, all equal by heuristics, at the same speed).
            with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False):
                for n in sorted({bucket(i, self.rows) for i in range(1, self.rows + 1)}):
                    self.batch_step(n)
                # One row's step, graphed: a session's first half, and input-clocked frames. Eager, one row of
                # the full model is ~80-100 ms of launches, more than a gap between ticks.
                self._spare()
            self.scratch.capture(self.graph_pool)
        if fused.enabled():
            self._warm_prefill()
        return self._warm_first_half()

    def _warm_prefill(self) -> None:
        """Compile the fused helpers for the shapes of a session's start now, not in the first open (seconds, seen
        as 2.1 s of engine work in the first cold open on the H200): prefill chunks, and a .wav voice's one-shot
        Mimi encode (two lengths, so the compiled code is the one for any length)."""
        lm = self.lm
        with torch.no_grad():
            for frames in (self.config.prefill_chunk, 2):
                x = torch.zeros(frames, lm.cfg.dim, device=self.device, dtype=lm.text_linear.weight.dtype)
                self.prefill_chunk(x, 0)
            self.reset_lm_row(0)
        noise = 0.05 * np.random.default_rng(0).standard_normal(2 * SAMPLE_RATE).astype(np.float32)
        for seconds in (1.0, 1.5):
            self.model.encode_wav_voice(noise[: int(seconds * SAMPLE_RATE)], SAMPLE_RATE)

    def _warm_first_half(self) -> float:
        for _ in range(2):
            started = time.perf_counter()
            self.first_half(0)
            elapsed = time.perf_counter() - started  # the second run's is kept: the first pays first-use costs
            self.active[0] = False
            self.reset_lm_row(0)
            self.reset_mimi_row(0)
        return elapsed

    # ----- steps --------------------------------------------------------------------------------------------

    def run_batch(self, n: int, protected_rows: list[int], out_rows: np.ndarray,
                  while_in_flight: Callable[[float], None] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One step over rows [0, n) with the inputs and flags the host wrote; `protected_rows` (input-clocked
        sessions) keep their Mimi state. On CUDA, `while_in_flight(launched)` runs once the step is queued and
        before its outputs are waited for. The frames and audio of `out_rows` (rows below n), in that order and
        the caller's own (gathered on the device; on CUDA fresh pinned blocks, which the caching host allocator
        reuses only once nothing refers to them); and each row's emitted flag and whether its audio is finite (on
        CUDA checked by the device), views of pinned memory the next step overwrites."""
        entered = time.perf_counter()
        step = self.batch_step(n)
        self.pages.flush()
        saved = [(r, self.mimi_state.encoder.rows(slice(r, r + 1)).clone(),
                  self.mimi_state.decoder.rows(slice(r, r + 1)).clone()) for r in protected_rows]
        self.pcm_in[:n].copy_(self._pcm_host[:n], non_blocking=True)
        self.active[:n].copy_(self._active_host[:n], non_blocking=True)
        self.takes_input[:n].copy_(self._takes_input_host[:n], non_blocking=True)
        uploaded = time.perf_counter()
        self._timer.start()
        frame, emitted, audio = step.run(self._timer)
        for r, enc, dec in saved:
            self.mimi_state.encoder.rows(slice(r, r + 1)).copy_(enc)
            self.mimi_state.decoder.rows(slice(r, r + 1)).copy_(dec)
        stepped = time.perf_counter()
        # Outputs come back in one transfer wait per tick, through pinned buffers. The rows are gathered in the
        # order they are handed out, into blocks of their own: the host's copy of them out of a reused buffer, in
        # that order, took ~0.4 ms of a tick of 250 on an H100's host (memory the transfer just wrote).
        index = self._on_device(out_rows)
        frames_out, audio_out = frame.index_select(0, index), audio.index_select(0, index).float()
        self._emitted_host[:n].copy_(emitted, non_blocking=True)
        cuda = self.device.type == "cuda"
        if cuda:  # two small kernels, where numpy on the host took ~0.2 ms of a tick of 250 rows
            self._finite_host[:n].copy_(torch.isfinite(audio).all(dim=1), non_blocking=True)
            # to the host without blocking: torch gives each a fresh pinned block
            frames_out, audio_out = frames_out.to("cpu", non_blocking=True), audio_out.to("cpu", non_blocking=True)
        launched = time.perf_counter()
        if self._outputs_ready is not None:
            self._outputs_ready.record()
            if while_in_flight is not None:
                while_in_flight(launched)
            self._outputs_ready.synchronize()  # not the stream: work queued in flight waits behind the outputs
        returned = time.perf_counter()
        self.parts_ms = self._timer.parts_ms()
        self.step_marks = StepMarks(entered, uploaded, stepped, launched, returned)
        finite = self._finite_host[:n].numpy()
        if not cuda:  # numpy's check is ~10x torch's on the CPU
            finite[:] = np.isfinite(audio.float().numpy()).all(axis=1)
        return frames_out.numpy(), self._emitted_host[:n].numpy(), audio_out.numpy(), finite

    def warm_tick_calls(self) -> None:
        """The tick's first host calls made once on a sample of their own, shortly before it: a host-to-device copy
        and a finiteness check (EngineConfig.warm_lead_ms). Touches no buffer a step reads."""
        self._warm_device.copy_(self._warm_host, non_blocking=True)
        np.isfinite(self._warm_host.numpy()).all()
        self.tick_warm_ups += 1

    def _on_device(self, rows: np.ndarray) -> Tensor:
        """`rows` as an index on the device, uploaded again only when they are another array (a tick's plan keeps
        its rows between the sessions' moves)."""
        if self._gather is None or self._gather[0] is not rows:
            # a copy: the plan's rows are read-only, and on the CPU the index would share their memory
            self._gather = (rows, upload(np.array(rows, dtype=np.int64), self.device))
        return self._gather[1]

    def outputs_landed(self) -> bool:
        """Whether the step in flight has its outputs on the host."""
        return self._outputs_ready.query()

    def first_half(self, row: int) -> RowOutputs:
        """A session's first model half (and its decode) as a one-row step; its outputs on the host."""
        self.active[row] = True
        self._take_pages(row)
        return _row_to_host(*self._on_spare_row(row, BatchStep.first_half))

    def row_step(self, row: int) -> RowOutputs:
        """One input-clocked frame of `row`, its input already in the host row: stepped alone, between ticks."""
        # The row's active flag and input go straight into the device buffers; the next realtime tick rewrites
        # both for its own rows.
        self.pcm_in[row].copy_(self._pcm_host[row])
        self.active[row] = self.takes_input[row] = True
        self._take_pages(row)
        timer = PartTimer(self.device)
        return _row_to_host(*self._on_spare_row(row, lambda step: step.run(timer)))

    def batch_step(self, n: int) -> BatchStep:
        """The step over rows [0, n) (a bucket's padded size), made, and on CUDA captured, on first use."""
        step = self._steps.get(n)
        if step is None:
            pool = self.graph_pool if self.graphs else None
            step = self._steps[n] = BatchStep(self.model, self.buffers(), self.const, slice(0, n), graph_pool=pool,
                                              mimi=self.mimi, lm=self.lm)
        return step

    def _spare(self) -> BatchStep:
        """The step over the spare row: a session's first half, and input-clocked sessions between ticks."""
        if self._spare_step is None:
            pool = self.graph_pool if self.graphs else None
            row = self.spare_row
            self._spare_step = BatchStep(self.model, self.buffers(), self.const, slice(row, row + 1), graph_pool=pool,
                                         mimi=self.mimi, lm=self.lm)
        return self._spare_step

    def _on_spare_row(self, row: int, step: Callable[[BatchStep], tuple[Tensor, Tensor, Tensor]]
                      ) -> tuple[Tensor, Tensor, Tensor]:
        """`step` run for `row` on the spare row: the row's state copied in, stepped, copied back.

        One graph serves every row: a graph per row held 1.9 GiB for 290 sessions on the H200 (~100 KV pages,
        the difference between 7 refusals and none in a call mix of 250) and 40 s of the engine's start. The
        copies cost two launches per state tensor; the KV stays in its pages, reached through the copied table."""
        buffers = self.buffers()
        spare, views = buffers.row_views(self.spare_row), buffers.row_views(row)
        for into, source in zip(spare, views, strict=True):
            into.copy_(source)
        outputs = step(self._spare())
        for into, source in zip(views, spare, strict=True):
            into.copy_(source)
        return outputs

    # ----- a row's state ------------------------------------------------------------------------------------

    def prepare_batch(self, n: int) -> list[int]:
        """Pages for the next frame of each row of [0, n) marked active, counted as stepped; the rows for which no
        page could be found (left inactive)."""
        rows = np.flatnonzero(self.active_np[:n])
        starved = self.pages.ensure_rows(rows.tolist())
        if starved:
            self.active_np[starved] = self.takes_input_np[starved] = False
            rows = np.flatnonzero(self.active_np[:n])
        self.pages.advance(rows)
        return starved

    def _take_pages(self, row: int, frames: int = 1) -> None:
        """Pages for the row's next `frames` frames, counted as written, on the device before the step."""
        if not self.pages.ensure(row, frames):
            raise ResourceExhausted("no KV page is free and no session's context can shrink further")
        self.pages.flush()
        self.pages.advance([row], frames)

    @torch.no_grad()
    def reset_lm_row(self, row: int) -> None:
        self.pages.release(row)
        self.pages.flush()
        self.lm.reset_row(self.lm_state, row, used=0)

    def reset_mimi_row(self, row: int, decoder: bool = True) -> None:
        state = self.mimi_state.rows(slice(row, row + 1))
        fresh = torch.ones(1, dtype=torch.bool, device=self.device)
        state.encoder.reset_rows(fresh)
        if decoder:
            state.decoder.reset_rows(fresh)

    def set_sampling(self, row: int, sampling: SamplingParams, seed: int) -> None:
        self.text_sampling.set_row(row, sampling.greedy, sampling.temp_text, sampling.topk_text, seed)
        self.audio_sampling.set_row(row, sampling.greedy, sampling.temp_audio, sampling.topk_audio, seed)

    def sync_elapsed(self, since: float) -> float:
        """Seconds since `since` (perf_counter) once the device has finished what was queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - since

    def fill_context(self, rows: slice, frames: int) -> None:
        """Mark `frames` past frames as present in the KV of `rows` (their values left as they are, in pages
        taken for them)."""
        state, context = self.lm_state, self.model.config.context
        held = min(frames, context)
        positions = torch.arange(frames - held, frames, device=self.device)
        kpos = torch.full((context,), -1, dtype=torch.long, device=self.device)
        kpos[positions % context] = positions
        for row in range(*rows.indices(self.rows)):
            self.pages.release(row)
            self._take_pages(row, frames)
        state.kpos[rows] = kpos
        state.pos[rows] = frames
        state.offset[rows] = frames + 1

    # ----- prompts ------------------------------------------------------------------------------------------

    def prompt_chunks(self, plan: PromptPlan) -> list[Tensor]:
        """The prompt as the pieces `prefill_chunk` prefills on a row, one per step (longer than the scratch)."""
        return prefill_chunks(plan.embeddings, self.config.prefill_chunk)

    @torch.no_grad()
    def prefill_on_scratch(self, plan: PromptPlan) -> CachedPrompt:
        """The whole prompt on the scratch row (replayed CUDA graphs, model/prompt_prefill.py); its effect."""
        self.scratch.run(plan.embeddings)
        finish_prompt(self.lm, self.scratch.state, 0, plan)
        return self._prompt_of(self.scratch.state, 0)

    @torch.no_grad()
    def prefill_chunk(self, chunk: Tensor, row: int) -> None:
        """Prefill `chunk` after what the row holds (a fresh row's prompt, or a prompt added to a live context)."""
        self._take_pages(row, chunk.shape[0])
        pages = self.pages
        self.lm.prefill(chunk, self.lm_state, row, origin=int(pages.origin[row]), ring=int(pages.window[row]))

    @torch.no_grad()
    def continuation(self, row: int, persona: list[int], pending: bool) -> PromptPlan:
        """A prompt for a live row, from its ring and call counter as they are (prompts.plan_continuation)."""
        state = self.lm_state
        return plan_continuation(self.lm, state.ring[row], int(state.offset[row]), persona, pending)

    @torch.no_grad()
    def end_prompt(self, plan: PromptPlan, row: int) -> None:
        """After a continuation's last chunk: the row's ring, call counter and forced tokens."""
        finish_prompt(self.lm, self.lm_state, row, plan)

    @torch.no_grad()
    def finish_prompt(self, plan: PromptPlan, row: int) -> CachedPrompt:
        """After the last chunk on `row`: the prompt's last frames, and its effect."""
        finish_prompt(self.lm, self.lm_state, row, plan)
        return self._prompt_of(self.lm_state, row)

    @torch.no_grad()
    def copy_prompt(self, cached: CachedPrompt, row: int) -> None:
        state = self.lm_state
        filled = cached.kpos.shape[0]
        self._take_pages(row, cached.pos)  # a fresh row: its slots [0, filled)
        state.kv.write_slots(row, cached.kv)
        state.kpos[row, :filled] = cached.kpos
        # fill_, not `x[row] = int`: that copies a host scalar, which waits for the stream (a tick in flight).
        state.pos[row].fill_(cached.pos)
        state.ring[row] = cached.ring
        state.offset[row].fill_(cached.offset)
        state.forced[row] = cached.forced

    def _prompt_of(self, state: LMState, row: int) -> CachedPrompt:
        """The prompt that `row` of `state` holds (a fresh row after its prefill)."""
        filled = int(min(int(state.pos[row]), self.model.config.context))
        return CachedPrompt(
            kv=state.kv.read_slots(row, filled),
            kpos=state.kpos[row, :filled].clone(), pos=int(state.pos[row]), ring=state.ring[row].clone(),
            offset=int(state.offset[row]), forced=state.forced[row].clone(),
        )


def page_frames(context: int, most: int) -> int:
    """Frames per KV page: the largest divisor of the context not above `most` (a window is whole pages)."""
    return max(d for d in range(1, min(most, context) + 1) if context % d == 0)
