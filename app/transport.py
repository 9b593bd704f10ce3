"""The WebSocket plumbing the three dialects share: auth before upgrade, admission, a bounded receive loop, one writer.

`WsSession.handle()` runs a connection: refuse a bad key or Origin with HTTP 401/403 and an address over
`max_connections_per_ip` with HTTP 429 (no slot taken), upgrade,
then read messages with a first-message timeout and a read-idle timeout, a size bound (close 1009), and a token
bucket against floods (`rate_limited`, close 1008 when sustained). JSON text frames are parsed and handed to
`on_event`; a `ProtocolError` raised there becomes one `error` event and the session goes on. Client JSON goes
through `app.wire` (depth and non-finite numbers refused with `invalid_json`), and everything sent is strict JSON.

Output has one bounded path per session: every byte queued for the client (audio, transcript, errors, acks, Twilio
media and marks) waits in one queue drained by one writer task, so events keep their order. When the oldest queued
message has waited `max_output_backlog_s`, or more than `max_output_bytes` are queued, the session ends at once:
the queue is dropped (its memory freed), the slot freed, `error output_backpressure` and close 1008 are tried for a
bounded time and the connection is then dropped. A disconnect closes the conversation (frees the slot) at once.

Close codes: 1000 normal, 1001 server shutdown, 1008 policy (flood, first-message timeout, unread output),
1009 message too big, 1011 engine failure, 1013 no free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from app.auth import refusal, response_subprotocols, too_many_connections
from app.context import CONTEXT, ServerContext
from app.conversation import Conversation, InputPolicy
from app.errors import DRAINING_MESSAGE, ProtocolError, error_event, http_error_body, new_event_id
from app.wire import WireError, dumps, parse_object
from model.engine import EngineError, ResourceExhausted, Slot

logger = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_LATER = 1013
CLOSE_WAIT_S = 5.0  # for the close handshake, after which the connection is dropped
FLUSH_WAIT_S = 2.0  # for the queued output to drain when a session closes
SOCKET_SEND_BUFFER = 64 << 10   # bytes; seconds of audio at any of our formats, far below autotuning's megabytes


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class WsSession:
    """Base of a dialect: subclasses set `route`/`type_key` and implement `on_open`, `on_event`, `on_binary`."""

    route = ""
    type_key = "type"

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.ctx: ServerContext = request.app[CONTEXT]
        self.settings = self.ctx.settings
        self.ws = web.WebSocketResponse(
            # Twice the bound, so a message a little over it can be answered with `event_too_large` before the
            # close; aiohttp itself closes (1009, no event) beyond that.
            max_msg_size=2 * self.settings.max_message_bytes,
            protocols=response_subprotocols(request),
            autoping=True,
            heartbeat=None,
        )
        self.conversation: Conversation | None = None
        self.idle_timeout_s = self.settings.idle_timeout_s
        self._out: deque[tuple[float, str | bytes]] = deque()   # (queued at, message), oldest first
        self._out_bytes = 0
        self._out_ready = asyncio.Event()
        self._out_done = False               # the writer ends once the queue is empty
        self._overflowed = False             # past the output bound: nothing more is queued
        self._writer: asyncio.Task[None] | None = None
        self._close_wait_s = CLOSE_WAIT_S
        self._flush_wait_s = FLUSH_WAIT_S
        self._address: str | None = None     # counted in ctx.addresses while the connection is open
        self._closing: tuple[int, str] | None = None  # (code, reason) once a close has begun
        self._closer: asyncio.Task[None] | None = None  # the flush and handshake of that close
        self._reader: asyncio.Task[None] | None = None  # the read loop
        self._close_caller: asyncio.Task[Any] | None = None  # the task that began the close
        self._bucket = TokenBucket(self.settings.max_events_per_s, 2 * self.settings.max_events_per_s)
        self._dropped = 0
        self._last_flood_error = 0.0

    @property
    def closed(self) -> bool:
        """A close has begun: nothing more is sent or read."""
        return self._closing is not None

    # ---- hooks -----------------------------------------------------------------------------------------------

    async def on_open(self) -> None:
        """After the upgrade (admission, greeting). Call `self.close(...)` to end the connection."""

    async def on_event(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        raise ProtocolError("binary_unsupported", f"{self.route} takes JSON text frames only")

    def closed_event(self, reason: str) -> dict[str, Any] | None:
        """The event sent before the socket closes (`session.closed`), or None."""
        return None

    async def on_disconnect(self) -> None:
        """The socket is gone; free what the dialect holds. The conversation itself is closed by the base."""

    # ---- connection ------------------------------------------------------------------------------------------

    async def handle(self) -> web.StreamResponse:
        refused = refusal(self.request, self.settings.api_keys, self.settings.allowed_origins)
        if refused is not None:
            self.ctx.metrics.rejections[(self.route, "unauthorized" if refused.status == 401 else
                                         "origin_not_allowed")] += 1
            return refused
        limited = self.take_address()
        if limited is not None:
            return limited
        try:
            return await self._serve()
        finally:
            self.release_address()

    def take_address(self) -> web.Response | None:
        """Count this connection against its address; the HTTP 429 when the address is at its limit."""
        limit = self.settings.max_connections_per_ip
        self._address = self.ctx.addresses.take(self.request, limit)
        if self._address is None:
            self.ctx.metrics.rejections[(self.route, "too_many_connections")] += 1
            return too_many_connections(limit)
        return None

    def release_address(self) -> None:
        address, self._address = self._address, None
        if address is not None:
            self.ctx.addresses.release(address)

    async def _serve(self) -> web.StreamResponse:
        if self.ctx.draining:
            self.ctx.metrics.rejections[(self.route, "server_draining")] += 1
            return web.json_response(http_error_body("server_draining", DRAINING_MESSAGE), status=503)
        if not self.ctx.ready:
            return web.json_response({"error": {"type": "server_error", "code": "engine_stopped",
                                                "message": "the server is starting or shutting down"}}, status=503)
        await self.ws.prepare(self.request)
        self._bound_socket_buffer()
        self.ctx.sockets.add(self)
        self.ctx.metrics.connections[self.route] += 1
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        try:
            await self.on_open()
            if not self.closed:
                # Its own task, so that a close from elsewhere can stop it first (_stop_reader).
                self._reader = asyncio.get_running_loop().create_task(self._read_loop())
                try:
                    await self._reader
                except asyncio.CancelledError:
                    if self._closing is None:
                        raise  # the handler itself was cancelled, not the reader by a close
        except Exception as e:
            logger.exception("%s: session failed", self.route)
            if not self.closed:
                await self.send_error(ProtocolError("internal_error", f"{type(e).__name__}: {e}"))
                await self.close(CLOSE_INTERNAL, "internal_error")
        finally:
            self.ctx.sockets.discard(self)
            self.ctx.metrics.connections[self.route] -= 1
            if self.conversation is not None:
                self.conversation.close()
            with contextlib.suppress(Exception):
                await self.on_disconnect()
            if self._closer is not None:
                # A close in progress (waiting for its flush) has chosen the code; the read loop may end first.
                await asyncio.wait([self._closer])
            else:
                await self._stop_writer()
                await self._close_socket(CLOSE_NORMAL, "")
        return self.ws

    def _bound_socket_buffer(self) -> None:
        """Cap the kernel's send buffer for this connection: autotuned it grows to megabytes (minutes of Twilio
        audio) that a client which stops reading would hold unseen by the output bound, which counts only what
        waits here."""
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER)

    async def _read_loop(self) -> None:
        first = True
        while not self.closed:
            timeout = self.settings.first_message_timeout_s if first else self.idle_timeout_s
            try:
                msg = await self.ws.receive(timeout=timeout)
            except asyncio.TimeoutError:
                if first:
                    await self.send_error(ProtocolError(
                        "config_timeout", f"no message within {timeout:g} s of connecting"))
                    await self.close(CLOSE_POLICY, "config_timeout")
                else:
                    await self.close(CLOSE_NORMAL, "idle_timeout")
                return
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return
            if msg.type is WSMsgType.ERROR:
                await self._on_receive_error(msg.data)
                return
            first = False
            if not self._admit_message():
                continue
            if len(msg.data) > self.settings.max_message_bytes:
                await self.send_error(ProtocolError(
                    "event_too_large", f"message of {len(msg.data)} bytes; the bound is "
                    f"{self.settings.max_message_bytes} bytes"))
                await self.close(CLOSE_TOO_BIG, "event_too_large")
                return
            if msg.type is WSMsgType.TEXT:
                await self._dispatch_text(msg.data)
            elif msg.type is WSMsgType.BINARY:
                await self._guard(self.on_binary(msg.data), None)

    async def _on_receive_error(self, exc: object) -> None:
        code = getattr(exc, "code", None)
        if code == WSCloseCode.MESSAGE_TOO_BIG:
            self.ctx.metrics.errors["event_too_large"] += 1
            await self.close(CLOSE_TOO_BIG, "event_too_large")
        else:
            await self.close(CLOSE_POLICY, "protocol_error")

    def _admit_message(self) -> bool:
        if self._bucket.take():
            self._dropped = 0
            return True
        self._dropped += 1
        now = time.monotonic()
        if self._dropped > self._bucket.burst:
            self.spawn(self._flood_close())
        elif now - self._last_flood_error >= 1.0:
            self._last_flood_error = now
            self.send_error_nowait(ProtocolError(
                "rate_limited", f"more than {self.settings.max_events_per_s:g} events per second; events dropped"))
        return False

    async def _flood_close(self) -> None:
        if not self.closed:
            await self.send_error(ProtocolError("rate_limited", "sustained flood of events; closing"))
            await self.close(CLOSE_POLICY, "rate_limited")

    async def _dispatch_text(self, text: str) -> None:
        try:
            event = parse_object(text)
        except WireError as e:
            await self.send_error(ProtocolError("invalid_json", str(e)))
            return
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        if not isinstance(event.get(self.type_key), str):
            await self.send_error(ProtocolError("bad_event", f"an event needs a string `{self.type_key}`",
                                                param=self.type_key), event_id)
            return
        await self._guard(self.on_event(event), event_id)

    async def _guard(self, work: Any, event_id: str | None) -> None:
        try:
            await work
        except ProtocolError as e:
            await self.send_error(e, event_id)

    # ---- admission -------------------------------------------------------------------------------------------

    async def reserve(self) -> Slot | None:
        """A slot, or None after telling the client `resource_exhausted` and closing with 1013."""
        engine = self.ctx.engine
        assert engine is not None
        if self.ctx.draining:
            self.ctx.metrics.rejections[(self.route, "server_draining")] += 1
            await self.send_error(ProtocolError("server_draining", DRAINING_MESSAGE))
            await self.close(CLOSE_TRY_LATER, "server_draining", send_closed=False)
            return None
        try:
            slot = await engine.reserve_wait(self.settings.queue_timeout_s)
        except ResourceExhausted:
            self.ctx.metrics.rejections[(self.route, "resource_exhausted")] += 1
            await self.send_error(ProtocolError(
                "resource_exhausted", f"duplex_session_capacity_exhausted: limit={engine.max_sessions}"))
            await self.close(CLOSE_TRY_LATER, "resource_exhausted", send_closed=False)
            return None
        except EngineError as e:  # the engine process is down or restarting
            self.ctx.metrics.rejections[(self.route, e.code)] += 1
            await self.send_error(ProtocolError(e.code, e.message))
            await self.close(CLOSE_TRY_LATER, e.code, send_closed=False)
            return None
        self.ctx.metrics.admissions[self.route] += 1
        return slot

    def new_conversation(self, slot: Slot) -> Conversation:
        """A conversation on `slot` whose pushes past the backlog bounds are refused (WebSocket audio must lose
        nothing: the client gets `input_backpressure` instead)."""
        policy = InputPolicy(backlog_s=self.settings.max_realtime_backlog_s,
                             input_backlog_s=self.settings.max_input_backlog_s)
        return Conversation(slot, metrics=self.ctx.metrics, input_policy=policy)

    # ---- output ----------------------------------------------------------------------------------------------

    def send_nowait(self, event: dict[str, Any]) -> None:
        """Queue one server event (an `event_id` is added); safe from loop callbacks."""
        if self.closed:
            return
        if "event_id" not in event and self.type_key == "type":
            event = {"type": event["type"], "event_id": new_event_id(), **event}
        self.enqueue(dumps(event))

    def send_audio_nowait(self, payload: dict[str, Any] | bytes) -> None:
        """Queue one frame's audio (a JSON event or a binary frame)."""
        if isinstance(payload, bytes):
            if not self.closed:
                self.enqueue(payload)
        else:
            self.send_nowait(payload)

    def enqueue(self, message: str | bytes) -> None:
        """The one way out: past the session's output bound (time or bytes) the session ends instead."""
        if self._overflowed:
            return
        now = time.monotonic()
        if self._out and (now - self._out[0][0] > self.settings.max_output_backlog_s
                          or self._out_bytes + len(message) > self.settings.max_output_bytes):
            self._output_overflow()
            return
        self._out.append((now, message))
        self._out_bytes += len(message)
        self._out_ready.set()

    def _output_overflow(self) -> None:
        """The client does not read: free the slot and the queue now, then tell it and close (bounded)."""
        self.ctx.metrics.errors["output_backpressure"] += 1
        self._overflowed = True
        if self.conversation is not None:
            self.conversation.close()
        self._out.clear()
        self._out_bytes = 0
        message = (f"output unread for more than {self.settings.max_output_backlog_s:g} s or "
                   f"{self.settings.max_output_bytes} bytes; closing")
        self._out.append((time.monotonic(), dumps(error_event("output_backpressure", message))))
        self._out_ready.set()
        self.spawn(self.close(CLOSE_POLICY, "output_backpressure"))

    async def send(self, event: dict[str, Any]) -> None:
        self.send_nowait(event)

    def send_error_nowait(self, err: ProtocolError, event_id: str | None = None) -> None:
        self.ctx.metrics.errors[err.code] += 1
        self.send_nowait(error_event(err.code, err.message, param=err.param, event_id=event_id))

    async def send_error(self, err: ProtocolError, event_id: str | None = None) -> None:
        self.send_error_nowait(err, event_id)

    async def _next_message(self) -> str | bytes | None:
        """The oldest queued message (left queued, so its age counts until it is sent), or None at the end."""
        while not self._out:
            if self._out_done:
                return None
            self._out_ready.clear()
            await self._out_ready.wait()
        return self._out[0][1]

    def _sent(self, message: str | bytes) -> None:
        """`message` has left: unqueue it (unless an overflow dropped the queue while it was being sent)."""
        if self._out and self._out[0][1] is message:
            self._out_bytes -= len(self._out.popleft()[1])

    async def _write_loop(self) -> None:
        while True:
            data = await self._next_message()
            if data is None:
                return
            try:
                if isinstance(data, bytes):
                    await self.ws.send_bytes(data)
                else:
                    await self.ws.send_str(data)
            except (ConnectionError, RuntimeError):
                return
            self._sent(data)

    async def _stop_writer(self) -> None:
        """Flush what is queued (for a bounded time), then end the writer."""
        writer, self._writer = self._writer, None
        self._out_done = True
        self._out_ready.set()
        if writer is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(writer), timeout=self._flush_wait_s)
        if not writer.done():
            writer.cancel()
        self._out.clear()
        self._out_bytes = 0

    # ---- closing ---------------------------------------------------------------------------------------------

    async def close(self, code: int, reason: str, *, send_closed: bool = True) -> None:
        """Say `session.closed` (if the dialect has one), flush, close the socket; frees the slot first."""
        if self.closed:
            return
        if send_closed:
            closed = self.closed_event(reason)
            if closed is not None:
                self.send_nowait(closed)
        self._closing = (code, reason)
        if self.conversation is not None:
            self.conversation.close()
        # The flush and the handshake run as one task, which the connection's handler waits for too.
        self._close_caller = asyncio.current_task()
        self._closer = asyncio.get_running_loop().create_task(self._finish_close(code, reason))
        await asyncio.shield(self._closer)

    async def _finish_close(self, code: int, reason: str) -> None:
        await self._stop_writer()
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
        if self.ws.closed or not self.ws.prepared:  # a WebRTC call has no socket of its own
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
        closing = asyncio.ensure_future(self.close(CLOSE_GOING_AWAY, "server_shutdown"))
        await asyncio.wait([closing], timeout=budget * 0.8)
        self.abort()   # after a completed handshake nothing is left to drop; else the client waits no longer

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.ctx.tasks.add(task)
        task.add_done_callback(self.ctx.tasks.discard)
