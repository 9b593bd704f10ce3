"""GPU figures for the model: ms per LM step and per Mimi encode/decode at batch 1, 16, 64 (full 7B shape).

    python -m bench.model_step [--batches 1 16 64] [--iterations 50] [--context-fill 0 3000]

Runs the engine's batched step (CUDA graphs per padded batch) on random bf16 weights and prints one JSON line per
(batch, context) with p50/p99 ms of each part: Mimi encode, temporal transformer, depformer, Mimi decode.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from bench.fullsize import gpu_memory_gb
from model.engine import Engine, EngineConfig
from model.random_model import random_personaplex


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    parts = list(runs[0])
    for name in parts:
        values = [r[name] for r in runs]
        out[f"{name}_ms_p50"] = round(float(np.percentile(values, 50)), 3)
        out[f"{name}_ms_p99"] = round(float(np.percentile(values, 99)), 3)
    lm = [r["temporal"] + r["depformer"] for r in runs]
    total = [sum(r.values()) for r in runs]
    out["lm_step_ms_p50"] = round(float(np.percentile(lm, 50)), 3)
    out["total_ms_p50"] = round(float(np.percentile(total, 50)), 3)
    out["total_ms_p99"] = round(float(np.percentile(total, 99)), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--context-fill", type=int, nargs="+", default=[0, 3000])
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--fp8-kv", action="store_true", help="FP8 (e4m3) KV cache")
    parser.add_argument("--no-fuse", action="store_true", help="no torch.compile of elementwise helpers")
    args = parser.parse_args()
    model = random_personaplex()
    engine = Engine(model, EngineConfig(max_sessions=max(args.batches), cuda_graphs=not args.no_graphs,
                                        fp8_kv=args.fp8_kv, fuse_kernels=not args.no_fuse))
    kv = "fp8" if args.fp8_kv else "bf16"
    for fill in args.context_fill:
        for batch in args.batches:
            engine.fill_context(slice(0, batch), fill)
            engine.step_timings(batch, 5)
            runs = engine.step_timings(batch, args.iterations)
            torch.cuda.synchronize()
            line = {"bench": "model_step", "batch": batch, "context_frames": fill, "cuda_graphs": not args.no_graphs,
                    "fused": not args.no_fuse, "kv": kv, **summarize(runs), **gpu_memory_gb()}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
