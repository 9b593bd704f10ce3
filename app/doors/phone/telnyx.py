"""`WS /v1/telnyx`: Telnyx media streaming (bidirectional, `stream_bidirectional_mode: rtp`), every frame TEXT JSON.

In, as Telnyx sends them: `connected`; `start` (`stream_id`, `start.media_format` = PCMU or PCMA at 8 kHz, or L16
(big-endian, as RFC 2586) at 8000-48000 Hz, mono; persona/voice/sampling from `start.custom_parameters`) reserves a
slot and starts the conversation; `media` (`media.payload`: base64 RTP payload of the inbound track, put back in
order by `media.chunk`, since Telnyx does not guarantee the order); `dtmf` (`dtmf.digit`, counted); `mark` (the
echo of one of ours: the caller has heard the audio before it); `error` (logged); `stop` ends the call (close
1000). Telnyx's own auth token (`stream_auth_token`) arrives in the `x-telnyx-streaming-auth-token` header and is
taken as the API key, as are `?api_key=` on the `stream_url` and `Authorization: Bearer`.
Out: `{"event":"media","media":{"payload"}}` with 20 ms of audio in the stream's own codec and rate (set
`stream_bidirectional_codec` and `_sampling_rate` to match `stream_codec`), paced at real time, and every second of
audio a `{"event":"mark","mark":{"name":"audio-<seconds>"}}` whose echo tells how far the caller has heard. The
model takes turns in its own audio, so the server sends `{"event":"clear"}` only when the output is cut
(`PhoneLine.cut_output`, the admin API); the echoes of the marks that clear returns are not taken as heard. Errors
use the shared `error` envelope; no free slot: an `error` and close 1013.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from aiohttp import web

from app.doors.phone.line import PhoneLine, inbound_payload, media_streams_start
from app.doors.phone.reorder import Reorder
from app.sessions.audio import b64encode
from app.sessions.errors import ProtocolError
from app.sessions.transport import CLOSE_NORMAL
from app.sessions.websocket import serve
from app.shell.context import CONTEXT
from media.codecs import MAX_RATE, MIN_RATE, AudioFormat

logger = logging.getLogger(__name__)

ROUTE = "/v1/telnyx"
_G711 = {"PCMU": "pcmu", "PCMA": "pcma"}
MARK_EVERY = 50       # chunks (1 s) between playback marks


class TelnyxSession(PhoneLine):
    route = ROUTE
    type_key = "event"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_id: str | None = None
        self.line: AudioFormat | None = None
        self.big_endian = False
        self.order: Reorder[bytes] = Reorder()
        self.heard_s = 0           # seconds of audio the caller has heard (from the mark echoes)
        self.cleared_through = 0   # marks a `clear` returned: their echoes mean dropped, not heard

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "connected":
            return
        if kind == "start":
            await self.on_start(event)
        elif kind == "stop":
            await self.close(CLOSE_NORMAL, "stop")
        elif kind == "error":
            logger.warning("telnyx %s: the bridge reports %s", self.stream_id, str(event.get("payload"))[:200])
        elif kind not in ("media", "dtmf", "mark"):
            raise ProtocolError("unknown_event", f"unknown Telnyx event {kind!r}", param="event")
        elif self.conversation is None:
            raise ProtocolError("session_not_created", f"`{kind}` before `start`")
        elif kind == "media":
            self.on_media(event)
        elif kind == "dtmf":
            body = event.get("dtmf")
            self.dtmf(body.get("digit") if isinstance(body, dict) else None, "dtmf.digit")
        else:
            body = event.get("mark")
            name = body.get("name") if isinstance(body, dict) else None
            if isinstance(name, str) and name.startswith("audio-") and name[6:].isdigit() and \
                    not self.heard_s < int(name[6:]) <= self.cleared_through:
                self.heard_s = max(self.heard_s, int(name[6:]))

    async def on_start(self, event: dict[str, Any]) -> None:
        if self.conversation is not None:
            raise ProtocolError("session_already_created", "this stream already started")
        sid, start, params = media_streams_start(event, "stream_id", "custom_parameters")
        line, big_endian = _line_format(start.get("media_format"))
        config = self.call_config(params, "start.custom_parameters.")
        self.stream_id, self.line, self.big_endian = sid, line, big_endian
        self.caller = {"stream_id": sid, **{k: start.get(k) for k in ("call_control_id", "call_session_id", "from",
                                                                     "to")}, "custom_parameters": params}
        if not await self.begin(config, line):
            self.stream_id = None

    def on_media(self, event: dict[str, Any]) -> None:
        payload = inbound_payload(event)
        if payload is None:
            return
        if self.big_endian:
            payload = _swap16(payload, "media.payload")
        chunk = event["media"].get("chunk")
        n = int(chunk) if isinstance(chunk, (str, int)) and str(chunk).isdigit() and len(str(chunk)) <= 12 else None
        for data in self.order.put(n, payload) if n is not None else [payload]:
            self.hear(data, "media.payload")

    def on_cut(self) -> None:
        assert self.pacer is not None
        self.cleared_through = self.pacer.chunks_sent // MARK_EVERY
        self.send_nowait({"event": "clear"})

    def call_details(self) -> dict[str, Any]:
        return {**super().call_details(), "heard_s": self.heard_s}

    def send_chunk(self, samples: np.ndarray) -> None:
        assert self.line is not None and self.pacer is not None
        data = self.line.encode(samples)
        if self.big_endian:
            data = _swap16(data, "media.payload")
        self.send_nowait({"event": "media", "media": {"payload": b64encode(data)}})
        sent = self.pacer.chunks_sent + 1
        if sent % MARK_EVERY == 0:
            self.send_nowait({"event": "mark", "mark": {"name": f"audio-{sent // MARK_EVERY}"}})


def _line_format(value: object) -> tuple[AudioFormat, bool]:
    """(format, big-endian) from `start.media_format`."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_event", "`start` needs `media_format`", param="start.media_format")
    encoding, rate, channels = value.get("encoding"), value.get("sample_rate"), value.get("channels", 1)
    if channels != 1:
        raise ProtocolError("unsupported_audio_format", "the stream must be mono", param="start.media_format")
    if encoding in _G711 and rate == 8000:
        return AudioFormat(_G711[encoding], 8000), False
    if encoding == "L16" and isinstance(rate, int) and not isinstance(rate, bool) and MIN_RATE <= rate <= MAX_RATE:
        return AudioFormat("pcm16", rate), True
    raise ProtocolError("unsupported_audio_format", f"media_format must be PCMU or PCMA at 8000 Hz, or L16 at "
                        f"{MIN_RATE}-{MAX_RATE} Hz; got {encoding!r} at {rate!r}", param="start.media_format")


def _swap16(data: bytes, param: str) -> bytes:
    if len(data) % 2:
        raise ProtocolError("bad_audio", f"L16 audio needs whole 2-byte samples, got {len(data)} bytes", param=param)
    return np.frombuffer(data, ">i2").astype("<i2").tobytes()


async def telnyx_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, TelnyxSession(request.app[CONTEXT]))
