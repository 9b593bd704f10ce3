"""`WS /v1/freeswitch`: FreeSWITCH `mod_audio_stream` (`uuid_audio_stream <uuid> start <url> mono <8k|16k> [meta]`).

The stream's rate is not on the wire, so the URL says it: `ws://host:port/v1/freeswitch?rate=16000` (default 8000;
any multiple of 8000 up to 48000, matching the `start` command's `8k`/`16k`/N; another: `error
unsupported_audio_format` and close 1008, after the key is checked). Only `mono` (the caller's leg) and
`mixed` streams are taken: a `stereo` stream cannot be told apart on the wire and would be heard as noise.
In: the optional metadata as the first TEXT frame, a JSON object whose `persona` (or `instructions`), `voice` and
sampling keys configure the call; then BINARY L16 (little-endian, FreeSWITCH's host order on x86), 20 ms per
message by default. The call starts (admission, then the conversation) at the first message, metadata or audio.
Later TEXT frames (`uuid_audio_stream <uuid> send_text <json>`) carry `{"type":"dtmf","digit":"5"}` (counted), for
a dialplan that forwards key presses. The API key: `?api_key=` on the URL, or `Authorization: Bearer` through
`STREAM_EXTRA_HEADERS`.
Out: TEXT `{"type":"streamAudio","data":{"audioDataType":"raw","sampleRate":N,"audioData":"<base64 L16>"}}`, one
per 100 ms of audio, paced at real time; `mod_audio_stream` raises each as a `mod_audio_stream::play` event for the
ESL application to play. Errors use the shared `error` envelope (raised as `mod_audio_stream::json`); no free slot:
an `error` and close 1013; `stop` or a hang-up closes the socket, which frees the slot at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from aiohttp import web

from app.doors.phone.line import PhoneLine
from app.sessions.audio import b64encode
from app.sessions.errors import ProtocolError
from app.sessions.transport import CLOSE_POLICY
from app.sessions.websocket import serve
from app.sessions.wire import WireError, parse_object
from app.shell.context import CONTEXT, ServerContext
from media.codecs import MAX_RATE, AudioFormat

ROUTE = "/v1/freeswitch"


class FreeSwitchSession(PhoneLine):
    route = ROUTE
    chunk_ms = 100      # each message becomes a file for the ESL application: fewer, longer ones

    def __init__(self, ctx: ServerContext, rate: str) -> None:
        super().__init__(ctx)
        self.rate = rate
        self.line = AudioFormat("pcm16", int(rate)) if _valid_rate(rate) else None
        self.started = False

    async def on_open(self) -> None:
        if self.line is None:
            await self.send_error(ProtocolError("unsupported_audio_format", f"?rate= must be a multiple of 8000 "
                                                f"from 8000 to {MAX_RATE}, got {self.rate[:16]!r}", param="rate"))
            await self.close(CLOSE_POLICY, "unsupported_audio_format")

    async def dispatch_text(self, text: str) -> None:
        if self.started:
            await super().dispatch_text(text)
            return
        try:
            metadata = parse_object(text)
        except WireError as e:
            await self.send_error(ProtocolError("invalid_json", f"the metadata: {e}"))
            return
        await self.guard(self._start(metadata), None)

    async def _start(self, params: dict[str, Any]) -> None:
        config = self.call_config(params, "metadata.")
        self.started = True
        self.caller = {"metadata": params}
        assert self.line is not None
        await self.begin(config, self.line)

    async def on_event(self, event: dict[str, Any]) -> None:
        if event["type"] != "dtmf":
            raise ProtocolError("unknown_event", f"unknown event {event['type']!r}: after the metadata only "
                                "`dtmf` is taken", param="type")
        self.dtmf(event.get("digit"), "digit")

    async def on_binary(self, data: bytes) -> None:
        if not self.started:
            await self._start({})
        if self.conversation is not None:
            self.hear(data, "audio")

    def send_chunk(self, samples: np.ndarray) -> None:
        assert self.line is not None
        self.send_nowait({"type": "streamAudio", "data": {
            "audioDataType": "raw", "sampleRate": self.line.sample_rate,
            "audioData": b64encode(self.line.encode(samples))}})


def _valid_rate(rate: str) -> bool:
    return rate.isdigit() and len(rate) <= 6 and int(rate) % 8000 == 0 and 8000 <= int(rate) <= MAX_RATE


async def freeswitch_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, FreeSwitchSession(request.app[CONTEXT], request.query.get("rate", "8000")))
