"""SIP on the wire: the UDP and TCP sockets of `--sip-port`, framing, where a reply goes, and the addresses we give.

A datagram, or a TCP message framed by its Content-Length, is handed on as bytes with the `Peer` it came from (a
header section or body past `MAX_SIP_BYTES` ends that TCP connection; a double-CRLF ping gets its CRLF pong).
Replies go where RFC 3581 says: with `rport`, to the source address and port; else to the source address at the
Via's port (never to another host than the one that sent the request, so we cannot be used to reflect traffic).
`response(...)` builds a response from its request (Via, From, To, Call-ID and CSeq copied as they came; our tag
added to To). `Local` is the address our SDP and Contact give: `--sip-address`, the bind address, or our side of
the route to the caller when bound to every interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

from sipmessage import Request, Response

from app.shell.metrics import Metrics
from app.shell.settings import Settings

logger = logging.getLogger(__name__)

MAX_SIP_BYTES = 16 << 10          # larger requests get 513 (a trunk's INVITE is 1-4 KB)
_RPORT = re.compile(r";\s*rport(?=[;\s]|$)")
_LENGTH = re.compile(rb"^(?:content-length|l)[ \t]*:[ \t]*(\d+)[ \t]*\r?$", re.I | re.M)


@dataclass
class Peer:
    """Where a request came from and how to answer it (a UDP socket, or the TCP connection it came on)."""

    addr: tuple[str, int]
    send: Callable[[bytes, tuple[str, int]], None]
    transport: str                 # "UDP" or "TCP"


def tag(address: object) -> str | None:
    """The `tag` parameter of a From or To address."""
    return getattr(address, "parameters", {}).get("tag") if address is not None else None


def reply_address(peer: Peer, via_parameters: dict[str, object], via_port: int | None) -> tuple[str, int]:
    """Where the responses to a request go (RFC 3581)."""
    return peer.addr if peer.transport == "TCP" or "rport" in via_parameters else (peer.addr[0], via_port or 5060)


def response(req: Request, peer: Peer, code: int, reason: str, *, to_tag: str | None = None,
             headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> bytes:
    """A response to `req`: Via (with `received`, and `rport` filled in over UDP), From, Call-ID, CSeq copied, our
    tag added to To, then `headers` and an SDP `body`."""
    r = Response(code, reason, body)
    vias = req.headers.getlist("Via")
    if vias:
        top = vias[0]
        top = _RPORT.sub(f";rport={peer.addr[1]}", top, count=1) if peer.transport == "UDP" else top
        vias[0] = f"{top};received={peer.addr[0]}"
        r.headers.setlist("Via", vias)
    for name in ("From", "To", "Call-ID", "CSeq"):
        value = req.headers.get(name)
        if value is not None:
            if name == "To" and to_tag and not tag(req.to_address):
                value = f"{value};tag={to_tag}"
            r.headers.set(name, value)
    for name, value in headers or []:
        r.headers.add(name, value)
    r.headers.set("Server", "personaplex")
    if body:
        r.headers.set("Content-Type", "application/sdp")
    r.headers.set("Content-Length", str(len(body)))
    return bytes(r)


class Sockets:
    """The SIP port on UDP and TCP; each message goes to `receive(data, peer)`."""

    def __init__(self, metrics: Metrics, receive: Callable[[bytes, Peer], None]) -> None:
        self._metrics = metrics
        self._receive = receive
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        sockets = self

        class Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                sockets._receive(data, Peer(addr[:2], sockets._udp_send, "UDP"))

            def error_received(self, exc: Exception) -> None:
                pass  # ICMP errors for a caller that went away

        try:
            self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(host, port))
            self.port = self._udp.get_extra_info("sockname")[1]
            self._tcp = await asyncio.start_server(self._tcp_connection, host, self.port, limit=MAX_SIP_BYTES)
        except OSError as exc:  # another process holds the port, on either transport: the operator's to see
            if self._udp is not None:
                self._udp.close()
            raise OSError(exc.errno, f"the SIP port {port} on {host}: {exc.strerror}") from None

    def _udp_send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(data, addr)

    async def _tcp_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def send(data: bytes, _addr: tuple[str, int]) -> None:
            if not writer.is_closing():
                writer.write(data)
        peer = Peer(writer.get_extra_info("peername")[:2], send, "TCP")
        # A peer that hangs up mid-message, or sends a header section past the limit, loses its connection.
        with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.strip():
                    writer.write(b"\r\n")   # RFC 5626 keep-alive: a CRLF pong for a double-CRLF ping
                    continue
                match = _LENGTH.search(head)
                length = int(match.group(1)) if match else 0
                if length > MAX_SIP_BYTES:
                    self._metrics.sip["oversized"] += 1
                    break
                self._receive(head + await reader.readexactly(length), peer)
        writer.close()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tcp.wait_closed(), 1.0)


class Local:
    """Our side of a call's signalling: the address and port our SDP and Contact give."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = 0                              # the SIP port, once bound
        self._towards: dict[str, str] = {}         # caller address -> our address on the route to it

    def advertised(self, peer: Peer) -> str:
        """`--sip-address`, the bind address, or our side of the route to the caller when bound to every interface."""
        if self.settings.sip_address:
            return self.settings.sip_address
        host = self.settings.host
        if host not in ("0.0.0.0", "::", ""):
            return host
        found = self._towards.get(peer.addr[0])
        if found is None:
            with socket.socket(socket.AF_INET6 if ":" in peer.addr[0] else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer.addr[0], 9))
                found = s.getsockname()[0]
            self._towards[peer.addr[0]] = found
        return found

    def contact(self, req: Request, peer: Peer) -> str:
        user = req.uri.user or "personaplex"
        transport = ";transport=tcp" if peer.transport == "TCP" else ""
        return f"<sip:{user}@{self.advertised(peer)}:{self.port}{transport}>"
