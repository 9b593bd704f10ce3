"""A UDP socket that hands each datagram and its sender's (host, port) to a callback: the SIP door's RTP and RTCP
ports, and the load driver's impairing relay (bench/impair.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class DatagramSocket(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, tuple[str, int]], None]) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.on_datagram(data, addr[:2])

    def error_received(self, exc: Exception) -> None:
        pass  # ICMP port unreachable from a peer that went away: its packets are lost, as on a network
