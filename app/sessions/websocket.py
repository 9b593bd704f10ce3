"""The WebSocket transport: one aiohttp WebSocket carrying one session (`app.sessions.session.Session`) of any dialect.

`serve(request, session)` runs a connection: refuse a bad key or Origin with HTTP 401/403 and an address over
`max_connections_per_ip` with HTTP 429 (no slot taken), a draining or stopped server with HTTP 503
(`app.sessions.admission`), upgrade, then read messages with a first-message timeout and a read-idle timeout (the
session's, which its dialect may change), a size bound (close 1009), and the session's flood guard (`rate_limited`,
close 1008 when sustained). Text frames go to the dialect's parser, binary frames to `on_binary`.

The session's outbox is drained here into the socket, whose kernel send buffer is capped so that unread output
stays where the outbox bound sees it. A close flushes the outbox for a bounded time, then runs the close handshake
for a bounded time, after which the connection is dropped. A disconnect closes the conversation (frees the slot)
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from app.sessions.admission import gate
from app.sessions.errors import ProtocolError, http_error_body
from app.sessions.outbox import Message, held_by
from app.sessions.session import Session
from app.sessions.transport import CLOSE_GOING_AWAY, CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG
from app.shell.auth import refusal, response_subprotocols, too_many_connections
from app.shell.context import CONTEXT

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 5.0  # for the close handshake, after which the connection is dropped
FLUSH_WAIT_S = 2.0  # for the queued output to drain when a session closes
SOCKET_SEND_BUFFER = 64 << 10   # bytes; seconds of audio at any of our formats, far below autotuning's megabytes


class WsTransport:
    carries_events = True
    carries_audio = True

    def __init__(self, request: web.Request, session: Session) -> None:
        self.request = request
        self.session = session
        self.ctx = request.app[CONTEXT]
        self.settings = self.ctx.settings
        self.ws = web.WebSocketResponse(
            # Twice the bound, so a message a little over it can be answered with `event_too_large` before the
            # close; aiohttp itself closes (1009, no event) beyond that.
            max_msg_size=2 * self.settings.max_message_bytes,
            protocols=response_subprotocols(request),
            autoping=True,
            heartbeat=None,
        )
        self._close_wait_s = CLOSE_WAIT_S
        self._flush_wait_s = FLUSH_WAIT_S
        self._address: str | None = None     # counted in ctx.addresses while the connection is open
        self._closer: asyncio.Task[None] | None = None  # the flush and handshake of a close
        self._reader: asyncio.Task[None] | None = None  # the read loop
        self._close_caller: asyncio.Task[Any] | None = None  # the task that began the close
        session.attach(self)

    @property
    def route(self) -> str:
        return self.session.route

    async def serve(self) -> web.StreamResponse:
        refused = refusal(self.request, self.settings.api_keys, self.settings.allowed_origins)
        if refused is not None:
            self.ctx.metrics.rejections[(self.route, "unauthorized" if refused.status == 401 else
                                         "origin_not_allowed")] += 1
            return refused
        limit = self.settings.max_connections_per_ip
        self._address = self.ctx.addresses.take(self.request, limit)
        if self._address is None:
            self.ctx.metrics.rejections[(self.route, "too_many_connections")] += 1
            return too_many_connections(limit)
        try:
            closed = gate(self.ctx, self.route)
            if closed is not None:
                return web.json_response(http_error_body(closed.code, closed.message), status=closed.status)
            return await self._serve()
        finally:
            self.ctx.addresses.release(self._address)

    async def _serve(self) -> web.StreamResponse:
        session = self.session
        await self.ws.prepare(self.request)
        self._bound_socket_buffer()
        self.ctx.sockets.add(self)
        self.ctx.metrics.connections[self.route] += 1
        session.outbox.start(self._send, lambda: held_by(self.request.transport))
        try:
            await session.on_open()
            if not session.closed:
                # Its own task, so that a close from elsewhere can stop it first (_stop_reader).
                self._reader = asyncio.get_running_loop().create_task(self._read_loop())
                try:
                    await self._reader
                except asyncio.CancelledError:
                    if not session.closed:
                        raise  # the handler itself was cancelled, not the reader by a close
        except Exception as e:
            logger.exception("%s: session failed", self.route)
            if not session.closed:
                await session.send_error(ProtocolError("internal_error", f"{type(e).__name__}: {e}"))
                await session.close(CLOSE_INTERNAL, "internal_error")
        finally:
            self.ctx.sockets.discard(self)
            self.ctx.metrics.connections[self.route] -= 1
            if session.conversation is not None:
                session.conversation.close()
            with contextlib.suppress(Exception):
                await session.on_disconnect()
            if self._closer is not None:
                # A close in progress (waiting for its flush) has chosen the code; the read loop may end first.
                await asyncio.wait([self._closer])
            else:
                await session.outbox.stop(self._flush_wait_s)
                await self._close_socket(CLOSE_NORMAL, "")
        return self.ws

    def _bound_socket_buffer(self) -> None:
        """Cap the kernel's send buffer for this connection: autotuned it grows to megabytes (minutes of Twilio
        audio) that a client which stops reading would hold unseen by the output bound, which counts only what
        waits in the outbox."""
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)

    async def _send(self, message: Message) -> bool:
        try:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_str(message)
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def _read_loop(self) -> None:
        session = self.session
        first = True
        while not session.closed:
            timeout = self.settings.first_message_timeout_s if first else session.idle_timeout_s
            try:
                msg = await self.ws.receive(timeout=timeout)
            except asyncio.TimeoutError:
                if first:
                    await session.send_error(ProtocolError(
                        "config_timeout", f"no message within {timeout:g} s of connecting"))
                    await session.close(CLOSE_POLICY, "config_timeout")
                else:
                    await session.close(CLOSE_NORMAL, "idle_timeout")
                return
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return
            if msg.type is WSMsgType.ERROR:
                await self._on_receive_error(msg.data)
                return
            first = False
            if not session.flood.admit():
                continue
            if len(msg.data) > self.settings.max_message_bytes:
                await session.send_error(ProtocolError(
                    "event_too_large", f"message of {len(msg.data)} bytes; the bound is "
                    f"{self.settings.max_message_bytes} bytes"))
                await session.close(CLOSE_TOO_BIG, "event_too_large")
                return
            if msg.type is WSMsgType.TEXT:
                await session.dispatch_text(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await session.dispatch_binary(msg.data)

    async def _on_receive_error(self, exc: object) -> None:
        code = getattr(exc, "code", None)
        if code == WSCloseCode.MESSAGE_TOO_BIG:
            self.ctx.metrics.errors["event_too_large"] += 1
            await self.session.close(CLOSE_TOO_BIG, "event_too_large")
        else:
            await self.session.close(CLOSE_POLICY, "protocol_error")

    # ---- closing ---------------------------------------------------------------------------------------------

    async def close(self, code: int, reason: str) -> None:
        # The flush and the handshake run as one task, which the connection's handler waits for too.
        self._close_caller = asyncio.current_task()
        self._closer = asyncio.get_running_loop().create_task(self._finish_close(code, reason))
        await asyncio.shield(self._closer)

    async def _finish_close(self, code: int, reason: str) -> None:
        await self.session.outbox.stop(self._flush_wait_s)
        await self._close_socket(code, reason)

    async def _stop_reader(self) -> None:
        """End the read loop unless it is the caller. aiohttp's close() beside a pending receive() skips the
        client's half of the handshake and drops the connection at once; with the client's last messages unread
        that is a reset, which can take the close frame with it (the client then sees 1006)."""
        reader = self._reader
        # Not when the read loop is the one closing: it waits for this close, not in a receive.
        if reader is None or reader.done() or reader in (asyncio.current_task(), self._close_caller):
            return
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader

    async def _close_socket(self, code: int, reason: str) -> None:
        """Send the close frame and wait for the client's, within bounds: a client that never reads would hold
        the handler forever, so past the bound the connection is dropped."""
        if self.ws.closed or not self.ws.prepared:
            return
        await self._stop_reader()
        try:
            await asyncio.wait_for(self.ws.close(code=code, message=reason.encode()[:120]), self._close_wait_s)
        except asyncio.TimeoutError:
            self.abort()
        except Exception:  # the connection broke: nothing left to close
            logger.debug("%s: close on a broken connection", self.route, exc_info=True)

    def abort(self) -> None:
        """Drop the connection without a handshake (a client that does not read cannot take one)."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    async def shutdown(self) -> None:
        """`session.closed` and close 1001, within the server's shutdown timeout: the flush and the handshake share
        it (a stuck client holds neither past it), and a connection still open at the end is dropped."""
        budget = self.settings.shutdown_timeout_s
        self._flush_wait_s = min(FLUSH_WAIT_S, budget / 3)
        self._close_wait_s = min(CLOSE_WAIT_S, budget / 3)
        closing = asyncio.ensure_future(self.session.close(CLOSE_GOING_AWAY, "server_shutdown"))
        await asyncio.wait([closing], timeout=budget * 0.8)
        self.abort()   # after a completed handshake nothing is left to drop; else the client waits no longer


async def serve(request: web.Request, session: Session) -> web.StreamResponse:
    """Run `session` over the WebSocket that `request` opens."""
    return await WsTransport(request, session).serve()
