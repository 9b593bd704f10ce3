"""media/tracks.py on live aiortc peers over loopback: the receive bypass, the paced 20 ms track, contained failures."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiortc
import numpy as np
import pytest
import tomllib
from aiortc.mediastreams import MediaStreamError
from webrtc_support import connect_pair

from app.webrtc_client import ArraySource
from media.jitter import JitterBuffer
from media.tracks import (
    AIORTC_VERSION,
    OUT_SAMPLES,
    RATE,
    AiortcMismatch,
    ContainedOpusEncoder,
    InboundAudio,
    OutboundAudioTrack,
    ReorderingTimestampMapper,
    install_receive_bypass,
    pcm_frame,
    receive_bypassed,
)

ROOT = Path(__file__).resolve().parents[1]


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


async def collect(track, n: int, timeout_s: float = 10.0) -> list[tuple[int, float]]:
    """(pts, arrival) of the next n frames from a remote track."""
    out = []
    async with asyncio.timeout(timeout_s):
        while len(out) < n:
            frame = await track.recv()
            out.append((frame.pts, time.monotonic()))
    return out


async def close(*pcs) -> None:
    for pc in pcs:
        await pc.close()


def test_aiortc_is_pinned_to_the_version_the_bypass_is_written_for():
    assert aiortc.__version__ == AIORTC_VERSION
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"aiortc=={AIORTC_VERSION}" in deps


def test_timestamp_mapper_takes_steps_back_as_reordering_and_forward_wraps_as_wraps():
    m = ReorderingTimestampMapper()
    base = (1 << 32) - 1920
    assert m.map(base) == 0
    assert m.map(base + 960) == 960
    assert m.map(base - 960) == -960                 # an older packet arrives late: before the first
    assert m.map(0) == 1920                          # 32-bit wrap forward
    assert m.map((1 << 32) - 960) == 960             # and a late one from before the wrap
    assert m.map(960) == 2880


async def read_until(rx, tap, packets: int) -> tuple[list[int], list[int]]:
    """Frames out of the remote track until `packets` reached the receiver: (pts list, lookahead list), where
    lookahead = packets that had arrived after the frame's own packet when the frame came out."""
    got, lookahead = [], []
    async with asyncio.timeout(10):
        while tap.handled < packets:
            frame = await rx.receiver.track.recv()
            got.append(frame.pts)
            lookahead.append(tap.handled - 1 - tap.index_of(frame.pts))
    return got, lookahead


def missing(tap, got: list[int]) -> set[int]:
    """Packets the receiver saw (or had dropped) whose frame never came out, up to the last frame that did."""
    last = tap.index_of(max(got))
    return {tap.pts_of(i) for i in range(last + 1)} - set(got)


async def test_bypass_delivers_each_packet_at_once_and_a_loss_is_exactly_one_missing_frame():
    track = OutboundAudioTrack(ArraySource(tone(4.0)))
    a, b, rx, _, tap = await connect_pair(track, bypass=True, drop=lambda i: i in (40, 41, 90))
    try:
        assert receive_bypassed(rx.receiver)
        got, lookahead = await read_until(rx, tap, 130)
        assert missing(tap, got) == {tap.pts_of(i) for i in (40, 41, 90)}
        assert got == sorted(got)
        # a frame comes out as soon as its packet is in (the stock buffer waits for 4 more: prefetch=4)
        assert np.percentile(lookahead, 95) <= 1
    finally:
        await close(a, b)


async def test_stock_buffer_holds_frames_back_and_loses_more_than_the_network_did():
    """What the bypass removes (aiortc 1.16.0, as measured in spec/webrtc.md §1): not our code, the reason for it."""
    track = OutboundAudioTrack(ArraySource(tone(4.0)))
    a, b, rx, _, tap = await connect_pair(track, bypass=False, drop=lambda i: i == 40)
    try:
        got, lookahead = await read_until(rx, tap, 130)
        assert min(lookahead) >= 4
        assert len(missing(tap, got)) > 1
    finally:
        await close(a, b)


async def test_bypass_hands_on_a_reordered_packet_with_its_own_pts():
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    a, b, rx, _, tap = await connect_pair(track, bypass=True, delay_s=lambda i: 0.07 if i == 30 else 0.0)
    try:
        got = [pts for pts, _ in await collect(rx.receiver.track, 60)]
        assert tap.delayed == [30]
        assert sorted(got) == [tap.pts_of(i) for i in range(60)]    # nothing lost, nothing mapped 2**32 away
        late = got.index(tap.pts_of(30))
        assert late > got.index(tap.pts_of(31))                      # it did come after newer ones
    finally:
        await close(a, b)


async def test_install_refuses_a_receiver_it_has_already_changed():
    track = OutboundAudioTrack(ArraySource(tone(1.0)))
    a, b, rx, _, _ = await connect_pair(track, bypass=True)
    try:
        with pytest.raises(AiortcMismatch):
            install_receive_bypass(rx.receiver)
    finally:
        await close(a, b)


async def test_outbound_track_returns_20ms_frames_on_a_contiguous_clock_and_silence_when_empty():
    track = OutboundAudioTrack(ArraySource(tone(0.1)))
    frames = [await track.recv() for _ in range(10)]
    assert [f.samples for f in frames] == [OUT_SAMPLES] * 10
    assert {(f.format.name, f.layout.name, f.sample_rate) for f in frames} == {("s16", "mono", RATE)}
    assert [f.pts for f in frames] == [i * OUT_SAMPLES for i in range(10)]
    assert np.abs(frames[0].to_ndarray()).max() > 5000
    assert np.abs(frames[-1].to_ndarray()).max() == 0          # 100 ms of tone, then silence
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_after_a_stall_the_clock_jumps_forward_instead_of_bursting():
    offset = [0.0]
    track = OutboundAudioTrack(ArraySource(tone(1.0)), clock=lambda: time.monotonic() + offset[0])
    first = [(await track.recv()).pts for _ in range(3)]
    offset[0] += 0.23                                  # the loop was away: the next frame is ~210 ms overdue
    after = await track.recv()
    following = await track.recv()
    assert first == [0, 480, 960]
    assert after.pts == 960 + 480 + 10 * OUT_SAMPLES   # the 10 frames it slept through are skipped, not sent
    assert following.pts == after.pts + OUT_SAMPLES
    assert track.stats.stalls == 1 and track.stats.skipped_ms == pytest.approx(200.0)


async def test_a_blocked_loop_gives_a_timestamp_jump_on_the_wire_not_a_burst():
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    a, b, rx, _, _ = await connect_pair(track, bypass=True)
    try:
        frames = await collect(rx.receiver.track, 10)
        time.sleep(0.25)                               # block the event loop: the sender can't run
        frames += await collect(rx.receiver.track, 15)
        assert track.stats.stalls == 1
        steps = np.diff([p for p, _ in frames])
        jump = int(np.argmax(steps))
        assert 200 <= steps[jump] / 48 <= 320          # RTP time jumped with the wall clock
        assert np.all(np.delete(steps, jump) == 960)
        # no burst: the frames after the stall arrive about 20 ms apart, not together
        t0 = frames[jump + 1][1]
        assert sum(1 for _, t in frames[jump + 2:] if t - t0 < 0.010) <= 1
    finally:
        await close(a, b)


class FlakySource(ArraySource):
    """A playout source with a bug on chosen reads: wrong length (the encoder must refuse it) or an exception."""

    def __init__(self, samples: np.ndarray, bad_reads: dict[int, str]) -> None:
        super().__init__(samples)
        self.reads = 0
        self.bad = bad_reads

    def read(self, n: int) -> np.ndarray:
        self.reads += 1
        kind = self.bad.get(self.reads)
        if kind == "raise":
            raise RuntimeError("playout bug")
        out = super().read(n)
        return np.concatenate([out, out]) if kind == "long" else out


async def test_encoder_and_source_failures_cost_one_frame_and_sending_goes_on():
    source = FlakySource(tone(3.0), {20: "long", 30: "raise"})
    track = OutboundAudioTrack(source)
    a, b, rx, encoder, _ = await connect_pair(track, bypass=True)
    try:
        got = [pts // 960 for pts, _ in await collect(rx.receiver.track, 60)]
        assert encoder.failures == 1                   # the 40 ms frame was refused and skipped
        assert track.stats.failures == 1               # the raising read became silence
        missing = set(range(max(got) + 1)) - set(got)
        skipped = round(track.stats.skipped_ms / 20)               # clock jumps while the call was set up
        assert len(missing) == skipped + 1                         # one frame missing on the wire, the rest flowed
    finally:
        await close(a, b)


def test_contained_encoder_recovers_after_a_codec_failure():
    enc = ContainedOpusEncoder()
    assert enc.encode(pcm_frame(np.zeros(960, np.float32), 0)) == ([], None)
    payloads, ts = enc.encode(pcm_frame(tone(0.02), 480))
    assert len(payloads) == 1 and ts == 0
    payloads, ts = enc.encode(pcm_frame(tone(0.02), 960 + 4800))
    assert ts == (480 + 4800) * 2                      # a pts jump is a jump on the 48 kHz RTP clock
    assert enc.failures == 1


async def test_inbound_audio_lands_each_packet_at_its_pts_in_the_jitter_buffer():
    """Loss leaves a gap that is read out as silence (concealed = lost), a reordered packet fills its own gap."""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    a, b, rx, _, tap = await connect_pair(track, bypass=True, drop=lambda i: i in (20, 21, 50),
                                          delay_s=lambda i: 0.05 if i == 70 else 0.0)
    buffer = JitterBuffer()
    inbound = InboundAudio(rx.receiver.track, buffer)
    reader = asyncio.ensure_future(inbound.run())
    frames = []
    try:
        async with asyncio.timeout(10):
            while tap.handled < 110:
                await asyncio.sleep(0.08)                  # the engine's tick
                frame = buffer.read_frame()
                if frame is not None:
                    frames.append(frame)
        st = buffer.stats()
        assert inbound.stats.late_frames == 1 and st.late_drops == 0
        assert inbound.stats.lost_frames == 4              # three lost, one gap only until the late packet came
        assert st.concealed_ms == pytest.approx(60.0)      # exactly the three lost 20 ms packets
        assert st.overrun_drops_ms == 0
        # the timeline is whole: what was read plus what waits covers first packet .. newest packet
        newest = max(tap.pts_of(i) for i in range(tap.handled) if i not in tap.dropped)
        assert len(frames) * 1920 + st.depth_ms * 24 == pytest.approx(newest // 2 + 480 - 16, abs=480)
        audio = np.concatenate(frames)
        assert np.sqrt(np.mean(audio[4800:] ** 2)) > 0.1   # the tone came through
    finally:
        reader.cancel()
        await close(a, b)


async def test_align_moves_the_read_grid_to_just_after_a_write_without_a_timestamp_gap():
    track = OutboundAudioTrack(ArraySource(tone(1.0)))
    pts = [(await track.recv()).pts for _ in range(3)]
    written = time.monotonic() + 0.007                 # a frame lands 7 ms from now, off the 20 ms grid
    await asyncio.sleep(0.007)
    track.align(written)
    t = [time.monotonic()]
    for _ in range(3):
        pts.append((await track.recv()).pts)
        t.append(time.monotonic())
    assert pts == [i * OUT_SAMPLES for i in range(6)]  # RTP time stays continuous
    assert written + 0.002 - 0.001 <= t[1] < written + 0.002 + 0.010
    assert track.stats.aligned == 1
    # a recv() already waiting for its due time is woken and re-timed
    waiting = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.001)
    due_before = t[-1] + 0.020
    track.align(time.monotonic() - 0.015)              # its new due time has already passed
    await waiting
    assert time.monotonic() < due_before
