"""What a session's transport is to its dialect, and the close codes every transport speaks.

A session is a dialect (`app.sessions.session.Session` and its subclasses: client messages in, server messages out, the
protocol state; no I/O) joined to a transport that owns the I/O: reading and bounding what arrives, draining the
session's `Outbox` into the connection, timeouts, and the close handshake. The transports: `app.sessions.websocket`
(WebSocket text and binary frames), `app.doors.webrtc.call` (the `oai-events` data channel plus the RTP media track) and
`app.sessions.tcp` (framed raw TCP, for Asterisk AudioSocket).
The dialect reaches its transport only through `Transport`.

Close codes (WebSocket numbers; other transports map them to their own ending): 1000 normal, 1001 server shutdown,
1008 policy (flood, first-message timeout, unread output), 1009 message too big, 1011 engine failure, 1013 no free
slot.
"""

from __future__ import annotations

from typing import Protocol

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_LATER = 1013


class Transport(Protocol):
    carries_events: bool     # server events reach the client (a WebRTC call without a data channel has nowhere)
    carries_audio: bool      # the dialect's audio messages are sent (WebRTC's audio leaves on the RTP track)

    async def close(self, code: int, reason: str) -> None:
        """Flush the outbox (bounded), end the connection with `code`; called once, by `Session.close`."""
        ...
