"""The per-door table of an impaired load run (`bench.impair_run`'s JSON files), as docs/benchmarks.md prints it.

    python3 -m bench.impair_table docs/bench/h200_impaired_{far,clean,stalls,bursty}.jsonl

Each file is one `bench.e2e` run, or several (one JSON line each, as `--out` appends them: runs of one condition under
other seeds, say), whose sessions are pooled; its name after the last `_` (far, clean, stalls, bursty) names the run.
Rows: each door under each link: the all-clean run, the clean callers beside the far ones, and the impaired callers of
every impaired run. Columns: sessions; RTF min at the client; missing frames max; client output lateness p99 ms (median
/ max over sessions), and the same without the pieces read while the load driver's own loop was held 10 ms or more (runs
since 2026-12-07; SIP's arrivals are the kernel's, so the same); the server input buffer's added latency p50 ms (median
/ max; WebRTC from the call's own stats, SIP's where the call's end came back, the Realtime and native dialects from
`session.closed` (the whole call; runs before it from the native dialect's last `session.link`), Twilio from `GET
/v1/calls` (none in runs before it)); the link's uplink jitter p95 ms (median / max); sessions whose added p50 is over
that jitter + 20 ms (the issue's bound, for 20 ms packets), and over that jitter + the door's packet where its load
client sends longer ones (the Realtime and native clients' 80 ms appends unless the run set `--piece-ms`: a buffer holds
whole appends); concealed / lost ms summed over the sessions that report both (lost: what the link lost of the caller's
packets, less what in-band FEC rebuilt, plus what the caller's own sender skipped, where a WebRTC run reports those;
before them, the link's loss alone); input underruns max; most sound cut by one read ms / hard cuts; first audio p50 ms.
After the table, one JSON line per run: ticks, late ticks, tick p50 / p99, the engine thread's garbage collections, and
per door the silence the server sent its callers where a frame was due and had not come (calls reporting it, calls sent
any, total ms: the server's gaps, not the link's); one per worker process: its CPU, loop lag and the input frames it
sent the engine late (the counters are the server's totals since its start), its longest full collection and where its
loop was when it stalled (since 2026-12-07), which is where a busy worker shows, with the stalls that began during
the run as [seconds from the sessions' origin, place] (`stalls_at_s`, runs since c8b6e3a: beside the calls'
`worst_at_s`, a stall is told to be the one that made a call's worst moment); and, for runs that traced the load
driver's own loops (bench.e2e since 2026-12-06), one per run with each driver process's loop lag max (and where it
stalled, since 2026-12-07) and how many sessions had their worst moment with a driver stall half its size or more beside
it: the driver's share of the lateness maxima.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.doors import DOORS as CLIENTS

DOORS = {"webrtc": "WebRTC", "realtime": "Realtime", "twilio": "Twilio", "sip": "SIP", "duplex": "native"}
BOUND_MS = 20.0


def input_figures(session: dict[str, Any]) -> dict[str, float] | None:
    """The server input buffer's figures for one session, where its door reports them."""
    if server := session.get("server"):
        # WebRTC: the buffer's own hold where the run has it, as every other door reports it; runs before it have
        # only the wait until the tick began, which also counts the worker's input lead and the answer's way back.
        held = server.get("input_buffered_ms") or server["input_added_ms"]
        return {"added_p50": held["p50"], "underruns": server["input_underruns"],
                "concealed": server["concealed_ms"], "cut": server["sound_cut_max_ms"], "hard": server["hard_cuts"]}
    if (closed := session.get("server_closed") or {}).get("input_added_ms_p50") is not None:
        # The Realtime and native dialects' session.closed: the whole call's figures.
        return {"added_p50": closed["input_added_ms_p50"], "underruns": closed["underruns"],
                "concealed": closed["concealed_ms"], "cut": closed["input_sound_cut_max_ms"],
                "hard": closed["input_hard_cuts"]}
    # The SIP door's call stats, a Twilio call's live stats (GET /v1/calls) and the native dialect's session.link
    # carry the buffer's own stats, field for field.
    got = ((session.get("sip_server") or {}).get("input") or (session.get("call_stats") or {}).get("input")
           or (session.get("server_link") or {}).get("input"))
    if got is None:
        return None
    return {"added_p50": (got["added_ms"] or {}).get("p50") or 0.0, "underruns": got["underruns"],
            "concealed": got["concealed_ms"], "cut": got["sound_cut_max_ms"], "hard": got["hard_cuts"]}


def silence_sent_ms(session: dict[str, Any]) -> float | None:
    """The silence the server sent this caller where the model's next frame was due and had not come (the engine
    or the worker late, not the link), where the door reports it: WebRTC's call stats, SIP's, a Twilio call's
    `GET /v1/calls` (runs before it: none)."""
    if server := session.get("server"):
        return server.get("output_underrun_ms")
    return (session.get("sip_server") or session.get("call_stats") or {}).get("out_silence_ms")


def silence_by_door(sessions: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per door: the calls that report it, those that were sent any silence, and its total ms."""
    out: dict[str, dict[str, float]] = {}
    for s in sessions:
        if (ms := silence_sent_ms(s)) is not None:
            door = out.setdefault(s["door"], {"calls": 0, "with_silence": 0, "ms": 0.0})
            door["calls"] += 1
            door["with_silence"] += ms > 0
            door["ms"] = round(door["ms"] + ms, 1)
    return out


def lost_ms(session: dict[str, Any]) -> float:
    """The caller's audio the server could not have had: the link's losses less what RED and FEC rebuilt, plus
    sender skips."""
    server = session.get("server") or {}
    rebuilt = (server.get("fec_rebuilt") or 0) + (server.get("red_rebuilt") or 0)
    return session["impairment"]["rtp_lost_ms"] - 20.0 * rebuilt + session.get("sender_skipped_ms", 0.0)


def _pair(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return f"{np.median(values):.{digits}f} / {max(values):.{digits}f}"


def row(door: str, label: str, sessions: list[dict[str, Any]]) -> str:
    inputs = [(s, got) for s in sessions if (got := input_figures(s)) is not None]
    # by session, not name: pooled runs repeat their names
    jitter = {id(s): s["impairment"]["up"]["jitter_p95_ms"] for s in sessions if s.get("impairment")}
    lost = [(s, got) for s, got in inputs if s.get("impairment", {}).get("rtp_lost_ms") is not None]
    # each session's own piece where its report names it (bench.e2e --piece-ms), else the door's client's default
    packet_ms = max(BOUND_MS, *(s.get("piece_ms", 1000.0 * CLIENTS[door].send_period_s) for s in sessions))
    over = [s for s, got in inputs if id(s) in jitter and got["added_p50"] > jitter[id(s)] + BOUND_MS]
    over_packet = [s for s, got in inputs if id(s) in jitter and got["added_p50"] > jitter[id(s)] + packet_ms]
    judged = len([1 for s, _ in inputs if id(s) in jitter])
    cells = [
        DOORS[door], label, str(len(sessions)), f"{min(s['rtf'] for s in sessions):.4f}",
        str(max(s["missing_frames"] for s in sessions)),
        _pair([s["output_lateness_ms"]["p99"] for s in sessions]),
        _pair([s["output_lateness_ms"]["p99_outside_driver_stalls"] for s in sessions
               if s["output_lateness_ms"].get("p99_outside_driver_stalls") is not None]),
        _pair([got["added_p50"] for _, got in inputs], 0),
        _pair(list(jitter.values()), 0),
        f"{len(over)} of {judged}" if jitter and inputs else "-",
        (f"{len(over_packet)} of {judged} (+{packet_ms:.0f})" if packet_ms > BOUND_MS else "same")
        if jitter and inputs else "-",
        (f"{sum(got['concealed'] for _, got in lost):.0f} / {sum(lost_ms(s) for s, _ in lost):.0f}"
         if lost else "-"),
        str(max(got["underruns"] for _, got in inputs)) if inputs else "-",
        f"{max(got['cut'] for _, got in inputs):.1f} / {sum(got['hard'] for _, got in inputs)}" if inputs else "-",
        f"{np.median([s['first_audio_ms'] for s in sessions if s.get('first_audio_ms') is not None]):.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def stalls_during(run: dict[str, Any], process: dict[str, Any]) -> list[list[Any]]:
    """A process's loop stalls that began during this run, as [seconds from the sessions' origin, place] (the
    server's processes outlive the run; runs before `t0_monotonic` was recorded give none)."""
    t0 = run.get("t0_monotonic")
    if t0 is None:
        return []
    return [[round(at - t0, 2), site] for at, site in process.get("loop_stalls_at", [])
            if 0.0 <= at - t0 <= run["wall_s"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    runs = {path.stem.rsplit("_", 1)[-1]: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in args.files}
    print("| door | link | n | RTF min | missing | lateness p99 | driver's stalls out | added p50 | jitter p95 | over "
          "| over + packet | concealed / lost | underruns | cut / hard | first audio |")
    print("|" + "---|" * 15)
    for door in DOORS:
        for name, lines in runs.items():
            mine = [s for run in lines for s in run["per_session"] if s["door"] == door]
            if name == "far":
                groups = [("clean, beside far", [s for s in mine if s["link"] is None]),
                          ("far", [s for s in mine if s["link"] is not None])]
            elif name == "clean":
                groups = [("all clean", mine)]
            else:
                groups = [(name, [s for s in mine if s["link"] is not None])]
            for label, sessions in groups:
                if sessions:
                    print(row(door, label, sessions))
    for name, run in ((name, run) for name, lines in runs.items() for run in lines):
        server = run["server"]
        print(json.dumps({"run": name, "sessions": len(run["per_session"]), "ticks": server["ticks"],
                          "late_ticks": server["late_ticks"], "tick_p50_ms": server["tick_run_ms"]["p50_ms"],
                          "tick_p99_ms": server["tick_run_ms"]["p99_ms"], "refused": run["summary"]["refused"],
                          "failed": run["summary"]["failed"], "errors": run["summary"]["errors"],
                          "engine_gc": server.get("engine_gc"), "silence_sent": silence_by_door(run["per_session"])}))
        for process in server["processes"]:
            if process["role"] == "worker":
                lag = process.get("loop_lag_ms", {})
                print(json.dumps({"run": name, "worker": process["worker"], "cpu_pct": process.get("cpu_pct"),
                                  "loop_lag_p99_ms": lag.get("p99"), "loop_lag_max_ms": lag.get("max"),
                                  "input_late_frames": process.get("input_late_frames"),
                                  "gc_full_max_ms": process.get("gc", {}).get("full_max_ms"),
                                  "loop_stalls": process.get("loop_stalls"),
                                  "stalls_at_s": stalls_during(run, process)}))
        procs = run.get("driver", {}).get("procs", [])
        if any("loop_lag_ms" in proc for proc in procs):
            print(json.dumps({"run": name, "driver_loop_lag_max_ms": [proc["loop_lag_ms"].get("max") for proc in procs],
                              "driver_loop_stalls": [proc.get("loop_stalls") for proc in procs],
                              "driver_stalls_at_s": [stalls_during(run, proc) for proc in procs],
                              "worst_with_driver_stall": run["summary"].get("worst_with_driver_stall"),
                              "live": run["summary"]["live"]}))


if __name__ == "__main__":
    main()
