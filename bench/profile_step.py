"""Kernel-level profile of the engine's batched step (full 7B shape, random bf16 weights): top CUDA kernels as JSON.

    python -m bench.profile_step [--batch 1] [--context-fill 3000] [--graphs] [--fp8-kv] [--top 20]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from model.batch_step import BatchStep, PartTimer
from model.engine import Engine, EngineConfig
from model.random_model import random_personaplex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context-fill", type=int, default=3000)
    parser.add_argument("--graphs", action="store_true", help="profile graph replays (kernels still listed)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--fp8-kv", action="store_true")
    parser.add_argument("--ops", action="store_true", help="also list the top operators (eager) with input shapes")
    args = parser.parse_args()
    model = random_personaplex()
    config = EngineConfig(max_sessions=max(args.batch), cuda_graphs=args.graphs, fp8_kv=args.fp8_kv)
    engine = Engine(model, config)
    for batch in args.batch:
        engine.fill_context(slice(0, batch), args.context_fill)
        engine.step_timings(batch, 3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step_timings(batch, 5)
            torch.cuda.synchronize()
        rows = []
        for event in prof.key_averages():
            if event.device_time_total <= 0:
                continue
            rows.append((event.device_time_total / 5 / 1000, event.count // 5, event.key[:90]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        kernels = sum(r[1] for r in rows)
        print(json.dumps({"bench": "profile_step", "batch": batch, "device_ms_per_step": round(total, 3),
                          "kernels_per_step": kernels}))
        for ms, count, name in rows[: args.top]:
            print(json.dumps({"batch": batch, "ms": round(ms, 3), "calls": count, "kernel": name}))
        if args.ops:
            print_ops(engine, batch, args.top)


def print_ops(engine: Engine, batch: int, top: int) -> None:
    """Operators by device time with their input shapes, from eager runs (the graphs hide the operators)."""
    eager = BatchStep(engine.model, engine.runner.buffers(), engine.runner.const, slice(0, batch),
                      mimi=engine.runner.mimi)
    timer = PartTimer(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            timer.start()
            eager.run(timer)
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_time_total > 0 and e.key.startswith("aten")]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    for e in ops[:top]:
        print(json.dumps({"batch": batch, "op": e.key, "self_ms": round(e.self_device_time_total / 3 / 1000, 3),
                          "calls": e.count // 3, "shapes": str(e.input_shapes)[:160]}))


if __name__ == "__main__":
    main()
