"""aiortc audio tracks: a pass-through receive path and a paced 20 ms outbound track.

Receive: aiortc's audio `JitterBuffer(capacity=16, prefetch=4)` adds ~81 ms and, after one lost packet, ~281 ms for
good while it throws frames away. `InboundAudio` takes its place in the receiver: every RTP packet is decoded as it
arrives and written as 24 kHz mono into our own jitter buffer at its pts, so a lost packet is a gap there (concealed
as silence) and a late one lands at its place; a lost packet whose successor carries in-band FEC is rebuilt from
it (media/opus.py) and lands in its gap before the buffer reads it. `with_inband_fec(answer_sdp)` asks the caller's
sender for that redundancy. Where both peers have RED (media/red.py; `use_red`, after the remote description), a lost
packet comes back whole from the next one's redundant copy instead, and in-band FEC covers what RED could not.

Send: `OutboundAudioTrack` returns exactly 20 ms per `recv()` (aiortc stamps every packet of one `recv()` with one RTP
timestamp), paced by a send grid (media/pacing.py), silence when the playout buffer is empty, and after a stall it
jumps its clock forward instead of bursting overdue frames. `ContainedOpusEncoder` encodes those frames as mono Opus
at 24 kHz with no resampling (each packet wrapped with the one before it where RED was negotiated), and an encoder
failure costs one frame instead of ending aiortc's RTP sender for good.

Both swaps touch private aiortc attributes: the version is pinned (`AIORTC_VERSION`) and checked when they are made.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiortc
import av
import numpy as np
from aiortc.codecs.base import Encoder
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.rtcrtptransceiver import RTCRtpTransceiver
from aiortc.rtp import RtpPacket

from media.opus import OpusDecoder, asks_inband_fec, rtpmap_payload_types
from media.pacing import Pacer, SendGrid
from media.red import MAX_REDUNDANT, RedFormat, Redundancy, red_format, unpack

logger = logging.getLogger(__name__)

AIORTC_VERSION = "1.16.0"
RATE = 24000                      # model rate: what the tracks carry on our side
RTP_RATE = 48000                  # Opus RTP clock
OUT_SAMPLES = RATE // 50          # 20 ms per outbound recv()
_TIME_BASE = fractions.Fraction(1, RATE)


class AiortcMismatch(RuntimeError):
    """The installed aiortc is not the version whose private receive/send internals we replace."""


def _check_aiortc() -> None:
    if aiortc.__version__ != AIORTC_VERSION:
        raise AiortcMismatch(f"aiortc {aiortc.__version__} is installed; the receive bypass and the contained "
                             f"encoder are written against aiortc {AIORTC_VERSION} (pin it)")


def _swap(obj: object, attr: str, expected: type, new: object) -> None:
    current = getattr(obj, attr, None)
    if not isinstance(current, expected):
        raise AiortcMismatch(f"{type(obj).__name__}.{attr} is {type(current).__name__}, expected {expected.__name__}")
    setattr(obj, attr, new)


# ---- receive ------------------------------------------------------------------------------------------------------

class ReorderingTimestampMapper:
    """RTP timestamp -> offset from the first packet, unwrapped by the signed 32-bit distance to the newest one.

    aiortc's mapper treats any step back as a wrap (+2**32), which is right only behind its reordering buffer."""

    def __init__(self) -> None:
        self._origin: int | None = None
        self._newest = 0                                     # unwrapped

    def map(self, timestamp: int) -> int:
        if self._origin is None:
            self._origin = self._newest = timestamp
            return 0
        delta = (timestamp - self._newest + (1 << 31)) % (1 << 32) - (1 << 31)
        unwrapped = self._newest + delta
        self._newest = max(self._newest, unwrapped)
        return unwrapped - self._origin


class PtsSink(Protocol):
    """Where received audio goes: `media.jitter.JitterBuffer` (24 kHz mono float32, keyed on pts)."""

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> object: ...


@dataclass
class InboundStats:
    frames: int = 0               # packets decoded
    fec_frames: int = 0           # lost packets rebuilt from their successor's in-band FEC
    fec_superseded: int = 0       # rebuilt, then the original came after all (reordered, not lost): not in fec_frames
    red_packets: int = 0          # packets that came as RED (the caller sends it: negotiated, `use_red`)
    red_frames: int = 0           # lost packets taken whole from a later packet's RED block
    red_superseded: int = 0       # taken from RED, then the original came after all: not in red_frames
    lost_frames: int = 0          # gaps in pts, in packets, when seen (a late packet may fill one afterwards)
    late_frames: int = 0          # arrived behind a newer packet (reordered)
    bad_frames: int = 0           # undecodable, or refused by the sink: dropped and counted
    first_arrival: float | None = None
    last_arrival: float | None = None


class InboundAudio:
    """Takes an Opus receiver's packets in place of aiortc's audio jitter buffer and writes them, as 24 kHz mono, into
    a `PtsSink` at their own pts the moment each arrives.

    Each packet is decoded here, on the event loop (libopus, mono, straight to 24 kHz: ~30 µs), rather than handed to
    aiortc's decoder thread and back through a queue and the remote track. Its output for RTP time `t` (48 kHz, from
    the first packet) goes to `t/2`: in-order audio is contiguous, a lost packet leaves a gap of exactly its length,
    a reordered one lands in its own place. A packet after a gap fills what it can of it before its own audio: with
    RED (`red`, the negotiated format), the lost packets its redundant blocks carry, whole; then, if the packet just
    before it is still missing and it carries in-band FEC, that one from the FEC. What is rebuilt lands in the gap
    before the buffer reads it (the buffer holds a margin of tens of ms); a late original that comes after it finds
    its place taken. aiortc still keeps its RTCP statistics; the remote track gets no frames and ends (`ended()`
    returns) when the receiver stops: RTCP BYE, or the peer connection closing.

    Install after `setRemoteDescription` has made the receiver's track and before ICE connects. The call must
    have negotiated Opus, and RED over it if `red` is given; packets of any other payload type are counted bad."""

    def __init__(self, receiver: RTCRtpReceiver, sink: PtsSink, clock: Callable[[], float] = time.monotonic,
                 red: RedFormat | None = None) -> None:
        _check_aiortc()
        if receiver.track is None or receiver.track.kind != "audio":
            raise ValueError("InboundAudio takes an audio receiver whose remote track exists")
        self._track = receiver.track
        self._sink = sink
        self._clock = clock
        self.red = red
        self._decoder = OpusDecoder(RATE)
        self._mapper = ReorderingTimestampMapper()
        self._next: int | None = None                       # RTP time the next in-order packet should carry
        self._seq: int | None = None                        # the newest sequence number seen
        self._rebuilt: deque[tuple[int, bool]] = deque(maxlen=64)   # recent rebuilt RTP times, and whether by RED
        self.stats = InboundStats()
        _swap(receiver, "_RTCRtpReceiver__jitter_buffer", JitterBuffer, self)

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        """aiortc's `JitterBuffer.add`: called with every depayloaded packet; aiortc gets no frame back to decode."""
        now = self._clock()
        st = self.stats
        t = self._mapper.map(packet.timestamp)
        newest = self._seq is None or (packet.sequence_number - self._seq) & 0xFFFF < 0x8000
        lost_before = newest and self._seq is not None and (packet.sequence_number - self._seq) & 0xFFFF > 1
        self._seq = packet.sequence_number if newest else self._seq
        try:
            payload, earlier = self._opus(packet)
            samples = self._decoder.samples_in(payload)
            recovered = self._recover(t, earlier)
            gap_from = recovered[-1][0] + 2 * recovered[-1][1].size if recovered else self._next
            rebuilt = None
            # The packet just before this one (by sequence number, not a sender's timestamp jump) is missing, and its
            # time is a gap here: rebuild it from this packet's redundancy.
            if lost_before and gap_from is not None and t - gap_from >= 2 * samples and \
                    self._decoder.has_fec(payload):
                rebuilt = self._decoder.recover(payload, samples)
            audio = self._decoder.decode(payload)
        except ValueError:
            st.bad_frames += 1
            return False, None
        st.frames += 1
        st.red_packets += self.red is not None and packet.payload_type == self.red.payload_type
        st.first_arrival = now if st.first_arrival is None else st.first_arrival
        st.last_arrival = now
        if self._next is not None:
            if t > self._next:
                st.lost_frames += (t - self._next) // (2 * samples)
            elif t < self._next:
                st.late_frames += 1
                self._superseded(t)
        self._next = max(self._next or 0, t + 2 * samples)
        for at, copy in recovered:
            st.red_frames += 1
            self._rebuilt.append((at, True))
            self._push(at // 2, copy, now)
        if rebuilt is not None and rebuilt.size:
            st.fec_frames += 1
            self._rebuilt.append((t - 2 * rebuilt.size, False))
            self._push(t // 2 - rebuilt.size, rebuilt, now)
        self._push(t // 2, audio, now)
        return False, None

    def _opus(self, packet: RtpPacket) -> tuple[bytes, list[tuple[int, bytes]]]:
        """A packet's Opus payload and, from a RED packet, its newest earlier blocks (up to MAX_REDUNDANT, whatever
        the format names: a sender deepens its RED on a lossy link, `RedDepth`) as (RTP ticks before it, payload)."""
        payload: bytes = packet._data  # type: ignore[attr-defined]
        red = self.red
        if red is None or packet.payload_type != red.payload_type:
            if red is not None and packet.payload_type != red.opus_type:
                raise ValueError(f"payload type {packet.payload_type} is neither Opus nor RED")
            return payload, []
        blocks = unpack(payload)
        if any(b.payload_type != red.opus_type for b in blocks):
            raise ValueError("a RED block that is not Opus")
        return blocks[-1].data, [(b.offset, b.data) for b in blocks[:-1][-MAX_REDUNDANT:]]

    def _recover(self, t: int, earlier: list[tuple[int, bytes]]) -> list[tuple[int, np.ndarray]]:
        """The earlier blocks of a packet at RTP time `t` that fill where nothing has come yet (from the in-order end
        on, oldest first, none overlapping), decoded. A block that does not decode is skipped (counted bad): the
        packet's own audio is still good."""
        out: list[tuple[int, np.ndarray]] = []
        edge = self._next
        for offset, data in earlier:
            at = t - offset
            if edge is None or not edge <= at < t:
                continue
            try:
                audio = self._decoder.decode(data)
            except ValueError:
                self.stats.bad_frames += 1
                continue
            out.append((at, audio))
            edge = at + 2 * audio.size
        return out

    def _superseded(self, t: int) -> None:
        """A late packet at RTP time `t`: if its place was rebuilt, that rebuild recovered no loss after all."""
        st = self.stats
        for at, by_red in self._rebuilt:
            if at == t:
                self._rebuilt.remove((at, by_red))
                if by_red:
                    st.red_frames -= 1
                    st.red_superseded += 1
                else:
                    st.fec_frames -= 1
                    st.fec_superseded += 1
                return

    def _push(self, at: int, audio: np.ndarray, now: float) -> None:
        if audio.size and at + audio.size > 0:
            try:
                self._sink.push(at, audio, now)
            except Exception:           # aiortc's receive loop must not see it: it would end the transport
                logger.exception("audio sink failed; packet dropped")
                self.stats.bad_frames += 1

    async def ended(self) -> None:
        """Returns when the receiver has stopped (its remote track ended)."""
        with contextlib.suppress(MediaStreamError):
            while True:
                await self._track.recv()


def with_inband_fec(sdp: str) -> str:
    """An SDP (our answer) whose Opus formats say `useinbandfec=1`: the receiver can use in-band FEC, so the caller's
    sender (a browser) adds it once it sees loss. aiortc answers with its own codec parameters, which have none."""
    lines = sdp.split("\r\n")
    opus = rtpmap_payload_types(lines, "opus/")
    with_fmtp = {line[7:].split()[0] for line in lines if line.startswith("a=fmtp:")}
    out = []
    for line in lines:
        pt = line[7:].split()[0] if line.startswith("a=fmtp:") else None
        if pt in opus and "useinbandfec" not in line:
            line += ";useinbandfec=1" if " " in line else " useinbandfec=1"
        out.append(line)
        pt = line[9:].split()[0] if line.startswith("a=rtpmap:") else None
        if pt in opus and pt not in with_fmtp:
            out.append(f"a=fmtp:{pt} useinbandfec=1")
    return "\r\n".join(out)


def use_red(transceiver: RTCRtpTransceiver, remote_sdp: str) -> RedFormat | None:
    """After `setRemoteDescription`: where the remote SDP has RED over the Opus format the transceiver negotiated, put
    RED first among its codecs (aiortc's own list has no RED, so it drops it from the remote's), so that an answer
    made from them offers it first (a browser sends RED only then), the sender sends under its payload type (the
    encoder then wraps: `ContainedOpusEncoder.red`), and the receiver takes it (`InboundAudio(red=...)`)."""
    _check_aiortc()
    codecs: list[RTCRtpCodecParameters] = transceiver._codecs
    opus = next((c for c in codecs if c.mimeType.lower() == "audio/opus"), None)
    fmt = red_format(remote_sdp, opus.payloadType) if opus is not None else None
    if fmt is None or any(c.payloadType == fmt.payload_type for c in codecs):
        return None
    blocks = "/".join([str(fmt.opus_type)] * (fmt.redundant + 1))
    codecs.insert(0, RTCRtpCodecParameters(mimeType="audio/red", clockRate=opus.clockRate, channels=opus.channels,
                                           payloadType=fmt.payload_type, parameters={blocks: None}))
    return fmt


def decodes_inband_fec(sdp: str) -> bool:
    """Whether the caller's SDP (its offer) says its Opus decoder uses in-band FEC: then what the server sends it
    carries some (media/opus.py, `DOWNLINK_FEC_LOSS_PCT`)."""
    lines = sdp.splitlines()
    opus = set(rtpmap_payload_types(lines, "opus/"))
    return any(line.startswith("a=fmtp:") and line[7:].partition(" ")[0] in opus
               and asks_inband_fec(line.split(None, 1)[-1]) for line in lines)


# ---- send ---------------------------------------------------------------------------------------------------------

class PlayoutSource(Protocol):
    """What the outbound track reads: `media.playout.PlayoutBuffer`."""

    def read(self, n: int) -> np.ndarray: ...               # always n float32 samples at 24 kHz (silence when empty)


@dataclass
class OutboundStats:
    frames: int = 0               # 20 ms frames returned
    stalls: int = 0               # times recv() came a stall (40 ms) late and the clock jumped
    skipped_ms: float = 0.0       # clock time jumped over (no burst was sent for it)
    failures: int = 0             # recv() bodies that failed and sent silence instead
    aligned: int = 0              # align() and advance() calls
    started_at: float | None = None


class OutboundAudioTrack(MediaStreamTrack):
    """Exactly 20 ms (480 samples, s16 mono, 24 kHz) per `recv()`, on a `media.pacing.SendGrid`: `pts` is the send's
    slot x 480.

    The source is a `Pacer` (the server's calls: its grid follows the engine's frames) or any `PlayoutSource` (read
    on a plain grid of its own, on `clock`). A `recv()` that comes a stall (40 ms) or more behind its due time (the
    loop was blocked) skips the whole frames it missed: the RTP timestamps then match the wall clock, so the browser
    conceals the gap instead of receiving a burst it can only queue (a burst grows its jitter buffer, it never plays
    faster)."""

    kind = "audio"

    def __init__(self, source: PlayoutSource | Pacer, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if isinstance(source, Pacer):
            self.grid, self._due, self._read = source.grid, source.due, source.read
        else:
            self.grid = SendGrid(OUT_SAMPLES / RATE, clock)
            self._due, self._read = self.grid.wait, source.read
        self._frames = 0
        self._failures = 0

    @property
    def stats(self) -> OutboundStats:
        grid = self.grid
        return OutboundStats(frames=self._frames, stalls=grid.stalls, skipped_ms=grid.skipped * grid.period_s * 1000,
                             failures=self._failures, aligned=grid.moves, started_at=grid.started_at)

    def align(self, written_at: float, after_s: float = 0.002) -> None:
        """Make the next read (the one waiting now, or else the next `recv()`) fall `after_s` after `written_at`,
        and the 20 ms grid with it.

        A move of less than a packet keeps the RTP timestamps continuous: the packets leave up to 20 ms earlier
        (or later) than they would have, once, which the receiver's jitter buffer takes as a step in network
        delay. A later move skips the timestamps of the whole packets it spans, as a stall does: the receiver
        conceals the gap and keeps its delay, where a step of that size would stand in its buffer as latency for
        the rest of the call."""
        self.grid.align(written_at + after_s, skip=True)

    def advance(self, seconds: float) -> None:
        """Bring the read grid `seconds` (< 20 ms) earlier; RTP timestamps stay continuous."""
        self.grid.advance(seconds)

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        slot = await self._due()
        try:
            samples = self._read(OUT_SAMPLES)
        except Exception:
            logger.exception("outbound audio source failed; sending silence")
            self._failures += 1
            samples = np.zeros(OUT_SAMPLES, np.float32)
        self._frames += 1
        return pcm_frame(samples, slot * OUT_SAMPLES)


def pcm_frame(samples: np.ndarray, pts: int) -> av.AudioFrame:
    """float32 [-1, 1] mono at 24 kHz -> an s16 mono AudioFrame at `pts` (1/24000)."""
    s16 = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
    frame = av.AudioFrame.from_ndarray(s16.reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = RATE
    frame.pts = pts
    frame.time_base = _TIME_BASE
    return frame


class ContainedOpusEncoder(Encoder):
    """Mono Opus from 20 ms s16 frames at 24 kHz (libopus takes 24 kHz as is: no resampler, one packet per frame).

    RTP timestamps come from the frames' pts (on the 48 kHz clock), so a clock jump in the track is a jump on the wire
    at the same frame (libopus's own packet pts lag one frame behind: each packet starts with lookahead samples).
    Any exception is logged and counted, the codec is rebuilt, and the frame is skipped: aiortc's sender would
    otherwise stop sending for good while the call looks alive."""

    def __init__(self, bitrate: int = 48000, expected_loss_pct: int = 0) -> None:
        self.bitrate = bitrate
        self.expected_loss_pct = expected_loss_pct   # > 0: in-band FEC for that much loss (as a browser sends it)
        self.red: Redundancy | None = None            # set where RED was negotiated (`use_red`): packets wrapped
        self.failures = 0
        self._codec: av.CodecContext | None = None
        self._first_pts: int | None = None
        self._released = False

    def release(self) -> None:
        """Free the codec now, at the call's end, and encode nothing more. PyAV gives the codec a resampler graph of
        its own, with a pool of FFmpeg threads; held by a call object that waits in reference cycles for a full
        collection (minutes apart in a worker), they piled up: 45-85 idle threads per worker ten minutes into a soak."""
        self._released = True
        self._codec = None

    def _open(self) -> av.CodecContext:
        codec = av.CodecContext.create("libopus", "w")
        codec.sample_rate = RATE
        codec.layout = "mono"
        codec.format = "s16"
        codec.bit_rate = self.bitrate
        codec.time_base = _TIME_BASE
        codec.options = {"application": "voip", **({"fec": "1", "packet_loss": str(self.expected_loss_pct)}
                                                   if self.expected_loss_pct else {})}
        return codec

    def encode(self, frame: av.AudioFrame, force_keyframe: bool = False) -> tuple[list[bytes], int | None]:
        if self._released:
            return [], None
        try:
            if frame.sample_rate != RATE or frame.layout.name != "mono" or frame.samples != OUT_SAMPLES:
                raise ValueError(f"expected 20 ms mono at {RATE} Hz, got {frame.samples} samples "
                                 f"{frame.layout.name} at {frame.sample_rate} Hz")
            if self._codec is None:
                self._codec = self._open()
            packets = self._codec.encode(frame)
        except Exception:
            logger.exception("Opus encode failed; frame skipped, encoder rebuilt")
            self.failures += 1
            self._codec = None
            return [], None
        if not packets:
            return [], None
        if self._first_pts is None:
            self._first_pts = frame.pts
        timestamp = (frame.pts - self._first_pts) * (RTP_RATE // RATE)
        payloads = [bytes(p) for p in packets]
        if self.red is not None:
            payloads = [self.red.wrap(p, timestamp) for p in payloads]
        return payloads, timestamp

    def pack(self, packet: av.Packet) -> tuple[list[bytes], int]:
        raise NotImplementedError("ContainedOpusEncoder encodes frames; it does not pack pre-encoded packets")


class _EncodeInPlace:
    """Stands in for the event loop inside one RTCRtpSender, whose only use of it is `run_in_executor(None,
    encoder.encode, …)`: a 20 ms mono frame encodes in ~0.1 ms, less than the hop to a pool thread and back
    (a future, a queue, and a self-pipe wake-up of the loop per packet) costs, so it runs in place."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def run_in_executor(self, executor: object, fn: Callable[..., object], *args: object) -> asyncio.Future[object]:
        future = self._loop.create_future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future


def install_contained_encoder(sender: RTCRtpSender, encoder: ContainedOpusEncoder) -> None:
    """Give an Opus sender our encoder before it starts (aiortc creates its own only when none is set), encoding in
    place on the loop."""
    _check_aiortc()
    if getattr(sender, "_RTCRtpSender__encoder", "missing") is not None:
        raise AiortcMismatch("RTCRtpSender already has an encoder (or its internals changed)")
    loop = getattr(sender, "_RTCRtpSender__loop", None)
    _swap(sender, "_RTCRtpSender__loop", asyncio.AbstractEventLoop, _EncodeInPlace(loop))  # type: ignore[arg-type]
    sender._RTCRtpSender__encoder = encoder  # type: ignore[attr-defined]
