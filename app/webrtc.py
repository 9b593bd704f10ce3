"""WebRTC calls: `POST /v1/realtime/calls` (SDP offer in, 201 + SDP answer out), the `oai-events` data channel.

As OpenAI Realtime does it over WebRTC. The body is the offer as `application/sdp`, or `multipart/form-data` with an
`sdp` part and an optional `session` part (the JSON of a `session.update`'s `session`: persona as `instructions`,
`voice`, sampling); `application/json` `{"sdp", "session"?}` is taken too. The answer is `201` with the answer SDP
and `Location: /v1/realtime/calls/<call id>`; `GET` there gives the call's counters, `DELETE` (or
`POST …/hangup`) hangs up. A full server answers `429` with a JSON error before any peer is made.

One call is one `Conversation`, driven by `CallSession`, the Realtime dialect of `app.realtime` with the data
channel as its transport: the same event handlers and builders (`session.created`, `session.updated`, the response
lifecycle, transcript deltas, errors) go out on `oai-events`, client events come in on it. What differs on WebRTC:
the microphone arrives on the RTP track (appends are refused), the model's audio leaves on the RTP track (no audio
deltas), the conversation starts with the first RTP audio, `response.cancel` also empties the playout buffer, and a
`session.stats` event every second carries the media counters.

Media: aiortc's receive jitter buffer is bypassed (`media.tracks.InboundAudio`): each 20 ms packet is decoded as
it arrives, resampled to 24 kHz and lands at its pts in the conversation's jitter buffer; engine frames go to a
`PlayoutBuffer` read 20 ms at a time by the paced `OutboundAudioTrack` (mono Opus at 24 kHz), whose read grid is
aligned to the engine's writes. The call ends, and its slot is freed at once, on DELETE, when ICE fails or does not
connect within `connect_timeout_s`, when the peer closes (DTLS close or RTCP BYE), or at server shutdown
(`session.closed` first, reason `server_shutdown`).

ICE servers: none by default (host candidates only: localhost and LAN). `--stun-url`, `--turn-url` (with
`--turn-username`, `--turn-credential`) and `--ice-relay-only` set them (or their `PERSONAPLEX_*` environment twins),
`--ice-connect-timeout-s` the connect deadline; browsers get the same list from `GET /v1/realtime/webrtc-config`
(which needs the API key, as it carries the TURN credential).
aiortc uses one STUN and one TURN URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import BodyPartReader, web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcconfiguration import RTCIceTransportPolicy
from aiortc.rtcrtpsender import RTCRtpSender

from app.audio import InputDecoder, OutputEncoder
from app.auth import refusal, too_many_connections
from app.context import CONTEXT
from app.conversation import Conversation, State
from app.errors import DRAINING_MESSAGE, ProtocolError, http_error_body
from app.realtime import RealtimeSession
from app.session_config import default_config
from app.settings import Settings
from app.transport import CLOSE_GOING_AWAY, CLOSE_NORMAL
from app.wire import WireError, parse_object
from app.worker_routing import call_owner, forward, new_call_id, worker_socket
from media.jitter import FRAME, JitterStats
from media.playout import PlayoutBuffer, PlayoutConfig
from media.tracks import (
    RATE,
    ContainedOpusEncoder,
    InboundAudio,
    OutboundAudioTrack,
    install_contained_encoder,
)
from model.engine import EngineError, FrameOutput, InvalidSessionParams, ResourceExhausted, Slot
from model.engine.pool import EnginePool

logger = logging.getLogger(__name__)

CALLS_ROUTE = "/v1/realtime/calls"
CHANNEL_LABEL = "oai-events"
STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# The outbound track reads right after each engine frame lands (OutboundAudioTrack.align), so the prebuffer is all
# the slack a late tick needs: 10 ms (a tick's duration varies by a few ms); an underrun adds 20 ms (media.playout).
PLAYOUT = PlayoutConfig(start_prebuffer_ms=10.0, min_prebuffer_ms=10.0)
# A context's frame 0 comes straight after the prompt prefill, 0-80 ms behind the tick grid: playing it would leave
# that much standing latency for the rest of the call (the playout buffer sheds only beyond prebuffer + 160 ms).
# It is the model's answer to the first 80 ms of the call, i.e. to nothing yet: its transcript is still sent.
FIRST_PLAYED_FRAME = 1
READ_AFTER_WRITE_MS = 2.0   # where a read lands after the write it should find
REPACE_FRAMES = 25          # 2 s of frames between read-grid corrections
CHANNEL_BUFFER_BYTES = 256 << 10   # data-channel bytes in flight before the writer waits for SCTP to drain
_RTP_ONLY = ("input_audio_buffer.append", "input_audio_buffer.commit", "input.commit")


@dataclass(frozen=True)
class WebRTCConfig:
    ice_servers: tuple[RTCIceServer, ...] = ()
    relay_only: bool = False
    connect_timeout_s: float = 20.0        # ICE + DTLS must be up this long after the answer, or the call ends
    stats_interval_s: float = 1.0          # `session.stats` on the data channel

    @classmethod
    def from_settings(cls, settings: Settings) -> WebRTCConfig:
        """ICE servers and timeouts from the server settings (`--stun-url`, `--turn-url`, …, or their env twins)."""
        servers = []
        if settings.stun_url:
            servers.append(RTCIceServer(urls=settings.stun_url))
        if settings.turn_url:
            servers.append(RTCIceServer(urls=settings.turn_url, username=settings.turn_username or None,
                                        credential=settings.turn_credential or None))
        if settings.ice_relay_only and not settings.turn_url:
            raise ValueError("ice_relay_only needs a TURN server (turn_url)")
        return cls(ice_servers=tuple(servers), relay_only=settings.ice_relay_only,
                   connect_timeout_s=settings.ice_connect_timeout_s)

    def browser_ice_servers(self) -> list[dict[str, Any]]:
        out = []
        for s in self.ice_servers:
            entry: dict[str, Any] = {"urls": s.urls}
            if s.username:
                entry.update(username=s.username, credential=s.credential)
            out.append(entry)
        return out


WEBRTC = web.AppKey("personaplex_webrtc", WebRTCConfig)
CALLS = web.AppKey("personaplex_webrtc_calls", dict)


class OfferError(Exception):
    """The POST body is not a usable offer; answered with HTTP `status` and a JSON error."""

    def __init__(self, message: str, code: str = "bad_event", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


async def read_offer(request: web.Request) -> tuple[str, dict[str, Any] | None]:
    """(offer SDP, session object or None) from an `application/sdp`, multipart or JSON body."""
    try:
        sdp, session = await _read_body(request)
    except (ValueError, LookupError) as e:   # not text in its charset, or a broken multipart body
        raise OfferError(f"the body cannot be read as {request.content_type}: {type(e).__name__}") from None
    if not isinstance(sdp, str) or not sdp.lstrip().startswith("v=0"):
        raise OfferError("no SDP offer: the `sdp` must be a session description starting with v=0")
    if "m=audio" not in sdp:
        raise OfferError("the offer has no audio (m=audio): add the microphone track before creating the offer")
    if session is not None and not isinstance(session, dict):
        raise OfferError("`session` must be a JSON object", code="invalid_session_config")
    return sdp, session


async def _read_body(request: web.Request) -> tuple[object, object]:
    ctype = request.content_type
    session: object = None
    if ctype == "application/sdp":
        sdp = await request.text()
    elif ctype == "multipart/form-data":
        sdp = ""
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):
                raise OfferError("nested multipart bodies are not taken")
            if part.name == "sdp":
                sdp = await part.text()
            elif part.name == "session":
                session = _json_object(await part.text(), "session")
    elif ctype == "application/json":
        body = _json_object(await request.text(), "body")
        sdp = body.get("sdp", "")
        session = body.get("session")
    else:
        raise OfferError(f"Content-Type {ctype or 'none'!r}: send the offer as application/sdp, or multipart/form-data "
                         "with an `sdp` part (and an optional `session` part)", status=415)
    return sdp, session


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        return parse_object(text)
    except WireError as e:
        raise OfferError(f"`{what}`: {e}", code="invalid_json") from None


class TimedPlayout:
    """The call's PlayoutBuffer as the outbound track's source, timing each engine frame from its write until its
    first sample is handed to the encoder (the server's output-side added latency)."""

    def __init__(self, playout: PlayoutBuffer) -> None:
        self.playout = playout
        self._pending: deque[tuple[int, float]] = deque()   # (first sample position, written at)
        self.waits_ms: deque[float] = deque(maxlen=750)      # the last minute of frames

    def write(self, samples: np.ndarray) -> None:
        start = self.playout.stats().written_samples
        if self.playout.write(samples):
            self._pending.append((start, time.monotonic()))

    def read(self, n: int) -> np.ndarray:
        out = self.playout.read(n)
        if self._pending:
            drained = self.playout.stats().drained_samples
            now = time.monotonic()
            while self._pending and self._pending[0][0] < drained:
                self.waits_ms.append((now - self._pending.popleft()[1]) * 1000.0)
        return out

    def clear(self) -> None:
        self.playout.clear()
        self._pending.clear()


def _summary(values: deque[float] | list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None}
    arr = np.asarray(values)
    return {"mean": round(float(arr.mean()), 2), "p50": round(float(np.percentile(arr, 50)), 2),
            "p95": round(float(np.percentile(arr, 95)), 2)}


class CallSession(RealtimeSession):
    """One WebRTC call: a peer connection, the conversation, and the Realtime dialect on the data channel."""

    route = CALLS_ROUTE

    def __init__(self, request: web.Request, slot: Slot, config: WebRTCConfig, offer_sdp: str) -> None:
        super().__init__(request)
        self.offer_sdp = offer_sdp
        self.expects_channel = "m=application" in offer_sdp   # no channel offered: events have nowhere to go
        self.call_id = new_call_id(getattr(self.ctx.engine, "worker", None))
        self._slot = slot
        self.webrtc = config
        policy = RTCIceTransportPolicy.RELAY if config.relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=list(config.ice_servers), iceTransportPolicy=policy))
        self.playout = TimedPlayout(PlayoutBuffer(RATE, PLAYOUT))
        self.track = OutboundAudioTrack(self.playout)
        self.opus = ContainedOpusEncoder()
        self.inbound: InboundAudio | None = None
        self.channel: Any = None
        self.input_waits_ms: deque[float] = deque(maxlen=750)
        self._arrivals: deque[tuple[int, int, float]] = deque(maxlen=64)   # recent pushes: (pts, end, arrival)
        self._origin: int | None = None      # input timeline position the engine's read count starts from
        self._tick_s = 0.0                   # the engine's recent tick duration (its read came that much earlier)
        self._underruns_seen = 0
        self._paced_at = 0                   # frame index of the last read-grid correction
        self.opened_at = time.monotonic()
        self.connected_at: float | None = None
        self.end_reason: str | None = None
        self._incoming: asyncio.Queue[str | bytes] = asyncio.Queue()
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- set-up ----------------------------------------------------------------------------------------------

    async def open(self, session: dict[str, Any] | None) -> None:
        """Conversation and config; `session` is applied like a `session.update` (a ProtocolError if bad)."""
        await self.on_open()
        if session is not None:
            await self.on_session_update({"type": "session.update", "session": session})
        assert self.ctx.engine is not None
        try:
            self.ctx.engine.validate(self.config.params())
        except InvalidSessionParams as e:
            raise ProtocolError(e.code, e.message, param="session") from None

    async def on_open(self) -> None:
        # As RealtimeSession.on_open with the slot admitted by the POST, and the jitter buffer's own network
        # bounds for input (late audio is worthless on a call) instead of the WebSocket's refuse-past-backlog.
        self.conversation = Conversation(self._slot, metrics=self.ctx.metrics)
        self.conversation.add_listener(self._on_frame, self._on_engine_error)
        self.config = default_config(self.ctx)
        self.decoder = InputDecoder(self.config.input_format)
        self.encoder = OutputEncoder(self.config.output_format)
        await self.send({"type": "session.created", "session": self.session_object()})

    async def negotiate(self) -> str:
        """Apply the offer, wire the media, return the answer SDP (ICE candidates included: aiortc gathers first)."""
        pc = self.pc
        mic = pc.addTransceiver(self.track, direction="sendrecv")
        mic.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("audio").codecs
                                 if c.mimeType.lower() == "audio/opus"])
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=self.offer_sdp, type="offer"))
        except Exception as e:
            raise OfferError(f"the offer was not accepted ({type(e).__name__}: {e}); audio must offer Opus") from None
        if mic.receiver.track is None:
            raise OfferError("the offer's audio does not send: the microphone must be sendrecv")
        for other in pc.getTransceivers():
            if other is not mic:
                other.direction = "inactive"          # video, or extra audio lines: not ours to decode
        install_contained_encoder(mic.sender, self.opus)
        self.inbound = InboundAudio(mic.receiver, self)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:   # aiortc fails this way on offers it parsed but cannot answer (a broken BUNDLE)
            raise OfferError(f"the offer cannot be answered ({type(e).__name__}: {e})") from None
        self._spawn(self._receive_audio())
        self._spawn(self._connect_deadline())
        return pc.localDescription.sdp

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    # ---- peer events -----------------------------------------------------------------------------------------

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected" and self.connected_at is None:
            self.connected_at = time.monotonic()
        elif state in ("failed", "closed") and not self.closed:
            self.spawn(self.close(CLOSE_NORMAL, "ice_failed" if state == "failed" else "peer_closed"))

    async def _connect_deadline(self) -> None:
        await asyncio.sleep(self.webrtc.connect_timeout_s)
        if self.connected_at is None and not self.closed:
            await self.close(CLOSE_NORMAL, "ice_timeout")

    async def _receive_audio(self) -> None:
        assert self.inbound is not None
        await self.inbound.ended()                        # the receiver stopped: RTCP BYE, peer gone
        if not self.closed:
            self.spawn(self.close(CLOSE_NORMAL, "peer_closed"))

    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != CHANNEL_LABEL or self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._incoming.put_nowait)
        channel.on("close", lambda: self.spawn(self.close(CLOSE_NORMAL, "peer_closed")))
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._spawn(self._read_channel())
        self._spawn(self._send_stats())

    # ---- the data channel as the dialect's transport ---------------------------------------------------------

    def send_nowait(self, event: dict[str, Any]) -> None:
        if self.expects_channel:
            super().send_nowait(event)

    def send_audio_nowait(self, payload: dict[str, Any] | bytes) -> None:
        """The model's audio leaves on the RTP track: no audio deltas on a call."""

    async def _write_loop(self) -> None:
        """The base's bounded queue, drained into the channel only as fast as SCTP takes it: what the peer does not
        read stays queued here, where the session's output bound sees it (aiortc's own send queue is unbounded)."""
        drained = asyncio.Event()
        channel = self.channel
        channel.bufferedAmountLowThreshold = CHANNEL_BUFFER_BYTES
        channel.on("bufferedamountlow", drained.set)
        while True:
            data = await self._next_message()
            if data is None or channel.readyState != "open":
                return
            channel.send(data)
            self._sent(data)
            if channel.bufferedAmount > CHANNEL_BUFFER_BYTES:
                drained.clear()
                await drained.wait()

    async def _read_channel(self) -> None:
        limit = self.settings.max_message_bytes
        while not self.closed:
            data = await self._incoming.get()
            if not self._admit_message():
                continue
            try:
                if isinstance(data, bytes):
                    await self.send_error(ProtocolError("binary_unsupported",
                                                        f"{CHANNEL_LABEL} takes JSON text only"))
                elif len(data) > limit:
                    await self.send_error(ProtocolError("event_too_large",
                                                        f"message of {len(data)} bytes; the bound is {limit} bytes"))
                else:
                    await self._dispatch_text(data)
            except Exception as e:   # a bug must not silently end the reader: the call keeps its events
                logger.exception("call %s: event failed", self.call_id)
                self.send_error_nowait(ProtocolError("internal_error", f"{type(e).__name__}: {e}"))

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind in _RTP_ONLY:
            raise ProtocolError("unsupported_event", f"{kind}: on a WebRTC call the microphone audio travels on the "
                                "RTP track", param="type")
        await super().on_event(event)
        if kind in ("input_audio_buffer.clear", "input.cancel"):
            self._origin = None                            # the buffer starts a new timeline
        if kind in ("response.cancel", "output_audio_buffer.clear"):
            self.playout.clear()                           # the cancelled context's audio must not play on

    # ---- media -----------------------------------------------------------------------------------------------

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        """Received audio (24 kHz, at its pts): the first of it starts the conversation."""
        conv = self.conversation
        if self.closed or conv is None or conv.state in (State.FAILED, State.CLOSED):
            return
        if conv.state is State.IDLE:
            self._start()
        now = time.monotonic() if now is None else now
        conv.push(pts, samples, now)
        if pts is not None:
            if self._origin is None and conv.input is not None:
                self._origin = pts - self._consumed(conv.input.stats())
            self._arrivals.append((pts, pts + samples.size, now))

    @staticmethod
    def _consumed(st: JitterStats) -> int:
        """Input positions the engine has moved past: frames read plus windows shed."""
        return st.frames_out * FRAME + round(st.overrun_drops_ms * RATE / 1000)

    def _time_input_wait(self, st: JitterStats, now: float) -> None:
        """How long the newest sample of the frame the engine just read had waited in the jitter buffer."""
        if self._origin is None:
            return
        newest = self._origin + self._consumed(st) - 1
        for start, end, arrival in reversed(self._arrivals):
            if start <= newest < end:
                self.input_waits_ms.append((now - self._tick_s - arrival) * 1000.0)
                return

    def _started(self, task: asyncio.Task[None]) -> None:
        super()._started(task)
        if not task.cancelled() and task.exception() is not None and not self.closed:
            self.spawn(self.close(CLOSE_NORMAL, "start_failed"))   # no retry on every packet

    def _on_frame(self, frame: FrameOutput) -> None:
        if self.closed:
            return
        conv = self.conversation
        if conv is not None and conv.input is not None:
            if frame.index % 25 == 0 and self.ctx.engine is not None:
                self._tick_s = self.ctx.engine.stats().tick_ms_p50 / 1000.0
            self._time_input_wait(conv.input.stats(), time.monotonic())
        if frame.index >= FIRST_PLAYED_FRAME:
            self._pace_reads(frame.index)
            self.playout.write(frame.audio)
        super()._on_frame(frame)

    def _pace_reads(self, index: int) -> None:
        """Keep the track's 20 ms reads just after the engine's 80 ms writes.

        At the first played frame, and after the playout buffer ran dry (a late tick, another session's prefill),
        this write restarts playback: the next read is put right after it. Ticks then come at a phase that moves
        with the engine's load; when every frame of the last two seconds waited longer than the prebuffer for its
        first read, the reads are brought forward by the smallest excess (a write later than the reads only eats
        into the prebuffer, and past it is an underrun, which re-aligns)."""
        playout = self.playout.playout.stats()
        if index == FIRST_PLAYED_FRAME or playout.underruns != self._underruns_seen:
            self.track.align(time.monotonic(), READ_AFTER_WRITE_MS / 1000.0)
            self._underruns_seen = playout.underruns
            self._paced_at = index
        elif index - self._paced_at >= REPACE_FRAMES and len(self.playout.waits_ms) >= REPACE_FRAMES:
            recent = list(self.playout.waits_ms)[-REPACE_FRAMES:]
            excess_ms = min(recent) - playout.prebuffer_ms - READ_AFTER_WRITE_MS
            if excess_ms > 3.0:
                self.track.advance(excess_ms / 1000.0)
            self._paced_at = index

    # ---- counters --------------------------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        conv = self.conversation
        rtp: dict[str, Any] = {}
        if not self.closed:
            with contextlib.suppress(Exception):
                for s in (await self.pc.getStats()).values():
                    if s.type == "inbound-rtp" and s.kind == "audio":
                        rtp = {"packets_received": s.packetsReceived, "packets_lost": s.packetsLost,
                               "jitter_ms": round(s.jitter * 1000.0 / 48000, 2)}
        engine = self.ctx.engine.stats() if self.ctx.engine is not None else None
        track = self.track.stats
        return {
            "type": "session.stats",
            "call_id": self.call_id,
            "state": "closed" if self.closed else (conv.state.value if conv else "idle"),
            "connected": self.connected_at is not None,
            "input": asdict(conv.input.stats()) if conv is not None and conv.input is not None else None,
            "output": {**asdict(self.playout.playout.stats()), "frames_sent": track.frames, "stalls": track.stalls,
                       "skipped_ms": track.skipped_ms, "encode_failures": self.opus.failures},
            "inbound": asdict(self.inbound.stats) if self.inbound is not None else None,
            "rtp": rtp,
            "latency_ms": {"input_added": _summary(self.input_waits_ms),
                           "output_added": _summary(self.playout.waits_ms)},
            "engine": None if engine is None else {"tick_ms_p50": engine.tick_ms_p50, "tick_ms_p99": engine.tick_ms_p99,
                                                   "late_ticks": engine.late_ticks, "batch": engine.batch},
            "conversation": conv.counters() if conv is not None else None,
        }

    async def _send_stats(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.webrtc.stats_interval_s)
            if not self.closed:
                self.send_nowait(await self.stats())

    # ---- ending ----------------------------------------------------------------------------------------------

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "hang_up", *, send_closed: bool = True) -> None:
        """`session.closed` on the channel, slot freed, peer closed; idempotent."""
        if self.closed:
            return
        self.end_reason = reason
        await super().close(code, reason, send_closed=send_closed)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self.track.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()
        self.request.app[CALLS].pop(self.call_id, None)
        self.release_address()
        if self in self.ctx.sockets:
            self.ctx.sockets.discard(self)
            self.ctx.metrics.connections[self.route] -= 1
        logger.info("call %s ended: %s", self.call_id, reason)

    async def shutdown(self) -> None:
        await self.close(CLOSE_GOING_AWAY, "server_shutdown")


# ---- routes --------------------------------------------------------------------------------------------------

def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(http_error_body(code, message), status=status)


async def create_call(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    settings = ctx.settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        ctx.metrics.rejections[(CALLS_ROUTE, "unauthorized" if refused.status == 401 else "origin_not_allowed")] += 1
        return refused
    if ctx.draining:
        ctx.metrics.rejections[(CALLS_ROUTE, "server_draining")] += 1
        return _error(503, "server_draining", DRAINING_MESSAGE)
    if not ctx.ready or ctx.engine is None:
        return _error(503, "engine_stopped", "the server is starting or shutting down")
    try:
        offer, session = await read_offer(request)
    except OfferError as e:
        return _error(e.status, e.code, str(e))
    try:
        slot = await ctx.engine.reserve_wait(settings.queue_timeout_s)
    except ResourceExhausted:
        ctx.metrics.rejections[(CALLS_ROUTE, "resource_exhausted")] += 1
        return _error(429, "resource_exhausted",
                      f"duplex_session_capacity_exhausted: limit={ctx.engine.max_sessions}; try again later")
    except EngineError as e:  # the engine process is down or restarting
        ctx.metrics.rejections[(CALLS_ROUTE, e.code)] += 1
        return _error(503, e.code, e.message)
    call = CallSession(request, slot, request.app[WEBRTC], offer)
    try:
        await call.open(session)
        answer = await call.negotiate()
    except (ProtocolError, OfferError) as e:
        await call.close(CLOSE_NORMAL, "bad_offer", send_closed=False)
        return _error(getattr(e, "status", 400), e.code, str(e))
    except Exception as e:
        logger.exception("call set-up failed")
        await call.close(CLOSE_NORMAL, "internal_error", send_closed=False)
        return _error(500, "internal_error", f"call set-up failed: {type(e).__name__}: {e}")
    if call.closed:                                   # shut down while negotiating
        return _error(503, "engine_stopped", "the server is shutting down")
    request.app[CALLS][call.call_id] = call
    ctx.sockets.add(call)
    ctx.metrics.admissions[CALLS_ROUTE] += 1
    ctx.metrics.connections[CALLS_ROUTE] += 1
    location = f"{CALLS_ROUTE}/{call.call_id}"
    return web.Response(status=201, text=answer, content_type="application/sdp", headers={"Location": location})


async def create_call_limited(request: web.Request) -> web.Response:
    """`create_call` under the per-address connection limit: the address stays counted while the call lives."""
    ctx = request.app[CONTEXT]
    limit = ctx.settings.max_connections_per_ip
    address = ctx.addresses.take(request, limit)
    if address is None:
        ctx.metrics.rejections[(CALLS_ROUTE, "too_many_connections")] += 1
        return too_many_connections(limit)
    call = None
    try:
        response = await create_call(request)
        if response.status == 201:
            call = request.app[CALLS].get(response.headers["Location"].rsplit("/", 1)[-1])
    finally:
        if call is not None and not call.closed:
            call._address = address                      # released by the call's close
        else:
            ctx.addresses.release(address)
    return response


def _find_call(request: web.Request) -> CallSession | web.Response:
    settings = request.app[CONTEXT].settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        return refused
    call_id = request.match_info["call_id"]
    call = request.app[CALLS].get(call_id)
    if call is None:
        return _error(404, "bad_event", f"no live call {call_id!r}")
    return call


def _other_worker(request: web.Request) -> str | None:
    """The private socket of the worker that holds this request's call, when that is another process."""
    engine = request.app[CONTEXT].engine
    owner = call_owner(request.match_info["call_id"])
    if not isinstance(engine, EnginePool) or owner is None or owner == engine.worker:
        return None
    return worker_socket(engine.folder, owner)


async def hang_up(request: web.Request) -> web.Response:
    found = _find_call(request)
    if isinstance(found, web.Response):
        other = _other_worker(request) if found.status == 404 else None
        return await forward(request, other) if other else found
    await found.close(CLOSE_NORMAL, "client_hangup")
    return web.Response(status=204)


async def call_stats(request: web.Request) -> web.Response:
    found = _find_call(request)
    if isinstance(found, web.Response):
        other = _other_worker(request) if found.status == 404 else None
        return await forward(request, other) if other else found
    return web.json_response(await found.stats())


async def webrtc_config(request: web.Request) -> web.Response:
    """The ICE servers for browsers: they carry the TURN credential, so the API key is required (when keys are set)."""
    settings = request.app[CONTEXT].settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        return refused
    return web.json_response({"ice_servers": request.app[WEBRTC].browser_ice_servers(),
                              "calls_url": CALLS_ROUTE, "data_channel": CHANNEL_LABEL})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


def setup_webrtc(app: web.Application, config: WebRTCConfig | None = None) -> None:
    """Add the call routes and the browser page (`/`, `/static/`) to the server."""
    app[WEBRTC] = config or WebRTCConfig.from_settings(app[CONTEXT].settings)
    app[CALLS] = {}
    app.router.add_post(CALLS_ROUTE, create_call_limited)
    app.router.add_get(CALLS_ROUTE + "/{call_id}", call_stats)
    app.router.add_delete(CALLS_ROUTE + "/{call_id}", hang_up)
    app.router.add_post(CALLS_ROUTE + "/{call_id}/hangup", hang_up)
    app.router.add_get("/v1/realtime/webrtc-config", webrtc_config)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR)
