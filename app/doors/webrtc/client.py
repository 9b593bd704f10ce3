"""A Python WebRTC client for `POST /v1/realtime/calls`: an aiortc peer that speaks a waveform and records the reply.

Used by the end-to-end tests and by `bench/webrtc_load.py`, and usable from scripts. The microphone is an
`OutboundAudioTrack` over the given samples (20 ms paced, then silence); the model's audio comes through the same
receive path the server uses (`InboundAudio`, no aiortc jitter buffer; its offer says `useinbandfec=1` and proposes
RED, as a browser's does, so a lost packet comes back from the next one, whole or from its FEC) and is recorded at its
pts; `oai-events` messages are kept in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcrtpsender import RTCRtpSender

from media.red import Redundancy, with_red_offer
from media.tracks import (
    RATE,
    ContainedOpusEncoder,
    InboundAudio,
    OutboundAudioTrack,
    install_contained_encoder,
    use_red,
    with_inband_fec,
)


class ArraySource:
    """A `PlayoutSource` over fixed samples: 20 ms at a time, then silence (or again, with `loop`)."""

    def __init__(self, samples: np.ndarray, loop: bool = False) -> None:
        self._samples = np.asarray(samples, np.float32).reshape(-1)
        self._pos = 0
        self._loop = loop

    @property
    def sent_s(self) -> float:
        return self._pos / RATE

    def read(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        total = len(self._samples)
        if self._loop and total:
            idx = (self._pos + np.arange(n)) % total
            out[:] = self._samples[idx]
        elif self._pos < total:
            chunk = self._samples[self._pos:self._pos + n]
            out[:len(chunk)] = chunk
        self._pos += n
        return out


@dataclass
class Recording:
    """A `PtsSink` that keeps every received chunk with its arrival time."""

    chunks: list[tuple[int, np.ndarray, float]] = field(default_factory=list)

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        self.chunks.append((int(pts or 0), samples.copy(), time.monotonic() if now is None else now))

    def audio(self) -> np.ndarray:
        """The received timeline at 24 kHz: each chunk at its pts, gaps as zeros."""
        if not self.chunks:
            return np.zeros(0, np.float32)
        end = max(p + len(s) for p, s, _ in self.chunks)
        out = np.zeros(max(0, end), np.float32)
        for p, s, _ in self.chunks:
            if p >= 0:
                out[p:p + len(s)] = s
        return out


class CallRefused(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body

    def error(self) -> dict[str, Any]:
        with contextlib.suppress(ValueError):
            return json.loads(self.body).get("error", {})
        return {}


class RealtimeCall:
    """One call: `await connect()`, speak `audio` (24 kHz float32), read `events` / `recording`, `await hang_up()`."""

    def __init__(self, base_url: str, audio: np.ndarray | None = None, *, session: dict[str, Any] | None = None,
                 api_key: str | None = None, ice_servers: list[RTCIceServer] | None = None, loop_audio: bool = False,
                 multipart: bool | None = None,
                 on_answer: Callable[[RTCPeerConnection], object] | None = None, fec_loss_pct: int = 0,
                 red: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session
        self.api_key = api_key
        self.multipart = session is not None if multipart is None else multipart
        # Called once the answer is applied, before ICE and DTLS start (a test or load driver puts the peer's
        # transport behind an impaired link there: bench/impair.py).
        self.on_answer = on_answer
        self.source = ArraySource(np.zeros(0, np.float32) if audio is None else audio, loop=loop_audio)
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers or []))
        self.mic = OutboundAudioTrack(self.source)
        # > 0: the microphone sends in-band FEC for that much loss, as a browser does once its RTCP says it loses.
        self.encoder = ContainedOpusEncoder(expected_loss_pct=fec_loss_pct)
        self.offers_red = red              # as a browser's offer does: RED both ways if the server answers it
        self.recording = Recording()
        self.inbound: InboundAudio | None = None
        self.events: list[dict[str, Any]] = []
        self.location: str | None = None
        self.connected_at: float | None = None
        self._event_waiters: list[tuple[str, asyncio.Future[dict[str, Any]]]] = []
        self._dc_open = asyncio.Event()
        self._connected = asyncio.Event()
        self._failed = asyncio.Event()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def connect(self, timeout_s: float = 20.0) -> None:
        pc = self.pc
        transceiver = pc.addTransceiver(self.mic, direction="sendrecv")
        opus = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType.lower() == "audio/opus"]
        transceiver.setCodecPreferences(opus)
        install_contained_encoder(transceiver.sender, self.encoder)

        channel = pc.createDataChannel("oai-events")
        self.channel = channel
        channel.on("open", self._dc_open.set)
        channel.on("message", self._on_message)

        @pc.on("connectionstatechange")
        def _state() -> None:
            if pc.connectionState == "connected":
                self.connected_at = time.monotonic()
                self._connected.set()
            elif pc.connectionState in ("failed", "closed"):
                self._failed.set()

        await pc.setLocalDescription(await pc.createOffer())
        # As a browser's offer does: our receive path (InboundAudio) rebuilds a lost packet from in-band FEC, so
        # the server sends some (aiortc's own offer does not say so).
        offer = with_inband_fec(pc.localDescription.sdp)
        answer = await self._post_offer(with_red_offer(offer) if self.offers_red else offer)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        red = use_red(transceiver, answer) if self.offers_red else None
        if red is not None:
            self.encoder.red = Redundancy(red)
        if self.on_answer is not None:
            self.on_answer(pc)
        # the remote track exists from here on; packets can only come after ICE and DTLS
        self.inbound = InboundAudio(transceiver.receiver, self.recording, red=red)
        waits = [asyncio.ensure_future(self._connected.wait()), asyncio.ensure_future(self._failed.wait())]
        done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if not self._connected.is_set():
            raise ConnectionError(f"ICE/DTLS did not connect (state {pc.connectionState})")
        await asyncio.wait_for(self._dc_open.wait(), timeout_s)

    async def _post_offer(self, sdp: str) -> str:
        url = f"{self.base_url}/v1/realtime/calls"
        async with aiohttp.ClientSession() as http:
            if self.multipart:
                form = aiohttp.FormData()
                form.add_field("sdp", sdp, content_type="application/sdp")
                if self.session is not None:
                    form.add_field("session", json.dumps(self.session), content_type="application/json")
                request = http.post(url, data=form, headers=self._headers())
            else:
                headers = {"Content-Type": "application/sdp", **self._headers()}
                request = http.post(url, data=sdp.encode(), headers=headers)
            async with request as res:
                body = await res.text()
                if res.status != 201:
                    raise CallRefused(res.status, body)
                location = res.headers.get("Location", "")
                self.location = location if location.startswith("http") else f"{self.base_url}{location}"
                return body

    def _on_message(self, message: str | bytes) -> None:
        event = json.loads(message)
        self.events.append(event)
        for waiter in list(self._event_waiters):
            etype, fut = waiter
            if event.get("type") == etype and not fut.done():
                fut.set_result(event)
                self._event_waiters.remove(waiter)

    async def wait_event(self, etype: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The first event of this type (already received, or the next one)."""
        for event in self.events:
            if event.get("type") == etype:
                return event
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._event_waiters.append((etype, fut))
        return await asyncio.wait_for(fut, timeout_s)

    def send_event(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    def transcript(self) -> str:
        return "".join(e.get("delta", "") for e in self.events
                       if e.get("type") == "response.output_audio_transcript.delta")

    async def hang_up(self, delete: bool = True) -> int | None:
        """DELETE the call (when `delete`), then close the peer. Returns the DELETE status."""
        status = None
        if delete and self.location:
            async with aiohttp.ClientSession() as http, http.delete(self.location, headers=self._headers()) as res:
                status = res.status
        await self.close()
        return status

    async def close(self) -> None:
        await self.pc.close()
        self.encoder.release()
