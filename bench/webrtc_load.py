"""WebRTC load: N aiortc client peers speak to a server for S seconds; prints one JSON object.

    python bench/webrtc_load.py --peers 4 --seconds 20                       # spawns a local server (tiny model)
    python bench/webrtc_load.py --url http://127.0.0.1:8000 --peers 4 --seconds 20 [--pid PID] [--baseline-ws]

Per peer, from the call's own counters (`GET` on its Location): server-added latency on the input side (how long
the newest sample of each engine frame had waited in the jitter buffer when the engine read it: the part beyond the
80 ms framing) and on the output side (engine frame written -> its first sample handed to the Opus encoder), input
underruns, playout underruns, concealed audio, late and overrun drops, RTP loss, clock stalls, encoder failures;
from the client: seconds of model audio received and transcript characters.

Server CPU comes from /proc/<pid>/stat, so the server must run on this machine (spawned, or `--pid`): total % of a
core during the run, idle before the peers came, and per peer. The engine's own compute (the tiny model on a CPU)
is in that total; `--baseline-ws` runs the same number of WebSocket Realtime sessions (same engine load, audio as
JSON appends and deltas) afterwards, so the difference per peer is what the WebRTC media path costs beyond a
WebSocket session. The client peers run in this process and share the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):                      # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np

from app.doors.webrtc.client import RealtimeCall
from bench.doors import FRAME, RATE, client_session, peer_report, speech
from bench.server_probe import cpu_seconds


async def cpu_pct(pid: int | None, seconds: float) -> float | None:
    if pid is None:
        await asyncio.sleep(seconds)
        return None
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    c1 = cpu_seconds(pid)
    return None if c0 is None or c1 is None else round(100.0 * (c1 - c0) / (time.monotonic() - t0), 2)


async def health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(url + "/health") as res:
        return await res.json()


def spawn_server(sessions: int, torch_threads: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "app", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-sessions", str(sessions), "--log-level", "WARNING"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch_threads)}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            if (await health(url)).get("ready"):
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} was not ready within {timeout_s:.0f} s")


async def call_report(call: RealtimeCall) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {call.api_key}"} if call.api_key else {}
    async with aiohttp.ClientSession() as http, http.get(call.location, headers=headers) as res:
        st = await res.json()
    return {**peer_report(st), "received_audio_s": round(len(call.recording.audio()) / RATE, 2),
            "transcript_chars": len(call.transcript())}


async def run_webrtc(url: str, audio: np.ndarray, peers: int, seconds: float, warmup_s: float, pid: int | None,
                     api_key: str | None) -> dict[str, Any]:
    calls = [RealtimeCall(url, np.roll(audio, i * RATE // 3), loop_audio=True, api_key=api_key,
                          session={"instructions": "You are a helpful assistant at a restaurant."})
             for i in range(peers)]
    results = await asyncio.gather(*(c.connect() for c in calls), return_exceptions=True)
    live = [c for c, r in zip(calls, results) if r is None]
    refused = [repr(r) for r in results if r is not None]
    try:
        await asyncio.sleep(warmup_s)
        cpu = await cpu_pct(pid, seconds)
        engine = (await health(url)).get("tick", {})
        reports = [await call_report(c) for c in live]
    finally:
        await asyncio.gather(*(c.hang_up() for c in live), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in calls if c not in live), return_exceptions=True)
    return {"connected": len(live), "refused": refused, "server_cpu_pct": cpu, "engine_tick": engine,
            "per_peer": reports}


async def run_ws(url: str, audio: np.ndarray, sessions: int, seconds: float, warmup_s: float,
                 pid: int | None, api_key: str | None) -> dict[str, Any]:
    """The same number of `/v1/realtime` sessions, 80 ms PCM16 appends paced on the clock, output read and dropped."""
    ws_url = url.replace("http", "ws", 1) + "/v1/realtime?duplex=1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
    stop = asyncio.Event()

    async def session(http: aiohttp.ClientSession, offset: int) -> None:
        async with http.ws_connect(ws_url, headers=headers, max_msg_size=0) as ws:
            reader = asyncio.ensure_future(_drain(ws))
            start, i = time.monotonic(), 0
            while not stop.is_set():
                pos = (offset + i * FRAME * 2) % (len(pcm) - FRAME * 2)
                await ws.send_json({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(pcm[pos:pos + FRAME * 2]).decode()})
                i += 1
                await asyncio.sleep(max(0.0, start + i * 0.08 - time.monotonic()))
            await ws.send_json({"type": "session.close"})
            reader.cancel()

    async with client_session() as http:
        tasks = [asyncio.ensure_future(session(http, k * 7680)) for k in range(sessions)]
        await asyncio.sleep(warmup_s)
        cpu = await cpu_pct(pid, seconds)
        engine = (await health(url)).get("tick", {})
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"sessions": sessions, "server_cpu_pct": cpu, "engine_tick": engine}


async def _drain(ws: aiohttp.ClientWebSocketResponse) -> None:
    async for _ in ws:
        pass


def mean_of(reports: list[dict[str, Any]], key: str, stat: str) -> float | None:
    values = [r[key][stat] for r in reports if r[key][stat] is not None]
    return round(float(np.mean(values)), 2) if values else None


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="server base URL (default: spawn a local server on the tiny model)")
    p.add_argument("--pid", type=int, help="the server's process id, for CPU (a spawned server is known)")
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=4.0, help="seconds after connecting before measuring")
    p.add_argument("--wav", help="speech to send (default: espeak-ng, else synthetic)")
    p.add_argument("--api-key")
    p.add_argument("--baseline-ws", action="store_true", help="also measure N WebSocket sessions for the CPU delta")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of a spawned server: on a small machine the CPU engine otherwise takes every "
                        "core in each tick, and the event loop and the client peers queue behind it")
    args = p.parse_args()

    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = spawn_server(args.peers, args.torch_threads)
        pid = proc.pid
    try:
        await wait_ready(url.rstrip("/"))
        url = url.rstrip("/")
        audio = speech(args.wav)
        idle = await cpu_pct(pid, 3.0)
        webrtc = await run_webrtc(url, audio, args.peers, args.seconds, args.warmup, pid, args.api_key)
        result: dict[str, Any] = {"bench": "webrtc_load", "url": url, "peers": args.peers, "seconds": args.seconds,
                                  "server_cpu_idle_pct": idle, **webrtc}
        n = max(1, webrtc["connected"])
        if webrtc["server_cpu_pct"] is not None and idle is not None:
            result["server_cpu_pct_per_peer"] = round((webrtc["server_cpu_pct"] - idle) / n, 2)
        reports = webrtc["per_peer"]
        result["added_latency_ms"] = {
            "input_p50_mean": mean_of(reports, "input_added_ms", "p50"),
            "output_p50_mean": mean_of(reports, "output_added_ms", "p50"),
            "input_p95_mean": mean_of(reports, "input_added_ms", "p95"),
            "output_p95_mean": mean_of(reports, "output_added_ms", "p95"),
        }
        result["underruns"] = {"input": sum(r["input_underruns"] or 0 for r in reports),
                               "output": sum(r["output_underruns"] or 0 for r in reports)}
        result["concealed_ms"] = round(sum(r["concealed_ms"] for r in reports), 1)
        if args.baseline_ws:
            await asyncio.sleep(2.0)
            ws = await run_ws(url, audio, webrtc["connected"], args.seconds, args.warmup, pid, args.api_key)
            result["baseline_ws"] = ws
            if ws["server_cpu_pct"] is not None and webrtc["server_cpu_pct"] is not None:
                result["webrtc_media_cpu_pct_per_peer"] = round(
                    (webrtc["server_cpu_pct"] - ws["server_cpu_pct"]) / n, 2)
        print(json.dumps(result))
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


if __name__ == "__main__":
    asyncio.run(main())
