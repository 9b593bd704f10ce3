"""How late this process's event loop runs what is due: the measure of a door process that is too busy.

A task asks to wake every PERIOD_S and records how much later it woke. A worker whose loop lags by tens of ms sends
its input frames late and its output in bursts, whatever the engine does; the lag's recent quantiles go to /metrics
(`personaplex_event_loop_lag_ms`) and, per worker process, to /health's `processes`.

The garbage collector is one cause, kept small here: a full collection walks every tracked object with the loop
held, and a worker's imports alone (aiohttp, aiortc, av, numpy, torch) are ~365,000 of them, 160 ms a walk on a
2-core machine; a WebRTC call's packets bring one every few seconds. `freeze_startup_objects` takes what exists once
the worker serves out of the collector's view, so a full collection walks only what sessions made since.
"""

from __future__ import annotations

import asyncio
import gc
from collections import deque

import numpy as np

PERIOD_S = 0.05
WINDOW = 1200  # the last minute of wake-ups


class LoopLag:
    def __init__(self) -> None:
        self.lags_ms: deque[float] = deque(maxlen=WINDOW)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            self.lags_ms.append(max(0.0, (loop.time() - due) * 1000.0))

    def quantiles(self) -> dict[str, int]:
        """p50, p99 and max over the window, in whole ms (they cross to other processes as integers)."""
        if not self.lags_ms:
            return {}
        lags = np.fromiter(self.lags_ms, dtype=np.float64)
        p50, p99 = np.percentile(lags, [50, 99])
        return {"p50": round(float(p50)), "p99": round(float(p99)), "max": round(float(lags.max()))}


_frozen = 0


def freeze_startup_objects() -> None:
    """Collect what is garbage now, then move every surviving object to the collector's permanent generation."""
    global _frozen
    gc.collect()
    gc.freeze()
    # Counted once: gc.get_freeze_count() walks the whole frozen list, 34 ms over a worker's; reported twice a
    # second it held every worker's loop that long (loop lag p99 44 ms on the H200 host).
    _frozen = gc.get_freeze_count()


def collector_report() -> dict[str, int]:
    """Objects taken out of the collector's view at start, and full collections so far (each walks only what is
    not frozen)."""
    return {"frozen": _frozen, "full_collections": gc.get_stats()[2]["collections"]}
