"""What a caller behind a bad link hears, from measurements: the server's input buffer and the client's player.

Input side, from a jitter buffer's read trace (`media.jitter.JitterBuffer.trace()`) and stats, against the link's
own record (`bench.impair.LinkStats`): concealed ms against lost ms; underruns (the ones a stall or a loss burst at
the newest packets explains are told apart by the caller, who knows the link); the added input latency (the depth a
read leaves: how long the newest sample of the frame it handed out had waited) after the first seconds, p50 and p95,
against the link's jitter p95; and after each stall, how long until the added latency is back within 20 ms of its
value before the stall (the median of five reads, a sawtooth cycle, at or under it), with the most sound one read
cut (the acceleration's step).

Output side, at a player on the client: `fixed_delay_player` plays each piece of the stream at a fixed delay after
the first one arrived (a WebSocket client's playout, moshi's web client style) and counts the gaps (a piece that came
after its time: the player pauses until it comes, and goes on that much later) and their length, and the buffer that
would have played the call without a gap (`needed_ms`: the lateness's maximum). WebRTC's stand-in for the browser's
player is `adaptive_player`: the received packets (pts and arrival) replayed into our own jitter buffer read every
20 ms, as a NetEq-like player does (concealment, underruns, the delay it settles at).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from media.jitter import JitterBuffer, JitterConfig, JitterStats, ReadRecord

RATE = 24000
SETTLE_S = 2.0          # the added latency is judged after this much of the call (the buffer primes, then adapts)
RECOVERED_MS = 20.0
CYCLE_READS = 5
STALL_RECOVERY_S = 2.0  # the bound on a stall's recovery


def _q(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def _added(trace: Sequence[ReadRecord]) -> tuple[np.ndarray, np.ndarray]:
    """The reads that handed out a frame: their times and the latency each added."""
    kept = [r for r in trace if r.added_ms is not None]
    return np.array([r.at for r in kept]), np.array([r.added_ms for r in kept])


def _back_after(times: np.ndarray, added: np.ndarray, start: float, end: float) -> tuple[float | None, float | None]:
    """The added latency before `start` (median over the 2 s before) and the seconds from `end` until a cycle of
    reads has its median back within 20 ms of it (None: never, within the trace)."""
    before = added[(times >= start - 2.0) & (times < start)]
    if not before.size:
        return None, None
    pre = float(np.median(before))
    after_t, after = times[times >= end], added[times >= end]
    for k in range(max(0, after.size - CYCLE_READS + 1)):
        if np.median(after[k:k + CYCLE_READS]) <= pre + RECOVERED_MS:
            return pre, float(after_t[k] - end)
    return pre, None


def stall_recovery(trace: Sequence[ReadRecord], stall_starts: Sequence[float], stall_s: float,
                   origin: float) -> list[dict[str, float | None]]:
    """For each stall (starts in seconds after `origin`, on the trace's clock): the added latency before it (median
    over the 2 s before), and the seconds from its end until a cycle of reads has its median back within 20 ms of
    that (None: never, within the trace)."""
    times, added = _added(trace)
    out: list[dict[str, float | None]] = []
    for start in stall_starts:
        end = origin + start + stall_s
        pre, back = _back_after(times, added, origin + start, end)
        after = added[times >= end]
        out.append({"at_s": start, "added_before_ms": None if pre is None else round(pre, 1),
                    "back_after_s": None if back is None else round(back, 2),
                    "peak_ms": round(float(after[:CYCLE_READS * 4].max()), 1) if after.size else None})
    return out


def late_read_windows(trace: Sequence[ReadRecord], tick_s: float, late_s: float,
                      most_s: float = STALL_RECOVERY_S) -> list[tuple[float, float]]:
    """Where the reader itself stalled: each read that came more than `late_s` after its period (a tick this
    machine could not run on time: the frame it skipped stays in the buffer as excess) opens a window on the trace's
    clock that closes when the added latency is back within 20 ms of its value before (as after a link's stall), or
    `most_s` after it: a buffer slower to recover than a link's stall allows has the reads after that judged."""
    times, added = _added(trace)
    windows = []
    for a, b in zip(trace, trace[1:]):
        if b.at - a.at > tick_s + late_s:
            _, back = _back_after(times, added, b.at, b.at)
            windows.append((b.at, b.at + (most_s if back is None else min(back, most_s))))
    return windows


def underrun_onsets(trace: Sequence[ReadRecord], since: float, until: float) -> list[float]:
    """When reads began to find the buffer dry (a read that handed out nothing after one that did)."""
    return [b.at for a, b in zip(trace, trace[1:])
            if b.added_ms is None and a.added_ms is not None and since <= b.at <= until]


def unexplained(onsets: Sequence[float], causes: Sequence[float], window_s: float = 1.0) -> list[float]:
    """The underruns no cause (a loss's send time, a retransmission, a stall, the client's own late send) came
    within `window_s` before."""
    c = np.sort(np.asarray(causes, dtype=np.float64))
    out = []
    for t in onsets:
        i = int(np.searchsorted(c, t, side="right"))
        if i == 0 or t - c[i - 1] > window_s:
            out.append(t)
    return out


def input_report(stats: JitterStats, trace: Sequence[ReadRecord], lost_ms: float, jitter_p95_ms: float,
                 origin: float, stall_starts: Sequence[float] = (), stall_s: float = 0.0,
                 unjudged: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The server's input side of one call (see the module docstring); `origin` is when the call's audio began on
    the trace's clock. The added latency leaves out the reads in `unjudged` windows (the reader's own stalls,
    `late_read_windows`)."""
    settled = [r.added_ms for r in trace if r.added_ms is not None and r.at - origin >= SETTLE_S
               and not any(start <= r.at < end for start, end in unjudged)]
    return {
        "lost_ms": round(lost_ms, 1), "concealed_ms": round(stats.concealed_ms, 1),
        "underruns": stats.underruns, "late_drops": stats.late_drops,
        "overrun_drops_ms": round(stats.overrun_drops_ms, 1),
        "added_ms": {"p50": _q(settled, 50), "p95": _q(settled, 95)}, "judged_reads": len(settled),
        "jitter_p95_ms": round(jitter_p95_ms, 1), "target_ms": round(stats.target_ms, 1),
        "sound_cut_max_ms": round(stats.sound_cut_max_ms, 2), "hard_cuts": stats.hard_cuts,
        "stalls": stall_recovery(trace, stall_starts, stall_s, origin),
    }


def fixed_delay_player(arrivals: Sequence[float], ends_s: Sequence[float], delay_ms: float) -> dict[str, Any]:
    """A player that starts `delay_ms` after the first piece arrived and plays the stream at real time: each piece
    (arrival time, where it ends in the stream in seconds) must be there before it is due; one that is not pauses the
    player until it arrives (a gap), and everything after plays that much later."""
    if not arrivals:
        return {"delay_ms": delay_ms, "gaps": 0, "gap_ms": 0.0, "needed_ms": None, "lateness_ms": None}
    t = np.asarray(arrivals, dtype=np.float64)
    ends = np.asarray(ends_s, dtype=np.float64)
    starts = np.concatenate([[0.0], ends[:-1]])
    order = np.argsort(starts, kind="stable")
    t, starts = t[order], starts[order]
    shift, gaps, gap_s = t[0] + delay_ms / 1000.0, 0, 0.0
    for arrived, begins in zip(t, starts):
        due = shift + begins
        if arrived > due:
            gaps += 1
            gap_s += arrived - due
            shift += arrived - due
    lag = t - starts
    lateness = (lag - lag[0]) * 1000.0
    return {"delay_ms": delay_ms, "gaps": gaps, "gap_ms": round(gap_s * 1000.0, 1),
            "needed_ms": round(float(lateness.max()), 1),
            "lateness_ms": {"p50": _q(lateness, 50), "p99": _q(lateness, 99)}}


def adaptive_player(chunks: Sequence[tuple[int, np.ndarray, float]], tail_s: float = 0.2) -> dict[str, Any]:
    """The received packets (24 kHz pts, samples, arrival) replayed into a jitter buffer read 20 ms at a time from the
    first arrival on (a NetEq-like player): what it concealed, its underruns, and the delay it held."""
    if not chunks:
        return {"concealed_ms": 0.0, "underruns": 0, "delay_ms": None}
    packet = 480
    jb = JitterBuffer(config=JitterConfig(frame=packet, prime_margin_ms=40.0))
    events = sorted([(arrived, 0, pts, samples) for pts, samples, arrived in chunks], key=lambda e: (e[0], e[1]))
    t0, t_end = events[0][0], events[-1][0] + tail_s
    reads = np.arange(t0 + 0.02, t_end, 0.02)
    merged = sorted([(e[0], 0, e[2], e[3]) for e in events] + [(r, 1, 0, None) for r in reads],
                    key=lambda e: (e[0], e[1]))
    for at, kind, pts, samples in merged:
        if kind == 0:
            jb.push(int(pts), samples, now=at)
        else:
            jb.read_frame(now=at)
    st = jb.stats()
    held = [r.added_ms for r in jb.trace() if r.added_ms is not None]
    return {"concealed_ms": round(st.concealed_ms, 1), "underruns": st.underruns, "late_drops": st.late_drops,
            "delay_ms": {"p50": _q(held, 50), "p95": _q(held, 95)}, "target_ms": round(st.target_ms, 1)}
