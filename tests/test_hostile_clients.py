"""Hostile and broken clients on every door (issue 14's findings): deeply nested JSON, non-finite numbers, huge
echoes, clients that never read. Each answer is a clear error or a documented close, and the session or server
goes on."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import numpy as np
import pytest
from server_support import b64, closed_with, encode, expect_error, next_event, until, wait_in_use
from webrtc_support import ensure_ice_host_address

from app.doors.webrtc.client import RealtimeCall

REALTIME = "/v1/realtime?duplex=1"
DEEP = "[" * 1000 + "]" * 1000   # 2 KB, 1000 levels


def strict_loads(text: str) -> object:
    """A strict JSON parser, as other languages' parsers are: NaN and Infinity are not JSON."""
    def refuse(name: str) -> object:
        raise ValueError(f"non-standard constant {name}")
    return json.loads(text, parse_constant=refuse)


async def open_dialect(http: aiohttp.ClientSession, server, dialect: str) -> aiohttp.ClientWebSocketResponse:
    """A socket past its greeting, and ready to answer a probe."""
    if dialect == "realtime":
        ws = await http.ws_connect(server.ws(REALTIME))
        assert (await next_event(ws))["type"] == "session.created"
    else:
        ws = await http.ws_connect(server.ws(f"/v1/{dialect}"))
    return ws


async def probe(ws: aiohttp.ClientWebSocketResponse, dialect: str) -> None:
    """The session still answers: a heartbeat (Twilio has none: an unknown event gets its error)."""
    if dialect == "twilio":
        await ws.send_json({"event": "probe"})
        await expect_error(ws, "unknown_event")
    else:
        await ws.send_json({"type": "session.heartbeat"})
        await until(ws, "session.heartbeat_ack")


@pytest.mark.parametrize("dialect", ["realtime", "duplex", "twilio"])
async def test_deep_nesting_is_invalid_json_and_the_session_goes_on(server, dialect):
    key = "event" if dialect == "twilio" else "type"
    async with aiohttp.ClientSession() as http:
        ws = await open_dialect(http, server, dialect)
        await ws.send_str(f'{{"{key}": "session.update", "session": {DEEP}}}')
        err = await expect_error(ws, "invalid_json")
        assert "nested deeper" in err["message"]
        await ws.send_str(DEEP)
        await expect_error(ws, "invalid_json")
        await probe(ws, dialect)
        await ws.close()
    assert server.ctx.metrics.errors["internal_error"] == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
async def test_non_finite_numbers_are_refused_and_nothing_non_strict_is_sent(server, number):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        assert (await next_event(ws))["type"] == "session.created"
        await ws.send_str(f'{{"type": "playback.ack", "played_ms": {number}, "event_id": "ack1"}}')
        msg = await ws.receive(timeout=5)
        event = strict_loads(msg.data)
        assert event["type"] == "error" and event["error"]["code"] == "invalid_json", event
        assert "finite" in event["error"]["message"]
        await ws.send_str('{"type": "playback.ack", "played_ms": 1e300, "committed_ms": 12.5}')
        acked = strict_loads((await ws.receive(timeout=5)).data)
        assert acked["type"] == "playback.acknowledged" and acked["event"]["played_ms"] == 1e300


async def test_errors_echo_only_a_short_prefix_of_what_was_sent(server):
    huge = "x" * 200_000
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/duplex")) as ws:
        await ws.send_json({"type": huge, "event_id": "e" * 100_000})
        msg = await ws.receive(timeout=5)
        assert len(msg.data) < 1000, len(msg.data)
        err = json.loads(msg.data)["error"]
        assert err["code"] == "unknown_event" and err["event_id"].startswith("eee")
        await ws.send_json({"type": "session.create", "session": {"voice": huge}})
        assert len((await ws.receive(timeout=5)).data) < 1000


async def test_twilio_ids_that_would_be_echoed_in_every_message_are_bounded(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        await ws.send_json({"event": "start", "streamSid": "M" * 10_000, "start": {}})
        err = await expect_error(ws, "bad_event")
        assert err["param"] == "start.streamSid"
        assert server.ctx.metrics.admissions["/v1/twilio"] == 0


async def test_deep_nesting_on_the_calls_route_is_a_400(server):
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/realtime/calls", data=f'{{"sdp": "v=0", "session": {DEEP}}}',
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_json"
        form = aiohttp.FormData()
        form.add_field("sdp", "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n", content_type="application/sdp")
        form.add_field("session", DEEP, content_type="application/json")
        async with http.post(server.url + "/v1/realtime/calls", data=form) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_json"
        await wait_in_use(http, server.url, 0)


async def test_the_data_channel_reader_survives_hostile_events(server):
    ensure_ice_host_address()
    call = RealtimeCall(server.url)
    await call.connect()
    try:
        await call.wait_event("session.created")
        call.channel.send('{"type": "session.update", "session": ' + DEEP + "}")
        call.channel.send('{"type": "playback.ack", "played_ms": NaN}')
        call.send_event({"type": "session.heartbeat"})
        await call.wait_event("session.heartbeat_ack", timeout_s=10)
        codes = [e["error"]["code"] for e in call.events if e["type"] == "error"]
        assert codes == ["invalid_json", "invalid_json"], codes
    finally:
        await call.hang_up()


def _small_receive_buffer(addr_info) -> socket.socket:
    """A client socket whose kernel receive buffer stays small, so a client that stops reading stalls soon."""
    sock = socket.socket(addr_info[0], addr_info[1], addr_info[2])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


async def _until_backpressure(server, ws: aiohttp.ClientWebSocketResponse, send, timeout_s: float = 90.0) -> None:
    """Keep `send`ing on a client that reads nothing until the server gives up on it."""
    deadline = time.monotonic() + timeout_s
    while server.ctx.metrics.errors["output_backpressure"] == 0:
        assert time.monotonic() < deadline, "the client that never reads was never closed"
        await send()
        await asyncio.sleep(0.02)


async def test_a_twilio_client_that_never_reads_is_closed_and_its_slot_freed(start_server, speech_24k):
    server = await start_server(max_output_backlog_s=1.0)
    ulaw = encode(np.tile(speech_24k, 3)[::3], "pcmu", 8000)
    stalled = aiohttp.TCPConnector(socket_factory=_small_receive_buffer)
    async with aiohttp.ClientSession() as http, aiohttp.ClientSession(connector=stalled) as stalled_http:
        ws = await stalled_http.ws_connect(server.ws("/v1/twilio"))
        ws._conn.transport.pause_reading()   # the bridge sends media and never reads
        await ws.send_json({"event": "start", "streamSid": "MZ1", "start": {"streamSid": "MZ1"}})
        chunks = iter(range(0, 10**9, 160))

        async def media() -> None:
            i = next(chunks) % max(160, len(ulaw) - 160)
            await ws.send_json({"event": "media", "streamSid": "MZ1", "media": {"payload": b64(ulaw[i:i + 160])}})

        await _until_backpressure(server, ws, media)
        await wait_in_use(http, server.url, 0)  # its slot is free at once
        ws._conn.transport.resume_reading()
        code, seen = await closed_with(ws, timeout=15)
        assert code == 1008
        codes = [e["error"]["code"] for e in seen if e.get("type") == "error"]
        assert codes == ["output_backpressure"], [e.get("event", e.get("type")) for e in seen][-5:]


async def test_a_non_reader_flooding_invalid_events_is_bounded_in_bytes(start_server):
    server = await start_server(max_output_backlog_s=600.0, max_output_bytes=16384)
    stalled = aiohttp.TCPConnector(socket_factory=_small_receive_buffer)
    async with aiohttp.ClientSession(connector=stalled) as stalled_http:
        ws = await stalled_http.ws_connect(server.ws("/v1/duplex"))
        ws._conn.transport.pause_reading()
        junk = json.dumps({"type": "y" * 60_000})

        async def flood() -> None:
            await ws.send_str(junk)

        await _until_backpressure(server, ws, flood)
        ws._conn.transport.resume_reading()
        code, _ = await closed_with(ws, timeout=15)
        assert code == 1008
