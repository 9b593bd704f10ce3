"""media/tracks.py on live aiortc peers over loopback: the receive path in place of aiortc's jitter buffer, the paced
20 ms track, contained failures."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiortc
import numpy as np
import pytest
import tomllib
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket
from webrtc_support import connect_pair

from app.doors.webrtc.client import ArraySource
from media.jitter import JitterBuffer, JitterConfig
from media.opus import OpusDecoder
from media.red import pack, unpack
from media.tracks import (
    AIORTC_VERSION,
    OUT_SAMPLES,
    RATE,
    AiortcMismatch,
    ContainedOpusEncoder,
    InboundAudio,
    OutboundAudioTrack,
    ReorderingTimestampMapper,
    pcm_frame,
)

ROOT = Path(__file__).resolve().parents[1]


def tone(seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


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


class Arrivals:
    """A PtsSink noting, per packet, its frame number (20 ms units) and how many packets the receiver had handled."""

    def __init__(self) -> None:
        self.tap = None
        self.got: list[tuple[int, int, float]] = []          # (frame number, packets handled, arrival)

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        self.got.append(((pts + OUT_SAMPLES // 2) // OUT_SAMPLES, self.tap.handled, now))

    def frames(self) -> list[int]:
        return [n for n, _, _ in self.got]


async def pair(track, **options):
    sink = Arrivals()
    a, b, rx, encoder, tap, inbound = await connect_pair(track, sink=sink, **options)
    return a, b, rx, encoder, tap, inbound, sink


async def until_handled(tap, packets: int) -> None:
    async with asyncio.timeout(10):
        while tap.handled < packets:
            await asyncio.sleep(0.02)


def frame_of(tap, index: int) -> int:
    return tap.pts_of(index) // 960


async def test_each_packet_lands_as_it_arrives_and_a_loss_is_exactly_one_missing_frame():
    track = OutboundAudioTrack(ArraySource(tone(4.0)))
    a, b, _, _, tap, inbound, sink = await pair(track, drop=lambda i: i in (40, 41, 90))
    try:
        await until_handled(tap, 130)
        got = sink.frames()
        missing = set(range(max(got) + 1)) - set(got)
        dropped = {frame_of(tap, i) for i in (40, 41, 90)}
        # Frames the track's clock jumped over while the call was set up (a busy loop) were never sent: a pts gap,
        # which the receiver counts with the losses.
        skipped = missing - dropped
        assert dropped <= missing and len(skipped) == round(track.stats.skipped_ms / 20)
        assert not skipped & {frame_of(tap, i) for i in range(tap.handled)}
        assert got == sorted(got) and inbound.stats.lost_frames == 3 + len(skipped)
        # written into the sink while its own packet is handled (the stock buffer waits for 4 more: prefetch=4)
        assert all(handled - 1 == tap.index_of(n * 960) for n, handled, _ in sink.got)
    finally:
        await close(a, b)


async def test_stock_buffer_holds_frames_back_and_loses_more_than_the_network_did():
    """What InboundAudio replaces (aiortc 1.16.0, as measured in spec/webrtc.md §1): the reason for it."""
    track = OutboundAudioTrack(ArraySource(tone(4.0)))
    a, b, rx, _, tap, _ = await connect_pair(track, drop=lambda i: i == 40)
    try:
        got, lookahead = [], []
        async with asyncio.timeout(10):
            while tap.handled < 130:
                frame = await rx.receiver.track.recv()
                got.append(frame.pts)
                lookahead.append(tap.handled - 1 - tap.index_of(frame.pts))
        assert min(lookahead) >= 4
        last = tap.index_of(max(got))
        assert len({tap.pts_of(i) for i in range(last + 1)} - set(got)) > 1
    finally:
        await close(a, b)


async def test_a_reordered_packet_lands_at_its_own_pts():
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    a, b, _, _, tap, inbound, sink = await pair(track, delay_s=lambda i: 0.07 if i == 30 else 0.0)
    try:
        await until_handled(tap, 61)
        await asyncio.sleep(0.1)
        got = sink.frames()[:60]
        assert tap.delayed == [30]
        assert sorted(got) == [frame_of(tap, i) for i in range(60)]  # nothing lost, nothing mapped 2**32 away
        assert got.index(frame_of(tap, 30)) > got.index(frame_of(tap, 31))
        assert inbound.stats.late_frames == 1
    finally:
        await close(a, b)


async def test_fec_counts_only_losses_it_rebuilt_not_a_reordered_packet_it_stood_in_for():
    """A packet held back 70 ms looks lost when its successor comes: FEC fills its place then. When the original
    comes after all, that rebuild recovered no loss: fec_frames counts only the real loss (packet 20), so a caller's
    loss minus fec_frames is what the buffer had to conceal. (libopus adds FEC to a steady tone's first ~30 packets
    only: its voice detector then calls it no speech.)"""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    a, b, _, _, tap, inbound, sink = await pair(track, encoder=ContainedOpusEncoder(expected_loss_pct=10),
                                                drop=lambda i: i == 20, delay_s=lambda i: 0.07 if i == 10 else 0.0)
    try:
        await until_handled(tap, 40)
        await asyncio.sleep(0.1)
        st = inbound.stats
        assert tap.delayed == [10] and st.late_frames == 1
        assert (st.fec_frames, st.fec_superseded) == (1, 1)
    finally:
        await close(a, b)


async def test_the_receiver_can_be_taken_over_only_once():
    track = OutboundAudioTrack(ArraySource(tone(1.0)))
    a, b, rx, _, _, _, _ = await pair(track)
    try:
        with pytest.raises(AiortcMismatch):
            InboundAudio(rx.receiver, Arrivals())
    finally:
        await close(a, b)


async def test_ended_returns_when_the_peer_goes_away():
    track = OutboundAudioTrack(ArraySource(tone(1.0)))
    a, b, _, _, tap, inbound, _ = await pair(track)
    await until_handled(tap, 5)
    ended = asyncio.ensure_future(inbound.ended())
    await asyncio.sleep(0.05)
    assert not ended.done()
    await a.close()
    await asyncio.wait_for(ended, 10)
    await b.close()


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


async def test_a_stall_gives_a_timestamp_jump_on_the_wire_not_a_burst():
    """The sender's clock jumps 250 ms (what a blocked event loop looks like to it): the RTP time on the wire jumps
    with it, and the frames after come 20 ms apart, not in a burst. A loaded machine's own stalls (a recv() 40 ms
    late) are counted by the track and may add small jumps of their own."""
    offset = [0.0]
    track = OutboundAudioTrack(ArraySource(tone(3.0)), clock=lambda: time.monotonic() + offset[0])
    a, b, _, _, tap, _, sink = await pair(track)
    try:
        await until_handled(tap, 10)
        offset[0] += 0.25
        await until_handled(tap, 25)
        frames = sink.got[:25]
        steps = np.diff([n for n, _, _ in frames])
        jump = int(np.argmax(steps))
        assert 12 <= steps[jump] <= 16                 # RTP time jumped with the clock (~250 ms)
        assert np.count_nonzero(np.delete(steps, jump) != 1) <= track.stats.stalls - 1
        # no burst: the frames after the stall arrive about 20 ms apart, not together
        t0 = frames[jump + 1][2]
        assert sum(1 for _, _, t in frames[jump + 2:] if t - t0 < 0.010) <= 1
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
    a, b, _, encoder, tap, _, sink = await pair(track)
    try:
        await until_handled(tap, 60)
        got = sink.frames()
        assert encoder.failures == 1                   # the 40 ms frame was refused and skipped
        assert track.stats.failures == 1               # the raising read became silence
        missing = set(range(max(got) + 1)) - set(got)
        skipped = round(track.stats.skipped_ms / 20)   # clock jumps while the call was set up
        assert len(missing) == skipped + 1             # one frame missing on the wire, the rest flowed
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


async def test_loss_is_concealed_and_a_late_packet_fills_its_gap_in_the_jitter_buffer():
    """Loss leaves a gap that is read out as silence (concealed = lost), a reordered packet fills its own gap.
    The buffer does not accelerate: the tone never pauses, and the timeline is checked sample for sample."""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    buffer = JitterBuffer(config=JitterConfig(accelerate_after_s=None))
    a, b, _, _, tap, inbound = await connect_pair(track, sink=buffer, drop=lambda i: i in (20, 21, 50),
                                                  delay_s=lambda i: 0.05 if i == 70 else 0.0)
    frames = []
    tick_at = time.monotonic()
    try:
        async with asyncio.timeout(10):
            while tap.handled < 110:
                # The engine's tick: every 80 ms on the clock, not 80 ms after the last read (a loaded loop's lag
                # would add up, and the reader fall behind the sender until the buffer overran).
                tick_at += 0.08
                await asyncio.sleep(max(0.0, tick_at - time.monotonic()))
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
        await close(a, b)


async def test_a_realign_a_packet_or_more_later_skips_timestamps_instead_of_standing_as_delay():
    offset = [0.0]
    track = OutboundAudioTrack(ArraySource(tone(1.0)), clock=lambda: time.monotonic() + offset[0])
    first = [(await track.recv()).pts for _ in range(3)]   # read at start, +20, +40 ms; the next is due at +60
    # The playout ran dry: the next frame is written 57 ms after that read was due.
    written = track.stats.started_at + 0.060 + 0.057
    track.align(written, after_s=0.0)
    offset[0] = written + 0.001 - time.monotonic()   # the clock is at the new due time
    after = await track.recv()
    assert first == [0, 480, 960]
    assert after.pts == 960 + OUT_SAMPLES + 2 * OUT_SAMPLES   # the two whole packets it spans are skipped
    assert track.stats.skipped_ms == pytest.approx(40.0) and track.stats.aligned == 1


async def test_align_moves_the_read_grid_to_just_after_a_write_without_a_timestamp_gap():
    """The track's clock is set back 5 s before each align: left alone, its next read would wait those 5 s; aligned,
    it comes at the write's time + 2 ms (never before), well within the 2 s each read gets here, however loaded the
    machine."""
    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]
    track = OutboundAudioTrack(ArraySource(tone(1.0)), clock=clock)
    pts = [(await track.recv()).pts for _ in range(3)]
    offset[0] -= 5.0                                   # the grid's next read is 5 s away now
    written = clock() + 0.007                          # a frame lands 7 ms from now, off the 20 ms grid
    await asyncio.sleep(0.007)
    track.align(written)
    pts.append((await asyncio.wait_for(track.recv(), 2.0)).pts)
    assert clock() >= written + 0.002                  # not before its aligned time
    pts += [(await track.recv()).pts for _ in range(2)]
    assert pts == [i * OUT_SAMPLES for i in range(6)]  # RTP time stays continuous
    assert track.stats.aligned == 1
    # a recv() already waiting for its due time (5 s away again) is woken and re-timed
    offset[0] -= 5.0
    waiting = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.001)
    track.align(clock() - 0.015)                       # its new due time has already passed
    assert (await asyncio.wait_for(waiting, 2.0)).pts == 6 * OUT_SAMPLES


class Heard(Arrivals):
    """Arrivals that also keep each pushed frame's samples."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[int, np.ndarray] = {}

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        super().push(pts, samples, now)
        self.samples[self.got[-1][0]] = samples


def decoded_in_order(tap, packets: int) -> dict[int, np.ndarray]:
    """Every packet the sender sent (the tap saw each, dropped or not), its primary decoded by a fresh decoder in
    order: what the receiver hears with no loss at all."""
    decoder = OpusDecoder(RATE)
    return {frame_of(tap, i): decoder.decode(unpack(tap.payloads[i])[-1].data) for i in range(packets)}


async def test_with_red_a_lost_packet_comes_back_whole_from_the_next_one():
    """Both peers took RED (the offer proposed it, as a browser's does): each packet carries the one before it, so
    a lost packet is rebuilt bit for bit, and what the receiver hears is what it hears with no loss at all."""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    sink = Heard()
    a, b, _, _, tap, inbound = await connect_pair(track, sink=sink, red=True, drop=lambda i: i in (40, 90))
    sink.tap = tap
    try:
        await until_handled(tap, 120)
        st = inbound.stats
        assert (st.lost_frames, st.red_frames, st.fec_frames) == (2 + round(track.stats.skipped_ms / 20), 2, 0)
        assert st.red_packets == st.frames >= 118        # every packet came as RED
        whole = decoded_in_order(tap, 119)
        assert {frame_of(tap, 40), frame_of(tap, 90)} <= set(sink.samples)
        for frame, samples in whole.items():
            np.testing.assert_array_equal(sink.samples[frame], samples)
    finally:
        await close(a, b)


async def test_with_red_two_losses_in_a_row_leave_the_first_and_a_reordered_packet_is_no_loss():
    """Once redundant (Chromium's `111/111`), two packets lost in a row leave a gap of one; a packet held back 70 ms
    is rebuilt from its successor first, and when it comes after all, that rebuild counts as no loss."""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    sink = Heard()
    a, b, _, _, tap, inbound = await connect_pair(track, sink=sink, red=True, drop=lambda i: i in (40, 41),
                                                  delay_s=lambda i: 0.07 if i == 20 else 0.0)
    sink.tap = tap
    try:
        await until_handled(tap, 60)
        await asyncio.sleep(0.1)
        st = inbound.stats
        assert frame_of(tap, 40) not in sink.samples and frame_of(tap, 41) in sink.samples
        assert (st.red_frames, st.red_superseded, st.late_frames) == (1, 1, 1)
    finally:
        await close(a, b)


async def test_with_red_deepened_by_the_sender_two_losses_in_a_row_both_come_back():
    """A sender that carries two earlier packets where the format names one (the server deepens its RED on a lossy
    link: media.red.RedDepth): the receiver takes both blocks, so two packets lost in a row come back whole."""
    track = OutboundAudioTrack(ArraySource(tone(3.0)))
    sink = Heard()
    a, b, _, encoder, tap, inbound = await connect_pair(track, sink=sink, red=True, drop=lambda i: i in (60, 61))
    encoder.red.depth = 2
    sink.tap = tap
    try:
        await until_handled(tap, 80)
        await asyncio.sleep(0.1)
        assert inbound.red.redundant == 1 and len(unpack(tap.payloads[-1])) == 3
        assert frame_of(tap, 60) in sink.samples and frame_of(tap, 61) in sink.samples
        assert inbound.stats.red_frames == 2
    finally:
        await close(a, b)


async def test_a_red_packet_keeps_its_own_audio_past_a_bad_block_and_is_read_at_most_two_blocks_deep():
    """Crafted RED payloads straight into the receive path once the call has stopped: an undecodable redundant block
    is skipped (counted bad) and the packet's own audio still lands; a packet of fifty copies of the same block
    costs one decode (at most MAX_REDUNDANT blocks are read, and copies of one place fill it once); a block that is
    not Opus makes the packet bad."""
    track = OutboundAudioTrack(ArraySource(tone(1.0)))
    sink = Heard()
    a, b, _, _, tap, inbound = await connect_pair(track, sink=sink, red=True)
    sink.tap = tap
    await until_handled(tap, 10)
    await close(a, b)
    st, fmt = inbound.stats, inbound.red
    opus = unpack(tap.payloads[-1])[-1].data
    last = max(tap.timestamps, key=lambda ts: (ts - tap.timestamps[0]) % (1 << 32))

    def packet(k: int, payload: bytes) -> RtpPacket:
        p = RtpPacket(payload_type=fmt.payload_type, sequence_number=60000 + k, timestamp=(last + 960 * k) % (1 << 32))
        p._data = payload
        return p

    before = (st.frames, st.bad_frames, st.red_frames, len(sink.got))
    inbound.add(packet(2, pack(fmt.opus_type, opus, [(960, b"\xff\xff\xff")])))     # a gap of one before it
    assert (st.frames, st.bad_frames, st.red_frames, len(sink.got)) == (before[0] + 1, before[1] + 1, before[2],
                                                                          before[3] + 1)
    inbound.add(packet(4, pack(fmt.opus_type, opus, [(960, opus)] * 50)))
    assert (st.red_frames, len(sink.got)) == (before[2] + 1, before[3] + 3)
    bad = bytearray(pack(fmt.opus_type, opus, [(960, opus)]))
    bad[0] = 0x80 | 0                                                               # a PCMU block
    inbound.add(packet(6, bytes(bad)))
    assert (st.bad_frames, len(sink.got)) == (before[1] + 2, before[3] + 3)
