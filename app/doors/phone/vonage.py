"""`WS /v1/vonage`: the Vonage Voice API WebSocket (NCCO `connect` to a `websocket` endpoint).

In, as Vonage sends them: first the TEXT `{"event":"websocket:connected","content-type":"audio/l16;rate=16000"}`
(or `rate=8000`) with the NCCO `headers` flattened beside it (`persona` or `instructions`, `voice`, sampling keys
configure the call); it reserves a slot and starts the conversation. Then BINARY 16-bit little-endian mono PCM at
that rate (Vonage sends 20 ms per message; any whole number of samples is taken); `websocket:dtmf` (`digit`,
counted); `websocket:notify` (the echo of one of ours: the caller has heard the audio before it);
`websocket:cleared`. The API key goes in the NCCO `uri` (`?api_key=`), since NCCO headers arrive inside the first
message, not as HTTP headers.
Out: BINARY of exactly 20 ms (320 bytes at 8 kHz, 640 at 16 kHz), one per 20 ms of wall clock, and every second of
audio `{"action":"notify","payload":{"audio_s":n}}`, which Vonage echoes when that point has played. The model takes
turns in its own audio, so the server sends `{"action":"clear"}` only when the output is cut
(`PhoneLine.cut_output`, the admin API). Errors are TEXT in the shared `error` envelope
(Vonage ignores them; they are for logs); no free slot: an `error` and close 1013; a caller hang-up is the socket
closing, which frees the slot at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web

from app.doors.phone.line import PhoneLine
from app.sessions.errors import ProtocolError
from app.sessions.websocket import serve
from app.shell.context import CONTEXT
from media.codecs import AudioFormat

ROUTE = "/v1/vonage"
RATES = (8000, 16000)
NOTIFY_EVERY = 50       # chunks (1 s) between playback notifications


class VonageSession(PhoneLine):
    route = ROUTE
    type_key = "event"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.line: AudioFormat | None = None
        self.heard_s = 0           # seconds of audio the caller has heard (from the notify echoes)

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "websocket:connected":
            await self.on_connected(event)
        elif kind not in ("websocket:dtmf", "websocket:notify", "websocket:cleared"):
            raise ProtocolError("unknown_event", f"unknown Vonage event {kind!r}", param="event")
        elif self.conversation is None:
            raise ProtocolError("session_not_created", f"`{kind}` before `websocket:connected`")
        elif kind == "websocket:dtmf":
            self.dtmf(event.get("digit"), "digit")
        elif kind == "websocket:notify":
            payload = event.get("payload")
            heard = payload.get("audio_s") if isinstance(payload, dict) else None
            if isinstance(heard, int) and not isinstance(heard, bool):
                self.heard_s = max(self.heard_s, heard)

    async def on_connected(self, event: dict[str, Any]) -> None:
        if self.conversation is not None:
            raise ProtocolError("session_already_created", "this call is already connected")
        line = _line_format(event.get("content-type"))
        config = self.call_config(event, "")
        self.line = line
        self.caller = {k: v for k, v in event.items() if k not in ("event", "content-type")}
        await self.begin(config, line)

    async def on_binary(self, data: bytes) -> None:
        self.hear(data, "audio")

    def on_cut(self) -> None:
        self.send_nowait({"action": "clear"})

    def call_details(self) -> dict[str, Any]:
        return {**super().call_details(), "heard_s": self.heard_s}

    def send_chunk(self, samples: np.ndarray) -> None:
        assert self.line is not None and self.pacer is not None
        self.send_audio_nowait(self.line.encode(samples))
        sent = self.pacer.chunks_sent + 1
        if sent % NOTIFY_EVERY == 0:
            self.send_nowait({"action": "notify", "payload": {"audio_s": sent // NOTIFY_EVERY}})


def _line_format(content_type: object) -> AudioFormat:
    """`audio/l16;rate=16000` -> 16-bit PCM at 16 kHz."""
    if isinstance(content_type, str):
        kind, _, params = content_type.replace(" ", "").lower().partition(";")
        rate = params.removeprefix("rate=")
        if kind == "audio/l16" and rate.isdigit() and int(rate) in RATES:
            return AudioFormat("pcm16", int(rate))
    raise ProtocolError("unsupported_audio_format", f"content-type must be audio/l16;rate=8000 or 16000, got "
                        f"{str(content_type)[:64]!r}", param="content-type")


async def vonage_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, VonageSession(request.app[CONTEXT]))
