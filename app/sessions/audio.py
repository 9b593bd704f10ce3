"""Wire audio for the WebSocket dialects: format names as clients spell them, and per-session stateful converters.

`parse_format` takes every spelling the dialects accept (OpenAI GA `audio/pcm`, beta `pcm16`/`g711_ulaw`, the
reference's `pcm_f32le`, Twilio's `audio/x-mulaw`) and gives a `media.codecs.AudioFormat`. `InputDecoder` turns wire
bytes into 24 kHz float32 for the jitter buffer; `OutputEncoder` turns the engine's 24 kHz frames into wire bytes.
Each keeps one resampler for the life of the session, so chunk edges leave no artefacts.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from app.sessions.errors import ProtocolError
from media.codecs import MAX_RATE, MIN_RATE, AudioFormat
from media.resample import Resampler

MODEL_RATE = 24000

_ENCODING_NAMES = {
    "pcm16": "pcm16", "audio/pcm": "pcm16", "pcm": "pcm16", "s16le": "pcm16", "pcm_s16le": "pcm16",
    "f32": "f32", "pcm_f32le": "f32", "f32le": "f32", "audio/pcm_f32le": "f32", "float32": "f32",
    "pcmu": "pcmu", "g711_ulaw": "pcmu", "audio/pcmu": "pcmu", "audio/x-mulaw": "pcmu", "ulaw": "pcmu",
    "mulaw": "pcmu",
    "pcma": "pcma", "g711_alaw": "pcma", "audio/pcma": "pcma", "audio/x-alaw": "pcma", "alaw": "pcma",
}
_G711 = ("pcmu", "pcma")


def parse_format(name: object, rate: object = None, *, param: str = "format") -> AudioFormat:
    """A format name in any accepted spelling plus an optional rate (default: 8000 for G.711, else 24000)."""
    if not isinstance(name, str) or name.lower() not in _ENCODING_NAMES:
        raise ProtocolError("unsupported_audio_format",
                            f"unknown audio format {name!r}; use one of {', '.join(sorted(_ENCODING_NAMES))}",
                            param=param)
    encoding = _ENCODING_NAMES[name.lower()]
    if rate is None:
        rate = 8000 if encoding in _G711 else MODEL_RATE
    if isinstance(rate, bool) or not isinstance(rate, int) or not MIN_RATE <= rate <= MAX_RATE:
        raise ProtocolError("unsupported_audio_format",
                            f"sample rate must be an integer from {MIN_RATE} to {MAX_RATE} Hz, got {rate!r}",
                            param=param)
    if encoding in _G711 and rate != 8000:
        raise ProtocolError("unsupported_audio_format", f"G.711 ({name}) is 8000 Hz only, got {rate}", param=param)
    return AudioFormat(encoding, rate)


def b64decode(text: object, *, param: str = "audio") -> bytes:
    """Strict base64 (no stray characters), with a clear error."""
    if not isinstance(text, str):
        raise ProtocolError("bad_event", f"`{param}` must be a base64 string", param=param)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError("bad_audio", f"`{param}` is not valid base64: {e}", param=param) from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class InputDecoder:
    """Wire bytes in one format -> float32 at 24 kHz; switching format keeps the stream if the rate is the same."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resampler = Resampler(fmt.sample_rate, MODEL_RATE)

    def set_format(self, fmt: AudioFormat) -> None:
        if fmt.sample_rate != self.format.sample_rate:
            self._resampler = Resampler(fmt.sample_rate, MODEL_RATE)
        self.format = fmt

    def decode(self, data: bytes, *, param: str = "audio") -> np.ndarray:
        """Raises ProtocolError `bad_audio` for a partial sample or a non-finite value; nothing is kept then."""
        try:
            samples = self.format.decode(data)
        except ValueError as e:
            raise ProtocolError("bad_audio", str(e), param=param) from None
        if not np.isfinite(samples).all():
            raise ProtocolError("bad_audio", "audio contains a non-finite sample (NaN or infinity)", param=param)
        return self._resampler.process(samples)

    def reset(self) -> None:
        self._resampler.reset()


class OutputEncoder:
    """The engine's 24 kHz float32 frames -> wire bytes in the session's output format, each frame whole (the
    resampler starts primed: the first delta at 16 kHz is 1280 samples, as every other)."""

    def __init__(self, fmt: AudioFormat) -> None:
        self.format = fmt
        self._resampler = Resampler(MODEL_RATE, fmt.sample_rate, primed=True)

    def encode(self, samples: np.ndarray) -> bytes:
        return self.format.encode(np.clip(self._resampler.process(samples), -1.0, 1.0))

    def reset(self) -> None:
        self._resampler.reset()
