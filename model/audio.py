"""Offline audio helpers for files: WAV read/write, whole-signal resampling, and loudness normalisation.

Used by voice prompts and the offline CLI, where the whole signal is at hand (streaming paths use `media/`).
Each step is the library the reference uses or the maintained one for the job, so a `.wav` voice reaches Mimi as
the same float32 samples as in NVIDIA's PersonaPlex: read (soundfile), resample to 24 kHz (sphn, the reference's
own resampler), normalise to -24 LUFS (pyloudnorm, the reference's own meter), in that order (docs/fidelity.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile
import sphn

VOICE_LUFS = -24.0
BLOCK_SECONDS = 0.4  # BS.1770 gating block: pyloudnorm needs at least one


def read_wav(path: Path | str) -> tuple[np.ndarray, int]:
    """Read an audio file (WAV in any PCM/float encoding) -> (mono float32, rate); channels are averaged."""
    try:
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except RuntimeError as exc:  # soundfile.LibsndfileError
        raise ValueError(f"{path}: cannot read audio ({exc})") from exc
    x = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1)
    if not np.isfinite(x).all():
        raise ValueError(f"{path}: non-finite samples")
    return np.ascontiguousarray(x, dtype=np.float32), int(rate)


def write_wav(path: Path | str, samples: np.ndarray, rate: int) -> None:
    """Write mono PCM16 (clipped to [-1, 1] first: libsndfile would wrap what lies outside)."""
    soundfile.write(str(path), np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0), rate, subtype="PCM_16")


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Resample a whole signal as the reference does (sphn: rubato's FFT resampler, 1024-sample chunks).

    Not soxr: sphn's filter, its delay (32 ms from 16 kHz) and its padded tail all change Mimi's codes, so only the
    reference's own resampler gives its tokens for a voice or input recorded at another rate.
    """
    x = np.ascontiguousarray(samples, dtype=np.float32)
    if rate_in == rate_out or x.size == 0:
        return x
    return np.asarray(sphn.resample(x, src_sample_rate=rate_in, dst_sample_rate=rate_out), dtype=np.float32)


def loudness_lufs(samples: np.ndarray, rate: int) -> float:
    """Integrated loudness by ITU-R BS.1770-4 (pyloudnorm); -inf for silence. Needs at least one 400 ms block."""
    if samples.size < BLOCK_SECONDS * rate:
        raise ValueError(f"{samples.size / rate:.3f} s of audio is shorter than one {BLOCK_SECONDS} s loudness block")
    # Imported here: it brings scipy.signal (1.3 s), which only a .wav voice needs (an engine imports it at start).
    import pyloudnorm

    return float(pyloudnorm.Meter(rate).integrated_loudness(np.asarray(samples, dtype=np.float32)))


def normalize_loudness(samples: np.ndarray, rate: int, target_lufs: float = VOICE_LUFS) -> np.ndarray:
    """Scale to `target_lufs` as the reference does for `.wav` voice prompts: one gain, no clipping.

    Silence (or anything under BS.1770's -70 LUFS gate) measures -inf and is left as it is: the reference scales
    it by an infinite gain into NaNs.
    """
    x = np.asarray(samples, dtype=np.float32)
    current = loudness_lufs(x, rate)
    if not np.isfinite(current):
        return x
    # The reference multiplies float32 samples by a float64 gain (float64 result) and Mimi takes float32.
    gain = np.power(10.0, (target_lufs - current) / 20.0)
    return (gain * x).astype(np.float32)
