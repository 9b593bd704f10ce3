"""The load drivers against the tiny in-process server: past aiohttp's default 100-connection cap, and `bench/e2e.py`
end to end over every door. These runs check what the drivers report, not how fast the server is."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def run_driver(*args: str, timeout_s: float = 240.0) -> dict:
    """Run `python -m <args>` beside the in-process server; its last JSON line (a hang fails, it is not waited out)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.communicate()
        raise AssertionError(f"{args[0]} did not finish within {timeout_s:.0f} s") from None
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    assert lines, err.decode()[-3000:]
    return json.loads(lines[-1])


async def test_realtime_check_opens_more_than_100_sessions(start_server):
    """110 sessions through one driver process: every one is admitted and hears the model (the default aiohttp
    connector stopped the 101st `ws_connect` for ever)."""
    server = await start_server(max_sessions=110, first_message_timeout_s=60.0)
    report = await run_driver("bench.realtime_check", "--url", server.ws(""), "--sessions", "110",
                              "--seconds", "0.8", "--drain-s", "6")
    assert report["sessions_admitted"] == 110 and report["refused"] == [], report.get("refused")
    sessions = report["per_session"]
    assert len({s["session_id"] for s in sessions}) == 110
    bad = [s for s in sessions if not (s["errors"] == 0 and s["frames_in"] == 10 and s["frames_out"] > 0)]
    assert not bad, (len(bad), json.dumps(bad[:2]))
