"""Per-row token sampling: greedy, or temperature + top-k, seeded per row with a counter-based hash.

The noise for row b depends only on (seed_b, frame counter, stream, token id), never on other rows, the batch
size or a global generator, so a session's samples are reproducible from its seed wherever its slot sits, and
the whole thing is fixed-shape tensor math that a CUDA graph can capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: Tensor, counter: Tensor, stream: int, ids: Tensor) -> Tensor:
    """Uniform (0, 1) floats for each row and id: seed, counter [B]; ids [B, K] -> [B, K] fp32."""
    base = hash32(hash32(seed) ^ hash32(counter * 64 + stream))
    h = hash32(base.unsqueeze(1) + ids * 0x9E3779B1)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class RowSampling:
    """Sampling settings of every row as tensors [B] on the model's device."""

    greedy: Tensor  # bool
    temperature: Tensor  # fp32; <= 0 means greedy
    top_k: Tensor  # long, >= 1
    seed: Tensor  # long, [0, 2**32)


def sample(logits: Tensor, params: RowSampling, counter: Tensor, stream: int, max_top_k: int) -> Tensor:
    """One token per row from logits [B, V] (fp32) -> [B] long.

    Sampled rows take argmax(logits / T + Gumbel) over their own top-k, which is the reference's draw
    (softmax, top-k, then argmax of p / q with q ~ Exp(1)) written in log space.
    """
    k = min(max_top_k, logits.shape[-1])
    values, ids = logits.topk(k, dim=-1)
    greedy_token = ids[:, 0]
    temp = params.temperature.clamp(min=1e-5).unsqueeze(1)
    gumbel = -torch.log(-torch.log(uniform_noise(params.seed, counter, stream, ids)))
    scores = values / temp + gumbel
    ranks = torch.arange(k, device=logits.device).unsqueeze(0)
    scores = scores.masked_fill(ranks >= params.top_k.unsqueeze(1), float("-inf"))
    sampled = ids.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1)
    use_greedy = params.greedy | (params.temperature <= 0)
    return torch.where(use_greedy, greedy_token, sampled)
