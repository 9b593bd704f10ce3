"""Decode attention over per-row ring KV caches kept in pages, and the optional FP8 storage of those caches.

A row's valid keys always sit in ring slots [0, n_valid) with n_valid = min(frames + 1, window): rows start empty
and fill slots in order, and once the ring wraps every slot is valid. So attention needs no mask, only a length per
row, and a kernel that stops at that length costs what the real context costs. Slot s of row r lives in page
table[r, s // page] (`KVStore`): the engine's pool hands pages to rows as they grow (model/engine/pages.py); a
contiguous store is one page per row. On CUDA a Triton split-K kernel
does this (several programs per (row, head) so that small batches still fill the GPU, partial softmaxes merged
after); elsewhere the same arithmetic runs through SDPA with a length mask.

FP8 storage (e4m3 with one fp32 scale per row, head and slot) halves the bytes a tick reads and the memory a
session holds; values are dequantised in the kernel.

Writing a step's keys and values also lives here (`rope_and_store`): on CUDA one kernel per layer rotates q and
k, quantises, and stores into each row's ring slot, through its page table too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model import launch
from model.fused import fusable
from model.rope import apply_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class KVStore:
    """One layer-stacked KV cache in pages: values [layers, pages, heads, page, head_dim] and, for FP8, scales
    [.., page]. `table` [B, slots / page] maps logical ring slot s of row r to offset s % page of page
    table[r, s // page].

    A contiguous store (`empty` without `pool_pages`) has one page of `slots` per row and an identity table: the
    layout of a plain [layers, B, heads, slots, head_dim] ring. A pool (`pool_pages`) starts with every table entry
    on page 0, a page never handed out: writes of inactive rows through an unmapped entry are masked, and it stays
    zero. The engine's page pool (model/engine/pages.py) maps and releases the rest.
    """

    k: Tensor
    v: Tensor
    k_scale: Tensor | None
    v_scale: Tensor | None
    table: Tensor  # [B, slots // page] long
    slots: int  # a row's logical ring slots

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def page(self) -> int:
        return self.k.shape[3]

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype, device, fp8: bool, page: int | None = None,
              pool_pages: int | None = None) -> KVStore:
        """shape = (layers, rows, heads, slots, head_dim); a pool of `pool_pages` pages of `page` slots, or
        contiguous rows."""
        layers, rows, heads, slots, head_dim = shape
        if pool_pages is None:
            page, pages = slots, rows
            table = torch.arange(rows, device=device).view(rows, 1)
        else:
            if slots % page:
                raise ValueError(f"a page of {page} slots does not divide a ring of {slots}")
            pages = pool_pages + 1
            table = torch.zeros(rows, slots // page, device=device, dtype=torch.long)
        values = (layers, pages, heads, page, head_dim)
        tensors = [torch.zeros(values, device=device, dtype=FP8 if fp8 else dtype) for _ in range(2)]
        scales = [torch.zeros(values[:-1], device=device) for _ in range(2)] if fp8 else [None, None]
        return cls(*tensors, *scales, table, slots)

    def rows(self, index: slice) -> KVStore:
        """A view of some batch rows (the pages are shared)."""
        return KVStore(self.k, self.v, self.k_scale, self.v_scale, self.table[index], self.slots)

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def locate(self, rows: Tensor | int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(page, offset) of each (row, slot)."""
        return self.table[rows, slots // self.page], slots % self.page

    def write(self, layer: int, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> None:
        """Store k, v [N, heads, head_dim] at (rows[i], slots[i]); where `keep` [N] is False the old entry stays."""
        pages, offsets = self.locate(rows, slots)
        for cache, scale, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            old = cache[layer, pages, :, offsets]
            if scale is None:
                value = new if keep is None else torch.where(keep.view(-1, 1, 1), new, old)
                cache[layer, pages, :, offsets] = value
                continue
            q, s = quantize(new)
            if keep is not None:
                q = torch.where(keep.view(-1, 1, 1), q.view(torch.uint8), old.view(torch.uint8)).view(FP8)
                s = torch.where(keep.view(-1, 1), s, scale[layer, pages, :, offsets])
            cache[layer, pages, :, offsets] = q
            scale[layer, pages, :, offsets] = s

    def write_span(self, layer: int, row: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [heads, T, head_dim] of one row at `slots` [T] (prefill)."""
        pages, offsets = self.locate(row, slots)
        for cache, scale, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scale is None:
                cache[layer, pages, :, offsets] = new.transpose(0, 1)
            else:
                q, s = quantize(new)
                cache[layer, pages, :, offsets] = q.transpose(0, 1)
                scale[layer, pages, :, offsets] = s.transpose(0, 1)

    def read_row(self, layer: int, row: int, dtype: torch.dtype, slots: int) -> tuple[Tensor, Tensor]:
        """One row's first `slots` ring slots [heads, slots, head_dim] in `dtype` (dequantised)."""
        pages, offsets = self.locate(row, torch.arange(slots, device=self.table.device))
        k, v = self.k[layer, pages, :, offsets].transpose(0, 1), self.v[layer, pages, :, offsets].transpose(0, 1)
        if not self.fp8:
            return k, v
        return (dequantize(k, self.k_scale[layer, pages, :, offsets].transpose(0, 1), dtype),
                dequantize(v, self.v_scale[layer, pages, :, offsets].transpose(0, 1), dtype))

    def read_slots(self, row: int, slots: int) -> list[Tensor]:
        """Every tensor's entries of one row's first `slots` slots, [layers, heads, slots(, head_dim)] each."""
        pages, offsets = self.locate(row, torch.arange(slots, device=self.table.device))
        return [t[:, pages, :, offsets].transpose(0, 1).transpose(1, 2) for t in self.tensors()]

    def write_slots(self, row: int, saved: list[Tensor]) -> None:
        """read_slots' entries back into one row's first slots."""
        pages, offsets = self.locate(row, torch.arange(saved[0].shape[2], device=self.table.device))
        for t, entries in zip(self.tensors(), saved, strict=True):
            t[:, pages, :, offsets] = entries.transpose(1, 2).transpose(0, 1)

    def gather(self, layer: int) -> tuple[Tensor, ...]:
        """Every row's ring of one layer through its table: [B, heads, slots(, head_dim)] per tensor."""
        out = []
        for t in self.tensors():
            rows = t[layer][self.table]  # [B, table pages, heads, page(, head_dim)]
            out.append(rows.transpose(1, 2).flatten(2, 3)[:, :, : self.slots])
        return tuple(out)

    def zero_rows(self, rows: Tensor) -> None:
        """Zero the pages that `rows` (bool [B]) map."""
        self.zero_pages(self.table[rows].flatten())

    def zero_pages(self, pages: Tensor) -> None:
        for t in self.tensors():
            _raw(t).index_fill_(1, pages, 0)

    def zero_slots(self, row: int, slots: slice) -> None:
        """Zero some ring slots of one row, in every layer."""
        indices = torch.arange(slots.start or 0, slots.stop, device=self.table.device)
        if indices.numel():
            pages, offsets = self.locate(row, indices)
            for t in self.tensors():
                _raw(t)[:, pages, :, offsets] = 0


def _raw(t: Tensor) -> Tensor:
    """`t` itself, or its bytes for fp8 (fills are not implemented for fp8)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


@fusable
def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., head_dim] -> (fp8 values, fp32 scale [...]) with the vector's max at the format's max."""
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale.unsqueeze(-1)).to(FP8), scale


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (x.float() * scale.unsqueeze(-1)).to(dtype)


def attention_reference(q: Tensor, store: KVStore, layer: int, n_valid: Tensor) -> Tensor:
    """q [B, heads, head_dim] over each row's first n_valid slots -> [B, heads, head_dim] (SDPA + length mask)."""
    k, v, *scales = store.gather(layer)
    if store.fp8:
        k = dequantize(k, scales[0], q.dtype)
        v = dequantize(v, scales[1], q.dtype)
    slots = torch.arange(k.shape[2], device=q.device)
    mask = (slots.view(1, -1) < n_valid.view(-1, 1)).view(q.shape[0], 1, 1, -1)
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask).squeeze(2)


def use_kernel(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


# Triton's interpreter runs kernels on the CPU (tests/conftest.py sets it where there is no GPU), so the kernels that
# the engine takes by a flag (Mimi's fused SEANet steps, the fused depformer) can be tested anywhere; the engine
# fuses them on CUDA only (model/engine/runner.py).
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class KernelConfig:
    """Launch shape of the decode kernel."""

    block: int = 64
    warps: int = 4
    stages: int = 3
    target_programs: int = 1024
    use_dot: bool = True


# The fastest shapes on the H200 at 64 rows x 3000 slots (bench/attention_kernel.py): bf16 through tensor cores
# matches cuDNN (4.3 TB/s); fp8 runs on CUDA cores as independent softmax streams (3.7 TB/s), since converting
# e4m3 for the tensor cores costs more than the dots.
KERNEL_BF16 = KernelConfig()
KERNEL_FP8 = KernelConfig(block=32, warps=1, stages=3, target_programs=2048, use_dot=False)


def split_length(batch: int, heads: int, slots: int, block: int = 64, target_programs: int = 1024) -> int:
    """Keys per program: enough programs to fill the GPU at small batch, long runs at large batch."""
    splits = max(1, min(math.ceil(slots / block), target_programs // max(1, batch * heads)))
    return math.ceil(math.ceil(slots / splits) / block) * block


def longest_first(n_valid: Tensor) -> Tensor:
    """Rows by valid keys, most first: the order decode_attention's programs start in.

    At 250 rows one program per (row, head) reads all its row's keys, and the GPU starts programs in launch order;
    with unequal contexts a long row launched last runs on alone at the end of every layer. Longest first, the
    end of a layer is short rows (the longest-processing-time-first schedule)."""
    return torch.argsort(n_valid, descending=True, stable=True)


def decode_attention(q: Tensor, store: KVStore, layer: int, n_valid: Tensor, order: Tensor | None = None) -> Tensor:
    """Attention of one query per row over its first n_valid ring slots; q [B, heads, head_dim]. `order` [B]: the
    rows in the order their programs launch (`longest_first`, made once a step); row order if None. It changes
    when each row's result is computed, not what it is."""
    if not use_kernel(q.device):
        return attention_reference(q, store, layer, n_valid)
    B, H, D = q.shape
    if order is None:
        order = torch.arange(B, device=q.device)
    slots = store.slots
    cfg = KERNEL_FP8 if store.fp8 else KERNEL_BF16
    block = min(cfg.block, 1 << (store.page.bit_length() - 1))  # a block spans two pages at most
    span = split_length(B, H, slots, block, cfg.target_programs)
    splits = math.ceil(slots / span)
    direct = splits == 1  # one program per (row, head): it normalises and writes the result, no merge
    if direct:
        acc = m = denom = torch.empty_like(q)
    else:
        acc = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
        m = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
        denom = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    k, v = store.k[layer], store.v[layer]
    ks = store.k_scale[layer] if store.fp8 else k
    vs = store.v_scale[layer] if store.fp8 else v
    table = store.table
    _partial_kernel[(B * H, splits)](
        q, k, v, ks, vs, n_valid, order, table, acc, m, denom,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), ks.stride(0), ks.stride(1), table.stride(0),
        table.shape[1], H, span, 1.0 / math.sqrt(D),
        HAS_SCALE=store.fp8, BLOCK_N=block, D=D, PAGE=store.page, STAGES=cfg.stages, USE_DOT=cfg.use_dot,
        DIRECT=direct, **launch.arguments(q.device), num_warps=cfg.warps,
    )
    return acc if direct else merge_partials(acc, m, denom, q.dtype)


def rope_and_store_reference(store: KVStore, layer: int, projected: Tensor, rotation: Tensor, slot: Tensor,
                             active: Tensor | None) -> Tensor:
    """rope_and_store through separate torch ops (CPU, and the oracle for the kernel)."""
    B, H, D = projected.shape[0], store.k.shape[2], store.k.shape[4]
    q, k, v = projected.view(B, 3, H, D).unbind(1)
    rotation = rotation.view(B, 1, D // 2, 2)
    store.write(layer, torch.arange(B, device=slot.device), slot, apply_rope(k, rotation), v, active)
    return apply_rope(q, rotation)


def rope_and_store(store: KVStore, layer: int, projected: Tensor, rotation: Tensor, slot: Tensor,
                   active: Tensor | None) -> Tensor:
    """One step's in_proj output [B, 3 * dim] -> rotated queries [B, heads, head_dim].

    The rotated keys and the values go into each row's ring `slot` [B]; where `active` [B] is False the old entry
    stays. `rotation` is [B, head_dim // 2, 2] (cos, sin). On CUDA one kernel per layer does it all.
    """
    if not use_kernel(projected.device):
        return rope_and_store_reference(store, layer, projected, rotation, slot, active)
    B = projected.shape[0]
    H, D = store.k.shape[2], store.k.shape[4]
    q = torch.empty(B, H, D, device=projected.device, dtype=projected.dtype)
    k, v = store.k[layer], store.v[layer]
    ks = store.k_scale[layer] if store.fp8 else k
    vs = store.v_scale[layer] if store.fp8 else v
    table = store.table
    _rope_store_kernel[(B, H)](
        projected, rotation, slot, slot if active is None else active, table, q, k, v, ks, vs,
        projected.stride(0), k.stride(0), k.stride(1), k.stride(2), ks.stride(0), ks.stride(1), table.stride(0),
        H * D, HAS_ACTIVE=active is not None, HAS_SCALE=store.fp8, D=D, PAGE=store.page,
        **launch.arguments(projected.device), num_warps=1,
    )
    return q


def depformer_attention_reference(qkv: Tensor, keys: Tensor, values: Tensor, step: Tensor, heads: int) -> Tensor:
    """depformer_attention through torch ops (CPU, and the oracle for the kernel)."""
    q, k, v = qkv.unflatten(-1, (3, heads, -1)).unbind(1)
    keys.index_copy_(2, step, k.unsqueeze(2))
    values.index_copy_(2, step, v.unsqueeze(2))
    # Later steps hold the previous frame's entries (or a former session's): masked out of scores and values both.
    visible = torch.arange(keys.shape[2], device=keys.device) <= step
    scores = (keys.float() * q.float().unsqueeze(2)).sum(-1) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).unsqueeze(-1)
    return (weights * torch.where(visible.view(-1, 1), values.float(), 0.0)).sum(2).to(q.dtype).flatten(1)


def depformer_attention(qkv: Tensor, keys: Tensor, values: Tensor, step: Tensor, heads: int) -> Tensor:
    """One depformer step's attention: its k and v go into the frame's cache at `step` (in place), its q attends
    over steps 0..step. qkv [B, 3 * dim], keys and values [B, heads, steps, head_dim], step [1] long -> [B, dim].

    On CUDA one kernel does it all, per (row, head): the torch ops are five launches (two cache writes, scores,
    softmax, weighted sum) for a few microseconds of work, 48 times a tick (8 steps x 6 layers). The step is a
    tensor, so one CUDA graph or compiled function serves every step.
    """
    if not use_kernel(qkv.device):
        return depformer_attention_reference(qkv, keys, values, step, heads)
    B, steps, D = qkv.shape[0], keys.shape[2], keys.shape[3]
    out = torch.empty(B, heads * D, device=qkv.device, dtype=qkv.dtype)
    _depformer_attention_kernel[(B, heads)](
        qkv, keys, values, step, out, qkv.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), D ** -0.5,
        D=D, BLOCK_S=triton.next_power_of_2(steps), **launch.arguments(qkv.device), num_warps=1,
    )
    return out


@fusable
def merge_partials(acc: Tensor, m: Tensor, denom: Tensor, dtype: torch.dtype) -> Tensor:
    """Combine split-K partial softmaxes: acc [B, H, S, D], running max m and denominator [B, H, S]; the result
    in `dtype` (the query's), cast by the merge's own last pass (a launch of its own a layer when it followed)."""
    top = m.amax(dim=2, keepdim=True)
    weight = torch.where(denom > 0, torch.exp(m - top), torch.zeros_like(m))
    return ((acc * weight.unsqueeze(-1)).sum(2) / (denom * weight).sum(2, keepdim=True)).to(dtype)


if triton is not None:

    # Two ways to find a block's keys through the page table, each the faster on its path (bench/attention_kernel.py
    # --pages, H200, 64 rows x 3000 slots, against the contiguous kernel before pages): the tensor-core path takes
    # the block's one or two pages as scalars (+1 % in bf16; a table load per key cost it +10 %), the CUDA-core fp8
    # path a table load per key (+5 %; the scalar pages' selects cost it +13 %).

    @triton.jit
    def _block_pages(ROW_TABLE, pages, h, skp, skh, ssp, ssh, n0, offs, PAGE: tl.constexpr):
        """Offsets of keys n0 + [0, BLOCK_N) of one row, which span two pages at most (BLOCK_N <= PAGE): the
        row's (key, scale) offsets of their page and head, and each key's slot in its page."""
        first = n0 // PAGE
        low = tl.load(ROW_TABLE + first)
        high = tl.load(ROW_TABLE + tl.minimum(first + 1, pages - 1))
        local = offs - first * PAGE
        upper = local >= PAGE
        page = tl.where(upper, high, low)
        return page * skp + h * skh, page * ssp + h * ssh, tl.where(upper, local - PAGE, local)

    @triton.jit
    def _key_pages(ROW_TABLE, h, skp, skh, ssp, ssh, offs, valid, PAGE: tl.constexpr):
        """_block_pages with one table load per key."""
        page = tl.load(ROW_TABLE + offs // PAGE, mask=valid, other=0)
        return page * skp + h * skh, page * ssp + h * ssh, offs % PAGE

    @triton.jit
    def _partial_kernel(Q, K, V, KS, VS, NV, ORDER, TABLE, ACC, M, L,
                        sqb, sqh, skp, skh, sks, ssp, ssh, stb, pages,
                        H, SPAN, scale,
                        HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                        STAGES: tl.constexpr, USE_DOT: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr):
        """Partial softmax of one (row, head) over one span of its keys into ACC/M/L [B, H, splits(, D)]; with
        DIRECT (a single span) the normalised result goes straight into ACC [B, H, D] in its dtype. Key n of row b
        sits at offset n % PAGE of page TABLE[b, n // PAGE]. Program (i, h) serves row ORDER[i]."""
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        b = tl.load(ORDER + tl.program_id(0) // H)
        h = tl.program_id(0) % H
        n_valid = tl.load(NV + b)
        start = split * SPAN
        end = tl.minimum(start + SPAN, n_valid)
        d = tl.arange(0, D)
        out = (b * H + h) * splits + split
        if USE_DOT:
            # Tensor cores need 16 query rows: the query is repeated and row 0 of the result kept.
            rows = tl.arange(0, 16)
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * 0 + d[None, :])
            q = (q.to(tl.float32) * scale).to(tl.bfloat16)
            m_i = tl.full([16], -float("inf"), tl.float32)
            l_i = tl.zeros([16], dtype=tl.float32)
            acc = tl.zeros([16, D], dtype=tl.float32)
            for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
                offs = n0 + tl.arange(0, BLOCK_N)
                valid = offs < end
                at, scale_at, local = _block_pages(TABLE + b * stb, pages, h, skp, skh, ssp, ssh, n0, offs, PAGE)
                at += local * sks
                scale_at += local
                k = tl.load(K + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(V + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k.to(tl.bfloat16)))
                if HAS_SCALE:  # per-slot scales commute with the dots: apply them to scores and probabilities
                    s = s * tl.load(KS + scale_at, mask=valid, other=0.0)[None, :]
                s = tl.where(valid[None, :], s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                pv = p
                if HAS_SCALE:
                    pv = p * tl.load(VS + scale_at, mask=valid, other=0.0)[None, :]
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), v.to(tl.bfloat16))
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            first = rows == 0
            if DIRECT:
                result = (acc / l_i[:, None]).to(ACC.dtype.element_ty)
                tl.store(ACC + out * D + rows[:, None] * 0 + d[None, :], result, mask=first[:, None])
            else:
                tl.store(ACC + out * D + rows[:, None] * 0 + d[None, :], acc, mask=first[:, None])
                tl.store(M + out + rows * 0, m_i, mask=first)
                tl.store(L + out + rows * 0, l_i, mask=first)
        else:
            # BLOCK_N independent online-softmax streams (key n0 + j feeds stream j): the loop has no reduction
            # across keys, only each key's dot over head_dim; the streams merge once at the end.
            q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32) * scale
            m_j = tl.full([BLOCK_N], -float("inf"), tl.float32)
            l_j = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_j = tl.zeros([BLOCK_N, D], dtype=tl.float32)
            for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
                offs = n0 + tl.arange(0, BLOCK_N)
                valid = offs < end
                at, scale_at, local = _key_pages(TABLE + b * stb, h, skp, skh, ssp, ssh, offs, valid, PAGE)
                at += local * sks
                scale_at += local
                k = tl.load(K + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                v = tl.load(V + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
                pv = v.to(tl.float32)
                if HAS_SCALE:
                    s = s * tl.load(KS + scale_at, mask=valid, other=0.0)
                s = tl.where(valid, s, -float("inf"))
                m_new = tl.maximum(m_j, s)
                alpha = tl.where(m_new > -float("inf"), tl.exp(m_j - m_new), 1.0)
                p = tl.where(valid, tl.exp(s - m_new), 0.0)
                weight = p
                if HAS_SCALE:
                    weight = p * tl.load(VS + scale_at, mask=valid, other=0.0)
                acc_j = acc_j * alpha[:, None] + weight[:, None] * pv
                l_j = l_j * alpha + p
                m_j = m_new
            top = tl.max(m_j, axis=0)
            w = tl.where(l_j > 0, tl.exp(m_j - top), 0.0)
            total = tl.sum(acc_j * w[:, None], axis=0)
            if DIRECT:
                tl.store(ACC + out * D + d, (total / tl.sum(l_j * w, axis=0)).to(ACC.dtype.element_ty))
            else:
                tl.store(ACC + out * D + d, total)
                tl.store(M + out, top)
                tl.store(L + out, tl.sum(l_j * w, axis=0))

    @triton.jit
    def _rotate(x, cos, sin, D: tl.constexpr):
        real, imag = tl.split(tl.reshape(x.to(tl.float32), (D // 2, 2)))
        return tl.reshape(tl.join(real * cos - imag * sin, real * sin + imag * cos), (D,))

    @triton.jit
    def _store_quantized(CACHE, SCALE, x, at, scale_at, keep, keep_row):
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        tl.store(CACHE + at, (x / scale).to(CACHE.dtype.element_ty), mask=keep)
        tl.store(SCALE + scale_at, scale, mask=keep_row)

    @triton.jit
    def _rope_store_kernel(P, ROT, SLOT, ACTIVE, TABLE, QOUT, K, V, KS, VS,
                           spb, skp, skh, sks, ssp, ssh, stb, DIM,
                           HAS_ACTIVE: tl.constexpr, HAS_SCALE: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                           PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        d = tl.arange(0, D)
        cos, sin = tl.split(tl.reshape(tl.load(ROT + b * D + d), (D // 2, 2)))
        src = P + b * spb + h * D + d
        q = _rotate(tl.load(src), cos, sin, D)
        tl.store(QOUT + (b * heads + h) * D + d, q.to(QOUT.dtype.element_ty))
        k = _rotate(tl.load(src + DIM), cos, sin, D).to(P.dtype.element_ty)  # rounded as the eager path rounds
        v = tl.load(src + 2 * DIM)
        keep_row = tl.full([], 1, tl.int1)
        if HAS_ACTIVE:
            keep_row = tl.load(ACTIVE + b) != 0
        keep = tl.full([D], 1, tl.int1) & keep_row
        slot = tl.load(SLOT + b)
        page = tl.load(TABLE + b * stb + slot // PAGE)
        at = page * skp + h * skh + (slot % PAGE) * sks + d
        if HAS_SCALE:
            scale_at = page * ssp + h * ssh + slot % PAGE
            _store_quantized(K, KS, k.to(tl.float32), at, scale_at, keep, keep_row)
            _store_quantized(V, VS, v.to(tl.float32), at, scale_at, keep, keep_row)
        else:
            tl.store(K + at, k, mask=keep)
            tl.store(V + at, v, mask=keep)

    @triton.jit
    def _depformer_attention_kernel(QKV, K, V, STEP, OUT, sq, skb, skh, sks, scale,
                                    D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        dim = tl.num_programs(1) * D
        d = tl.arange(0, D)
        src = QKV + b * sq + h * D + d
        q = tl.load(src).to(tl.float32)
        k = tl.load(src + dim)
        v = tl.load(src + 2 * dim)
        step = tl.load(STEP)
        base = b * skb + h * skh
        tl.store(K + base + step * sks + d, k)
        tl.store(V + base + step * sks + d, v)
        # Earlier steps come from the cache; this step's k and v from registers (no read-back of the stores above).
        s = tl.arange(0, BLOCK_S)
        earlier = (s < step)[:, None]
        at = base + s[:, None] * sks + d[None, :]
        keys = tl.load(K + at, mask=earlier, other=0.0)
        vals = tl.load(V + at, mask=earlier, other=0.0)
        now = (s == step)[:, None]
        keys = tl.where(now, k[None, :], keys).to(tl.float32)
        vals = tl.where(now, v[None, :], vals).to(tl.float32)
        scores = tl.sum(keys * q[None, :], axis=1) * scale
        scores = tl.where(s <= step, scores, -float("inf"))
        p = tl.exp(scores - tl.max(scores, axis=0))
        out = tl.sum(p[:, None] * vals, axis=0) / tl.sum(p, axis=0)
        tl.store(OUT + b * dim + h * D + d, out.to(OUT.dtype.element_ty))
