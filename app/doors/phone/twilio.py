"""`WS /v1/twilio`: the Twilio Media Streams dialect, for phone lines (and Fonoster, SignalWire, 2600Hz).

In: `connected`; `start` (`streamSid`, `callSid`, `mediaFormat` = μ-law 8 kHz mono, persona/voice/sampling from
`customParameters`) reserves a slot and starts the conversation; `media` (base64 μ-law, any length, usually 20 ms)
feeds it; `mark` is Twilio's echo of one of ours (the audio before it has played, or was dropped by our `clear`);
`dtmf` is counted; `stop` ends the call.
Out, as Twilio documents it: `media` with 160 bytes (20 ms) each, paced by the clock at real time from a playout
buffer (a small adaptive prebuffer, silence while the model's next frame is due); after each engine frame's audio a
`mark` named `f<n>` (n frames sent), whose echo tells how much of the model's speech the caller has heard
(`heard_s`); and `clear` when the output is cut (`PhoneLine.cut`), after which the echoes of the marks then pending
mean dropped, not heard. Twilio sends no marks of its own: a mark we did not send is ignored, and nothing is echoed.
Errors use the shared `error` envelope. No free slot: an `error` and close 1013 (the bridge hangs up).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web

from app.doors.phone.line import MAX_NAME_CHARS, PhoneLine, inbound_payload, media_streams_start
from app.sessions.audio import b64encode
from app.sessions.errors import ProtocolError
from app.sessions.transport import CLOSE_NORMAL
from app.sessions.websocket import serve
from app.shell.context import CONTEXT
from media.codecs import AudioFormat
from model.engine import FrameOutput

RATE = 8000
FRAME_S = 0.08
ULAW = AudioFormat("pcmu", RATE)


class TwilioSession(PhoneLine):
    route = "/v1/twilio"
    type_key = "event"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_sid: str | None = None
        self.frames_sent = 0                 # engine frames written to the line (each followed by a mark)
        self.heard_frames = 0                # of them, those Twilio has played (its mark echoes)
        self.marks_out: set[str] = set()     # marks sent, not echoed yet
        self.marks_dropped: set[str] = set()  # marks a `clear` dropped: their echo means dropped, not played

    # ---- events ----------------------------------------------------------------------------------------------

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "connected":
            return
        if kind == "start":
            await self.on_start(event)
            return
        if kind == "stop":
            await self.close(CLOSE_NORMAL, "stop")
            return
        if kind not in ("media", "mark", "dtmf"):
            raise ProtocolError("unknown_event", f"unknown Twilio event {kind!r}", param="event")
        if self.conversation is None or self.pacer is None:
            raise ProtocolError("session_not_created", f"`{kind}` before `start`")
        if kind == "media":
            self.on_media(event)
        elif kind == "mark":
            name = (event.get("mark") or {}).get("name") if isinstance(event.get("mark"), dict) else None
            if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
                raise ProtocolError("bad_event", f"`mark` needs `mark.name` (a string of at most {MAX_NAME_CHARS} "
                                    "characters)", param="mark.name")
            self.on_echo(name)
        else:
            digit = (event.get("dtmf") or {}).get("digit") if isinstance(event.get("dtmf"), dict) else None
            self.dtmf(digit, "dtmf.digit")

    async def on_start(self, event: dict[str, Any]) -> None:
        if self.conversation is not None:
            raise ProtocolError("session_already_created", "this stream already started")
        sid, start, params = media_streams_start(event, "streamSid", "customParameters")
        media_format = start.get("mediaFormat", {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1})
        if not isinstance(media_format, dict) or media_format.get("channels", 1) != 1 or \
                media_format.get("encoding") != "audio/x-mulaw" or media_format.get("sampleRate") != RATE:
            raise ProtocolError("unsupported_audio_format",
                                f"Media Streams audio must be audio/x-mulaw at 8000 Hz mono, got {media_format!r}",
                                param="start.mediaFormat")
        config = self.call_config(params, "start.customParameters.")
        self.stream_sid = sid
        self.caller = {"stream_sid": sid, "call_sid": start.get("callSid"), "account_sid": start.get("accountSid"),
                       "custom_parameters": params}
        if not await self.begin(config, ULAW):
            self.stream_sid = None

    def on_media(self, event: dict[str, Any]) -> None:
        payload = inbound_payload(event)
        if payload is not None:
            self.hear(payload, "media.payload")

    # ---- output ----------------------------------------------------------------------------------------------

    def send_chunk(self, samples: np.ndarray) -> None:
        self.send_audio_nowait({"event": "media", "streamSid": self.stream_sid,
                                "media": {"payload": b64encode(ULAW.encode(samples))}})

    def _on_frame(self, frame: FrameOutput) -> None:
        super()._on_frame(frame)
        if not self.closed and self.pacer is not None:
            self.frames_sent += 1
            self.pacer.mark(f"f{self.frames_sent}")

    def on_mark(self, name: str) -> None:
        """The audio before our mark `name` has left: the mark follows it, for Twilio to echo once played."""
        self.marks_out.add(name)
        self.send_audio_nowait({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    def on_echo(self, name: str) -> None:
        """Twilio's echo of our mark: the caller heard what came before it, unless a `clear` dropped it."""
        if name in self.marks_dropped:
            self.marks_dropped.discard(name)
        elif name in self.marks_out:
            self.marks_out.discard(name)
            self.heard_frames = max(self.heard_frames, int(name[1:]))

    def on_cut(self) -> None:
        self.marks_dropped |= self.marks_out
        self.marks_out.clear()
        self.send_nowait({"event": "clear", "streamSid": self.stream_sid})

    def call_details(self) -> dict[str, Any]:
        return {**super().call_details(), "heard_s": self.heard_s}

    @property
    def heard_s(self) -> float:
        """Seconds of the model's audio Twilio has played to the caller (by its mark echoes)."""
        return round(self.heard_frames * FRAME_S, 2)


async def twilio_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, TwilioSession(request.app[CONTEXT]))
