"""RTP audio for telephony: the codecs a trunk offers, RFC 4733 telephone-events, and one call's receive side.

Codecs (RFC 3551 table 4, RFC 7587): PCMU/PCMA at 8 kHz (our G.711 tables, media.codecs), G.722 at 16 kHz whose RTP
clock is 8000 (a registration error kept for compatibility: 20 ms = 160 bytes = 320 samples, timestamp +160), and
Opus whose RTP clock is always 48000 (`opus/48000/2`; we send mono, which every decoder takes). G.722 goes through
PyAV (libavcodec's g722), Opus through PyAV to encode and libopus itself to decode (media/opus.py: in-band FEC).
Every codec maps 20 ms packets <-> mono float32 at its own rate.

`RtpReceiver` takes every datagram that reaches a call's RTP port and decides what it is worth: too short, not
version 2, oversized, another SSRC than the latched one, a flood past the packet budget, or an unknown payload type
is dropped and counted; telephone-events are de-duplicated by their timestamp and reported once each; audio is
decoded, resampled to 24 kHz and pushed into a `PtsSink` (the conversation's jitter buffer) at the position its RTP
timestamp says, so lost packets leave gaps and reordered ones land in place; an Opus packet that comes right after
a lost one rebuilds it first from its in-band FEC, when it carries some. A long sequence jump is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import av
import numpy as np
from aiortc.rtp import RtpPacket

from media.codecs import AudioFormat
from media.opus import OpusDecoder
from media.resample import Resampler

MODEL_RATE = 24000
PACKET_MS = 20
MAX_DATAGRAM = 1500              # larger than any 20 ms audio packet of ours; a bigger one is hostile or broken
SSRC_IDLE_S = 1.0                # the latched SSRC silent this long: a new source may take over (a transfer)
SEQ_JUMP = 3000                  # packets; a larger sequence step is counted as a jump
DTMF_NAMES = "0123456789*#ABCD"


@dataclass(frozen=True)
class RtpCodec:
    name: str            # as SDP's rtpmap writes it
    clock_rate: int      # RTP timestamp units per second
    sample_rate: int     # audio samples per second
    channels: int = 1    # as SDP writes it
    static_pt: int | None = None

    @property
    def samples_per_packet(self) -> int:
        return self.sample_rate * PACKET_MS // 1000

    @property
    def ticks_per_packet(self) -> int:
        return self.clock_rate * PACKET_MS // 1000

    def rtpmap(self) -> str:
        return f"{self.name}/{self.clock_rate}" + (f"/{self.channels}" if self.channels > 1 else "")


PCMU = RtpCodec("PCMU", 8000, 8000, static_pt=0)
PCMA = RtpCodec("PCMA", 8000, 8000, static_pt=8)
G722 = RtpCodec("G722", 8000, 16000, static_pt=9)
OPUS = RtpCodec("opus", 48000, 48000, channels=2)
CODECS = (OPUS, G722, PCMU, PCMA)          # our preference when a caller offers several
TELEPHONE_EVENT = "telephone-event"


def codec_named(name: str, clock_rate: int) -> RtpCodec | None:
    for codec in CODECS:
        if codec.name.lower() == name.lower() and codec.clock_rate == clock_rate:
            return codec
    return None


class AudioCodec:
    """One direction-pair of a codec for one call: `decode(payload)` and `encode(20 ms of samples)`."""

    def __init__(self, codec: RtpCodec, fec_loss_pct: int = 0) -> None:
        """`fec_loss_pct` > 0: Opus packets carry in-band FEC for that much expected loss (a caller whose format
        parameters asked for it)."""
        self.codec = codec
        self._g711 = AudioFormat(codec.name.lower(), codec.sample_rate) if codec in (PCMU, PCMA) else None
        self._dec: av.CodecContext | None = None
        self._enc: av.CodecContext | None = None
        self._opus = OpusDecoder(codec.sample_rate) if codec is OPUS else None
        self._pts = 0
        if self._g711 is None:
            lib = "libopus" if codec is OPUS else "g722"
            if self._opus is None:
                self._dec = av.CodecContext.create(lib, "r")
                self._dec.sample_rate = codec.sample_rate
                self._dec.layout = "mono"
            self._enc = av.CodecContext.create(lib, "w")
            self._enc.sample_rate = codec.sample_rate
            self._enc.format = "s16"
            self._enc.layout = "mono"
            if codec is OPUS:
                self._enc.bit_rate = 32000
                if fec_loss_pct:
                    self._enc.options = {"fec": "1", "packet_loss": str(fec_loss_pct)}
            self._enc.open()

    def recover(self, payload: bytes) -> np.ndarray | None:
        """The packet before `payload`, from its in-band FEC (Opus only, when it carries some); call before
        decoding `payload`."""
        if self._opus is None or not self._opus.has_fec(payload):
            return None
        return self._opus.recover(payload, self._opus.samples_in(payload))

    def decode(self, payload: bytes) -> np.ndarray:
        """Mono float32 at the codec's sample rate; raises ValueError for an undecodable payload."""
        if self._g711 is not None:
            return self._g711.decode(payload)
        if self._opus is not None:
            return self._opus.decode(payload)
        assert self._dec is not None
        try:
            frames = self._dec.decode(av.Packet(payload))
        except av.FFmpegError as e:
            raise ValueError(f"undecodable {self.codec.name} payload: {e}") from None
        parts = [_mono_float(f) for f in frames]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def encode(self, samples: np.ndarray) -> bytes:
        if self._g711 is not None:
            return self._g711.encode(samples)
        assert self._enc is not None
        pcm = np.clip(np.rint(np.asarray(samples, np.float32) * 32768.0), -32768, 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = self.codec.sample_rate
        frame.pts = self._pts
        self._pts += pcm.size
        return b"".join(bytes(p) for p in self._enc.encode(frame))


def _mono_float(frame: av.AudioFrame) -> np.ndarray:
    x = frame.to_ndarray()
    x = x.reshape(frame.samples, -1).mean(axis=1) if frame.format.is_packed else x.mean(axis=0)
    return (x / 32768.0 if frame.format.name.startswith("s16") else x).astype(np.float32)


@dataclass(frozen=True)
class TelephoneEvent:
    event: int
    end: bool
    volume: int
    duration: int

    @property
    def name(self) -> str:
        return DTMF_NAMES[self.event] if self.event < len(DTMF_NAMES) else ("flash" if self.event == 16
                                                                             else str(self.event))


def parse_telephone_event(payload: bytes) -> TelephoneEvent | None:
    """RFC 4733 §2.3: event, E|R|volume, duration; None when too short."""
    if len(payload) < 4:
        return None
    return TelephoneEvent(payload[0], bool(payload[1] & 0x80), payload[1] & 0x3F, int.from_bytes(payload[2:4], "big"))


def build_rtp(payload_type: int, sequence: int, timestamp: int, ssrc: int, payload: bytes,
              marker: bool = False) -> bytes:
    return RtpPacket(payload_type=payload_type, marker=int(marker), sequence_number=sequence & 0xFFFF,
                     timestamp=timestamp & 0xFFFFFFFF, ssrc=ssrc, payload=payload).serialize()


class PtsSink(Protocol):
    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> object: ...


@dataclass
class ReceiveStats:
    packets: int = 0             # audio packets decoded and pushed
    dropped: dict[str, int] = field(default_factory=dict)   # by reason
    seq_jumps: int = 0
    ssrc_changes: int = 0
    events: int = 0              # telephone-events reported (each once)
    lost: int = 0                # packets missing by sequence number when a later one came
    fec: int = 0                 # of those, rebuilt from the next packet's in-band FEC (Opus)
    late: int = 0                # arrived behind a newer packet

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


class RtpReceiver:
    """One call's inbound RTP (see the module docstring). `set_codec` follows a re-INVITE's codec change."""

    def __init__(self, codec: RtpCodec, payload_type: int, dtmf_pt: int | None, sink: PtsSink,
                 on_event: Callable[[TelephoneEvent], None] | None = None, max_packets_per_s: float = 200.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stats = ReceiveStats()
        self._sink = sink
        self._on_event = on_event
        self._clock = clock
        self._rate = max_packets_per_s
        self._tokens = max_packets_per_s
        self._stamp = clock()
        self.ssrc: int | None = None
        self._last_seen = 0.0
        self._last_seq: int | None = None
        self._event_ts: int | None = None
        self.dtmf_pt = dtmf_pt
        self._end = 0                          # 24 kHz position one past the furthest audio pushed
        self._end_at = 0.0                     # when that push happened
        self.set_codec(codec, payload_type)

    def set_codec(self, codec: RtpCodec, payload_type: int) -> None:
        """A new stream (a re-INVITE's codec, a new SSRC): its first packet continues the timeline where the wall
        clock says, so the jitter buffer neither drops it as late nor conceals a gap that was a pause."""
        self.codec = codec
        self.payload_type = payload_type
        self._decoder = AudioCodec(codec)
        self._resampler = Resampler(codec.sample_rate, MODEL_RATE)
        self._origin: int | None = None        # RTP timestamp of the stream's first packet
        self._newest = 0                       # unwrapped offset from the origin, newest seen
        self._base_pts: int | None = None      # 24 kHz position of that origin, set by the first packet
        self._delay = 0                        # the resampler's held-back samples, seen on the first packet

    def receive(self, data: bytes) -> bool:
        """One datagram; True when it was a valid packet of the call's stream (for latching the send address)."""
        st = self.stats
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens < 1.0:
            st.drop("flood")
            return False
        self._tokens -= 1.0
        if len(data) > MAX_DATAGRAM:
            st.drop("oversized")
            return False
        if len(data) < 12 or data[0] >> 6 != 2:
            st.drop("not_rtp")
            return False
        try:
            packet = RtpPacket.parse(data)
        except ValueError:
            st.drop("not_rtp")
            return False
        if packet.ssrc != self.ssrc:
            if self.ssrc is not None and now - self._last_seen < SSRC_IDLE_S:
                st.drop("wrong_ssrc")
                return False
            if self.ssrc is not None:
                st.ssrc_changes += 1
                self.set_codec(self.codec, self.payload_type)
            self.ssrc = packet.ssrc
            self._last_seq = None
        self._last_seen = now
        lost_before = self._track_sequence(packet.sequence_number)
        if packet.payload_type == self.dtmf_pt:
            self._telephone_event(packet)
            return True
        if packet.payload_type != self.payload_type:
            st.drop("payload_type")
            return False
        try:
            rebuilt = self._decoder.recover(packet.payload) if lost_before and self._base_pts is not None else None
            samples = self._decoder.decode(packet.payload)
        except ValueError:
            st.drop("undecodable")
            return False
        if rebuilt is not None and rebuilt.size:
            st.fec += 1
            samples = np.concatenate([rebuilt, samples])     # in stream order through the stateful resampler
        audio = self._resampler.process(samples)
        offset = self._unwrap(packet.timestamp) * MODEL_RATE // self.codec.clock_rate
        if rebuilt is not None and rebuilt.size:
            offset -= rebuilt.size * MODEL_RATE // self.codec.sample_rate
        if self._base_pts is None:
            self._base_pts = self._end + (int((now - self._end_at) * MODEL_RATE) if self._end else 0)
            self._delay = samples.size * MODEL_RATE // self.codec.sample_rate - audio.size
            at = self._base_pts
        else:
            at = self._base_pts + offset - self._delay
        st.packets += 1
        if audio.size and at >= 0:
            self._sink.push(at, audio, now)
            if at + audio.size > self._end:
                self._end, self._end_at = at + audio.size, now
        return True

    def _unwrap(self, timestamp: int) -> int:
        if self._origin is None:
            self._origin = timestamp
            self._newest = 0
            return 0
        newest_abs = (self._origin + self._newest) & 0xFFFFFFFF
        delta = (timestamp - newest_abs + (1 << 31)) % (1 << 32) - (1 << 31)
        unwrapped = self._newest + delta
        if delta < 0:
            self.stats.late += 1
        self._newest = max(self._newest, unwrapped)
        return unwrapped

    def _track_sequence(self, seq: int) -> bool:
        """Count lost packets and jumps; True when the packet just before this one is missing."""
        if self._last_seq is None:
            self._last_seq = seq
            return False
        step = (seq - self._last_seq) & 0xFFFF
        if step >= 0x8000:
            return False
        if step > SEQ_JUMP:
            self.stats.seq_jumps += 1
        elif step > 1:
            self.stats.lost += step - 1
        self._last_seq = seq
        return 1 < step <= SEQ_JUMP

    def _telephone_event(self, packet: RtpPacket) -> None:
        event = parse_telephone_event(packet.payload)
        if event is None:
            self.stats.drop("bad_event")
            return
        # Every packet of one event carries its start timestamp; report each event once, at its first packet.
        if packet.timestamp == self._event_ts:
            return
        self._event_ts = packet.timestamp
        self.stats.events += 1
        if self._on_event is not None:
            self._on_event(event)
