"""The input buffer alone behind a link, read at different phases of the 20 ms packet grid: how much latency it adds.

    python3 -m bench.jitter_phase [--link far] [--tcp] [--seeds 3] [--phases-ms 0 5 ... 75] [--seconds 30]

A seeded `bench.impair.LinkModel` (`--link`: a preset, or fields as `Link.parse` reads them, e.g. far,jitter_ms=10)
delivers a 20 ms packet stream (random noise, so no window is silence the buffer may cut) into
`media.jitter.JitterBuffer` (`--tcp`: over a reliable link, a lost packet a retransmission later that holds what
follows, appended as a WebSocket door appends), which the engine's 80 ms tick reads from `0.5 s + phase` on, in virtual
time (no sockets, no sleeping). One JSON line per (seed, phase), "jitter_phase": the added latency's p50 and p95 over
the reads after the first 2.5 s, the buffer's jitter estimate and target, the link's own jitter p95 and the underruns; a
"jitter_phase_summary" line per seed (the p50's spread over the phases, the underruns); and a "jitter_phase_total" line:
all underruns, and the worst phase against its link's jitter p95.
On the far link (6 seeds x 16 phases 5 ms apart), when the buffer judged what it keeps on its level (the packets that
came early counted too), the phase decided the added p50 as much as the link did: 20 to 75 ms, median 50, the worst
phases at the link's p95 (55) + 20, 20 underruns. Judged in time, on the packet that completes each frame (see
media/jitter.py), it is 20 to 60 ms, median 40 (worst p95 + 5), with 6 underruns.
"""

from __future__ import annotations

import argparse
import heapq
import json

import numpy as np

from bench.impair import PRESETS, Link, LinkModel
from bench.impair_report import stall_recovery
from media.jitter import JitterBuffer

PACKET_S = 0.02
PACKET_SAMPLES = 480   # 20 ms at the model's 24 kHz
TICK_S = 0.08
FIRST_READ_S = 0.5
SETTLE_S = 2.5
RECOVERY_BOUND_S = 2.0  # the issue's: back within 20 ms of the pre-stall latency this soon after each stall


def run(link_name: str, seed: int, phase_s: float, seconds: float, tcp: bool = False) -> dict:
    """One buffer behind one seeded link, read every tick from FIRST_READ_S + phase_s. `tcp`: the link is reliable
    (a lost packet is a retransmission later, holding what follows, as the relay in front of a WebSocket door does)
    and the packets are appended (pts None), as a WebSocket door pushes them."""
    buffer = JitterBuffer(realtime=True)
    link = LinkModel(Link.parse(link_name), seed=seed, reliable=tcp)
    events: list[tuple[float, int, int]] = []        # (time, 0 = a packet arrives / 1 = a read, packet index)
    for k in range(int(seconds / PACKET_S)):
        for at in link.schedule(k * PACKET_S):
            heapq.heappush(events, (at, 0, k))
    read_at = FIRST_READ_S + phase_s
    while read_at < seconds:
        heapq.heappush(events, (read_at, 1, -1))
        read_at += TICK_S
    rng = np.random.default_rng(seed)
    while events:
        at, kind, k = heapq.heappop(events)
        if kind == 0:
            noise = (0.1 * rng.standard_normal(PACKET_SAMPLES)).astype(np.float32)
            buffer.push(None if tcp else k * PACKET_SAMPLES, noise, now=at)
        else:
            buffer.read_frame(now=at)
    added = [r.added_ms for r in buffer.trace() if r.added_ms is not None and r.at > SETTLE_S]
    stats = buffer.stats()
    line = {"bench": "jitter_phase", "link": link_name, "tcp": tcp, "seed": seed,
            "phase_ms": round(phase_s * 1000.0, 1),
            "added_p50_ms": round(float(np.percentile(added, 50)), 1),
            "added_p95_ms": round(float(np.percentile(added, 95)), 1),
            "jitter_estimate_ms": round(stats.jitter_ms, 1), "target_ms": round(stats.target_ms, 1),
            "link_jitter_p95_ms": round(link.stats.jitter_ms(), 1), "underruns": stats.underruns}
    # The first packet leaves at 0 on the link's clock and the reads share it, so the trace's origin is 0.
    stalls = stall_recovery(buffer.trace(), link.stall_starts(seconds - RECOVERY_BOUND_S - 1.0),
                            link.link.stall_ms / 1000.0, 0.0)
    if stalls:
        line["stalls_back_s"] = [s["back_after_s"] for s in stalls]
    return line


def recovered(line: dict) -> tuple[int, int]:
    """Stalls of a run, and those after which the added latency was back within the bound's time."""
    backs = line.get("stalls_back_s", [])
    return len(backs), sum(b is not None and b <= RECOVERY_BOUND_S for b in backs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="far", help=f"a preset ({', '.join(sorted(PRESETS))}) "
                        "or fields, as bench.impair.Link.parse reads them: far,jitter_ms=10")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--phases-ms", type=float, nargs="+", default=[5.0 * i for i in range(16)])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tcp", action="store_true", help="a reliable link and appended packets (a WebSocket door)")
    args = parser.parse_args()
    try:
        Link.parse(args.link)       # kept as written: it names the link in the JSON lines
    except ValueError as e:
        parser.error(str(e))
    every: list[dict] = []
    for seed in range(args.seeds):
        lines = [run(args.link, seed, phase / 1000.0, args.seconds, args.tcp) for phase in args.phases_ms]
        for line in lines:
            print(json.dumps(line))
        p50s = [line["added_p50_ms"] for line in lines]
        print(json.dumps({"bench": "jitter_phase_summary", "link": args.link, "seed": seed,
                          "added_p50_ms_min": min(p50s), "added_p50_ms_median": float(np.median(p50s)),
                          "added_p50_ms_max": max(p50s), "link_jitter_p95_ms": lines[0]["link_jitter_p95_ms"],
                          "underruns": sum(line["underruns"] for line in lines)}))
        every += lines
    worst = max(every, key=lambda line: line["added_p50_ms"] - line["link_jitter_p95_ms"])
    stalls, back = (sum(counts) for counts in zip(*(recovered(line) for line in every)))
    print(json.dumps({"bench": "jitter_phase_total", "link": args.link, "runs": len(every),
                      "underruns": sum(line["underruns"] for line in every),
                      "stalls": stalls, "stalls_back_within_2s": back,
                      "worst": {key: worst[key] for key in ("seed", "phase_ms", "added_p50_ms", "link_jitter_p95_ms")},
                      "worst_p50_over_p95_ms": round(worst["added_p50_ms"] - worst["link_jitter_p95_ms"], 1)}))

if __name__ == "__main__":
    main()
