"""One SIP call's media: its RTP/RTCP ports, the conversation behind them, and the 20 ms sender.

Inbound RTP goes through `media.rtp.RtpReceiver` into the conversation's jitter buffer at its RTP time. The first
valid packet latches the send address (RFC 7362: behind NAT the packets come from where ours must go), and we send
from the port we receive on (symmetric RTP, RFC 4961). Outbound: engine frames (24 kHz) go into a `media.pacing.Pacer`
at the codec's rate; a sender task takes 20 ms from it every 20 ms of wall clock on the pacer's grid, which follows the
engine's frames by its `SIP_RTP` rules; silence when the model has nothing, so the caller never hears a gap. While the
call is on hold (we answered recvonly/inactive) the timestamps go on advancing but nothing is sent. A sender that
wakes a stall late skips the packets' time and their audio instead of bursting. RTCP: a sender report every 5 s from
the RTCP port; what arrives there is counted, not read. A caller that should be sending and
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
from dataclasses import dataclass, field

import numpy as np
from aiortc.rtp import RtcpSenderInfo, RtcpSrPacket

from app.doors.sip.sdp import Choice
from app.sessions.conversation import Conversation, InputPolicy
from app.sessions.link import input_report
from app.sessions.udp import DatagramSocket
from app.shell.metrics import Metrics
from app.shell.settings import rtp_port_range
from media.opus import DOWNLINK_FEC_LOSS_PCT, asks_inband_fec
from media.pacing import FIRST_PLAYED_FRAME, SIP_RTP, Pacer
from media.rtp import OPUS, AudioCodec, RtpReceiver, TelephoneEvent, build_rtp
from model.engine import EngineError, FrameOutput, SessionParams, Slot

logger = logging.getLogger(__name__)

RTCP_INTERVAL_S = 5.0
RTP_TIMEOUT_S = 30.0     # no RTP this long from a caller that should be sending: it is gone (no BYE came)
_NTP_EPOCH = 2208988800


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


def sender_codec(choice: Choice) -> AudioCodec:
    """The codec the call sends with: Opus with in-band FEC when the caller's format parameters ask for it."""
    asked = choice.codec is OPUS and asks_inband_fec(choice.fmtp or "")
    return AudioCodec(choice.codec, fec_loss_pct=DOWNLINK_FEC_LOSS_PCT if asked else 0)


@dataclass
class CallStats:
    dtmf: list[str] = field(default_factory=list)
    packets_sent: int = 0
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
        self._rtp: DatagramSocket | None = None
        self._rtcp: DatagramSocket | None = None
        self._codec = sender_codec(choice)
        self.pacer = Pacer(choice.codec.sample_rate, SIP_RTP)
        self._ssrc = random.getrandbits(32)
        self._seq = random.getrandbits(16)
        self._ts = random.getrandbits(32)
        self._octets = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.out_ahead: deque[float] = deque(maxlen=2000)              # seconds of audio queued ahead of each frame
        self.in_cost: deque[float] = deque(maxlen=2000)                # seconds, per datagram
        self.closed = False

    async def open(self, ports: PortRange) -> None:
        """Bind an even RTP port and the RTCP port after it; OSError when the whole range is taken."""
        loop = asyncio.get_running_loop()
        for port in ports.candidates():
            rtp = rtcp = None
            try:
                _, rtp = await loop.create_datagram_endpoint(lambda: DatagramSocket(self._on_rtp),
                                                             local_addr=(self.host, port))
                _, rtcp = await loop.create_datagram_endpoint(lambda: DatagramSocket(self._on_rtcp),
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
            self._codec = sender_codec(choice)
            self.pacer.set_rate(choice.codec.sample_rate)
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
        self.pacer.clear()

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
        self.out_ahead.append(self.pacer.playout.stats().depth_ms / 1000.0)
        self.pacer.write(frame.audio)

    async def _send_loop(self) -> None:
        """One packet per slot of the pacer's grid; the RTP timestamps advance 20 ms per slot, skipped ones too."""
        last: int | None = None
        while not self.closed:
            slot = await self.pacer.due()
            chunk = self.pacer.read()
            if last is not None:
                self._ts = (self._ts + (slot - last) * self.choice.codec.ticks_per_packet) & 0xFFFFFFFF
            last = slot
            if self.choice.sends and self._rtp is not None and self._rtp.transport is not None:
                payload = self._codec.encode(chunk)
                self._rtp.transport.sendto(build_rtp(self.choice.payload_type, self._seq, self._ts, self._ssrc,
                                                     payload, marker=self.stats.packets_sent == 0), self.remote)
                self.stats.packets_sent += 1
                self._octets += len(payload)
            self._seq = (self._seq + 1) & 0xFFFF

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
        return {"inbound_p50_ms": p50(self.in_cost), "outbound_p50_ms": p50(self.pacer.waits),
                "outbound_queued_ahead_p50_ms": p50(self.out_ahead)}

    def snapshot(self) -> dict[str, object]:
        rx = self.receiver.stats if self.receiver is not None else None
        return {"codec": self.choice.codec.rtpmap(), "payload_type": self.choice.payload_type,
                "direction": self.choice.direction, "rtp_port": self.port, "remote": list(self.remote),
                "latched": self.stats.latched, "packets_sent": self.stats.packets_sent,
                "packets_received": rx.packets if rx else 0, "dropped": dict(rx.dropped) if rx else {},
                "lost": rx.lost if rx else 0, "seq_jumps": rx.seq_jumps if rx else 0,
                "rtcp_received": self.stats.rtcp_received, "stalls": self.pacer.grid.stalls,
                **self.pacer.sent(),
                "dtmf": list(self.stats.dtmf), "conversation": self.conversation.counters(),
                "input": input_report(self.conversation), **self.latency_ms()}

