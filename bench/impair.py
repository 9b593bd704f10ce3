"""Network impairment in user space, seeded: a link model, a UDP relay, a TCP relay and a hook in an aiortc peer.

The kernel here has no netem (spec/webrtc.md s.5), so links are impaired by the test or the load driver itself, without
privileges. One `Link` describes one direction; `LinkModel` turns each packet's send time into its delivery times
(none: lost; two: duplicated), from a seeded generator, so a run can be repeated:
- delay: a fixed one-way delay plus normal jitter (sigma = jitter / 2, clipped to +-jitter, so `jitter_ms=30` is the
  usual "+-30 ms") and an optional heavy tail (with probability `tail`, an extra Pareto(1.5) delay of at least
  `tail_ms`). A network queue keeps order, so jittered packets do not overtake each other (each is delivered no
  earlier than the one sent before it); reordering is its own knob:
- reorder: with probability `reorder` a packet is held `reorder_ms` more and its successors pass it;
- loss: random (`loss`) and bursty (`burst_loss`, Gilbert-Elliott: a bad state that loses every packet, entered so the
  long-run loss is `burst_loss` and left with probability 1/`burst_len`, so bursts average `burst_len` packets);
- duplicate: with probability `duplicate` a second copy follows 0-10 ms later (datagrams only);
- stalls: every `stall_every_s` (first at `stall_first_s`, default one period in) the link goes silent for `stall_ms`
  and then delivers, in order, everything it held (Wi-Fi roaming, a cellular handover).
On a reliable link (TCP) a lost segment is not gone: it is sent again once the sender learns of the loss, by three
duplicate acknowledgements (the three segments after it, sent at the stream's recent pace, and a round trip) or
by its retransmission timeout (Linux's 200 ms minimum plus a round trip), whichever comes first, so it arrives a
round trip (`retransmit_s`) plus the lesser of 200 ms and three send intervals late; everything behind it waits
(head-of-line blocking). Duplicates and reordering do not exist there.

Carriers: `UdpRelay` (SIP RTP: the phone sends to `near`, the server talks to `far`), `TcpRelay` (the WebSocket doors:
point the client at the relay's port) and `impair_peer` (an aiortc peer's ICE transport: every datagram it sends and
receives after the call is up, DTLS, SRTP and SCTP alike, as a browser behind a bad link would see them).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from app.sessions.udp import DatagramSocket

TCP_MIN_RTO_S = 0.2
TCP_MSS = 1448       # bytes of payload a TCP segment carries on a 1,500-byte path (IPv4, timestamps)
MAX_TAIL_S = 2.0


@dataclass(frozen=True)
class Link:
    """One direction of a link (see the module docstring); times in ms, rates as fractions."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    tail: float = 0.0
    tail_ms: float = 0.0
    loss: float = 0.0
    burst_loss: float = 0.0
    burst_len: float = 1.0
    reorder: float = 0.0
    reorder_ms: float = 30.0
    duplicate: float = 0.0
    stall_every_s: float = 0.0
    stall_ms: float = 0.0
    stall_first_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("tail", "loss", "burst_loss", "reorder", "duplicate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} is a probability in [0, 1), got {getattr(self, name)}")
        if self.burst_len < 1.0:
            raise ValueError(f"burst_len is a mean count of packets (>= 1), got {self.burst_len}")
        if min(self.delay_ms, self.jitter_ms, self.tail_ms, self.reorder_ms, self.stall_ms, self.stall_every_s) < 0:
            raise ValueError("delays, jitter and stall lengths cannot be negative")
        if self.stall_ms and self.stall_every_s * 1000.0 <= self.stall_ms:
            raise ValueError("a stall must be shorter than the period between stalls")

    @property
    def impaired(self) -> bool:
        return self != Link()

    @classmethod
    def parse(cls, text: str) -> Link:
        """`delay_ms=75,jitter_ms=30,loss=0.01` (any field), or a preset's name, or a preset plus fields:
        `far,stall_ms=400,stall_every_s=20`."""
        values: dict[str, float] = {}
        names = {f.name for f in fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = part.partition("=")
            if not eq:
                if key not in PRESETS:
                    raise ValueError(f"unknown link preset {key!r} (presets: {', '.join(PRESETS)})")
                values.update({f.name: getattr(PRESETS[key], f.name) for f in fields(cls)
                               if getattr(PRESETS[key], f.name) != getattr(cls(), f.name)})
            elif key not in names:
                raise ValueError(f"unknown link field {key!r} (fields: {', '.join(sorted(names))})")
            else:
                values[key] = float(value)
        return cls(**values)


# The conditions, each way of a 150 ms round trip: (a) far: +-30 ms jitter, 1 % loss, 0.5 % reordering;
# (b) bursty: 5 % loss in bursts of 3 packets on average; (c) stalls: the link goes silent 400 ms every 20 s.
FAR = Link(delay_ms=75.0, jitter_ms=30.0, loss=0.01, reorder=0.005)
PRESETS: dict[str, Link] = {
    "clean": Link(),
    "far": FAR,
    "bursty": Link(delay_ms=75.0, jitter_ms=30.0, burst_loss=0.05, burst_len=3.0),
    "stalls": Link(delay_ms=75.0, jitter_ms=30.0, stall_ms=400.0, stall_every_s=20.0),
}
# The in-band FEC a WebRTC caller behind an impaired link sends (a browser's Opus encoder adds it once its RTCP says
# it loses packets; the server's answer asks for it).
FEC_LOSS_PCT = 10


@dataclass
class LinkStats:
    sent: int = 0
    delivered: int = 0          # copies delivered (duplicates included)
    lost: int = 0               # never delivered (datagrams), or retransmitted (reliable)
    duplicated: int = 0
    reordered: int = 0
    stalled: int = 0            # held by a stall
    transits_s: list[float] = field(default_factory=list)   # per delivered packet (first copy)
    lost_at: list[float] = field(default_factory=list)      # send times of the lost (or retransmitted) packets

    def jitter_ms(self, q: float = 95.0) -> float:
        """The q-th percentile of each delivered packet's transit above the fastest one's (what a receiver's jitter
        estimate sees)."""
        if not self.transits_s:
            return 0.0
        t = np.asarray(self.transits_s)
        return float(np.percentile(t - t.min(), q) * 1000.0)

    def summary(self) -> dict[str, Any]:
        t = np.asarray(self.transits_s) * 1000.0 if self.transits_s else np.zeros(1)
        return {"sent": self.sent, "delivered": self.delivered, "lost": self.lost,
                "loss_pct": round(100.0 * self.lost / max(1, self.sent), 3), "duplicated": self.duplicated,
                "reordered": self.reordered, "stalled": self.stalled,
                "transit_ms": {"min": round(float(t.min()), 2), "p50": round(float(np.median(t)), 2),
                               "p95": round(float(np.percentile(t, 95)), 2), "max": round(float(t.max()), 2)},
                "jitter_p95_ms": round(self.jitter_ms(), 2)}


class LinkModel:
    """Delivery times of one direction's packets, from their send times (any monotonic clock, seconds)."""

    def __init__(self, link: Link, seed: int = 0, reliable: bool = False, retransmit_s: float | None = None) -> None:
        self.link = link
        self.reliable = reliable
        self.retransmit_s = 2 * link.delay_ms / 1000.0 if retransmit_s is None else retransmit_s  # a round trip
        self._last_sent: float | None = None
        self._interval = TCP_MIN_RTO_S           # the stream's recent send interval (reliable links)
        self.stats = LinkStats()
        self._rng = random.Random(seed)
        self._bad = False
        r = 1.0 / link.burst_len
        self._enter_bad = link.burst_loss * r / (1.0 - link.burst_loss) if link.burst_loss else 0.0
        self._leave_bad = r
        self._origin: float | None = None
        self._fifo = -math.inf          # delivery time of the last in-order packet

    def schedule(self, sent_at: float, segments: int = 1) -> list[float]:
        """When the packet sent at `sent_at` arrives: [] if lost, two times if duplicated. On a reliable link a
        write of several `segments` goes out back to back, one delay for all, each segment lost on its own (the
        chain of a bursty loss advancing per segment): the write waits for a retransmission if any was, sooner
        where segments behind the lost one bring the duplicate ACKs of a fast retransmit."""
        link, rng, st = self.link, self._rng, self.stats
        if self._origin is None:
            self._origin = sent_at
        if self._last_sent is not None:
            self._interval += 0.2 * (sent_at - self._last_sent - self._interval)
        self._last_sent = sent_at
        st.sent += 1
        fates = [self._lost() for _ in range(segments)]     # every segment drawn, lost or not
        lost = any(fates)
        at = sent_at + self._delay()
        reordered = not self.reliable and link.reorder > 0 and rng.random() < link.reorder
        if lost:
            st.lost += 1
            st.lost_at.append(sent_at)
            if not self.reliable:
                return []
            # Fast retransmit needs three duplicate ACKs: from the segments behind the lost one in this write, else
            # from the writes after it; the retransmission timeout fires first if they are slow to come.
            behind = segments - 1 - fates.index(True)
            writes = 0 if behind >= 3 else math.ceil((3 - behind) / segments)
            resend = self.retransmit_s + min(TCP_MIN_RTO_S, writes * self._interval)
            at += resend
            # The retransmission can be lost too (then only the timeout finds it). It leaves a round trip later, when
            # a loss burst (counted in packets of the stream) has long passed: an independent draw at the mean rate.
            while rng.random() < link.loss + link.burst_loss:
                at += self.retransmit_s + TCP_MIN_RTO_S
        if reordered:
            st.reordered += 1
            at += link.reorder_ms / 1000.0
        if self._after_stall(at) != at:
            st.stalled += 1
        at = self._after_stall(at if reordered else max(at, self._fifo))
        if not reordered:
            self._fifo = at
        st.delivered += 1
        st.transits_s.append(at - sent_at)
        out = [at]
        if not self.reliable and link.duplicate > 0 and rng.random() < link.duplicate:
            st.duplicated += 1
            st.delivered += 1
            out.append(at + rng.uniform(0.0, 0.010))
        return out

    def _lost(self) -> bool:
        link, rng = self.link, self._rng
        if self._enter_bad:
            self._bad = rng.random() >= self._leave_bad if self._bad else rng.random() < self._enter_bad
        return self._bad or (link.loss > 0 and rng.random() < link.loss)

    def _delay(self) -> float:
        link, rng = self.link, self._rng
        d = link.delay_ms
        if link.jitter_ms:
            d += max(-link.jitter_ms, min(link.jitter_ms, rng.gauss(0.0, link.jitter_ms / 2.0)))
        if link.tail and rng.random() < link.tail:
            d += min(link.tail_ms * rng.paretovariate(1.5), MAX_TAIL_S * 1000.0)
        return max(0.0, d) / 1000.0

    def _after_stall(self, at: float) -> float:
        """`at`, or the end of the stall it falls in."""
        link = self.link
        if not link.stall_ms or self._origin is None:
            return at
        first = link.stall_every_s if link.stall_first_s is None else link.stall_first_s
        t = at - self._origin - first
        if t < 0:
            return at
        into = t % link.stall_every_s
        return at + (link.stall_ms / 1000.0 - into) if into < link.stall_ms / 1000.0 else at

    def stall_starts(self, until_s: float) -> list[float]:
        """When the stalls begin, in seconds after the first packet, before `until_s`."""
        link = self.link
        if not link.stall_ms:
            return []
        first = link.stall_every_s if link.stall_first_s is None else link.stall_first_s
        return [float(t) for t in np.arange(first, until_s, link.stall_every_s)]


class Delayer:
    """Hands items to `deliver` at the times a `LinkModel` gives them, on the running loop's clock, in time order and,
    for equal times (packets bunched behind a slow one, a stall's release), in the order they were sent; with
    `bypass` set, at once."""

    def __init__(self, model: LinkModel, deliver: Callable[[Any], object]) -> None:
        self.model = model
        self.bypass = False
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._due: list[tuple[float, int, Any]] = []     # a heap: (time, order sent, item)
        self._count = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, item: Any) -> list[float]:
        """Schedule `item`; its delivery times ([]: lost)."""
        if self.bypass:
            self._hand(item)
            return [self._loop.time()]
        times = self.model.schedule(self._loop.time())
        for at in times:
            heapq.heappush(self._due, (at, next(self._count), item))
        self._arm()
        return times

    def _arm(self) -> None:
        # asyncio's timers do not keep the order of equal times, so one timer serves the heap's head
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(self._due[0][0], self._fire) if self._due else None

    def _fire(self) -> None:
        now = self._loop.time()
        while self._due and self._due[0][0] <= now:
            self._hand(heapq.heappop(self._due)[2])
        self._arm()

    def _hand(self, item: Any) -> None:
        result = self._deliver(item)
        if asyncio.iscoroutine(result):
            self._loop.create_task(_quietly(result))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._due.clear()


async def _quietly(coro: Awaitable[object]) -> None:
    """A delayed send into a transport that closed meanwhile is a packet lost, not an error."""
    with contextlib.suppress(ConnectionError, OSError):
        await coro


# ---- UDP ------------------------------------------------------------------------------------------------------------


class UdpRelay:
    """client <-> `near` [relay] `far` <-> server. The client sends to `near`; what arrives there goes to `server`
    from `far` through the `up` link. The server sends to `far` (so a phone's SDP names `far` as its media address);
    what arrives there goes to `client` (the address `near` last heard from, unless given) through the `down` link."""

    def __init__(self, up: Link, down: Link, seed: int = 0, host: str = "127.0.0.1",
                 server: tuple[str, int] | None = None, client: tuple[str, int] | None = None) -> None:
        self.host = host
        self.server = server
        self.client = client
        self.up_model = LinkModel(up, seed)
        self.down_model = LinkModel(down, seed + 1)
        self._near: DatagramSocket | None = None
        self._far: DatagramSocket | None = None
        self._up: Delayer | None = None
        self._down: Delayer | None = None

    async def start(self) -> UdpRelay:
        loop = asyncio.get_running_loop()
        _, self._near = await loop.create_datagram_endpoint(lambda: DatagramSocket(self._from_client),
                                                            local_addr=(self.host, 0))
        _, self._far = await loop.create_datagram_endpoint(lambda: DatagramSocket(self._from_server),
                                                           local_addr=(self.host, 0))
        self._up = Delayer(self.up_model, lambda data: self._send(self._far, data, self.server))
        self._down = Delayer(self.down_model, lambda data: self._send(self._near, data, self.client))
        return self

    @property
    def near(self) -> tuple[str, int]:
        assert self._near is not None and self._near.transport is not None
        return self._near.transport.get_extra_info("sockname")[:2]

    @property
    def far(self) -> tuple[str, int]:
        assert self._far is not None and self._far.transport is not None
        return self._far.transport.get_extra_info("sockname")[:2]

    def _from_client(self, data: bytes, addr: tuple[str, int]) -> None:
        self.client = self.client or addr
        if self._up is not None:
            self._up.submit(data)

    def _from_server(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._down is not None:
            self._down.submit(data)

    @staticmethod
    def _send(endpoint: DatagramSocket | None, data: bytes, to: tuple[str, int] | None) -> None:
        if endpoint is not None and endpoint.transport is not None and to is not None:
            endpoint.transport.sendto(data, to)

    def close(self) -> None:
        for delayer in (self._up, self._down):
            if delayer is not None:
                delayer.cancel()
        for endpoint in (self._near, self._far):
            if endpoint is not None and endpoint.transport is not None:
                endpoint.transport.close()


# ---- TCP ------------------------------------------------------------------------------------------------------------

class TcpRelay:
    """A listening port that forwards each connection to `target` through an `up` and a `down` reliable link: every
    read is one write of as many segments as its bytes fill (`TCP_MSS`), delivered in order at the model's time
    (a lost segment is a retransmission later, holding everything behind it: an 80 ms PCM append, four segments,
    meets four times a 20 ms μ-law message's loss, as on a real link). `port` is where clients connect (a WebSocket
    URL with this port reaches the server). Each connection gets its own seeded models (seed, seed + 1 for the
    first; + 2 per further connection); `models` keeps them, in connection order."""

    def __init__(self, target: tuple[str, int], up: Link, down: Link, seed: int = 0, host: str = "127.0.0.1") -> None:
        self.target = target
        self.up = up
        self.down = down
        self.seed = seed
        self.host = host
        self.models: list[tuple[LinkModel, LinkModel]] = []
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        rtt_s = (self.up.delay_ms + self.down.delay_ms) / 1000.0
        k = len(self.models)
        up = LinkModel(self.up, self.seed + 2 * k, reliable=True, retransmit_s=rtt_s)
        down = LinkModel(self.down, self.seed + 2 * k + 1, reliable=True, retransmit_s=rtt_s)
        self.models.append((up, down))
        pumps = [asyncio.ensure_future(_pump(reader, up_writer, up)),
                 asyncio.ensure_future(_pump(up_reader, writer, down))]
        for task in pumps:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*pumps, return_exceptions=True)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, model: LinkModel) -> None:
    """Read segments as they come; write each at its delivery time, in order; close the far side at the end."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def write() -> None:
        while (item := await queue.get()) is not None:
            at, data = item
            await asyncio.sleep(max(0.0, at - loop.time()))
            writer.write(data)
            await writer.drain()

    writing = asyncio.ensure_future(write())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((model.schedule(loop.time(), -(-len(data) // TCP_MSS))[0], data))
        queue.put_nowait(None)
        await writing
    except (ConnectionError, OSError):
        pass
    finally:
        writing.cancel()
        with contextlib.suppress(Exception):
            writer.close()


# ---- an aiortc peer -------------------------------------------------------------------------------------------------

@dataclass
class PeerImpairment:
    """What `impair_peer` installed: the two models (for their stats) and `remove()`."""

    up: LinkModel
    down: LinkModel
    remove: Callable[[], None]
    rtp_lost_at: list[float]       # send times of the RTP packets (not RTCP, DTLS or SCTP) the up link lost


def impair_peer(pc: Any, up: Link, down: Link, seed: int = 0) -> PeerImpairment:
    """Impair every datagram an aiortc peer connection sends (`up`) and receives (`down`) from now on. Install once
    the peer is connected (its DTLS handshake is done); the hook sits on the ICE transport that the call's media and
    data channel share (BUNDLE), so RTP, RTCP and SCTP all cross the same bad link, as they would for a browser.

    aiortc's DTLS transport sends through `RTCIceTransport._send` and reads through `RTCIceTransport._recv`; both are
    plain attributes (aiortc 1.16), replaced here and put back by `remove()`."""
    transports = {id(t.sender.transport.transport): t.sender.transport.transport for t in pc.getTransceivers()
                  if t.sender.transport is not None}
    sctp = getattr(pc, "sctp", None)
    if sctp is not None:
        transports[id(sctp.transport.transport)] = sctp.transport.transport
    if len(transports) != 1:
        raise ValueError(f"impair_peer expects one bundled ICE transport, found {len(transports)}")
    ice = next(iter(transports.values()))
    loop = asyncio.get_running_loop()
    send, recv = ice._send, ice._recv
    up_model, down_model = LinkModel(up, seed), LinkModel(down, seed + 1)
    sender = Delayer(up_model, send)
    inbox: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
    receiver = Delayer(down_model, inbox.put_nowait)

    rtp_lost_at: list[float] = []

    async def impaired_send(data: bytes) -> None:
        if not sender.submit(data) and is_rtp(data):
            rtp_lost_at.append(loop.time())

    async def pump() -> None:
        while True:
            try:
                data = await recv()
            except Exception as e:          # the connection ended: the reader must see it, at once
                inbox.put_nowait(e)
                return
            receiver.submit(data)

    pumping: list[asyncio.Task[None]] = []

    async def impaired_recv() -> bytes:
        if not pumping:           # the first read comes once ICE is up (reading before that is an error)
            pumping.append(loop.create_task(pump()))
        item = await inbox.get()
        if isinstance(item, BaseException):
            inbox.put_nowait(item)
            raise item
        return item

    ice._send, ice._recv = impaired_send, impaired_recv

    def remove() -> None:
        """From now on every datagram passes at once (the reader already waiting on the impaired path keeps it)."""
        sender.bypass = receiver.bypass = True
        sender.cancel()
        receiver.cancel()
        ice._send = send

    return PeerImpairment(up_model, down_model, remove, rtp_lost_at)


def is_rtp(datagram: bytes) -> bool:
    """An (S)RTP packet, not RTCP (RFC 5761 s.4: its second byte is 192-223), DTLS or STUN (RFC 7983)."""
    return len(datagram) >= 12 and 128 <= datagram[0] <= 191 and not 192 <= datagram[1] <= 223
