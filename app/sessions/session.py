"""The dialect half of a session: client messages in, server messages out, the protocol state; no I/O of its own.

A dialect (`app.doors.realtime.dialect`, `app.doors.duplex`, `app.doors.phone.twilio`, the bridges) subclasses
`Session`, sets `route`/`type_key` and implements the hooks: `on_open` (after the connection is up: admission,
greeting), `on_event` (one parsed JSON message), `on_binary` (one binary message), `closed_event` (its last word),
`on_disconnect` (free what it holds). A `ProtocolError` raised in a hook becomes one `error` event and the session goes
on.

What the dialect sends goes into the session's one `Outbox` (bounded; past its bound the session ends with
`output_backpressure` and close 1008), which its transport drains; it ends the session with `close()`, which frees
the slot at once and asks the transport to flush and close. It takes a slot through `reserve()`, the one admission
path (`app.sessions.admission`). The session owns its `Conversation`; `close()` and a disconnect close it. Its
conversation is in the live-call list (`app.calls.live`: `call_opening`, `call_details`, `hang_up`, `cut_output`)
until then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from app.sessions.admission import Refused, admit
from app.sessions.conversation import Conversation, InputPolicy, State
from app.sessions.errors import ProtocolError, error_event, new_event_id
from app.sessions.flood import FloodGuard
from app.sessions.outbox import Outbox
from app.sessions.transport import CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_LATER, Transport
from app.sessions.wire import WireError, dumps, parse_object
from app.shell.context import ServerContext
from model.engine import Slot

if TYPE_CHECKING:
    from app.calls.live import LiveCall

logger = logging.getLogger(__name__)

OUTPUT_TAG = "output"   # the model's audio and what goes with it: withdrawn from the outbox when a response is cut


class Session:
    route = ""
    type_key = "type"

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.conversation: Conversation | None = None
        self.idle_timeout_s = self.settings.idle_timeout_s
        self.transport: Transport | None = None
        self.outbox = Outbox(self.settings.max_output_backlog_s, self.settings.max_output_bytes,
                             self._output_overflow)
        self.flood = FloodGuard(self.settings.max_events_per_s, self._flood_warning,
                                lambda: self.spawn(self._flood_close()))
        self._closing: tuple[int, str] | None = None   # (code, reason) once a close has begun
        self.live_call: LiveCall | None = None          # in the live-call list (calls/live.py) from its conversation on

    def attach(self, transport: Transport) -> None:
        self.transport = transport

    @property
    def closed(self) -> bool:
        """A close has begun: nothing more is sent or read."""
        return self._closing is not None

    # ---- hooks -----------------------------------------------------------------------------------------------

    async def on_open(self) -> None:
        """After the connection is up (admission, greeting). Call `self.close(...)` to end it."""

    async def on_event(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        raise ProtocolError("binary_unsupported", f"{self.route} takes JSON text frames only")

    def closed_event(self, reason: str) -> dict[str, Any] | None:
        """The event sent before the connection closes (`session.closed`), or None."""
        return None

    async def on_disconnect(self) -> None:
        """The connection is gone; free what the dialect holds (an override calls this too: the call ends here when
        no close came first). The conversation itself is closed already."""
        self.ctx.calls.end(self.live_call, self._closing[1] if self._closing else "hang_up")

    def call_opening(self) -> dict[str, Any]:
        """What the door knows of its call as the conversation is made: `caller` (the identity it carries), `codec`,
        `record` (the session's own wish), as `CallRegistry.open` takes them."""
        return {}

    def call_details(self) -> dict[str, Any]:
        """The door's own figures of the call now (how much the caller heard, say), for the live-call list."""
        return {}

    async def hang_up(self, reason: str) -> None:
        """End the call from outside (the admin API): the client is told `reason` as any close tells it."""
        await self.close(CLOSE_NORMAL, reason)

    def cut_output(self) -> None:
        """Drop what the client is about to hear (the admin API): the model's audio still queued for it."""
        self.outbox.drop_tagged(OUTPUT_TAG)

    # ---- input -----------------------------------------------------------------------------------------------

    async def dispatch_text(self, text: str) -> None:
        """One text message: strict JSON (`app.sessions.wire`) with a string `type_key`, handed to `on_event`."""
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
        await self.guard(self.on_event(event), event_id)

    async def dispatch_binary(self, data: bytes) -> None:
        await self.guard(self.on_binary(data), None)

    async def guard(self, work: Any, event_id: str | None) -> None:
        try:
            await work
        except ProtocolError as e:
            await self.send_error(e, event_id)

    def _flood_warning(self) -> None:
        self.send_error_nowait(ProtocolError(
            "rate_limited", f"more than {self.settings.max_events_per_s:g} events per second; events dropped"))

    async def _flood_close(self) -> None:
        if not self.closed:
            await self.send_error(ProtocolError("rate_limited", "sustained flood of events; closing"))
            await self.close(CLOSE_POLICY, "rate_limited")

    # ---- admission -------------------------------------------------------------------------------------------

    async def reserve(self) -> Slot | None:
        """A slot, or None after telling the client why (`resource_exhausted`, …) and closing with 1013."""
        try:
            return await admit(self.ctx, self.route)
        except Refused as e:
            await self.send_error(ProtocolError(e.code, e.message))
            await self.close(CLOSE_TRY_LATER, e.code, send_closed=False)
            return None

    def start_failure(self, task: asyncio.Task[None]) -> BaseException | None:
        """Why the conversation's start (`task`, done) failed, when someone is still there to tell; else None."""
        if task.cancelled():
            return None
        e = task.exception()  # retrieved even when it no longer matters (asyncio logs one never retrieved)
        if e is None or self.closed or self.conversation is None or self.conversation.state is State.CLOSED:
            return None  # closed while it started (the client went away): nobody to tell
        return e

    def new_conversation(self, slot: Slot) -> Conversation:
        """A conversation on `slot` whose pushes past the backlog bounds are refused (streamed audio must lose
        nothing: the client gets `input_backpressure` instead)."""
        policy = InputPolicy(backlog_s=self.settings.max_realtime_backlog_s,
                             input_backlog_s=self.settings.max_input_backlog_s)
        conversation = Conversation(slot, metrics=self.ctx.metrics, input_policy=policy)
        self.live_call = self.ctx.calls.open(self.route, conversation, self, **self.call_opening())
        return conversation

    # ---- output ----------------------------------------------------------------------------------------------

    def send_nowait(self, event: dict[str, Any], tag: str | None = None) -> None:
        """Queue one server event (an `event_id` is added where the dialect's events have one); safe from loop
        callbacks. A tagged event can be withdrawn while queued (`Outbox.drop_tagged`)."""
        if self.closed or (self.transport is not None and not self.transport.carries_events):
            return
        if "event_id" not in event and self.type_key == "type":
            event = {"type": event["type"], "event_id": new_event_id(), **event}
        self.outbox.put(dumps(event), tag)

    @property
    def sends_audio(self) -> bool:
        """Whether the dialect's audio messages go anywhere (worth encoding)."""
        return not self.closed and (self.transport is None or self.transport.carries_audio)

    def send_audio_nowait(self, payload: dict[str, Any] | bytes) -> None:
        """Queue one frame's audio (a JSON event or a binary message), tagged `OUTPUT_TAG`."""
        if not self.sends_audio:
            return
        if isinstance(payload, bytes):
            self.outbox.put(payload, OUTPUT_TAG)
        else:
            self.send_nowait(payload, OUTPUT_TAG)

    async def send(self, event: dict[str, Any]) -> None:
        self.send_nowait(event)

    def send_error_nowait(self, err: ProtocolError, event_id: str | None = None) -> None:
        self.ctx.metrics.errors[err.code] += 1
        self.send_nowait(error_event(err.code, err.message, param=err.param, event_id=event_id))

    async def send_error(self, err: ProtocolError, event_id: str | None = None) -> None:
        self.send_error_nowait(err, event_id)

    def _output_overflow(self) -> None:
        """The client does not read: free the slot now, then tell it and close (bounded)."""
        self.ctx.metrics.errors["output_backpressure"] += 1
        if self.conversation is not None:
            self.conversation.close()
        message = (f"output unread for more than {self.settings.max_output_backlog_s:g} s or "
                   f"{self.settings.max_output_bytes} bytes; closing")
        if self.transport is None or self.transport.carries_events:
            self.outbox.put_last(dumps(error_event("output_backpressure", message)))
        self.spawn(self.close(CLOSE_POLICY, "output_backpressure"))

    # ---- closing ---------------------------------------------------------------------------------------------

    async def close(self, code: int, reason: str, *, send_closed: bool = True) -> None:
        """Say `closed_event` (if the dialect has one), free the slot, let the transport flush and close."""
        if self.closed:
            return
        if send_closed:
            closed = self.closed_event(reason)
            if closed is not None:
                self.send_nowait(closed)
        self._closing = (code, reason)
        if self.conversation is not None:
            self.conversation.close()
        self.ctx.calls.end(self.live_call, reason)
        if self.transport is not None:
            await self.transport.close(code, reason)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.ctx.tasks.add(task)
        task.add_done_callback(self.ctx.tasks.discard)
