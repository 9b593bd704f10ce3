"""A SEANet residual unit's streaming step as one Triton kernel (opt-in: `Mimi.with_fused_seanet`).

The unit is x + conv1x1(elu(conv_k(elu(x)))). Step by step in torch it is five passes over its activations: the ELU
written into the first convolution's window, that convolution, the hidden ELU, the 1x1 convolution, the residual
add. At 250 rows the first unit of the encoder (and the last of the decoder) holds 64 channels x 1,920 samples a row,
123 MB in float32, so each pass is tens of microseconds of the H200's bandwidth and a kernel launch. Here one program
takes a row's tile of samples through all of it in registers: x is read once (each shifted copy the convolution
needs comes from cache), the output written once, and the hidden activations never leave the chip.

Arithmetic: both products accumulate in fp32 (TF32 inputs for a float32 unit where cuDNN's convolutions use TF32,
bf16 inputs for a bf16 unit), and the hidden activations stay fp32 between them where the torch path rounds them to
the unit's dtype. So the outputs are not bit-equal to the torch path's: within TF32's rounding in float32, closer to
float32 than the torch path in bf16. `bench.mimi_step --fused residual` measures both paths' time and agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

FUSED_CHANNELS = (32, 64, 128)  # the unit's channels (hidden: half) whose weights and tiles fit one program


@dataclass(frozen=True)
class Tile:
    """A program's share: `samples` of one row (a power of two >= 16, for tl.dot) over all channels, with `warps`
    for each 64 channels. Not tuned on a GPU yet: `bench.mimi_step --residual-tiles` times others."""

    samples: int = 64
    warps: int = 4


TILE = Tile()


def fits(channels: int, hidden: int) -> bool:
    """Whether a unit of these widths can run as the kernel (tl.dot needs powers of two >= 16)."""
    return channels in FUSED_CHANNELS and hidden >= 16 and hidden & (hidden - 1) == 0


def fused_residual_step(x: Tensor, window: Tensor | None, conv: torch.nn.Conv1d, conv_1x1: torch.nn.Conv1d,
                        alpha: float, alpha_hidden: float) -> Tensor:
    """One streaming step of the unit over x [B, C, L] (time or channels contiguous, as a strided convolution's
    product leaves it; L >= the context): the output [B, C, L], contiguous.

    `window` is the first convolution's streaming state as `CausalConv1d` keeps it: its first `context` samples are
    the ELU'd input kept from the last step; they are read here and replaced by this step's last ones. The rest of
    the window is not used. A convolution of one tap keeps none (None).
    """
    b, c, length = x.shape
    hidden, _, k = conv.weight.shape
    dilation = conv.dilation[0]
    context = (k - 1) * dilation
    assert 1 in x.stride()[1:] and length >= context and fits(c, hidden) and (window is not None or not context)
    assert conv.bias is not None and conv_1x1.bias is not None and conv.weight.is_contiguous()
    out = torch.empty(b, c, length, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32 and not torch.backends.cudnn.allow_tf32  # else TF32 for float32, as cuDNN's
    window_strides = (0, 0, 0) if window is None else window.stride()  # never read without a context
    _residual_kernel[(b, triton.cdiv(length, TILE.samples))](
        x, x if window is None else window, conv.weight, conv.bias, conv_1x1.weight, conv_1x1.bias, out, length,
        x.stride(0), x.stride(1), x.stride(2), *window_strides, alpha, alpha_hidden,
        C=c, H=hidden, K=k, DILATION=dilation, CONTEXT=context, CHANNELS_INNER=x.stride(2) != 1,
        BLOCK_T=TILE.samples, PRECISION="ieee" if ieee else None, num_warps=max(1, TILE.warps * c // 64),
    )
    if context:  # what the next step's first samples convolve with: this step's last, ELU'd
        torch.ops.aten.elu.out(x[..., length - context :], alpha, out=window[..., :context])
    return out


if triton is not None:

    @triton.jit
    def _elu(v, alpha):
        return tl.where(v > 0, v, alpha * (tl.exp(v) - 1.0))

    # Pointers to x[row, c, t] for a [C, BLOCK_T] tile: the contiguous dimension's stride left out, so that the
    # compiler sees it and reads along it.
    @triton.jit
    def _x_at(X, row, c, t, sxb, sxc, sxt, CHANNELS_INNER: tl.constexpr):
        if CHANNELS_INNER:
            return X + row * sxb + c[:, None] + t[None, :] * sxt
        return X + row * sxb + c[:, None] * sxc + t[None, :]

    @triton.jit
    def _residual_kernel(X, WINDOW, W1, B1, W2, B2, OUT, L, sxb, sxc, sxt, swb, swc, swt, alpha, alpha_hidden,
                         C: tl.constexpr, H: tl.constexpr, K: tl.constexpr, DILATION: tl.constexpr,
                         CONTEXT: tl.constexpr, CHANNELS_INNER: tl.constexpr, BLOCK_T: tl.constexpr,
                         PRECISION: tl.constexpr):
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, C)
        h = tl.arange(0, H)
        inside = (t < L)[None, :]
        dtype = W1.dtype.element_ty
        hidden = tl.zeros([H, BLOCK_T], dtype=tl.float32)
        for tap in tl.static_range(K):
            # Input sample t + tap * DILATION - CONTEXT of this step; before its start, the window's kept samples.
            src = t + tap * DILATION - CONTEXT
            kept = (src < 0)[None, :]
            fresh = tl.load(_x_at(X, row, c, src, sxb, sxc, sxt, CHANNELS_INNER), mask=inside & ~kept,
                            other=0.0).to(tl.float32)
            old = tl.load(WINDOW + row * swb + c[:, None] * swc + (src + CONTEXT)[None, :] * swt,
                          mask=inside & kept, other=0.0).to(tl.float32)
            taken = tl.where(kept, old, _elu(fresh, alpha))
            weight = tl.load(W1 + h[:, None] * (C * K) + c[None, :] * K + tap)  # W1 [H, C, K]
            hidden = tl.dot(weight, taken.to(dtype), hidden, input_precision=PRECISION)
        hidden = _elu(hidden + tl.load(B1 + h).to(tl.float32)[:, None], alpha_hidden)
        weight = tl.load(W2 + c[:, None] * H + h[None, :])  # W2 [C, H, 1]
        y = tl.dot(weight, hidden.to(dtype), input_precision=PRECISION)
        skip = tl.load(_x_at(X, row, c, t, sxb, sxc, sxt, CHANNELS_INNER), mask=inside, other=0.0).to(tl.float32)
        y += tl.load(B2 + c).to(tl.float32)[:, None] + skip
        tl.store(OUT + row * (C * L) + c[:, None] * L + t[None, :], y.to(OUT.dtype.element_ty), mask=inside)
