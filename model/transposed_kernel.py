"""A SEANet upsampling (transposed) convolution's streaming step, with the ELU before it, as one Triton kernel
(opt-in: `Mimi.with_fused_seanet`).

In torch the step is four passes: the ELU, the input transposed into a matrix, the product writing every input
frame's taps (kernel / stride times the output's size), and the overlap-add reading them back (model/stream_kernels.py).
At 250 rows the decoder's last one writes 123 MB of taps to make 61 MB of audio-rate activations. Here each program
computes a tile of output frames for a block of output channels directly: for each of the kernel's shifts, one
product of the weights (rows: an output channel's `stride` offsets) with the ELU'd input frames that shift reaches,
accumulated in registers, the bias and the kept tail added as it stores. The state is the torch path's: the tail of
the last call's overlap, without the bias.

Arithmetic: the taps are summed in fp32 without being rounded to the activation's dtype first, so the outputs agree
with the torch path's within that dtype's rounding, not bit for bit.
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
    """A program's share: `frames` output frames (a power of two >= 16, for tl.dot) of as many output channels as
    give `rows` product rows (a channel's `stride` offsets, padded to a power of two, are its rows), with `warps`.
    Not tuned on a GPU yet."""

    frames: int = 32
    rows: int = 256
    warps: int = 8

    def channels(self, stride: int) -> int:
        return self.rows // padded(stride)


TILE = Tile()


def padded(stride: int) -> int:
    """The stride rounded up to a power of two (tl.arange's sizes are)."""
    return 1 << (stride - 1).bit_length()


def fits(in_channels: int, out_channels: int, kernel: int, stride: int, groups: int) -> bool:
    """Whether a transposed convolution can run as the kernel: dense, the kernel a multiple of the stride, and the
    decoder's last two (256 -> 128 and 128 -> 64 channels, the widest activations)."""
    return (groups == 1 and kernel % stride == 0 and in_channels in (128, 256)
            and out_channels % TILE.channels(stride) == 0)


def fused_transposed_step(x: Tensor, tail: Tensor, convtr: torch.nn.ConvTranspose1d, alpha: float | None) -> Tensor:
    """One streaming step of a transposed convolution over x [B, C_in, T] (time or channels contiguous), the ELU
    of `alpha` applied to x first when given: the output [B, C_out, T * stride], contiguous. `tail` [B, C_out,
    kernel - stride] (CausalConvTranspose1d's state) is added to the output's start and then holds the part that
    overruns this step, without the bias, as `overlap_add` leaves it."""
    b, c_in, frames = x.shape
    _, c_out, k = convtr.weight.shape
    stride = convtr.stride[0]
    shifts = k // stride
    assert 1 in x.stride()[1:] and tail.is_contiguous() and frames * stride >= k - stride
    assert fits(c_in, c_out, k, stride, convtr.groups) and convtr.bias is not None and convtr.weight.is_contiguous()
    out = torch.empty(b, c_out, frames * stride, device=x.device, dtype=x.dtype)
    new_tail = torch.empty_like(tail)  # the programs of the first frames still read the old one
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32  # as the torch path's product
    block_co = TILE.channels(stride)
    grid = (b, triton.cdiv(frames + shifts - 1, TILE.frames), c_out // block_co)
    _transposed_kernel[grid](
        x, tail, new_tail, convtr.weight, convtr.bias, out, frames, x.stride(0), x.stride(1), x.stride(2),
        1.0 if alpha is None else alpha, C_IN=c_in, C_OUT=c_out, K=k, STRIDE=stride,
        PADDED_STRIDE=padded(stride), SHIFTS=shifts, HAS_ELU=alpha is not None,
        CHANNELS_INNER=x.stride(2) != 1, BLOCK_T=TILE.frames, BLOCK_CO=block_co, BLOCK_CI=INPUT_BLOCK,
        PRECISION="ieee" if ieee else None, num_warps=TILE.warps,
    )
    tail.copy_(new_tail)
    return out


if triton is not None:

    @triton.jit
    def _transposed_kernel(X, TAIL, NEW_TAIL, W, BIAS, OUT, T, sxb, sxc, sxt, alpha,
                           C_IN: tl.constexpr, C_OUT: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
                           PADDED_STRIDE: tl.constexpr, SHIFTS: tl.constexpr, HAS_ELU: tl.constexpr,
                           CHANNELS_INNER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,
                           BLOCK_CI: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        # Output frame u covers output samples u * STRIDE + offset; frames from T on are the overrun: the new tail.
        u = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        r = tl.arange(0, BLOCK_CO * PADDED_STRIDE)  # an output channel's offsets side by side
        co = tl.program_id(2) * BLOCK_CO + r // PADDED_STRIDE
        offset = r % PADDED_STRIDE
        real = (offset < STRIDE)[:, None]
        dtype = W.dtype.element_ty
        acc = tl.zeros([BLOCK_CO * PADDED_STRIDE, BLOCK_T], dtype=tl.float32)
        for first_ci in tl.static_range(0, C_IN, BLOCK_CI):
            ci = first_ci + tl.arange(0, BLOCK_CI)
            for shift in tl.static_range(SHIFTS):
                # Shift `shift` of input frame u - shift lands on output frame u; earlier frames are in the tail.
                src = u - shift
                if CHANNELS_INNER:
                    at = X + row * sxb + ci[:, None] + src[None, :] * sxt
                else:
                    at = X + row * sxb + ci[:, None] * sxc + src[None, :]
                a = tl.load(at, mask=((src >= 0) & (src < T))[None, :], other=0.0).to(tl.float32)
                if HAS_ELU:
                    a = tl.where(a > 0, a, alpha * (tl.exp(a) - 1.0))
                # W [C_in, C_out, K]: tap shift * STRIDE + offset of channel co, as rows (co, offset).
                weight = tl.load(W + ci[None, :] * (C_OUT * K) + co[:, None] * K + (shift * STRIDE + offset)[:, None],
                                 mask=real, other=0.0)
                acc = tl.dot(weight, a.to(dtype), acc, input_precision=PRECISION)
        overlap = K - STRIDE
        sample = u[None, :] * STRIDE + offset[:, None]  # in this step's output; >= T * STRIDE: in the new tail
        tail_at = row * (C_OUT * overlap) + co[:, None] * overlap + sample
        old = tl.load(TAIL + tail_at, mask=real & (sample < overlap), other=0.0).to(tl.float32)
        y = acc + tl.load(BIAS + co).to(tl.float32)[:, None] + old
        ours = real & (u < T)[None, :]
        tl.store(OUT + row * (C_OUT * T * STRIDE) + co[:, None] * (T * STRIDE) + sample, y.to(OUT.dtype.element_ty),
                 mask=ours)
        spill = real & (u >= T)[None, :] & (u < T + SHIFTS - 1)[None, :]
        tl.store(NEW_TAIL + tail_at - T * STRIDE, acc.to(NEW_TAIL.dtype.element_ty), mask=spill)
