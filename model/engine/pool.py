"""Every engine process of the host (one per GPU) seen from a worker as one engine: placement, totals, and each one.

`EnginePool` answers what the doors ask of an engine (`reserve_wait`, `validate`, `stats`, `running`,
`max_sessions`) over one `RemoteEngine` per engine process. A new session goes to the engine with the most free
slots (ties: the lower tick p99). Free slots are counted from each engine's last pushed stats, corrected by this
worker's own reservations since (stats come twice a second, a burst of opens comes faster), so a burst spreads at
once; the other workers' opens since the last stats are what it cannot see, and each worker balancing its own share
keeps the whole even. When every engine is full, the caller queues on the best one for up to its timeout.

An engine process that stops fails only its own sessions (`engine_stopped`, from its `RemoteEngine`); the pool keeps
placing on the others, and takes the engine back when its process is started again. Totals (`stats`) add slots and
ticks and take the worst tick quantiles; `engines()` gives each engine's own view for /health and /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from model.engine import EngineError, EngineStats, ResourceExhausted, SessionParams
from model.engine.channel import ModelInfo, WorkerInfo
from model.engine.client import RemoteEngine, RemoteSlot


@dataclass(frozen=True)
class EngineView:
    """One engine process as a worker sees it now."""

    index: int
    device: str
    pid: int
    running: bool
    stats: EngineStats | None


class EnginePool:
    """The engine processes of this server, from worker `worker`; `await run()` keeps every channel up."""

    def __init__(self, paths: list[str], devices: list[str], worker: int, input_lead_s: float = 0.008) -> None:
        """`devices`: each engine's device as configured (`auto` until its engine says which it took)."""
        if not paths or len(paths) != len(devices):
            raise ValueError("one channel path per engine device is needed")
        self.engines = [RemoteEngine(path, worker, input_lead_s) for path in paths]
        self.devices = list(devices)
        self.worker = worker
        self.folder = str(Path(paths[0]).parent)

    async def run(self) -> None:
        await asyncio.gather(*(engine.run() for engine in self.engines))

    def set_counters_source(self, source: object) -> None:
        for engine in self.engines:
            engine.counters_source = source  # type: ignore[assignment]

    # ---- what the doors use -----------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return any(engine.running for engine in self.engines)

    @property
    def max_sessions(self) -> int:
        return sum(engine.max_sessions for engine in self._connected())

    @property
    def model(self) -> ModelInfo | None:
        return next((engine.model for engine in self._connected()), None)

    @property
    def note(self) -> str:
        return next((engine.note for engine in self._connected()), "")

    @property
    def connects(self) -> int:
        return sum(engine.connects for engine in self.engines)

    @property
    def input_lead_s(self) -> float:
        return max(engine.input_lead_s for engine in self.engines)

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        """Each worker's process and counters, its sessions and late frames summed over the engines."""
        merged: dict[str, WorkerInfo] = {}
        for engine in self._connected():
            for number, info in engine.workers.items():
                seen = merged.get(number)
                merged[number] = info if seen is None else msgspec.structs.replace(
                    seen, sessions=seen.sessions + info.sessions, late_frames=seen.late_frames + info.late_frames)
        return merged

    async def wait_connected(self, timeout_s: float) -> bool:
        """Every engine connected within `timeout_s`."""
        results = await asyncio.gather(*(engine.wait_connected(timeout_s) for engine in self.engines))
        return all(results)

    def stats(self) -> EngineStats:
        return total_stats([engine.stats() for engine in self._connected()])

    async def fresh_stats(self) -> EngineStats:
        """Stats asked of every connected engine now (health checks), totalled over the engines connected once all
        have answered: one that connects meanwhile, or does not answer, counts with its last pushed stats, as /health
        lists it beside these totals (a test once saw two engines listed and one engine's slots in the total)."""
        await asyncio.gather(*(engine.fresh_stats() for engine in self._connected()), return_exceptions=True)
        return total_stats([engine.stats() for engine in self._connected()])

    def validate(self, params: SessionParams) -> None:
        self.engines[0].validate(params)

    async def reserve_wait(self, timeout_s: float) -> RemoteSlot:
        """A slot on the engine with the most free slots (ties: the lower tick p99), trying the next on a race;
        when all are full, queued on the best one for up to `timeout_s`."""
        ranked = sorted((engine for engine in self.engines if engine.running),
                        key=lambda engine: (-self._free(engine), engine.stats().tick_ms_p99))
        if not ranked:
            raise EngineError("no engine process is running", "engine_stopped")
        for engine in ranked:
            if self._free(engine) <= 0:
                break
            with contextlib.suppress(ResourceExhausted):
                return await engine.reserve_wait(0.0)
        return await ranked[0].reserve_wait(timeout_s)

    def engines_now(self) -> list[EngineView]:
        views = []
        for index, (engine, device) in enumerate(zip(self.engines, self.devices, strict=True)):
            stats = None
            with contextlib.suppress(EngineError):
                stats = engine.stats()
            taken = engine.model.device if engine.model is not None else device
            views.append(EngineView(index, taken, engine.engine_pid, engine.running, stats))
        return views

    # ---- placement ----------------------------------------------------------------------------------------------

    def _connected(self) -> list[RemoteEngine]:
        return [engine for engine in self.engines if engine.connected]

    def _free(self, engine: RemoteEngine) -> int:
        """Free slots: the last stats' count, with this worker's sessions taken as they are now."""
        stats = engine.stats()
        info = engine.workers.get(str(self.worker))
        mine_then = info.sessions if info is not None else 0
        return stats.max_sessions - (stats.sessions_in_use - mine_then + engine.sessions_here)


def total_stats(each: list[EngineStats]) -> EngineStats:
    """Several engines' stats as one: slots, ticks and counts add up; tick and start times take the worst."""
    if not each:
        raise EngineError("no engine process is connected", "engine_stopped")
    if len(each) == 1:
        return each[0]

    def added(field: str) -> int:
        return sum(getattr(s, field) for s in each)

    def worst(maps: list[dict[str, float]]) -> dict[str, float]:
        keys = set().union(*maps)
        return {key: max(m.get(key, 0.0) for m in maps) for key in keys}

    buckets: dict[float, int] = {}
    for s in each:
        for bound, count in s.tick_ms_buckets:
            buckets[bound] = buckets.get(bound, 0) + count
    causes: dict[str, int] = {}
    for s in each:
        for cause, count in s.errors_by_cause.items():
            causes[cause] = causes.get(cause, 0) + count
    slowest = max(each, key=lambda s: s.tick_ms_p99)
    return EngineStats(
        ticks=added("ticks"), late_ticks=added("late_ticks"), batch=added("batch"),
        tick_ms=max(s.tick_ms for s in each), tick_ms_p50=max(s.tick_ms_p50 for s in each),
        tick_ms_p99=slowest.tick_ms_p99, parts_ms=slowest.parts_ms, host_ms=slowest.host_ms,
        sessions_in_use=added("sessions_in_use"), max_sessions=added("max_sessions"),
        tick_ms_buckets=sorted(buckets.items()), tick_ms_sum=sum(s.tick_ms_sum for s in each),
        errors=added("errors"), errors_by_cause=causes, offline_frames=added("offline_frames"),
        prompt_cache_hits=added("prompt_cache_hits"), prompt_cache_misses=added("prompt_cache_misses"),
        open_work_ms_last=max(s.open_work_ms_last for s in each), open_step_ms=worst([s.open_step_ms for s in each]),
        prompt_copies_in_flight=added("prompt_copies_in_flight"), last_tick_at=max(s.last_tick_at for s in each),
        start_ms=worst([s.start_ms for s in each]), first_frame_ms=worst([s.first_frame_ms for s in each]),
        stalled_after_s=max(s.stalled_after_s for s in each),
        kv_pages=added("kv_pages"), kv_pages_free=added("kv_pages_free"), kv_window_shrinks=added("kv_window_shrinks"),
        kv_window_grows=added("kv_window_grows"), kv_refused=added("kv_refused"),
        gc_collections=added("gc_collections"), gc_ms_max=max(s.gc_ms_max for s in each),
        input_frames_staged=added("input_frames_staged"),
    )
