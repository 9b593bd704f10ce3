"""Interleaved rotary position embeddings, shared by the LM and Mimi's transformers.

Pairs (2i, 2i+1) of each head's vector rotate by position * max_period^(-2i/head_dim), computed in fp32 as a
complex multiply (the reference's layout; HF's rotate-half form needs permuted weights instead).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rope_rotation(positions: Tensor, head_dim: int, max_period: float) -> Tensor:
    """Unit rotations at integer `positions` (any shape) -> complex64 [..., head_dim // 2]."""
    half = head_dim // 2
    freqs = torch.exp(
        torch.arange(half, device=positions.device, dtype=torch.float32) * (-math.log(max_period) * 2 / head_dim)
    )
    angles = positions.float().unsqueeze(-1) * freqs
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: Tensor, rotation: Tensor) -> Tensor:
    """Rotate x [..., T, head_dim]; `rotation` broadcasts to [..., T, head_dim // 2]."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
