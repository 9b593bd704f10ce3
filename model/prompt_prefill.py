"""A session prompt's prefill on a scratch row, in pieces of fixed lengths that CUDA graphs replay.

Run eagerly, a prompt chunk's forward through the full model is hundreds of small launches: ~50 ms on the H200's
host whatever the chunk's length, one chunk per gap between ticks. Here the prompt runs on a one-row scratch state
in pieces of 128 frames, the last one padded up to 16, 32, 64 or 128 with frames that come after every real one;
on CUDA each length is captured once as a graph, so a prompt of T frames is ceil(T / 128) replays and fits in one
gap. Each piece reads every weight once (~9 ms on the H200 whatever its length), so fewer, padded pieces beat
exact ones. The padding frames cannot reach a real frame (attention is causal) and their keys are dropped after
the last piece. Pieces read a fixed window of the scratch ring (`LM.prefill(window=...)`), so they need no host
sync. The engine then stores the scratch row as a prompt-cache entry and copies it into the session's row.
Prompts longer than the scratch ring take the eager path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.lm import LM, LMState

PIECE_FRAMES = (128, 64, 32, 16)  # largest first; a prompt's last piece is the smallest that holds what is left
SCRATCH_SLOTS = 512  # frames of prompt the scratch row holds: 41 s, far above a voice + persona prompt


class PromptPrefill:
    """The scratch row, its input buffer and (on CUDA, given a pool) one graph per piece length."""

    def __init__(self, lm: LM, device: torch.device, fp8_kv: bool):
        self.lm = lm
        self.slots = min(SCRATCH_SLOTS, lm.cfg.context)
        self.state: LMState = lm.init_state(1, device, fp8_kv, slots=self.slots)
        self.x = torch.zeros(PIECE_FRAMES[0], lm.cfg.dim, device=device, dtype=lm.text_linear.weight.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, frames: int) -> bool:
        return sum(self.pieces(frames)) <= self.slots

    @staticmethod
    def pieces(total: int) -> list[int]:
        """Piece lengths for a prompt of `total` frames: whole 128s, then the smallest piece that holds the rest."""
        full, rest = divmod(total, PIECE_FRAMES[0])
        tail = [min(n for n in PIECE_FRAMES if n >= rest)] if rest else []
        return [PIECE_FRAMES[0]] * full + tail

    @torch.no_grad()
    def run(self, embeddings: Tensor) -> None:
        """Prefill `embeddings` [T, dim] (T <= slots) into the scratch row, from fresh."""
        self.lm.reset_row(self.state, 0)
        done, total = 0, embeddings.shape[0]
        pieces = self.pieces(total)
        for frames in pieces:
            real = min(frames, total - done)
            self.x[:real].copy_(embeddings[done : done + real])
            self.x[real:frames].zero_()
            graph = self.graphs.get(frames)
            if graph is None:
                self._piece(frames)
            else:
                graph.replay()
            done += real
        padded = sum(pieces)
        if padded > total:  # the padding frames' keys leave the ring; the row ends at its last real frame
            state = self.state
            state.kv.zero_slots(0, slice(total, padded))
            state.kpos[0, total:padded] = -1
            state.pos[0] = total

    def capture(self, pool) -> None:
        """One graph per piece length, after a warm-up run of each (compiling the fused helpers)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for frames in PIECE_FRAMES:
                self.lm.reset_row(self.state, 0)
                self._piece(frames)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            for frames in PIECE_FRAMES:
                self.lm.reset_row(self.state, 0)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(frames)
                self.graphs[frames] = graph
        self.lm.reset_row(self.state, 0)

    def _piece(self, frames: int) -> None:
        self.lm.prefill(self.x[:frames], self.state, 0, window=self.slots)
