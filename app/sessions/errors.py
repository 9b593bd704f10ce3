"""The error vocabulary every dialect shares: codes, their OpenAI error types, and the `error` event envelope.

`{"type": "error", "event_id": "event_…", "error": {"type", "code", "message", "param"?, "event_id"?}}`, where
`error.event_id` echoes the client event that caused it. `docs/protocol.md` prints `CODES` as its table.
An error never echoes more than a short prefix of what the client sent: messages are cut at `MAX_MESSAGE_CHARS`
and an echoed `event_id` at `MAX_ECHO_CHARS` (a client that sends megabytes of junk gets bytes of errors back).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

INVALID = "invalid_request_error"
RATE = "rate_limit_error"
SERVER = "server_error"
MAX_MESSAGE_CHARS = 300
MAX_ECHO_CHARS = 64
DRAINING_MESSAGE = "this server is draining for a restart and takes no new session; connect again"


@dataclass(frozen=True)
class ErrorCode:
    code: str
    type: str
    meaning: str


CODES: dict[str, ErrorCode] = {
    c.code: c
    for c in (
        ErrorCode("invalid_json", INVALID, "A text frame is not a JSON object, nests deeper than 32 levels, or has a "
                  "non-finite number (NaN, Infinity, 1e400); the session goes on."),
        ErrorCode("bad_event", INVALID, "A required field is missing or has the wrong type."),
        ErrorCode("unknown_event", INVALID, "The event `type` is not part of this dialect."),
        ErrorCode("unsupported_event", INVALID, "An OpenAI event that does not apply to a model-native duplex model."),
        ErrorCode("event_too_large", INVALID, "A message is over the size bound; the socket closes with 1009."),
        ErrorCode("binary_unsupported", INVALID, "A binary frame on a dialect that takes JSON only."),
        ErrorCode("config_timeout", INVALID, "No first message within the first-message timeout; the socket closes."),
        ErrorCode("invalid_session_config", INVALID,
                  "A session field has a bad value (sampling, modalities, pacing…)."),
        ErrorCode("invalid_voice", INVALID, "The voice is not a bundled voice or a file in the voices folder."),
        ErrorCode("unsupported_audio_format", INVALID, "An unknown audio format, or a rate outside 8000–48000 Hz."),
        ErrorCode("bad_audio", INVALID, "Bad base64, a byte count that is not whole samples, or non-finite samples."),
        ErrorCode("invalid_duplex_runtime_config", INVALID, "`extra_body` names a key the server owns."),
        ErrorCode("item_not_found", INVALID, "A conversation item id the session does not hold (or no longer: it "
                  "keeps the last 256)."),
        ErrorCode("invalid_item", INVALID, "An item that cannot take the request (only an assistant message's audio "
                  "can be truncated)."),
        ErrorCode("unsupported_session_resume", INVALID, "Sessions cannot be resumed."),
        ErrorCode("session_not_created", INVALID, "An event that needs a session before `session.create`."),
        ErrorCode("session_already_created", INVALID, "A second `session.create` on one socket."),
        ErrorCode("resource_exhausted", RATE, "Every conversation slot is taken; the socket closes with 1013."),
        ErrorCode("server_draining", RATE, "The server is draining for a restart and takes no new session (HTTP "
                  "503 before the upgrade, else this error and close 1013); connect again: a balancer sends you to "
                  "another instance."),
        ErrorCode("input_backpressure", RATE, "Audio arrives faster than it is consumed; the append was dropped."),
        ErrorCode("rate_limited", RATE, "Too many events per second; the event was dropped (sustained: close 1008)."),
        ErrorCode("output_backpressure", RATE, "The client does not read its output (more than the output bound "
                  "queued, in seconds or bytes); the socket closes with 1008."),
        ErrorCode("too_many_connections", RATE,
                  "The address has `--max-connections-per-ip` connections open (HTTP 429 before the upgrade)."),
        ErrorCode("unauthorized", INVALID, "Missing or wrong API key (HTTP 401 before the upgrade)."),
        ErrorCode("invalid_client_secret", INVALID, "An `ek_` client secret this server did not mint, or a garbled "
                  "one (HTTP 401 before the upgrade)."),
        ErrorCode("client_secret_expired", INVALID, "The client secret's `expires_at` has passed (HTTP 401 before the "
                  "upgrade): mint a new one."),
        ErrorCode("client_secret_used", INVALID, "The client secret already opened a session: each opens one (HTTP "
                  "401 before the upgrade)."),
        ErrorCode("origin_not_allowed", INVALID,
                  "The Origin is not in the allowed list (HTTP 403 before the upgrade)."),
        ErrorCode("runtime_failed", SERVER, "The engine failed this conversation; the socket closes with 1011."),
        ErrorCode("engine_stopped", SERVER, "The engine stopped under the conversation."),
        ErrorCode("internal_error", SERVER, "A server bug; the message says what failed."),
    )
}


class ProtocolError(Exception):
    """A client-visible error: raised anywhere in a dialect, turned into one `error` event by the socket loop."""

    def __init__(self, code: str, message: str, *, param: str | None = None) -> None:
        if code not in CODES:
            raise ValueError(f"unregistered error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def new_event_id() -> str:
    return f"event_{uuid.uuid4().hex[:20]}"


def error_event(code: str, message: str, *, param: str | None = None, event_id: str | None = None) -> dict[str, Any]:
    """The shared `error` envelope; `event_id` is the client event being answered, if it named one."""
    body: dict[str, Any] = {"type": CODES[code].type, "code": code, "message": short(message, MAX_MESSAGE_CHARS)}
    if param is not None:
        body["param"] = param
    if event_id is not None:
        body["event_id"] = short(event_id, MAX_ECHO_CHARS)
    return {"type": "error", "event_id": new_event_id(), "error": body}


def http_error_body(code: str, message: str) -> dict[str, Any]:
    """The JSON body of an HTTP refusal (401, 403, 429, 503): the `error` object without the event wrapper."""
    return {"error": {"type": CODES[code].type, "code": code, "message": short(message, MAX_MESSAGE_CHARS)}}


def short(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "…"
