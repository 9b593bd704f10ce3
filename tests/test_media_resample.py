"""Streaming resampler: quality against the ideal signal, chunk independence, no drift, stream control."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from media.resample import Resampler


def sine(freq: float, rate: int, n: int, delay_s: float = 0.0) -> np.ndarray:
    return 0.5 * np.sin(2 * np.pi * freq * (np.arange(n) / rate - delay_s))


def stream(r: Resampler, x: np.ndarray, chunk: int) -> np.ndarray:
    return np.concatenate([r.process(x[i : i + chunk]) for i in range(0, x.size, chunk)])


@pytest.mark.parametrize(
    "in_rate, out_rate, freq, min_snr_db",
    [
        (8000, 24000, 440.0, 45),
        (8000, 24000, 3000.0, 45),
        (16000, 24000, 5000.0, 45),
        (48000, 24000, 1000.0, 60),
        (48000, 24000, 9000.0, 60),
        (24000, 48000, 1000.0, 60),
        (24000, 8000, 3000.0, 60),
    ],
)
def test_sine_in_20ms_chunks_matches_the_ideal_sine(
    in_rate: int, out_rate: int, freq: float, min_snr_db: float
) -> None:
    x = sine(freq, in_rate, 2 * in_rate).astype(np.float32)
    y = stream(Resampler(in_rate, out_rate), x, in_rate // 50).astype(np.float64)
    skip = out_rate // 100  # the filter's start-up transient
    t = np.arange(y.size) / out_rate
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
    (c_sin, c_cos), *_ = np.linalg.lstsq(basis[skip:], y[skip:], rcond=None)
    delay_s = -np.arctan2(c_cos, c_sin) / (2 * np.pi * freq)
    assert abs(delay_s) * out_rate < 1.0  # swr keeps timestamps: the constant delay is under a sample
    ideal = sine(freq, out_rate, y.size, delay_s)
    snr = 10 * np.log10(np.mean(ideal[skip:] ** 2) / np.mean((y[skip:] - ideal[skip:]) ** 2))
    assert snr > min_snr_db


def test_downsampling_rejects_aliases() -> None:
    # 16 kHz at 48 kHz would fold to 8 kHz at 24 kHz; the anti-alias filter removes it
    x = sine(16000, 48000, 48000).astype(np.float32)
    y = stream(Resampler(48000, 24000), x, 960)
    assert 10 * np.log10(np.mean(y[2400:] ** 2) / np.mean(x**2)) < -60


@pytest.mark.parametrize("in_rate, out_rate", [(8000, 24000), (48000, 24000), (24000, 48000), (11025, 24000)])
def test_chunking_does_not_change_the_output(in_rate: int, out_rate: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(in_rate * 2) * 0.1).astype(np.float32)
    whole = Resampler(in_rate, out_rate)
    expected = np.concatenate([whole.process(x), whole.flush()])
    pieces = Resampler(in_rate, out_rate)
    out, pos = [], 0
    for n in rng.integers(1, in_rate // 20, 10_000):  # ragged chunks, as WebSocket appends arrive
        if pos >= x.size:
            break
        out.append(pieces.process(x[pos : pos + n]))
        pos += n
    out.append(pieces.process(x[pos:]))
    out.append(pieces.flush())
    np.testing.assert_array_equal(np.concatenate(out), expected)
    assert expected.size == round(x.size * out_rate / in_rate)


@pytest.mark.parametrize("in_rate, out_rate, chunk", [(48000, 24000, 960), (8000, 24000, 160), (24000, 48000, 1920)])
def test_no_drift_over_a_minute(in_rate: int, out_rate: int, chunk: int) -> None:
    r = Resampler(in_rate, out_rate)
    x = (np.random.default_rng(1).standard_normal(chunk) * 0.1).astype(np.float32)
    held = []
    for _ in range(60 * in_rate // chunk):
        r.process(x)
        held.append(r.held_back)
    # output length tracks input x ratio; what is held back stays a constant few ms
    assert max(held) == min(held)
    assert 0 < held[-1] < 0.003 * out_rate
    total_in = 60 * in_rate
    assert r.samples_out + held[-1] == pytest.approx(total_in * out_rate / in_rate)
    assert r.flush().size == held[-1]


def test_identity_is_a_copy() -> None:
    r = Resampler(24000, 24000)
    x = np.linspace(-1, 1, 480, dtype=np.float32)
    y = r.process(x)
    np.testing.assert_array_equal(y, x)
    assert y is not x
    assert r.flush().size == 0 and r.held_back == 0


def test_flush_and_reset_start_new_streams() -> None:
    x = sine(440, 8000, 800).astype(np.float32)
    fresh = Resampler(8000, 24000)
    first = np.concatenate([fresh.process(x), fresh.flush()])
    assert first.size == 2400
    assert fresh.samples_in == 0  # flush started a new stream ...
    np.testing.assert_array_equal(np.concatenate([fresh.process(x), fresh.flush()]), first)  # ... from scratch
    fresh.process(x[:400])
    fresh.reset()  # drops the held-back tail and the filter history
    np.testing.assert_array_equal(np.concatenate([fresh.process(x), fresh.flush()]), first)


def test_input_validation() -> None:
    r = Resampler(48000, 24000)
    with pytest.raises(ValueError, match="1-D"):
        r.process(np.zeros((2, 960), np.float32))
    assert r.process(np.zeros(0, np.float32)).size == 0
    with pytest.raises(ValueError, match="positive"):
        Resampler(0, 24000)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_resamplers_start_no_threads() -> None:
    """FFmpeg gives every filter graph a pool of worker threads by default (3 a graph on 2 cores), which a resampler
    never uses; a session's resamplers live until the garbage collector frees its call, so a worker held ~100 idle
    threads after a soak."""
    def threads() -> int:
        return len(list(Path("/proc/self/task").iterdir()))

    before = threads()
    resamplers = [Resampler(8000, 24000) for _ in range(5)] + [Resampler(24000, 48000) for _ in range(5)]
    outputs = [r.process(np.zeros(960, np.float32)) for r in resamplers]
    assert all(out.size for out in outputs)
    assert threads() - before < 3  # the test process's own threads may come and go; a pool a graph would be 30


@pytest.mark.parametrize("out_rate", [8000, 11025, 16000, 22050, 32000, 44100, 48000])
def test_a_primed_resampler_gives_every_frame_whole_from_the_first(out_rate: int) -> None:
    rng = np.random.default_rng(out_rate)
    r = Resampler(24000, out_rate, primed=True)
    whole = 1920 * out_rate // 24000
    for _ in range(2):                              # a fresh stream, then one after flush()
        assert [r.process(0.1 * rng.standard_normal(1920).astype(np.float32)).size for _ in range(5)] == [whole] * 5
        r.flush()
    # The priming is the filter's delay in silence, before the stream's own audio; an unprimed one is short first.
    assert Resampler(24000, out_rate).process(np.zeros(1920, np.float32)).size < whole


def test_the_wire_gets_whole_frames_at_every_output_rate() -> None:
    from app.sessions.audio import OutputEncoder, parse_format

    for fmt, frame_bytes in ((parse_format("pcm16", 16000), 2560), (parse_format("g711_ulaw"), 640),
                             (parse_format("pcm16", 48000), 7680)):
        encoder = OutputEncoder(fmt)
        assert [len(encoder.encode(np.zeros(1920, np.float32))) for _ in range(3)] == [frame_bytes] * 3
        encoder.reset()
        assert len(encoder.encode(np.zeros(1920, np.float32))) == frame_bytes
