"""One SIP call's media: its RTP/RTCP ports, the conversation behind them, and the 20 ms sender.

Inbound RTP goes through `media.rtp.RtpReceiver` into the conversation's jitter buffer at its RTP time. The first
valid packet latches the send address (RFC 7362: behind NAT the packets come from where ours must go), and we send
from the port we receive on (symmetric RTP, RFC 4961). Outbound: engine frames (24 kHz) are resampled to the codec's
rate into a playout buffer; a sender task takes 20 ms from it every 20 ms of wall clock, silence when the model has
nothing, so the caller never hears a gap. While the call is on hold (we answered recvonly/inactive) the timestamps go
on advancing but nothing is sent. A sender that wakes late moves its clock on instead of bursting. RTCP: a sender
report every 5 s from the RTCP port; what arrives there is counted, not read. A caller that should be sending and
has sent no RTP for 30 s is taken as gone: the call ends with our BYE, so its slot does not stay taken.

`latency_ms()` gives what the SIP path adds on each side: inbound, a datagram's decode and push; outbound, the wait
from an engine frame's arrival to the RTP packet carrying its first sample, and how much audio was queued ahead of
it then (engine frames that came bunched after a late tick; bench/sip_latency.py reports them).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from aiortc.rtp import RtcpSenderInfo, RtcpSrPacket

from app.conversation import Conversation, InputPolicy
from app.metrics import Metrics
from app.settings import rtp_port_range
from app.sip.sdp import Choice
from media.playout import PlayoutBuffer, PlayoutConfig
from media.resample import Resampler
from media.rtp import MODEL_RATE, AudioCodec, RtpReceiver, TelephoneEvent, build_rtp
from model.engine import EngineError, FrameOutput, SessionParams, Slot

logger = logging.getLogger(__name__)

PACKET_S = 0.020
STALL_S = 0.040          # a send this late moves the clock on instead of catching up in a burst
RTCP_INTERVAL_S = 5.0
RTP_TIMEOUT_S = 30.0     # no RTP this long from a caller that should be sending: it is gone (no BYE came)
# The 20 ms send grid follows the engine's 80 ms frames as the WebRTC track does (app/webrtc.py): at the first played
# frame and after an underrun the next packet leaves ALIGN_S after the frame landed; a frame then waits one packet
# (20 ms, the previous frame's last) plus ALIGN_S. The tick's phase moves with the engine's load: when every frame
# of the last REPACE_FRAMES waited more than that by over 3 ms, the grid is brought forward by the smallest excess.
# The 10 ms prebuffer is the slack of a late tick; an underrun adds 20 ms (media.playout).
PLAYOUT = PlayoutConfig(start_prebuffer_ms=10.0, min_prebuffer_ms=10.0)
ALIGN_S = 0.002
REPACE_FRAMES = 25
# Frame 0 comes straight after the prompt prefill, 0-80 ms behind the tick grid: playing it would leave that much
# standing latency for the whole call. It answers the first 80 ms of the call, i.e. nothing yet.
FIRST_PLAYED_FRAME = 1
_NTP_EPOCH = 2208988800


def _wake_up(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class PortRange:
    """Even RTP ports (RTCP on the next odd one) handed out from `first-last`."""

    def __init__(self, spec: str) -> None:
        first, last = rtp_port_range(spec)
        self.ports = list(range(first + first % 2, last, 2))
        self._next = 0

    def candidates(self) -> list[int]:
        """Every port once, starting after the last one handed out (a port freed a moment ago is tried last)."""
        n = len(self.ports)
        order = [self.ports[(self._next + i) % n] for i in range(n)]
        self._next = (self._next + 1) % n
        return order


class _Socket(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.on_datagram(data, addr[:2])

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP port unreachable from a caller that went away: the BYE or the timers end the call


@dataclass
class CallStats:
    dtmf: list[str] = field(default_factory=list)
    packets_sent: int = 0
    stalls: int = 0              # the sender woke a stall late and skipped that time (and its audio)
    shed_ms: float = 0.0         # standing output backlog dropped to keep the latency down
    rtcp_received: int = 0
    latched: bool = False


class MediaSession:
    """RTP for one call: `open()` binds the ports, `start()` the conversation, `close()` frees everything."""

    def __init__(self, slot: Slot, choice: Choice, metrics: Metrics, host: str,
                 on_event: Callable[[TelephoneEvent], None], on_failure: Callable[[EngineError], None],
                 on_timeout: Callable[[], None]) -> None:
        self.choice = choice
        self.host = host
        self.port = 0
        self.stats = CallStats()
        self._metrics = metrics
        self._on_event = on_event
        self._on_failure = on_failure
        self._on_timeout = on_timeout
        self._heard_at = time.monotonic()   # the last valid RTP packet (or the start, or a direction change)
        self.conversation = Conversation(slot, metrics=metrics, input_policy=InputPolicy())
        self.remote = choice.remote
        self.remote_rtcp = choice.remote_rtcp
        self.receiver: RtpReceiver | None = None
        self._rtp: _Socket | None = None
        self._rtcp: _Socket | None = None
        self._codec = AudioCodec(choice.codec)
        self._to_codec = Resampler(MODEL_RATE, choice.codec.sample_rate)
        self.playout = PlayoutBuffer(choice.codec.sample_rate, PLAYOUT)
        self._ssrc = random.getrandbits(32)
        self._seq = random.getrandbits(16)
        self._ts = random.getrandbits(32)
        self._octets = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._due = 0.0                      # when the sender's next packet leaves
        self._underruns_seen = 0
        self._paced = 0                      # frames since the grid was last moved or checked
        self._wake: asyncio.Future[None] | None = None
        self._frames: deque[tuple[int, float]] = deque(maxlen=64)     # (playout position, arrival) of engine frames
        self.out_latency: deque[float] = deque(maxlen=2000)            # seconds, per frame
        self.out_ahead: deque[float] = deque(maxlen=2000)              # seconds of audio queued ahead of each frame
        self.in_cost: deque[float] = deque(maxlen=2000)                # seconds, per datagram
        self.closed = False

    async def open(self, ports: PortRange) -> None:
        """Bind an even RTP port and the RTCP port after it; OSError when the whole range is taken."""
        loop = asyncio.get_running_loop()
        for port in ports.candidates():
            rtp = rtcp = None
            try:
                _, rtp = await loop.create_datagram_endpoint(lambda: _Socket(self._on_rtp),
                                                             local_addr=(self.host, port))
                _, rtcp = await loop.create_datagram_endpoint(lambda: _Socket(self._on_rtcp),
                                                              local_addr=(self.host, port + 1))
            except OSError:
                for sock in (rtp, rtcp):
                    if sock is not None and sock.transport is not None:
                        sock.transport.close()
                continue
            self._rtp, self._rtcp, self.port = rtp, rtcp, port
            return
        raise OSError("no free RTP port pair in --rtp-ports")

    def start(self, params: SessionParams) -> asyncio.Task[None]:
        """The conversation's prefill (the caller waits for it before answering 200) and the sender."""
        conv = self.conversation
        conv.add_listener(self._on_frame, self._on_failure)
        task = conv.start(params)
        assert conv.input is not None
        self.receiver = RtpReceiver(self.choice.codec, self.choice.payload_type, self.choice.dtmf_pt, conv.input,
                                    on_event=self._dtmf)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._send_loop()), loop.create_task(self._rtcp_loop())]
        return task

    def update(self, choice: Choice) -> None:
        """A re-INVITE's answer: a new codec, direction or address takes effect now."""
        if choice.codec != self.choice.codec:
            self._codec = AudioCodec(choice.codec)
            self._to_codec = Resampler(MODEL_RATE, choice.codec.sample_rate)
            self.playout = PlayoutBuffer(choice.codec.sample_rate, PLAYOUT)
        if self.receiver is not None:
            if choice.codec != self.choice.codec or choice.payload_type != self.choice.payload_type:
                self.receiver.set_codec(choice.codec, choice.payload_type)
            self.receiver.dtmf_pt = choice.dtmf_pt
        self._heard_at = time.monotonic()
        if choice.remote != self.choice.remote:
            self.remote, self.remote_rtcp, self.stats.latched = choice.remote, choice.remote_rtcp, False
        self.choice = choice

    def cut(self) -> None:
        """Drop the model's audio not sent yet (the admin API's cut): the caller hears silence until the next
        frame."""
        self.playout.clear()

    def sent_s(self) -> float:
        """Seconds of the model's audio sent to the caller."""
        return round(self.playout.stats().drained_samples / self.choice.codec.sample_rate, 2)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.conversation.close()
        for task in self._tasks:
            task.cancel()
        for sock in (self._rtp, self._rtcp):
            if sock is not None and sock.transport is not None:
                sock.transport.close()

    # ---- inbound ---------------------------------------------------------------------------------------------

    def _on_rtp(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.closed or self.receiver is None:
            return
        began = time.perf_counter()
        try:
            valid = self.receiver.receive(data)
        except ValueError:           # audio the jitter buffer refused (NaN from a broken decoder): dropped
            self.receiver.stats.drop("refused")
            valid = False
        if valid:
            self._heard_at = time.monotonic()
            self.in_cost.append(time.perf_counter() - began)
            if not self.stats.latched:
                self.remote, self.remote_rtcp, self.stats.latched = addr, (addr[0], addr[1] + 1), True

    def _on_rtcp(self, data: bytes, addr: tuple[str, int]) -> None:
        self.stats.rtcp_received += 1

    def _dtmf(self, event: TelephoneEvent) -> None:
        self.stats.dtmf.append(event.name)
        self._metrics.dtmf["sip"] += 1
        self._on_event(event)

    # ---- outbound --------------------------------------------------------------------------------------------

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed or frame.index < FIRST_PLAYED_FRAME:
            return
        now = time.monotonic()
        stats = self.playout.stats()
        self._frames.append((stats.written_samples, now))
        self.out_ahead.append(stats.depth_ms / 1000.0)
        self.playout.write(self._to_codec.process(frame.audio))
        if frame.index == FIRST_PLAYED_FRAME or stats.underruns != self._underruns_seen:
            self._move_grid(now + ALIGN_S)
            self._underruns_seen = stats.underruns
            self._paced = 0
        elif self._paced >= REPACE_FRAMES and len(self.out_latency) >= REPACE_FRAMES:
            excess = min(list(self.out_latency)[-REPACE_FRAMES:]) - PACKET_S - ALIGN_S
            packets = int(excess / PACKET_S)
            if packets:     # a standing backlog (frames that came bunched after a stall): shed it, oldest first
                self.playout.read(packets * self.choice.codec.samples_per_packet)
                self.stats.shed_ms += packets * PACKET_S * 1000
            if excess - packets * PACKET_S > 0.003:
                self._move_grid(self._due - (excess - packets * PACKET_S))
            self._paced = 0
        self._paced += 1

    def _move_grid(self, due: float) -> None:
        """The next packet leaves at `due` (the timestamps stay continuous: packets leave earlier or later once,
        which the receiver's jitter buffer takes as a step in delay)."""
        self._due = due
        if self._wake is not None:
            _wake_up(self._wake)

    async def _send_loop(self) -> None:
        """One packet per 20 ms; the RTP timestamps advance 20 ms per packet whatever the grid does."""
        self._due = time.monotonic()
        while not self.closed:
            await self._sleep_until_due()
            n = self.choice.codec.samples_per_packet
            chunk = self.playout.read(n)
            now = time.monotonic()
            drained = self.playout.stats().drained_samples
            while self._frames and self._frames[0][0] < drained:
                self.out_latency.append(now - self._frames.popleft()[1])
            if self.choice.sends and self._rtp is not None and self._rtp.transport is not None:
                payload = self._codec.encode(chunk)
                self._rtp.transport.sendto(build_rtp(self.choice.payload_type, self._seq, self._ts, self._ssrc,
                                                     payload, marker=self.stats.packets_sent == 0), self.remote)
                self.stats.packets_sent += 1
                self._octets += len(payload)
            self._seq = (self._seq + 1) & 0xFFFF
            self._ts = (self._ts + self.choice.codec.ticks_per_packet) & 0xFFFFFFFF
            self._due += PACKET_S
            if now - self._due > STALL_S:        # the loop was blocked: skip the packets' time and their audio
                missed = int((now - self._due) / PACKET_S)
                self._ts = (self._ts + missed * self.choice.codec.ticks_per_packet) & 0xFFFFFFFF
                self._due += missed * PACKET_S
                self.playout.read(missed * n)
                self.stats.stalls += 1

    async def _sleep_until_due(self) -> None:
        """Sleep until `_due`, which an alignment may move while we sleep."""
        loop = asyncio.get_running_loop()
        while (delay := self._due - time.monotonic()) > 0:
            wake = self._wake = loop.create_future()
            timer = loop.call_later(delay, _wake_up, wake)
            try:
                await wake
            finally:
                timer.cancel()

    async def _rtcp_loop(self) -> None:
        """Every 5 s: a sender report, and the check for a caller that vanished without BYE."""
        while not self.closed:
            await asyncio.sleep(RTCP_INTERVAL_S)
            if self.choice.direction in ("sendrecv", "recvonly") and \
                    time.monotonic() - self._heard_at > RTP_TIMEOUT_S:
                self._on_timeout()
                return
            if self._rtcp is None or self._rtcp.transport is None or not self.choice.sends:
                continue
            now = time.time() + _NTP_EPOCH
            ntp = (int(now) << 32) | int((now % 1) * (1 << 32))
            sr = RtcpSrPacket(ssrc=self._ssrc, sender_info=RtcpSenderInfo(
                ntp_timestamp=ntp, rtp_timestamp=self._ts, packet_count=self.stats.packets_sent,
                octet_count=self._octets & 0xFFFFFFFF))
            self._rtcp.transport.sendto(bytes(sr), self.remote_rtcp)

    def latency_ms(self) -> dict[str, float]:
        def p50(values: deque[float]) -> float:
            return round(float(np.median(values)) * 1000.0, 2) if values else 0.0
        return {"inbound_p50_ms": p50(self.in_cost), "outbound_p50_ms": p50(self.out_latency),
                "outbound_queued_ahead_p50_ms": p50(self.out_ahead)}

    def snapshot(self) -> dict[str, object]:
        rx = self.receiver.stats if self.receiver is not None else None
        return {"codec": self.choice.codec.rtpmap(), "payload_type": self.choice.payload_type,
                "direction": self.choice.direction, "rtp_port": self.port, "remote": list(self.remote),
                "latched": self.stats.latched, "packets_sent": self.stats.packets_sent,
                "packets_received": rx.packets if rx else 0, "dropped": dict(rx.dropped) if rx else {},
                "lost": rx.lost if rx else 0, "seq_jumps": rx.seq_jumps if rx else 0,
                "rtcp_received": self.stats.rtcp_received, "stalls": self.stats.stalls,
                "shed_ms": self.stats.shed_ms, "dtmf": list(self.stats.dtmf),
                "conversation": self.conversation.counters(), "input": self.input_stats(), **self.latency_ms()}

    def input_stats(self) -> dict[str, object] | None:
        """The input jitter buffer's counters and the latency it added over its recent reads (p50, p95)."""
        jb = self.conversation.input
        if jb is None:
            return None
        added = jb.added_ms(len(jb.trace()))
        return {**{k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(jb.stats()).items()},
                "added_ms": None if added is None else {"p50": round(added[0], 2), "p95": round(added[1], 2)}}
