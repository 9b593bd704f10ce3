"""The CPU engine's ticks beside a busy Python thread of its process, at Python's GIL switch interval and at the
engine's (core.ENGINE_SWITCH_INTERVAL_S).

    python -m bench.gil_contention [--model PATH] [--seconds 5] [--intervals-ms 5,0.5]

One live realtime session (silence) on the tiny checkpoint by default. For each switch interval: ticks alone, then
beside a thread that never waits (what an event loop under a burst of clients is). Every torch op of a CPU tick
gives up the GIL and waits to take it back, up to one switch interval each. Prints one JSON line per run: ticks,
tick ms p50 / max, and the longest gap between tick ends (what the stall check on /health sees).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time

import numpy as np

from model.engine import Engine, EngineConfig, SessionParams
from model.loading import load_model
from model.tiny import write_tiny_checkpoint


class Silence:
    def read_frame(self) -> None:
        return None

    def frames_ready(self) -> int:
        return 0


def spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


async def measure(engine: Engine, seconds: float, busy: bool, ends: list[float]) -> dict[str, float]:
    stop = threading.Event()
    spinner = threading.Thread(target=spin, args=(stop,)) if busy else None
    before, first_end = engine.counters.ticks, len(ends)
    if spinner is not None:
        spinner.start()
    await asyncio.sleep(seconds)
    stop.set()
    if spinner is not None:
        spinner.join()
    ms = [record.ms for record in engine.recent_ticks(engine.counters.ticks - before)] or [float("nan")]
    gaps = np.diff(ends[first_end:]) if len(ends) - first_end > 1 else np.array([seconds])
    return {"ticks": len(ms), "tick_ms_p50": round(float(np.median(ms)), 1), "tick_ms_max": round(max(ms), 1),
            "max_gap_s": round(float(gaps.max()), 3)}


async def run(args: argparse.Namespace) -> None:
    path = args.model or str(write_tiny_checkpoint(tempfile.mkdtemp()))
    engine = Engine(load_model(path), EngineConfig(max_sessions=2))
    engine.start()
    ends: list[float] = []
    engine.add_tick_listener(lambda record, next_tick_at: ends.append(time.monotonic()))
    try:
        await engine.reserve().start(SessionParams(), Silence(), lambda frame: None, lambda error: None)
        for interval_ms in args.intervals_ms:
            sys.setswitchinterval(interval_ms / 1000.0)  # the engine set its own at start; this overrides it
            for busy in (False, True):
                result = await measure(engine, args.seconds, busy, ends)
                print(json.dumps({"switch_interval_ms": interval_ms, "busy_thread": busy, **result}), flush=True)
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: a freshly written tiny checkpoint)")
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length")
    parser.add_argument("--intervals-ms", type=lambda text: [float(v) for v in text.split(",")], default=[5.0, 0.5],
                        help="switch intervals to compare, comma-separated (default 5,0.5)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
