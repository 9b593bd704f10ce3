"""Every server event of the Realtime dialect, validated against the openai SDK's own pydantic types.

    validate_server_event(event)              # GA: openai.types.realtime.RealtimeServerEvent
    validate_server_event(event, beta=True)   # beta: openai.types.beta.realtime.RealtimeServerEvent

The SDK's union is discriminated by `type`, so an event validates only as its own type, field by field (enums such as
an item's `status` included). The server's documented extensions (docs/protocol.md §2, "Extensions") are not in the
SDK: each is checked against its own model here, and only those types pass. Raises `SchemaError` naming the event.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict


class SchemaError(AssertionError):
    pass


class _Extension(BaseModel):
    model_config = ConfigDict(extra="forbid")
    event_id: str


class SessionClosed(_Extension):
    type: Literal["session.closed"]
    session_id: str
    reason: str
    stats: dict[str, int]


class HeartbeatAck(_Extension):
    type: Literal["session.heartbeat_ack"]
    session_id: str


class PlaybackAcknowledged(_Extension):
    type: Literal["playback.acknowledged"]
    event: dict[str, Any]


EXTENSIONS: dict[str, type[BaseModel]] = {
    "session.closed": SessionClosed,
    "session.heartbeat_ack": HeartbeatAck,
    "playback.acknowledged": PlaybackAcknowledged,
}


@cache
def _adapter(beta: bool) -> pydantic.TypeAdapter:
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    return pydantic.TypeAdapter(RealtimeServerEvent)


def validate_server_event(event: dict[str, Any], beta: bool = False) -> None:
    """Raise SchemaError unless `event` is a valid server event of the SDK (or a documented extension)."""
    kind = event.get("type")
    try:
        if kind in EXTENSIONS:
            EXTENSIONS[kind].model_validate(event)
        else:
            _adapter(beta).validate_python(event)
    except pydantic.ValidationError as e:
        dialect = "beta" if beta else "GA"
        raise SchemaError(f"{kind!r} is not a valid {dialect} server event: {e}\nevent: {str(event)[:600]}") from None
