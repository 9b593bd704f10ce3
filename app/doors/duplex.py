"""`WS /v1/duplex`: the native dialect, lean for SDKs and bridges (documented in docs/protocol.md).

`session.create` (persona, voice, sampling, pacing, input/output format, output transport) reserves a slot, runs the
prompt prefill and answers `session.created` once the conversation is live. Audio in: binary frames of raw samples
in the input format (any length, whole samples), or `input_audio_buffer.append` with base64. Audio out: one binary
frame per 80 ms model frame, or `response.output_audio.delta {frame, audio}` when the session asked for JSON; the
model's text arrives as `response.output_text.delta {frame, delta}`, `frame` being the frame index it belongs to.
`conversation.restart` starts a fresh model context (frame indices restart at 0); `session.close` answers
`session.closed` with the session's counters.

`session.create {link_report_s}` (0.5-60 s; off by default) asks for `session.link` every that many seconds: what the
server measures of the link from the client (the input buffer's arrival jitter, target, depth, the latency it added
over the period, underruns, concealment, drops) and `playout_ms`, the playout buffer the client's own player needs
to play the model's audio without gaps over this link (`media.playout.advised_playout_ms`).
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from app.doors.realtime.dialect import capabilities
from app.sessions.audio import InputDecoder, OutputEncoder, b64decode, b64encode
from app.sessions.conversation import Backpressure
from app.sessions.errors import ProtocolError
from app.sessions.link import closed_stats, link_report_s, report_link
from app.sessions.session import Session
from app.sessions.session_config import (
    SAMPLING_KEYS,
    ConfigUpdate,
    SessionConfig,
    default_config,
    format_from,
    with_update,
)
from app.sessions.transport import CLOSE_INTERNAL, CLOSE_NORMAL
from app.sessions.websocket import serve
from app.shell.context import CONTEXT, ServerContext
from media.codecs import AudioFormat
from model.engine import EngineError, FrameOutput, InvalidSessionParams

OUTPUT_TRANSPORTS = ("binary", "json")


def format_object(fmt: AudioFormat) -> dict[str, Any]:
    return {"format": fmt.encoding, "rate": fmt.sample_rate,
            "frame_bytes": fmt.bytes_per_sample * fmt.sample_rate * 80 // 1000}


class DuplexSession(Session):
    route = "/v1/duplex"

    def __init__(self, ctx: ServerContext) -> None:
        super().__init__(ctx)
        self.session_id = f"duplex_{uuid.uuid4().hex[:24]}"
        self.config: SessionConfig | None = None
        self.output_transport = "binary"
        self.decoder: InputDecoder | None = None
        self.encoder: OutputEncoder | None = None
        self.frames_sent = 0
        self.link_report_s = 0.0
        self._early: list[FrameOutput] | None = None

    def closed_event(self, reason: str) -> dict[str, Any] | None:
        if self.config is None:
            return None
        return {"type": "session.closed", "session_id": self.session_id, "reason": reason,
                "stats": closed_stats(self.conversation, self.frames_sent)}

    # ---- events ----------------------------------------------------------------------------------------------

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.create":
            await self.on_create(event)
            return
        if kind in ("session.close", "close"):
            reason = event.get("reason") if isinstance(event.get("reason"), str) else "client_close"
            await self.close(CLOSE_NORMAL, reason)
            return
        if kind == "session.heartbeat":
            await self.send({"type": "session.heartbeat_ack", "session_id": self.session_id})
            return
        if kind not in _NEEDS_SESSION:
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}", param="type")
        if self.conversation is None or self.config is None:
            raise ProtocolError("session_not_created", f"{kind} needs a session: send session.create first")
        if kind == "input_audio_buffer.append":
            self._push(b64decode(event.get("audio")))
        elif kind == "input_audio_buffer.clear":
            assert self.decoder is not None
            self.conversation.clear_input()
            self.decoder.reset()
            await self.send({"type": "input_audio_buffer.cleared"})
        elif kind == "conversation.restart":
            self._early = []  # the new context's first frame comes with the restart: hold it until we say so
            try:
                await self.conversation.restart()
            finally:
                early, self._early = self._early, None
            self.encoder = OutputEncoder(self.config.output_format)
            await self.send({"type": "conversation.restarted", "epoch": self.conversation.epoch})
            for frame in early:
                self._on_frame(frame)

    async def on_binary(self, data: bytes) -> None:
        if self.conversation is None or self.config is None:
            raise ProtocolError("session_not_created", "audio before session.create")
        self._push(data)

    def _push(self, data: bytes) -> None:
        assert self.conversation is not None and self.decoder is not None
        samples = self.decoder.decode(data)
        if samples.size:
            try:
                self.conversation.push(None, samples)
            except Backpressure as e:
                raise ProtocolError("input_backpressure", str(e)) from None

    async def on_create(self, event: dict[str, Any]) -> None:
        if self.conversation is not None:
            raise ProtocolError("session_already_created", "this socket already has a session")
        s = event.get("session", {})
        if not isinstance(s, dict):
            raise ProtocolError("bad_event", "`session` must be an object", param="session")
        config = self._parse(s)
        transport = s.get("output_transport", "binary")
        if transport not in OUTPUT_TRANSPORTS:
            raise ProtocolError("invalid_session_config", f"`output_transport` must be one of {OUTPUT_TRANSPORTS}",
                                param="session.output_transport")
        link_s = link_report_s(s.get("link_report_s"), "session.link_report_s")
        slot = await self.reserve()
        if slot is None:
            return
        conv = self.new_conversation(slot)
        self.decoder = InputDecoder(config.input_format)
        self.encoder = OutputEncoder(config.output_format)
        self.output_transport = transport
        conv.add_listener(self._on_frame, self._on_engine_error)
        self.conversation = conv   # a disconnect during the prefill frees the slot
        self._early = []           # frames the engine made before session.created went out (the first)
        try:
            await conv.start(config.params())
        except InvalidSessionParams as e:
            conv.close()
            self.conversation = None
            raise ProtocolError(e.code, e.message) from None
        except EngineError as e:
            conv.close()
            await self.send_error(ProtocolError("runtime_failed", f"the conversation did not start: {e.message}"))
            await self.close(CLOSE_INTERNAL, "runtime_failed", send_closed=False)
            return
        self.config = config
        self.link_report_s = float(link_s)
        assert self.ctx.engine is not None
        await self.send({"type": "session.created", "session": {
            "id": self.session_id, "model": self.ctx.model_id, "voice": config.voice_name,
            "persona": config.persona, "sampling": config.sampling_dict(), "pacing": config.pacing,
            "input": format_object(config.input_format),
            "output": format_object(config.output_format) | {"transport": transport},
            "frame_ms": 80, "idle_timeout_s": self.idle_timeout_s, "link_report_s": self.link_report_s,
            "capabilities": capabilities(self.ctx.engine.max_sessions)}})
        early, self._early = self._early, None
        for frame in early or ():
            self._on_frame(frame)
        if self.link_report_s:
            self.spawn(report_link(self, self.session_id, lambda: self.link_report_s))

    def _parse(self, s: dict[str, Any]) -> SessionConfig:
        up = ConfigUpdate()
        persona = s.get("persona", s.get("instructions"))
        up.persona = persona if persona is not None else None
        if "voice" in s:
            up.voice = s["voice"]
        sampling = s.get("sampling", {})
        if not isinstance(sampling, dict):
            raise ProtocolError("invalid_session_config", "`sampling` must be an object", param="session.sampling")
        up.sampling_fields = {k: v for src in (s, sampling) for k, v in src.items()
                              if k in SAMPLING_KEYS or k == "temperature"}
        up.pacing = s.get("pacing")
        for key in ("input", "output"):
            value = s.get(key)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ProtocolError("unsupported_audio_format", f"`{key}` must be {{\"format\", \"rate\"}}",
                                    param=f"session.{key}")
            fmt = format_from(value.get("format"), value.get("rate"), f"session.{key}")
            setattr(up, f"{key}_format", fmt)
        return with_update(self.ctx, default_config(self.ctx), up)

    # ---- output ----------------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed or self.encoder is None:
            return
        if self._early is not None:
            self._early.append(frame)
            return
        audio = self.encoder.encode(frame.audio)
        if self.output_transport == "binary":
            self.send_audio_nowait(audio)
        else:
            self.send_audio_nowait({"type": "response.output_audio.delta", "frame": frame.index,
                                    "audio": b64encode(audio)})
        self.frames_sent += 1
        if frame.text:
            self.send_nowait({"type": "response.output_text.delta", "frame": frame.index, "delta": frame.text})

    def _on_engine_error(self, error: EngineError) -> None:
        if self.closed:
            return
        code = "engine_stopped" if error.code == "engine_stopped" else "runtime_failed"
        self.send_error_nowait(ProtocolError(code, f"the engine failed this conversation: {error.message}"))
        self.spawn(self.close(CLOSE_INTERNAL, code))


_NEEDS_SESSION = ("input_audio_buffer.append", "input_audio_buffer.clear", "conversation.restart")


async def duplex_handler(request: web.Request) -> web.StreamResponse:
    return await serve(request, DuplexSession(request.app[CONTEXT]))
