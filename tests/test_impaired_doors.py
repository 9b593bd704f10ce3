"""A far caller on every door: one call each (WebRTC, Realtime WebSocket, Twilio, SIP) on the tiny model behind the
issue's first condition, both ways: 150 ms round trip, +-30 ms jitter, 1 % loss, 0.5 % reordering (bench/impair.py).

Real clients on loopback: an aiortc peer whose ICE transport is impaired from before DTLS, the load drivers'
WebSocket clients through a TCP relay (loss there is a retransmission a timeout later, holding what follows), a SIP
caller whose RTP goes through a UDP relay. On the server's input buffer (media/jitter.py) each call must meet the
condition's bounds: concealment within what was lost + 20 ms per minute, no underrun that a loss (or this machine's
own stall: the loop is shared by the server and the client) does not explain, and added input latency (its median
after the first 2 s) at most the jitter's p95 + 20 ms (plus what the client's packet is longer than 20 ms: the
Realtime client appends 80 ms at a time): the link's jitter, or, where this machine's own stalls (the client's
sender, the loop, the engine thread: all on two shared cores) made the arrivals the server saw more jittery than
the link, the arrival jitter the buffer measured (both are printed). The engine's own late reads are this machine's
too: the tiny engine shares two cores with the clients, and a tick it could not run on time leaves its frame in the
buffer as excess (CI, one run: 1.6 s drained over a 12 s call, added p50 110 ms), so the reads from one until the
latency is back within 20 ms of its value before (at most 2 s, a stall's bound) are not judged; where more than a
tenth of the reads came late, this machine did not keep real time and the latency is not judged at all (skipped,
saying so). What the caller hears (a player on the client), first audio and the link's own record are printed as
one JSON line per door.

`IMPAIR_CONDITIONS=all` runs a clean link (the first condition's bounds) and the issue's other two conditions on
every door too (not in CI): 5 % bursty loss (mean
burst 3 packets: the output keeps real time, RTF >= 0.99, and the session no error) and a 400 ms stall (here 4 s
in: added latency back within 20 ms of its value before the stall in <= 2 s, no hard cut, at most 25 ms of sound
cut by one read).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from process_support import TICK_S
from webrtc_support import ensure_ice_host_address

from app.doors.sip import SIP
from app.doors.sip.client import RtpPeer, SipClient, offer
from app.doors.sip.sdp import parse_offer
from app.doors.webrtc.client import RealtimeCall
from app.doors.webrtc.routes import CALLS
from bench.doors import RealtimeClient, TwilioClient, client_session
from bench.impair import FAR, FEC_LOSS_PCT, PRESETS, Link, LinkModel, PeerImpairment, TcpRelay, UdpRelay, impair_peer
from bench.impair_report import (
    SETTLE_S,
    adaptive_player,
    fixed_delay_player,
    input_report,
    late_read_windows,
    underrun_onsets,
    unexplained,
)
from media.jitter import JitterBuffer
from media.resample import Resampler
from media.rtp import PCMU
from tests.sip_support import start_sip_server

RATE = 24000
SECONDS = 12.0
SEED = 30
PLAYER_MS = (80.0, 160.0, 320.0)     # fixed-delay players on the WebSocket clients
STALL_S = 0.04                       # a loop wake-up or an engine read this late is this machine's stall
LATE_READS_MAX = 0.1                 # a share of the reads late beyond which this machine cannot keep real time
CONDITIONS: dict[str, Link] = {"clean": Link(), "far": FAR, "bursty": PRESETS["bursty"],
                               "stalls": replace(PRESETS["stalls"], stall_first_s=4.0)}
_ALL = pytest.mark.skipif(os.environ.get("IMPAIR_CONDITIONS") != "all",
                          reason="the second and third conditions run with IMPAIR_CONDITIONS=all (CI runs the first)")


@pytest.fixture(params=["far", pytest.param("clean", marks=_ALL), pytest.param("bursty", marks=_ALL),
                        pytest.param("stalls", marks=_ALL)])
def condition(request: pytest.FixtureRequest) -> str:
    return request.param


class LoopLag:
    """Wakes every 20 ms and keeps when a wake-up came `STALL_S` late: on a loaded machine the shared loop stalls,
    and a stall holds the server's receive side as a stalled link would."""

    def __init__(self) -> None:
        self.stalls: list[float] = []
        self.held_ms = 0.0              # how long those late wake-ups were late, together
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + 0.02
            await asyncio.sleep(0.02)
            late = time.monotonic() - due
            if late > STALL_S:
                self.stalls.append(time.monotonic())
                self.held_ms += 1000.0 * late

    def stop(self) -> None:
        self._task.cancel()


@pytest.fixture
async def lag() -> AsyncIterator[LoopLag]:
    monitor = LoopLag()
    yield monitor
    monitor.stop()


def speech_for(speech: np.ndarray, seconds: float) -> np.ndarray:
    return np.resize(speech, int(seconds * RATE)).astype(np.float32)


def judge(door: str, condition: str, buffer: JitterBuffer, origin: float, lost_ms: float, up: LinkModel,
          causes: list[float], extra: dict[str, Any], packet_ms: float = 20.0) -> dict[str, Any]:
    """The input side's report, checked against the condition's bounds; printed with `extra`. `packet_ms`: the
    client's packet. The bound on added latency presumes 20 ms packets; the buffer hands out a frame once the
    packet that completes it is in, so a longer packet (the Realtime client's 80 ms appends) adds what it is
    longer, by where the engine's reads fall on its grid (the load runs judge that door the same way)."""
    shift = (up._origin or origin) - origin             # the link's clock starts at its first packet
    stalls = [t + shift for t in up.stall_starts(SECONDS)]
    late_reads = late_read_windows(buffer.trace(), TICK_S, STALL_S)
    report = input_report(buffer.stats(), buffer.trace(), lost_ms, up.stats.jitter_ms(), origin, stalls,
                          up.link.stall_ms / 1000.0, unjudged=late_reads)
    report["reader_late_reads"] = len(late_reads)
    onsets = underrun_onsets(buffer.trace(), origin + SETTLE_S, origin + SECONDS)
    report["underrun_onsets"] = len(onsets)
    report["seen_jitter_p95_ms"] = round(buffer.stats().jitter_ms, 1)
    report["unexplained_underruns"] = [round(t - origin, 2) for t in unexplained(onsets, causes)]
    print(json.dumps({"door": door, "link": condition, **report, **extra}))
    if condition == "clean":       # the baseline row: nothing to conceal (an underrun here is this machine's)
        assert report["concealed_ms"] <= 20.0 * SECONDS / 60.0 + extra.get("sender_skipped_ms", 0.0), report
        return report
    if condition == "bursty":
        assert extra.get("errors", 0) == 0 and (extra.get("rtf") or 1.0) >= 0.99, extra
        return report
    if condition == "stalls":
        assert report["stalls"] and all(s["back_after_s"] is not None and s["back_after_s"] <= 2.0
                                        for s in report["stalls"]), report
        assert report["hard_cuts"] == 0 and report["sound_cut_max_ms"] <= 25.0, report
        return report
    minutes = SECONDS / 60.0
    assert report["concealed_ms"] <= report["lost_ms"] + 20.0 * minutes + extra.get("sender_skipped_ms", 0.0), report
    assert report["concealed_ms"] >= report["lost_ms"] - 200.0 - report["overrun_drops_ms"], report  # some still queued
    assert report["unexplained_underruns"] == [], report
    reads = SECONDS / TICK_S
    if report["reader_late_reads"] > LATE_READS_MAX * reads:
        pytest.skip(f"this machine ran the engine late on {report['reader_late_reads']} of {reads:.0f} reads: the "
                    f"buffer held what it could not hand out, so its latency says nothing of the link")
    assert report["added_ms"]["p50"] is not None, report
    bound = max(report["jitter_p95_ms"], report["seen_jitter_p95_ms"]) + 20.0 + max(0.0, packet_ms - 20.0)
    assert report["added_ms"]["p50"] <= bound, (bound, report)
    return report


async def test_webrtc_far_caller(server, speech_24k, lag, condition):
    ensure_ice_host_address()
    hooks: list[PeerImpairment] = []
    link = CONDITIONS[condition]
    # The microphone sends in-band FEC, as a browser's does seeing loss.
    call = RealtimeCall(server.url, speech_for(speech_24k, SECONDS + 4),
                        on_answer=lambda pc: hooks.append(impair_peer(pc, link, link, SEED)), fec_loss_pct=FEC_LOSS_PCT)
    began = time.monotonic()
    await call.connect()
    try:
        served = next(iter(server.app[CALLS].values()))
        origin = time.monotonic()
        await asyncio.sleep(SECONDS)
        buffer = served.conversation.input
        hook = hooks[0]
        audible = [c for c in call.recording.chunks if np.abs(c[1]).max(initial=0.0) > 1e-3]
        fec, red = served.inbound.stats.fec_frames, served.inbound.stats.red_frames
        # a loss RED or FEC rebuilt is not concealed: the buffer's loss is what they left
        report = judge("webrtc", condition, buffer, origin, 20.0 * (len(hook.rtp_lost_at) - fec - red), hook.up,
                       hook.rtp_lost_at + lag.stalls, {"rtp_lost": len(hook.rtp_lost_at), "fec_rebuilt": fec,
                  "red_rebuilt": red,
                  "sender_skipped_ms": call.mic.stats.skipped_ms, "up": hook.up.stats.summary(),
                  "down": hook.down.stats.summary(), "player": adaptive_player(call.recording.chunks),
                  "first_audio_ms": round((audible[0][2] - began) * 1000.0, 1) if audible else None})
        if len(hook.rtp_lost_at) >= 3 and condition == "far":
            # isolated losses: each comes back whole from the next packet's RED block (the caller proposed RED)
            assert red >= 0.8 * len(hook.rtp_lost_at), report
    finally:
        await call.hang_up()


async def ws_door(server, client_cls: type, speech: np.ndarray, lag: LoopLag, condition: str,
                  **client_options: Any) -> None:
    link = CONDITIONS[condition]
    relay = await TcpRelay(("127.0.0.1", server.port), link, link, SEED).start()
    client = client_cls(client_cls.door, f"http://127.0.0.1:{relay.port}", **client_options)
    try:
        async with client_session() as http:
            assert await client.open(http) is None
            origin = time.monotonic()
            streaming = asyncio.ensure_future(client.stream(speech_for(speech, SECONDS), origin))
            while not server.ctx.sockets:
                await asyncio.sleep(0.01)
            session = next(iter(server.ctx.sockets)).session
            await streaming
            buffer = session.conversation.input
            up, down = relay.models[0]
            late = [origin + i * client.send_period_s for i, ms in enumerate(client.send_late_ms) if ms > 40]
            await client.wait_output(1.0, timeout_s=5.0)
            report = client.report()
            judge(client.door, condition, buffer, origin, 0.0, up, up.stats.lost_at + lag.stalls + late, {
                "up": up.stats.summary(), "down": down.stats.summary(), "first_audio_ms": report["first_audio_ms"],
                "rtf": report["rtf"], "errors": report["errors"],
                "players": [fixed_delay_player(client.received.times, client.received.ends_s, d) for d in PLAYER_MS]},
                  packet_ms=1000.0 * client.send_period_s)
            await client.close()
    finally:
        await relay.close()


async def test_realtime_far_caller(server, speech_24k, lag, condition):
    await ws_door(server, RealtimeClient, speech_24k, lag, condition)


async def test_realtime_far_caller_in_20_ms_appends(server, speech_24k, lag, condition):
    """A Realtime client that appends 20 ms at a time (as a telephony or WebRTC front end would): the added latency
    meets the issue's bound as written, the jitter's p95 + 20 ms, with nothing added for the packet."""
    await ws_door(server, RealtimeClient, speech_24k, lag, condition, piece_ms=20.0)


async def test_twilio_far_caller(server, speech_24k, lag, condition):
    await ws_door(server, TwilioClient, speech_24k, lag, condition)


async def test_sip_far_caller(start_server, speech_24k, lag, condition):
    srv = await start_sip_server(start_server)
    client = SipClient(("127.0.0.1", srv.app[SIP].port))
    await client.open()
    rtp = RtpPeer()
    await rtp.open()
    link = CONDITIONS[condition]
    relay = await UdpRelay(link, link, SEED, client=("127.0.0.1", rtp.port)).start()
    try:
        d = client.dialog()
        began = time.monotonic()
        final = (await client.invite(d, offer("127.0.0.1", relay.far[1], [(0, "PCMU/8000")])))[-1]
        assert final.code == 200, (final.code, final.phrase)
        client.ack(d, final)
        media = parse_offer(final.body).media[0]
        relay.server = (media.address or "127.0.0.1", media.port)
        origin = time.monotonic()
        await rtp.stream(PCMU, 0, Resampler(RATE, 8000).process(speech_for(speech_24k, SECONDS)), relay.near)
        buffer = srv.app[SIP].dialogs[d.call_id].media.conversation.input
        up, down = relay.up_model, relay.down_model.stats
        ts0 = rtp.received[0][1].timestamp if rtp.received else 0
        heard = [(at, ((p.timestamp - ts0) % (1 << 32) + 160) / 8000) for at, p in rtp.received
                 if any(b != 0xFF for b in p.payload)]
        judge("sip", condition, buffer, origin, 20.0 * up.stats.lost, up, up.stats.lost_at + lag.stalls, {
            "up": up.stats.summary(), "down": down.summary(),
            "first_audio_ms": round((heard[0][0] - began) * 1000.0, 1) if heard else None,
            "players": [fixed_delay_player([h[0] for h in heard], [h[1] for h in heard], ms) for ms in PLAYER_MS]})
        await client.bye(d)
    finally:
        relay.close()
        rtp.close()
        client.close()
