"""One WebRTC call: the WebRTC transport (peer connection, `oai-events` data channel, RTP media track) carrying the
Realtime dialect (`CallDialect`, the `app.doors.realtime.dialect` dialect with WebRTC's differences).

`Call` is the transport: it negotiates the peer, drains the session's outbox into the data channel only as fast as
SCTP takes it (what the peer does not read stays in the outbox, where its bound sees it; aiortc's own send queue is
unbounded), reads the channel under the session's flood guard and size bound, feeds received RTP audio to the
conversation, plays the model's audio on the outbound track, sends `session.stats` as often as the session asks
(`stats_interval_s`; none by default), and ends the call (flush, peer closed, slot freed) on DELETE, ICE failure or
timeout, peer close, or shutdown.

What differs in the dialect on WebRTC: the microphone arrives on the RTP track (appends are refused), the model's
audio leaves on the RTP track (no audio deltas), the conversation starts with the offer (its prefill overlaps ICE),
a cut response (`response.cancel`) also empties the playout buffer, and input comes under the jitter buffer's own
network bounds (late audio is worthless on a call) instead of the WebSocket's refuse-past-backlog.

Media: aiortc's receive jitter buffer is bypassed (`media.tracks.InboundAudio`): each 20 ms packet is decoded as
it arrives, resampled to 24 kHz and lands at its pts in the conversation's jitter buffer; engine frames go to a
`media.pacing.Pacer` read 20 ms at a time by the `OutboundAudioTrack` (mono Opus at 24 kHz), whose read grid follows
the engine's writes by the pacer's rules (`WEBRTC_TRACK`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

# aiortc's first peer in a process imports these through cryptography and pyOpenSSL (its certificate, then DTLS):
# 5-7 ms of the worker's loop on the 2-core CPU, likely several times that on a busy host (as numpy.ma's import was:
# app/shell/loop_lag.py), at a moment every session of the worker hears; so they are taken at its start.
import cryptography.hazmat.backends.openssl.backend  # noqa: F401
import cryptography.hazmat.primitives.serialization  # noqa: F401
import numpy as np
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcconfiguration import RTCIceTransportPolicy
from aiortc.rtcrtpsender import RTCRtpSender

from app.calls.recording import asked_to_record
from app.doors.realtime.dialect import RealtimeSession, is_beta
from app.sessions.conversation import Conversation, State
from app.sessions.errors import ProtocolError
from app.sessions.link import input_report
from app.sessions.outbox import Message
from app.sessions.transport import CLOSE_GOING_AWAY, CLOSE_NORMAL
from app.shell.context import CONTEXT
from app.shell.settings import Settings
from app.shell.worker_routing import new_call_id
from media.jitter import FRAME, JitterStats
from media.opus import DOWNLINK_FEC_LOSS_PCT
from media.pacing import FIRST_PLAYED_FRAME, WEBRTC_TRACK, Pacer
from media.red import RedDepth, Redundancy
from media.tracks import (
    RATE,
    ContainedOpusEncoder,
    InboundAudio,
    OutboundAudioTrack,
    decodes_inband_fec,
    install_contained_encoder,
    use_red,
    with_inband_fec,
)
from model.engine import FrameOutput, InvalidSessionParams, Slot

logger = logging.getLogger(__name__)

CALLS_ROUTE = "/v1/realtime/calls"
CHANNEL_LABEL = "oai-events"
FLUSH_WAIT_S = 2.0   # for the queued events to drain when a call ends
RECENT_FRAMES = 750  # the output latency reported: the last minute of frames
CHANNEL_BUFFER_BYTES = 256 << 10   # data-channel bytes in flight before the writer waits for SCTP to drain
RED_DEPTH_CHECK_S = 1.0   # how often RED's depth looks at the caller's last receiver report (Chromium's: ~5 s apart)
_RTP_ONLY = ("input_audio_buffer.append", "input_audio_buffer.commit", "input.commit")


@dataclass(frozen=True)
class WebRTCConfig:
    ice_servers: tuple[RTCIceServer, ...] = ()
    relay_only: bool = False
    connect_timeout_s: float = 20.0        # ICE + DTLS must be up this long after the answer, or the call ends
    red: bool = True                       # RED (media/red.py) both ways with a caller that offers it

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
                   connect_timeout_s=settings.ice_connect_timeout_s, red=settings.webrtc_red)

    def browser_ice_servers(self) -> list[dict[str, Any]]:
        out = []
        for s in self.ice_servers:
            entry: dict[str, Any] = {"urls": s.urls}
            if s.username:
                entry.update(username=s.username, credential=s.credential)
            out.append(entry)
        return out


class OfferError(Exception):
    """The POST body is not a usable offer; answered with HTTP `status` and a JSON error."""

    def __init__(self, message: str, code: str = "bad_event", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def _summary(values: deque[float] | list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p95": None}
    arr = np.asarray(values)
    return {"mean": round(float(arr.mean()), 2), "p50": round(float(np.percentile(arr, 50)), 2),
            "p95": round(float(np.percentile(arr, 95)), 2)}



class CallDialect(RealtimeSession):
    """The Realtime dialect on a WebRTC call (see the module docstring for what differs)."""

    route = CALLS_ROUTE

    def __init__(self, call: Call, beta: bool) -> None:
        super().__init__(call.ctx, beta)
        self.call = call

    async def on_open(self) -> None:
        # The slot was admitted by the POST.
        await self.greet(Conversation(self.call.slot, metrics=self.ctx.metrics))

    async def on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind in _RTP_ONLY:
            raise ProtocolError("unsupported_event", f"{kind}: on a WebRTC call the microphone audio travels on the "
                                "RTP track", param="type")
        await super().on_event(event)
        if kind in ("input_audio_buffer.clear", "input.cancel"):
            self.call.input_cleared()

    def cut(self, status: str, details: dict[str, Any] | None) -> None:
        self.call.cut_playback()                           # what the caller would still hear of it
        super().cut(status, details)

    def call_details(self) -> dict[str, Any]:
        """How much of the model's audio has gone to the caller (what the outbound track has read), and the
        silence it was sent where the engine fell behind."""
        return self.call.pacer.sent()

    def _started(self, task: asyncio.Task[None]) -> None:
        super()._started(task)
        if not task.cancelled() and task.exception() is not None and not self.closed:
            self.spawn(self.close(CLOSE_NORMAL, "start_failed"))   # no retry on every packet

    def _on_frame(self, frame: FrameOutput) -> None:
        if not self.closed:
            self.call.time_input(frame)
        super()._on_frame(frame)

    def play(self, frame: FrameOutput, ids: dict[str, Any]) -> None:
        self.call.play(frame)


class Call:
    """One WebRTC call: the peer connection and media, as the transport of its `CallDialect` session."""

    carries_audio = False                   # the model's audio leaves on the RTP track

    def __init__(self, request: web.Request, slot: Slot, config: WebRTCConfig, offer_sdp: str,
                 calls: dict[str, Call]) -> None:
        self.ctx = request.app[CONTEXT]
        self.settings = self.ctx.settings
        self.offer_sdp = offer_sdp
        self.remote = request.remote
        self.carries_events = "m=application" in offer_sdp   # no channel offered: events have nowhere to go
        self.call_id = new_call_id(getattr(self.ctx.engine, "worker", None))
        self.slot = slot
        self.webrtc = config
        self.calls = calls
        self.address: str | None = None      # counted in ctx.addresses while the call lives
        policy = RTCIceTransportPolicy.RELAY if config.relay_only else RTCIceTransportPolicy.ALL
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=list(config.ice_servers), iceTransportPolicy=policy))
        self.pacer = Pacer(RATE, WEBRTC_TRACK)
        self.track = OutboundAudioTrack(self.pacer)
        self.opus = ContainedOpusEncoder(expected_loss_pct=DOWNLINK_FEC_LOSS_PCT if decodes_inband_fec(offer_sdp)
                                         else 0)
        self.inbound: InboundAudio | None = None
        self.red_depth: RedDepth | None = None          # where RED was negotiated: how deep it is now
        self.channel: Any = None
        self.input_waits_ms: deque[float] = deque(maxlen=750)
        self._arrivals: deque[tuple[int, int, float]] = deque(maxlen=64)   # recent pushes: (pts, end, arrival)
        self._origin: int | None = None      # input timeline position the engine's read count starts from
        self._tick_s = 0.0                   # the engine's recent tick duration (its read came that much earlier)
        self.opened_at = time.monotonic()
        self.connected_at: float | None = None
        self.end_reason: str | None = None
        self._incoming: asyncio.Queue[str | bytes] = asyncio.Queue()
        self._channel_drained = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.session = CallDialect(self, is_beta(request))
        self.session.attach(self)

    @property
    def closed(self) -> bool:
        return self.session.closed

    @property
    def conversation(self) -> Conversation | None:
        return self.session.conversation

    # ---- set-up ----------------------------------------------------------------------------------------------

    async def open(self, session: dict[str, Any] | None) -> None:
        """Conversation and config; `session` is applied like a `session.update` (a ProtocolError if bad)."""
        dialect = self.session
        await dialect.on_open()
        record = None
        if session is not None:
            session = dict(session)
            record = asked_to_record(session.pop("record", None))   # ours, beside the Realtime session's fields
            await dialect.on_session_update({"type": "session.update", "session": session})
        assert self.ctx.engine is not None and dialect.conversation is not None
        try:
            self.ctx.engine.validate(dialect.config.params())
        except InvalidSessionParams as e:
            raise ProtocolError(e.code, e.message, param="session") from None
        dialect.live_call = self.ctx.calls.open(CALLS_ROUTE, dialect.conversation, dialect, call_id=self.call_id,
                                                caller={"remote": self.remote}, codec="opus/48000", record=record,
                                                agent={"persona": dialect.config.persona,
                                                       "voice": dialect.config.voice})

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
        red = use_red(mic, self.offer_sdp) if self.webrtc.red else None
        if red is not None:
            self.opus.red = Redundancy(red)
            self.red_depth = RedDepth(red.redundant)
        install_contained_encoder(mic.sender, self.opus)
        self.inbound = InboundAudio(mic.receiver, self, red=red)
        pc.on("datachannel", self._on_datachannel)
        pc.on("connectionstatechange", self._on_connection_state)
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:   # aiortc fails this way on offers it parsed but cannot answer (a broken BUNDLE)
            raise OfferError(f"the offer cannot be answered ({type(e).__name__}: {e})") from None
        self._spawn(self._receive_audio())
        self._spawn(self._connect_deadline())
        if self.red_depth is not None:
            self._spawn(self._follow_reported_loss())
        # The model starts now, not at the first microphone packet: its prompt prefill overlaps ICE and DTLS, so
        # the call's first words come one frame after the media is up. Until then it hears silence, and its
        # frames are not played (on_frame), so no latency stands in the playout buffer.
        self.session._start()
        return with_inband_fec(pc.localDescription.sdp)   # the caller adds FEC, InboundAudio uses it

    def _spawn(self, coro: Any) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def _follow_reported_loss(self) -> None:
        """RED's depth follows the loss the caller's RTCP receiver reports on what the server sends (RedDepth)."""
        assert self.opus.red is not None and self.red_depth is not None
        while not self.closed:
            await asyncio.sleep(RED_DEPTH_CHECK_S)
            with contextlib.suppress(Exception):   # a peer closing under the stats
                for s in (await self.pc.getStats()).values():
                    if s.type == "remote-inbound-rtp" and s.kind == "audio":
                        self.opus.red.depth = self.red_depth.report(s.packetsLost, s.packetsReceived)

    # ---- peer events -----------------------------------------------------------------------------------------

    def _on_connection_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected" and self.connected_at is None:
            self.connected_at = time.monotonic()
        elif state in ("failed", "closed") and not self.closed:
            self.session.spawn(self.hang_up(CLOSE_NORMAL, "ice_failed" if state == "failed" else "peer_closed"))

    async def _connect_deadline(self) -> None:
        await asyncio.sleep(self.webrtc.connect_timeout_s)
        if self.connected_at is None and not self.closed:
            await self.hang_up(CLOSE_NORMAL, "ice_timeout")

    async def _receive_audio(self) -> None:
        assert self.inbound is not None
        await self.inbound.ended()                        # the receiver stopped: RTCP BYE, peer gone
        if not self.closed:
            self.session.spawn(self.hang_up(CLOSE_NORMAL, "peer_closed"))

    def _on_datachannel(self, channel: Any) -> None:
        if channel.label != CHANNEL_LABEL or self.channel is not None:
            channel.close()
            return
        self.channel = channel
        channel.on("message", self._incoming.put_nowait)
        channel.on("close", lambda: self.session.spawn(self.hang_up(CLOSE_NORMAL, "peer_closed")))
        channel.bufferedAmountLowThreshold = CHANNEL_BUFFER_BYTES
        channel.on("bufferedamountlow", self._channel_drained.set)
        self.session.outbox.start(self._send_channel)
        self._spawn(self._read_channel())
        self._spawn(self._send_stats())

    # ---- the data channel ------------------------------------------------------------------------------------

    async def _send_channel(self, message: Message) -> bool:
        """The outbox's writer: into the channel only as fast as SCTP drains it."""
        channel = self.channel
        if channel.readyState != "open":
            return False
        channel.send(message)
        if channel.bufferedAmount > CHANNEL_BUFFER_BYTES:
            self._channel_drained.clear()
            await self._channel_drained.wait()
        return True

    async def _read_channel(self) -> None:
        dialect = self.session
        limit = self.settings.max_message_bytes
        while not self.closed:
            data = await self._incoming.get()
            if not dialect.flood.admit():
                continue
            try:
                if isinstance(data, bytes):
                    await dialect.send_error(ProtocolError("binary_unsupported",
                                                           f"{CHANNEL_LABEL} takes JSON text only"))
                elif len(data) > limit:
                    await dialect.send_error(ProtocolError(
                        "event_too_large", f"message of {len(data)} bytes; the bound is {limit} bytes"))
                else:
                    await dialect.dispatch_text(data)
            except Exception as e:   # a bug must not silently end the reader: the call keeps its events
                logger.exception("call %s: event failed", self.call_id)
                dialect.send_error_nowait(ProtocolError("internal_error", f"{type(e).__name__}: {e}"))

    # ---- media -----------------------------------------------------------------------------------------------

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        """Received audio (24 kHz, at its pts); the conversation started at the answer (again after a failed
        start, at the next packet)."""
        conv = self.conversation
        if self.closed or conv is None or conv.state in (State.FAILED, State.CLOSED):
            return
        if conv.state is State.IDLE:
            self.session._start()
        now = time.monotonic() if now is None else now
        conv.push(pts, samples, now)
        if pts is not None:
            if self._origin is None and conv.input is not None:
                self._origin = pts - self._consumed(conv.input.stats())
            self._arrivals.append((pts, pts + samples.size, now))

    def input_cleared(self) -> None:
        self._origin = None                                # the input buffer starts a new timeline

    @staticmethod
    def _consumed(st: JitterStats) -> int:
        """Input positions the engine has moved past: frames read plus windows shed."""
        return st.frames_out * FRAME + round(st.overrun_drops_ms * RATE / 1000)

    def _time_input_wait(self, st: JitterStats, now: float) -> None:
        """How long the newest sample of the frame the engine just answered had waited until the tick that took it
        began: the jitter buffer's hold, and the worker's input lead (a frame goes to the engine that much before
        its tick) and the answer's way back, as far as the tick's usual length does not cover it."""
        if self._origin is None:
            return
        newest = self._origin + self._consumed(st) - 1
        for start, end, arrival in reversed(self._arrivals):
            if start <= newest < end:
                self.input_waits_ms.append((now - self._tick_s - arrival) * 1000.0)
                return

    def time_input(self, frame: FrameOutput) -> None:
        """An engine frame (heard or not): time the input it answered."""
        conv = self.conversation
        if conv is not None and conv.input is not None:
            if frame.index % 25 == 0 and self.ctx.engine is not None:
                self._tick_s = self.ctx.engine.stats().tick_ms_p50 / 1000.0
            self._time_input_wait(conv.input.stats(), time.monotonic())

    def cut_playback(self) -> None:
        """A cut response: what is buffered is not played; the next frame played restarts playback."""
        self.pacer.clear()

    def play(self, frame: FrameOutput) -> None:
        """An engine frame the caller hears (from frame 1, once the peer is connected): onto the outbound track."""
        if frame.index >= FIRST_PLAYED_FRAME and self.connected_at is not None:
            self.pacer.write(frame.audio)

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
        # What the jitter buffer itself held after each read (as the other doors report it), over the whole call.
        link = input_report(conv) if conv is not None else None
        return {
            "type": "session.stats",
            "call_id": self.call_id,
            "state": "closed" if self.closed else (conv.state.value if conv else "idle"),
            "connected": self.connected_at is not None,
            "input": asdict(conv.input.stats()) if conv is not None and conv.input is not None else None,
            "output": {**asdict(self.pacer.playout.stats()), "frames_sent": track.frames, "stalls": track.stalls,
                       "skipped_ms": track.skipped_ms, "encode_failures": self.opus.failures,
                       "red": self.opus.red is not None,
                       "red_depth": self.opus.red.depth if self.opus.red is not None else 0,
                       "red_deepened": self.red_depth.deepened if self.red_depth is not None else 0},
            "inbound": asdict(self.inbound.stats) if self.inbound is not None else None,
            "rtp": rtp,
            "latency_ms": {"input_added": _summary(self.input_waits_ms),
                           "input_buffered": link["added_ms"] if link is not None else None,
                           "output_added": _summary([w * 1000.0 for w in self.pacer.waits][-RECENT_FRAMES:])},
            "engine": None if engine is None else {"tick_ms_p50": engine.tick_ms_p50, "tick_ms_p99": engine.tick_ms_p99,
                                                   "late_ticks": engine.late_ticks, "batch": engine.batch},
            "conversation": conv.counters() if conv is not None else None,
        }

    async def _send_stats(self) -> None:
        """`session.stats` every `stats_interval_s` the session asked for (none by default: an extension)."""
        while not self.closed:
            interval = self.session.stats_interval_s
            await asyncio.sleep(interval or 0.5)
            if interval and not self.closed:
                self.session.send_nowait(await self.stats())

    # ---- ending ----------------------------------------------------------------------------------------------

    async def hang_up(self, code: int = CLOSE_NORMAL, reason: str = "hang_up", *, send_closed: bool = True) -> None:
        """End the call from outside the dialect (DELETE, the peer, the deadline): `session.closed` on the
        channel, slot freed, peer closed; idempotent."""
        await self.session.close(code, reason, send_closed=send_closed)

    async def close(self, code: int, reason: str) -> None:
        """The transport's end of `Session.close`: flush the channel (bounded), close the peer, forget the call."""
        self.end_reason = reason
        await self.session.outbox.stop(FLUSH_WAIT_S)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self.track.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()
        self.opus.release()
        self.calls.pop(self.call_id, None)
        address, self.address = self.address, None
        if address is not None:
            self.ctx.addresses.release(address)
        if self in self.ctx.sockets:
            self.ctx.sockets.discard(self)
            self.ctx.metrics.connections[CALLS_ROUTE] -= 1
        logger.info("call %s ended: %s", self.call_id, reason)

    async def shutdown(self) -> None:
        await self.hang_up(CLOSE_GOING_AWAY, "server_shutdown")
