"""The temporal transformer's input: a token column's 17 embeddings summed, one kernel on CUDA.

Each token of the column (text, 8 agent, 8 user codes) is looked up in its own table, zeroed where the id is
negative (-1 "zero", -2 "ungenerated"), and the 17 summed in the reference's order: the audio codebooks in turn, the
text last. Through torch that is a clamp, a lookup, a comparison, a cast, a product and an add for each of the 17:
about a hundred launches in every tick's temporal graph. Here it is one Triton kernel, which reads the tables through
a device array of their addresses and rounds to the tables' dtype after each product and each add as torch does, so
the sum is torch's bit for bit (tests/test_lm.py).
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

BLOCK = 256


def embed_column_reference(tokens: Tensor, tables: list[Tensor]) -> Tensor:
    """tokens [..., C] with `tables[c]` [rows, dim] column c's table -> summed embedding [..., dim]: columns 1 .. C-1
    in turn, then column 0 (the reference's order; it matters in bf16). Torch's ops: the CPU path, and the oracle
    for the kernel."""
    total = None
    for c in [*range(1, len(tables)), 0]:
        tok = tokens[..., c]
        e = torch.nn.functional.embedding(tok.clamp(min=0), tables[c]) * (tok >= 0).unsqueeze(-1).to(tables[c].dtype)
        total = e if total is None else total + e
    return total


class EmbeddingTables:
    """The device array of the tables' addresses the kernel reads (weights do not move once the engine captures its
    graphs; the array follows them if they do)."""

    def __init__(self) -> None:
        self._addresses = launch.DeviceInts()

    def array(self, tables: list[Tensor]) -> Tensor:
        first = tables[0]

        def check() -> None:
            if any(t.dtype != first.dtype or t.device != first.device or t.dim() != 2 or t.shape[1] != first.shape[1]
                   or not t.is_contiguous() for t in tables):
                raise ValueError("the embedding tables must be contiguous [rows, dim] of one dtype and device")

        return self._addresses.array(tuple(t.data_ptr() for t in tables), first.device, check)


def embed_column(tokens: Tensor, tables: list[Tensor], addresses: EmbeddingTables) -> Tensor:
    """`embed_column_reference`'s sum: the kernel on CUDA, torch's ops elsewhere."""
    if not use_kernel(tokens.device):
        return embed_column_reference(tokens, tables)
    return embed_column_triton(tokens, tables, addresses)


def embed_column_triton(tokens: Tensor, tables: list[Tensor], addresses: EmbeddingTables) -> Tensor:
    """The sum as the Triton kernel, on whatever device Triton runs (CUDA; the CPU through its interpreter)."""
    columns, dim = len(tables), tables[0].shape[1]
    if tokens.shape[-1] != columns:
        raise ValueError(f"tokens must end in {columns} columns, got {list(tokens.shape)}")
    flat = tokens.reshape(-1, columns)
    out = torch.empty(flat.shape[0], dim, device=tokens.device, dtype=tables[0].dtype)
    if flat.shape[0]:
        _embed_column_kernel[(flat.shape[0], triton.cdiv(dim, BLOCK))](
            flat, addresses.array(tables), out, flat.stride(0), flat.stride(1), dim, COLUMNS=columns, BLOCK=BLOCK,
            **launch.arguments(tokens.device), num_warps=2,
        )
    return out.view(*tokens.shape[:-1], dim)


if triton is not None:

    @triton.jit
    def _lookup(TOKENS, TABLES, row, column, stt, stc, d, inside, dim, dtype: tl.constexpr):
        """Column `column`'s embedding of row `row` at dims d, times (id >= 0), rounded as torch's product is."""
        tok = tl.load(TOKENS + row * stt + column * stc)
        table = tl.load(TABLES + column).to(tl.pointer_type(dtype))
        e = tl.load(table + tl.maximum(tok, 0) * dim + d, mask=inside, other=0.0)
        return (e.to(tl.float32) * (tok >= 0).to(tl.float32)).to(dtype)

    @triton.jit
    def _embed_column_kernel(TOKENS, TABLES, OUT, stt, stc, dim, COLUMNS: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        launch.allow_next(PDL)
        launch.wait_for_previous(PDL)
        row = tl.program_id(0)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = d < dim
        dtype = OUT.dtype.element_ty
        total = _lookup(TOKENS, TABLES, row, 1, stt, stc, d, inside, dim, dtype)
        for c in tl.static_range(2, COLUMNS + 1):  # columns 2 .. C-1, then column 0 (c == COLUMNS)
            e = _lookup(TOKENS, TABLES, row, c % COLUMNS, stt, stc, d, inside, dim, dtype)
            total = (total.to(tl.float32) + e.to(tl.float32)).to(dtype)
        tl.store(OUT + row.to(tl.int64) * dim + d, total, mask=inside)
