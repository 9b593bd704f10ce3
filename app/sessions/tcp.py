"""The TCP transport: one raw TCP connection carrying one session whose messages are type-length-value frames.

Framing is Asterisk AudioSocket's (`kind: u8 | length: u16 big-endian | payload`), the one framed-TCP protocol
served; each whole frame (header included) goes to the dialect's `on_binary`. The transport owns the timeouts (a
first frame within `first_message_timeout_s`, then read-idle `idle_timeout_s`: past either the session closes),
the session's flood guard, the per-address connection limit, and the output: the session's outbox drained into the
socket, whose kernel send buffer is capped like a WebSocket's. A close flushes the outbox for a bounded time, ends
our side of the stream, drops what the peer still sends until it ends its side (bounded), then closes the socket;
an end of stream closes the conversation (frees the slot) at once. There are no server events
on this transport (`carries_events` is False): the dialect speaks only in frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from app.sessions.outbox import Message, held_by
from app.sessions.session import Session
from app.sessions.transport import CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_POLICY
from app.sessions.websocket import FLUSH_WAIT_S, SOCKET_SEND_BUFFER
from app.shell.context import ServerContext

logger = logging.getLogger(__name__)

HEADER_BYTES = 3


class TcpTransport:
    carries_events = False
    carries_audio = True

    def __init__(self, ctx: ServerContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 session: Session) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.reader = reader
        self.writer = writer
        self.session = session
        self._flush_wait_s = FLUSH_WAIT_S
        self._reading: asyncio.Task[None] | None = None   # the task running the read loop
        self._read_ended = asyncio.Event()
        session.attach(self)

    async def serve(self) -> None:
        session, route = self.session, self.session.route
        peer = self.writer.get_extra_info("peername")
        address = self.ctx.addresses.take_address(peer[0] if peer else "", self.settings.max_connections_per_ip)
        if address is None:
            self.ctx.metrics.rejections[(route, "too_many_connections")] += 1
            self.writer.close()
            return
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ctx.sockets.add(self)
        self.ctx.metrics.connections[route] += 1
        session.outbox.start(self._send, lambda: held_by(self.writer.transport))
        try:
            await session.on_open()
            if not session.closed:
                self._reading = asyncio.current_task()
                await self._read_loop()
        except asyncio.CancelledError:
            if not session.closed:
                raise
        except Exception:
            logger.exception("%s: session failed", route)
        finally:
            self.ctx.sockets.discard(self)
            self.ctx.metrics.connections[route] -= 1
            self.ctx.addresses.release(address)
            if session.conversation is not None:
                session.conversation.close()
            with contextlib.suppress(Exception):
                await session.on_disconnect()
            if not session.closed:
                await session.close(CLOSE_NORMAL, "hang_up")

    async def _read_loop(self) -> None:
        session = self.session
        timeout = self.settings.first_message_timeout_s
        try:
            while True:
                try:
                    header = await asyncio.wait_for(self.reader.readexactly(HEADER_BYTES), timeout)
                    payload = await asyncio.wait_for(self.reader.readexactly(int.from_bytes(header[1:], "big")),
                                                     self.settings.idle_timeout_s)
                except asyncio.TimeoutError:
                    if not session.closed:
                        await session.close(CLOSE_POLICY, "idle_timeout")
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return   # the peer hung up (Asterisk closes the socket without a hangup frame)
                if session.closed:
                    continue   # read and dropped until our close: unread input would turn that close into a reset
                timeout = session.idle_timeout_s
                if session.flood.admit():
                    await session.dispatch_binary(header + payload)
        finally:
            self._read_ended.set()

    async def _send(self, message: Message) -> bool:
        assert isinstance(message, bytes)   # no events here (`carries_events`): only the dialect's frames
        try:
            self.writer.write(message)
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def close(self, code: int, reason: str) -> None:
        await self.session.outbox.stop(self._flush_wait_s)
        # Our end of the stream follows the flushed frames (the hang-up among them); the read loop drops what the
        # peer still sends until it ends its side too (bounded), so that our close is not a reset that would
        # overtake what the peer was sent.
        with contextlib.suppress(Exception):
            self.writer.write_eof()
        if self._reading is not None and self._reading is not asyncio.current_task():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._read_ended.wait(), self._flush_wait_s)
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), self._flush_wait_s)

    async def shutdown(self) -> None:
        budget = self.settings.shutdown_timeout_s
        self._flush_wait_s = min(FLUSH_WAIT_S, budget / 3)
        closing = asyncio.ensure_future(self.session.close(CLOSE_GOING_AWAY, "server_shutdown"))
        await asyncio.wait([closing], timeout=budget * 0.8)
        self.writer.transport.abort()
