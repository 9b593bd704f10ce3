"""Sample codecs for the wire formats clients send: PCM16 LE, float32 LE, G.711 mu-law and A-law.

Every codec maps bytes <-> mono float32 in [-1, 1]. G.711 follows ITU-T G.711: mu-law quantises a 14-bit
linear value in 8 segments of 16 steps over the biased magnitude |x| + 33, A-law a 13-bit value in 8 segments
(the first two with the same step); mu-law codes are sent with all bits inverted, A-law codes with the even
bits inverted. The tables below are computed from that definition once at import, so encoding and decoding
are single lookups. A 16-bit sample is reduced to 14 (13) bits by an arithmetic shift, as CPython's `audioop`
and the classic reference g711.c do, so the codes are bit-identical to theirs for every 16-bit input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ENCODINGS = ("pcm16", "f32", "pcmu", "pcma")
MIN_RATE = 8000
MAX_RATE = 48000

_PCM16_SCALE = 32768.0
_ULAW_BIAS = 33  # in 14-bit units: makes every segment start at a power of two
_ULAW_CLIP = 8159  # largest 14-bit magnitude G.711 mu-law represents


def _check_samples(samples: np.ndarray) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"audio samples must be a 1-D (mono) array, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("audio samples contain NaN or infinity")
    return x


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, rounded to nearest, clipped (1.0 becomes 32767)."""
    x = _check_samples(samples)
    return np.clip(np.rint(x * _PCM16_SCALE), -32768, 32767).astype(np.int16)


def pcm16_to_float(pcm: np.ndarray) -> np.ndarray:
    return (np.asarray(pcm, dtype=np.int16) / np.float32(_PCM16_SCALE)).astype(np.float32)


def pcm16_decode(data: bytes) -> np.ndarray:
    return pcm16_to_float(np.frombuffer(data, dtype="<i2"))


def pcm16_encode(samples: np.ndarray) -> bytes:
    return float_to_pcm16(samples).astype("<i2").tobytes()


def f32_decode(data: bytes) -> np.ndarray:
    x = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(x).all():
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise ValueError(f"f32 audio contains a non-finite sample (NaN or infinity) at sample {bad}")
    return x


def f32_encode(samples: np.ndarray) -> bytes:
    return _check_samples(samples).astype("<f4").tobytes()


def _ulaw_tables() -> tuple[np.ndarray, np.ndarray]:
    x14 = np.arange(-32768, 32768, dtype=np.int32) >> 2
    negative = x14 < 0
    biased = np.minimum(np.abs(x14), _ULAW_CLIP) + _ULAW_BIAS  # in [33, 8192]
    seg = np.minimum(np.floor(np.log2(biased)).astype(np.int32) - 5, 7)
    mant = np.where(biased >= 8192, 15, (biased >> (seg + 1)) & 0xF)
    code = ~((negative.astype(np.int32) << 7) | (seg << 4) | mant) & 0xFF
    encode = np.empty(65536, dtype=np.uint8)
    encode[np.arange(-32768, 32768) & 0xFFFF] = code  # indexed by the sample's uint16 bit pattern

    c = ~np.arange(256, dtype=np.int32) & 0xFF
    seg_d, mant_d = (c >> 4) & 7, c & 0xF
    magnitude14 = ((2 * mant_d + _ULAW_BIAS) << seg_d) - _ULAW_BIAS
    decode = (np.where(c & 0x80, -magnitude14, magnitude14) * 4).astype(np.int16)
    return encode, decode


def _alaw_tables() -> tuple[np.ndarray, np.ndarray]:
    x13 = np.arange(-32768, 32768, dtype=np.int32) >> 3
    positive = x13 >= 0
    magnitude = np.where(positive, x13, ~x13)  # one's complement: -1 -> 0, so both signs have a zero level
    seg = np.where(magnitude < 32, 0, np.floor(np.log2(np.maximum(magnitude, 1))).astype(np.int32) - 4)
    mant = np.where(seg == 0, magnitude >> 1, magnitude >> np.maximum(seg, 1)) & 0xF
    code = ((positive.astype(np.int32) << 7) | (seg << 4) | mant) ^ 0x55
    encode = np.empty(65536, dtype=np.uint8)
    encode[np.arange(-32768, 32768) & 0xFFFF] = code

    c = np.arange(256, dtype=np.int32) ^ 0x55
    seg_d, mant_d = (c >> 4) & 7, c & 0xF
    magnitude13 = np.where(seg_d == 0, 2 * mant_d + 1, (2 * mant_d + 33) << np.maximum(seg_d - 1, 0))
    decode = (np.where(c & 0x80, magnitude13, -magnitude13) * 8).astype(np.int16)
    return encode, decode


_ULAW_ENCODE, ULAW_DECODE_PCM16 = _ulaw_tables()
_ALAW_ENCODE, ALAW_DECODE_PCM16 = _alaw_tables()
_ULAW_DECODE = pcm16_to_float(ULAW_DECODE_PCM16)
_ALAW_DECODE = pcm16_to_float(ALAW_DECODE_PCM16)


def ulaw_encode_pcm16(pcm: np.ndarray) -> np.ndarray:
    """int16 samples -> G.711 mu-law codes (uint8)."""
    return _ULAW_ENCODE[np.asarray(pcm, dtype=np.int16).view(np.uint16)]


def alaw_encode_pcm16(pcm: np.ndarray) -> np.ndarray:
    """int16 samples -> G.711 A-law codes (uint8)."""
    return _ALAW_ENCODE[np.asarray(pcm, dtype=np.int16).view(np.uint16)]


def ulaw_decode(data: bytes) -> np.ndarray:
    return _ULAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def ulaw_encode(samples: np.ndarray) -> bytes:
    return ulaw_encode_pcm16(float_to_pcm16(samples)).tobytes()


def alaw_decode(data: bytes) -> np.ndarray:
    return _ALAW_DECODE[np.frombuffer(data, dtype=np.uint8)]


def alaw_encode(samples: np.ndarray) -> bytes:
    return alaw_encode_pcm16(float_to_pcm16(samples)).tobytes()


_CODECS = {
    "pcm16": (2, pcm16_decode, pcm16_encode),
    "f32": (4, f32_decode, f32_encode),
    "pcmu": (1, ulaw_decode, ulaw_encode),
    "pcma": (1, alaw_decode, alaw_encode),
}


@dataclass(frozen=True)
class AudioFormat:
    """A mono wire format: `encoding` is one of pcm16 | f32 | pcmu | pcma, `sample_rate` in 8000..48000 Hz."""

    encoding: str
    sample_rate: int

    def __post_init__(self) -> None:
        if self.encoding not in _CODECS:
            raise ValueError(f"unknown audio encoding {self.encoding!r}; expected one of {', '.join(ENCODINGS)}")
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not MIN_RATE <= rate <= MAX_RATE:
            raise ValueError(f"sample_rate must be an integer in {MIN_RATE}..{MAX_RATE} Hz, got {rate!r}")

    @property
    def bytes_per_sample(self) -> int:
        return _CODECS[self.encoding][0]

    def decode(self, data: bytes) -> np.ndarray:
        """Wire bytes -> mono float32. Raises ValueError if the bytes are not whole samples."""
        size = self.bytes_per_sample
        if len(data) % size:
            raise ValueError(
                f"{self.encoding} audio needs a whole number of {size}-byte samples, got {len(data)} bytes"
            )
        return _CODECS[self.encoding][1](data)

    def encode(self, samples: np.ndarray) -> bytes:
        """Mono float32 in [-1, 1] -> wire bytes (values outside [-1, 1] clip, except for f32)."""
        return _CODECS[self.encoding][2](samples)
