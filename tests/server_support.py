"""Client-side helpers for the server tests: read events until one arrives, encode audio, check envelopes."""

from __future__ import annotations

import asyncio
import base64
import errno
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np

from media.codecs import AudioFormat


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def encode(samples: np.ndarray, encoding: str, rate: int) -> bytes:
    return AudioFormat(encoding, rate).encode(np.clip(samples, -1.0, 1.0))


async def next_event(ws: aiohttp.ClientWebSocketResponse, timeout: float = 10.0) -> dict[str, Any]:
    msg = await ws.receive(timeout=timeout)
    if msg.type is not aiohttp.WSMsgType.TEXT:
        raise AssertionError(f"expected a text event, got {msg.type} {msg.data!r} {msg.extra!r}")
    return json.loads(msg.data)


async def until(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 10.0,
                seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Read events until one of type `kind` (kept in `seen` if given); binary frames are skipped."""
    deadline = time.monotonic() + timeout
    error: dict[str, Any] | None = None  # the server's last error event, which says why a close came
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} within {timeout} s; saw {[e.get('type') for e in seen or []][-20:]}")
        msg = await ws.receive(timeout=left)
        if msg.type is aiohttp.WSMsgType.BINARY:
            continue
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"socket ended ({msg.type} {msg.data!r} {msg.extra!r}) while waiting for {kind}"
                                 + (f"; the last error: {error}" if error else ""))
        event = json.loads(msg.data)
        if event.get("type", event.get("event")) == "error":
            error = event
        if seen is not None:
            seen.append(event)
        if event.get("type", event.get("event")) == kind:
            return event


async def expect_error(ws: aiohttp.ClientWebSocketResponse, code: str, timeout: float = 5.0) -> dict[str, Any]:
    """The next `error` event must carry `code`; returns its `error` object (envelope checked)."""
    seen: list[dict[str, Any]] = []
    event = await until(ws, "error", timeout, seen)
    err = event["error"]
    assert err["code"] == code, err
    assert err["type"] in ("invalid_request_error", "rate_limit_error", "server_error"), err
    assert isinstance(err["message"], str) and err["message"], err
    assert event["event_id"].startswith("event_")
    return err


async def closed_with(ws: aiohttp.ClientWebSocketResponse, timeout: float = 5.0) -> tuple[int | None, list[dict]]:
    """Read until the socket closes; returns the close code and the events seen on the way."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"socket still open after {timeout} s; saw {[e.get('type') for e in seen][-10:]}")
        try:
            msg = await ws.receive(timeout=left)
        except asyncio.TimeoutError:
            continue
        if msg.type is aiohttp.WSMsgType.TEXT:
            seen.append(json.loads(msg.data))
        elif msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                          aiohttp.WSMsgType.ERROR):
            return ws.close_code, seen


async def sessions_in_use(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/health") as r:
        return (await r.json())["sessions"]["in_use"]


async def wait_in_use(http: aiohttp.ClientSession, url: str, n: int, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while await sessions_in_use(http, url) != n:
        if time.monotonic() > deadline:
            raise AssertionError(f"sessions in use stayed {await sessions_in_use(http, url)}, expected {n}")
        await asyncio.sleep(0.02)


async def eventually(check: Callable[[], Any | Awaitable[Any]], timeout_s: float, what: str,
                     every_s: float = 0.02) -> Any:
    """Poll `check` (a function or coroutine function) until it returns a truthy value, which is returned; an
    AssertionError naming `what` and the last value after `timeout_s`: a wait for an event, not a timed claim."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last: {str(value)[:2000]})")
        await asyncio.sleep(every_s)


async def start_on_free_ports(start_server: Callable[..., Awaitable[Any]], choose: Callable[[], dict[str, Any]],
                              **overrides: Any) -> Any:
    """`start_server(**choose(), **overrides)`, `choose` finding free ports for it: a port found free may be taken
    before the server binds it (a neighbour test's socket, on a busy machine), and then they are chosen again."""
    for attempt in range(1, 6):
        try:
            return await start_server(**choose(), **overrides)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 5:
                raise
