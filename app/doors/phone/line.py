"""What every telephone-bridge dialect shares: the call's start, its audio in and out, DTMF, and its failures.

A bridge (Twilio, Telnyx, Vonage, FreeSWITCH, Asterisk AudioSocket) subclasses `PhoneLine`: it parses its vendor's
messages and calls `begin(config, line_format)` when the vendor says the call is up (admission through
`Session.reserve`, the one admission path; then the conversation starts at once), `hear(bytes)` with each piece of
caller audio in the line's format, `dtmf(digit)` for each key press; it implements `send_chunk(samples)` to put
one paced chunk of the model's audio (float32 at the line's rate) on its wire. The model's frames go through a
`media.pacing.Pacer` at the line's rate (its `PHONE_LINE` rules): one chunk per chunk period of wall clock, silence
while the model's next frame is due, never a burst and never a gap, since the platforms play what they are sent as
it comes. Caller audio lands in the conversation's jitter buffer under the WebSocket input policy
(a backlog past the bound is refused with `input_backpressure`).

A start that fails (a bad voice, sampling out of range) is an `error` and close 1008; an engine failure is
`runtime_failed` and close 1011. Key presses are counted per route (`personaplex_dtmf_total`). The bridge sets
`caller` (the identity its vendor gives the call) before `begin`, and a `record` parameter is the call's wish to be
recorded: both go to the live-call list (app/calls/live.py), the recording and the webhooks. `cut_output` (the admin
API) drops the audio not sent yet and tells the vendor to drop what it buffered (`on_cut`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from app.calls.recording import asked_to_record
from app.sessions.audio import InputDecoder, b64decode
from app.sessions.conversation import Backpressure
from app.sessions.errors import ProtocolError
from app.sessions.session import Session
from app.sessions.session_config import SAMPLING_KEYS, ConfigUpdate, SessionConfig, default_config, with_update
from app.sessions.transport import CLOSE_INTERNAL, CLOSE_POLICY
from app.sessions.wire import WireError, parse_value
from media.codecs import AudioFormat
from media.pacing import PHONE_LINE, Pacer
from model.engine import EngineError, FrameOutput

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 128   # stream ids and mark names: echoed in every message, so kept short
MAX_DIGIT_CHARS = 8


class PhoneLine(Session):
    chunk_ms = 20        # the model's audio goes out in chunks this long, one per chunk period

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decoder: InputDecoder | None = None
        self.pacer: Pacer | None = None
        self.digits: list[str] = []
        self.caller: dict[str, Any] = {}     # the identity the vendor gives the call (set before `begin`)
        self.record: bool | None = None      # the call's own wish to be recorded (its `record` parameter)
        self.config: SessionConfig | None = None

    # ---- to implement ----------------------------------------------------------------------------------------

    def send_chunk(self, samples: np.ndarray) -> None:
        """One paced chunk of the model's audio (float32 at the line's rate) onto the wire."""
        raise NotImplementedError

    def on_mark(self, name: str) -> None:
        """Every sample written before `Pacer.mark(name)` has been sent."""

    def on_cut(self) -> None:
        """The audio not sent yet was dropped (`cut`): tell the vendor to drop what it has buffered too."""

    # ---- the call --------------------------------------------------------------------------------------------

    def call_config(self, params: dict[str, Any], prefix: str) -> SessionConfig:
        """The session's config from the vendor's string parameters (persona or instructions, voice, sampling);
        `prefix` names where they came from in errors."""
        up = ConfigUpdate()
        persona = params.get("persona", params.get("instructions"))
        up.persona = persona if isinstance(persona, str) else None
        if params.get("voice"):
            up.voice = params["voice"]
        up.sampling_fields = {k: _param_value(v) for k, v in params.items() if k in SAMPLING_KEYS}
        self.record = asked_to_record(params.get("record"))
        return with_update(self.ctx, default_config(self.ctx), up, prefix=prefix)

    async def begin(self, config: SessionConfig, line: AudioFormat) -> bool:
        """Take a slot and start the conversation; False when refused (the client was told, the line closed)."""
        slot = await self.reserve()
        if slot is None:
            return False
        self.config = config
        self.decoder = InputDecoder(line)
        self.pacer = Pacer(line.sample_rate, PHONE_LINE, chunk_ms=self.chunk_ms, on_mark=self.on_mark)
        conv = self.conversation = self.new_conversation(slot)   # in the live-call list from here
        conv.add_listener(self._on_frame, self._on_engine_error)
        conv.start(config.params()).add_done_callback(self._started)
        return True

    def hear(self, data: bytes, param: str) -> None:
        """Caller audio in the line's format."""
        if self.conversation is None or self.decoder is None:
            raise ProtocolError("session_not_created", "audio before the call started")
        samples = self.decoder.decode(data, param=param)
        if samples.size:
            try:
                self.conversation.push(None, samples)
            except Backpressure as e:
                raise ProtocolError("input_backpressure", str(e)) from None

    def dtmf(self, digit: object, param: str) -> None:
        if not isinstance(digit, str) or not 0 < len(digit) <= MAX_DIGIT_CHARS:
            raise ProtocolError("bad_event", "a key press needs its digit (a short string)", param=param)
        self.digits.append(digit)
        self.ctx.metrics.dtmf[self.route] += 1

    def _started(self, task: asyncio.Task[None]) -> None:
        e = self.start_failure(task)
        if e is None:
            return
        if isinstance(e, EngineError):
            self.send_error_nowait(ProtocolError(e.code if e.code in ("invalid_voice", "invalid_session_config")
                                                 else "runtime_failed", f"the call did not start: {e.message}"))
            self.spawn(self.close(CLOSE_POLICY if e.code.startswith("invalid") else CLOSE_INTERNAL, e.code))
        else:
            logger.error("%s: start failed", self.route, exc_info=e)
            self.spawn(self.close(CLOSE_INTERNAL, "internal_error"))

    # ---- output ----------------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if not self.closed and self.pacer is not None:
            self.pacer.start(self._send_chunk)   # the sends start with the first frame
            self.pacer.write(frame.audio)

    def cut_output(self) -> None:
        """Stop what the caller is about to hear: the model's audio not sent yet is dropped (paced and queued),
        and the vendor is told to drop what it buffered (`on_cut`)."""
        if self.closed or self.pacer is None:
            return
        self.pacer.clear()
        super().cut_output()
        self.on_cut()
        self.ctx.calls.note(self.live_call, {"event": "cut", **self.call_details()})

    def call_opening(self) -> dict[str, Any]:
        line = self.decoder.format if self.decoder is not None else None
        agent = {"persona": self.config.persona, "voice": self.config.voice} if self.config is not None else None
        return {"caller": self.caller, "record": self.record, "agent": agent,
                "codec": f"{line.encoding}/{line.sample_rate}" if line is not None else ""}

    def call_details(self) -> dict[str, Any]:
        return {**(self.pacer.sent() if self.pacer is not None else {}), "dtmf": "".join(self.digits)}

    def _send_chunk(self, samples: np.ndarray) -> None:
        if not self.closed:
            self.send_chunk(samples)

    def _on_engine_error(self, error: EngineError) -> None:
        if self.closed:
            return
        self.send_error_nowait(ProtocolError("runtime_failed", f"the engine failed this call: {error.message}"))
        self.spawn(self.close(CLOSE_INTERNAL, "runtime_failed"))

    async def on_disconnect(self) -> None:
        if self.pacer is not None:
            self.pacer.stop()
        await super().on_disconnect()


def media_streams_start(event: dict[str, Any], sid_key: str, params_key: str) -> tuple[str, dict[str, Any],
                                                                                      dict[str, Any]]:
    """(stream id, `start` object, parameters) of a Media-Streams-style `start` event (Twilio, Telnyx)."""
    start = event.get("start")
    if not isinstance(start, dict):
        raise ProtocolError("bad_event", "`start` needs a `start` object", param="start")
    sid = event.get(sid_key, start.get(sid_key))
    if not isinstance(sid, str) or not sid or len(sid) > MAX_NAME_CHARS:
        raise ProtocolError("bad_event", f"`start` needs a `{sid_key}` (at most {MAX_NAME_CHARS} characters)",
                            param=f"start.{sid_key}")
    params = start.get(params_key) or {}
    if not isinstance(params, dict):
        raise ProtocolError("bad_event", f"`{params_key}` must be an object", param=f"start.{params_key}")
    return sid, start, params


def inbound_payload(event: dict[str, Any]) -> bytes | None:
    """The caller's audio in a Media-Streams-style `media` event (Twilio, Telnyx); None for another track."""
    media = event.get("media")
    if not isinstance(media, dict):
        raise ProtocolError("bad_event", "`media` needs a `media` object", param="media")
    if media.get("track", "inbound") not in ("inbound", "inbound_track"):
        return None
    return b64decode(media.get("payload"), param="media.payload")


def _param_value(value: object) -> object:
    """Vendor parameters arrive as strings: "0.7" -> 0.7, "true" -> True, "42" -> 42."""
    if isinstance(value, str):
        try:
            return parse_value(value)
        except WireError:
            return value
    return value
