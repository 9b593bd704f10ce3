"""`POST /v1/realtime/calls` end to end: a real aiortc client peer against the server (tiny model) on loopback."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import aiohttp
import numpy as np
import pytest
from process_support import ROOT, open_call
from server_support import wait_in_use
from webrtc_support import ensure_ice_host_address

from app.doors.webrtc.client import CallRefused, RealtimeCall
from app.doors.webrtc.routes import CALLS, WebRTCConfig
from app.shell.settings import parse_settings
from bench.impair import Link, PeerImpairment, impair_peer

CALLS_URL = "/v1/realtime/calls"
OFFER = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"


@pytest.fixture(autouse=True)
def _ice_address():
    ensure_ice_host_address()


async def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_call_speaks_back_and_streams_transcript_events(server, speech_24k):
    session = {"type": "realtime", "instructions": "You are a friendly receptionist.", "stats_interval_s": 1}
    call = RealtimeCall(server.url, speech_24k, session=session)
    await call.connect()
    try:
        assert call.location and "/v1/realtime/calls/rtc_" in call.location
        created = await call.wait_event("session.created")
        updated = await call.wait_event("session.updated")
        assert created["session"]["capabilities"]["implementation_level"] == "model_native_duplex"
        assert updated["session"]["instructions"] == "You are a friendly receptionist."
        await call.wait_event("response.created", timeout_s=15)
        await wait_for(lambda: len(call.transcript()) > 0 and len(call.recording.chunks) > 100, 20,
                       "audio and transcript")
        kinds = [e["type"] for e in call.events]
        start = kinds.index("response.created")
        assert kinds[start:start + 4] == ["response.created", "conversation.item.added",
                                          "response.output_item.added", "response.content_part.added"]
        assert "response.output_audio.delta" not in kinds       # the audio is on the RTP track
        audio = call.recording.audio()
        assert np.isfinite(audio).all()
        assert float(np.sqrt(np.mean(audio[-24000:] ** 2))) > 1e-3
        stats = await call.wait_event("session.stats", timeout_s=5)
        assert stats["input"]["frames_out"] > 0 and stats["output"]["frames_sent"] > 0
        assert stats["rtp"]["packets_received"] > 0 and stats["output"]["encode_failures"] == 0
        assert stats["inbound"]["frames"] > 0
    finally:
        status = await call.hang_up()
    assert status == 204
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, server.url, 0)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
async def test_an_ended_call_frees_its_codec_threads_before_any_collection(server, speech_24k):
    """Each Opus encoder (ours, PyAV's resampler graph inside it) holds FFmpeg threads. A call ends held in reference
    cycles (aiortc's peer and its callbacks) that only a full collection frees, minutes apart in a worker; the
    threads must go when the call ends. The collector is held off here, as between a worker's full collections."""
    thresholds = gc.get_threshold()
    gc.set_threshold(10**9)  # the engine thread's collections follow the thresholds too (model/engine/core.py)

    async def one_call() -> None:
        call = RealtimeCall(server.url, speech_24k)
        await call.connect()
        try:
            await wait_for(lambda: len(call.recording.chunks) > 25, 20, "audio both ways")
        finally:
            await call.hang_up()
        await wait_for(lambda: not server.app[CALLS], 10, "the server to forget the call")

    try:
        await one_call()                                  # the first call starts what stays (executor threads)
        before = os_threads()
        for _ in range(3):
            await one_call()
        assert os_threads() <= before, f"{os_threads() - before} threads left by 3 ended calls"
    finally:
        gc.set_threshold(*thresholds)


async def test_a_full_server_answers_429_and_a_hung_up_call_frees_its_slot(start_server, speech_24k):
    srv = await start_server(max_sessions=1)
    first = RealtimeCall(srv.url, speech_24k, loop_audio=True)
    await first.connect()
    second = RealtimeCall(srv.url, speech_24k)
    with pytest.raises(CallRefused) as refused:
        await second.connect()
    await second.close()
    assert refused.value.status == 429
    assert refused.value.error()["code"] == "resource_exhausted"
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, srv.url, 1)
        assert await first.hang_up() == 204
        await wait_in_use(http, srv.url, 0)
        async with http.delete(first.location) as res:
            assert res.status == 404                       # already gone
    third = RealtimeCall(srv.url, speech_24k, session={"instructions": "again"})
    await third.connect()
    try:
        await third.wait_event("response.created", timeout_s=15)
    finally:
        await third.hang_up()


async def test_a_client_that_leaves_without_hanging_up_frees_its_slot(server, speech_24k):
    call = RealtimeCall(server.url, speech_24k)
    await call.connect()
    await call.wait_event("response.created", timeout_s=15)
    assert len(server.app[CALLS]) == 1
    ended = next(iter(server.app[CALLS].values()))
    await call.close()                                     # DTLS close, no DELETE
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, server.url, 0, timeout=10)
    assert ended.end_reason == "peer_closed" and not server.app[CALLS]


async def test_a_call_whose_ice_never_connects_is_dropped(start_server, speech_24k):
    srv = await start_server(ice_connect_timeout_s=1.0)
    call = RealtimeCall(srv.url, speech_24k)
    call.pc.setRemoteDescription = _never                   # the client never applies the answer: no ICE
    connecting = asyncio.ensure_future(call.connect())
    await wait_for(lambda: srv.app[CALLS], 5, "the call")
    server_side = next(iter(srv.app[CALLS].values()))
    assert srv.ctx.engine.sessions_in_use() == 1
    await wait_for(lambda: server_side.closed, 5, "the call to be dropped")
    assert server_side.end_reason == "ice_timeout" and srv.ctx.engine.sessions_in_use() == 0
    connecting.cancel()
    await call.close()


async def _never(*args, **kwargs):
    await asyncio.sleep(3600)


async def test_the_data_channel_takes_realtime_events_both_ways(server, speech_24k):
    call = RealtimeCall(server.url, speech_24k)
    await call.connect()
    try:
        await call.wait_event("session.created")
        call.send_event({"type": "session.heartbeat", "event_id": "e1"})
        assert (await call.wait_event("session.heartbeat_ack"))["session_id"]
        call.send_event({"type": "input_audio_buffer.append", "audio": "AAAA", "event_id": "e2"})
        call.send_event({"type": "no.such.event", "event_id": "e3"})
        call.channel.send("{not json")
        await wait_for(lambda: len([e for e in call.events if e["type"] == "error"]) >= 3, 5, "three errors")
        errors = {e["error"].get("event_id"): e["error"]["code"] for e in call.events if e["type"] == "error"}
        assert errors["e2"] == "unsupported_event" and errors["e3"] == "unknown_event"
        assert errors[None] == "invalid_json"
        await call.wait_event("response.created", timeout_s=15)
        call.send_event({"type": "session.update", "session": {"instructions": "A different persona."},
                         "event_id": "e4"})
        updated = await call.wait_event("session.updated")     # applied mid-call: prefilled into the context
        assert updated["session"]["instructions"] == "A different persona."
        first = call.events.copy()
        response_id = (await call.wait_event("response.created"))["response_id"]
        call.send_event({"type": "response.cancel"})
        await wait_for(lambda: any(e["type"] == "response.done" for e in call.events), 5, "response.done")
        done = next(e for e in call.events if e["type"] == "response.done")
        assert done["response"]["id"] == response_id and done["response"]["status"] == "cancelled"
        call.send_event({"type": "response.create"})
        await wait_for(lambda: sum(e["type"] == "response.created" for e in call.events) == 2, 10, "new response")
        assert len(call.events) > len(first)
        assert not [e for e in call.events if e["type"] == "error" and e["error"].get("event_id") == "e4"]
    finally:
        await call.hang_up()


async def test_session_closed_is_sent_on_hang_up_and_at_server_shutdown(start_server, speech_24k):
    srv = await start_server()
    call = RealtimeCall(srv.url, speech_24k)
    await call.connect()
    await call.wait_event("session.created")
    await srv.stop()
    closed = await call.wait_event("session.closed", timeout_s=5)
    assert closed["reason"] == "server_shutdown"
    await call.close()


@pytest.mark.parametrize("body,ctype,status,code", [
    (b"hello", "text/plain", 415, "bad_event"),
    (b"not an sdp", "application/sdp", 400, "bad_event"),
    (OFFER.encode(), "application/sdp", 400, "bad_event"),                          # no m=audio
    (b'{"sdp": 5}', "application/json", 400, "bad_event"),
    (b"{broken", "application/json", 400, "invalid_json"),
    ((OFFER + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111\r\n").encode(), "application/sdp", 400,
     "bad_event"),                                                                  # a format with no encoding
    ((OFFER + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\na=fmtp:\r\n").encode(),
     "application/sdp", 400, "bad_event"),                                          # parameters of no format
])
async def test_bad_offers_get_clear_errors_and_take_no_slot(server, body, ctype, status, code):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + CALLS_URL, data=body, headers={"Content-Type": ctype}) as res:
            assert res.status == status
            err = (await res.json())["error"]
            assert err["code"] == code and err["message"]
        await wait_in_use(http, server.url, 0)


async def test_a_bad_session_part_is_refused_before_any_peer(server, speech_24k):
    call = RealtimeCall(server.url, speech_24k, session={"voice": "no-such-voice"})
    with pytest.raises(CallRefused) as refused:
        await call.connect()
    await call.close()
    assert refused.value.status == 400 and refused.value.error()["code"] == "invalid_voice"
    call = RealtimeCall(server.url, speech_24k, session={"temperature": -1})
    with pytest.raises(CallRefused) as refused:
        await call.connect()
    await call.close()
    assert refused.value.error()["code"] == "invalid_session_config"
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, server.url, 0)
        assert not server.app[CALLS]


async def test_api_keys_guard_calls(start_server, speech_24k):
    srv = await start_server(api_keys=("sekrit",))
    call = RealtimeCall(srv.url, speech_24k)
    with pytest.raises(CallRefused) as refused:
        await call.connect()
    await call.close()
    assert refused.value.status == 401
    call = RealtimeCall(srv.url, speech_24k, api_key="sekrit")
    await call.connect()
    try:
        await call.wait_event("session.created")
    finally:
        assert await call.hang_up() == 204


def test_ice_servers_come_from_flags_or_environment():
    settings = parse_settings(["--stun-url", "stun:stun.example.org:3478", "--ice-connect-timeout-s", "7"],
                              env={"PERSONAPLEX_TURN_URL": "turn:turn.example.org:3478",
                                   "PERSONAPLEX_TURN_USERNAME": "u", "PERSONAPLEX_TURN_CREDENTIAL": "p"})
    cfg = WebRTCConfig.from_settings(settings)
    assert [s.urls for s in cfg.ice_servers] == ["stun:stun.example.org:3478", "turn:turn.example.org:3478"]
    assert cfg.browser_ice_servers()[1] == {"urls": "turn:turn.example.org:3478", "username": "u", "credential": "p"}
    assert cfg.connect_timeout_s == 7.0
    assert WebRTCConfig.from_settings(parse_settings([], env={})).ice_servers == ()
    with pytest.raises(ValueError, match="TURN"):
        WebRTCConfig.from_settings(parse_settings(["--ice-relay-only"], env={}))


async def test_the_page_and_its_config_are_served(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/") as res:
            assert res.status == 200 and "<title>PersonaPlex" in await res.text()
        for asset in ("app.js", "style.css"):
            async with http.get(f"{server.url}/static/{asset}") as res:
                assert res.status == 200
        async with http.get(server.url + "/v1/realtime/webrtc-config") as res:
            assert (await res.json())["ice_servers"] == []


async def test_the_favicon_is_served(server):
    async with aiohttp.ClientSession() as http, http.get(server.url + "/favicon.ico") as res:
        body = await res.read()
    assert res.status == 200 and res.content_type in ("image/x-icon", "image/vnd.microsoft.icon")
    assert body[:4] == b"\x00\x00\x01\x00" and body == (ROOT / "static" / "favicon.ico").read_bytes()


async def test_the_model_starts_at_the_answer_not_at_the_first_microphone_packet(server):
    """The prompt prefill overlaps ICE and DTLS: the conversation is live and the engine makes frames for a call
    whose peer has not even applied the answer yet (so no microphone packet can have arrived)."""
    aiortc = pytest.importorskip("aiortc")
    pc = aiortc.RTCPeerConnection()
    try:
        async with aiohttp.ClientSession() as http:
            headers = await open_call(http, server.url, pc)
            location = server.url + headers["Location"]
            stats: dict = {}
            deadline = time.monotonic() + 20
            while not (stats.get("state") == "live" and (stats.get("conversation") or {}).get("frames_out", 0) > 2):
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.1)
                async with http.get(location) as r:
                    stats = await r.json()
            assert stats["connected"] is False and stats["rtp"] == {}
            assert stats["output"]["frames_sent"] == 0     # nothing is played before the peer is connected
            async with http.delete(location) as r:
                assert r.status == 204
    finally:
        await pc.close()


@pytest.mark.parametrize("allowed, offered", [(True, True), (True, False), (False, True)])
async def test_red_is_taken_both_ways_when_the_caller_offers_it_and_the_server_allows(start_server, speech_24k,
                                                                                     allowed, offered):
    """A caller whose offer has RED over its Opus (as a browser's does; our client's `red`) gets an answer that lists
    RED first, and then each side's packets come as RED; a caller that offers none, or a server started with
    `--no-webrtc-red`, gets plain Opus both ways."""
    srv = await start_server(webrtc_red=allowed)
    call = RealtimeCall(srv.url, speech_24k, red=offered)
    await call.connect()
    try:
        served = next(iter(srv.app[CALLS].values()))
        await wait_for(lambda: min(call.inbound.stats.frames, served.inbound.stats.frames) > 50, 20,
                       "packets both ways")
        red = allowed and offered
        answer = call.pc.remoteDescription.sdp
        audio = next(line for line in answer.splitlines() if line.startswith("m=audio"))
        assert audio.split()[3] == ("63" if red else "96") and ("red/48000/2" in answer) == red   # RED first
        for received in (served.inbound.stats, call.inbound.stats):      # what each side got
            assert received.red_packets == (received.frames if red else 0) and received.bad_frames == 0, received
        async with aiohttp.ClientSession() as http, http.get(call.location) as res:
            stats = await res.json()
        assert stats["output"]["red"] == red and (stats["inbound"]["red_packets"] > 0) == red, stats
        assert stats["output"]["red_depth"] == (1 if red else 0) and stats["output"]["red_deepened"] == 0, stats
    finally:
        await call.hang_up()


async def test_red_carries_two_earlier_packets_while_the_caller_reports_much_loss(start_server, speech_24k):
    """The caller's receiver reports (RTCP: aiortc's ~1 s apart, Chromium's ~5 s) say how much of what the server
    sends is lost; from an interval that loses 3 % or more, each packet carries two earlier ones (media.red.RedDepth),
    so a burst of two comes back whole too; the call's stats say so."""
    ensure_ice_host_address()
    srv = await start_server()
    hooks: list[PeerImpairment] = []
    bursty = Link(burst_loss=0.08, burst_len=2.0)
    call = RealtimeCall(srv.url, np.tile(speech_24k, 4), on_answer=lambda pc: hooks.append(impair_peer(pc, Link(),
                                                                                                       bursty, 5)))
    await call.connect()
    try:
        served = next(iter(srv.app[CALLS].values()))
        await wait_for(lambda: served.opus.red.depth == 2, 20, "RED twice redundant")
        async with aiohttp.ClientSession() as http, http.get(call.location) as res:
            stats = await res.json()
        assert stats["output"]["red_depth"] == 2 and stats["output"]["red_deepened"] == 1, stats
        lost = hooks[0].down.stats.lost
        await wait_for(lambda: hooks[0].down.stats.lost >= lost + 4, 20, "more packets lost, twice redundant")
        assert call.inbound.stats.red_frames > 0, call.inbound.stats
    finally:
        await call.hang_up()
