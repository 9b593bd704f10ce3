"""Per-row token sampling: greedy, or temperature + top-k, seeded per row with a counter-based hash.

The noise for row b depends only on (seed_b, frame counter, stream, token id), never on other rows, the batch
size or a global generator, so a session's samples are reproducible from its seed wherever its slot sits, and
the whole thing is fixed-shape tensor math that a CUDA graph can capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.fused import fusable
from model.sampling_params import SamplingParams

_M32 = 0xFFFFFFFF


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: Tensor, salt: Tensor, ids: Tensor) -> Tensor:
    """Uniform (0, 1) floats for each row and id: seed, salt [B] (counter and stream); ids [B, K] -> [B, K] fp32."""
    base = hash32(hash32(seed) ^ hash32(salt))
    h = hash32(base.unsqueeze(1) + ids * 0x9E3779B1)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class RowSampling:
    """Sampling settings of every row as tensors [B] on the model's device."""

    greedy: Tensor  # bool
    temperature: Tensor  # fp32; <= 0 means greedy
    top_k: Tensor  # long, >= 1
    seed: Tensor  # long, [0, 2**32)

    def rows(self, index: slice) -> RowSampling:
        """A view of some rows."""
        return RowSampling(self.greedy[index], self.temperature[index], self.top_k[index], self.seed[index])

    def to(self, device: torch.device) -> RowSampling:
        return RowSampling(*(t.to(device) for t in (self.greedy, self.temperature, self.top_k, self.seed)))

    def set_row(self, row: int, greedy: bool, temperature: float, top_k: int, seed: int) -> None:
        """Set one row in place from Python values: fills on the device, no upload, so nothing waits for the
        work queued before it (a tick in flight)."""
        self.greedy[row].fill_(greedy)
        self.temperature[row].fill_(temperature)
        self.top_k[row].fill_(top_k)
        self.seed[row].fill_(seed_bits(seed))


def sample(logits: Tensor, params: RowSampling, counter: Tensor, stream: int, max_top_k: int) -> Tensor:
    """One token per row from logits [B, V] (fp32) -> [B] long.

    Sampled rows take argmax(logits / T + Gumbel) over their own top-k, which is the reference's draw
    (softmax, top-k, then argmax of p / q with q ~ Exp(1)) written in log space. Greedy rows take the reference's
    argmax, the first of equal maxima: logits out of bf16 products tie often, and topk orders ties its own way.
    """
    k = min(max_top_k, logits.shape[-1])
    values, ids = logits.topk(k, dim=-1)
    return _choose(values, ids, logits.argmax(dim=-1), params.greedy, params.temperature, params.top_k, params.seed,
                   counter * 64 + stream)


@fusable
def _choose(values: Tensor, ids: Tensor, first_max: Tensor, greedy: Tensor, temperature: Tensor, top_k: Tensor,
            seed: Tensor, salt: Tensor) -> Tensor:
    """The draw among each row's sorted top candidates (values, ids [B, K]); greedy rows take first_max [B]."""
    gumbel = -torch.log(-torch.log(uniform_noise(seed, salt, ids)))
    scores = values / temperature.clamp(min=1e-5).unsqueeze(1) + gumbel
    ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    scores = scores.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    sampled = ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    return torch.where(greedy | (temperature <= 0), first_max, sampled)


def seed_bits(seed: int) -> int:
    """Fold a 64-bit seed into the 32 bits the noise hash takes."""
    return (seed ^ (seed >> 32)) & _M32


def row_sampling(
    params: list[SamplingParams], seeds: list[int], device: torch.device
) -> tuple[RowSampling, RowSampling]:
    """Text and audio RowSampling tensors for rows with these params and resolved seeds."""
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
    seed = torch.tensor([seed_bits(s) for s in seeds], dtype=torch.long)
    text = RowSampling(greedy, torch.tensor([p.temp_text for p in params]), torch.tensor([p.topk_text for p in params]),
                       seed)
    audio = RowSampling(greedy, torch.tensor([p.temp_audio for p in params]),
                        torch.tensor([p.topk_audio for p in params]), seed)
    return text.to(device), audio.to(device)
