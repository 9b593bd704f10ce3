"""`WS /v1/realtime?duplex=1`: the OpenAI Realtime vocabulary over one model-native duplex conversation.

Admission happens at connect (`session.created`, or `error resource_exhausted` and close 1013). `session.update` sets
persona, voice, sampling, pacing and the wire formats (GA and beta spellings, `app.doors.realtime.update`); the first
`input_audio_buffer.append` or `response.create` starts the conversation (prompt prefill, then one frame per 80 ms).

A full-duplex model has no turns, so each turn-based request gets the meaning it can have (docs/protocol.md §2):
the model's frames are the audio of one open response at a time; `response.create` ends the open one and opens
another carrying the request's metadata (before any audio it starts the conversation); `response.cancel` and
`output_audio_buffer.clear` cut what the caller hears (queued audio withdrawn) and keep the model's context, muting
the model until it has finished what it was saying (a fresh context instead is the session option
`restart_on_cancel`); instructions changed mid-call and text items a client adds are prefilled into the live context
at the next frame boundary; item events are bookkeeping (`app.doors.realtime.items`). Every event sent validates against
the openai SDK's types (GA, or beta when the client asked for beta names: `OpenAI-Beta: realtime=v1` or the
`openai-beta.realtime-v1` subprotocol); the extensions `session.closed`, `session.heartbeat_ack` and
`playback.acknowledged` are documented, and the last two answer only our own events.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import numpy as np
from aiohttp import web

from app.doors.realtime.items import ConversationItems, Response, new_id
from app.doors.realtime.update import Ignored, SessionUpdate, read_update
from app.sessions.audio import InputDecoder, OutputEncoder, b64decode, b64encode
from app.sessions.conversation import Backpressure, Conversation, State
from app.sessions.errors import MAX_ECHO_CHARS, ProtocolError
from app.sessions.link import closed_stats, report_link
from app.sessions.session import OUTPUT_TAG, Session
from app.sessions.session_config import SessionConfig, default_config, format_from, with_update
from app.sessions.transport import CLOSE_INTERNAL, CLOSE_NORMAL
from app.sessions.websocket import serve
from app.shell.auth import BETA_SUBPROTOCOL, CLIENT_SECRET, offered_subprotocols
from app.shell.context import CONTEXT, ServerContext
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
_BETA_NAMES_OF_SDK = ("pcm16", "g711_ulaw", "g711_alaw")   # the beta types' only audio formats
_FALSE = ("0", "false", "no", "off")
# After a cut, the model's utterance is over once this many frames (320 ms) pass without a text piece; the next
# frame with one opens the next response. Shorter pauses happen between the words of one sentence.
QUIET_FRAMES = 4
# A model that talks on through a cut without such a pause is heard again after this many frames (960 ms): the cut
# stops what was playing at once, it does not silence the call (an agent framework whose own VAD interrupts asks
# for no new response; it waits for the model's next one).
MAX_MUTED_FRAMES = 12
_TEXT_PARTS = ("input_text", "text", "output_text")


def capabilities(max_sessions: int) -> dict[str, Any]:
    """spec/protocol.md §6: what a model-native duplex session can and cannot do."""
    true = ("supports_model_native_turn_policy", "supports_playback_ack", "supports_input_append",
            "supports_session_lease", "supports_realtime_endpoint", "supports_model_internal_state",
            "supports_independent_io_streams", "supports_session_adapter", "supports_audio_truncate")
    false = ("supports_external_turn_signal", "supports_client_commit", "supports_barge_in",
             "supports_replace_latest_chunk",
             "supports_reencode_context", "supports_rollback_to_checkpoint", "supports_turn_commit_only",
             "supports_session_resume", "supports_kv_lease", "supports_image_input", "supports_text_only_turn")
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


def is_beta(request: web.Request) -> bool:
    header = request.headers.get("OpenAI-Beta", "").replace(" ", "").lower()
    return "realtime=v1" in header or BETA_SUBPROTOCOL in offered_subprotocols(request)


def _metadata(value: object) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs (keys up to 64 characters, values up to 512)."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        raise ProtocolError("bad_event", "`metadata` must be at most 16 string pairs (keys up to 64 characters, "
                            "values up to 512)", param="response.metadata")
    return dict(value)


def _texts(item: dict[str, Any]) -> list[str]:
    content = item.get("content") if isinstance(item.get("content"), list) else []
    return [p["text"] for p in content
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS and isinstance(p.get("text"), str)]


class RealtimeSession(Session):
    """The Realtime dialect; `beta` picks the beta event names."""

    route = "/v1/realtime"

    def __init__(self, ctx: ServerContext, beta: bool, session_id: str | None = None,
                 bound: dict[str, Any] | None = None) -> None:
        """`session_id` and `bound`: a client secret's (app/doors/realtime/client_secrets.py): the id its mint answered
        and the session config it carries, applied before `session.created`."""
        super().__init__(ctx)
        self.beta = beta
        self.names = BETA_NAMES if self.beta else GA_NAMES
        self.session_id = session_id or new_id("sess")
        self.bound = bound
        self.config: SessionConfig = SessionConfig()
        self.decoder: InputDecoder | None = None
        self.encoder: OutputEncoder | None = None
        self.items = ConversationItems()
        self.response: Response | None = None       # the open response
        self.last_response_id: str | None = None
        self.restart_on_cancel = False
        self.stats_interval_s = 0.0                  # `session.stats` (WebRTC calls) every this many seconds; 0: none
        self.link_report_s = 0.0                     # `session.link` every this many seconds; 0: none
        self._link_task: asyncio.Task[None] | None = None
        self.frames_sent = 0                         # audio frames handed to the client
        self.record: bool | None = None              # the session's wish to be recorded, stated before audio flows
        self.turn_detection: dict[str, Any] | None = None
        self._muted = False                          # cut: frames are not sent until the model's next utterance
        self._quiet = 0                              # frames without text since the cut
        self._muted_frames = 0                       # frames withheld since the cut
        self._next_metadata: dict[str, str] | None = None   # for the response the next frame opens
        self._prompt_notes: list[str] = []           # folded into the start's prompt
        self._pending_prompts: list[str] = []        # to prefill into the live context
        self._pending_persona: str | None = None
        self._prompt_task: asyncio.Task[None] | None = None
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
        refused: ProtocolError | None = None
        if self.bound is not None:
            try:   # checked at the mint: only a server changed since (a voice file gone) refuses it now
                self.apply_update(read_update(self.bound))
            except ProtocolError as e:
                refused = e
        await self.send({"type": "session.created", "session": self.session_object()})
        if refused is not None:
            await self.send_error(refused)

    def session_object(self) -> dict[str, Any]:
        """The session as GA clients read it, with the beta spellings beside; where the beta type allows only
        OpenAI's own values (its model names, three audio formats) those fields are left out for beta clients."""
        c = self.config
        assert self.conversation is not None and self.ctx.engine is not None
        session: dict[str, Any] = {
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
                "input": {"format": ga_format(c.input_format), "turn_detection": self.turn_detection},
                "output": {"format": ga_format(c.output_format), "voice": c.voice_name},
            },
            "input_audio_format": _BETA_TYPES[c.input_format.encoding],
            "input_sample_rate_hz": c.input_format.sample_rate,
            "output_audio_format": _BETA_TYPES[c.output_format.encoding],
            "output_sample_rate_hz": c.output_format.sample_rate,
            "turn_detection": self.turn_detection,
            "temperature": c.sampling.temp_audio,
            "sampling": c.sampling_dict(),
            "pacing": c.pacing,
            "idle_timeout_s": self.idle_timeout_s,
            "restart_on_cancel": self.restart_on_cancel,
            "stats_interval_s": self.stats_interval_s,
            "link_report_s": self.link_report_s,
            "record": self.record,
            "conversation_state": self.conversation.state.value,
            "capabilities": capabilities(self.ctx.engine.max_sessions),
        }
        if self.beta:
            del session["model"]
            for key in ("input_audio_format", "output_audio_format"):
                if session[key] not in _BETA_NAMES_OF_SDK:
                    del session[key]
        return session

    def closed_event(self, reason: str) -> dict[str, Any]:
        return {"type": "session.closed", "session_id": self.session_id, "reason": reason,
                "stats": closed_stats(self.conversation, self.frames_sent)}

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
        ignored = self.apply_update(read_update(s))
        await self.send({"type": "session.updated", "session": self.session_object(),
                         "ignored": [i.as_dict() for i in ignored]})

    def apply_update(self, update: SessionUpdate) -> list[Ignored]:
        """Apply a read `session` object (a `session.update`, a client secret's config, a call's offer); the fields
        it left alone, and why. Mid-call, the voice, sampling and pacing stay as they are (listed) and new
        instructions are prefilled into the live context."""
        conv, decoder, encoder = self.conversation, self.decoder, self.encoder
        assert conv is not None and decoder is not None and encoder is not None
        old, up = self.config, update.config
        new = with_update(self.ctx, old, up)
        ignored = list(update.ignored)
        if update.openai_voice is not None:
            ignored.append(Ignored(up.path("voice", "session."), f"{update.openai_voice!r} is an OpenAI voice: "
                                   f"this model speaks with the default voice {new.voice_name!r}"))
        if conv.started:
            locked = {"voice": (new.voice != old.voice, {"voice": old.voice, "voice_name": old.voice_name}),
                      "sampling": (new.sampling != old.sampling, {"sampling": old.sampling}),
                      "pacing": (new.pacing != old.pacing, {"pacing": old.pacing})}
            for name, (changed, keep) in locked.items():
                if changed:
                    new = replace(new, **keep)
                    param = up.path(name, "session.") if name != "sampling" else "session.sampling"
                    ignored.append(Ignored(param, f"the {name} is fixed once the conversation started"))
        self.config = new
        decoder.set_format(new.input_format)
        if new.output_format != encoder.format:
            self.encoder = OutputEncoder(new.output_format)
        if update.idle_timeout_s is not None:
            self.idle_timeout_s = update.idle_timeout_s
        if update.restart_on_cancel is not None:
            self.restart_on_cancel = update.restart_on_cancel
        if update.stats_interval_s is not None:
            self.stats_interval_s = update.stats_interval_s
        if update.record is not None:
            if conv.started:
                ignored.append(Ignored("session.record", "recording is decided as the conversation starts"))
            else:
                self.record = update.record
        if update.link_report_s is not None:
            self.link_report_s = update.link_report_s
            if self.link_report_s and (self._link_task is None or self._link_task.done()):
                self._link_task = asyncio.get_running_loop().create_task(
                    report_link(self, self.session_id, lambda: self.link_report_s))
                self.ctx.tasks.add(self._link_task)
                self._link_task.add_done_callback(self.ctx.tasks.discard)
        if update.turn_detection_given:
            self.turn_detection = update.turn_detection
        if conv.started and new.persona != old.persona:
            self._queue_prompt(new.persona, persona=new.persona)
        return ignored

    async def on_append(self, event: dict[str, Any]) -> None:
        if "audio" not in event:
            raise ProtocolError("bad_event", "`input_audio_buffer.append` needs `audio` (base64)", param="audio")
        decoder = self.decoder
        assert decoder is not None
        data = b64decode(event["audio"])
        if "format" in event or "sample_rate_hz" in event:
            fmt = format_from(event.get("format", _BETA_TYPES[decoder.format.encoding]), event.get("sample_rate_hz"),
                              "format")
            decoder.set_format(fmt)
        self._push(decoder.decode(data))

    def _push(self, samples: np.ndarray) -> None:
        conv = self.conversation
        assert conv is not None
        if conv.state is State.IDLE:
            self._start()
        if samples.size:
            try:
                conv.push(None, samples)
            except Backpressure as e:
                raise ProtocolError("input_backpressure", str(e)) from None

    def call_opening(self) -> dict[str, Any]:
        return {"defer_record": True}   # the wish comes with a session.update, before the conversation starts

    def _start(self) -> None:
        assert self.conversation is not None
        self.ctx.calls.start_recording(self.live_call, self.record)
        params = self.config.params()
        if self._prompt_notes:
            params = replace(params, persona="\n".join([params.persona, *self._prompt_notes]).strip())
            self._prompt_notes = []
        self._start_task = self.conversation.start(params)
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
        """Cut what the caller hears; the model keeps its context (or starts a fresh one: `restart_on_cancel`).
        Nothing to cut (no open response, or another response's id) is not an error: the request is already met."""
        conv = self.conversation
        assert conv is not None
        rid = event.get("response_id")
        if rid is not None and not isinstance(rid, str):
            raise ProtocolError("bad_event", "`response_id` must be a string", param="response_id")
        open_ = self.response
        if open_ is not None and rid in (None, open_.id):
            self.cut("cancelled", {"type": "cancelled", "reason": "client_cancelled"})
        if event["type"] == "output_audio_buffer.clear" and self.last_response_id is not None:
            await self.send({"type": "output_audio_buffer.cleared", "response_id": self.last_response_id})
        if not self.restart_on_cancel or open_ is None:
            return
        if conv.state is State.STARTING and self._start_task is not None:
            await asyncio.wait([self._start_task])
        if conv.state is State.LIVE:
            await conv.restart()
            self._muted = False
            self.encoder = OutputEncoder(self.config.output_format)

    def cut(self, status: str, details: dict[str, Any] | None) -> None:
        """End the open response now: its queued audio is withdrawn and the model is muted until its next
        utterance."""
        self.outbox.drop_tagged(OUTPUT_TAG)
        self._end_response(status, details)
        self._muted, self._quiet, self._muted_frames = True, 0, 0
        self.ctx.calls.note(self.live_call, {"event": "cut", "status": status, **self.call_details()})

    def cut_output(self) -> None:
        """The admin API's cut: the open response ends as a client's cancel ends it."""
        self.cut("cancelled", {"type": "cancelled", "reason": "admin_cut"})

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
                         "item_id": new_id("item")})

    async def on_response_create(self, event: dict[str, Any]) -> None:
        """Before any audio: start the conversation (the model may speak first). During it: the open response
        ends and one carrying this request's metadata opens; `response.instructions` beyond the session's are
        prefilled into the context."""
        request = event.get("response") if event.get("response") is not None else {}
        if not isinstance(request, dict):
            raise ProtocolError("bad_event", "`response` must be an object", param="response")
        metadata = _metadata(request.get("metadata"))
        instructions = request.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise ProtocolError("bad_event", "`response.instructions` must be a string", param="response.instructions")
        conv = self.conversation
        assert conv is not None
        persona = self.config.persona
        if instructions and instructions.strip() != persona.strip():
            note = instructions[len(persona):] if persona and instructions.startswith(persona) else instructions
            self._queue_prompt(note.strip())
        if conv.state is State.IDLE:
            self._next_metadata = metadata
            self._start()
        elif self.response is not None:
            self._end_response("completed", None)
            self._open_response(metadata)
        elif self._muted:
            self._muted = False
            self._open_response(metadata)
        else:  # the conversation's first frame (or a fresh context's) is still to come
            self._next_metadata = metadata

    async def on_item_create(self, event: dict[str, Any]) -> None:
        """A client's item: a system, developer or user text is prefilled into the model's context; a user's
        `input_audio` is heard as input; every item is kept and acknowledged."""
        item = event.get("item")
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise ProtocolError("bad_event", "`conversation.item.create` needs an `item` with a `type`", param="item")
        item_id = item.get("id") if item.get("id") is not None else new_id("item")
        if not isinstance(item_id, str) or len(item_id) > MAX_ECHO_CHARS:
            raise ProtocolError("bad_event", f"`item.id` must be a string of at most {MAX_ECHO_CHARS} characters",
                                param="item.id")
        content = item.get("content") if isinstance(item.get("content"), list) else []
        audio = [p for p in content if isinstance(p, dict) and p.get("type") == "input_audio" and "audio" in p]
        if item.get("type") == "message" and item.get("role") == "user" and audio:
            assert self.decoder is not None
            for part in audio:
                self._push(self.decoder.decode(b64decode(part["audio"], param="item.content.audio"),
                                               param="item.content.audio"))
        texts = _texts(item)
        if item.get("type") == "message" and item.get("role") in ("system", "developer", "user") and texts:
            self._queue_prompt("\n".join(texts))
        parts = [{k: v for k, v in p.items() if k != "audio"} if isinstance(p, dict) else p for p in content]
        stored = {**item, "id": item_id, "object": "realtime.item", "status": "completed"}
        if "content" in item:
            stored["content"] = parts
        previous = self.items.add(stored)
        await self.send({"type": self.names["item_added"], "previous_item_id": previous, "item": stored})
        if self.names["item_done"]:
            await self.send({"type": self.names["item_done"], "previous_item_id": previous, "item": stored})

    async def on_item_retrieve(self, event: dict[str, Any]) -> None:
        await self.send({"type": "conversation.item.retrieved", "item": self.items.get(event.get("item_id"))})

    async def on_item_delete(self, event: dict[str, Any]) -> None:
        self.items.delete(event.get("item_id"))
        await self.send({"type": "conversation.item.deleted", "item_id": event["item_id"]})

    async def on_item_truncate(self, event: dict[str, Any]) -> None:
        """Playback bookkeeping: the item's transcript is cut at the audio the client played; the model's context
        is not rewound (it heard the caller talk over it)."""
        content_index = event.get("content_index", 0)
        if isinstance(content_index, bool) or not isinstance(content_index, int) or content_index < 0:
            raise ProtocolError("bad_event", "`content_index` must be a non-negative integer", param="content_index")
        response = self.items.truncate(event.get("item_id"), event.get("audio_end_ms"))
        await self.send({"type": "conversation.item.truncated", "item_id": response.item_id,
                         "content_index": content_index, "audio_end_ms": response.played_ms})

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

    # ---- prompts into the live context -----------------------------------------------------------------------

    def _queue_prompt(self, text: str, persona: str | None = None) -> None:
        """Prefill `text` (as a `<system>` prompt) into the model's context: into the start's prompt before the
        conversation starts, else at the next frame boundary (several queued meanwhile go in one prefill)."""
        conv = self.conversation
        assert conv is not None
        if persona is not None:
            self._pending_persona = persona
        if not conv.started:
            if persona is None:
                self._prompt_notes.append(text)
            return
        self._pending_prompts.append(text)
        if self._prompt_task is None or self._prompt_task.done():
            self._prompt_task = asyncio.get_running_loop().create_task(self._run_prompts())
            self.ctx.tasks.add(self._prompt_task)
            self._prompt_task.add_done_callback(self.ctx.tasks.discard)

    async def _run_prompts(self) -> None:
        conv = self.conversation
        assert conv is not None
        while self._pending_prompts and not self.closed:
            if self._start_task is not None and not self._start_task.done():
                await asyncio.wait([self._start_task])
            if conv.state is not State.LIVE:
                return
            text, self._pending_prompts = "\n".join(self._pending_prompts), []
            persona, self._pending_persona = self._pending_persona, None
            try:
                await conv.add_prompt(text, persona)
            except EngineError as e:
                if not self.closed and conv.state is State.LIVE:
                    self.send_error_nowait(ProtocolError("internal_error", f"the prompt was not added: {e.message}"))

    # ---- engine output ---------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed or not self._audible(frame):
            return
        if self.response is None:
            self._open_response(self._next_metadata)
            self._next_metadata = None
        assert self.response is not None
        r = self.response
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        self.play(frame, ids)
        self.frames_sent += 1
        r.frames += 1
        if frame.text:
            r.pieces.append((r.frames - 1, frame.text))
            self.send_nowait({"type": self.names["transcript_delta"], **ids, "delta": frame.text}, OUTPUT_TAG)

    def _audible(self, frame: FrameOutput) -> bool:
        """Whether the frame is heard: always, unless a cut muted the model and its utterance is not over yet (and
        the cut was less than MAX_MUTED_FRAMES ago)."""
        if not self._muted:
            return True
        if (frame.text and self._quiet >= QUIET_FRAMES) or self._muted_frames >= MAX_MUTED_FRAMES:
            self._muted = False
            return True
        self._quiet = 0 if frame.text else self._quiet + 1
        self._muted_frames += 1
        return False

    def play(self, frame: FrameOutput, ids: dict[str, Any]) -> None:
        """The frame's audio to the caller: an audio delta (a WebRTC call plays it on its track instead)."""
        assert self.encoder is not None
        if self.sends_audio:
            self.send_audio_nowait({"type": self.names["audio_delta"], **ids,
                                    "delta": b64encode(self.encoder.encode(frame.audio))})

    def _item(self, r: Response, status: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": self.names["content_type"], "transcript": r.transcript}
        return {"id": r.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": [part] if status != "in_progress" else []}

    def _response_object(self, r: Response, status: str, details: dict[str, Any] | None) -> dict[str, Any]:
        item_status = {"in_progress": "in_progress", "completed": "completed"}.get(status, "incomplete")
        return {"object": "realtime.response", "id": r.id, "status": status, "status_details": details,
                "output": [self._item(r, item_status)] if status != "in_progress" else [],
                "output_modalities": ["audio"], "modalities": ["audio", "text"],
                "conversation_id": self.session_id, "usage": None, "metadata": r.metadata,
                "audio": {"output": {"format": ga_format(self.config.output_format),
                                     "voice": self.config.voice_name}}}

    def _open_response(self, metadata: dict[str, str] | None) -> None:
        r = self.response = Response.open(metadata)
        self.last_response_id = r.id
        item = self._item(r, "in_progress")
        previous = self.items.add(item, r)
        self.send_nowait({"type": "response.created", "response_id": r.id,
                          "response": self._response_object(r, "in_progress", None)})
        self.send_nowait({"type": self.names["item_added"], "previous_item_id": previous, "item": item})
        self.send_nowait({"type": "response.output_item.added", "response_id": r.id, "output_index": 0,
                          "item": item})
        self.send_nowait({"type": "response.content_part.added", "response_id": r.id, "item_id": r.item_id,
                          "output_index": 0, "content_index": 0,
                          "part": {"type": "audio", "transcript": ""}})

    def _end_response(self, status: str, details: dict[str, Any] | None) -> None:
        r = self.response
        if r is None:
            return
        self.response = None
        ids = {"response_id": r.id, "item_id": r.item_id, "output_index": 0, "content_index": 0}
        transcript = r.transcript
        item = self._item(r, "completed" if status == "completed" else "incomplete")
        self.items.update(item)
        self.send_nowait({"type": self.names["audio_done"], **ids})
        self.send_nowait({"type": self.names["transcript_done"], **ids, "transcript": transcript})
        self.send_nowait({"type": "response.content_part.done", **ids,
                          "part": {"type": "audio", "transcript": transcript}})
        self.send_nowait({"type": "response.output_item.done", "response_id": r.id, "output_index": 0,
                          "item": item})
        if self.names["item_done"]:
            self.send_nowait({"type": self.names["item_done"], "previous_item_id": None, "item": item})
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
    "conversation.item.retrieve": RealtimeSession.on_item_retrieve,
    "conversation.item.delete": RealtimeSession.on_item_delete,
    "conversation.item.truncate": RealtimeSession.on_item_truncate,
    "session.heartbeat": RealtimeSession.on_heartbeat,
    "playback.ack": RealtimeSession.on_playback_ack,
    "audio.playback_ack": RealtimeSession.on_playback_ack,
    "session.close": RealtimeSession.on_close,
    "close": RealtimeSession.on_close,
    "close_session": RealtimeSession.on_close,
}
_UNSUPPORTED = {
    "session.resume": ("unsupported_session_resume", "sessions cannot be resumed; open a new one"),
    "barge_in": ("unsupported_event", "the model handles interruptions itself (supports_barge_in=false); "
                 "response.cancel cuts what the caller hears"),
    "turn.signal": ("unsupported_event", "no external turn signals (supports_external_turn_signal=false)"),
    "transcription_session.update": ("unsupported_event", "transcription sessions are not served"),
}


async def realtime_handler(request: web.Request) -> web.StreamResponse:
    if request.query.get("duplex", "1").lower() in _FALSE:
        return web.json_response({"error": {"type": "invalid_request_error", "code": "unsupported_event",
                                            "message": "Realtime API is not available: this server serves "
                                                       "duplex sessions only (?duplex=1)"}}, status=400)
    claim = request.get(CLIENT_SECRET)   # a client secret's session id and bound config, when one was presented
    session = RealtimeSession(request.app[CONTEXT], is_beta(request), claim and claim.id, claim and claim.session)
    return await serve(request, session)
