"""How late this process's event loop runs what is due: the measure of a door process that is too busy.

A task asks to wake every PERIOD_S and records how much later it woke. A worker whose loop lags by tens of ms sends
its input frames late and its output in bursts, whatever the engine does; the lag's recent quantiles go to /metrics
(`personaplex_event_loop_lag_ms`) and, per worker process, to /health's `processes`. Where a wake-up is over
STALL_MS late, a watching thread takes the loop thread's stack once, and the places it found the loop most often
are reported beside the quantiles (`stall_sites`), and the latest ones with when they began on the machine's
monotonic clock (`stall_times`): a stall in a load run says where and when it was, not only that it was; a load
driver on the same machine puts it beside its calls' worst moments.
(A stall inside one C call that holds the GIL is seen as it ends: the stack is then where that call returned. A
place ending in `> select` is a loop that was idle and still woke late: the process did not get a CPU, or another of
its threads held the GIL; the host, not the loop's own work.)

The garbage collector is one cause, kept small here: a full collection walks every tracked object with the loop
held, and a worker's imports alone (aiohttp, aiortc, av, numpy, torch) are ~365,000 of them, 160 ms a walk on a
2-core machine; a WebRTC call's packets bring one every few seconds. `freeze_startup_objects` takes what exists once
the worker serves out of the collector's view, so a full collection walks only what sessions made since; how long
each full collection held the loop is timed (`collector_report`'s `full_max_ms`), so that a stall in a load run can
be told from one.

An import while serving is another: numpy imports numpy.ma at a process's first median or percentile, so this
module (which every door process and the load driver's processes import) imports it at their start instead.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import traceback
from collections import Counter, deque
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

# numpy imports it at a process's first median or percentile: 10 ms on the 2-core CPU, 35-54 ms on a 16-core H100 host
# with its sixteen processes busy, where the stall watch found every load-driver process held that long in it at its
# calls' end (its first quantiles) and four of eight door workers at their first loop-lag quantiles (2026-12-07).
import numpy.ma  # noqa: F401

PERIOD_S = 0.05
WINDOW = 1200  # the last minute of wake-ups
STALL_MS = 30.0  # a wake-up this late is a stall whose place is taken
WATCH_S = 0.01  # how often the watching thread looks while the loop has not started or is still held
SITES = 5  # the most frequent stall places reported
RECENT = 16  # the latest stalls reported with their times
_ROOT = Path(__file__).parents[2]  # as the frames name their files: not resolved
_OURS = tuple(str(_ROOT / package) + os.sep for package in ("app", "media", "model", "bench"))  # bench: the driver


def stall_site(frame: FrameType) -> str:
    """Where a stack was: its innermost frame of our packages ("app/doors/sip/call.py:238 snapshot"), and the
    innermost frame of all where that is another ("... > percentile")."""
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    for entry in reversed(stack):
        if entry.filename.startswith(_OURS):
            place = f"{Path(entry.filename).relative_to(_ROOT).as_posix()}:{entry.lineno} {entry.name}"
            return place if entry is inner else f"{place} > {inner.name}"
    return f"{Path(inner.filename).name}:{inner.lineno} {inner.name}"


class StallWatch:
    """A thread beside an event loop's thread: once the wake-up the loop's sampler waits for (`expect`) is STALL_MS
    overdue, it takes the loop thread's stack, once per wake-up, and counts the place (`stall_site`)."""

    def __init__(self) -> None:
        self._stalls: Counter[str] = Counter()
        self._recent: deque[tuple[float, str]] = deque(maxlen=RECENT)  # (the wake-up's due time, the place)
        self._lock = threading.Lock()  # this thread counts while the loop's reports read
        self._due: float | None = None  # on the monotonic clock
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Watch the calling thread's loop."""
        self.thread = threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                                       name="loop-stall-watch")
        self.thread.start()

    def stop(self) -> None:
        """Stop watching, the thread gone on return (it wakes at once): none is left for the interpreter's end."""
        self._stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=1.0)

    def expect(self, due: float) -> None:
        """The loop's next wake-up is due at `due` (time.monotonic())."""
        self._due = due

    def _watch(self, loop_thread: int) -> None:
        # It sleeps until the wake-up it waits for is STALL_MS overdue, once a period: polling every WATCH_S took
        # ~3 % off a busy loop's Python throughput (2-core CPU, best of eight runs), each look a GIL hand-over;
        # this way, none that the same runs could tell.
        sampled: float | None = None
        while True:
            due = self._due
            if due is None or due == sampled:  # not started yet, or this stall's place is taken: until the next
                if self._stop.wait(WATCH_S):
                    return
                continue
            if self._stop.wait(max(0.0, due + STALL_MS / 1000.0 - time.monotonic())):
                return
            if self._due != due:  # the loop woke in time, and waits for another
                continue
            sampled = due
            site = self._site(loop_thread)
            if site is not None:
                with self._lock:
                    self._stalls[site] += 1
                    self._recent.append((due, site))

    @staticmethod
    def _site(loop_thread: int) -> str | None:
        """Where the loop's thread is now. Its frames are let go here: held until the next stall, they kept every
        object of the stalled stack alive (and a server's last ones were freed by this thread as the interpreter
        ended, tensors among them: a C++ abort at exit)."""
        frame = sys._current_frames().get(loop_thread)
        return None if frame is None else stall_site(frame)

    def sites(self) -> dict[str, int]:
        """The SITES places the loop was found stalled most often, with how many times."""
        with self._lock:
            return dict(self._stalls.most_common(SITES))

    def recent(self) -> list[tuple[float, str]]:
        """The latest RECENT stalls: when each began (the wake-up's due time, time.monotonic(), ms rounded) and its
        place."""
        with self._lock:
            return [(round(due, 3), site) for due, site in self._recent]


class LoopLag:
    def __init__(self) -> None:
        self.lags_ms: deque[float] = deque(maxlen=WINDOW)
        self.stalls = StallWatch()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.stalls.start()
        try:
            while True:
                due = loop.time() + PERIOD_S  # loop.time() is time.monotonic()
                self.stalls.expect(due)
                await asyncio.sleep(PERIOD_S)
                self.lags_ms.append(max(0.0, (loop.time() - due) * 1000.0))
        finally:
            self.stalls.stop()

    def stall_sites(self) -> dict[str, int]:
        """Where the loop was found stalled most often since the start (StallWatch.sites)."""
        return self.stalls.sites()

    def stall_times(self) -> list[tuple[float, str]]:
        """The latest stalls with when each began (StallWatch.recent)."""
        return self.stalls.recent()

    def quantiles(self) -> dict[str, int]:
        """p50, p99 and max over the window, in whole ms (they cross to other processes as integers)."""
        if not self.lags_ms:
            return {}
        lags = np.fromiter(self.lags_ms, dtype=np.float64)
        p50, p99 = np.percentile(lags, [50, 99])
        return {"p50": round(float(p50)), "p99": round(float(p99)), "max": round(float(lags.max()))}


_frozen = 0
_full_started: float | None = None
_full_max_ms = 0.0


def _time_full_collections(phase: str, info: dict[str, Any]) -> None:
    """gc.callbacks: the longest full collection so far, ms (the young generations' are short and many)."""
    global _full_started, _full_max_ms
    if info["generation"] != 2:
        return
    if phase == "start":
        _full_started = time.perf_counter()
    elif _full_started is not None:
        _full_max_ms = max(_full_max_ms, (time.perf_counter() - _full_started) * 1000.0)
        _full_started = None


def freeze_startup_objects() -> None:
    """Collect what is garbage now, then move every surviving object to the collector's permanent generation; from
    then on, time each full collection."""
    global _frozen
    gc.collect()
    gc.freeze()
    # Counted once: gc.get_freeze_count() walks the whole frozen list, 34 ms over a worker's; reported twice a
    # second it held every worker's loop that long (loop lag p99 44 ms on the H200 host).
    _frozen = gc.get_freeze_count()
    if _time_full_collections not in gc.callbacks:
        gc.callbacks.append(_time_full_collections)


def collector_report() -> dict[str, int]:
    """Objects taken out of the collector's view at start, full collections so far (each walks only what is not
    frozen; the first is the freeze's own) and the longest of those since the freeze, in whole ms."""
    return {"frozen": _frozen, "full_collections": gc.get_stats()[2]["collections"],
            "full_max_ms": round(_full_max_ms)}
