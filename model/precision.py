"""Variants of a model's parts in another precision that share everything else: module siblings, and linear
layers whose weights are e4m3 (fp8) with a scale per output channel.

An fp8 product reads half the bytes of a bf16 one and runs on the tensor cores' fp8 path (twice bf16's rate on
Hopper). The input is quantized per row as it comes (the row's max at e4m3's max), so one loud row never costs the
others their precision; `torch._scaled_mm` applies both scales in the product's epilogue.
"""

from __future__ import annotations

import copy
from typing import TypeVar

import torch
from torch import Tensor, nn

from model.attention import quantize

M = TypeVar("M", bound=nn.Module)


def sibling(module: M) -> M:
    """A shallow copy whose submodule table is its own (a plain shallow copy would share it): setting a submodule
    on the copy leaves the original as it was."""
    other = copy.copy(module)
    other._modules = dict(module._modules)
    return other


class Fp8Linear(nn.Module):
    """y = x W^T, bias-free, with W [N, K] held in e4m3 and a float32 scale per output channel; y in the dtype the
    weight had."""

    def __init__(self, weight: Tensor):
        super().__init__()
        values, scale = quantize(weight.detach())   # each output channel's max at e4m3's max, as the fp8 KV does
        self.register_buffer("weight", values)
        self.register_buffer("scale", scale.view(1, -1).contiguous())
        self.out_dtype = weight.dtype

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear has no bias")
        return cls(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        values, scale = quantize(x.reshape(-1, x.shape[-1]))
        # CUDA's per-row scaled product writes bf16 only; a float32 model (the tiny one in tests) casts after it.
        y = torch._scaled_mm(values, self.weight.t(), scale_a=scale.unsqueeze(-1), scale_b=self.scale,
                             out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], y.shape[-1]).to(self.out_dtype)
