"""What a load run reads from the server: `/health` and `/metrics` before and after (ticks, late ticks, tick
quantiles over the run from the histogram, the engine thread's garbage collections, underruns, errors and
rejections by code), and per server process on this machine its CPU time, resident memory and open file
descriptors from /proc. Used by `bench/e2e.py` and `bench/soak.py`.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process on this machine, or None when it is not here."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> Metrics:
    out: Metrics = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric_delta(before: Metrics, after: Metrics, name: str, label: str | None = None) -> dict[str, float] | float:
    """The growth of a counter over the run (per value of `label` when given)."""
    if label is None:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)
    grown: Counter[str] = Counter()
    for k, v in after.items():
        if k[0] == name:
            grown[dict(k[1]).get(label, "")] += v - before.get(k, 0.0)
    return {key: n for key, n in grown.items() if n}


def histogram_count(before: Metrics, after: Metrics, name: str, edge: float) -> float:
    """The observations a histogram gained over the run at or below `edge` (a bucket's bound)."""
    return sum(v - before.get(k, 0.0) for k, v in after.items()
               if k[0] == f"{name}_bucket" and float(dict(k[1])["le"]) == edge)


def histogram_quantiles(before: Metrics, after: Metrics, name: str, qs: tuple[float, ...]) -> dict[str, float | None]:
    """Quantiles of the observations a histogram gained over the run, interpolated inside their bucket."""
    buckets = sorted((float(dict(k[1])["le"]), v - before.get(k, 0.0))
                     for k, v in after.items() if k[0] == f"{name}_bucket")
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, float | None] = {}
    for q in qs:
        key = f"p{round(q * 100):d}_ms"
        if total <= 0:
            out[key] = None
            continue
        want, lo_edge, lo_count = q * total, 0.0, 0.0
        for edge, count in buckets:
            if count >= want:
                if edge == float("inf"):
                    out[key] = lo_edge
                else:
                    share = (want - lo_count) / (count - lo_count) if count > lo_count else 1.0
                    out[key] = round(lo_edge + share * (edge - lo_edge), 2)
                break
            lo_edge, lo_count = edge, count
    return out


async def server_snapshot(http: aiohttp.ClientSession, url: str, pids: dict[int, str]) -> dict[str, Any]:
    async with http.get(url + "/health") as res:
        health = await res.json()
    async with http.get(url + "/metrics") as res:
        metrics = parse_metrics(await res.text())
    for p in health.get("processes") or []:
        pids.setdefault(int(p["pid"]), str(p.get("role", "server")))
    return {"health": health, "metrics": metrics, "cpu": {pid: cpu_seconds(pid) for pid in pids},
            "at": time.monotonic()}


def server_report(before: dict[str, Any], after: dict[str, Any], pids: dict[int, str]) -> dict[str, Any]:
    wall = after["at"] - before["at"]
    # What /health says of each process at the end (a worker's sessions, loop lag over the last minute, garbage
    # collections), beside its CPU over the run.
    reported = {int(p["pid"]): p for p in after["health"].get("processes") or []}
    processes = []
    for pid, role in pids.items():
        c0, c1 = before["cpu"].get(pid), after["cpu"].get(pid)
        said = {k: v for k, v in reported.get(pid, {}).items() if k not in ("pid", "this")}
        processes.append({"role": role, **said, "pid": pid, "cpu_pct": None if c0 is None or c1 is None
                          else round(100.0 * (c1 - c0) / wall, 1)})
    m0, m1 = before["metrics"], after["metrics"]
    tick1 = after["health"].get("tick", {})
    return {
        "model": after["health"].get("model"), "note": after["health"].get("note"),
        "sessions_max": after["health"].get("sessions", {}).get("max"),
        # Every count of ticks from the one scrape of /metrics: /health is read just before it, and a tick that lands
        # between the two would count in one window and not the other.
        "ticks": round(metric_delta(m0, m1, "personaplex_engine_ticks_total")),
        "late_ticks": round(metric_delta(m0, m1, "personaplex_engine_late_ticks_total")),
        "tick_window_p50_ms": round(tick1.get("p50_ms", 0.0), 2),
        "tick_window_p99_ms": round(tick1.get("p99_ms", 0.0), 2),
        "tick_run_ms": histogram_quantiles(m0, m1, "personaplex_engine_tick_ms", (0.5, 0.99)),
        # A tick that runs long without being late still delays every session's frame by as much: a phone door's
        # sender, which holds a frame one packet, plays silence for it.
        "ticks_over_ms": {f"{edge:g}": metric_delta(m0, m1, "personaplex_engine_tick_ms_count")
                          - histogram_count(m0, m1, "personaplex_engine_tick_ms", edge) for edge in (25.0, 40.0)},
        # The engine thread's collections in the run, and the longest since the server started.
        "engine_gc": {"collections": metric_delta(m0, m1, "personaplex_engine_gc_collections_total"),
                      "max_ms": round(max((v for k, v in m1.items() if k[0] == "personaplex_engine_gc_max_ms"),
                                          default=0.0), 2)},
        "underruns": metric_delta(m0, m1, "personaplex_underruns_total"),
        "errors_by_code": metric_delta(m0, m1, "personaplex_errors_total", "code"),
        "rejections_by_code": metric_delta(m0, m1, "personaplex_rejections_total", "code"),
        "processes": processes,
    }
