"""Decode attention: the length-bounded kernel (CUDA) and reference (CPU) agree with plain masked attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import compiled_helpers

from model.attention import (
    KVStore,
    attention_reference,
    decode_attention,
    depformer_attention,
    depformer_attention_reference,
    dequantize,
    longest_first,
    merge_partials,
    quantize,
    rope_and_store,
    rope_and_store_reference,
    split_length,
)
from model.rope import rope_rotation


def full_attention(q, k, v, n_valid):
    slots = torch.arange(k.shape[2], device=q.device)
    mask = (slots[None] < n_valid[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.float().unsqueeze(2), k.float(), v.float(), attn_mask=mask).squeeze(2)


def make_store(B, H, C, D, dtype, device, fp8, seed=0, page=None):
    """Random keys and values [1, B, H, C, D] in a store: contiguous rows, or pages of `page` slots shuffled over a
    pool with spare pages."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(1, B, H, C, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, B, H, C, D, generator=g).to(device=device, dtype=dtype)
    pages = None if page is None else B * C // page + 3
    store = KVStore.empty((1, B, H, C, D), dtype, device, fp8, page, pages)
    if page is not None:
        store.table.copy_((torch.randperm(pages, generator=g)[: B * C // page] + 1).view(B, -1))
    rows = torch.arange(B, device=device).repeat_interleave(C)
    slots = torch.arange(C, device=device).repeat(B)
    store.write(0, rows, slots, k[0].permute(0, 2, 1, 3).reshape(B * C, H, D),
                v[0].permute(0, 2, 1, 3).reshape(B * C, H, D), None)
    return store, k, v


def test_quantize_round_trip():
    x = torch.randn(5, 7, 128) * torch.logspace(-3, 3, 7).view(1, 7, 1)
    q, s = quantize(x)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize(q, s, torch.float32)
    assert ((back - x).abs() <= 0.07 * x.abs().amax(-1, keepdim=True)).all()


def test_reference_equals_masked_attention_on_cpu():
    store, k, v = make_store(3, 2, 20, 16, torch.float32, "cpu", fp8=False)
    q = torch.randn(3, 2, 16)
    n_valid = torch.tensor([1, 7, 20])
    torch.testing.assert_close(attention_reference(q, store, 0, n_valid), full_attention(q, k[0], v[0], n_valid))


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_reads_through_shuffled_pages_as_through_contiguous_rows(fp8):
    contiguous, k, v = make_store(3, 2, 24, 16, torch.float32, "cpu", fp8, seed=4)
    paged, _, _ = make_store(3, 2, 24, 16, torch.float32, "cpu", fp8, seed=4, page=4)
    q = torch.randn(3, 2, 16)
    n_valid = torch.tensor([1, 13, 24])
    assert torch.equal(attention_reference(q, paged, 0, n_valid), attention_reference(q, contiguous, 0, n_valid))
    for a, b in zip(paged.read_row(0, 1, torch.float32, 24), contiguous.read_row(0, 1, torch.float32, 24)):
        assert torch.equal(a, b)


def test_longest_first_takes_rows_by_valid_keys_most_first_and_ties_in_row_order():
    assert longest_first(torch.tensor([5, 3000, 5, 0, 1650])).tolist() == [1, 4, 0, 2, 3]


def test_split_length_fills_the_gpu_at_small_batch():
    assert split_length(1, 32, 3000) < split_length(64, 32, 3000)
    assert split_length(64, 32, 3000) % 64 == 0 and split_length(64, 32, 3000) >= 3000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B", [1, 5, 64])
@pytest.mark.parametrize("page", [None, 75, 20])
def test_kernel_matches_reference_on_cuda(B, fp8, page):
    H, C, D = 32, 3000, 128
    store, _, _ = make_store(B, H, C, D, torch.bfloat16, "cuda", fp8, seed=B, page=page)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    n_valid = torch.randint(1, C + 1, (B,), device="cuda")
    n_valid[0] = C
    got = decode_attention(q, store, 0, n_valid).float()
    want = attention_reference(q, store, 0, n_valid).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("B", [5, 64])
def test_programs_launched_longest_row_first_compute_what_row_order_computes(B, fp8):
    """`order` moves when a row's programs run (longest_first), not their arithmetic: bit for bit the same."""
    H, C, D = 32, 3000, 128
    store, _, _ = make_store(B, H, C, D, torch.bfloat16, "cuda", fp8, seed=B, page=75)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    n_valid = torch.randint(1, C + 1, (B,), device="cuda")
    order = longest_first(n_valid)
    assert torch.equal(n_valid[order], n_valid.sort(descending=True).values)
    assert torch.equal(decode_attention(q, store, 0, n_valid, order), decode_attention(q, store, 0, n_valid))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("page", [None, 8])
def test_rope_and_store_kernel_matches_reference_on_cuda(fp8, masked, page):
    B, H, C, D = 5, 32, 40, 128
    pos = torch.tensor([0, 7, 39, 40, 100000], device="cuda")
    rotation = rope_rotation(pos, D, 10000.0)
    projected = torch.randn(B, 3 * H * D, device="cuda").to(torch.bfloat16) * 3
    active = torch.tensor([True, False, True, True, False], device="cuda") if masked else None
    results = []
    for fn in (rope_and_store, rope_and_store_reference):
        store, _, _ = make_store(B, H, C, D, torch.bfloat16, "cuda", fp8, seed=3, page=page)
        q = fn(store, 0, projected, rotation, pos % C, active)
        k, v, *scales = store.gather(0)
        results.append((q.float(), [dequantize(t, s, torch.float32) if fp8 else t.float()
                                    for t, s in ((k, scales[0] if fp8 else None), (v, scales[1] if fp8 else None))]))
    (q, kv), (q_ref, kv_ref) = results
    torch.testing.assert_close(q, q_ref, atol=0.07, rtol=1e-2)  # one bf16 ulp: fused multiply-adds round once
    for got, want in zip(kv, kv_ref):
        tolerance = 0.15 if fp8 else 0.07
        torch.testing.assert_close(got, want, atol=tolerance, rtol=0.07)
        if masked:  # rows that were not active keep their old entries exactly
            assert torch.equal(got[1], want[1]) and torch.equal(got[4], want[4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA only")
@pytest.mark.parametrize("steps", [8, 16])
def test_depformer_attention_kernel_matches_reference_on_cuda(steps):
    """Step by step over one frame (stale NaN entries past the step), the kernel leaves the reference's cache bit
    for bit and attends as it does."""
    B, H, D = 5, 16, 64
    caches = [[torch.full((B, H, steps, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for _ in range(2)]
    positions = torch.arange(steps, device="cuda")
    for step in range(steps):
        qkv = (torch.randn(B, 3 * H * D, device="cuda") * 2).to(torch.bfloat16)
        got = depformer_attention(qkv, *caches[0], positions[step : step + 1], H)
        want = depformer_attention_reference(qkv, *caches[1], positions[step : step + 1], H)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
        for a, b in zip(caches[0], caches[1]):
            assert torch.equal(a[:, :, : step + 1], b[:, :, : step + 1])


@pytest.mark.filterwarnings(r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_the_split_merge_casting_in_its_own_pass_leaves_every_value_of_the_cast_after_it(device):
    """The split-K merge compiled with the query's dtype as its output (the engine's launch a layer fewer) gives
    every value of the float32 merge cast by torch after it: one row and eight, splits without keys among them."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, splits in ((1, 47), (8, 8)):
        acc = torch.randn(rows, 32, splits, 128, generator=g).to(device)
        m = torch.randn(rows, 32, splits, generator=g).to(device) * 4
        denom = torch.rand(rows, 32, splits, generator=g).to(device) * 30
        denom[..., 1:] *= torch.rand(rows, 32, splits - 1, generator=g).to(device) < 0.3  # most spans hold no key
        cases.append((acc, m, denom))
    with compiled_helpers():
        for acc, m, denom in cases:
            after = merge_partials(acc, m, denom, torch.float32).to(torch.bfloat16)
            within = merge_partials(acc, m, denom, torch.bfloat16)
            assert within.dtype == torch.bfloat16 and torch.equal(within, after), acc.shape
