"""The engine under a call mix: Poisson arrivals, exponential call lengths, real sessions on the 80 ms wall clock.

    python -m bench.call_mix --fp8-kv --concurrency 250 --mean-s 180 --cap-s 600 --minutes 3 --max-sessions 320
    python -m bench.call_mix --fp8-kv --concurrency 250 --minutes 1 --max-sessions 290 --equal-seconds 20
    python -m bench.call_mix --fp8-kv --max-sessions 320 --minutes 0 --worst-case 144

Full 7B shape with random bf16 weights (`--tiny`: the tiny checkpoint on the CPU, to try the script). Calls arrive
at the rate that keeps `--concurrency` calls live on average (Little's law over lengths exponential around
`--mean-s`, cut at `--cap-s`); each is a realtime engine session fed by a source that always has a frame, closed
when its length ends. The run starts in steady state: `--concurrency` calls are live from the start with the ages
and remaining lengths of a steady state (ages of live calls are exponential around the mean too, cut at the cap;
memoryless lengths leave an exponential remainder), their context filled to their age (engine.fill_context, in
one engine command for all), so the minutes measured are steady state from the first tick. One JSON line,
"call_mix": live sessions (mean, max), tick p50/p99, late ticks, arrivals and refusals, context shrinks and
grow-backs (while opening, and measured), KV pool occupancy (mean, max), the opening's seconds; when late ticks came
and the fewest live calls at which an arrival was refused. Late ticks of the opening (its one fill command can make
the next tick start late) are counted apart from the measured minutes.
With `--equal-seconds S`, then the mix's mean live calls for S seconds, each holding an equal share of the KV frames
the mix held on average (on average over the seconds measured: `equal_share_frames`): the line "call_mix_equal",
with the mix's tick p50 and p99 over its own (`mix_vs_equal_p50`, `_p99`). With `--worst-case N`, then N sessions
at full context for `--worst-seconds`: the line "call_mix_worst_case".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time

import numpy as np
import torch

from bench.engine_bench import EndlessSource, drop, percentiles
from bench.fullsize import add_arithmetic_flags, arithmetic_config, bench_model, gpu_memory_gb, machine
from model.engine import Engine, EngineConfig, EngineError, ResourceExhausted, SamplingParams, SessionParams, Slot

PARAMS = SessionParams(persona="You are a helpful agent.", sampling=SamplingParams())
SETTLE_TICKS = 12  # waited out after a fixed load's opening, before its measured seconds


class Mix:
    """The run's counters and samples."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.ticks: list[tuple[float, bool, float]] = []  # (ms, late, when it ended: monotonic seconds)
        self.arrivals = self.refused = self.failed = 0
        self.refused_at_live: list[int] = []  # the live calls when each arrival was refused
        self.live: set[Slot] = set()
        self.samples: list[tuple[int, float]] = []  # (live sessions, pool occupancy)
        engine.add_tick_listener(lambda record, _: self.ticks.append((record.ms, record.late, time.monotonic())))

    def failure(self, error: EngineError) -> None:
        self.failed += 1

    async def call(self, seconds: float, seed: int) -> None:
        self.arrivals += 1
        try:
            slot = self.engine.reserve()
        except ResourceExhausted:
            self.refused += 1
            self.refused_at_live.append(len(self.live))
            return
        await self.run(slot, seconds, seed)

    async def run(self, slot: Slot, seconds: float, seed: int) -> None:
        try:
            await slot.start(PARAMS, EndlessSource(seed), drop, self.failure)
        except BaseException:
            slot.close()
            raise
        await self.hold(slot, seconds)

    async def hold(self, slot: Slot, seconds: float) -> None:
        """A started call, live for `seconds`."""
        try:
            self.live.add(slot)
            await asyncio.sleep(seconds)
        finally:
            self.live.discard(slot)
            slot.close()

    async def open_filled(self, calls: list[tuple[int, float]]) -> tuple[list[asyncio.Future], float]:
        """Calls (context frames, seconds left) live at once: started together, then their contexts filled in one
        engine command; the calls' tasks and the seconds the opening took."""
        opening = time.monotonic()
        slots = [self.engine.reserve() for _ in calls]
        try:
            await asyncio.gather(*(slot.start(PARAMS, EndlessSource(i), drop, self.failure)
                                   for i, slot in enumerate(slots)))

            def fill() -> None:
                for slot, (frames, _) in zip(slots, calls, strict=True):
                    self.engine.fill_context(slice(slot.index, slot.index + 1), frames)

            await self.engine.submit(fill)
        except BaseException:
            for slot in slots:
                slot.close()
            raise
        tasks = [asyncio.ensure_future(self.hold(slot, seconds)) for slot, (_, seconds) in zip(slots, calls)]
        await asyncio.sleep(0)  # each call live before the measured time starts
        return tasks, time.monotonic() - opening

    async def settle(self, ticks: int) -> None:
        """Wait out `ticks` ticks after an opening: the fill ran as one engine command between two ticks, so the
        tick after it can start late. That is the benchmark's set-up (real sessions fill their context frame by
        frame), not the load measured."""
        seen = len(self.ticks)
        while len(self.ticks) < seen + ticks:
            await asyncio.sleep(0.01)

    async def sample(self, period_s: float) -> None:
        while True:
            stats = self.engine.stats()
            self.samples.append((len(self.live), 1.0 - stats.kv_pages_free / max(stats.kv_pages, 1)))
            await asyncio.sleep(period_s)


def tick_figures(ticks: list[tuple[float, bool, float]]) -> dict:
    """Tick p50/p99, count and late ticks of a run's (ms, late, ended at) records."""
    p50, p99 = percentiles([ms for ms, _, _ in ticks]) if ticks else (0.0, 0.0)
    return {"tick_ms_p50": p50, "tick_ms_p99": p99, "ticks": len(ticks),
            "late_ticks": sum(late for _, late, _ in ticks)}


def mean_length(mean_s: float, cap_s: float) -> float:
    """E[min(L, cap)] for L exponential around `mean_s`."""
    return mean_s * (1.0 - math.exp(-cap_s / mean_s))


def truncated_exponential(rng: random.Random, mean_s: float, cap_s: float) -> float:
    """A draw of an exponential around `mean_s` conditioned below `cap_s` (inverse CDF)."""
    return -mean_s * math.log(1.0 - rng.random() * (1.0 - math.exp(-cap_s / mean_s)))


async def call_mix(engine: Engine, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    frame_s = engine.config.tick_ms / 1000.0
    rate = args.concurrency / mean_length(args.mean_s, args.cap_s)
    mix = Mix(engine)
    # Steady state from the start: live calls with a steady state's ages, contexts and remaining lengths.
    calls = []
    for _ in range(args.concurrency):
        age = truncated_exponential(rng, args.mean_s, args.cap_s)
        calls.append((int(age / frame_s), min(rng.expovariate(1.0 / args.mean_s), args.cap_s - age)))
    opened = engine.stats()
    tasks, open_s = await mix.open_filled(calls)
    await mix.settle(2)
    sampler = asyncio.ensure_future(mix.sample(0.5))
    before = engine.stats()
    open_late_ticks = tick_figures(mix.ticks)["late_ticks"]
    mix.ticks.clear()
    started = time.monotonic()
    end = started + args.minutes * 60.0
    arrival = started
    seed = args.concurrency
    while True:
        arrival += rng.expovariate(rate)
        if arrival >= end:
            break
        await asyncio.sleep(max(0.0, arrival - time.monotonic()))
        seed += 1
        tasks.append(asyncio.ensure_future(mix.call(min(rng.expovariate(1.0 / args.mean_s), args.cap_s), seed)))
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    after = engine.stats()
    sampler.cancel()
    ticks = list(mix.ticks)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    live, occupancy = zip(*mix.samples) if mix.samples else ((0,), (0.0,))
    return {"bench": "call_mix", "kv": "fp8" if engine.config.fp8_kv else "bf16", "mean_s": args.mean_s,
            "cap_s": args.cap_s, "target_concurrency": args.concurrency, "arrivals_per_s": round(rate, 4),
            "minutes": args.minutes, "sessions_mean": round(float(np.mean(live)), 1), "sessions_max": max(live),
            **tick_figures(ticks), "late_ticks_at_s": [round(at - started, 2) for _, late, at in ticks if late],
            "arrivals": mix.arrivals, "refused": mix.refused,
            "refused_at_live_min": min(mix.refused_at_live, default=None), "failed": mix.failed,
            "shrink_events": after.kv_window_shrinks - before.kv_window_shrinks,
            "grow_events": after.kv_window_grows - before.kv_window_grows,
            "pool_occupancy_mean": round(float(np.mean(occupancy)), 4),
            "pool_occupancy_max": round(float(max(occupancy)), 4), "pool_pages": after.kv_pages,
            "page_frames": engine.lm_state.kv.page, "max_sessions": engine.max_sessions, "open_s": round(open_s, 1),
            "open_shrink_events": before.kv_window_shrinks - opened.kv_window_shrinks,
            "open_late_ticks": open_late_ticks}


async def fixed_load(engine: Engine, sessions: int, context: int, seconds: float) -> dict:
    """`sessions` calls, each holding `context` frames, for `seconds`: their tick figures."""
    mix = Mix(engine)
    while engine.stats().kv_pages_free < engine.stats().kv_pages:  # the calls before returning their pages
        await asyncio.sleep(0.05)
    tasks, open_s = await mix.open_filled([(context, seconds + 600.0)] * sessions)
    await mix.settle(SETTLE_TICKS)
    before = engine.stats()
    mix.ticks.clear()
    await asyncio.sleep(seconds)
    after = engine.stats()
    ticks, live = list(mix.ticks), len(mix.live)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"kv": "fp8" if engine.config.fp8_kv else "bf16", "sessions": sessions,
            "live": live, "context_frames": context, "open_s": round(open_s, 1), "seconds": seconds,
            **tick_figures(ticks), "failed": mix.failed,
            "shrink_events": after.kv_window_shrinks - before.kv_window_shrinks, "pool_pages": after.kv_pages,
            "pool_pages_free": after.kv_pages_free}


def equal_share_frames(mix: dict, sessions: int, seconds: float, tick_ms: float) -> int:
    """The context each of `sessions` equal calls opens with: so that over the `seconds` measured (after the settle's
    ticks) it holds on average the frames a mix's call held (the mix's pages per call, less the half page a call's
    last page holds unwritten on average), or less where their pages would outgrow the pool before the run ends.
    Equal calls all grow at once, where the mix's calls end and free pages: opened at the mix's share, 248 of 248
    calls shrank their windows at 250 on the H200; opened below it by their mean growth, 103 still did."""
    share = mix["pool_occupancy_mean"] * mix["pool_pages"] * mix["page_frames"] / sessions - mix["page_frames"] / 2
    fits = mix["pool_pages"] // sessions * mix["page_frames"] - SETTLE_TICKS - seconds * 1000.0 / tick_ms
    return max(0, round(min(share - mean_growth_frames(seconds, tick_ms), fits)))


def mean_growth_frames(seconds: float, tick_ms: float) -> float:
    """The frames a fixed load's call gains from its opening to the middle of its `seconds` measured."""
    return SETTLE_TICKS + seconds * 1000.0 / tick_ms / 2


async def equal_contexts(engine: Engine, mix: dict, seconds: float) -> dict:
    """The mix's mean live calls, each holding an equal share of the KV frames the mix held on average, for
    `seconds`: the tick the same KV costs without the mix's unequal contexts and arrivals (the issue's 1.05x)."""
    sessions, tick_ms = max(1, round(mix["sessions_mean"])), engine.config.tick_ms
    context = min(equal_share_frames(mix, sessions, seconds, tick_ms), engine.model.config.context)
    line = {"bench": "call_mix_equal", **await fixed_load(engine, sessions, context, seconds),
            "context_frames_mean": round(context + mean_growth_frames(seconds, tick_ms))}
    for stat in ("p50", "p99"):
        line[f"mix_vs_equal_{stat}"] = round(mix[f"tick_ms_{stat}"] / max(line[f"tick_ms_{stat}"], 1e-9), 4)
    return line


def memory_parts_gb(engine: Engine) -> dict[str, float]:
    """Where the device memory goes: weights, the KV pool, every row's other state (Mimi's streams, the LM's
    rings and tables, sampling), and the rest of what the allocator holds (the captured graphs, workspaces)."""
    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    runner = engine.runner
    weights = size(engine.model.lm.parameters()) + size(engine.model.mimi.parameters())
    pool = size(engine.lm_state.kv.tensors())
    rows = size(runner.buffers().row_views(0)) * (runner.spare_row + 1)
    parts = {"weights_gb": weights, "kv_pool_gb": pool, "row_state_gb": rows}
    if torch.cuda.is_available():
        parts["graphs_and_rest_gb"] = torch.cuda.memory_reserved() - weights - pool - rows
    return {name: round(value / 1e9, 2) for name, value in parts.items()}


async def main_async(args: argparse.Namespace) -> None:
    model = bench_model(args.tiny)
    started = time.perf_counter()
    config = EngineConfig(max_sessions=args.max_sessions, fp8_kv=args.fp8_kv, kv_pages=args.kv_pages,
                          kv_page_frames=args.page_frames, kv_floor_frames=args.floor_frames,
                          kv_free_gib=args.kv_free_gib, **arithmetic_config(args))
    engine = Engine(model, config)
    engine.start()
    memory = gpu_memory_gb()
    print(json.dumps({"bench": "call_mix_start", "max_sessions": args.max_sessions,
                      "kv": "fp8" if args.fp8_kv else "bf16", **arithmetic_config(args), **machine(),
                      "warm_lead_ms": config.warm_lead_ms, "pool_pages": engine.stats().kv_pages,
                      "page_frames": engine.lm_state.kv.page, "start_s": round(time.perf_counter() - started, 1),
                      **memory, **memory_parts_gb(engine)}), flush=True)
    try:
        if args.minutes > 0:
            mix = await call_mix(engine, args)
            print(json.dumps(mix), flush=True)
            if args.equal_seconds > 0:
                print(json.dumps(await equal_contexts(engine, mix, args.equal_seconds)), flush=True)
        if args.worst_case:
            line = await fixed_load(engine, args.worst_case, engine.model.config.context, args.worst_seconds)
            print(json.dumps({"bench": "call_mix_worst_case", **line}), flush=True)
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=250, help="live calls on average (sets the arrival rate)")
    parser.add_argument("--mean-s", type=float, default=180.0, help="mean call length, seconds")
    parser.add_argument("--cap-s", type=float, default=600.0, help="longest call, seconds")
    parser.add_argument("--minutes", type=float, default=3.0, help="steady-state minutes measured (0: none)")
    parser.add_argument("--max-sessions", type=int, default=320)
    parser.add_argument("--worst-case", type=int, default=0, help="then this many sessions at full context")
    parser.add_argument("--worst-seconds", type=float, default=30.0)
    parser.add_argument("--equal-seconds", type=float, default=0.0,
                        help="then the mix's KV as equal contexts of its mean live calls for this long (0: not)")
    parser.add_argument("--kv-pages", type=int, help="KV pool pages (default: from free GPU memory)")
    parser.add_argument("--kv-free-gib", type=float, default=EngineConfig.kv_free_gib,
                        help="GPU memory left free beside the KV pool")
    parser.add_argument("--page-frames", type=int, default=EngineConfig.kv_page_frames)
    parser.add_argument("--floor-frames", type=int, default=EngineConfig.kv_floor_frames,
                        help="the smallest context window a shrink leaves")
    parser.add_argument("--fp8-kv", action="store_true", help="FP8 (e4m3) KV cache")
    add_arithmetic_flags(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
