"""A SEANet downsampling convolution's streaming step, with the ELU before it, as one Triton kernel (opt-in:
`Mimi.with_fused_seanet`).

In torch the step is three passes over its input: the ELU written into the convolution's window, the window
unfolded into a matrix of every output frame's inputs (a copy twice the input's size: the kernel is twice the
stride), and the product reading that matrix. At 250 rows the encoder's first one reads 64 channels x 1,920
samples a row (123 MB in float32) and so moves about 0.9 GB a step. Here each program computes a tile of output
frames for a block of output channels as an implicit product: it reads the input where it lies, applies the ELU as
it loads, and accumulates each tap's product in registers; the step reads its input once and writes its output.

Arithmetic: the product accumulates in fp32 over the taps in another order than cuBLAS's over the unfolded matrix,
with TF32 inputs for a float32 convolution as the torch path's, so outputs agree within TF32's rounding, not bit
for bit. The output is [B, C_out, frames] with time contiguous (the torch path leaves it transposed).
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

INPUT_BLOCK = 64  # input channels a product takes at once


@dataclass(frozen=True)
class Tile:
    """A program's share: `frames` output frames (a power of two >= 16, for tl.dot) of `channels` output channels,
    with `warps`. Not tuned on a GPU yet."""

    frames: int = 32
    channels: int = 128
    warps: int = 8


TILE = Tile()


def fits(in_channels: int, out_channels: int, stride: int) -> bool:
    """Whether a strided convolution of these widths can run as the kernel: the encoder's first two (64 -> 128 and
    128 -> 256 channels, the widest activations); the later ones' few frames gain little from it."""
    return stride > 1 and in_channels in (64, 128) and out_channels % TILE.channels == 0


def fused_strided_step(x: Tensor, window: Tensor, conv: torch.nn.Conv1d, alpha: float | None) -> Tensor:
    """One streaming step of a strided causal convolution over x [B, C_in, L] (time or channels contiguous; L a
    multiple of the stride and at least the context), the ELU of `alpha` applied to x first when given: the output
    [B, C_out, L / stride], contiguous.

    `window` is the convolution's streaming state as `CausalConv1d` keeps it: its first `context` samples are the
    (ELU'd) input kept from the last step; they are read here and replaced by this step's last ones. The rest of
    the window is not used.
    """
    b, c_in, length = x.shape
    c_out, _, k = conv.weight.shape
    stride = conv.stride[0]
    context = k - stride
    frames = length // stride
    assert 1 in x.stride()[1:] and length == frames * stride and length >= context > 0
    assert fits(c_in, c_out, stride) and conv.bias is not None and conv.weight.is_contiguous()
    out = torch.empty(b, c_out, frames, device=x.device, dtype=x.dtype)
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32  # as the torch path's product
    grid = (b, triton.cdiv(frames, TILE.frames), c_out // TILE.channels)
    _strided_kernel[grid](
        x, window, conv.weight, conv.bias, out, frames, x.stride(0), x.stride(1), x.stride(2), window.stride(0),
        window.stride(1), window.stride(2), 1.0 if alpha is None else alpha,
        C_IN=c_in, C_OUT=c_out, K=k, STRIDE=stride, CONTEXT=context, HAS_ELU=alpha is not None,
        CHANNELS_INNER=x.stride(2) != 1, BLOCK_L=TILE.frames, BLOCK_CO=TILE.channels, BLOCK_CI=INPUT_BLOCK,
        PRECISION="ieee" if ieee else None, num_warps=TILE.warps,
    )
    kept = x[..., length - context :]
    if alpha is None:
        window[..., :context].copy_(kept)
    else:
        torch.ops.aten.elu.out(kept, alpha, out=window[..., :context])
    return out


if triton is not None:

    @triton.jit
    def _strided_kernel(X, WINDOW, W, BIAS, OUT, L_OUT, sxb, sxc, sxt, swb, swc, swt, alpha,
                        C_IN: tl.constexpr, C_OUT: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
                        CONTEXT: tl.constexpr, HAS_ELU: tl.constexpr, CHANNELS_INNER: tl.constexpr,
                        BLOCK_L: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr,
                        PRECISION: tl.constexpr):
        row = tl.program_id(0)
        frame = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        co = tl.program_id(2) * BLOCK_CO + tl.arange(0, BLOCK_CO)
        inside = (frame < L_OUT)[None, :]
        dtype = W.dtype.element_ty
        acc = tl.zeros([BLOCK_CO, BLOCK_L], dtype=tl.float32)
        for first_ci in tl.static_range(0, C_IN, BLOCK_CI):
            ci = first_ci + tl.arange(0, BLOCK_CI)
            for tap in tl.static_range(K):
                # Input sample frame * STRIDE + tap - CONTEXT of this step; before its start, the window's kept ones.
                src = frame * STRIDE + tap - CONTEXT
                kept = (src < 0)[None, :]
                if CHANNELS_INNER:
                    at = X + row * sxb + ci[:, None] + src[None, :] * sxt
                else:
                    at = X + row * sxb + ci[:, None] * sxc + src[None, :]
                fresh = tl.load(at, mask=inside & ~kept, other=0.0).to(tl.float32)
                if HAS_ELU:
                    fresh = tl.where(fresh > 0, fresh, alpha * (tl.exp(fresh) - 1.0))
                old = tl.load(WINDOW + row * swb + ci[:, None] * swc + (src + CONTEXT)[None, :] * swt,
                              mask=inside & kept, other=0.0).to(tl.float32)
                taken = tl.where(kept, old, fresh)
                weight = tl.load(W + co[:, None] * (C_IN * K) + ci[None, :] * K + tap)  # W [C_out, C_in, K]
                acc = tl.dot(weight, taken.to(dtype), acc, input_precision=PRECISION)
        acc += tl.load(BIAS + co).to(tl.float32)[:, None]
        tl.store(OUT + row * (C_OUT * L_OUT) + co[:, None] * L_OUT + frame[None, :], acc.to(OUT.dtype.element_ty),
                 mask=inside)
