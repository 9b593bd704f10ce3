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

from model.fused import fusable

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
M = TypeVar("M", bound=nn.Module)


def sibling(module: M) -> M:
    """A shallow copy whose submodule table is its own (a plain shallow copy would share it): setting a submodule
    on the copy leaves the original as it was."""
    other = copy.copy(module)
    other._modules = dict(module._modules)
    return other


@fusable
def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, 1]) with x ~= values * scale, each row's max at e4m3's max."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x W^T, bias-free, with W [N, K] held in e4m3 and a float32 scale per output channel; y in the dtype the
    weight had."""

    def __init__(self, weight: Tensor):
        super().__init__()
        values, scale = quantize_rows(weight.detach())
        self.register_buffer("weight", values)
        self.register_buffer("scale", scale.view(1, -1).contiguous())
        self.out_dtype = weight.dtype

    @classmethod
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear has no bias")
        return cls(linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        values, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        # CUDA's per-row scaled product writes bf16 only; a float32 model (the tiny one in tests) casts after it.
        y = torch._scaled_mm(values, self.weight.t(), scale_a=scale, scale_b=self.scale, out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], y.shape[-1]).to(self.out_dtype)
