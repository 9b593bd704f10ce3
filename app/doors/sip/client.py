"""A minimal SIP caller over UDP with its own RTP socket, for tests, benches and smoke checks of the SIP door.

`SipClient.invite()` sends an INVITE (an SDP offer built from `codecs`, or any body) and returns every response up
to the final one; `ack()`, `bye()`, `cancel()`, `options()` and `send_raw()` do what they say. `RtpPeer` sends
20 ms packets on the clock and keeps what arrives, each packet with the time the kernel took it in (where Linux stamps
it), so a busy event loop that reads late does not make the server's packets late. No retransmissions: loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np
from aiortc.rtp import RtpPacket
from sipmessage import Message, Response

from media.rtp import AudioCodec, RtpCodec, build_rtp


class _Queue(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.queue.put_nowait(data)


# Linux's SO_TIMESTAMPNS (asm-generic/socket.h; Python's socket module does not name it): each datagram comes with
# the wall-clock time the kernel received it, a timespec of two 64-bit fields.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("qq")


def _arrived_at(ancdata: list[tuple[int, int, bytes]]) -> float:
    """A datagram's arrival on the monotonic clock: now, less how long it waited since the kernel stamped it."""
    now = time.monotonic()
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return now - max(0.0, time.time() - (sec + nsec * 1e-9))
    return now


@dataclass
class RtpPeer:
    """An RTP endpoint: `send(codec, pt, samples)` in 20 ms packets, `received` keeps (arrival, packet)."""

    host: str = "127.0.0.1"
    port: int = 0
    ssrc: int = field(default_factory=lambda: secrets.randbits(32))
    seq: int = 0
    ts: int = 0
    received: list[tuple[float, RtpPacket]] = field(default_factory=list)
    _sock: socket.socket | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # not Linux: arrivals are when the loop reads them
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._sock, self._loop = sock, asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._read)

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, ancdata, _, _ = self._sock.recvmsg(65536, socket.CMSG_SPACE(_TIMESPEC.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error for an earlier send (the far port closed): nothing to read in it
                continue
            try:
                self.received.append((_arrived_at(ancdata), RtpPacket.parse(data)))
            except ValueError:
                continue

    def send_raw(self, data: bytes, to: tuple[str, int]) -> None:
        assert self._sock is not None
        with contextlib.suppress(BlockingIOError):  # the send buffer full: lost, as UDP loses it
            self._sock.sendto(data, to)

    def send_packet(self, pt: int, payload: bytes, to: tuple[str, int], ticks: int, marker: bool = False) -> None:
        self.send_raw(build_rtp(pt, self.seq, self.ts, self.ssrc, payload, marker), to)
        self.seq += 1
        self.ts += ticks

    async def stream(self, codec: RtpCodec, pt: int, samples: np.ndarray, to: tuple[str, int]) -> None:
        """Send `samples` (float32 at the codec's rate) as 20 ms packets paced by the clock."""
        x = np.asarray(samples, dtype=np.float32)
        enc = AudioCodec(codec)
        n = codec.samples_per_packet
        start = time.monotonic()
        for i in range(x.size // n):
            self.send_packet(pt, enc.encode(x[i * n:(i + 1) * n]), to, codec.ticks_per_packet, marker=i == 0)
            await asyncio.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))

    def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())  # a no-op on a closed loop
            self._sock.close()
            self._sock = None


def offer(address: str, port: int, codecs: list[tuple[int, str]], direction: str = "sendrecv",
          dtmf_pt: int | None = 101, version: int = 1, fmtp: dict[int, str] | None = None) -> bytes:
    """An SDP offer: `codecs` as (payload type, rtpmap) e.g. (0, "PCMU/8000"), with `fmtp` parameters by payload
    type (e.g. {111: "useinbandfec=1"}), plus telephone-event/8000."""
    pts = [pt for pt, _ in codecs] + ([dtmf_pt] if dtmf_pt is not None else [])
    lines = ["v=0", f"o=test 1 {version} IN IP4 {address}", "s=-", f"c=IN IP4 {address}", "t=0 0",
             f"m=audio {port} RTP/AVP {' '.join(map(str, pts))}"]
    lines += [f"a=rtpmap:{pt} {name}" for pt, name in codecs]
    lines += [f"a=fmtp:{pt} {params}" for pt, params in (fmtp or {}).items()]
    if dtmf_pt is not None:
        lines += [f"a=rtpmap:{dtmf_pt} telephone-event/8000", f"a=fmtp:{dtmf_pt} 0-15"]
    lines += ["a=ptime:20", f"a={direction}"]
    return ("\r\n".join(lines) + "\r\n").encode()


@dataclass
class Dialog:
    call_id: str
    from_tag: str
    uri: str
    cseq: int = 1
    to_tag: str | None = None
    invite_branch: str = ""


class SipClient:
    def __init__(self, server: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.server = server
        self.host = host
        self.port = 0
        self.server_requests: list[Message] = []   # requests the server sent us (its BYE)
        self.strays = 0                              # datagrams here that are not SIP, skipped as a phone does: a
                                                     # keep-alive, or RTCP meant for an RTP port just below ours
        self._sock: _Queue | None = None

    async def open(self) -> None:
        _, self._sock = await asyncio.get_running_loop().create_datagram_endpoint(_Queue, local_addr=(self.host, 0))
        assert self._sock.transport is not None
        self.port = self._sock.transport.get_extra_info("sockname")[1]

    def close(self) -> None:
        if self._sock is not None and self._sock.transport is not None:
            self._sock.transport.close()

    def send_raw(self, data: bytes) -> None:
        assert self._sock is not None and self._sock.transport is not None
        self._sock.transport.sendto(data, self.server)

    async def response(self, timeout: float = 5.0) -> Response:
        """The next response (requests from the server, e.g. its BYE, are answered 200 and skipped)."""
        assert self._sock is not None
        deadline = time.monotonic() + timeout
        while True:
            data = await asyncio.wait_for(self._sock.queue.get(), max(0.01, deadline - time.monotonic()))
            try:
                msg = Message.parse(data)
            except Exception:  # the parser fails on non-SIP bytes in more ways than one: each is a stray
                self.strays += 1
                continue
            if isinstance(msg, Response):
                return msg
            self.server_requests.append(msg)

    def request(self, method: str, d: Dialog, body: bytes = b"", headers: dict[str, str] | None = None,
                branch: str | None = None, cseq: int | None = None, to_tag: str | None = None) -> str:
        """Send a request in dialog `d` (`to_tag` overrides the dialog's); returns its Via branch."""
        branch = branch or "z9hG4bK" + secrets.token_hex(8)
        tag = to_tag or d.to_tag
        to = f"<{d.uri}>" + (f";tag={tag}" if tag else "")
        lines = [f"{method} {d.uri} SIP/2.0", f"Via: SIP/2.0/UDP {self.host}:{self.port};branch={branch};rport",
                 "Max-Forwards: 70", f"From: <sip:tester@{self.host}>;tag={d.from_tag}", f"To: {to}",
                 f"Call-ID: {d.call_id}", f"CSeq: {cseq if cseq is not None else d.cseq} {method}",
                 f"Contact: <sip:tester@{self.host}:{self.port}>"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body:
            lines.append("Content-Type: application/sdp")
        lines.append(f"Content-Length: {len(body)}")
        self.send_raw(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return branch

    def dialog(self, user: str = "agent") -> Dialog:
        return Dialog(secrets.token_hex(8), secrets.token_hex(4), f"sip:{user}@{self.server[0]}:{self.server[1]}")

    async def invite(self, d: Dialog, body: bytes, headers: dict[str, str] | None = None,
                     timeout: float = 10.0) -> list[Response]:
        """INVITE (a new CSeq when `d` already has a to-tag: a re-INVITE); every response up to the final one."""
        if d.to_tag:
            d.cseq += 1
        d.invite_branch = self.request("INVITE", d, body, headers)
        seen: list[Response] = []
        while True:
            resp = await self.response(timeout)
            if resp.cseq.method != "INVITE" or resp.cseq.sequence != d.cseq:
                continue
            seen.append(resp)
            if resp.code >= 200:
                tag = resp.to_address.parameters.get("tag")
                if tag and 200 <= resp.code < 300:
                    d.to_tag = tag
                return seen

    def ack(self, d: Dialog, final: Response) -> None:
        """ACK the INVITE's final response (a non-2xx one's ACK reuses the INVITE's branch)."""
        branch = d.invite_branch if final.code >= 300 else None
        self.request("ACK", d, cseq=d.cseq, branch=branch, to_tag=final.to_address.parameters.get("tag"))

    async def bye(self, d: Dialog) -> Response:
        d.cseq += 1
        self.request("BYE", d)
        return await self.response()
