"""Property-based fuzzing of every client event of the WebSocket dialects (Realtime, duplex, Twilio, and the bridges
Telnyx, Vonage, FreeSWITCH) over a real
socket, against one server per module (tiny model, loopback): arbitrary JSON, wrong types, NaN/Infinity, huge
strings, deep nesting, truncated text, binary junk, and raw bytes cut mid-frame. Invariant: each message gets clear
error events (registered codes, no `internal_error`, short echoes) or a documented close, and a bystander
conversation on the same server keeps being served."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from conftest import RunningServer
from fuzz_support import (
    DOCUMENTED_CLOSES,
    FUZZ,
    Bystander,
    check_event,
    frames,
    start_fuzz_server,
    strict_json,
)
from hypothesis import given
from hypothesis import strategies as st

from app.doors.realtime.dialect import _HANDLERS, _UNSUPPORTED

pytestmark = pytest.mark.asyncio(loop_scope="module")

REALTIME_TYPES = sorted(_HANDLERS) + sorted(_UNSUPPORTED)
REALTIME_FIELDS = ["session", "audio", "event_id", "response_id", "item_id", "played_ms", "committed_ms", "reason",
                   "format", "sample_rate_hz", "item"]
DUPLEX_TYPES = ["session.create", "session.close", "close", "session.heartbeat", "input_audio_buffer.append",
                "input_audio_buffer.clear", "conversation.restart"]
DUPLEX_FIELDS = ["session", "audio", "event_id", "reason"]
TWILIO_TYPES = ["connected", "start", "media", "mark", "clear", "dtmf", "stop"]
TWILIO_FIELDS = ["start", "streamSid", "media", "mark", "dtmf", "sequenceNumber", "stop", "event_id"]
TELNYX_TYPES = ["connected", "start", "media", "dtmf", "mark", "error", "stop"]
TELNYX_FIELDS = ["start", "stream_id", "media", "mark", "dtmf", "sequence_number", "stop", "payload", "event_id"]
VONAGE_TYPES = ["websocket:connected", "websocket:dtmf", "websocket:notify", "websocket:cleared"]
VONAGE_FIELDS = ["content-type", "digit", "duration", "payload", "persona", "voice", "event_id"]
DIALECTS = {
    "realtime": ("/v1/realtime?duplex=1", "type", REALTIME_TYPES, REALTIME_FIELDS),
    "duplex": ("/v1/duplex", "type", DUPLEX_TYPES, DUPLEX_FIELDS),
    "twilio": ("/v1/twilio", "event", TWILIO_TYPES, TWILIO_FIELDS),
    "telnyx": ("/v1/telnyx", "event", TELNYX_TYPES, TELNYX_FIELDS),
    "vonage": ("/v1/vonage", "event", VONAGE_TYPES, VONAGE_FIELDS),
    "freeswitch": ("/v1/freeswitch?rate=16000", "type", ["dtmf"], ["digit", "event_id"]),
}
# Well-formed events the fuzz builds on: a started session takes a wider path through each dialect.
OPENERS: dict[str, list[dict[str, Any]]] = {
    "realtime": [],
    "duplex": [{"type": "session.create", "session": {"pacing": "input"}}],
    "twilio": [{"event": "start", "streamSid": "MZfuzz", "start": {"streamSid": "MZfuzz"}}],
    "telnyx": [{"event": "start", "stream_id": "fuzz", "start": {
        "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}}}],
    "vonage": [{"event": "websocket:connected", "content-type": "audio/l16;rate=8000"}],
    "freeswitch": [{}],      # the metadata
}


class Client:
    """One socket per dialect, reopened when a fuzzed message closed it."""

    def __init__(self, http: aiohttp.ClientSession, server: RunningServer, dialect: str) -> None:
        self.http, self.server, self.dialect = http, server, dialect
        self.path, self.type_key, _, _ = DIALECTS[dialect]
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.probes = itertools.count()

    async def socket(self) -> aiohttp.ClientWebSocketResponse:
        if self.ws is None or self.ws.closed:
            self.ws = await self.http.ws_connect(self.server.ws(self.path), max_msg_size=0)
            for event in OPENERS[self.dialect]:
                await self.ws.send_json(event)
        return self.ws

    async def send_and_check(self, frame: str | bytes) -> None:
        """Send one frame, then a probe (an unknown event naming an event_id); read until the probe's error or the
        close, checking every event on the way."""
        ws = await self.socket()
        probe = f"probe_{next(self.probes)}"
        try:
            await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            await ws.send_json({self.type_key: "fuzz.probe", "event_id": probe})
        except ConnectionError:
            pass   # closed while sending: the close is checked below
        while True:
            msg = await ws.receive(timeout=30)
            if msg.type is aiohttp.WSMsgType.BINARY:
                continue
            if msg.type is not aiohttp.WSMsgType.TEXT:
                assert ws.close_code in DOCUMENTED_CLOSES, (ws.close_code, msg)
                return
            event = strict_json(msg.data)
            check_event(event, self.type_key)
            if event.get("type") == "error" and event["error"].get("event_id") == probe:
                assert event["error"]["code"] == "unknown_event"
                return


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fuzz(tiny_checkpoint):
    server = await start_fuzz_server(tiny_checkpoint)
    http = aiohttp.ClientSession()
    bystander = await Bystander.open(http, server)
    clients = {name: Client(http, server, name) for name in DIALECTS}
    yield server, bystander, clients
    await bystander.assert_served()
    assert server.ctx.metrics.errors["internal_error"] == 0
    await http.close()
    await server.runner.cleanup()


def _fuzz_dialect(dialect: str):
    _, type_key, types, fields = DIALECTS[dialect]

    @FUZZ
    @given(batch=st.lists(frames(type_key, types, fields), min_size=1, max_size=3))
    async def test(fuzz, batch: list[str | bytes]) -> None:
        _, bystander, clients = fuzz
        for frame in batch:
            await clients[dialect].send_and_check(frame)
        await bystander.assert_served()

    test.__name__ = f"test_fuzz_{dialect}_events"
    return test


test_fuzz_realtime_events = _fuzz_dialect("realtime")
test_fuzz_duplex_events = _fuzz_dialect("duplex")
test_fuzz_twilio_events = _fuzz_dialect("twilio")
test_fuzz_telnyx_events = _fuzz_dialect("telnyx")
test_fuzz_vonage_events = _fuzz_dialect("vonage")
test_fuzz_freeswitch_events = _fuzz_dialect("freeswitch")


@FUZZ
@given(path=st.sampled_from([d[0] for d in DIALECTS.values()]), junk=st.binary(min_size=1, max_size=600),
       mask=st.booleans())
async def test_fuzz_raw_frames_cut_anywhere(fuzz, path: str, junk: bytes, mask: bool) -> None:
    """A client that upgrades, then writes raw bytes (a frame header with a junk length, half a frame) and
    vanishes: the server drops it and serves the others."""
    server, bystander, _ = fuzz
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setblocking(False)
    try:
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        await loop.sock_sendall(sock, (f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade"
                                       f"\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = await asyncio.wait_for(loop.sock_recv(sock, 4096), 10)
        assert head.startswith(b"HTTP/1.1 101"), head[:200]
        # A text frame header (FIN, opcode 1), masked as clients must, then whatever the fuzz gives.
        frame = bytes([0x81, 0x80 | min(len(junk), 125)]) + (os.urandom(4) if mask else b"") + junk
        await loop.sock_sendall(sock, frame)
    finally:
        sock.close()
    await bystander.assert_served()
