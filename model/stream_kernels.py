"""The streaming state update of Mimi's transposed convolutions, one kernel on CUDA.

A streaming transposed convolution overlap-adds its taps, adds the tail it kept, and keeps the new tail (a zero
fill, an add per tap shift, the bias, a concatenation, a subtraction and a copy): about seven launches of a few
microseconds each, on non-contiguous views, for each of the decoder's five. Here it is one Triton kernel per call,
with the torch ops as the reference and the CPU path; both do the same fp32 operations in the same order, so they
agree bit for bit. (The plain convolutions keep their whole input window as state and need no kernel: see
mimi_modules.py.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from model import launch
from model.attention import use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def overlap_add_reference(taps: Tensor, tail: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """overlap_add through torch ops (CPU, and the oracle for the kernel); sums in fp32 whatever the dtype."""
    b, c, t, k = taps.shape
    shifts = k // stride
    parts = taps.unflatten(-1, (shifts, stride))
    y = taps.new_zeros(b, c, (t + shifts - 1) * stride, dtype=torch.float32)
    for i in range(shifts):  # tap group i of input frame j lands on output frame j + i
        y[..., i * stride : (t + i) * stride] += parts[:, :, :, i].flatten(-2)
    if bias is not None:
        y = y + bias[:, None]
    n, overlap = t * stride, k - stride
    out = torch.cat([y[..., :overlap] + tail, y[..., overlap:n]], dim=-1).to(taps.dtype)
    rest = y[..., n:]
    if bias is not None:
        # The next call's outputs carry the bias again; keep it only once.
        rest = rest - bias[:, None]
    tail.copy_(rest)
    return out


def overlap_add(taps: Tensor, tail: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """A streaming transposed convolution's output from its taps [B, C, T, K] (input frame t's contribution to
    output samples t * stride .. t * stride + K - 1): [B, C, T * stride], the kept `tail` [B, C, K - stride] added
    to its start; `tail` then holds the part that overruns this call (without the bias, which the next call adds).
    """
    if not use_kernel(taps.device):
        return overlap_add_reference(taps, tail, bias, stride)
    return overlap_add_triton(taps, tail, bias, stride)


def overlap_add_triton(taps: Tensor, tail: Tensor, bias: Tensor | None, stride: int) -> Tensor:
    """overlap_add as the Triton kernel, on whatever device Triton runs (CUDA; the CPU through its interpreter)."""
    b, c, t, k = taps.shape
    overlap = k - stride
    assert t * stride >= overlap and tail.is_contiguous() and tail.shape[-1] == overlap
    out = torch.empty(b, c, t * stride, device=taps.device, dtype=taps.dtype)
    _overlap_add_kernel[(b * c,)](
        taps, tail, tail if bias is None else bias, out, c, t, taps.stride(0), taps.stride(1), taps.stride(2),
        taps.stride(3), overlap, STRIDE=stride, SHIFTS=k // stride, HAS_BIAS=bias is not None,
        BLOCK=triton.next_power_of_2(t * stride + overlap), **launch.arguments(taps.device), num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _overlap_add_kernel(TAPS, TAIL, BIAS, OUT, C, T, stb, stc, stt, stk, OVERLAP,
                            STRIDE: tl.constexpr, SHIFTS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        b = row // C
        c = row % C
        p = tl.arange(0, BLOCK)
        n = T * STRIDE
        frame = p // STRIDE
        offset = p % STRIDE
        y = tl.zeros([BLOCK], dtype=tl.float32)
        for i in tl.static_range(SHIFTS):  # in the reference's order: shift 0's taps first
            f = frame - i
            y += tl.load(TAPS + b * stb + c * stc + f * stt + (i * STRIDE + offset) * stk,
                         mask=(f >= 0) & (f < T), other=0.0)
        if HAS_BIAS:
            bias = tl.load(BIAS + c)
            y = y + bias
        head = p < OVERLAP
        tail = tl.load(TAIL + row * OVERLAP + p, mask=head, other=0.0)
        tl.store(OUT + row * n + p, tl.where(head, y + tail, y).to(OUT.dtype.element_ty), mask=p < n)
        tl.debug_barrier()  # every lane has read its part of the tail before any lane overwrites it
        if HAS_BIAS:
            y = y - bias
        tl.store(TAIL + row * OVERLAP + (p - n), y.to(TAIL.dtype.element_ty), mask=(p >= n) & (p < n + OVERLAP))
