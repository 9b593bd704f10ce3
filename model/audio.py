"""Offline audio helpers for files: WAV read/write, whole-signal resampling, and loudness normalisation.

Used by voice prompts and the offline CLI, where the whole signal is at hand (streaming paths use `media/`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_PCM = 1
_FLOAT = 3
_EXTENSIBLE = 0xFFFE


def read_wav(path: Path | str) -> tuple[np.ndarray, int]:
    """Read a RIFF/WAVE file (PCM 8/16/24/32-bit or IEEE float 32/64) -> (mono float32 in [-1, 1], rate)."""
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError(f"{path}: not a RIFF/WAVE file")
    fmt: tuple[int, int, int, int] | None = None
    pos = 12
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if tag == b"fmt ":
            code, channels, rate = struct.unpack("<HHI", body[:8])
            bits = struct.unpack("<H", body[14:16])[0]
            if code == _EXTENSIBLE and len(body) >= 26:
                code = struct.unpack("<H", body[24:26])[0]
            fmt = (code, channels, rate, bits)
        elif tag == b"data":
            if fmt is None:
                raise ValueError(f"{path}: 'data' chunk before 'fmt '")
            return _decode(body, *fmt, where=str(path)), fmt[2]
        pos += 8 + size + (size & 1)
    raise ValueError(f"{path}: no 'data' chunk")


def _decode(body: bytes, code: int, channels: int, rate: int, bits: int, where: str) -> np.ndarray:
    if channels < 1 or rate <= 0:
        raise ValueError(f"{where}: bad format ({channels} channels at {rate} Hz)")
    width = bits // 8
    usable = len(body) - len(body) % (width * channels)
    raw = body[:usable]
    if code == _PCM and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif code == _PCM and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif code == _PCM and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif code == _PCM and bits == 32:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / float(1 << 31)
    elif code == _FLOAT and bits in (32, 64):
        x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    else:
        raise ValueError(f"{where}: unsupported WAV encoding (format {code}, {bits} bits)")
    x = x.reshape(-1, channels).mean(axis=1)
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: non-finite samples")
    return x.astype(np.float32)


def write_wav(path: Path | str, samples: np.ndarray, rate: int) -> None:
    """Write mono PCM16."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + len(pcm), b"WAVE", b"fmt ", 16, _PCM, 1, rate,
                         rate * 2, 2, 16, b"data", len(pcm))
    Path(path).write_bytes(header + pcm)


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited resampling of a whole signal in the frequency domain."""
    if rate_in == rate_out or samples.size == 0:
        return samples.astype(np.float32)
    n_out = int(round(samples.size * rate_out / rate_in))
    spectrum = np.fft.rfft(samples.astype(np.float64))
    keep = min(spectrum.size, n_out // 2 + 1)
    out = np.zeros(n_out // 2 + 1, dtype=np.complex128)
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, n_out) * (n_out / samples.size)).astype(np.float32)


def _k_weighting_power(freqs: np.ndarray) -> np.ndarray:
    """|H(f)|^2 of the BS.1770 K-weighting (high shelf ~+4 dB above 1.5 kHz, high-pass at ~38 Hz), analog form."""
    f0_shelf, gain_db, q_shelf = 1681.97, 3.99984, 0.7071752
    f0_hp, q_hp = 38.1355, 0.5003270
    s = 1j * freqs / f0_shelf
    a = 10 ** (gain_db / 40)
    shelf = a * (a * s**2 + np.sqrt(a) / q_shelf * s + 1) / (s**2 + np.sqrt(a) / q_shelf * s + a)
    shelf = shelf / a  # unity at DC, +gain_db at high frequencies
    sh = 1j * freqs / f0_hp
    highpass = sh**2 / (sh**2 + sh / q_hp + 1)
    return np.abs(shelf * highpass) ** 2


def loudness_lufs(samples: np.ndarray, rate: int) -> float:
    """Integrated loudness (BS.1770 gating: 400 ms blocks, 75 % overlap, -70 LUFS and -10 LU gates)."""
    block, hop = int(0.4 * rate), int(0.1 * rate)
    if samples.size < block:
        samples = np.pad(samples, (0, block - samples.size))
    starts = range(0, samples.size - block + 1, hop)
    weight = _k_weighting_power(np.fft.rfftfreq(block, 1.0 / rate))
    powers = []
    for s in starts:
        spec = np.fft.rfft(samples[s : s + block].astype(np.float64))
        energy = (np.abs(spec) ** 2 * weight)
        energy[1:-1] *= 2  # one-sided spectrum
        powers.append(energy.sum() / block**2)
    z = np.asarray(powers)
    loud = -0.691 + 10 * np.log10(np.maximum(z, 1e-12))
    gated = z[loud > -70.0]
    if gated.size == 0:
        return -70.0
    relative = -0.691 + 10 * np.log10(gated.mean()) - 10.0
    final = z[(loud > -70.0) & (loud > relative)]
    return float(-0.691 + 10 * np.log10(max(final.mean(), 1e-12)))


def normalize_loudness(samples: np.ndarray, rate: int, target_lufs: float = -24.0) -> np.ndarray:
    """Scale to `target_lufs` as the reference does for `.wav` voice prompts; silence is left as it is."""
    current = loudness_lufs(samples, rate)
    if current <= -70.0:
        return samples.astype(np.float32)
    gain = 10 ** ((target_lufs - current) / 20)
    return (samples * gain).astype(np.float32)
