"""A session prompt's prefill on a scratch row, in pieces of fixed lengths that CUDA graphs replay.

Run eagerly, a prompt chunk's forward through the full model is hundreds of small launches: ~50 ms on the H200's
host whatever the chunk's length, one chunk per gap between ticks. Here the prompt runs on a one-row scratch state
in pieces of 128, 64, ..., 1 frames; on CUDA each length is captured once as a graph, so a prompt of T frames is a
few replays (its GPU work, a few ms) and fits in one gap. Pieces read a fixed window of the scratch ring
(`LM.prefill(window=...)`), so they need no host sync. The engine then stores the scratch row as a prompt-cache
entry and copies it into the session's row. Prompts longer than the scratch ring take the eager path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.lm import LM, LMState

PIECE_FRAMES = (128, 64, 32, 16, 8, 4, 2, 1)
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
        return frames <= self.slots

    @torch.no_grad()
    def run(self, embeddings: Tensor) -> None:
        """Prefill `embeddings` [T, dim] (T <= slots) into the scratch row, from fresh."""
        self.lm.reset_row(self.state, 0)
        done, total = 0, embeddings.shape[0]
        while done < total:
            frames = next(n for n in PIECE_FRAMES if n <= total - done)
            self.x[:frames].copy_(embeddings[done : done + frames])
            graph = self.graphs.get(frames)
            if graph is None:
                self._piece(frames)
            else:
                graph.replay()
            done += frames

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
