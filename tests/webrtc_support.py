"""Test helpers for WebRTC on loopback: an ICE host address aioice will use, speech wavs from espeak-ng.

aioice drops 127.0.0.1 from its host candidates, so on a machine (or netns) whose only interface is `lo` nothing
connects until `lo` carries another address: 127.0.0.2 is added when we are root, else the tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from aioice.ice import get_host_addresses

from model.audio import read_wav, resample, write_wav

LOOPBACK_EXTRA = "127.0.0.2"


def ensure_ice_host_address() -> list[str]:
    """The IPv4 host candidates aioice will gather; adds 127.0.0.2 to `lo` when there are none (root only)."""
    addresses = get_host_addresses(use_ipv4=True, use_ipv6=False)
    if addresses:
        return addresses
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("no IPv4 address besides 127.0.0.1 for ICE, and not root to add 127.0.0.2 to lo")
    subprocess.run(["ip", "addr", "add", f"{LOOPBACK_EXTRA}/8", "dev", "lo"], check=False, capture_output=True)
    addresses = get_host_addresses(use_ipv4=True, use_ipv6=False)
    if not addresses:
        pytest.skip("could not give lo an ICE-usable address")
    return addresses


def espeak_wav(folder: Path, text: str, rate: int = 24000, name: str = "speech") -> tuple[Path, np.ndarray]:
    """Speech from espeak-ng, resampled to `rate` mono s16: (wav path, float32 samples)."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    raw = folder / f"{name}-espeak.wav"
    subprocess.run(["espeak-ng", "-w", str(raw), text], check=True, capture_output=True)
    samples, raw_rate = read_wav(raw)
    samples = resample(samples, raw_rate, rate)
    path = folder / f"{name}-{rate}.wav"
    write_wav(path, samples, rate)
    return path, samples


class PacketTap:
    """Wraps one live receiver's RTP entry point: counts packets, drops or delays chosen ones (user-space netem).

    `drop(i)` / `delay_s(i)` decide per packet index (0-based, in arrival order at the receiver)."""

    def __init__(self, receiver, drop=None, delay_s=None) -> None:
        import asyncio

        self.handled = 0
        self.timestamps: list[int] = []          # RTP timestamp of each packet, by arrival index
        self.payloads: list[bytes] = []          # and its payload
        self.dropped: list[int] = []
        self.delayed: list[int] = []
        self._drop = drop or (lambda i: False)
        self._delay = delay_s or (lambda i: 0.0)
        inner = receiver._handle_rtp_packet
        loop = asyncio.get_running_loop()

        async def handle(packet, arrival_time_ms: int) -> None:
            index = self.handled
            self.handled += 1
            self.timestamps.append(packet.timestamp)
            self.payloads.append(packet.payload)
            if self._drop(index):
                self.dropped.append(index)
                return
            delay = self._delay(index)
            if delay > 0:
                self.delayed.append(index)
                loop.call_later(delay, lambda: asyncio.ensure_future(inner(packet, arrival_time_ms)))
                return
            await inner(packet, arrival_time_ms)

        receiver._handle_rtp_packet = handle

    def index_of(self, pts: int) -> int:
        """Arrival index of the packet a decoded frame came from (aiortc's pts counts from the first timestamp)."""
        return self.timestamps.index((self.timestamps[0] + pts) % (1 << 32))

    def pts_of(self, index: int) -> int:
        return (self.timestamps[index] - self.timestamps[0]) % (1 << 32)


async def connect_pair(sender_track, *, sink=None, drop=None, delay_s=None, timeout_s: float = 15.0, encoder=None,
                       red: bool = False):
    """Two in-process aiortc peers on loopback: `sender_track` (with our contained encoder) -> a receiver whose
    RTP entry is tapped from the first packet on. With a `sink`, the receiver's audio goes through `InboundAudio`
    into it; without, through aiortc's own jitter buffer and decoder to the remote track. `red`: the offer proposes
    RED and both peers take it (`media.tracks.use_red`), as the server and a browser do.

    Returns (sender_pc, receiver_pc, receiver_transceiver, encoder, tap, inbound or None)."""
    import asyncio

    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
    from aiortc.rtcrtpsender import RTCRtpSender

    from media.red import Redundancy, with_red_offer
    from media.tracks import ContainedOpusEncoder, InboundAudio, install_contained_encoder, use_red

    ensure_ice_host_address()
    a = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    b = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    sending = a.addTransceiver(sender_track, direction="sendonly")
    opus = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType.lower() == "audio/opus"]
    sending.setCodecPreferences(opus)
    encoder = encoder or ContainedOpusEncoder()
    install_contained_encoder(sending.sender, encoder)
    await a.setLocalDescription(await a.createOffer())
    offer = with_red_offer(a.localDescription.sdp) if red else a.localDescription.sdp
    await b.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
    receiving = b.getTransceivers()[0]
    fmt = use_red(receiving, offer) if red else None
    tap = PacketTap(receiving.receiver, drop=drop, delay_s=delay_s)
    if hasattr(sink, "tap"):
        sink.tap = tap
    inbound = InboundAudio(receiving.receiver, sink, red=fmt) if sink is not None else None
    await b.setLocalDescription(await b.createAnswer())
    await a.setRemoteDescription(b.localDescription)
    if red:
        encoder.red = Redundancy(use_red(sending, b.localDescription.sdp))
    connected = asyncio.Event()

    @b.on("connectionstatechange")
    def _state() -> None:
        if b.connectionState == "connected":
            connected.set()

    await asyncio.wait_for(connected.wait(), timeout_s)
    return a, b, receiving, encoder, tap, inbound
