"""Far callers at full load, in one go: start the server (with its SIP door), run `bench.e2e` over every door (Realtime,
WebRTC, Twilio, duplex, SIP) with half of each door's sessions behind the first condition (`far`), then all clean,
then small runs behind stalls and bursty loss; one JSON file per run.

    python3 -m bench.impair_run --out DIR --model random-7b --kv-cache fp8 --max-sessions 145 --workers 8 \\
        --sessions 144 --seconds 25 --procs 6 --budget-s 330          # the H200 run (docs/benchmarks.md)
    python3 -m bench.impair_run --out /tmp/x --model tiny --max-sessions 6 --workers 0 --sessions 4 --seconds 6

A run is skipped when the time left in `--budget-s` (counted from this script's start) is under its estimate, so a
limited lease still brings back the runs that finished. The server's log is kept in DIR/server.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

STARTUP_S = 300.0
ADMIN_KEY = "impair-run-admin"   # the Twilio calls read their own stats from /v1/calls (a local server, loopback)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as res:
                if json.load(res).get("ready"):
                    return time.monotonic() - t0
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="random-7b")
    p.add_argument("--kv-cache", default=None)
    p.add_argument("--max-sessions", type=int, default=145)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--sip-port", type=int, default=5070)
    p.add_argument("--sessions", type=int, default=144)
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--procs", type=int, default=6)
    p.add_argument("--small-sessions", type=int, default=8, help="sessions of the stalls and bursty runs")
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument("--piece-ms", type=float, help="the Realtime and duplex callers' append (bench.e2e --piece-ms)")
    args = p.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "app", "--model", args.model, "--host", "127.0.0.1", "--port", str(args.port),
           "--max-sessions", str(args.max_sessions), "--workers", str(args.workers), "--max-connections-per-ip", "0",
           "--sip-port", str(args.sip_port), "--rtp-ports", "30000-31999", "--admin-key", ADMIN_KEY,
           "--log-level", "WARNING"] + (["--kv-cache", args.kv_cache] if args.kv_cache else [])
    log = (args.out / "server.log").open("wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    mix = "realtime=1,webrtc=1,twilio=1,duplex=1,sip=1"
    runs = [     # the far run first: with little time left, it is the one that answers the load target
        ("far", ["--sessions", str(args.sessions), "--seconds", str(args.seconds), "--impair", "far"],
         args.seconds + 40),
        ("clean", ["--sessions", str(args.sessions), "--seconds", str(args.seconds)], args.seconds + 40),
        ("stalls", ["--sessions", str(args.small_sessions), "--seconds", "36", "--impair", "stalls,stall_first_s=10",
                    "--impaired-share", "1"], 60.0),
        ("bursty", ["--sessions", str(args.small_sessions), "--seconds", "15", "--impair", "bursty",
                    "--impaired-share", "1"], 35.0),
    ]
    done = {}
    try:
        ready_s = wait_ready(url, server, STARTUP_S)
        print(json.dumps({"server_ready_s": round(ready_s, 1)}), flush=True)
        for name, extra, estimate_s in runs:
            left = args.budget_s - (time.monotonic() - start)
            if left < estimate_s:
                print(json.dumps({"skipped": name, "left_s": round(left, 1)}), flush=True)
                continue
            out = args.out / f"{name}.jsonl"
            t0 = time.monotonic()
            res = subprocess.run([sys.executable, "-m", "bench.e2e", "--url", url, "--mix", mix, "--procs",
                                  str(min(args.procs, int(extra[1]))), "--impair-seed", "30", "--out", str(out),
                                  "--sip-port", str(args.sip_port), "--admin-key", ADMIN_KEY,
                                  *(["--piece-ms", str(args.piece_ms)] if args.piece_ms else []), *extra],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            done[name] = round(time.monotonic() - t0, 1)
            if res.returncode:
                print(res.stderr[-2000:], flush=True)
            print(json.dumps({"run": name, "rc": res.returncode, "wall_s": done[name]}), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
