"""Decode-attention kernel alone on the GPU: ms and effective TB/s by launch shape, against cuDNN SDPA; or, with
--pages, the default launch shapes reading rows through shuffled pages of each size against contiguous rows
(with --sweep, the CUDA-core path's launch shapes over pages, against the default contiguous; with --orders, rows
of unequal contexts with their programs launched in row order and longest row first).

    python -m bench.attention_kernel
    python -m bench.attention_kernel --pages 20 40 60 100 120 --batches 64
    python -m bench.attention_kernel --pages 75 --batches 64 --kv fp8 --sweep [--targets 2048 8192 16384]
    python -m bench.attention_kernel --pages 75 --batches 250 144 --orders

One layer of the 7B shape (32 heads x 128) over a 3000-slot ring; prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F

import model.attention as attention
from model.attention import KernelConfig, KVStore, decode_attention


def timed(fn, iterations: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def random_store(B: int, H: int, C: int, D: int, fp8: bool, page: int | None) -> KVStore:
    """Random keys and values for B full rows: contiguous, or in pages of `page` slots shuffled over the pool."""
    pages = None if page is None else B * C // page
    store = KVStore.empty((1, B, H, C, D), torch.bfloat16, "cuda", fp8, page, pages)
    for t in store.tensors():
        noise = torch.randn(t.shape, device="cuda")
        t.copy_(noise.abs() * 0.05 if t.dim() == 4 else noise)  # scales small and positive
    if page is not None:
        store.table.copy_((torch.randperm(pages, device="cuda") + 1).view(B, -1))
    return store


def compare_pages(kinds: list[str], batches: list[int], pages: list[int], H: int, C: int, D: int) -> None:
    """ms per layer of the default kernel over B full rows, contiguous and paged (best of 3 interleaved rounds)."""
    for B, kind in itertools.product(batches, kinds):
        fp8 = kind == "fp8"
        n_valid = torch.full((B,), C, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        layouts = [None, *(p for p in pages if C % p == 0)]
        stores = {page: random_store(B, H, C, D, fp8, page) for page in layouts}
        best = {page: float("inf") for page in layouts}
        for _ in range(3):
            for page, store in stores.items():
                best[page] = min(best[page], timed(partial(decode_attention, q, store, 0, n_valid), 200))
        base = best[None]
        print(json.dumps({"bench": "attention_kernel_pages", "batch": B, "filled": C, "kv": kind,
                          "contiguous_ms": round(base, 4),
                          "paged": [{"page": p, "ms": round(best[p], 4), "vs_contiguous": round(best[p] / base, 4)}
                                    for p in layouts[1:]]}), flush=True)
        del stores


def sweep_pages(batches: list[int], page: int, H: int, C: int, D: int, targets: list[int]) -> None:
    """fp8 over pages of `page`: every CUDA-core launch shape, with each of `targets` programs a launch aims at
    (more programs than rows x heads split each row's keys), against the default kernel over contiguous rows (best
    of 3 interleaved rounds each)."""
    default = attention.KERNEL_FP8
    shapes = [KernelConfig(block, warps, stages, programs, False)
              for block, warps, stages, programs in itertools.product((16, 32, 64), (1, 2), (2, 3, 4), targets)]
    for B in batches:
        n_valid = torch.full((B,), C, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        contiguous, paged = random_store(B, H, C, D, True, None), random_store(B, H, C, D, True, page)
        runs = [(None, contiguous, default)] + [(i, paged, shape) for i, shape in enumerate(shapes)]
        best: dict[int | None, float] = {}
        for _ in range(3):
            for key, store, shape in runs:
                attention.KERNEL_FP8 = shape
                ms = timed(partial(decode_attention, q, store, 0, n_valid), 200)
                best[key] = min(best.get(key, float("inf")), ms)
        attention.KERNEL_FP8 = default
        base = best.pop(None)
        ranked = sorted(best.items(), key=lambda item: item[1])
        print(json.dumps({"bench": "attention_kernel_page_sweep", "batch": B, "filled": C, "kv": "fp8", "page": page,
                          "contiguous_default_ms": round(base, 4),
                          "paged": [{**vars(shapes[i]), "ms": round(ms, 4), "vs_contiguous": round(ms / base, 4)}
                                    for i, ms in ranked[:6]],
                          "paged_default_vs_contiguous": round(best[shapes.index(default)] / base, 4)
                          if default in shapes else None}), flush=True)


def compare_orders(batches: list[int], page: int, H: int, C: int, D: int, seed: int = 0) -> None:
    """fp8 over pages of `page`, B rows of unequal contexts (uniform over 1..C, as calls of every age): ms per layer
    with programs launched in row order and longest row first (`longest_first`), against B equal rows holding the
    same keys (best of 3 interleaved rounds); and whether the two orders' outputs are bit-equal."""
    for B in batches:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        mixed = torch.randint(1, C + 1, (B,), device="cuda", generator=generator)
        equal = torch.full((B,), int(mixed.float().mean().round()), device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16, generator=generator)
        store = random_store(B, H, C, D, True, page)
        runs = {"row_order": (mixed, None), "longest_first": (mixed, attention.longest_first(mixed)),
                "equal": (equal, None)}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(3):
            for name, (n_valid, order) in runs.items():
                best[name] = min(best[name], timed(partial(decode_attention, q, store, 0, n_valid, order), 200))
        same = torch.equal(decode_attention(q, store, 0, mixed, runs["longest_first"][1]),
                           decode_attention(q, store, 0, mixed))
        print(json.dumps({"bench": "attention_kernel_orders", "batch": B, "kv": "fp8", "page": page,
                          "keys_mean": int(equal[0]), "keys_max": int(mixed.max()),
                          **{f"{name}_ms": round(ms, 4) for name, ms in best.items()},
                          "row_order_vs_equal": round(best["row_order"] / best["equal"], 4),
                          "longest_first_vs_equal": round(best["longest_first"] / best["equal"], 4),
                          "bit_equal": same}), flush=True)


def main() -> None:
    H, C, D = 32, 3000, 128
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--pages", type=int, nargs="+", help="page sizes (frames) to compare with contiguous rows")
    parser.add_argument("--sweep", action="store_true", help="with --pages: the fp8 launch shapes over the first size")
    parser.add_argument("--targets", type=int, nargs="+", default=[attention.KERNEL_FP8.target_programs],
                        help="with --sweep: programs a launch aims at (KernelConfig.target_programs)")
    parser.add_argument("--orders", action="store_true",
                        help="with --pages: unequal contexts, programs in row order and longest row first")
    args = parser.parse_args()
    if args.pages and args.orders:
        compare_orders(args.batches, args.pages[0], H, C, D)
        return
    if args.pages and args.sweep:
        sweep_pages(args.batches, args.pages[0], H, C, D, args.targets)
        return
    if args.pages:
        compare_pages(args.kv, args.batches, args.pages, H, C, D)
        return
    for B, fill in [(b, f) for b in args.batches for f in (3000, 500)]:
        n_valid = torch.full((B,), fill, device="cuda")
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        for fp8 in [kind == "fp8" for kind in args.kv]:
            store = KVStore.empty((1, B, H, C, D), torch.bfloat16, "cuda", fp8)
            for t in store.tensors():
                t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.bfloat16).abs() * 0.05 if t.dim() == 4
                        else torch.randn(t.shape, device="cuda", dtype=torch.bfloat16))
            kv_bytes = sum(t[:, :, :, :fill].numel() * t.element_size() for t in store.tensors())
            results = []
            for block, warps, stages, programs, dot in itertools.product((32, 64, 128), (4, 8), (2, 3), (1024, 4096),
                                                                         (True, False)):
                shape = KernelConfig(block, warps, stages, programs, dot)
                attention.KERNEL_BF16 = attention.KERNEL_FP8 = shape
                try:
                    ms = timed(partial(decode_attention, q, store, 0, n_valid))
                except Exception as exc:  # a shape Triton cannot compile
                    results.append({"error": str(exc)[:80], "block": block, "warps": warps, "dot": dot})
                    continue
                results.append({"ms": round(ms, 4), "tb_s": round(kv_bytes / ms / 1e9, 2), "block": block,
                                "warps": warps, "stages": stages, "programs": programs, "dot": dot})
            ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
            line = {"bench": "attention_kernel", "batch": B, "filled": fill, "kv": "fp8" if fp8 else "bf16",
                    "best": ok[:3], "worst": ok[-1:], "errors": [r for r in results if "error" in r][:2]}
            if not fp8:
                k = store.k[0]
                mask = torch.ones(B, 1, 1, C, dtype=torch.bool, device="cuda")
                mask[..., fill:] = False
                sdpa = partial(F.scaled_dot_product_attention, q.unsqueeze(2), k, store.v[0], attn_mask=mask)
                line["cudnn_sdpa_ms"] = round(timed(sdpa), 4)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
