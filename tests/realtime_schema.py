"""Every server event of the Realtime dialect, validated against the openai SDK's own pydantic types.

    validate_server_event(event)              # GA: openai.types.realtime.RealtimeServerEvent
    validate_server_event(event, beta=True)   # beta: openai.types.beta.realtime.RealtimeServerEvent

The SDK's union is discriminated by `type`, so an event validates only as its own type, field by field (enums such as
an item's `status` included). The server's documented extensions (docs/protocol.md §2, "Extensions") are not in the
SDK: each is checked against its own model here, and only those types pass. Raises `SchemaError` naming the event.
"""

from __future__ import annotations

from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

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
    stats: dict[str, float]


class SessionLink(_Extension):
    type: Literal["session.link"]
    session_id: str
    input: dict[str, Any]
    playout_ms: float


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
    "session.link": SessionLink,
}


@cache
def _models(beta: bool) -> dict[str, type[BaseModel]]:
    """The SDK's server event models by their `type`: validating against the one model of an event's type gives
    field-level errors (the SDK's union is not a discriminated one in pydantic's sense)."""
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    members = get_args(RealtimeServerEvent)
    if members and get_origin(members[0]) is Union:   # Annotated[Union[...], PropertyInfo(...)]
        members = get_args(members[0])
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in members}


def validate_server_event(event: dict[str, Any], beta: bool = False) -> None:
    """Raise SchemaError unless `event` is a valid server event of the SDK (or a documented extension)."""
    kind = event.get("type")
    dialect = "beta" if beta else "GA"
    model = EXTENSIONS.get(kind) or _models(beta).get(kind)
    if model is None:
        raise SchemaError(f"{kind!r} is not a {dialect} server event type nor a documented extension")
    try:
        model.model_validate(event)
    except pydantic.ValidationError as e:
        raise SchemaError(f"{kind!r} is not a valid {dialect} server event: {e}\nevent: {str(event)[:600]}") from None
