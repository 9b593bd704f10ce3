"""Interleaved rotary position embeddings, shared by the LM and Mimi's transformers.

Pairs (2i, 2i+1) of each head's vector rotate by position * max_period^(-2i/head_dim), computed in fp32 (the
reference's layout; HF's rotate-half form needs permuted weights instead). Real arithmetic, so it fuses.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.fused import fusable


def rope_rotation(positions: Tensor, head_dim: int, max_period: float) -> Tensor:
    """Rotations at integer `positions` (any shape) -> (cos, sin) as fp32 [..., head_dim // 2, 2]."""
    half = head_dim // 2
    freqs = torch.exp(
        torch.arange(half, device=positions.device, dtype=torch.float32) * (-math.log(max_period) * 2 / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * freqs
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


@fusable
def apply_rope(x: Tensor, rotation: Tensor) -> Tensor:
    """Rotate x [..., T, head_dim]; `rotation` broadcasts to [..., T, head_dim // 2, 2]."""
    return rotate(x, rotation)


def rotate(x: Tensor, rotation: Tensor) -> Tensor:
    """`apply_rope`'s arithmetic, for compiled helpers that rotate as part of a larger pass."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos, sin = rotation[..., 0], rotation[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2).to(x.dtype)
