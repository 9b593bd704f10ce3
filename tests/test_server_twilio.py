"""`/v1/twilio` with a local fake Twilio bridge (paced 20 ms μ-law media, marks, clear, dtmf, stop), and the G.711
round trip through the server's per-session converters."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import aiohttp
import numpy as np
import pytest
from server_support import b64, closed_with, expect_error, next_event

from app.audio import InputDecoder, OutputEncoder
from media.codecs import AudioFormat
from media.resample import Resampler

ULAW = AudioFormat("pcmu", 8000)


def start_event(sid: str = "MZ0001", **params: str) -> dict[str, Any]:
    return {"event": "start", "sequenceNumber": "1", "streamSid": sid, "start": {
        "streamSid": sid, "accountSid": "AC1", "callSid": "CA1", "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": params}}


async def test_realtime_fake_bridge_call(server, speech_24k):
    """Real time: the media it sends back is paced on the wall clock (checked with room for a loaded machine)."""
    caller = ULAW.encode(Resampler(24000, 8000).process(np.tile(speech_24k, 2)[: 24000 * 2]))
    sid = "MZ42"
    received: list[tuple[float, dict[str, Any]]] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:

        async def reader() -> None:
            while True:
                msg = await ws.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    return
                received.append((time.monotonic(), msg.json()))

        task = asyncio.ensure_future(reader())
        await ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await ws.send_json(start_event(sid, persona="You answer the phone for a bakery.", voice="NATM1",
                                       seed="5", text_temperature="0.6"))
        t0 = time.monotonic()
        chunks = [caller[i:i + 160] for i in range(0, len(caller), 160)]
        mark_sent_at = None
        for n, chunk in enumerate(chunks):
            await ws.send_json({"event": "media", "sequenceNumber": str(n + 2), "streamSid": sid,
                                "media": {"track": "inbound", "chunk": str(n + 1), "timestamp": str(n * 20),
                                          "payload": b64(chunk)}})
            if n == 60:
                await ws.send_json({"event": "mark", "streamSid": sid, "mark": {"name": "greeting"}})
                await ws.send_json({"event": "dtmf", "streamSid": sid, "dtmf": {"track": "inbound_track",
                                                                                "digit": "5"}})
                mark_sent_at = len(received)
            await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.02 - time.monotonic()))
        await ws.send_json({"event": "mark", "streamSid": sid, "mark": {"name": "before-clear"}})
        await ws.send_json({"event": "clear", "streamSid": sid})
        await asyncio.sleep(0.3)
        await ws.send_json({"event": "stop", "streamSid": sid, "stop": {"accountSid": "AC1", "callSid": "CA1"}})
        await asyncio.wait_for(task, 5)
        assert ws.close_code == 1000

    events = [e for _, e in received]
    assert not [e for e in events if e.get("type") == "error"], events
    media = [(t, e) for t, e in received if e["event"] == "media"]
    assert media and all(e["streamSid"] == sid for _, e in media)
    payloads = [base64.b64decode(e["media"]["payload"]) for _, e in media]
    assert {len(p) for p in payloads} == {160}
    audio = ULAW.decode(b"".join(payloads))
    assert float(np.sqrt(np.mean(audio ** 2))) > 1e-4
    # Paced at real time: one 20 ms chunk per 20 ms of wall clock, never a burst (and, however loaded the machine
    # that runs both ends, at least half of real time).
    span = media[-1][0] - media[0][0]
    assert len(media) <= span / 0.02 + 6, (len(media), span)
    assert len(media) >= span / 0.02 * 0.5, (len(media), span)
    marks = [e["mark"]["name"] for e in events if e["event"] == "mark"]
    assert marks == ["greeting", "before-clear"]
    greeting_at = next(i for i, e in enumerate(events) if e["event"] == "mark")
    assert mark_sent_at is not None and greeting_at >= mark_sent_at
    assert all(e["streamSid"] == sid for e in events if e["event"] == "mark")


async def test_twilio_bad_inputs(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        await ws.send_json({"event": "media", "media": {"payload": b64(b"\xff" * 160)}})
        await expect_error(ws, "session_not_created")
        bad = start_event()
        bad["start"]["mediaFormat"] = {"encoding": "audio/x-alaw", "sampleRate": 8000, "channels": 1}
        await ws.send_json(bad)
        await expect_error(ws, "unsupported_audio_format")
        await ws.send_json(start_event(voice="nobody"))
        await expect_error(ws, "invalid_voice")
        await ws.send_json({"event": "ring"})
        await expect_error(ws, "unknown_event")
        await ws.send_json({"event": "start", "start": {}})
        await expect_error(ws, "bad_event")
        await ws.send_json(start_event())
        await ws.send_json({"event": "media", "media": {"payload": "!!"}})
        await expect_error(ws, "bad_audio")
        await ws.send_json({"event": "mark", "mark": {}})
        await expect_error(ws, "bad_event")
        await ws.send_json(start_event())
        await expect_error(ws, "session_already_created")
        await ws.send_json({"event": "media", "media": {"payload": b64(b"\xff" * 160)}})
        msg = await next_event(ws)
        while msg.get("event") != "media":
            assert msg.get("type") != "error", msg
            msg = await next_event(ws)
        await ws.send_json({"event": "stop"})
        code, _ = await closed_with(ws)
        assert code == 1000


async def test_twilio_full_server_refuses_with_1013(start_server):
    server = await start_server(max_sessions=1)
    async with aiohttp.ClientSession() as http:
        first = await http.ws_connect(server.ws("/v1/twilio"))
        await first.send_json(start_event("MZ1"))
        await first.send_json({"event": "media", "media": {"payload": b64(b"\xff" * 160)}})
        await next_event(first)   # the first outbound media: the call is live
        second = await http.ws_connect(server.ws("/v1/twilio"))
        await second.send_json(start_event("MZ2"))
        await expect_error(second, "resource_exhausted")
        code, _ = await closed_with(second)
        assert code == 1013
        await first.close()


@pytest.mark.parametrize("encoding", ["pcmu", "pcma"])
def test_g711_round_trip_through_session_converters(encoding):
    """24 kHz model audio -> G.711 8 kHz on the wire -> back to 24 kHz: within the codec's (and band's) error."""
    t = np.arange(24000) / 24000
    tone = (0.4 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)).astype(np.float32)
    out, back = OutputEncoder(AudioFormat(encoding, 8000)), InputDecoder(AudioFormat(encoding, 8000))
    wire = b"".join(out.encode(tone[i:i + 1920]) for i in range(0, tone.size, 1920))
    assert 7950 <= len(wire) <= 8000   # swr holds a few ms back until the stream ends
    decoded = np.concatenate([back.decode(wire[i:i + 160]) for i in range(0, len(wire), 160)])
    lag = int(np.argmax(np.correlate(decoded[2400:4800], tone[2400:4800], mode="full"))) - 2399
    a = tone[4800:20000]
    b = decoded[4800 + lag:20000 + lag]
    snr = 10 * np.log10(np.sum(a ** 2) / np.sum((a - b) ** 2))
    assert snr > 25, snr   # G.711 alone gives ~35-38 dB on such a tone; two resamplers cost a little more
