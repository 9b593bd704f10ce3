"""What a balancer asks: readiness (can this instance take a call now?) and HAProxy's agent-check answer.

`/health/ready`'s body is `readiness(...)`; the agent-check port answers `agent_answer(body)` on each connection,
one line as HAProxy's `agent-check` reads it: `ready up 37%` (the share of free slots, so that `balance leastconn`
weighs instances by real capacity; `0%` while full), `drain` while the server drains for a restart (live sessions
go on, HAProxy sends no new ones), `down#<why>` while no engine is up. In one process the server answers from its
own state (`serve_agent`); in the multi-process server the supervisor alone listens on the port and answers from
a worker's `/health/ready` (app/shell/processes.py), so there is one listener whatever the worker count.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import Any

READY, FULL, DRAINING = "ready", "full", "draining"


def readiness(status: str, in_use: int = 0, max_sessions: int = 0) -> dict[str, Any]:
    """The `/health/ready` body; `status` is "ready", "full", "draining", "shutting_down", "engine_down" or
    "starting" ("ready" becomes "full" when no slot is free)."""
    if status == READY and in_use >= max_sessions:
        status = FULL
    return {"ready": status == READY, "status": status,
            "sessions": {"in_use": in_use, "free": max(0, max_sessions - in_use), "max": max_sessions}}


def agent_answer(body: dict[str, Any] | None) -> str:
    """One agent-check line for a `/health/ready` body (None: no answer from the server)."""
    if body is None:
        return "down#no_answer\n"
    status = body.get("status")
    if status == DRAINING:
        return "drain\n"
    if status not in (READY, FULL):
        return f"down#{status}\n"
    sessions = body["sessions"]
    percent = 0 if status == FULL else max(1, math.floor(100 * sessions["free"] / max(1, sessions["max"])))
    return f"ready up {percent}%\n"


async def serve_agent(host: str, port: int,
                      report: Callable[[], Awaitable[dict[str, Any] | None]]) -> asyncio.AbstractServer:
    """The agent-check listener of a one-process server: each connection gets one line, then is closed."""

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(agent_answer(await report()).encode())
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host, port, reuse_address=True)
