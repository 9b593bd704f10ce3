"""Prompt prefill (full 7B shape, random bf16 weights): eager chunks, and whole prompts on the scratch row.

    python -m bench.prefill_bench [--chunks 16 32 64 128 256] [--starts 0 256] [--prompts 64 117 256 512]
                                  [--fp8-kv] [--profile]

- "prefill" lines: one eager chunk (the path of prompts longer than the scratch row) by chunk length and the
  prompt frames already in the row: p50 ms until the call returned (host: launches) and until the GPU finished
  (wall). Host close to wall means the chunk is launch-bound.
- "prompt_prefill" lines: a whole prompt on the scratch row in padded pieces (model/prompt_prefill.py), CUDA
  graphs replayed on the GPU: p50 host and wall ms by prompt length.
- `--profile` adds the top operators of one eager 128-frame chunk by host time ("prefill_op").
`--tiny` runs the tiny checkpoint on the CPU, to try the script.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.fullsize import bench_model
from model import fused
from model.lm import LMState
from model.loading import PersonaPlex
from model.prompt_prefill import PromptPrefill


def build(tiny: bool) -> PersonaPlex:
    model = bench_model(tiny)
    if model.device.type == "cuda" and fused.available():
        fused.enable()  # as the engine does on CUDA
    return model


def sync(model: PersonaPlex) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def timed(model: PersonaPlex, fn: Callable[[], object]) -> tuple[float, float]:
    """(host ms until `fn` returned, wall ms until the GPU finished)."""
    sync(model)
    started = time.perf_counter()
    fn()
    host = time.perf_counter() - started
    sync(model)
    return host * 1000.0, (time.perf_counter() - started) * 1000.0


def frames_of(model: PersonaPlex, count: int) -> torch.Tensor:
    lm = model.lm
    return torch.randn(count, lm.cfg.dim, device=model.device, dtype=lm.text_linear.weight.dtype)


def prefill_from(model: PersonaPlex, state: LMState, start: int, frames: int) -> tuple[float, float]:
    """Reset row 0, prefill `start` frames untimed, then one chunk of `frames`: (host ms, wall ms) of the chunk."""
    lm = model.lm
    lm.reset_row(state, 0)
    for done in range(0, start, 128):
        lm.prefill(frames_of(model, min(128, start - done)), state, 0)
    x = frames_of(model, frames)
    return timed(model, lambda: lm.prefill(x, state, 0))


def p50s(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return tuple(round(float(np.percentile([r[i] for r in runs], 50)), 2) for i in (0, 1))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--starts", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 117, 256, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fp8-kv", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    model = build(args.tiny)
    state = model.lm.init_state(1, fp8_kv=args.fp8_kv)
    kv = "fp8" if args.fp8_kv else "bf16"
    with torch.no_grad():
        for start in args.starts:
            for frames in args.chunks:
                for _ in range(2):  # compile and first-use costs
                    prefill_from(model, state, start, frames)
                host, wall = p50s([prefill_from(model, state, start, frames) for _ in range(args.repeats)])
                print(json.dumps({"bench": "prefill", "kv": kv, "chunk_frames": frames, "start_frames": start,
                                  "host_ms_p50": host, "wall_ms_p50": wall,
                                  "wall_us_per_frame": round(1000.0 * wall / frames, 1)}), flush=True)
        scratch = PromptPrefill(model.lm, model.device, args.fp8_kv)
        if model.device.type == "cuda":
            scratch.capture(torch.cuda.graph_pool_handle())
        for frames in args.prompts:
            if not scratch.fits(frames):
                continue
            x = frames_of(model, frames)
            scratch.run(x)  # first-use costs
            host, wall = p50s([timed(model, lambda x=x: scratch.run(x)) for _ in range(args.repeats)])
            print(json.dumps({"bench": "prompt_prefill", "kv": kv, "prompt_frames": frames,
                              "pieces": scratch.pieces(frames), "graphs": bool(scratch.graphs),
                              "host_ms_p50": host, "wall_ms_p50": wall}), flush=True)
        if args.profile:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
            prefill_from(model, state, 0, 128)
            with profile(activities=activities) as prof:
                prefill_from(model, state, 0, 128)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            for event in events[:25]:
                print(json.dumps({"bench": "prefill_op", "op": event.key, "calls": event.count,
                                  "self_host_ms": round(event.self_cpu_time_total / 1000.0, 3),
                                  "device_ms": round(event.device_time_total / 1000.0, 3)}), flush=True)


if __name__ == "__main__":
    main()
