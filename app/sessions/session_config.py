"""A conversation's client-chosen settings, validated field by field, shared by the Realtime and native dialects.

`SessionConfig` holds persona, voice, sampling, pacing and the wire formats; `with_update` returns an updated copy
or raises a `ProtocolError` whose `param` is the path the client sent the bad field at (`ConfigUpdate.paths`; nothing
changes then). What may change once a conversation has started is the dialect's business (`app.doors.realtime.update`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from app.sessions.audio import MODEL_RATE, parse_format
from app.sessions.errors import ProtocolError
from app.shell.context import ServerContext
from media.codecs import AudioFormat
from model.engine import SamplingParams, SessionParams

PACINGS = ("realtime", "input")
SAMPLING_KEYS = ("greedy", "text_temperature", "text_topk", "audio_temperature", "audio_topk", "seed")
PRIVATE_EXTRA_KEYS = ("personaplex_prefill_slots", "personaplex_model_path", "personaplex_voice_prompt",
                      "personaplex_persona")
MAX_PERSONA_CHARS = 8000


@dataclass(frozen=True)
class SessionConfig:
    persona: str = ""
    voice_name: str | None = None      # as the client named it; None: the server's default voice
    voice: str | None = None           # what the engine takes (bundled name or voices-folder path)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    pacing: str = "realtime"
    input_format: AudioFormat = field(default_factory=lambda: AudioFormat("pcm16", MODEL_RATE))
    output_format: AudioFormat = field(default_factory=lambda: AudioFormat("pcm16", MODEL_RATE))

    def params(self) -> SessionParams:
        return SessionParams(voice=self.voice, persona=self.persona, sampling=self.sampling, pacing=self.pacing)

    def sampling_dict(self) -> dict[str, Any]:
        s = self.sampling
        return {"greedy": s.greedy, "text_temperature": s.temp_text, "text_topk": s.topk_text,
                "audio_temperature": s.temp_audio, "audio_topk": s.topk_audio, "seed": s.seed}


def default_config(ctx: ServerContext) -> SessionConfig:
    voice = ctx.default_voice
    return SessionConfig(voice_name=voice, voice=ctx.resolve_voice(voice))


def _temperature(value: object, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not 0.0 < value <= 5.0:
        raise ProtocolError("invalid_session_config",
                            f"`{param}` must be a number above 0 and at most 5 (use greedy for 0), got {value!r}",
                            param=param)
    return float(value)


def _topk(value: object, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
        raise ProtocolError("invalid_session_config", f"`{param}` must be a positive integer, got {value!r}",
                            param=param)
    return value


def sampling_with(s: SamplingParams, fields: dict[str, Any], prefix: str = "session.",
                  paths: dict[str, str] | None = None) -> SamplingParams:
    """`temperature` sets both temperatures; the specific keys win over it. A bad value's `param` is its path in
    `paths` (where the client sent it), else `prefix` + its key."""
    path = lambda key: (paths or {}).get(key, prefix + key)
    changes: dict[str, Any] = {}
    if fields.get("temperature") is not None:
        t = _temperature(fields["temperature"], path("temperature"))
        changes.update(temp_text=t, temp_audio=t)
    if "text_temperature" in fields:
        changes["temp_text"] = _temperature(fields["text_temperature"], path("text_temperature"))
    if "audio_temperature" in fields:
        changes["temp_audio"] = _temperature(fields["audio_temperature"], path("audio_temperature"))
    if "text_topk" in fields:
        changes["topk_text"] = _topk(fields["text_topk"], path("text_topk"))
    if "audio_topk" in fields:
        changes["topk_audio"] = _topk(fields["audio_topk"], path("audio_topk"))
    if "seed" in fields:
        seed = fields["seed"]
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ProtocolError("invalid_session_config", f"`{path('seed')}` must be a non-negative integer or null",
                                param=path("seed"))
        changes["seed"] = seed
    if "greedy" in fields:
        if not isinstance(fields["greedy"], bool):
            raise ProtocolError("invalid_session_config", f"`{path('greedy')}` must be true or false",
                                param=path("greedy"))
        changes["greedy"] = fields["greedy"]
    return replace(s, **changes) if changes else s


def check_extra_body(extra: object, param: str = "session.extra_body") -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ProtocolError("invalid_session_config", "`extra_body` must be an object", param=param)
    private = [k for k in extra if k in PRIVATE_EXTRA_KEYS]
    if private:
        raise ProtocolError("invalid_duplex_runtime_config",
                            f"extra_body keys {private} are set by the server, not per session", param=param)
    return extra


@dataclass
class ConfigUpdate:
    """Parsed, not yet validated against the session: the dialect fills only what its event carried, and `paths`
    says where the client sent each field (`voice` -> `session.audio.output.voice`), for the error's `param`."""

    persona: str | None = None
    voice: object = ...                   # ... = not given; None or "" = default voice
    sampling_fields: dict[str, Any] = field(default_factory=dict)
    pacing: object = None
    input_format: AudioFormat | None = None
    output_format: AudioFormat | None = None
    paths: dict[str, str] = field(default_factory=dict)

    def path(self, key: str, prefix: str) -> str:
        return self.paths.get(key, prefix + key)


def with_update(ctx: ServerContext, cfg: SessionConfig, up: ConfigUpdate, *, prefix: str = "session.") -> SessionConfig:
    """The updated config, or a ProtocolError for the first bad field."""
    changes: dict[str, Any] = {}
    if up.persona is not None:
        if not isinstance(up.persona, str) or len(up.persona) > MAX_PERSONA_CHARS:
            raise ProtocolError("invalid_session_config",
                                f"`instructions` must be a string of at most {MAX_PERSONA_CHARS} characters",
                                param=up.path("instructions", prefix))
        changes["persona"] = up.persona
    if up.voice is not ...:
        changes["voice"] = ctx.resolve_voice(up.voice, param=up.path("voice", prefix))
        changes["voice_name"] = up.voice or ctx.default_voice
    changes["sampling"] = sampling_with(cfg.sampling, up.sampling_fields, prefix, up.paths)
    if up.pacing is not None:
        if up.pacing not in PACINGS:
            raise ProtocolError("invalid_session_config", f"`pacing` must be one of {PACINGS}, got {up.pacing!r}",
                                param=up.path("pacing", prefix))
        changes["pacing"] = up.pacing
    if up.input_format is not None:
        changes["input_format"] = up.input_format
    if up.output_format is not None:
        changes["output_format"] = up.output_format
    return replace(cfg, **changes)


def format_from(value: object, rate: object, param: str) -> AudioFormat:
    """A format given as a name (`"pcm16"`) or an object (`{"type": "audio/pcm", "rate": 16000}`)."""
    if isinstance(value, dict):
        name = value.get("type", value.get("format"))
        rate = value.get("rate", value.get("sample_rate_hz", rate))
        return parse_format(name, rate, param=param)
    return parse_format(value, rate, param=param)
