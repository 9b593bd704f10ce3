"""The engine on the H200: tick time by session count and context, capacity, and session-open latency.

    python -m bench.engine_bench [--sessions 1 16 32 64 72 76] [--contexts 0 3000] [--ticks 60] [--max-sessions 76]
                                 [--loads 1x0 250x1650 144x3000] [--open-background 64] [--opens 5] [--fp8-kv]
                                 [--(no-)mimi-encoder-bf16] [--(no-)mimi-decoder-bf16]
                                 [--over-channel [--workers 1] [--compare-staging]] [--trace-host TICKS]
                                 [--warm-lead-ms 0 [0.5 ...]] [--tiny]

Full 7B shape with random bf16 weights. Sessions are real engine sessions (realtime pacing, 80 ms wall-clock ticks)
fed by sources that always have a frame. Every session count is measured at every context, or, with `--loads`,
only the (sessions x context) pairs given. With `--over-channel` the sessions are a worker's, served over the engine
process's channel (model/engine/process.py) on a Unix socket, as the server runs them: the tick's host phases then
include `hand_off`, the listeners that encode each worker's outputs (each worker a process of its own,
bench/channel_worker.py, as in the server; `--workers` of them, the sessions split evenly); with
`--compare-staging` too, each load is measured with the engine process's input staging off, then on, on the same
engine (`EngineConfig.stage_inputs`, model/engine/staging.py; the lines' `stage_inputs`). With several
`--warm-lead-ms` values, each load is measured with each lead in turn on the same engine (`EngineConfig.warm_lead_ms`;
an A/B with no restart between, so no recompile and no new machine state). One JSON line per measurement:
- "tick": sessions, context, tick p50/p99 ms total, per part and on the host, late ticks, input frames staged as
  they arrived and the engine process's time on each worker's Frames message (over the channel), GPU memory, the
  fused helpers that fell back to eager (`fused_eager`, model/fused.py);
- "host_calls" (with `--trace-host TICKS`, CUDA): after a load's timed ticks, TICKS more under the profiler, and
  each CUDA runtime call the process made meanwhile (every thread's, the engine thread's uploads and launches among
  them): calls a tick, ms a tick, and each call's p50, p99 and longest in us, longest first; the host's share of a
  tick, call by call (an asynchronous copy that returns in a quarter of a millisecond is a copy that waited). The
  tracer records kernels too, which apparently makes a graph's launch pay per node: `cudaGraphLaunch` reads ~0.8 ms
  a call under it where it returns in 3.5-6 us untraced (docs/benchmarks.md), so its line is the tracer's cost;
- "capacity": the largest session count whose p99 tick stayed under 80 ms, per context;
- "open": session-open latency (voice .wav + persona prompt) cold and cached, while N sessions tick: until the
  open returned, and until the session's first frame came out.
`--tiny` runs the tiny checkpoint on the CPU, to try the script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.channel_worker import EndlessSource
from bench.fullsize import (
    add_arithmetic_flags,
    arithmetic_config,
    bench_model,
    gpu_memory_gb,
    machine,
    persona,
    voice_wav,
)
from model import fused
from model.engine import Engine, EngineConfig, FrameOutput, SamplingParams, SessionParams, Slot
from model.engine.process import EngineHost
from model.loading import PersonaPlex

ROOT = Path(__file__).resolve().parents[1]


def drop(_: FrameOutput) -> None:
    pass


def fail(error) -> None:
    raise SystemExit(f"session failed: {error}")


async def open_sessions(engine: Engine, count: int, params: SessionParams) -> list[Slot]:
    slots: list[Slot] = []
    for i in range(count):
        slot = engine.reserve()
        await slot.start(params, EndlessSource(i), drop, fail)
        slots.append(slot)
    return slots


class WorkerProcesses:
    """Worker processes' sessions on the engine's channel (bench/channel_worker.py), as a server's workers hold
    them: a load's sessions split evenly over the workers."""

    def __init__(self, procs: list[asyncio.subprocess.Process], host: EngineHost) -> None:
        self.procs = procs
        self.host = host

    @staticmethod
    async def command(proc: asyncio.subprocess.Process, line: str) -> list[str]:
        proc.stdin.write(f"{line}\n".encode())
        await proc.stdin.drain()
        answer = (await proc.stdout.readline()).decode().split()
        if not answer:
            raise SystemExit(f"engine_bench: a worker process ended at {line!r} (exit {await proc.wait()})")
        return answer

    async def open(self, count: int) -> None:
        n = len(self.procs)
        for k, proc in enumerate(self.procs):  # one after another: the rows fill in order, as with one worker
            await self.command(proc, f"open {count // n + (k < count % n)}")

    async def close(self) -> None:
        answers = await asyncio.gather(*(self.command(proc, "close") for proc in self.procs))
        failed = sum(int(answer[1]) for answer in answers)
        if failed:
            raise SystemExit(f"engine_bench: {failed} of the workers' sessions failed")


def percentiles(values: list[float]) -> tuple[float, float]:
    return round(float(np.percentile(values, 50)), 3), round(float(np.percentile(values, 99)), 3)


async def trace_host_calls(engine: Engine, ticks: int) -> list[dict]:
    """The CUDA runtime calls of `ticks` ticks, by name: CUPTI sees every thread's (the profiler's operator records
    are the calling thread's only, and the ticks run on the engine's). Graph launches read the tracer's own cost
    (module docstring)."""
    before = engine.stats().ticks
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        await asyncio.sleep(ticks * engine.config.tick_ms / 1000)
        traced = max(engine.stats().ticks - before, 1)
    durations: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("cu"):
            durations.setdefault(event.name, []).append(event.cpu_time_total)
    lines = []
    for name, us in durations.items():
        p50, p99 = np.percentile(us, [50, 99])
        lines.append({"bench": "host_calls", "call": name, "ticks": traced,
                      "calls_per_tick": round(len(us) / traced, 2), "ms_per_tick": round(sum(us) / traced / 1000, 4),
                      "us_p50": round(float(p50), 1), "us_p99": round(float(p99), 1), "us_max": round(max(us), 1)})
    return sorted(lines, key=lambda line: -line["ms_per_tick"])


async def measure_ticks(engine: Engine, sessions: int, context: int, ticks: int,
                        worker: WorkerProcesses | None = None, trace_ticks: int = 0) -> tuple[dict, list[dict]]:
    if worker is None:
        slots = await open_sessions(engine, sessions, SessionParams(sampling=SamplingParams()))
    else:
        slots = []
        await worker.open(sessions)
    await engine.submit(lambda: engine.fill_context(slice(0, sessions), context))
    await asyncio.sleep(1.0)  # settle
    before, warm_ups_before = engine.stats(), engine.runner.tick_warm_ups
    if worker is not None:
        worker.host.frames_dispatch_s.clear()
    # Read after the run's wall time, not every tick (polling stats() would contend with the tick thread it
    # measures), and again after the time the missing ticks take where an engine below real time made fewer.
    after, missing = before, ticks
    while missing > 0:
        await asyncio.sleep(missing * engine.config.tick_ms / 1000)
        after = engine.stats()
        missing = ticks - (after.ticks - before.ticks)
    records = engine.recent_ticks(after.ticks - before.ticks)
    warm_ups = engine.runner.tick_warm_ups - warm_ups_before
    calls = await trace_host_calls(engine, trace_ticks) if trace_ticks else []
    for slot in slots:
        slot.close()
    if worker is not None:
        await worker.close()
        await asyncio.sleep(0.2)  # a worker's closes reach the engine
    totals = [record.ms for record in records]
    parts: dict[str, list[float]] = {}
    for record in records:
        for name, ms in record.parts_ms.items():
            parts.setdefault(name, []).append(ms)
        # What the tick spent outside the GPU step: launching, handing out 1920 samples per slot.
        parts.setdefault("host", []).append(record.ms - sum(record.parts_ms.values()))
        for name, ms in record.host_ms.items():
            parts.setdefault(f"host_{name}", []).append(ms)
    p50, p99 = percentiles(totals)
    line = {"bench": "engine_tick", "sessions": sessions, "context_frames": context, "batch": after.batch,
            "tick_ms_p50": p50, "tick_ms_p99": p99, "late_ticks": after.late_ticks - before.late_ticks,
            "ticks": after.ticks - before.ticks,
            "input_frames_staged": after.input_frames_staged - before.input_frames_staged,
            "warm_lead_ms": engine.config.warm_lead_ms, "tick_warm_ups": warm_ups}
    for name, values in parts.items():
        line[f"{name}_ms_p50"], line[f"{name}_ms_p99"] = percentiles(values)
    dispatch_ms = [1000.0 * s for s in worker.host.frames_dispatch_s] if worker is not None else []
    if dispatch_ms:  # the engine process's asyncio thread, a worker's Frames message each
        line["frames_dispatch_ms_p50"], line["frames_dispatch_ms_p99"] = percentiles(dispatch_ms)
    return {**line, **gpu_memory_gb()}, [{**call, "sessions": sessions, "context_frames": context} for call in calls]


@dataclass
class OpenTimes:
    wall_ms: float  # until the open returned
    work_ms: float  # the engine thread's work for it
    first_frame_ms: float  # until its first frame was handed out (its first model half runs after the open)


async def open_once(engine: Engine, params: SessionParams, seed: int, phases: random.Random) -> OpenTimes:
    """One session open while the others tick; then close it and pause."""
    loop = asyncio.get_running_loop()
    first_frame: asyncio.Future[float] = loop.create_future()

    def on_output(_: FrameOutput) -> None:
        now = time.perf_counter()
        loop.call_soon_threadsafe(lambda: first_frame.done() or first_frame.set_result(now))

    slot = engine.reserve()
    started = time.perf_counter()
    await slot.start(params, EndlessSource(seed), on_output, fail)
    wall = (time.perf_counter() - started) * 1000
    work = engine.stats().open_work_ms_last
    first = (await asyncio.wait_for(first_frame, 5.0) - started) * 1000
    slot.close()
    # Arrivals at uniformly random points of the 80 ms tick cycle: a fixed pause would fall into the same few
    # phases (an open that arrives just before a tick waits for it), and a handful of opens would measure those.
    await asyncio.sleep(0.1 + phases.uniform(0.0, engine.config.tick_ms / 1000))
    return OpenTimes(wall, work, first)


async def measure_open(engine: Engine, background: int, wav: str, opens: int) -> list[dict]:
    slots = await open_sessions(engine, background, SessionParams(sampling=SamplingParams()))
    await engine.submit(lambda: engine.fill_context(slice(0, background), 3000))
    await asyncio.sleep(1.0)
    phases = random.Random(0)
    cached = SessionParams(voice=wav, persona=persona(40, salt=10_000), sampling=SamplingParams())
    lines = []
    for kind in ("cold", "cached"):
        if kind == "cached":
            await open_once(engine, cached, 0, phases)  # fills the prompt cache; not counted
        runs = []
        for i in range(opens):
            params = cached if kind == "cached" else SessionParams(voice=wav, persona=persona(40, salt=i),
                                                                   sampling=SamplingParams())
            runs.append(await open_once(engine, params, i, phases))
        times, work = [r.wall_ms for r in runs], [r.work_ms for r in runs]
        first = [r.first_frame_ms for r in runs]
        p50, p99 = percentiles(times)
        lines.append({"bench": "engine_open", "kind": kind, "background_sessions": background,
                      "voice_seconds": 4.0, "persona_words": 40, "opens": opens, "open_ms_p50": p50,
                      "open_ms_max": round(max(times), 3), "open_ms_p99": p99,
                      "first_frame_ms_p50": percentiles(first)[0], "first_frame_ms_max": round(max(first), 3),
                      "engine_work_ms_p50": percentiles(work)[0], "engine_work_ms_max": round(max(work), 3),
                      "open_step_ms": {k: round(v, 2) for k, v in engine.stats().open_step_ms.items()},
                      "late_ticks_total": engine.stats().late_ticks,
                      "prompt_copies_in_flight_total": engine.stats().prompt_copies_in_flight})
    for slot in slots:
        slot.close()
    return lines


@contextlib.asynccontextmanager
async def served_workers(engine: Engine, model: PersonaPlex, count: int) -> AsyncIterator[WorkerProcesses]:
    """The engine served on its channel, as the engine process serves it, and `count` worker processes on it."""
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "engine.sock")
        host = EngineHost(engine, model.info(), path)
        started = asyncio.Event()
        serving = asyncio.ensure_future(host.serve(started))
        await started.wait()
        procs = [await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.channel_worker", path, str(k),
                                                      stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                      cwd=ROOT) for k in range(count)]
        try:
            yield WorkerProcesses(procs, host)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving


async def main_async(args: argparse.Namespace) -> None:
    model = bench_model(args.tiny)
    started = time.perf_counter()
    arithmetic = arithmetic_config(args)
    engine = Engine(model, EngineConfig(max_sessions=args.max_sessions, fp8_kv=args.fp8_kv,
                                        warm_lead_ms=args.warm_lead_ms[0], **arithmetic))
    engine.start()
    kv = "fp8" if args.fp8_kv else "bf16"
    print(json.dumps({"bench": "engine_start", "max_sessions": args.max_sessions, "kv": kv, **arithmetic, **machine(),
                      "graph_capture_s": round(time.perf_counter() - started, 1), "fused_eager": fused.fallen_back(),
                      **gpu_memory_gb()}), flush=True)
    loads = args.loads or [(sessions, context) for context in args.contexts for sessions in args.sessions]
    contexts = sorted({context for _, context in loads})
    best: dict[int, int] = {}
    async with contextlib.AsyncExitStack() as stack:
        worker = (await stack.enter_async_context(served_workers(engine, model, args.workers))
                  if args.over_channel else None)
        for sessions, context in loads:
            if sessions > args.max_sessions:
                continue
            for staging, lead in itertools.product(
                    (False, True) if args.compare_staging else (engine.config.stage_inputs,), args.warm_lead_ms):
                engine.config.stage_inputs, engine.config.warm_lead_ms = staging, lead
                line, calls = await measure_ticks(engine, sessions, context, args.ticks, worker, args.trace_host)
                print(json.dumps({**line, **arithmetic, "over_channel": args.over_channel,
                                  "workers": args.workers if args.over_channel else 0, "stage_inputs": staging,
                                  "fused_eager": fused.fallen_back()}), flush=True)
                for call in calls:
                    print(json.dumps(call), flush=True)
            if line["tick_ms_p99"] < 80.0:
                best[context] = max(best.get(context, 0), sessions)
    for context in contexts:  # 0 where no session count measured stayed real time
        print(json.dumps({"bench": "engine_capacity", "context_frames": context,
                          "largest_realtime_sessions": best.get(context, 0),
                          "max_sessions_allocated": args.max_sessions}))
    if args.opens > 0:
        wav = voice_wav()
        for line in await measure_open(engine, min(args.open_background, args.max_sessions - 1), wav, args.opens):
            print(json.dumps(line), flush=True)
    engine.stop()


def load(text: str) -> tuple[int, int]:
    """'250x1650' -> (250 sessions, 1650 frames of context)."""
    sessions, _, context = text.partition("x")
    try:
        return int(sessions), int(context)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a load is SESSIONSxCONTEXT, e.g. 250x1650: got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 32, 64, 72, 76])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 3000])
    parser.add_argument("--ticks", type=int, default=60)
    parser.add_argument("--max-sessions", type=int, default=76)
    parser.add_argument("--open-background", type=int, default=64)
    parser.add_argument("--opens", type=int, default=5, help="opens of each kind to time (0: none)")
    parser.add_argument("--loads", type=load, nargs="+", help="SESSIONSxCONTEXT pairs instead of every pair")
    parser.add_argument("--fp8-kv", action="store_true", help="FP8 (e4m3) KV cache")
    add_arithmetic_flags(parser)
    parser.add_argument("--over-channel", action="store_true",
                        help="the sessions a worker's, over the engine process's channel (module docstring)")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --over-channel: worker processes, the sessions split evenly over them")
    parser.add_argument("--compare-staging", action="store_true",
                        help="with --over-channel: each load with input staging off, then on (stage_inputs)")
    parser.add_argument("--trace-host", type=int, default=0, metavar="TICKS",
                        help="after each load's ticks, TICKS more with each CUDA runtime call timed (CUDA)")
    parser.add_argument("--warm-lead-ms", type=float, nargs="+", default=[EngineConfig.warm_lead_ms],
                        help="wake this long before each tick to warm its first host calls (EngineConfig); "
                             "several: each load measured with each in turn")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    if args.trace_host and args.tiny:
        raise SystemExit("engine_bench: --trace-host times CUDA runtime calls: the tiny model runs on the CPU")
    if args.compare_staging and not args.over_channel:
        raise SystemExit("engine_bench: --compare-staging compares the engine process's input path: add --over-channel")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("engine_bench: the full 7B shape needs a CUDA GPU and none is visible; --tiny runs the "
                         "tiny checkpoint on the CPU")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
