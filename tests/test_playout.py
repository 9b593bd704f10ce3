"""PlayoutBuffer driven by a deterministic schedule: engine writes of 80 ms, consumer reads of 20 ms."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from media.playout import PlayoutBuffer, PlayoutConfig


def frames(count: int, size: int, seed: int = 0) -> list[np.ndarray]:
    """Non-silent frames (no exact zeros), so played audio can be told apart from inserted silence."""
    rng = np.random.default_rng(seed)
    return [(0.1 + 0.5 * rng.random(size)).astype(np.float32) for _ in range(count)]


def drive(buf: PlayoutBuffer, written: list[np.ndarray | None], chunk: int, reads_per_write: int = 4) -> np.ndarray:
    """Write one item of `written` (None: the engine missed that tick) then make `reads_per_write` reads."""
    out = []
    for frame in written:
        if frame is not None:
            assert buf.write(frame)
        out += [buf.read(chunk) for _ in range(reads_per_write)]
    return np.concatenate(out)


@pytest.mark.parametrize("rate", [48000, 24000, 8000])
def test_steady_stream_is_continuous_after_the_prebuffer(rate: int) -> None:
    chunk, frame = rate // 50, rate * 2 // 25
    buf = PlayoutBuffer(rate)
    src = frames(125, frame)  # 10 s
    out = drive(buf, src, chunk)
    assert out.size == 125 * 4 * chunk  # every read returned exactly 20 ms
    lead = 2 * chunk  # 40 ms prebuffer: two reads of silence, then the stream without a gap
    assert not out[:lead].any()
    np.testing.assert_array_equal(out[lead:], np.concatenate(src)[: out.size - lead])
    s = buf.stats()
    assert (s.underruns, s.underrun_ms, s.shed_ms) == (0, 0.0, 0.0)
    assert s.depth_ms == pytest.approx(40.0)  # the prebuffer is the standing slack
    assert s.drained_samples == out.size - lead


def test_reads_are_silence_before_any_audio() -> None:
    buf = PlayoutBuffer(48000)
    for n in (960, 1, 4000):
        out = buf.read(n)
        assert out.shape == (n,) and out.dtype == np.float32 and not out.any()
    assert buf.stats().underruns == 0 and buf.stats().underrun_ms == 0.0
    with pytest.raises(ValueError):
        buf.read(0)


def test_underrun_pads_with_silence_and_grows_the_prebuffer_then_it_decays() -> None:
    buf = PlayoutBuffer(24000)
    src = frames(240, 1920, seed=1)  # 19.2 s
    missing = 60  # the engine misses one tick
    out = drive(buf, [None if i == missing else f for i, f in enumerate(src)], 480)
    s = buf.stats()
    assert s.underruns == 1
    # 40 ms of slack ran out 40 ms into the missing 80 ms; then 60 ms of prebuffer before playing again
    assert s.underrun_ms == pytest.approx(40.0 + 60.0)
    played = out[out != 0.0]
    expected = np.concatenate([f for i, f in enumerate(src) if i != missing])
    np.testing.assert_array_equal(played, expected[: played.size])  # nothing lost, order kept
    assert s.prebuffer_ms == pytest.approx(40.0)  # +20 at the underrun, -20 after 10 s of clean reads

    buf2 = PlayoutBuffer(24000)
    drive(buf2, [None if i == missing else f for i, f in enumerate(src[:100])], 480)
    assert buf2.stats().prebuffer_ms == pytest.approx(60.0)  # before the quiet period has passed


def test_clear_drops_queued_and_stale_audio() -> None:
    buf = PlayoutBuffer(24000)
    old, new = frames(2, 1920, seed=2), frames(1, 1920, seed=3)
    gen = buf.generation
    assert buf.write(old[0], gen)
    assert not buf.read(480).any() and not buf.read(480).any()  # prebuffering
    assert buf.read(480).any()  # playing
    assert buf.write(old[1], gen)
    new_gen = buf.clear()
    assert new_gen == gen + 1 == buf.generation
    assert not buf.read(480).any()  # the queued reply is gone at once
    assert not buf.write(old[0], gen)  # a frame the engine finished under the old generation
    assert buf.write(new[0], new_gen)
    out = np.concatenate([buf.read(480) for _ in range(6)])
    np.testing.assert_array_equal(out[out != 0.0], new[0])
    s = buf.stats()
    assert s.stale_writes == 1
    assert s.cleared_ms == pytest.approx(2 * 80 - 20)
    assert s.written_samples == s.drained_samples  # every written sample was played or cleared


def test_no_burst_after_a_consumer_stall() -> None:
    buf = PlayoutBuffer(48000)
    src = frames(20, 3840, seed=4)
    out = [buf.read(960) for _ in range(2)]
    for f in src[:10]:  # the consumer stalls for 800 ms while the engine keeps writing
        buf.write(f)
    s = buf.stats()
    assert s.depth_ms <= 40 + 160
    assert s.shed_ms == pytest.approx(10 * 80 - s.depth_ms)
    out += [buf.read(960) for _ in range(3)]
    resumed = np.concatenate(out[2:])  # plays at once: the backlog already covers the prebuffer
    tail = np.concatenate(src[:10])[-round(s.depth_ms * 48) :]
    np.testing.assert_array_equal(resumed, tail[: resumed.size])  # the newest audio, not the backlog


def test_prebuffer_is_clamped() -> None:
    cfg = PlayoutConfig()
    buf = PlayoutBuffer(8000, cfg)
    for _ in range(10):  # repeated starvation: every write is followed by more reads than it covers
        buf.write(np.full(160, 0.5, np.float32))
        for _ in range(12):
            buf.read(160)
    s = buf.stats()
    assert s.underruns >= 5
    assert s.prebuffer_ms == cfg.max_prebuffer_ms


@pytest.mark.parametrize("bad", [np.zeros((2, 4), np.float32), np.array([np.inf], np.float32)])
def test_bad_writes_are_refused(bad: np.ndarray) -> None:
    buf = PlayoutBuffer(24000)
    with pytest.raises(ValueError):
        buf.write(bad)
    assert buf.stats().written_samples == 0


def test_engine_and_consumer_threads() -> None:
    buf = PlayoutBuffer(24000, PlayoutConfig(headroom_ms=1e6))  # no shedding: every sample must come out
    src = frames(300, 1920, seed=5)
    total = sum(f.size for f in src)
    played: list[np.ndarray] = []

    def engine() -> None:
        for f in src:
            buf.write(f, buf.generation)

    def consumer() -> None:
        got = 0
        while got < total:
            out = buf.read(480)
            out = out[out != 0.0]
            played.append(out)
            got += out.size

    threads = [threading.Thread(target=engine), threading.Thread(target=consumer)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    np.testing.assert_array_equal(np.concatenate(played), np.concatenate(src))
