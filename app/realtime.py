"""`WS /v1/realtime?duplex=1`: the OpenAI Realtime vocabulary over one model-native duplex conversation.

Admission happens at connect (`session.created`, or `error resource_exhausted` and close 1013). `session.update`
sets persona, voice, sampling, pacing and the wire formats (GA and beta spellings); the first
`input_audio_buffer.append` starts the conversation (prompt prefill, then one frame per 80 ms). The model's first
frame opens the one response of the conversation: `response.created` → `conversation.item.added` →
`response.output_item.added` → `response.content_part.added`, then per frame `response.output_audio.delta` and,
when the frame has text, `response.output_audio_transcript.delta`. `response.cancel` ends the response
(`status: cancelled`) and restarts the model context; the next frame opens a new response. GA names are sent unless
the client asked for beta (`OpenAI-Beta: realtime=v1` or the `openai-beta.realtime-v1` subprotocol).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from app.audio import InputDecoder, OutputEncoder, b64decode, b64encode
from app.auth import BETA_SUBPROTOCOL, offered_subprotocols
from app.context import CONTEXT, ServerContext
from app.conversation import Backpressure, Conversation, State
from app.errors import MAX_ECHO_CHARS, ProtocolError
from app.session import Session
from app.session_config import (
    SAMPLING_KEYS,
    ConfigUpdate,
    SessionConfig,
    check_extra_body,
    default_config,
    format_from,
    with_update,
)
from app.transport import CLOSE_INTERNAL, CLOSE_NORMAL
from app.websocket import serve
from media.codecs import AudioFormat
from model.engine import EngineError, FrameOutput, InvalidSessionParams

logger = logging.getLogger(__name__)

GA_NAMES = {
    "audio_delta": "response.output_audio.delta",
    "audio_done": "response.output_audio.done",
    "transcript_delta": "response.output_audio_transcript.delta",
    "transcript_done": "response.output_audio_transcript.done",
    "item_added": "conversation.item.added",
    "item_done": "conversation.item.done",
    "content_type": "output_audio",
}
BETA_NAMES = {
    "audio_delta": "response.audio.delta",
    "audio_done": "response.audio.done",
    "transcript_delta": "response.audio_transcript.delta",
    "transcript_done": "response.audio_transcript.done",
    "item_added": "conversation.item.created",
    "item_done": None,
    "content_type": "audio",
}
_GA_TYPES = {"pcm16": "audio/pcm", "f32": "audio/pcm_f32le", "pcmu": "audio/pcmu", "pcma": "audio/pcma"}
_BETA_TYPES = {"pcm16": "pcm16", "f32": "pcm_f32le", "pcmu": "g711_ulaw", "pcma": "g711_alaw"}
_FALSE = ("0", "false", "no", "off")


def capabilities(max_sessions: int) -> dict[str, Any]:
    """spec/protocol.md §6: what a model-native duplex session can and cannot do."""
    true = ("supports_model_native_turn_policy", "supports_playback_ack", "supports_input_append",
            "supports_session_lease", "supports_realtime_endpoint", "supports_model_internal_state",
            "supports_independent_io_streams", "supports_session_adapter")
    false = ("supports_external_turn_signal", "supports_client_commit", "supports_barge_in",
             "supports_replace_latest_chunk", "supports_reencode_context", "supports_rollback_to_checkpoint",
             "supports_turn_commit_only", "supports_session_resume", "supports_audio_truncate",
             "supports_kv_lease", "supports_image_input", "supports_text_only_turn")
    caps: dict[str, Any] = {k: True for k in true} | {k: False for k in false}
    caps |= {
        "implementation_level": "model_native_duplex",
        "supports_multi_session": max_sessions > 1,
        "supports_multi_session_same_replica": max_sessions > 1,
        "session_admission_mode": "engine_managed",
        "chunk_period_ms": 80,
        "target_barge_in_latency_ms": None,
        "input_modes": ["append_audio_chunk"],
        "required_input_modalities": ["audio"],
        "max_sessions": max_sessions,
        "input_formats": sorted(_BETA_TYPES.values()),
        "output_formats": sorted(_BETA_TYPES.values()),
        "sample_rates_hz": [8000, 48000],
        "pacings": ["realtime", "input"],
    }
    return caps


def ga_format(fmt: AudioFormat) -> dict[str, Any]:
    return {"type": _GA_TYPES[fmt.encoding], "rate": fmt.sample_rate}


@dataclass
class Response:
    id: str
    item_id: str
    transcript: list[str] = field(default_factory=list)


def is_beta(request: web.Request) -> bool:
    header = request.headers.get("OpenAI-Beta", "").replace(" ", "").lower()
    return "realtime=v1" in header or BETA_SUBPROTOCOL in offered_subprotocols(request)


class RealtimeSession(Session):
    """The Realtime dialect; `beta` picks the beta event names."""

    route = "/v1/realtime"

    def __init__(self, ctx: ServerContext, beta: bool) -> None:
        super().__init__(ctx)
        self.beta = beta
        self.names = BETA_NAMES if self.beta else GA_NAMES
        self.session_id = f"sess_{uuid.uuid4().hex[:24]}"
        self.config: SessionConfig = SessionConfig()
        self.decoder: InputDecoder | None = None
        self.encoder: OutputEncoder | None = None
        self.response: Response | None = None
        self._start_task: asyncio.Task[None] | None = None

    # ---- open ------------------------------------------------------------------------------------------------

    async def on_open(self) -> None:
        slot = await self.reserve()
        if slot is not None:
            await self.greet(self.new_conversation(slot))

    async def greet(self, conversation: Conversation) -> None:
        """Take `conversation` (admitted, not started) and say `session.created`."""
        self.conversation = conversation
        conversation.add_listener(self._on_frame, self._on_engine_error)
        self.config = default_config(self.ctx)
        self.decoder = InputDecoder(self.config.input_format)
        self.encoder = OutputEncoder(self.config.output_format)
        await self.send({"type": "session.created", "session": self.session_object()})

    def session_object(self) -> dict[str, Any]:
        c = self.config
        assert self.conversation is not None and self.ctx.engine is not None
        return {
            "object": "realtime.session",
            "id": self.session_id,
            "type": "realtime",
            "model": self.ctx.model_id,
            "state": "open",
            "output_modalities": ["audio"],
            "modalities": ["audio", "text"],
            "instructions": c.persona,
            "voice": c.voice_name,
            "audio": {
                "input": {"format": ga_format(c.input_format), "turn_detection": None},
                "output": {"format": ga_format(c.output_format), "voice": c.voice_name},
            },
            "input_audio_format": _BETA_TYPES[c.input_format.encoding],
            "input_sample_rate_hz": c.input_format.sample_rate,
            "output_audio_format": _BETA_TYPES[c.output_format.encoding],
            "output_sample_rate_hz": c.output_format.sample_rate,
            "turn_detection": None,
            "temperature": c.sampling.temp_audio,
            "sampling": c.sampling_dict(),
            "pacing": c.pacing,
            "idle_timeout_s": self.idle_timeout_s,
            "conversation_state": self.conversation.state.value,
            "capabilities": capabilities(self.ctx.engine.max_sessions),
        }

    def closed_event(self, reason: str) -> dict[str, Any]:
        counters = self.conversation.counters() if self.conversation is not None else {}
        return {"type": "session.closed", "session_id": self.session_id, "reason": reason, "stats": counters}

    # ---- client events ---------------------------------------------------------------------------------------

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        handler = _HANDLERS.get(kind)
        if handler is not None:
            await handler(self, event)
        elif kind in _UNSUPPORTED:
            raise ProtocolError(_UNSUPPORTED[kind][0], f"{kind}: {_UNSUPPORTED[kind][1]}", param="type")
        else:
            raise ProtocolError("unknown_event", f"unknown event type {kind!r}", param="type")

    async def on_session_update(self, event: dict[str, Any]) -> None:
        s = event.get("session")
        if not isinstance(s, dict):
            raise ProtocolError("bad_event", "`session.update` needs a `session` object", param="session")
        assert self.conversation is not None and self.decoder is not None and self.encoder is not None
        if s.get("type") not in (None, "realtime"):
            raise ProtocolError("invalid_session_config", "only `realtime` sessions are served", param="session.type")
        modalities = s.get("output_modalities", s.get("modalities"))
        if modalities is not None and (not isinstance(modalities, list) or "audio" not in modalities):
            raise ProtocolError("invalid_session_config", "this model always speaks: modalities must include "
                                "\"audio\"", param="session.output_modalities")
        extra = check_extra_body(s.get("extra_body"))
        up = ConfigUpdate()
        up.persona = s.get("instructions")
        audio = s.get("audio") if isinstance(s.get("audio"), dict) else {}
        audio_in = audio.get("input") if isinstance(audio.get("input"), dict) else {}
        audio_out = audio.get("output") if isinstance(audio.get("output"), dict) else {}
        if "voice" in audio_out:
            up.voice = audio_out["voice"]
        elif "voice" in s:
            up.voice = s["voice"]
        up.sampling_fields = {k: v for src in (s, extra) for k, v in src.items()
                              if k in SAMPLING_KEYS or k == "temperature"}
        up.pacing = extra.get("pacing", s.get("pacing"))
        if "format" in audio_in:
            up.input_format = format_from(audio_in["format"], None, "session.audio.input.format")
        elif "input_audio_format" in s:
            up.input_format = format_from(s["input_audio_format"], s.get("input_sample_rate_hz"),
                                          "session.input_audio_format")
        if "format" in audio_out:
            up.output_format = format_from(audio_out["format"], None, "session.audio.output.format")
        elif "output_audio_format" in s:
            up.output_format = format_from(s["output_audio_format"], s.get("output_sample_rate_hz"),
                                           "session.output_audio_format")
        idle = s.get("idle_timeout_s")
        if idle is not None and (isinstance(idle, bool) or not isinstance(idle, (int, float))
                                 or not 1 <= idle <= 86400):
            raise ProtocolError("invalid_session_config", "`idle_timeout_s` must be a number of seconds (1–86400)",
                                param="session.idle_timeout_s")
        turn = audio_in.get("turn_detection", s.get("turn_detection"))
        self.config = with_update(self.ctx, self.config, up, started=self.conversation.started)
        self.decoder.set_format(self.config.input_format)
        if self.config.output_format != self.encoder.format:
            self.encoder = OutputEncoder(self.config.output_format)
        if idle is not None:
            self.idle_timeout_s = float(idle)
        await self.send({"type": "session.updated", "session": self.session_object()})
        if turn is not None:
            # The rest of the update stands: OpenAI clients send server VAD by habit; turns here are model-native.
            raise ProtocolError("unsupported_turn_detection", "turn_detection must be null: the model takes turns "
                                "by itself (the rest of this update was applied)", param="session.turn_detection")

    async def on_append(self, event: dict[str, Any]) -> None:
        conv, decoder = self.conversation, self.decoder
        assert conv is not None and decoder is not None
        if "audio" not in event:
            raise ProtocolError("bad_event", "`input_audio_buffer.append` needs `audio` (base64)", param="audio")
        data = b64decode(event["audio"])
        if "format" in event or "sample_rate_hz" in event:
            fmt = format_from(event.get("format", _BETA_TYPES[decoder.format.encoding]), event.get("sample_rate_hz"),
                              "format")
            decoder.set_format(fmt)
        samples = decoder.decode(data)
        if conv.state is State.IDLE:
            self._start()
        if samples.size:
            try:
                conv.push(None, samples)
            except Backpressure as e:
                raise ProtocolError("input_backpressure", str(e)) from None

    def _start(self) -> None:
        assert self.conversation is not None
        self._start_task = self.conversation.start(self.config.params())
        self._start_task.add_done_callback(self._started)

    def _started(self, task: asyncio.Task[None]) -> None:
        e = self.start_failure(task)
        if e is None:
            return
        if isinstance(e, InvalidSessionParams):
            self.send_error_nowait(ProtocolError(e.code, f"the conversation did not start: {e.message}"))
        elif isinstance(e, EngineError):
            self._on_engine_error(e)
        else:
            logger.error("realtime %s: start failed", self.session_id, exc_info=e)
            self.send_error_nowait(ProtocolError("internal_error", f"the conversation did not start: {e}"))

    async def on_cancel(self, event: dict[str, Any]) -> None:
        conv = self.conversation
        assert conv is not None
        rid = event.get("response_id")
        if not conv.started:
            raise ProtocolError("response_not_active", "no conversation yet: nothing to cancel", param="response_id")
        if rid is not None and (self.response is None or rid != self.response.id):
            raise ProtocolError("response_not_active", f"response {rid!r} is not the open response",
                                param="response_id")
        self._end_response("cancelled", {"type": "cancelled", "reason": "client_cancelled"})
        if event["type"] == "output_audio_buffer.clear":
            await self.send({"type": "output_audio_buffer.cleared", "response_id": rid})
        if conv.state is State.STARTING and self._start_task is not None:
            await asyncio.wait([self._start_task])
        if conv.state is State.LIVE:
            await conv.restart()
            self.encoder = OutputEncoder(self.config.output_format)

    async def on_input_clear(self, event: dict[str, Any]) -> None:
        assert self.conversation is not None and self.decoder is not None
        self.conversation.clear_input()
        self.decoder.reset()
        await self.send({"type": "input_audio_buffer.cleared"})

    async def on_commit(self, event: dict[str, Any]) -> None:
        conv = self.conversation
        assert conv is not None
        if conv.input is not None:
            # Flush the partial frame as the reference does: pad it with silence to a whole 80 ms frame.
            depth = round(conv.input.stats().depth_ms * 24)
            if depth % 1920:
                try:
                    conv.push(None, np.zeros(1920 - depth % 1920, np.float32))
                except Backpressure as e:
                    raise ProtocolError("input_backpressure", str(e)) from None
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": None,
                         "item_id": f"item_{uuid.uuid4().hex[:20]}"})

    async def on_response_create(self, event: dict[str, Any]) -> None:
        assert self.conversation is not None
        if not self.conversation.started:
            raise ProtocolError("response_create_without_input",
                                "the model answers by itself once audio flows: send input_audio_buffer.append")
        raise ProtocolError("conversation_already_has_active_response",
                            "the conversation's response is already open; the model decides when to speak")

    async def on_item_create(self, event: dict[str, Any]) -> None:
        raise ProtocolError("native_text_append_unsupported",
                            "conversation items cannot be added: the model only listens to the audio stream",
                            param="item")

    async def on_heartbeat(self, event: dict[str, Any]) -> None:
        await self.send({"type": "session.heartbeat_ack", "session_id": self.session_id})

    async def on_playback_ack(self, event: dict[str, Any]) -> None:
        played = event.get("played_ms")
        if isinstance(played, bool) or not isinstance(played, (int, float)) or played < 0:
            raise ProtocolError("bad_event", "`playback.ack` needs `played_ms` (a non-negative number)",
                                param="played_ms")
        committed = event.get("committed_ms")
        if committed is not None and (isinstance(committed, bool) or not isinstance(committed, (int, float))):
            raise ProtocolError("bad_event", "`committed_ms` must be a number", param="committed_ms")
        for key in ("response_id", "item_id"):
            value = event.get(key)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_ECHO_CHARS):
                raise ProtocolError("bad_event", f"`{key}` must be a string of at most {MAX_ECHO_CHARS} characters",
                                    param=key)
        keys = ("played_ms", "committed_ms", "response_id", "item_id")
        await self.send({"type": "playback.acknowledged", "event": {k: event[k] for k in keys if k in event}})

    async def on_close(self, event: dict[str, Any]) -> None:
        reason = event.get("reason") if isinstance(event.get("reason"), str) else "client_close"
        await self.close(CLOSE_NORMAL, reason)

    # ---- engine output ---------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed:
            return
        if self.response is None:
            self._open_response()
        assert self.response is not None and self.encoder is not None
        r = self.response
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        if self.sends_audio:
            self.send_audio_nowait({"type": self.names["audio_delta"], **ids,
                                    "delta": b64encode(self.encoder.encode(frame.audio))})
        if frame.text:
            r.transcript.append(frame.text)
            self.send_nowait({"type": self.names["transcript_delta"], **ids, "delta": frame.text})

    def _item(self, r: Response, status: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": self.names["content_type"], "transcript": "".join(r.transcript)}
        return {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [part] if status != "in_progress" else []}

    def _response_object(self, r: Response, status: str, details: dict[str, Any] | None) -> dict[str, Any]:
        return {"object": "realtime.response", "id": r.id, "status": status, "status_details": details,
                "output": [self._item(r, status)] if status != "in_progress" else [],
                "output_modalities": ["audio"], "modalities": ["audio", "text"],
                "conversation_id": self.session_id, "usage": None, "metadata": None}

    def _open_response(self) -> None:
        rid = f"resp_{uuid.uuid4().hex[:20]}"
        r = self.response = Response(id=rid, item_id=f"item_{rid[5:]}")
        self.send_nowait({"type": "response.created", "response_id": rid,
                          "response": self._response_object(r, "in_progress", None)})
        self.send_nowait({"type": self.names["item_added"], "previous_item_id": None,
                          "item": self._item(r, "in_progress")})
        self.send_nowait({"type": "response.output_item.added", "response_id": rid, "output_index": 0,
                          "item": self._item(r, "in_progress")})
        self.send_nowait({"type": "response.content_part.added", "response_id": rid, "item_id": r.item_id,
                          "output_index": 0, "content_index": 0,
                          "part": {"type": "audio", "transcript": ""}})

    def _end_response(self, status: str, details: dict[str, Any] | None) -> None:
        r = self.response
        if r is None:
            return
        self.response = None
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        transcript = "".join(r.transcript)
        self.send_nowait({"type": self.names["audio_done"], **ids})
        self.send_nowait({"type": self.names["transcript_done"], **ids, "transcript": transcript})
        self.send_nowait({"type": "response.content_part.done", **ids,
                          "part": {"type": "audio", "transcript": transcript}})
        self.send_nowait({"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
                          "item": self._item(r, "completed" if status == "completed" else "incomplete")})
        if self.names["item_done"]:
            self.send_nowait({"type": self.names["item_done"], "previous_item_id": None,
                              "item": self._item(r, "incomplete")})
        self.send_nowait({"type": "response.done", "response": self._response_object(r, status, details)})
        self.send_nowait({"type": "rate_limits.updated", "rate_limits": []})

    def _on_engine_error(self, error: EngineError) -> None:
        if self.closed:
            return
        self._end_response("failed", {"type": "failed", "error": {"code": error.code, "message": error.message}})
        code = "engine_stopped" if error.code == "engine_stopped" else "runtime_failed"
        self.send_error_nowait(ProtocolError(code, f"the engine failed this conversation: {error.message}"))
        self.spawn(self.close(CLOSE_INTERNAL, code))


_HANDLERS = {
    "session.update": RealtimeSession.on_session_update,
    "input_audio_buffer.append": RealtimeSession.on_append,
    "input_audio_buffer.clear": RealtimeSession.on_input_clear,
    "input.cancel": RealtimeSession.on_input_clear,
    "input_audio_buffer.commit": RealtimeSession.on_commit,
    "input.commit": RealtimeSession.on_commit,
    "response.cancel": RealtimeSession.on_cancel,
    "output_audio_buffer.clear": RealtimeSession.on_cancel,
    "response.create": RealtimeSession.on_response_create,
    "conversation.item.create": RealtimeSession.on_item_create,
    "input.text.append": RealtimeSession.on_item_create,
    "input_text.append": RealtimeSession.on_item_create,
    "push_text": RealtimeSession.on_item_create,
    "session.heartbeat": RealtimeSession.on_heartbeat,
    "playback.ack": RealtimeSession.on_playback_ack,
    "audio.playback_ack": RealtimeSession.on_playback_ack,
    "session.close": RealtimeSession.on_close,
    "close": RealtimeSession.on_close,
    "close_session": RealtimeSession.on_close,
}
_UNSUPPORTED = {
    "session.resume": ("unsupported_session_resume", "sessions cannot be resumed; open a new one"),
    "conversation.item.retrieve": ("unsupported_event", "the conversation keeps no retrievable items"),
    "conversation.item.truncate": ("unsupported_event", "audio cannot be truncated (supports_audio_truncate=false)"),
    "conversation.item.delete": ("unsupported_event", "the conversation keeps no deletable items"),
    "barge_in": ("unsupported_event", "the model handles interruptions itself (supports_barge_in=false)"),
    "turn.signal": ("unsupported_event", "no external turn signals (supports_external_turn_signal=false)"),
    "transcription_session.update": ("unsupported_event", "transcription sessions are not served"),
}


async def realtime_handler(request: web.Request) -> web.StreamResponse:
    if request.query.get("duplex", "1").lower() in _FALSE:
        return web.json_response({"error": {"type": "invalid_request_error", "code": "unsupported_event",
                                            "message": "Realtime API is not available: this server serves "
                                                       "duplex sessions only (?duplex=1)"}}, status=400)
    return await serve(request, RealtimeSession(request.app[CONTEXT], is_beta(request)))
