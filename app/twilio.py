"""`WS /v1/twilio`: the Twilio Media Streams dialect, for phone lines (and Fonoster, SignalWire, 2600Hz).

In: `connected`; `start` (`streamSid`, `mediaFormat` = μ-law 8 kHz mono, persona/voice/sampling from
`customParameters`) reserves a slot and starts the conversation; `media` (base64 μ-law, any length, usually 20 ms)
feeds it; `mark` is echoed once every sample queued before it has been sent; `clear` drops the audio not sent yet
(pending marks are then echoed at once, as Twilio does); `dtmf` is counted; `stop` ends the call.
Out: `media` with 160 bytes (20 ms) each, paced by the clock at real time from a playout buffer (a small adaptive
prebuffer, silence while the model's next frame is due), and the `mark` echoes. Errors use the shared `error`
envelope. No free slot: an `error` and close 1013 (the bridge hangs up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from aiohttp import web

from app.audio import InputDecoder, b64decode, b64encode
from app.context import CONTEXT, ServerContext
from app.conversation import Backpressure, State
from app.errors import ProtocolError
from app.session import Session
from app.session_config import SAMPLING_KEYS, ConfigUpdate, default_config, with_update
from app.transport import CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY
from app.websocket import serve
from app.wire import WireError, parse_value
from media.codecs import AudioFormat
from media.playout import PlayoutBuffer
from media.resample import Resampler
from model.engine import EngineError, FrameOutput

logger = logging.getLogger(__name__)

RATE = 8000
CHUNK = 160          # 20 ms at 8 kHz
CHUNK_S = 0.020
STALL_S = 0.040      # a send this late rebases the clock instead of catching up in a burst
ULAW = AudioFormat("pcmu", RATE)
MAX_NAME_CHARS = 128   # streamSid and mark names: echoed in every media event / mark, so kept short


class TwilioSession(Session):
    route = "/v1/twilio"
    type_key = "event"

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.stream_sid: str | None = None
        self.decoder = InputDecoder(ULAW)
        self.resampler = Resampler(24000, RATE)
        self.playout = PlayoutBuffer(RATE)
        self.marks: deque[tuple[int, str]] = deque()   # (playout position, name)
        self.dtmf: list[str] = []
        self.chunks_sent = 0
        self._pacer: asyncio.Task[None] | None = None

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
        if kind not in ("media", "mark", "clear", "dtmf"):
            raise ProtocolError("unknown_event", f"unknown Twilio event {kind!r}", param="event")
        if self.conversation is None:
            raise ProtocolError("session_not_created", f"`{kind}` before `start`")
        if kind == "media":
            self.on_media(event)
        elif kind == "mark":
            name = (event.get("mark") or {}).get("name") if isinstance(event.get("mark"), dict) else None
            if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
                raise ProtocolError("bad_event", f"`mark` needs `mark.name` (a string of at most {MAX_NAME_CHARS} "
                                    "characters)", param="mark.name")
            self.marks.append((self.playout.stats().written_samples, name))
            self._echo_marks()
        elif kind == "clear":
            self.playout.clear()
            self._echo_marks()
        else:
            digit = (event.get("dtmf") or {}).get("digit") if isinstance(event.get("dtmf"), dict) else None
            if not isinstance(digit, str):
                raise ProtocolError("bad_event", "`dtmf` needs `dtmf.digit`", param="dtmf.digit")
            self.dtmf.append(digit)

    async def on_start(self, event: dict[str, Any]) -> None:
        if self.conversation is not None:
            raise ProtocolError("session_already_created", "this stream already started")
        start = event.get("start")
        if not isinstance(start, dict):
            raise ProtocolError("bad_event", "`start` needs a `start` object", param="start")
        sid = event.get("streamSid", start.get("streamSid"))
        if not isinstance(sid, str) or not sid or len(sid) > MAX_NAME_CHARS:
            raise ProtocolError("bad_event", f"`start` needs a `streamSid` (at most {MAX_NAME_CHARS} characters)",
                                param="start.streamSid")
        media_format = start.get("mediaFormat", {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1})
        if not isinstance(media_format, dict) or media_format.get("channels", 1) != 1 or \
                media_format.get("encoding") != "audio/x-mulaw" or media_format.get("sampleRate") != RATE:
            raise ProtocolError("unsupported_audio_format",
                                f"Media Streams audio must be audio/x-mulaw at 8000 Hz mono, got {media_format!r}",
                                param="start.mediaFormat")
        params = start.get("customParameters") or {}
        if not isinstance(params, dict):
            raise ProtocolError("bad_event", "`customParameters` must be an object", param="start.customParameters")
        up = ConfigUpdate()
        persona = params.get("persona", params.get("instructions"))
        up.persona = persona if isinstance(persona, str) else None
        if params.get("voice"):
            up.voice = params["voice"]
        up.sampling_fields = {k: _param_value(v) for k, v in params.items() if k in SAMPLING_KEYS}
        config = with_update(self.ctx, default_config(self.ctx), up, started=False,
                             prefix="start.customParameters.")
        slot = await self.reserve()
        if slot is None:
            return
        self.stream_sid = sid
        conv = self.conversation = self.new_conversation(slot)
        conv.add_listener(self._on_frame, self._on_engine_error)
        task = conv.start(config.params())
        task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        e = task.exception()  # retrieved even when it no longer matters (asyncio logs one never retrieved)
        if e is None or self.closed or self.conversation is None or self.conversation.state is State.CLOSED:
            return  # a call closed while it started (the client went away): nobody to tell
        if isinstance(e, EngineError):
            self.send_error_nowait(ProtocolError(e.code if e.code in ("invalid_voice", "invalid_session_config")
                                                 else "runtime_failed", f"the call did not start: {e.message}"))
            self.spawn(self.close(CLOSE_POLICY if e.code.startswith("invalid") else CLOSE_INTERNAL, e.code))
        elif e is not None:
            logger.error("twilio %s: start failed", self.stream_sid, exc_info=e)
            self.spawn(self.close(CLOSE_INTERNAL, "internal_error"))

    def on_media(self, event: dict[str, Any]) -> None:
        media = event.get("media")
        if not isinstance(media, dict):
            raise ProtocolError("bad_event", "`media` needs a `media` object", param="media")
        if media.get("track", "inbound") not in ("inbound", "inbound_track"):
            return
        samples = self.decoder.decode(b64decode(media.get("payload"), param="media.payload"), param="media.payload")
        assert self.conversation is not None
        if samples.size:
            try:
                self.conversation.push(None, samples)
            except Backpressure as e:
                raise ProtocolError("input_backpressure", str(e)) from None

    # ---- output ----------------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed:
            return
        self.playout.write(self.resampler.process(frame.audio))
        if self._pacer is None:
            self._pacer = asyncio.get_running_loop().create_task(self._pace())

    async def _pace(self) -> None:
        """One 20 ms `media` per 20 ms of wall clock; after a stall the clock moves on instead of bursting."""
        due = time.monotonic()
        while not self.closed:
            chunk = self.playout.read(CHUNK)
            self.send_nowait({"event": "media", "streamSid": self.stream_sid,
                              "media": {"payload": b64encode(ULAW.encode(chunk))}})
            self.chunks_sent += 1
            self._echo_marks()
            due += CHUNK_S
            now = time.monotonic()
            if now - due > STALL_S:
                due = now
            await asyncio.sleep(max(0.0, due - now))

    def _echo_marks(self) -> None:
        drained = self.playout.stats().drained_samples
        while self.marks and self.marks[0][0] <= drained:
            _, name = self.marks.popleft()
            self.send_nowait({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    def _on_engine_error(self, error: EngineError) -> None:
        if self.closed:
            return
        self.send_error_nowait(ProtocolError("runtime_failed", f"the engine failed this call: {error.message}"))
        self.spawn(self.close(CLOSE_INTERNAL, "runtime_failed"))

    async def on_disconnect(self) -> None:
        if self._pacer is not None:
            self._pacer.cancel()


def _param_value(value: object) -> object:
    """customParameters arrive as strings: "0.7" -> 0.7, "true" -> True, "42" -> 42."""
    if isinstance(value, str):
        try:
            return parse_value(value)
        except WireError:
            return value
    return value


async def twilio_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, TwilioSession(request.app[CONTEXT]))
