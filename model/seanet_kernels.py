"""Mimi's SEANet streaming steps where its activations are largest, each as one Triton kernel
(`Mimi.with_fused_seanet`; `EngineConfig.mimi_fused_decoder`, on, and `mimi_fused_encoder`, off).

At 250 rows the encoder's first stage holds 64 channels x 1,920 samples a row (123 MB in float32) and the decoder's
last the same in bf16, and the torch path makes several passes over each: an ELU written into a convolution's
window, the convolution, layout copies, residual adds, a strided convolution's unfolded input (twice the input's
size) or a transposed one's taps (kernel / stride times its output) written and read back. Each kernel here takes a
tile of a row through a whole step in registers, reading its input once and writing its output once:

- a residual unit, x + conv1x1(elu(conv_k(elu(x)))): both products, both ELUs and the skip (`fused_residual_step`;
  the units of 32-128 channels);
- a downsampling convolution with the ELU before it, as an implicit product over the input where it lies
  (`fused_strided_step`; the encoder's first two);
- an upsampling (transposed) convolution with the ELU before it: one product per kernel shift whose rows are an
  output channel's stride offsets, the bias and the kept tail added as it stores (`fused_transposed_step`; the
  decoder's last two);
- a convolution to or from one channel, the encoder's first (audio -> 64 channels) and the decoder's last (64
  channels -> audio, with the ELU before it), as sums over broadcast products (`fused_thin_step`): cuDNN converts
  the decoder's 64-channel input to its own layout and back.

Each keeps the torch path's streaming state (model/mimi_modules.py), so either path can take a step. The products
accumulate in fp32 (TF32 inputs for float32 steps where the torch path's products use TF32, bf16 inputs for bf16
steps), in other orders than cuDNN's and cuBLAS's, and nothing is rounded to the activations' dtype between a
step's parts: outputs agree with the torch path's within that rounding, not bit for bit. The default tiles were
the fastest of the few timed on the H200 at 250 rows (`bench.mimi_step --fused ... --residual-tiles ...`;
docs/benchmarks.md): the residual units and the convolution to audio gain, the strided ones break even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

INPUT_BLOCK = 64  # input channels a convolution's product takes at once


@dataclass(frozen=True)
class ResidualTile:
    """A residual program's share: `samples` of one row (a power of two >= 16, for tl.dot) over all its channels,
    with `warps` for each 64 channels."""

    samples: int = 64
    warps: int = 4


@dataclass(frozen=True)
class StridedTile:
    """A downsampling program's share: `frames` output frames (a power of two >= 16) of `channels` output channels,
    with `warps`."""

    frames: int = 32
    channels: int = 128
    warps: int = 8


@dataclass(frozen=True)
class ThinTile:
    """A one-channel convolution's program: `samples` of one row, with `warps`."""

    samples: int = 128
    warps: int = 4


@dataclass(frozen=True)
class TransposedTile:
    """An upsampling program's share: `frames` output frames (a power of two >= 16) of as many output channels as
    give `rows` product rows (a channel's stride offsets, padded to a power of two, are its rows), with `warps`."""

    frames: int = 32
    rows: int = 256
    warps: int = 8

    def channels(self, stride: int) -> int:
        return self.rows // padded(stride)


RESIDUAL_TILE, STRIDED_TILE, TRANSPOSED_TILE, THIN_TILE = ResidualTile(), StridedTile(), TransposedTile(), ThinTile()


def padded(stride: int) -> int:
    """The stride rounded up to a power of two (tl.arange's sizes are)."""
    return 1 << (stride - 1).bit_length()


def residual_fits(channels: int, hidden: int) -> bool:
    """Whether a residual unit of these widths can run as the kernel (its weights and tiles fit one program)."""
    return channels in (32, 64, 128) and hidden >= 16 and hidden & (hidden - 1) == 0


def strided_fits(in_channels: int, out_channels: int, stride: int) -> bool:
    """Whether a strided convolution can run as the kernel: the encoder's first two (64 -> 128 and 128 -> 256
    channels, the widest activations); the later ones' few frames gain little from it."""
    return stride > 1 and in_channels in (64, 128) and out_channels % STRIDED_TILE.channels == 0


def thin_fits(in_channels: int, out_channels: int, stride: int, dilation: int) -> bool:
    """Whether a convolution can run as the one-channel kernel: to or from one channel, the other side 64 at most
    (its [channels, samples] tile is the program's), neither strided nor dilated."""
    return (stride == dilation == 1 and 1 in (in_channels, out_channels)
            and max(in_channels, out_channels) in (2, 4, 8, 16, 32, 64))


def transposed_fits(in_channels: int, out_channels: int, kernel: int, stride: int, groups: int) -> bool:
    """Whether a transposed convolution can run as the kernel: dense, the kernel a multiple of the stride, and the
    decoder's last two (256 -> 128 and 128 -> 64 channels)."""
    return (groups == 1 and kernel % stride == 0 and in_channels in (128, 256)
            and out_channels % TRANSPOSED_TILE.channels(stride) == 0)


def _precision(x: Tensor, tf32: bool) -> str | None:
    """tl.dot's input precision: the torch path's for a float32 step (TF32 where `tf32` allows it), else the
    inputs' own."""
    return "ieee" if x.dtype == torch.float32 and not tf32 else None


def _keep(x: Tensor, window: Tensor, context: int, alpha: float | None) -> None:
    """A convolution's window after a step: its first `context` samples, the next step's kept input, are this
    step's last (ELU'd where an ELU comes before the convolution), as the torch path leaves them."""
    kept = x[..., x.shape[-1] - context :]
    if alpha is None:
        window[..., :context].copy_(kept)
    else:
        torch.ops.aten.elu.out(kept, alpha, out=window[..., :context])


def taps_first(weight: Tensor) -> Tensor:
    """A convolution's weight [C_out, C_in, K] as the kernels read it, [K, C_out, C_in] contiguous: a kernel's
    [C_out, C_in] tile of one tap is then read along C_in, where torch's layout puts its neighbours K apart. A copy
    of the weight's size, made once as a layer is fused (`fuse()` in model/mimi_modules.py), not every step."""
    return weight.detach().permute(2, 0, 1).contiguous()


def transposed_taps(weight: Tensor) -> Tensor:
    """A transposed convolution's weight [C_in, C_out, K] as its kernel reads it, [C_out, K, C_in] contiguous (made
    once, as `taps_first`)."""
    return weight.detach().permute(1, 2, 0).contiguous()


def fused_residual_step(x: Tensor, window: Tensor | None, conv: torch.nn.Conv1d, taps: Tensor,
                        conv_1x1: torch.nn.Conv1d, alpha: float, alpha_hidden: float) -> Tensor:
    """One streaming step of a residual unit over x [B, C, L] (time or channels contiguous, as a strided
    convolution's product leaves it; L >= the context): the output [B, C, L], contiguous.

    `window` is the first convolution's state as `CausalConv1d` keeps it (its first `context` samples the ELU'd
    input kept from the last step, read here and then replaced; the rest unused), None for a convolution of one tap.
    `taps` is `conv`'s weight as `taps_first` orders it.
    """
    b, c, length = x.shape
    hidden, _, k = conv.weight.shape
    dilation = conv.dilation[0]
    context = (k - 1) * dilation
    assert 1 in x.stride()[1:] and length >= context and (window is not None or not context)
    assert residual_fits(c, hidden) and conv.bias is not None and conv_1x1.bias is not None
    assert conv_1x1.weight.is_contiguous()
    out = torch.empty(b, c, length, device=x.device, dtype=x.dtype)
    window_strides = (0, 0, 0) if window is None else window.stride()  # never read without a context
    tile = RESIDUAL_TILE
    _residual_kernel[(b, triton.cdiv(length, tile.samples))](
        x, x if window is None else window, taps, conv.bias, conv_1x1.weight, conv_1x1.bias, out,
        length, *x.stride(), *window_strides, alpha, alpha_hidden, C=c, H=hidden, K=k, DILATION=dilation,
        CONTEXT=context, CHANNELS_INNER=x.stride(2) != 1, BLOCK_T=tile.samples,
        PRECISION=_precision(x, torch.backends.cudnn.allow_tf32), **launch.arguments(x.device),
        num_warps=max(1, tile.warps * c // 64),
    )
    if context:
        _keep(x, window, context, alpha)
    return out


def fused_strided_step(x: Tensor, window: Tensor, conv: torch.nn.Conv1d, taps: Tensor, alpha: float | None
                       ) -> Tensor:
    """One streaming step of a strided causal convolution over x [B, C_in, L] (time or channels contiguous; L a
    multiple of the stride and at least the context), the ELU of `alpha` applied to x first when given: the output
    [B, C_out, L / stride], contiguous (the torch path leaves it transposed). `window` and `taps` as for a residual
    unit."""
    b, c_in, length = x.shape
    c_out, _, k = conv.weight.shape
    stride = conv.stride[0]
    context = k - stride
    frames = length // stride
    assert 1 in x.stride()[1:] and length == frames * stride and length >= context > 0
    assert strided_fits(c_in, c_out, stride) and conv.bias is not None
    out = torch.empty(b, c_out, frames, device=x.device, dtype=x.dtype)
    tile = STRIDED_TILE
    _strided_kernel[(b, triton.cdiv(frames, tile.frames), c_out // tile.channels)](
        x, window, taps, conv.bias, out, frames, *x.stride(), *window.stride(),
        1.0 if alpha is None else alpha,
        C_IN=c_in, C_OUT=c_out, K=k, STRIDE=stride, CONTEXT=context, HAS_ELU=alpha is not None,
        CHANNELS_INNER=x.stride(2) != 1, BLOCK_L=tile.frames, BLOCK_CO=tile.channels, BLOCK_CI=INPUT_BLOCK,
        PRECISION=_precision(x, torch.backends.cuda.matmul.allow_tf32), **launch.arguments(x.device),
        num_warps=tile.warps,
    )
    _keep(x, window, context, alpha)
    return out


def fused_thin_step(x: Tensor, window: Tensor, conv: torch.nn.Conv1d, taps: Tensor, alpha: float | None) -> Tensor:
    """One streaming step of a causal convolution to or from one channel over x [B, C_in, L] (time or channels
    contiguous; L >= the context), the ELU of `alpha` applied to x first when given: the output [B, C_out, L],
    contiguous. `window` and `taps` as for a residual unit."""
    b, c_in, length = x.shape
    c_out, _, k = conv.weight.shape
    context = k - 1
    assert 1 in x.stride()[1:] and length >= context > 0
    assert thin_fits(c_in, c_out, conv.stride[0], conv.dilation[0]) and conv.bias is not None
    out = torch.empty(b, c_out, length, device=x.device, dtype=x.dtype)
    tile = THIN_TILE
    _thin_kernel[(b, triton.cdiv(length, tile.samples))](
        x, window, taps, conv.bias, out, length, *x.stride(), *window.stride(),
        1.0 if alpha is None else alpha,
        C_IN=c_in, C_OUT=c_out, K=k, CONTEXT=context, HAS_ELU=alpha is not None, CHANNELS_INNER=x.stride(2) != 1,
        BLOCK_T=tile.samples, **launch.arguments(x.device), num_warps=tile.warps,
    )
    _keep(x, window, context, alpha)
    return out


def fused_transposed_step(x: Tensor, tail: Tensor, convtr: torch.nn.ConvTranspose1d, taps: Tensor,
                          alpha: float | None) -> Tensor:
    """One streaming step of a transposed convolution over x [B, C_in, T] (time or channels contiguous), the ELU
    of `alpha` applied to x first when given: the output [B, C_out, T * stride], contiguous. `tail` [B, C_out,
    kernel - stride] (CausalConvTranspose1d's state) is added to the output's start and then holds the part that
    overruns this step, without the bias, as `overlap_add` leaves it. `taps` is `convtr`'s weight as
    `transposed_taps` orders it."""
    b, c_in, frames = x.shape
    _, c_out, k = convtr.weight.shape
    stride = convtr.stride[0]
    shifts = k // stride
    assert 1 in x.stride()[1:] and tail.is_contiguous() and frames * stride >= k - stride
    assert transposed_fits(c_in, c_out, k, stride, convtr.groups) and convtr.bias is not None
    out = torch.empty(b, c_out, frames * stride, device=x.device, dtype=x.dtype)
    new_tail = torch.empty_like(tail)  # the programs of the first frames still read the old one
    tile = TRANSPOSED_TILE
    block_co = tile.channels(stride)
    _transposed_kernel[(b, triton.cdiv(frames + shifts - 1, tile.frames), c_out // block_co)](
        x, tail, new_tail, taps, convtr.bias, out, frames, *x.stride(),
        1.0 if alpha is None else alpha,
        C_IN=c_in, C_OUT=c_out, K=k, STRIDE=stride, PADDED_STRIDE=padded(stride), SHIFTS=shifts,
        HAS_ELU=alpha is not None, CHANNELS_INNER=x.stride(2) != 1, BLOCK_T=tile.frames, BLOCK_CO=block_co,
        BLOCK_CI=INPUT_BLOCK, PRECISION=_precision(x, torch.backends.cuda.matmul.allow_tf32),
        **launch.arguments(x.device), num_warps=tile.warps,
    )
    tail.copy_(new_tail)
    return out


if triton is not None:

    @triton.jit
    def _elu(v, alpha):
        return tl.where(v > 0, v, alpha * (tl.exp(v) - 1.0))

    # Pointers to x[row, ch, t] for a [channels, samples] tile: the contiguous dimension's stride left out, so that
    # the compiler sees it and reads along it.
    @triton.jit
    def _x_at(X, row, ch, t, sxb, sxc, sxt, CHANNELS_INNER: tl.constexpr):
        if CHANNELS_INNER:
            return X + row * sxb + ch[:, None] + t[None, :] * sxt
        return X + row * sxb + ch[:, None] * sxc + t[None, :]

    # A convolution's input samples src of this step for channels ch, fp32: x's (ELU'd) from 0 on, the window's
    # kept ones before, as the torch path's window holds them; 0 outside `inside`.
    @triton.jit
    def _window_tile(X, WINDOW, row, ch, src, inside, sxb, sxc, sxt, swb, swc, swt, alpha,
                     CONTEXT: tl.constexpr, HAS_ELU: tl.constexpr, CHANNELS_INNER: tl.constexpr):
        kept = (src < 0)[None, :]
        fresh = tl.load(_x_at(X, row, ch, src, sxb, sxc, sxt, CHANNELS_INNER), mask=inside & ~kept,
                        other=0.0).to(tl.float32)
        if HAS_ELU:
            fresh = _elu(fresh, alpha)
        old = tl.load(WINDOW + row * swb + ch[:, None] * swc + (src + CONTEXT)[None, :] * swt, mask=inside & kept,
                      other=0.0).to(tl.float32)
        return tl.where(kept, old, fresh)

    @triton.jit
    def _residual_kernel(X, WINDOW, W1, B1, W2, B2, OUT, L, sxb, sxc, sxt, swb, swc, swt, alpha, alpha_hidden,
                         C: tl.constexpr, H: tl.constexpr, K: tl.constexpr, DILATION: tl.constexpr,
                         CONTEXT: tl.constexpr, CHANNELS_INNER: tl.constexpr, BLOCK_T: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, C)
        h = tl.arange(0, H)
        inside = (t < L)[None, :]
        dtype = W1.dtype.element_ty
        hidden = tl.zeros([H, BLOCK_T], dtype=tl.float32)
        for tap in tl.static_range(K):
            taken = _window_tile(X, WINDOW, row, c, t + tap * DILATION - CONTEXT, inside, sxb, sxc, sxt, swb, swc,
                                 swt, alpha, CONTEXT, True, CHANNELS_INNER)
            weight = tl.load(W1 + tap * (H * C) + h[:, None] * C + c[None, :])  # W1 [K, H, C]
            hidden = tl.dot(weight, taken.to(dtype), hidden, input_precision=PRECISION)
        hidden = _elu(hidden + tl.load(B1 + h).to(tl.float32)[:, None], alpha_hidden)
        weight = tl.load(W2 + c[:, None] * H + h[None, :])  # W2 [C, H, 1]
        y = tl.dot(weight, hidden.to(dtype), input_precision=PRECISION)
        skip = tl.load(_x_at(X, row, c, t, sxb, sxc, sxt, CHANNELS_INNER), mask=inside, other=0.0).to(tl.float32)
        y += tl.load(B2 + c).to(tl.float32)[:, None] + skip
        tl.store(OUT + row * (C * L) + c[:, None] * L + t[None, :], y.to(OUT.dtype.element_ty), mask=inside)

    @triton.jit
    def _strided_kernel(X, WINDOW, W, BIAS, OUT, L_OUT, sxb, sxc, sxt, swb, swc, swt, alpha,
                        C_IN: tl.constexpr, C_OUT: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
                        CONTEXT: tl.constexpr, HAS_ELU: tl.constexpr, CHANNELS_INNER: tl.constexpr,
                        BLOCK_L: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        frame = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        co = tl.program_id(2) * BLOCK_CO + tl.arange(0, BLOCK_CO)
        inside = (frame < L_OUT)[None, :]
        dtype = W.dtype.element_ty
        acc = tl.zeros([BLOCK_CO, BLOCK_L], dtype=tl.float32)
        for first_ci in tl.static_range(0, C_IN, BLOCK_CI):
            ci = first_ci + tl.arange(0, BLOCK_CI)
            for tap in tl.static_range(K):
                taken = _window_tile(X, WINDOW, row, ci, frame * STRIDE + tap - CONTEXT, inside, sxb, sxc, sxt, swb,
                                     swc, swt, alpha, CONTEXT, HAS_ELU, CHANNELS_INNER)
                weight = tl.load(W + tap * (C_OUT * C_IN) + co[:, None] * C_IN + ci[None, :])  # W [K, C_out, C_in]
                acc = tl.dot(weight, taken.to(dtype), acc, input_precision=PRECISION)
        acc += tl.load(BIAS + co).to(tl.float32)[:, None]
        tl.store(OUT + row * (C_OUT * L_OUT) + co[:, None] * L_OUT + frame[None, :], acc.to(OUT.dtype.element_ty),
                 mask=inside)

    # A convolution from one channel (the encoder's first: C_OUT wide) or to one (the decoder's last: C_IN wide):
    # with one side a single channel there is no product to take, only broadcast multiplies summed over the taps
    # (and for the decoder's, over its channels once at the end). No tile has a dimension of one: with [C_OUT, 1,
    # T] broadcasts reduced over that axis, CUDA's code gave wrong outputs where the interpreter's were right.
    @triton.jit
    def _thin_kernel(X, WINDOW, W, BIAS, OUT, L, sxb, sxc, sxt, swb, swc, swt, alpha, C_IN: tl.constexpr,
                     C_OUT: tl.constexpr, K: tl.constexpr, CONTEXT: tl.constexpr, HAS_ELU: tl.constexpr,
                     CHANNELS_INNER: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        if C_IN == 1:
            co = tl.arange(0, C_OUT)
            acc = tl.zeros([C_OUT, BLOCK_T], dtype=tl.float32)
            for tap in tl.static_range(K):
                src = t + tap - CONTEXT
                kept = src < 0
                sample = tl.load(X + row * sxb + src * sxt, mask=(t < L) & ~kept, other=0.0).to(tl.float32)
                if HAS_ELU:
                    sample = _elu(sample, alpha)
                old = tl.load(WINDOW + row * swb + (src + CONTEXT) * swt, mask=(t < L) & kept, other=0.0)
                sample = tl.where(kept, old.to(tl.float32), sample)
                weight = tl.load(W + tap * C_OUT + co).to(tl.float32)  # W [K, C_OUT, 1]
                acc += weight[:, None] * sample[None, :]
            acc += tl.load(BIAS + co).to(tl.float32)[:, None]
            tl.store(OUT + row * (C_OUT * L) + co[:, None] * L + t[None, :], acc.to(OUT.dtype.element_ty),
                     mask=(t < L)[None, :])
        else:
            ci = tl.arange(0, C_IN)
            acc = tl.zeros([C_IN, BLOCK_T], dtype=tl.float32)
            for tap in tl.static_range(K):
                taken = _window_tile(X, WINDOW, row, ci, t + tap - CONTEXT, (t < L)[None, :], sxb, sxc, sxt, swb,
                                     swc, swt, alpha, CONTEXT, HAS_ELU, CHANNELS_INNER)  # [C_IN, BLOCK_T]
                weight = tl.load(W + tap * C_IN + ci).to(tl.float32)  # W [K, 1, C_IN]
                acc += weight[:, None] * taken
            y = tl.sum(acc, axis=0) + tl.load(BIAS).to(tl.float32)
            tl.store(OUT + row * L + t, y.to(OUT.dtype.element_ty), mask=t < L)

    @triton.jit
    def _transposed_kernel(X, TAIL, NEW_TAIL, W, BIAS, OUT, T, sxb, sxc, sxt, alpha,
                           C_IN: tl.constexpr, C_OUT: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
                           PADDED_STRIDE: tl.constexpr, SHIFTS: tl.constexpr, HAS_ELU: tl.constexpr,
                           CHANNELS_INNER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,
                           BLOCK_CI: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
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
                a = tl.load(_x_at(X, row, ci, src, sxb, sxc, sxt, CHANNELS_INNER),
                            mask=((src >= 0) & (src < T))[None, :], other=0.0).to(tl.float32)
                if HAS_ELU:
                    a = _elu(a, alpha)
                # W [C_out, K, C_in]: tap shift * STRIDE + offset of channel co, as rows (co, offset).
                weight = tl.load(W + co[:, None] * (K * C_IN) + (shift * STRIDE + offset)[:, None] * C_IN + ci[None, :],
                                 mask=real, other=0.0)
                acc = tl.dot(weight, a.to(dtype), acc, input_precision=PRECISION)
        overlap = K - STRIDE
        sample = u[None, :] * STRIDE + offset[:, None]  # in this step's output; >= T * STRIDE: in the new tail
        tail_at = row * (C_OUT * overlap) + co[:, None] * overlap + sample
        old = tl.load(TAIL + tail_at, mask=real & (sample < overlap), other=0.0).to(tl.float32)
        y = acc + tl.load(BIAS + co).to(tl.float32)[:, None] + old
        tl.store(OUT + row * (C_OUT * T * STRIDE) + co[:, None] * (T * STRIDE) + sample, y.to(OUT.dtype.element_ty),
                 mask=real & (u < T)[None, :])
        spill = real & (u >= T)[None, :] & (u < T + SHIFTS - 1)[None, :]
        tl.store(NEW_TAIL + tail_at - T * STRIDE, acc.to(NEW_TAIL.dtype.element_ty), mask=spill)
