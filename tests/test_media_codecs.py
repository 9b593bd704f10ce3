"""Wire codecs: PCM16, f32, and G.711 mu-law / A-law checked against the standard's code points."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from media import codecs
from media.codecs import AudioFormat

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        import audioop  # removed in Python 3.13; used here only as an independent oracle
    except ImportError:
        audioop = None

ALL_PCM16 = np.arange(-32768, 32768, dtype=np.int16)


def test_pcm16_round_trip_and_scaling() -> None:
    data = ALL_PCM16.astype("<i2").tobytes()
    x = codecs.pcm16_decode(data)
    assert x.dtype == np.float32 and x.min() == -1.0 and x.max() == 32767 / 32768
    assert codecs.pcm16_encode(x) == data
    # full scale clips instead of wrapping; rounding is to nearest
    enc = np.frombuffer(codecs.pcm16_encode(np.array([1.0, -1.0, 2.0, -3.0, 0.5 / 32768 * 0.99], np.float32)), "<i2")
    assert enc.tolist() == [32767, -32768, 32767, -32768, 0]


def test_f32_round_trip_and_non_finite_rejected() -> None:
    x = np.array([0.0, -0.25, 1.5, 1e-7], np.float32)
    assert np.array_equal(codecs.f32_decode(codecs.f32_encode(x)), x)
    bad = np.array([0.0, 0.5, np.nan], np.float32).astype("<f4").tobytes()
    with pytest.raises(ValueError, match="non-finite sample .* at sample 2"):
        codecs.f32_decode(bad)
    with pytest.raises(ValueError, match="NaN or infinity"):
        codecs.f32_encode(np.array([np.inf], np.float32))


# Code points from the tables of ITU-T G.711 (decoder outputs in 16-bit linear PCM: x4 the 14-bit mu-law
# values, x8 the 13-bit A-law values).
ULAW_POINTS = {
    0xFF: 0,  # +0
    0x7F: 0,  # -0
    0xFE: 8,  # first step of segment 0: 2 (14-bit)
    0xF0: 120,  # top of segment 0: 30
    0xEF: 132,  # bottom of segment 1: 33
    0x80: 32124,  # most positive: 8031
    0x00: -32124,
    0x70: -120,
}
ALAW_POINTS = {
    0xD5: 8,  # +1 (13-bit), the smallest positive level
    0x55: -8,
    0xC6: 312,  # +39: segment 1, step 3
    0xAA: 32256,  # most positive: 4032
    0x2A: -32256,
}


def test_g711_decoder_code_points() -> None:
    for code, value in ULAW_POINTS.items():
        assert codecs.ULAW_DECODE_PCM16[code] == value, hex(code)
        assert codecs.ulaw_decode(bytes([code]))[0] == np.float32(value / 32768)
    for code, value in ALAW_POINTS.items():
        assert codecs.ALAW_DECODE_PCM16[code] == value, hex(code)
        assert codecs.alaw_decode(bytes([code]))[0] == np.float32(value / 32768)


def test_g711_encoder_decision_levels() -> None:
    # mu-law: 14-bit magnitudes 0 -> code 0xFF, [1, 3) -> 0xFE, [31, 35) -> 0xEF (segment 1), >= 8159 -> 0x80
    u = codecs.ulaw_encode_pcm16(np.array([0, 3, 4, 11, 12, 123, 124, 139, 140, 32767, -32768], np.int16))
    assert u.tolist() == [0xFF, 0xFF, 0xFE, 0xFE, 0xFD, 0xF0, 0xEF, 0xEF, 0xEE, 0x80, 0x00]
    # A-law: 13-bit magnitudes [0, 2) -> 0xD5, [2, 4) -> 0xD4; negative values in one's complement
    a = codecs.alaw_encode_pcm16(np.array([0, 15, 16, -1, -16, -17, 32767, -32768], np.int16))
    assert a.tolist() == [0xD5, 0xD5, 0xD4, 0x55, 0x55, 0x54, 0xAA, 0x2A]


def test_g711_every_code_is_a_fixed_point() -> None:
    # decoding a code and encoding the level again gives the same code (except -0 for mu-law, which is +0)
    u = codecs.ulaw_encode_pcm16(codecs.ULAW_DECODE_PCM16)
    assert np.array_equal(u[np.arange(256) != 0x7F], np.arange(256)[np.arange(256) != 0x7F])
    assert np.array_equal(codecs.alaw_encode_pcm16(codecs.ALAW_DECODE_PCM16), np.arange(256))


@pytest.mark.skipif(audioop is None, reason="audioop (the oracle) is not in this Python")
def test_g711_bit_exact_with_audioop_for_every_16_bit_sample() -> None:
    data = ALL_PCM16.astype("<i2").tobytes()
    assert codecs.ulaw_encode_pcm16(ALL_PCM16).tobytes() == audioop.lin2ulaw(data, 2)
    assert codecs.alaw_encode_pcm16(ALL_PCM16).tobytes() == audioop.lin2alaw(data, 2)
    every_code = bytes(range(256))
    assert codecs.ULAW_DECODE_PCM16.astype("<i2").tobytes() == audioop.ulaw2lin(every_code, 2)
    assert codecs.ALAW_DECODE_PCM16.astype("<i2").tobytes() == audioop.alaw2lin(every_code, 2)


def test_g711_round_trip_error_within_quantisation_step() -> None:
    x = np.random.default_rng(0).uniform(-0.99, 0.99, 200_000).astype(np.float32)
    x[:1000] *= 1e-3  # plenty of samples in the finest segments
    mag = np.abs(x).astype(np.float64)
    # mu-law: half a step of a segment is at most (|x| + 33 units)/32 of 14-bit full scale, plus one unit lost
    # reducing 16 to 14 bits; A-law: at most |x|/32 or one 13-bit unit in the linear first segments
    err_u = np.abs(codecs.ulaw_decode(codecs.ulaw_encode(x)) - x)
    assert np.all(err_u <= (mag * 8192 + 33) / 32 / 8192 + 1 / 8192 + 1e-7)
    err_a = np.abs(codecs.alaw_decode(codecs.alaw_encode(x)) - x)
    assert np.all(err_a <= np.maximum(mag / 32, 1 / 4096) + 1 / 4096 + 1e-7)
    # and they are real quantisers: round trips of a loud sine keep ~38 dB SNR
    sine = (0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 8000)).astype(np.float32)
    for codec in ("pcmu", "pcma"):
        fmt = AudioFormat(codec, 8000)
        noise = fmt.decode(fmt.encode(sine)) - sine
        assert 10 * np.log10(np.mean(sine**2) / np.mean(noise**2)) > 35


@pytest.mark.parametrize("encoding, size", [("pcm16", 2), ("f32", 4), ("pcmu", 1), ("pcma", 1)])
def test_audio_format_round_trip(encoding: str, size: int) -> None:
    fmt = AudioFormat(encoding, 16000)
    assert fmt.bytes_per_sample == size
    x = (0.3 * np.sin(np.arange(320) / 5)).astype(np.float32)
    data = fmt.encode(x)
    assert len(data) == 320 * size
    y = fmt.decode(data)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() <= {"pcm16": 1 / 32768, "f32": 0.0, "pcmu": 0.01, "pcma": 0.01}[encoding]
    assert fmt.encode(y) == data  # decoded levels are exact code points


def test_audio_format_validation() -> None:
    with pytest.raises(ValueError, match="pcm16 audio needs a whole number of 2-byte samples, got 3 bytes"):
        AudioFormat("pcm16", 24000).decode(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="f32 audio needs a whole number of 4-byte samples, got 6 bytes"):
        AudioFormat("f32", 24000).decode(bytes(6))
    with pytest.raises(ValueError, match="unknown audio encoding 'opus'"):
        AudioFormat("opus", 48000)
    for rate in (7999, 48001, 0, 16000.0, True):
        with pytest.raises(ValueError, match="8000..48000"):
            AudioFormat("pcm16", rate)  # type: ignore[arg-type]
    assert AudioFormat("pcmu", 8000).decode(b"").size == 0
    with pytest.raises(ValueError, match="1-D"):
        AudioFormat("pcm16", 8000).encode(np.zeros((2, 2), np.float32))
