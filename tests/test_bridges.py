"""The telephone bridges end to end through the real server (tiny model), each driven by a fake of the vendor's side
speaking the vendor's protocol: Telnyx media streaming, Vonage Voice API WebSocket, FreeSWITCH mod_audio_stream,
Asterisk AudioSocket (TCP). Audio in at the line's format and pace, model audio out at the line's format, rate and
pace, the vendor's control events, hang-up freeing the slot, malformed frames answered, a full server refused."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
from server_support import b64, closed_with, expect_error, next_event, start_on_free_ports, wait_in_use

from media.resample import Resampler

KEY = "bridge-test-key"


def caller_audio(speech_24k: np.ndarray, rate: int, seconds: float = 3.0) -> np.ndarray:
    return Resampler(24000, rate).process(np.tile(speech_24k, 3)[: int(24000 * seconds)])


def l16(samples: np.ndarray, big_endian: bool = False) -> bytes:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    return pcm.astype(">i2").tobytes() if big_endian else pcm.tobytes()


def rms_l16(data: bytes, big_endian: bool = False) -> float:
    pcm = np.frombuffer(data, ">i2" if big_endian else "<i2").astype(np.float32) / 32768
    return float(np.sqrt(np.mean(pcm ** 2)))


def line_underruns(server: Any) -> int:
    """The model audio's underruns on the server's live phone lines so far (`out_underruns`: a frame that came
    later than the line's hold; the next send then leaves as that frame lands, less than a period after the last)."""
    return sum(call.stats().get("out_underruns", 0) for call in server.ctx.calls.calls.values())


def assert_paced(times: list[float], period_s: float, underruns: int) -> None:
    """One message per period of wall clock, never a burst: a few of slack at the start, and one for each underrun
    (a machine that runs the engine late, as a loaded 2-core one can: 34 messages of 100 ms in 2.78 s)."""
    span = times[-1] - times[0]
    assert len(times) <= span / period_s + 6 + underruns, (len(times), span, underruns)
    assert len(times) >= span / period_s * 0.7, (len(times), span)


async def send_paced(chunks: list[Any], send: Callable[[int, Any], Awaitable[None]], period_s: float = 0.02) -> None:
    t0 = time.monotonic()
    for n, chunk in enumerate(chunks):
        await send(n, chunk)
        await asyncio.sleep(max(0.0, t0 + (n + 1) * period_s - time.monotonic()))


async def dtmf_total(http: aiohttp.ClientSession, url: str, route: str) -> int:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'personaplex_dtmf_total{{route="{route}"}}'):
            return int(float(line.split()[-1]))
    return 0


# ---- Telnyx ------------------------------------------------------------------------------------------------------

def telnyx_start(encoding: str = "L16", rate: int = 16000, **params: str) -> dict[str, Any]:
    return {"event": "start", "sequence_number": "1", "stream_id": "st-1", "start": {
        "user_id": "u1", "call_control_id": "v3:cc", "call_session_id": "cs1", "from": "+15550001", "to": "+15550002",
        "tags": [], "client_state": None, "custom_parameters": params,
        "media_format": {"encoding": encoding, "sample_rate": rate, "channels": 1}}}


async def test_telnyx_call(start_server, speech_24k):
    server = await start_server(api_keys=(KEY,))
    audio = caller_audio(speech_24k, 16000)
    chunks = [l16(audio[i:i + 320], big_endian=True) for i in range(0, audio.size - 319, 320)]
    media: list[tuple[float, bytes]] = []
    marks: list[str] = []
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server.ws("/v1/telnyx"))
        assert refused.value.status == 401
        ws = await http.ws_connect(server.ws("/v1/telnyx"), headers={"x-telnyx-streaming-auth-token": KEY})

        async def bridge() -> None:
            """Telnyx's side: play what comes, echo each mark once the audio before it has played."""
            async for msg in ws:
                event = json.loads(msg.data)
                assert event["event"] in ("media", "mark"), event
                if event["event"] == "media":
                    media.append((time.monotonic(), base64.b64decode(event["media"]["payload"])))
                else:
                    marks.append(event["mark"]["name"])
                    await ws.send_json({"event": "mark", "sequence_number": "9", "stream_id": "st-1",
                                        "mark": {"name": event["mark"]["name"]}})

        task = asyncio.ensure_future(bridge())
        await ws.send_json({"event": "connected", "version": "1.0.0"})
        await ws.send_json(telnyx_start(persona="You answer the phone for a bakery.", seed="3"))
        # Out of order within pairs, as Telnyx may deliver them: the server puts them back by `chunk`.
        order = [n + 1 if n % 2 == 0 else n - 1 for n in range(len(chunks) - len(chunks) % 2)]

        async def send(n: int, index: int) -> None:
            await ws.send_json({"event": "media", "sequence_number": str(index + 2), "stream_id": "st-1", "media": {
                "track": "inbound", "chunk": str(index + 1), "timestamp": str(index * 20),
                "payload": b64(chunks[index])}})
            if n == 40:
                await ws.send_json({"event": "dtmf", "stream_id": "st-1", "dtmf": {"digit": "7"}})

        await send_paced(order, send)
        deadline = time.monotonic() + 20
        while not marks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        underruns = line_underruns(server)
        await ws.send_json({"event": "stop", "sequence_number": "999", "stream_id": "st-1", "stop": {}})
        await asyncio.wait_for(task, 5)
        assert ws.close_code == 1000
        await wait_in_use(http, server.url, 0)
        assert await dtmf_total(http, server.url, "/v1/telnyx") == 1
    assert {len(p) for _, p in media} == {640}                     # 20 ms of L16 at 16 kHz
    assert rms_l16(b"".join(p for _, p in media), big_endian=True) > 1e-4
    assert_paced([t for t, _ in media], 0.02, underruns)
    assert marks and marks[0] == "audio-1"


async def test_telnyx_bad_inputs(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/telnyx")) as ws:
        await ws.send_json({"event": "media", "media": {"payload": b64(b"\0" * 320)}})
        await expect_error(ws, "session_not_created")
        await ws.send_json(telnyx_start("G722", 16000))
        await expect_error(ws, "unsupported_audio_format")
        await ws.send_json({"event": "ring"})
        await expect_error(ws, "unknown_event")
        await ws.send_json(telnyx_start("PCMU", 8000))
        await ws.send_json({"event": "media", "media": {"chunk": "1", "payload": "not base64!"}})
        await expect_error(ws, "bad_audio")
        await ws.send_json({"event": "dtmf", "dtmf": {}})
        await expect_error(ws, "bad_event")
        await ws.send_json({"event": "media", "media": {"chunk": "2", "payload": b64(b"\xff" * 160)}})
        await ws.send_json({"event": "stop"})
        code, _ = await closed_with(ws)
        assert code == 1000


# ---- Vonage ------------------------------------------------------------------------------------------------------

async def test_vonage_call(start_server, speech_24k):
    server = await start_server(api_keys=(KEY,))
    audio = caller_audio(speech_24k, 16000)
    chunks = [l16(audio[i:i + 320]) for i in range(0, audio.size - 319, 320)]
    frames: list[tuple[float, bytes]] = []
    notified: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.ws(f"/v1/vonage?api_key={KEY}"))

        async def vonage() -> None:
            """Vonage's side: play the binary audio, answer each notify once what came before it has played."""
            async for msg in ws:
                if msg.type is aiohttp.WSMsgType.BINARY:
                    frames.append((time.monotonic(), msg.data))
                    continue
                event = json.loads(msg.data)
                assert event.get("action") == "notify", event
                notified.append(event["payload"])
                await ws.send_json({"event": "websocket:notify", "payload": event["payload"]})

        task = asyncio.ensure_future(vonage())
        await ws.send_json({"event": "websocket:connected", "content-type": "audio/l16;rate=16000",
                            "persona": "You answer the phone for a bakery.", "seed": "3"})

        async def send(n: int, chunk: bytes) -> None:
            await ws.send_bytes(chunk)
            if n == 40:
                await ws.send_json({"event": "websocket:dtmf", "digit": "5", "duration": 260})

        await send_paced(chunks, send)
        deadline = time.monotonic() + 20
        while not notified and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        underruns = line_underruns(server)
        await ws.close()                                   # the caller hangs up: Vonage closes the socket
        await asyncio.wait_for(task, 5)
        await wait_in_use(http, server.url, 0, timeout=1.0)
        assert await dtmf_total(http, server.url, "/v1/vonage") == 1
    assert {len(f) for _, f in frames} == {640}                   # exactly 20 ms at 16 kHz, as Vonage requires
    assert rms_l16(b"".join(f for _, f in frames)) > 1e-4
    assert_paced([t for t, _ in frames], 0.02, underruns)
    assert notified and notified[0] == {"audio_s": 1}


async def test_vonage_bad_inputs(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/vonage")) as ws:
        await ws.send_bytes(b"\0" * 640)
        await expect_error(ws, "session_not_created")
        await ws.send_json({"event": "websocket:connected", "content-type": "audio/l16;rate=44100"})
        await expect_error(ws, "unsupported_audio_format")
        await ws.send_json({"event": "websocket:connected", "content-type": "audio/l16;rate=8000"})
        await ws.send_bytes(b"\0" * 321)
        await expect_error(ws, "bad_audio")
        await ws.send_json({"event": "websocket:dtmf"})
        await expect_error(ws, "bad_event")
        await ws.send_bytes(b"\0" * 320)
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.BINARY and len(msg.data) == 320   # 20 ms at 8 kHz


# ---- FreeSWITCH --------------------------------------------------------------------------------------------------

async def test_freeswitch_call(start_server, speech_24k):
    server = await start_server(api_keys=(KEY,))
    audio = caller_audio(speech_24k, 8000)
    chunks = [l16(audio[i:i + 160]) for i in range(0, audio.size - 159, 160)]
    played: list[tuple[float, dict[str, Any]]] = []
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.ws("/v1/freeswitch?rate=8000"),
                                   headers={"Authorization": f"Bearer {KEY}"})   # via STREAM_EXTRA_HEADERS

        async def freeswitch() -> None:
            async for msg in ws:
                event = json.loads(msg.data)
                assert event["type"] == "streamAudio", event
                played.append((time.monotonic(), event["data"]))

        task = asyncio.ensure_future(freeswitch())
        await ws.send_str(json.dumps({"persona": "You answer the phone for a bakery.", "seed": 3}))   # metadata

        async def send(n: int, chunk: bytes) -> None:
            await ws.send_bytes(chunk)
            if n == 40:
                await ws.send_json({"type": "dtmf", "digit": "#"})   # relayed by the dialplan with send_text

        await send_paced(chunks, send)
        underruns = line_underruns(server)
        await ws.close()                                              # `uuid_audio_stream <uuid> stop`
        await asyncio.wait_for(task, 5)
        await wait_in_use(http, server.url, 0, timeout=1.0)
        assert await dtmf_total(http, server.url, "/v1/freeswitch") == 1
    assert played and {d["audioDataType"] for _, d in played} == {"raw"}
    assert {d["sampleRate"] for _, d in played} == {8000}
    pcm = [base64.b64decode(d["audioData"]) for _, d in played]
    assert {len(p) for p in pcm} == {1600}                          # 100 ms of L16 at 8 kHz
    assert rms_l16(b"".join(pcm)) > 1e-4
    assert_paced([t for t, _ in played], 0.1, underruns)


async def test_freeswitch_bad_inputs(server):
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.ws("/v1/freeswitch?rate=11025")) as ws:
            await expect_error(ws, "unsupported_audio_format")
            code, _ = await closed_with(ws)
            assert code == 1008
        async with http.ws_connect(server.ws("/v1/freeswitch?rate=16000")) as ws:
            await ws.send_str("{not json")
            await expect_error(ws, "invalid_json")
            await ws.send_bytes(b"\0" * 640)                           # no metadata: the call starts with audio
            await ws.send_bytes(b"\0" * 641)
            await expect_error(ws, "bad_audio")
            await ws.send_json({"type": "ping"})
            await expect_error(ws, "unknown_event")
            await ws.send_bytes(b"\0" * 640)
            event = await next_event(ws)
            while event["type"] != "streamAudio":
                assert event["type"] != "error", event
                event = await next_event(ws)
            assert event["data"]["sampleRate"] == 16000


# ---- Asterisk AudioSocket ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def audiosocket_server(start_server, **overrides):
    """A server listening for AudioSocket on a free port, and that port."""
    server = await start_on_free_ports(start_server, lambda: {"audiosocket_port": free_port()}, **overrides)
    return server, server.ctx.settings.audiosocket_port


def frame(kind: int, payload: bytes = b"") -> bytes:
    return bytes((kind,)) + len(payload).to_bytes(2, "big") + payload


async def read_frame(reader: asyncio.StreamReader, timeout: float = 10.0) -> tuple[int, bytes]:
    header = await asyncio.wait_for(reader.readexactly(3), timeout)
    return header[0], await reader.readexactly(int.from_bytes(header[1:], "big"))


async def test_audiosocket_call(start_server, speech_24k):
    server, port = await audiosocket_server(start_server)
    audio = caller_audio(speech_24k, 8000)
    chunks = [l16(audio[i:i + 160]) for i in range(0, audio.size - 159, 160)]
    heard: list[tuple[float, int, bytes]] = []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(0x01, uuid.uuid4().bytes))

    async def asterisk() -> None:
        while True:
            try:
                kind, payload = await read_frame(reader)
            except asyncio.IncompleteReadError:
                return
            heard.append((time.monotonic(), kind, payload))

    task = asyncio.ensure_future(asterisk())

    async def send(n: int, chunk: bytes) -> None:
        writer.write(frame(0x10, chunk))
        if n == 40:
            writer.write(frame(0x03, b"9"))
        await writer.drain()

    await send_paced(chunks, send)
    async with aiohttp.ClientSession() as http:
        assert await dtmf_total(http, server.url, "audiosocket") == 1
        underruns = line_underruns(server)
        writer.write(frame(0x00))                                    # hang up
        await writer.drain()
        await asyncio.wait_for(task, 5)                               # the server closes its side
        await wait_in_use(http, server.url, 0, timeout=1.0)
    writer.close()
    audio_frames = [(t, p) for t, k, p in heard if k == 0x10]
    assert audio_frames and {len(p) for _, p in audio_frames} == {320}   # 20 ms of slin at 8 kHz
    assert rms_l16(b"".join(p for _, p in audio_frames)) > 1e-4
    assert_paced([t for t, _ in audio_frames], 0.02, underruns)
    assert {k for _, k, _ in heard} <= {0x10, 0x00}


async def _hung_up(reader: asyncio.StreamReader) -> bool:
    """The server's answer to a refused or malformed call: a hang-up frame, then the end of the stream."""
    kind, payload = await read_frame(reader)
    while kind == 0x10:
        kind, payload = await read_frame(reader)
    return kind == 0x00 and payload == b"" and await asyncio.wait_for(reader.read(), 5) == b""


@pytest.mark.parametrize("first", [frame(0x10, b"\0" * 320), frame(0x01, b"short")])
async def test_audiosocket_malformed_first_frame_hangs_up(start_server, first):
    _, port = await audiosocket_server(start_server)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(first)
    assert await _hung_up(reader)
    writer.close()


@pytest.mark.parametrize("bad", [frame(0x42, b"x"), frame(0x10), frame(0x10, b"\0" * 321), frame(0x18, b"\0" * 8)])
async def test_audiosocket_malformed_frame_hangs_up_and_frees_the_slot(start_server, bad):
    server, port = await audiosocket_server(start_server)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame(0x01, uuid.uuid4().bytes) + frame(0x10, b"\0" * 320) + bad)
    assert await _hung_up(reader)
    writer.close()
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, server.url, 0, timeout=1.0)


async def test_audiosocket_that_never_reads_is_dropped_with_frames_only(start_server):
    """Asterisk stops reading: the output bound ends the call and frees the slot, and nothing but frames was ever
    written, the hang-up last (the output-backpressure error is an event, which this transport has no way to
    carry)."""
    server, port = await audiosocket_server(start_server, max_output_bytes=4096, max_output_backlog_s=1.0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(frame(0x01, uuid.uuid4().bytes) + frame(0x10, b"\0" * 320))
    writer.transport.pause_reading()                                  # it never reads again
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, server.url, 1, timeout=10)
        await wait_in_use(http, server.url, 0, timeout=60)
        async with http.get(server.url + "/metrics") as r:
            assert 'personaplex_errors_total{code="output_backpressure"} 1' in await r.text()
    writer.transport.resume_reading()
    data = await asyncio.wait_for(reader.read(), 10)                 # everything, up to the server's close
    assert data[-3:] == b"\x00\x00\x00"                              # the door's hang-up, last
    at = 0
    while at < len(data) - 3:                                        # before it whole frames, each 20 ms of audio
        kind, size = data[at], int.from_bytes(data[at + 1:at + 3], "big")
        assert kind == 0x10 and size == 320 and at + 3 + size <= len(data), (at, len(data), data[at:at + 40])
        at += 3 + size
    writer.close()


# ---- a full server -----------------------------------------------------------------------------------------------

async def test_full_server_refuses_every_bridge(start_server):
    server, port = await audiosocket_server(start_server, max_sessions=1)
    async with aiohttp.ClientSession() as http:
        first = await http.ws_connect(server.ws("/v1/vonage"))
        await first.send_json({"event": "websocket:connected", "content-type": "audio/l16;rate=8000"})
        await first.send_bytes(b"\0" * 320)
        msg = await first.receive(timeout=10)                          # the first outbound audio: the call is live
        assert msg.type is aiohttp.WSMsgType.BINARY
        for path, opening in (("/v1/telnyx", telnyx_start("PCMU", 8000)),
                              ("/v1/freeswitch", {"persona": "x"}),
                              ("/v1/vonage", {"event": "websocket:connected", "content-type": "audio/l16;rate=8000"})):
            ws = await http.ws_connect(server.ws(path))
            await ws.send_json(opening)
            await expect_error(ws, "resource_exhausted")
            code, _ = await closed_with(ws)
            assert code == 1013, path
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(frame(0x01, uuid.uuid4().bytes))
        assert await _hung_up(reader)
        writer.close()
        await first.close()
        await wait_in_use(http, server.url, 0, timeout=1.0)
        async with http.get(server.url + "/metrics") as r:
            text = await r.text()
        assert 'personaplex_rejections_total{code="resource_exhausted",route="audiosocket"} 1' in text
