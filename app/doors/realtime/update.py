"""`session.update` of the Realtime dialect: what the client sent, read field by field, GA and beta spellings.

`read_update(session)` turns the `session` object of a `session.update` (or of a client secret's bound config, or a
WebRTC call's offer) into a `SessionUpdate`: the `ConfigUpdate` the shared validation takes, with the path at which
the client sent each field (an error names `session.audio.output.voice` when that is where the voice came from), the
dialect's own options, and the fields this server does not act on, listed with the reason rather than failing the
update (OpenAI clients send tools, transcription, tracing, `max_output_tokens`… by habit; the rest of their update
must still apply). A bad value is still a `ProtocolError` that rejects the whole update.

Two OpenAI notions get their full-duplex meaning here: an OpenAI voice name (`marin`, `alloy`, …) is the server's
default voice, and `server_vad` / `semantic_vad` turn detection means "the model takes turns itself" (no VAD events
are sent); turn detection `null` or `false` means the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.sessions.errors import ProtocolError
from app.sessions.link import link_report_s
from app.sessions.session_config import SAMPLING_KEYS, ConfigUpdate, check_extra_body, format_from

OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar",
                           "fable", "onyx", "nova"})
MODEL_TURNS = ("server_vad", "semantic_vad")

# Fields the server reads no meaning from, and why; listed in `session.updated.ignored` when the client set them to
# something other than their no-op value (an empty tool list, `tool_choice: auto`, `max_output_tokens: inf`).
_NOT_ACTED_ON: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("the model calls no tools", ([],)),
    "tool_choice": ("the model calls no tools", ("auto", "none")),
    "max_output_tokens": ("the model speaks for as long as the conversation runs", ("inf",)),
    "max_response_output_tokens": ("the model speaks for as long as the conversation runs", ("inf",)),
    "tracing": ("no traces are kept", ()),
    "include": ("no extra output is included", ([],)),
    "prompt": ("stored prompts are not served; use instructions", ()),
    "truncation": ("the model's context is a sliding window of its own", ("auto",)),
    "input_audio_transcription": ("the caller's audio is not transcribed", ()),
    "input_audio_noise_reduction": ("the audio is not denoised", ()),
    "speed": ("the model speaks at its own pace", (1.0, 1)),
}
_AUDIO_IN_NOT_ACTED_ON = {"transcription": "input_audio_transcription",
                          "noise_reduction": "input_audio_noise_reduction"}
# Read elsewhere, or only informative when a client sends its session object back.
_KNOWN = frozenset({"type", "model", "instructions", "voice", "audio", "input_audio_format", "output_audio_format",
                    "input_sample_rate_hz", "output_sample_rate_hz", "turn_detection", "output_modalities",
                    "modalities", "temperature", "pacing", "idle_timeout_s", "extra_body", "restart_on_cancel",
                    "stats_interval_s", "link_report_s", "record", "object", "id", "expires_at", "client_secret",
                    "capabilities", "sampling", "state", "conversation_state", *SAMPLING_KEYS})


@dataclass(frozen=True)
class Ignored:
    param: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"param": self.param, "reason": self.reason}


@dataclass
class SessionUpdate:
    config: ConfigUpdate
    idle_timeout_s: float | None = None
    restart_on_cancel: bool | None = None
    stats_interval_s: float | None = None
    link_report_s: float | None = None
    record: bool | None = None                     # the session's wish to be recorded (the server's policy decides)
    turn_detection: dict[str, Any] | None = None   # as the client set it (server_vad / semantic_vad), when it did
    turn_detection_given: bool = False
    ignored: list[Ignored] = field(default_factory=list)
    openai_voice: str | None = None                # an OpenAI voice name, served by the default voice


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: object, low: float, high: float, param: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ProtocolError("invalid_session_config", f"`{param}` must be {what} ({low:g}–{high:g})", param=param)
    return float(value)


def read_update(s: dict[str, Any], prefix: str = "session") -> SessionUpdate:
    """Read one `session` object; a ProtocolError for a bad value (its `param` is the path the client used)."""
    if s.get("type") not in (None, "realtime"):
        raise ProtocolError("invalid_session_config", "only `realtime` sessions are served", param=f"{prefix}.type")
    for key in ("output_modalities", "modalities"):
        modalities = s.get(key)
        if modalities is not None and (not isinstance(modalities, list) or "audio" not in modalities):
            raise ProtocolError("invalid_session_config", "this model always speaks: modalities must include "
                                "\"audio\"", param=f"{prefix}.{key}")
    extra = check_extra_body(s.get("extra_body"), param=f"{prefix}.extra_body")
    up = ConfigUpdate()
    out = SessionUpdate(config=up)
    paths = up.paths
    if "instructions" in s and s["instructions"] is not None:
        up.persona = s["instructions"]
        paths["instructions"] = f"{prefix}.instructions"
    audio = _dict(s.get("audio"))
    audio_in, audio_out = _dict(audio.get("input")), _dict(audio.get("output"))
    for where, source in ((f"{prefix}.audio.output.voice", audio_out), (f"{prefix}.voice", s)):
        if "voice" in source:
            voice = source["voice"]
            if isinstance(voice, str) and voice.lower() in OPENAI_VOICES:
                out.openai_voice, voice = voice, None
            up.voice, paths["voice"] = voice, where
            break
    for src, where in ((s, prefix), (extra, f"{prefix}.extra_body")):
        for key, value in src.items():
            if key in SAMPLING_KEYS or key == "temperature":
                up.sampling_fields[key], paths[key] = value, f"{where}.{key}"
    if "pacing" in extra or "pacing" in s:
        in_extra = "pacing" in extra
        up.pacing = extra["pacing"] if in_extra else s["pacing"]
        paths["pacing"] = f"{prefix}.extra_body.pacing" if in_extra else f"{prefix}.pacing"
    if "format" in audio_in:
        up.input_format = format_from(audio_in["format"], None, f"{prefix}.audio.input.format")
    elif "input_audio_format" in s:
        up.input_format = format_from(s["input_audio_format"], s.get("input_sample_rate_hz"),
                                      f"{prefix}.input_audio_format")
    if "format" in audio_out:
        up.output_format = format_from(audio_out["format"], None, f"{prefix}.audio.output.format")
    elif "output_audio_format" in s:
        up.output_format = format_from(s["output_audio_format"], s.get("output_sample_rate_hz"),
                                       f"{prefix}.output_audio_format")
    if s.get("idle_timeout_s") is not None:
        out.idle_timeout_s = _number(s["idle_timeout_s"], 1, 86400, f"{prefix}.idle_timeout_s", "a number of seconds")
    for src, where in ((s, prefix), (extra, f"{prefix}.extra_body")):
        if src.get("restart_on_cancel") is not None:
            if not isinstance(src["restart_on_cancel"], bool):
                raise ProtocolError("invalid_session_config", "`restart_on_cancel` must be true or false",
                                    param=f"{where}.restart_on_cancel")
            out.restart_on_cancel = src["restart_on_cancel"]
        if src.get("stats_interval_s") is not None:
            out.stats_interval_s = _number(src["stats_interval_s"], 0, 60, f"{where}.stats_interval_s",
                                           "a number of seconds, 0 for none")
        if src.get("record") is not None:
            if not isinstance(src["record"], bool):
                raise ProtocolError("invalid_session_config", "`record` must be true or false",
                                    param=f"{where}.record")
            out.record = src["record"]
        if src.get("link_report_s") is not None:
            out.link_report_s = link_report_s(src["link_report_s"], f"{where}.link_report_s")
    _read_turn_detection(s, audio_in, prefix, out)
    _list_ignored(s, audio_in, audio_out, prefix, out)
    return out


def _read_turn_detection(s: dict[str, Any], audio_in: dict[str, Any], prefix: str, out: SessionUpdate) -> None:
    if "turn_detection" in audio_in:
        turn, param = audio_in["turn_detection"], f"{prefix}.audio.input.turn_detection"
    elif "turn_detection" in s:
        turn, param = s["turn_detection"], f"{prefix}.turn_detection"
    else:
        return
    out.turn_detection_given = True
    if turn is None or turn is False:
        out.turn_detection = None
    elif isinstance(turn, dict) and turn.get("type") in MODEL_TURNS:
        out.turn_detection = turn
    else:
        out.turn_detection = None
        out.ignored.append(Ignored(param, "the model takes turns itself; turn detection may be null, server_vad or "
                                          "semantic_vad, which all mean that"))


def _list_ignored(s: dict[str, Any], audio_in: dict[str, Any], audio_out: dict[str, Any], prefix: str,
                  out: SessionUpdate) -> None:
    fields = [(f"{prefix}.{k}", k, v) for k, v in s.items() if k in _NOT_ACTED_ON]
    fields += [(f"{prefix}.audio.input.{k}", name, audio_in[k]) for k, name in _AUDIO_IN_NOT_ACTED_ON.items()
               if k in audio_in]
    if "speed" in audio_out:
        fields.append((f"{prefix}.audio.output.speed", "speed", audio_out["speed"]))
    for param, name, value in fields:
        reason, no_ops = _NOT_ACTED_ON[name]
        if value is not None and value not in no_ops:
            out.ignored.append(Ignored(param, reason))
    for key in s:
        if key not in _KNOWN and key not in _NOT_ACTED_ON:
            out.ignored.append(Ignored(f"{prefix}.{key}", "not a field of this server's sessions"))
