"""Running `python -m app` as a real process for the tests: a free port, the environment, readiness."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from multidict import CIMultiDictProxy
from server_support import until

ROOT = Path(__file__).resolve().parents[1]
TICK_S = 0.08  # the engine's frame


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "PERSONAPLEX_MODEL")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def tiny_cache(tiny_checkpoint: Path, folder: Path) -> Path:
    """A cache folder whose built-in tiny checkpoint is the tests' (so the server need not write one)."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "tiny-checkpoint"
    if not link.exists():
        link.symlink_to(tiny_checkpoint, target_is_directory=True)
    return folder


async def start_cli(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", "app", *args, cwd=ROOT, env=cli_env(),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def start_tiny(tiny_checkpoint: Path, tmp_path: Path, *flags: str,
                     port: int | None = None) -> tuple[asyncio.subprocess.Process, str]:
    """`python -m app` on the tiny model and `port` (default: a free one); the process and its URL."""
    port = port or free_port()
    cache = tiny_cache(tiny_checkpoint, tmp_path / "cache")
    proc = await start_cli("--model", "tiny", "--port", str(port), "--cache-dir", str(cache), *flags)
    return proc, f"http://127.0.0.1:{port}"


async def stop(proc: asyncio.subprocess.Process, drain_s: float = 30.0) -> str:
    """SIGTERM (unless it has exited) and its whole output. A server still draining live sessions after `drain_s`
    (a test that failed with its callers open) gets the second SIGTERM, which closes them at once, then SIGKILL: the
    test's own failure is what is reported, with the output, not a timeout of its clean-up."""
    output = asyncio.ensure_future(proc.stdout.read())
    for sig, wait_s in ((signal.SIGTERM, drain_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        if proc.returncode is None:
            proc.send_signal(sig)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), wait_s)
            break
    out = await asyncio.wait_for(output, 15.0)
    return out.decode(errors="replace")


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    """/health on a fresh connection (so that each call may land on another worker), or None if refused."""
    try:
        async with http.get(url + "/health", headers={"Connection": "close"}) as r:
            return await r.json()
    except (aiohttp.ClientError, OSError):
        return None


async def wait_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 90.0,
                     workers: int = 0) -> dict[str, Any]:
    """/health once it says ready (and, with `workers`, that many worker processes are connected)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await health(http, url)
        if last is not None and last.get("ready") and workers <= sum(
                p["role"] == "worker" for p in last.get("processes", [])):
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"the server was not ready within {timeout_s} s: {last}")


FRAME = 1920


async def engine_ticks(server_url: str) -> int:
    async with aiohttp.ClientSession() as http:
        report = await health(http, server_url)
    assert report is not None, f"{server_url}/health did not answer"
    return report["tick"]["ticks"]


@dataclass
class EngineClock:
    """How far the server's engine falls behind real time after `start`: the wall time less its ticks' frames (from
    /health). A tick that overruns its 80 ms is never made up (model/engine/scheduler.py), so on a machine too busy
    for the tiny engine (two test processes, browsers, clients and the server's processes on two cores) a call gets
    fewer frames, each way, than its length, and a WebSocket client's input waits in its backlog."""

    url: str
    started: float
    ticks: int

    @classmethod
    async def start(cls, server_url: str) -> EngineClock:
        return cls(server_url, time.monotonic(), await engine_ticks(server_url))

    async def behind_s(self) -> float:
        return max(0.0, time.monotonic() - self.started - (await engine_ticks(self.url) - self.ticks) * TICK_S)


@dataclass
class DuplexCaller:
    """A realtime `/v1/duplex` session streaming a tone at the real-time pace, noting each output frame's index."""

    url: str
    frames: list[int] = field(default_factory=list)
    error: dict | None = None
    closed_event: dict | None = None
    ended: bool = False
    close_code: int | None = None
    sent: int = 0

    async def open(self) -> None:
        # One connection each (new source port): the kernel may put it on either worker.
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        self.ws = await self.http.ws_connect(self.url.replace("http", "ws") + "/v1/duplex")
        await self.ws.send_json({"type": "session.create", "session": {
            "pacing": "realtime", "input": {"format": "pcm16", "rate": 24000},
            "output": {"format": "pcm16", "rate": 24000}, "output_transport": "json"}})
        await until(self.ws, "session.created", timeout=30)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                self.ended, self.close_code = True, self.ws.close_code
                return
            event = msg.json()
            if event["type"] == "response.output_audio.delta":
                self.frames.append(event["frame"])
            elif event["type"] == "error" and self.error is None:
                self.error = event["error"]
            elif event["type"] == "session.closed":
                self.closed_event = event

    async def stream(self, seconds: float) -> None:
        tone = (0.2 * np.sin(2 * np.pi * 220 * np.arange(FRAME) / 24000) * 32767).astype("<i2").tobytes()
        start = time.monotonic()
        while time.monotonic() - start < seconds and not self.ended:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_bytes(tone)
            self.sent += 1
            await asyncio.sleep(max(0.0, start + self.sent * 0.08 - time.monotonic()))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.ws.close()
        self.reader.cancel()
        await self.http.close()

    def gaps(self) -> list[int]:
        """Frame indices missing between the first and the last received."""
        got = set(self.frames)
        return [i for i in range(min(got), max(got) + 1) if i not in got] if got else []


async def open_call(http: aiohttp.ClientSession, base: str, pc: Any) -> CIMultiDictProxy[str]:
    """Offer a call from aiortc peer `pc` as a browser does (audio sendrecv and the `oai-events` data channel) to
    `POST /v1/realtime/calls`; the 201's headers."""
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    async with http.post(base + "/v1/realtime/calls", data=pc.localDescription.sdp,
                         headers={"Content-Type": "application/sdp"}) as r:
        assert r.status == 201, await r.text()
        return r.headers
