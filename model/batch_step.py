"""One batched frame step over the engine's first `n` rows: Mimi encode, temporal, depformer, Mimi decode.

The engine owns buffers of `max_sessions` rows; a step works on views of a padded prefix of them (`bucket`), and on
CUDA each of its four parts is captured once as a CUDA graph and replayed every tick, so the tick costs a handful
of launches and no Python per session.

The model half runs one call ahead of the input (model/step.py says why that is exact): a tick encodes the user's
frame o, writes its codes, and runs the model half of call o + 1, which completes and decodes frame o. A session's
first model half (its "first half") has no frame to wait for: `first_half()` runs it on its own, or a tick runs it
in the batch with the row taking no input (`takes_input`).
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from model.lm import LM, LMState
from model.loading import PersonaPlex
from model.mimi import Mimi, MimiState
from model.sampling import RowSampling
from model.step import StepConstants, TemporalResult, depformer_half, temporal_half, write_user_codes

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass
class BatchBuffers:
    """Device state of all rows, owned by the engine: model state, per-row sampling, this tick's input and mask."""

    lm_state: LMState
    mimi_state: MimiState
    text_sampling: RowSampling
    audio_sampling: RowSampling
    pcm_in: Tensor  # [B, 1920]
    active: Tensor  # [B] bool: the row's model and decode run this tick
    takes_input: Tensor  # [B] bool: the row's input frame reaches the model (False on a session's first tick)

    def row_views(self, row: int) -> list[Tensor]:
        """Views of every per-row tensor of `row`, in a fixed order: all that a step over that row reads and
        writes (the KV pages themselves are shared, reached through the row's page table)."""
        index = slice(row, row + 1)
        lm, mimi = self.lm_state.rows(index), self.mimi_state.rows(index)
        views = [lm.kv.table, lm.kpos, lm.pos, lm.origin, lm.window, lm.ring, lm.offset, lm.forced]
        for stream in (mimi.encoder, mimi.decoder):
            views += [*stream.convs, stream.kv.keys, stream.kv.values, stream.kv.key_pos, stream.kv.pos]
        for sampling in (self.text_sampling, self.audio_sampling):
            part = sampling.rows(index)
            views += [part.greedy, part.temperature, part.top_k, part.seed]
        return views + [self.pcm_in[index], self.active[index], self.takes_input[index]]


def decode_agent(mimi: Mimi, frame: Tensor, emitted: Tensor, state: MimiState, bins: int,
                 active: Tensor | None = None) -> Tensor:
    """Mimi-decode the agent codes of token frames [B, 17] -> [B, 1920].

    Rows that emitted nothing (or idle rows, which may hold the 'initial' token = card, hence the clamp) keep a
    fresh decoder, as if the decode never ran.
    """
    audio = mimi.decode_frame(frame[:, 1:9].clamp(0, bins - 1), state)
    state.decoder.reset_idle(emitted, active)
    return audio


def prefill_chunks(frames: Tensor, size: int) -> list[Tensor]:
    """Split a prompt into chunks of about `size` frames, none of a single frame (a shape compiled code would
    specialise on)."""
    total = frames.shape[0]
    bounds = list(range(0, total, size)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        bounds[-2] -= 1
    return [frames[a:b] for a, b in itertools.pairwise(bounds) if b > a]


BEYOND_BUCKETS_STEP = 32


def bucket(n: int, limit: int) -> int:
    """The padded batch size a tick of `n` rows runs at: the next table entry, then every 32 rows past the table
    (one per row there would capture a graph per size: on the H200, 34 sizes from 257 to 290 held 7 GiB of pool)."""
    i = bisect.bisect_left(BATCH_BUCKETS, n)
    if i < len(BATCH_BUCKETS):
        size = BATCH_BUCKETS[i]
    else:
        size = BATCH_BUCKETS[-1] + -(-(n - BATCH_BUCKETS[-1]) // BEYOND_BUCKETS_STEP) * BEYOND_BUCKETS_STEP
    return min(size, limit)


class BatchStep:
    """Views of some rows of the engine's buffers (a padded prefix for ticks, one row for an input-clocked
    session), and (on CUDA, given a pool) one graph per part of the step."""

    def __init__(self, model: PersonaPlex, buffers: BatchBuffers, const: StepConstants, rows: slice,
                 graph_pool=None, warmups: int = 2, mimi: Mimi | None = None, lm: LM | None = None):
        """`mimi`, `lm`: the codec and language model the step runs (the engine's, perhaps of another precision),
        by default the model's."""
        self.lm = model.lm if lm is None else lm
        self.mimi = model.mimi if mimi is None else mimi
        self.lm_state: LMState = buffers.lm_state.rows(rows)
        self.mimi_state: MimiState = buffers.mimi_state.rows(rows)
        self.text_s = buffers.text_sampling.rows(rows)
        self.audio_s = buffers.audio_sampling.rows(rows)
        self.const = const
        self.pcm = buffers.pcm_in[rows]
        self.active = buffers.active[rows]
        self.takes_input = buffers.takes_input[rows]
        self.dep_cache = self.lm.depformer_cache(rows.stop - rows.start)
        self.bins = model.mimi_config.quantizer.bins
        self.codes: Tensor | None = None
        self.temporal: TemporalResult | None = None
        self.frame: Tensor | None = None
        self.emitted: Tensor | None = None
        self.audio: Tensor | None = None
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        if graph_pool is not None:
            self._capture(graph_pool, warmups)

    def encode(self) -> None:
        self.codes = self.mimi.encode_frame(self.pcm, self.mimi_state)
        write_user_codes(self.lm_state, self.codes, self.const, self.takes_input, ahead=1)

    def temporal_part(self) -> None:
        self.temporal = temporal_half(self.lm, self.lm_state, self.text_s, self.const, self.active)

    def depformer_part(self) -> None:
        self.frame, self.emitted = depformer_half(self.lm, self.lm_state, self.temporal, self.audio_s,
                                                  self.dep_cache, self.const, self.active)

    def decode(self) -> None:
        self.audio = decode_agent(self.mimi, self.frame, self.emitted, self.mimi_state, self.bins, self.active)

    PARTS = ("encode", "temporal", "depformer", "decode")

    @torch.no_grad()
    def first_half(self) -> tuple[Tensor, Tensor, Tensor]:
        """A session's first model half and decode (no input): from then on it runs one call ahead."""
        if self.graphs is not None:
            for graph in self.graphs[1:]:
                graph.replay()
        else:
            self.temporal_part()
            self.depformer_part()
            self.decode()
        return self.frame, self.emitted, self.audio

    def _capture(self, pool, warmups: int) -> None:
        fns = [self.encode, self.temporal_part, self.depformer_part, self.decode]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmups):
                for fn in fns:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graphs = []
        with torch.no_grad():
            for fn in fns:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    fn()
                self.graphs.append(graph)

    @torch.no_grad()
    def run(self, timer: PartTimer) -> tuple[Tensor, Tensor, Tensor]:
        if self.graphs is not None:
            for name, graph in zip(self.PARTS, self.graphs):
                graph.replay()
                timer.mark(name)
        else:
            for name, fn in zip(self.PARTS, (self.encode, self.temporal_part, self.depformer_part, self.decode)):
                fn()
                timer.mark(name)
        return self.frame, self.emitted, self.audio


class PartTimer:
    """Per-part times: CUDA events on the GPU (read after the tick's one sync), wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        # Re-recorded tick after tick (each tick syncs before the next): new events would be driver calls to create
        # and destroy five of them per tick on the host's critical path.
        self._events: list[torch.cuda.Event] = []

    def start(self) -> None:
        self.marks = []
        self.mark("start")

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        if len(self.marks) == len(self._events):
            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[len(self.marks)]
        event.record()
        return event

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def parts_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, a), (name, b) in itertools.pairwise(self.marks):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1000.0
        return out


