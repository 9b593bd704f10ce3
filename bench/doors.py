"""Load clients for the server's doors, one class per door, and what they measure; shared by `bench/realtime_check.py`,
`bench/webrtc_load.py` and `bench/e2e.py`.

Doors: `RealtimeClient` (`WS /v1/realtime?duplex=1`, PCM16 24 kHz appends, audio deltas out), `DuplexClient`
(`WS /v1/duplex`, binary PCM16 24 kHz both ways), `TwilioClient` (`WS /v1/twilio`, 20 ms μ-law 8 kHz `media` both
ways), `WebRTCClient` (an aiortc peer through `app.doors.webrtc.client.RealtimeCall`, Opus) and `SipClientDoor` (a SIP
call over UDP to the server's `--sip-port`, 20 ms PCMU RTP both ways; `SipClientDoor.sip_port` must be set).
Each one opens its session, sends its audio paced on the clock (a piece that is due late goes late: no catch-up
burst), reads everything, and keeps per piece of output its arrival time and where it ends in the output stream.

From that, per session: the stream's real-time factor (output seconds per wall second between 10 % and 90 % of the
pieces), output lateness (each piece's arrival against an ideal real-time schedule anchored at the earliest piece:
the jitter of the cadence), time to first audio after the open began, and missing frames. The WebSocket doors send
only model frames, so a missing frame is one the client sent and got nothing back for one drain after its last
send; Twilio and WebRTC play the model's audio out on a clock and fill a frame that was not there with silence, so
there a missing frame is 80 ms of digital silence after the first audio.

Every client session is built by `client_session()`: aiohttp's default connector allows 100 connections, and a
101st `ws_connect` through it waits forever.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import math
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

from app.doors.sip.client import RtpPeer, SipClient, offer
from app.doors.sip.sdp import parse_offer
from media.codecs import AudioFormat
from model.audio import read_wav, resample

FRAME = 1920
RATE = 24000
FRAME_S = 0.08
AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
TWILIO_RATE = 8000
TWILIO_CHUNK = 160          # 20 ms of μ-law at 8 kHz
ULAW_SILENCE = 0xFF         # μ-law of 0.0
OPUS_SILENCE_PEAK = 1e-3    # Opus gives digital silence back at about 3e-5 peak, never exactly 0
TEXT = ("Hello, I would like to book a table for two tonight, around eight if possible. "
        "Do you have anything by the window? My friend is vegetarian, is that a problem?")


def client_session() -> aiohttp.ClientSession:
    """An HTTP/WebSocket client session with no cap on concurrent connections."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


def synthetic_speech(seconds: float) -> np.ndarray:
    """A deterministic voice-like signal at 24 kHz: harmonics on a wandering pitch under a syllable envelope."""
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 140 * (1 + 0.1 * np.sin(2 * np.pi * 1.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 8))
    return (voice * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2) * 0.2).astype(np.float32)


def speech(wav: Path | str | None = None, seconds: float | None = None, espeak: bool = True) -> np.ndarray:
    """24 kHz mono float32 in whole 80 ms frames: the wav, else espeak-ng (when installed and `espeak`), else
    `synthetic_speech`; cut or looped to `seconds` when given."""
    path = Path(wav) if wav else None
    with tempfile.TemporaryDirectory() as tmp:
        if path is None and espeak and shutil.which("espeak-ng"):
            path = Path(tmp) / "speech.wav"
            subprocess.run(["espeak-ng", "-w", str(path), TEXT], check=True, capture_output=True)
        if path is None:
            audio = synthetic_speech(seconds or 4.0)
        else:
            samples, rate = read_wav(path)
            audio = resample(samples, rate, RATE)
    if seconds is not None:
        n = int(seconds * RATE)
        audio = np.resize(audio, n) if audio.size < n else audio[:n]
    frames = -(-audio.size // FRAME)
    return np.pad(audio.astype(np.float32), (0, frames * FRAME - audio.size))


def quantiles(values: list[float] | np.ndarray) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "max": round(float(a.max()), 2)}


@dataclass
class Received:
    """Output as it arrived: per piece its arrival time (monotonic s) and where it ends in the stream (s)."""

    times: list[float] = field(default_factory=list)
    ends_s: list[float] = field(default_factory=list)

    def add(self, now: float, end_s: float) -> None:
        self.times.append(now)
        self.ends_s.append(end_s)

    def rtf(self) -> float | None:
        """The output's rate against the wall clock: stream seconds over wall seconds between the least delayed
        piece of the call's second tenth and that of its ninth (the first and last tenths left out). A piece held
        by the link (a TCP retransmission, a stall) is jitter, not rate: taken at the ends of the span it would
        read as a rate 200 ms short over a 12 s call; a server slower than real time still shows, as a delay
        that grows from one end to the other."""
        n = len(self.times)
        if n < 10:
            return None
        times, ends, lag = np.asarray(self.times), np.asarray(self.ends_s), self.lag_s()
        tenth = n // 10
        lo = tenth + int(lag[tenth:2 * tenth].argmin())
        hi = n - 2 * tenth + int(lag[n - 2 * tenth:n - tenth].argmin())
        wall = times[hi] - times[lo]
        return round(float((ends[hi] - ends[lo]) / wall), 4) if wall > 0 else None

    def lag_s(self) -> np.ndarray:
        """Each piece's arrival less where it ends in the stream: its lateness against a real-time schedule, up to
        that schedule's origin."""
        return np.asarray(self.times) - np.asarray(self.ends_s)

    def latest_at(self) -> float | None:
        """When the latest piece (against the schedule `lateness_ms` measures) arrived, monotonic s."""
        if not self.times:
            return None
        return self.times[int(self.lag_s().argmax())]

    def lateness_p99_outside(self, held: list[tuple[float, float]]) -> float | None:
        """Lateness p99, ms, as `lateness_ms` measures it, over the pieces not read inside one of `held` (windows,
        monotonic s, in which the reader's own loop was held: a piece read then was made late by the reader)."""
        if not self.times:
            return None
        times, lag = np.asarray(self.times), self.lag_s()
        kept = np.ones(times.size, dtype=bool)
        for start, end in held:
            kept &= (times < start) | (times > end)
        return round(float(np.percentile((lag[kept] - lag.min()) * 1000, 99)), 2) if kept.any() else None

    def lateness_ms(self, origin: float | None = None) -> dict[str, float]:
        """Quantiles of lateness; with `origin` (monotonic s), when the latest piece came after it: a stall
        shared by several sessions shows as one moment."""
        if not self.times:
            return quantiles([])
        lag = self.lag_s()
        out = quantiles((lag - lag.min()) * 1000)
        if origin is not None:
            out["worst_at_s"] = round(self.latest_at() - origin, 2)
        return out


def ulaw_pieces(audio: np.ndarray) -> list[bytes]:
    """24 kHz audio as 20 ms μ-law pieces at 8 kHz (Twilio's `media`, SIP's PCMU packets)."""
    ulaw = AudioFormat("pcmu", TWILIO_RATE).encode(np.clip(resample(audio, RATE, TWILIO_RATE), -1, 1))
    return [ulaw[i:i + TWILIO_CHUNK] for i in range(0, len(ulaw) - TWILIO_CHUNK + 1, TWILIO_CHUNK)]


class DoorClient:
    """One session through one door. `await open(http)` (None, or the refusal), `await stream(audio, t0)`,
    `await wait_output(drain_s)`, `await close()`, then `report()`."""

    door: ClassVar[str]
    send_period_s: ClassVar[float] = FRAME_S
    any_piece: ClassVar[bool] = False          # its client may send pieces of any length (`piece_ms`)
    clocked_output: ClassVar[bool] = False     # the server plays out on its clock, silence filling what is missing
    kernel_stamped: ClassVar[bool] = False     # arrivals stamped by the kernel, not when this process read them

    def __init__(self, name: str, base_url: str, headers: dict[str, str] | None = None,
                 persona: str = "You are a wise and friendly teacher.") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}
        self.persona = persona
        self.session_id: str | None = None
        self.received = Received()
        self.model_s = 0.0                 # seconds of model audio received (no playout silence)
        self.silence_after_first_s = 0.0   # playout silence after the first model audio (paced doors)
        self.first_silence_at: float | None = None    # when the first of it came
        self.errors: list[dict[str, Any]] = []
        self.sent_s = 0.0
        self.send_late_ms: list[float] = []
        self.open_began: float | None = None
        self.live_at: float | None = None
        self.first_send: float | None = None
        self.first_audio_at: float | None = None
        self.frames_at_end: int | None = None
        self.missing_at_end: int | None = None
        self.reader: asyncio.Task[None] | None = None
        self.link_report: dict[str, Any] | None = None     # the server's last `session.link` (native dialect)

    # ---- per door -----------------------------------------------------------------------------------------------

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        raise NotImplementedError

    def pieces(self, audio: np.ndarray) -> list[bytes]:
        """The 24 kHz input cut into this door's wire pieces, one per `send_period_s`."""
        raise NotImplementedError

    async def send_piece(self, piece: bytes) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------------------------

    def ws_url(self, path: str) -> str:
        parts = urlsplit(self.base_url)
        scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
        return urlunsplit((scheme, parts.netloc, path.split("?")[0], path.partition("?")[2], ""))

    def heard(self, now: float, end_s: float, seconds: float, silent: bool = False) -> None:
        """A piece of output of `seconds` ending at `end_s` in the stream arrived at `now`."""
        self.received.add(now, end_s)
        if silent:
            if self.first_audio_at is not None:
                self.silence_after_first_s += seconds
                if self.first_silence_at is None:
                    self.first_silence_at = now
            return
        if self.first_audio_at is None:
            self.first_audio_at = now
        self.model_s += seconds

    @property
    def frames_in(self) -> int:
        return int(round(self.sent_s / FRAME_S))

    @property
    def frames_out(self) -> int:
        return int(self.model_s / FRAME_S + 1e-6)

    def missing_now(self) -> int:
        if self.clocked_output:
            return math.ceil(self.silence_after_first_s / FRAME_S - 1e-6)
        return max(0, self.frames_in - self.frames_out)

    async def stream(self, audio: np.ndarray, t0: float, pace: float = 1.0,
                     pieces: list[bytes] | None = None) -> None:
        """One piece per grid point t0 + k * send_period_s / pace (1.0: real time); a piece due late is sent late
        (no catch-up). `pieces`: `self.pieces(audio)` made beforehand (a minute of resampling and encoding, done
        here, would hold this process's loop while other sessions wait for their audio)."""
        for k, piece in enumerate(self.pieces(audio) if pieces is None else pieces):
            due = t0 + k * self.send_period_s / pace
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            self.send_late_ms.append(max(0.0, (now - due) * 1000))
            if self.first_send is None:
                self.first_send = now
            if self.reader is not None and self.reader.done():
                break
            await self.send_piece(piece)
            self.sent_s += self.send_period_s

    async def wait_output(self, drain_s: float, timeout_s: float = 0.0, max_missing: int = 0) -> None:
        """Wait (up to `timeout_s`) for the output to cover the input, then `drain_s` more; then count."""
        deadline = time.monotonic() + timeout_s
        while self.frames_out < self.frames_in - max_missing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(drain_s)
        self.frames_at_end = self.frames_out
        self.missing_at_end = self.missing_now()

    def report(self) -> dict[str, Any]:
        at_end = self.frames_at_end if self.frames_at_end is not None else self.frames_out
        missing = self.missing_at_end if self.missing_at_end is not None else self.missing_now()
        began = self.open_began
        return {
            "door": self.door, "name": self.name, "session_id": self.session_id,
            "frames_in": self.frames_in, "frames_out": at_end, "missing_frames": missing,
            "piece_ms": round(self.send_period_s * 1000, 2),
            "rtf": self.received.rtf(), "output_lateness_ms": self.received.lateness_ms(began),
            "send_lateness_ms": quantiles(self.send_late_ms),
            "open_ms": round((self.live_at - began) * 1000, 1) if self.live_at and began else None,
            "first_audio_ms": round((self.first_audio_at - began) * 1000, 1)
            if self.first_audio_at and began else None,
            "first_audio_after_send_ms": round((self.first_audio_at - self.first_send) * 1000, 1)
            if self.first_audio_at and self.first_send else None,
            **({"first_silence_ms": round((self.first_silence_at - began) * 1000, 1)}
               if self.first_silence_at and began else {}),
            "errors": len(self.errors),
            **({"first_error": self.errors[0].get("error", self.errors[0])} if self.errors else {}),
            **({"server_link": self.link_report} if self.link_report is not None else {}),
        }


async def _first_json(ws: aiohttp.ClientWebSocketResponse, timeout: float = 30.0) -> dict[str, Any]:
    msg = await ws.receive(timeout=timeout)
    if msg.type is not aiohttp.WSMsgType.TEXT:
        return {"type": "error", "error": {"code": "socket_closed", "message": f"{msg.type} {msg.data!r}"}}
    return json.loads(msg.data)


class WebSocketDoor(DoorClient):
    """A door over one WebSocket: `read()` hands each message to `on_event` / `on_binary`; PCM16 24 kHz pieces
    unless the door says otherwise, of one frame or `piece_ms` (a PCM door's client may send any length; Twilio's
    pieces are its 20 ms of μ-law); `close()` sends the door's goodbye, lets the reader see the end, and closes."""

    def __init__(self, *args: Any, piece_ms: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if piece_ms is not None:
            if not self.any_piece:
                raise ValueError(f"the {self.door} door's pieces are its wire's, not {piece_ms} ms")
            self.send_period_s = round(RATE * piece_ms / 1000.0) / RATE
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.closed: dict[str, Any] | None = None
        self._out_bytes = 0

    async def connect(self, http: aiohttp.ClientSession, path: str) -> aiohttp.ClientWebSocketResponse:
        self.open_began = time.monotonic()
        self.ws = await http.ws_connect(self.ws_url(path), headers=self.headers, max_msg_size=0)
        return self.ws

    def went_live(self) -> None:
        self.live_at = time.monotonic()
        self.reader = asyncio.ensure_future(self.read())

    async def read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type is aiohttp.WSMsgType.BINARY:
                self.on_binary(msg.data)
            elif msg.type is aiohttp.WSMsgType.TEXT:
                self.on_event(json.loads(msg.data))

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "error":
            self.errors.append(event)
        elif event.get("type") == "session.closed":
            self.closed = event

    def on_binary(self, data: bytes) -> None:
        """PCM16 24 kHz output."""
        self._out_bytes += len(data)
        self.heard(time.monotonic(), self._out_bytes / (2 * RATE), len(data) / (2 * RATE))

    def goodbye(self) -> dict[str, Any]:
        return {"type": "session.close"}

    def pieces(self, audio: np.ndarray) -> list[bytes]:
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
        size = 2 * round(RATE * self.send_period_s)
        return [pcm[i:i + size] for i in range(0, len(pcm) - size + 1, size)]

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.closed is not None and self.closed.get("stats"):
            out["server_closed"] = self.closed["stats"]      # the whole call's counters and input link
        return out

    async def close(self) -> None:
        if self.ws is None:
            return
        if not self.ws.closed:
            await self.ws.send_json(self.goodbye())
        if self.reader is not None:
            await asyncio.wait_for(self.reader, 10)
        await self.ws.close()


class RealtimeClient(WebSocketDoor):
    """`WS /v1/realtime?duplex=1`: `session.update` (PCM16 24 kHz both ways), 80 ms appends (`piece_ms`), audio
    deltas out."""

    door = "realtime"
    any_piece = True

    def __init__(self, *args: Any, path: str = "/v1/realtime?duplex=1", keep_audio: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = path
        self.keep_audio = keep_audio
        self.session: dict[str, Any] = {}
        self.response_ids: list[str] = []
        self.audio: list[bytes] = []
        self.bad_deltas: list[str] = []

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        ws = await self.connect(http, self.path)
        first = await _first_json(ws)
        if first.get("type") != "session.created":
            await ws.close()
            return first
        self.session = first["session"]
        self.session_id = self.session.get("id")
        await ws.send_json({"type": "session.update", "session": {
            "instructions": self.persona, "input_audio_format": "pcm16", "output_audio_format": "pcm16",
            "input_sample_rate_hz": RATE, "output_sample_rate_hz": RATE, "turn_detection": None}})
        updated = await _first_json(ws)
        if updated.get("type") != "session.updated":
            self.errors.append(updated)
        self.went_live()
        return None

    def on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.created":
            self.response_ids.append(event["response_id"])
        elif kind in AUDIO_DELTAS:
            self._on_delta(event)
        else:
            super().on_event(event)

    def _on_delta(self, event: dict[str, Any]) -> None:
        try:
            data = base64.b64decode(event["delta"], validate=True)
        except (binascii.Error, ValueError):
            self.bad_deltas.append("not strict base64")
            return
        if len(data) % 2:
            self.bad_deltas.append(f"odd byte count {len(data)}")
        if not event.get("response_id"):
            self.bad_deltas.append("no response_id")
        if self.keep_audio:
            self.audio.append(data)
        self.on_binary(data)

    async def send_piece(self, piece: bytes) -> None:
        assert self.ws is not None
        await self.ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()})

    def samples(self) -> np.ndarray:
        """The received PCM16 (with `keep_audio`) as float32."""
        return np.frombuffer(b"".join(self.audio), dtype="<i2").astype(np.float32) / 32768.0

    def report(self) -> dict[str, Any]:
        return {**super().report(), "response_ids": len(set(self.response_ids)), "bad_deltas": len(self.bad_deltas)}


class DuplexClient(WebSocketDoor):
    """`WS /v1/duplex`: `session.create` (PCM16 24 kHz both ways, binary), binary frames in and out."""

    door = "duplex"
    any_piece = True
    link_report_s = 2.0          # the server's `session.link` every this many seconds (the last one is reported)

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        ws = await self.connect(http, "/v1/duplex")
        fmt = {"format": "pcm16", "rate": RATE}
        await ws.send_json({"type": "session.create", "session": {"persona": self.persona, "input": fmt,
                                                                  "output": fmt,
                                                                  "link_report_s": self.link_report_s}})
        created = await _first_json(ws)
        if created.get("type") != "session.created":
            await ws.close()
            return created
        self.session_id = created["session"].get("id")
        self.went_live()
        return None

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "session.link":
            self.link_report = event
        else:
            super().on_event(event)

    async def send_piece(self, piece: bytes) -> None:
        assert self.ws is not None
        await self.ws.send_bytes(piece)


class TwilioClient(WebSocketDoor):
    """`WS /v1/twilio`: `connected` + `start` (μ-law 8 kHz), 20 ms `media` in; 20 ms `media` out on the server's
    clock (silence where the model's frame was not there). Twilio's protocol has no stats event: with `admin_key`
    set, the call's own figures (its input link among them) come from `GET /v1/calls` before it stops."""

    door = "twilio"
    send_period_s = TWILIO_CHUNK / TWILIO_RATE
    clocked_output = True
    admin_key: ClassVar[str | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream_sid = f"MZ{uuid.uuid4().hex}"
        self.call_stats: dict[str, Any] | None = None
        self.worker: str | None = None  # the server process that held the call: "main", or a worker's number

    async def wait_output(self, drain_s: float, timeout_s: float = 0.0, max_missing: int = 0) -> None:
        await super().wait_output(drain_s, timeout_s, max_missing)
        if self.admin_key is None:
            return
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        try:
            async with aiohttp.ClientSession() as http, http.get(self.base_url + "/v1/calls", headers=headers) as res:
                calls = (await res.json()).get("data", [])
        except (aiohttp.ClientError, ValueError):
            return
        mine = [c for c in calls if (c.get("caller") or {}).get("stream_sid") == self.stream_sid]
        if mine:  # the worker too: calls that go silent together say whether one process held them
            self.call_stats, self.worker = mine[0]["stats"], mine[0].get("worker")

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.call_stats is not None:
            out["call_stats"], out["worker"] = self.call_stats, self.worker
        return out

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        ws = await self.connect(http, "/v1/twilio")
        await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await ws.send_json({"event": "start", "streamSid": self.stream_sid, "start": {
            "streamSid": self.stream_sid, "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": TWILIO_RATE,
                                                          "channels": 1},
            "customParameters": {"persona": self.persona}}})
        self.session_id = self.stream_sid
        self.went_live()     # a bridge learns of a refusal only from the `error` that follows
        return None

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") != "media":
            super().on_event(event)
            return
        data = base64.b64decode(event["media"]["payload"])
        self._out_bytes += len(data)
        silent = data.count(ULAW_SILENCE) == len(data)
        self.heard(time.monotonic(), self._out_bytes / TWILIO_RATE, len(data) / TWILIO_RATE, silent)

    def pieces(self, audio: np.ndarray) -> list[bytes]:
        return ulaw_pieces(audio)

    async def send_piece(self, piece: bytes) -> None:
        assert self.ws is not None
        await self.ws.send_json({"event": "media", "streamSid": self.stream_sid,
                                 "media": {"track": "inbound", "payload": base64.b64encode(piece).decode()}})

    def goodbye(self) -> dict[str, Any]:
        return {"event": "stop", "streamSid": self.stream_sid}


class WebRTCClient(DoorClient):
    """`POST /v1/realtime/calls`: an aiortc peer whose microphone loops the audio from the moment it connects
    (Opus, 20 ms packets paced by the track); the model's audio is recorded with each packet's arrival and pts.
    `report()` adds the call's own counters from its Location (`server_stats()`, read before hanging up)."""

    door = "webrtc"
    send_period_s = 0.02
    clocked_output = True

    def __init__(self, *args: Any, audio: np.ndarray | None = None, on_answer: Any = None, fec_loss_pct: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.audio = audio
        self.on_answer = on_answer           # given the peer connection before ICE (bench/impair.py's hook)
        self.fec_loss_pct = fec_loss_pct     # the microphone's in-band FEC (a browser's, on a lossy link)
        self.call: Any = None
        self.stats: dict[str, Any] | None = None

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        from app.doors.webrtc.client import CallRefused, RealtimeCall
        self.open_began = time.monotonic()
        api_key = self.headers.get("Authorization", "").removeprefix("Bearer ") or None
        self.call = RealtimeCall(self.base_url, self.audio, loop_audio=True, api_key=api_key,
                                 session={"instructions": self.persona}, on_answer=self.on_answer,
                                 fec_loss_pct=self.fec_loss_pct)
        try:
            await self.call.connect()
        except CallRefused as e:
            await self.call.close()
            return {"type": "error", "error": e.error() or {"code": f"http_{e.status}", "message": e.body}}
        except (ConnectionError, asyncio.TimeoutError) as e:
            await self.call.close()
            return {"type": "error", "error": {"code": "connect_failed", "message": str(e)}}
        self.live_at = time.monotonic()
        self.session_id = self.location_id()
        return None

    def location_id(self) -> str | None:
        return self.call.location.rsplit("/", 1)[-1] if self.call and self.call.location else None

    async def stream(self, audio: np.ndarray, t0: float, pace: float = 1.0,
                     pieces: list[bytes] | None = None) -> None:
        """The track speaks by itself, in real time, from the connect on; this just lets `audio`'s length go by."""
        self.first_send = self.call.connected_at if self.call else None
        await asyncio.sleep(max(0.0, t0 + audio.size / RATE - time.monotonic()))

    async def wait_output(self, drain_s: float, timeout_s: float = 0.0, max_missing: int = 0) -> None:
        self.sent_s = self.call.source.sent_s if self.call else 0.0
        await asyncio.sleep(drain_s)
        self.take_recording()
        self.frames_at_end = self.frames_out
        self.missing_at_end = self.missing_now()
        self.stats = await self.server_stats()

    def take_recording(self) -> None:
        """The recorded packets (arrival, pts, samples) into the shared timeline; silence is playout fill."""
        self.received = Received()
        self.model_s = self.silence_after_first_s = 0.0
        self.first_audio_at = None
        chunks = sorted(self.call.recording.chunks, key=lambda c: c[2]) if self.call else []
        for pts, samples, arrived in chunks:
            silent = not samples.size or float(np.abs(samples).max()) < OPUS_SILENCE_PEAK
            self.heard(arrived, (pts + samples.size) / RATE, samples.size / RATE, silent)

    async def server_stats(self) -> dict[str, Any] | None:
        if self.call is None or not self.call.location:
            return None
        headers = {"Authorization": f"Bearer {self.call.api_key}"} if self.call.api_key else {}
        try:
            async with aiohttp.ClientSession() as http, http.get(self.call.location, headers=headers) as res:
                return await res.json()
        except (aiohttp.ClientError, ValueError):
            return None

    async def close(self) -> None:
        if self.call is not None:
            await self.call.hang_up()

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.stats is not None:
            out["server"] = peer_report(self.stats)
        if self.call is not None:
            # Time the microphone's own send grid jumped over (this load process's loop late by a stall): audio the
            # server never had, concealed there like a loss.
            out["sender_skipped_ms"] = round(self.call.mic.stats.skipped_ms, 1)
        return out


class SipClientDoor(DoorClient):
    """A SIP call (app/doors/sip/client.py): INVITE offering PCMU, 20 ms RTP on the clock; the server's RTP is recorded
    with each packet's arrival, played out on the server's clock (μ-law silence where the model's frame was not
    there). `relay` (a bench.impair.UdpRelay) puts the media behind a link: the SDP names its far side. While the
    model's last audio drains the phone sends silence, as a phone does until it hangs up. Before hanging up, the
    call's own counters come from `GET /v1/sip/calls` (any worker forwards it to worker 0, the SIP door's)."""

    door = "sip"
    send_period_s = TWILIO_CHUNK / TWILIO_RATE
    clocked_output = True
    kernel_stamped = True  # its arrivals are the kernel's (RtpPeer): the reader's stalls do not move them
    sip_port: ClassVar[int | None] = None

    def __init__(self, *args: Any, relay: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.relay = relay
        self.sip: SipClient | None = None
        self.rtp: RtpPeer | None = None
        self.dialog: Any = None
        self.to: tuple[str, int] | None = None
        self.stats: dict[str, Any] | None = None

    async def open(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        if self.sip_port is None:
            raise RuntimeError("SipClientDoor.sip_port is not set (the server's --sip-port)")
        host = urlsplit(self.base_url).hostname or "127.0.0.1"
        self.open_began = time.monotonic()
        self.sip = SipClient((host, self.sip_port))
        await self.sip.open()
        self.rtp = RtpPeer()
        await self.rtp.open()
        media_at = self.relay.far if self.relay is not None else ("127.0.0.1", self.rtp.port)
        if self.relay is not None:
            self.relay.client = ("127.0.0.1", self.rtp.port)
        self.dialog = self.sip.dialog()
        final = (await self.sip.invite(self.dialog, offer(media_at[0], media_at[1], [(0, "PCMU/8000")]),
                                       timeout=30.0))[-1]
        if final.code != 200:
            return {"type": "error", "error": {"code": f"sip_{final.code}", "message": final.phrase}}
        self.sip.ack(self.dialog, final)
        media = parse_offer(final.body).media[0]
        remote = (media.address or host, media.port)
        if self.relay is not None:
            self.relay.server = remote
        self.to = self.relay.near if self.relay is not None else remote
        self.live_at = time.monotonic()
        self.session_id = self.dialog.call_id
        return None

    def pieces(self, audio: np.ndarray) -> list[bytes]:
        return ulaw_pieces(audio)

    async def send_piece(self, piece: bytes) -> None:
        assert self.rtp is not None and self.to is not None
        self.rtp.send_packet(0, piece, self.to, TWILIO_CHUNK, marker=self.sent_s == 0)

    async def wait_output(self, drain_s: float, timeout_s: float = 0.0, max_missing: int = 0) -> None:
        # A phone sends RTP until it hangs up: silence here, so the server's input runs on to the call's end. Before,
        # the input stopped with the speech and every call counted the drain's reads as underruns (11-13 a call).
        talking = asyncio.ensure_future(self._send_silence())
        try:
            await asyncio.sleep(drain_s)
        finally:
            talking.cancel()
        received = sorted(self.rtp.received if self.rtp else [], key=lambda r: r[0])
        ts0 = received[0][1].timestamp if received else 0
        for at, packet in received:
            end_s = ((packet.timestamp - ts0) % (1 << 32) + TWILIO_CHUNK) / TWILIO_RATE
            silent = packet.payload.count(ULAW_SILENCE) == len(packet.payload)
            self.heard(at, end_s, len(packet.payload) / TWILIO_RATE, silent)
        self.frames_at_end = self.frames_out
        self.missing_at_end = self.missing_now()
        self.stats = await self.server_stats()

    async def _send_silence(self) -> None:
        silence = bytes([ULAW_SILENCE]) * TWILIO_CHUNK
        start = time.monotonic()
        for k in itertools.count(1):
            await self.send_piece(silence)
            await asyncio.sleep(max(0.0, start + k * self.send_period_s - time.monotonic()))

    async def server_stats(self, tries: int = 40) -> dict[str, Any] | None:
        """This call's own (`GET /v1/sip/calls/{call_id}`), not the list: at the end of a load run every SIP caller
        asks, and the list costs the SIP door's loop ~0.13 ms a live call each time (2-core CPU)."""
        async with aiohttp.ClientSession() as http:
            for _ in range(tries):
                try:
                    async with http.get(f"{self.base_url}/v1/sip/calls/{self.session_id}", headers=self.headers) as res:
                        if res.status == 200:
                            return await res.json()
                except (aiohttp.ClientError, ValueError):
                    continue
        return None

    async def close(self) -> None:
        if self.sip is not None and self.dialog is not None:
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await self.sip.bye(self.dialog)
        for end in (self.rtp, self.sip):
            if end is not None:
                end.close()

    def report(self) -> dict[str, Any]:
        out = super().report()
        if self.stats is not None:
            out["sip_server"] = {k: self.stats.get(k) for k in ("lost", "packets_received", "input", "stalls",
                                                                  "out_shed_ms", "out_underruns", "out_silence_ms")}
        return out


def peer_report(st: dict[str, Any]) -> dict[str, Any]:
    """A call's counters (`GET` on its Location): server-added latency on each side, underruns, drops, RTP."""
    jb, out, rtp = st.get("input") or {}, st.get("output") or {}, st.get("rtp") or {}
    return {
        "call_id": st.get("call_id"),
        "input_added_ms": st["latency_ms"]["input_added"],
        "input_buffered_ms": st["latency_ms"].get("input_buffered"),
        "output_added_ms": st["latency_ms"]["output_added"],
        "input_underruns": jb.get("underruns"),
        "output_underruns": out.get("underruns"),
        "output_underrun_ms": out.get("underrun_ms"),
        "concealed_ms": round(jb.get("concealed_ms", 0.0), 1),
        "late_drops": jb.get("late_drops"),
        "overrun_drops_ms": jb.get("overrun_drops_ms"),
        "input_target_ms": jb.get("target_ms"),
        "sound_cut_max_ms": jb.get("sound_cut_max_ms"),
        "hard_cuts": jb.get("hard_cuts"),
        "playout_prebuffer_ms": out.get("prebuffer_ms"),
        "packets_received": rtp.get("packets_received"),
        "packets_lost": rtp.get("packets_lost"),
        "fec_rebuilt": (st.get("inbound") or {}).get("fec_frames"),
        "red_rebuilt": (st.get("inbound") or {}).get("red_frames"),
        "red_depth": out.get("red_depth"),          # the server's RED to the caller: earlier packets each carries
        "red_deepened": out.get("red_deepened"),    # times the caller's reports took it to two
        "send_stalls": out.get("stalls"),
        "encode_failures": out.get("encode_failures"),
    }


DOORS: dict[str, type[DoorClient]] = {c.door: c for c in (RealtimeClient, WebRTCClient, TwilioClient, DuplexClient,
                                                         SipClientDoor)}
