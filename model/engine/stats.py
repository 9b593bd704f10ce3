"""The engine's counters: tick records and their histogram, errors by cause, offline frames, open work; and the
EngineStats snapshot other threads read. Its own lock: the engine thread writes, anyone reads."""

from __future__ import annotations

import bisect
import itertools
import statistics
import threading
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

# numpy imports it at a process's first percentile (35-54 ms on a busy host: app/shell/loop_lag.py); the engine
# process's first is at the stats after its first ticks, beside the tick thread, so it is taken here at the start.
import numpy.ma  # noqa: F401

from model.engine.api import EngineStats, TickRecord

if TYPE_CHECKING:
    from model.engine.pages import PoolCounts

TICK_MS_BUCKETS = (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 100.0, 160.0)
TICK_RECORDS = 2000
START_RECORDS = 500
# The names metrics and benchmarks know the first half by: its session-start step kind, and its host phase.
FIRST_HALF_STEP_LABEL = "lead"
FIRST_HALF_HOST_PHASE = "leads"
# The tick listeners' time after a tick (in the engine process, encoding each worker's outputs).
HAND_OFF_HOST_PHASE = "hand_off"
# Two parts of "prepare": reading the sessions' input frames, and the runner's pages, uploads and launches (the rest
# of "prepare" is the batch's flags and its pages' books).
PREPARE_INPUTS_HOST_PHASE = "prepare_inputs"
PREPARE_LAUNCH_HOST_PHASE = "prepare_launch"
# The parts of "prepare_launch" (runner.StepMarks): the pages, inputs and flags queued for the device; the step's
# parts launched (on the CPU, run); the outputs' gathers, finiteness check and copies to the host queued. Only what
# precedes the device's first work delays the tick; the rest overlaps it.
PREPARE_LAUNCH_PARTS = ("prepare_uploads", "prepare_steps", "prepare_outputs")


class EngineCounters:
    def __init__(self):
        self.lock = threading.Lock()
        self.records: deque[TickRecord] = deque(maxlen=TICK_RECORDS)
        self.buckets = [0] * (len(TICK_MS_BUCKETS) + 1)
        self.ticks = self.late = self.batch = 0
        self.tick_ms_sum = 0.0
        self.last_tick_at = 0.0
        self.errors: Counter[str] = Counter()  # by cause
        self.offline_frames = 0
        self.open_ms = 0.0
        self.copies_in_flight = 0
        self.refused = 0  # sessions the KV pages could not cover
        self.gc_collections = 0  # the engine thread's garbage collections (core._collect_garbage)
        self.gc_ms_max = 0.0
        self.start_s: deque[float] = deque(maxlen=START_RECORDS)
        self.first_frame_s: deque[float] = deque(maxlen=START_RECORDS)

    def record_start(self, seconds: float) -> None:
        with self.lock:
            self.start_s.append(seconds)

    def record_first_frame(self, seconds: float) -> None:
        with self.lock:
            self.first_frame_s.append(seconds)

    def record_tick(self, ms: float, batch: int, late: bool, parts_ms: dict[str, float],
                    host_ms: dict[str, float]) -> TickRecord:
        record = TickRecord(ms, batch, late, parts_ms, host_ms)
        with self.lock:
            self.ticks += 1
            self.late += int(late)
            self.batch = batch
            self.records.append(record)
            self.tick_ms_sum += ms
            self.buckets[bisect.bisect_left(TICK_MS_BUCKETS, ms)] += 1
        return record

    def record_collection(self, ms: float) -> None:
        with self.lock:
            self.gc_collections += 1
            self.gc_ms_max = max(self.gc_ms_max, ms)

    def count_refusal(self) -> None:
        with self.lock:
            self.refused += 1

    def count_error(self, cause: str) -> None:
        with self.lock:
            self.errors[cause] += 1

    def recent(self, count: int) -> list[TickRecord]:
        with self.lock:
            records = list(self.records)
        return records[max(len(records) - count, 0) :]

    def snapshot(self, sessions_in_use: int, max_sessions: int, cache_hits: int, cache_misses: int,
                 step_seconds: dict[str, list[float]], pages: PoolCounts) -> EngineStats:
        # Copied under the lock, summarised outside it.
        with self.lock:
            ms = [record.ms for record in self.records]
            starts, first_frames = list(self.start_s), list(self.first_frame_s)
            last = self.records[-1] if self.records else None
            counts = list(self.buckets)
            stats = EngineStats(
                ticks=self.ticks, late_ticks=self.late, batch=self.batch, tick_ms=last.ms if last else 0.0,
                tick_ms_p50=0.0, tick_ms_p99=0.0, parts_ms=dict(last.parts_ms) if last else {},
                host_ms=dict(last.host_ms) if last else {}, sessions_in_use=sessions_in_use,
                max_sessions=max_sessions, tick_ms_buckets=[], tick_ms_sum=self.tick_ms_sum,
                errors=sum(self.errors.values()), errors_by_cause=dict(self.errors),
                offline_frames=self.offline_frames, prompt_cache_hits=cache_hits, prompt_cache_misses=cache_misses,
                open_work_ms_last=self.open_ms, open_step_ms={}, prompt_copies_in_flight=self.copies_in_flight,
                last_tick_at=self.last_tick_at, kv_pages=pages.pages, kv_pages_free=pages.free,
                kv_window_shrinks=pages.shrinks, kv_window_grows=pages.grows, kv_refused=self.refused,
                gc_collections=self.gc_collections, gc_ms_max=self.gc_ms_max,
            )
        if ms:
            stats.tick_ms_p50, stats.tick_ms_p99 = (float(v) for v in np.percentile(ms, [50, 99]))
        stats.start_ms, stats.first_frame_ms = quantiles_ms(starts), quantiles_ms(first_frames)
        stats.tick_ms_buckets = list(zip((*TICK_MS_BUCKETS, float("inf")), itertools.accumulate(counts)))
        stats.open_step_ms = {FIRST_HALF_STEP_LABEL if kind == "first_half" else kind: 1000.0 * statistics.median(runs)
                              for kind, runs in step_seconds.items()}
        return stats


def quantiles_ms(seconds: Iterable[float]) -> dict[str, float]:
    """p50, p99 and max of durations in seconds, as ms ({} for none)."""
    seconds = list(seconds)
    if not seconds:
        return {}
    p50, p99 = np.percentile(seconds, [50, 99])
    return {"p50": 1000.0 * float(p50), "p99": 1000.0 * float(p99), "max": 1000.0 * max(seconds)}
