"""Mimi's streaming state updates as single kernels on CUDA: the transposed convolutions' overlap-add, and the
decoder's reset of its idle rows at every tick.

A streaming transposed convolution overlap-adds its taps, adds the tail it kept, and keeps the new tail (a zero
fill, an add per tap shift, the bias, a concatenation, a subtraction and a copy): about seven launches of a few
microseconds each, on non-contiguous views, for each of the decoder's five. Here it is one Triton kernel per call,
with the torch ops as the reference and the CPU path; both do the same fp32 operations in the same order, so they
agree bit for bit. (The plain convolutions keep their whole input window as state and need no kernel: see
mimi_modules.py.)

The decode marks the rows that emitted nothing as fresh at every tick (model/batch_step.py): a masked fill of each
convolution's carried samples and of the ring's positions, thirteen launches and the mask's two, on every tick
whether a row is idle or not. Here it is one kernel, which reads the buffers through a device array of their
addresses (as model/embed_kernel.py reads its tables); a fill is a fill, so the state is the torch path's.
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


class StreamBuffers:
    """The device array the reset kernel reads: a row per buffer of its address, row stride, channel stride,
    channels and carried samples (launch.DeviceInts: uploaded before the engine captures its graphs, and again if a
    buffer moves)."""

    def __init__(self) -> None:
        self._records = launch.DeviceInts()

    def array(self, convs: list[Tensor], carried: list[int]) -> Tensor:
        first = convs[0]

        def check() -> None:
            if any(t.dtype != first.dtype or t.device != first.device or t.dim() != 3 or t.stride(2) != 1
                   or t.shape[0] != first.shape[0] for t in convs):
                raise ValueError("the buffers must be [B, C, L] of one dtype and device, their samples contiguous")

        records = tuple((t.data_ptr(), t.stride(0), t.stride(1), t.shape[1], n)
                        for t, n in zip(convs, carried, strict=True))
        return self._records.array(records, first.device, check)


def reset_idle_reference(convs: list[Tensor], carried: list[int], key_pos: Tensor, pos: Tensor, emitted: Tensor,
                         active: Tensor | None) -> None:
    """The rows that did not emit (of the active ones, given `active`) as fresh: their carried samples zero, their
    ring's slots empty and position 0 (the values left in place: nothing reads an empty slot). Torch's ops: the CPU
    path, and the oracle for the kernel."""
    idle = ~emitted if active is None else active & ~emitted
    for buf, n in zip(convs, carried, strict=True):
        buf[..., :n].masked_fill_(idle[:, None, None], 0.0)
    key_pos.masked_fill_(idle[:, None], -1)
    pos.masked_fill_(idle, 0)


def reset_idle(convs: list[Tensor], carried: list[int], key_pos: Tensor, pos: Tensor, emitted: Tensor,
               active: Tensor | None, arrays: StreamBuffers) -> None:
    """`reset_idle_reference`'s state: the kernel on CUDA, torch's ops elsewhere."""
    if not use_kernel(emitted.device):
        reset_idle_reference(convs, carried, key_pos, pos, emitted, active)
        return
    reset_idle_triton(convs, carried, key_pos, pos, emitted, active, arrays)


def reset_idle_triton(convs: list[Tensor], carried: list[int], key_pos: Tensor, pos: Tensor, emitted: Tensor,
                      active: Tensor | None, arrays: StreamBuffers) -> None:
    """The reset as the Triton kernel, on whatever device Triton runs (CUDA; the CPU through its interpreter): one
    program per buffer and row, and one per row for the ring's positions."""
    rows = emitted.shape[0]
    assert key_pos.stride(1) == 1 and all(t.shape[0] == rows for t in (*convs, key_pos, pos))
    largest = max(t.shape[1] * n for t, n in zip(convs, carried, strict=True))
    _reset_idle_kernel[(len(convs) + 1, rows)](
        arrays.array(convs, carried), emitted, emitted if active is None else active, key_pos, pos, key_pos.stride(0),
        pos.stride(0), key_pos.shape[1], len(convs), HAS_ACTIVE=active is not None,
        BLOCK=triton.next_power_of_2(largest), SLOTS=triton.next_power_of_2(key_pos.shape[1]),
        DTYPE=_TRITON_DTYPES[convs[0].dtype], **launch.arguments(emitted.device), num_warps=4,
    )


if triton is not None:
    _TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _reset_idle_kernel(BUFFERS, EMITTED, ACTIVE, KEY_POS, POS, s_key_pos, s_pos, slots, buffers,
                           HAS_ACTIVE: tl.constexpr, BLOCK: tl.constexpr, SLOTS: tl.constexpr, DTYPE: tl.constexpr,
                           PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        i = tl.program_id(0)
        row = tl.program_id(1)
        idle = tl.load(EMITTED + row) == 0
        if HAS_ACTIVE:
            idle = idle & (tl.load(ACTIVE + row) != 0)
        if idle:
            if i < buffers:
                base = tl.load(BUFFERS + i * 5).to(tl.pointer_type(DTYPE))
                row_stride = tl.load(BUFFERS + i * 5 + 1)
                channel_stride = tl.load(BUFFERS + i * 5 + 2)
                channels = tl.load(BUFFERS + i * 5 + 3)
                carried = tl.load(BUFFERS + i * 5 + 4)
                e = tl.arange(0, BLOCK)
                offsets = row.to(tl.int64) * row_stride + (e // carried) * channel_stride + e % carried
                tl.store(base + offsets, tl.zeros([BLOCK], dtype=DTYPE), mask=e < channels * carried)
            else:
                k = tl.arange(0, SLOTS)
                tl.store(KEY_POS + row.to(tl.int64) * s_key_pos + k, tl.full([SLOTS], -1, tl.int64), mask=k < slots)
                tl.store(POS + row * s_pos, 0)


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
