"""Running `python -m app` as a real process for the tests: a free port, the environment, readiness."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


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
