"""A recording WebSocket relay for the framework tests: it listens on loopback, takes a client's WebSocket (a
voice-agent framework pointed at the tap's base URL), opens the same path on the server under test with the same
credentials (`Authorization`, `OpenAI-Beta`, the offered subprotocols), forwards every frame both ways, and records
every text frame with the time it passed. So the tests see each server event exactly as the framework received it,
whatever the framework does with it.

    tap = WsTap("http://127.0.0.1:8000")
    base = await tap.start()              # http://127.0.0.1:<port>: give the framework this base URL
    ...
    tap.connections[0].server_events()    # every JSON event the server sent on the first connection
    await tap.stop()

A maintained proxy would hide the frames; this one is a few lines of aiohttp and keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

FORWARDED_HEADERS = ("Authorization", "OpenAI-Beta", "Origin")


def json_event(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@dataclass
class Frame:
    at: float                 # time.monotonic() when it passed the tap
    from_server: bool
    text: str

    def event(self) -> dict[str, Any] | None:
        return json_event(self.text)


@dataclass
class Connection:
    """One relayed WebSocket: what each side sent, and how it ended."""

    path: str
    beta: bool
    opened_at: float
    frames: list[Frame] = field(default_factory=list)
    refused_status: int | None = None          # the server refused the upgrade with this HTTP status
    close_code: int | None = None              # the server's close code, once it closed
    closed_by: str | None = None               # "server" or "client"

    def server_events(self) -> list[dict[str, Any]]:
        return [e for f in self.frames if f.from_server and (e := f.event()) is not None]

    def client_events(self) -> list[dict[str, Any]]:
        return [e for f in self.frames if not f.from_server and (e := f.event()) is not None]

    def timeline(self, since: float) -> list[tuple[float, bool, dict[str, Any]]]:
        """(seconds since the monotonic time `since`, sent by the server, event) for every JSON event both ways."""
        return [(f.at - since, f.from_server, e) for f in self.frames if (e := f.event()) is not None]


class WsTap:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/").replace("http", "ws", 1)
        self.connections: list[Connection] = []
        self.base = ""                             # the tap's own base URL, once started
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._http = aiohttp.ClientSession()
        self.base = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.base

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._http is not None
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        beta = "realtime=v1" in request.headers.get("OpenAI-Beta", "").replace(" ", "").lower() or any(
            p.lower() == "openai-beta.realtime-v1" for p in offered)
        conn = Connection(path=request.path_qs, beta=beta, opened_at=time.monotonic())
        self.connections.append(conn)
        try:
            upstream = await self._http.ws_connect(self.upstream + request.path_qs, headers=headers,
                                                   protocols=offered, max_msg_size=0, autoping=True)
        except aiohttp.WSServerHandshakeError as e:
            conn.refused_status = e.status
            return web.Response(status=e.status, text=e.message)
        ws = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (), max_msg_size=0)
        await ws.prepare(request)
        to_client = asyncio.ensure_future(self._pump(upstream, ws, conn, from_server=True))
        to_server = asyncio.ensure_future(self._pump(ws, upstream, conn, from_server=False))
        await asyncio.wait([to_client, to_server], return_when=asyncio.FIRST_COMPLETED)
        if to_client.done() and conn.closed_by is None:
            conn.closed_by = "server"
        elif conn.closed_by is None:
            conn.closed_by = "client"
        conn.close_code = upstream.close_code
        await ws.close(code=upstream.close_code or aiohttp.WSCloseCode.OK)
        await upstream.close()
        for task in (to_client, to_server):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return ws

    @staticmethod
    async def _pump(src: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
                    dst: aiohttp.ClientWebSocketResponse | web.WebSocketResponse,
                    conn: Connection, from_server: bool) -> None:
        async for msg in src:
            if msg.type is aiohttp.WSMsgType.TEXT:
                conn.frames.append(Frame(time.monotonic(), from_server, msg.data))
                await dst.send_str(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                return
