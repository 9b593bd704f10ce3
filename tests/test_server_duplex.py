"""`/v1/duplex`, the native dialect: binary audio both ways, or JSON, over a real WebSocket client."""

from __future__ import annotations

import base64

import aiohttp
import numpy as np
from server_support import b64, closed_with, encode, expect_error, next_event, until

from media.codecs import AudioFormat
from media.resample import Resampler


async def test_binary_frames_both_ways(server, speech_24k):
    frames = 10
    wire = Resampler(24000, 16000).process(speech_24k[: (frames + 1) * 1920])
    pcm = encode(wire, "pcm16", 16000)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/duplex")) as ws:
        await ws.send_json({"type": "session.create", "session": {
            "persona": "You are a helpful clerk.", "voice": "NATM1", "pacing": "input",
            "sampling": {"greedy": True}, "input": {"format": "pcm16", "rate": 16000},
            "output": {"format": "pcm16", "rate": 24000}}})
        created = await next_event(ws)
        assert created["type"] == "session.created"
        s = created["session"]
        assert s["id"].startswith("duplex_") and s["voice"] == "NATM1" and s["sampling"]["greedy"] is True
        assert s["input"] == {"format": "pcm16", "rate": 16000, "frame_bytes": 2560}
        assert s["output"] == {"format": "pcm16", "rate": 24000, "frame_bytes": 3840, "transport": "binary"}
        assert s["capabilities"]["chunk_period_ms"] == 80
        for i in range(0, len(pcm), 1000):           # odd-sized chunks (whole samples)
            await ws.send_bytes(pcm[i:i + 1000])
        audio: list[bytes] = []
        texts: list[dict] = []
        while len(audio) < frames:
            msg = await ws.receive(timeout=20)
            if msg.type is aiohttp.WSMsgType.BINARY:
                audio.append(msg.data)
            else:
                event = msg.json()
                assert event["type"] == "response.output_text.delta", event
                texts.append(event)
        assert {len(a) for a in audio} == {3840}
        samples = AudioFormat("pcm16", 24000).decode(b"".join(audio))
        assert float(np.sqrt(np.mean(samples ** 2))) > 1e-4
        assert texts and all(0 <= t["frame"] < frames + 1 and t["delta"] for t in texts)
        assert [t["frame"] for t in texts] == sorted(t["frame"] for t in texts)
        await ws.send_json({"type": "session.close"})
        code, seen = await closed_with(ws)
        closed = next(e for e in seen if e.get("type") == "session.closed")
        assert code == 1000 and closed["reason"] == "client_close"
        stats = closed["stats"]
        # The first frame comes with the start, so `frames` outputs may have taken only frames - 1 inputs.
        assert stats["frames_in"] >= frames - 1 and stats["frames_out"] >= frames and stats["frames_sent"] >= frames
        assert stats["input_ms"] > 0


async def test_json_audio_both_ways_and_restart(server, speech_24k):
    f32 = encode(speech_24k[: 7 * 1920], "f32", 24000)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/duplex")) as ws:
        await ws.send_json({"type": "session.create", "session": {
            "pacing": "input", "input": {"format": "pcm_f32le", "rate": 24000},
            "output": {"format": "g711_ulaw"}, "output_transport": "json"}})
        created = await until(ws, "session.created")
        assert created["session"]["output"]["format"] == "pcmu" and created["session"]["output"]["rate"] == 8000
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(f32[: 4 * 7680])})
        deltas = []
        while len(deltas) < 4:
            event = await next_event(ws)
            if event["type"] == "response.output_audio.delta":
                deltas.append(event)
        assert [d["frame"] for d in deltas] == [0, 1, 2, 3]
        assert all(abs(len(base64.b64decode(d["audio"])) - 640) <= 20 for d in deltas)
        await ws.send_json({"type": "conversation.restart"})
        restarted = await until(ws, "conversation.restarted")
        assert restarted["epoch"] == 1
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(f32[4 * 7680:])})
        event = await until(ws, "response.output_audio.delta")
        assert event["frame"] == 0


async def test_native_bad_inputs(server, speech_24k):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/duplex")) as ws:
        await ws.send_bytes(b"\0\0")
        await expect_error(ws, "session_not_created")
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(b"\0\0")})
        await expect_error(ws, "session_not_created")
        await ws.send_json({"type": "session.create", "session": {"input": {"format": "opus"}}})
        await expect_error(ws, "unsupported_audio_format")
        await ws.send_json({"type": "session.create", "session": {"voice": "nobody"}})
        await expect_error(ws, "invalid_voice")
        await ws.send_json({"type": "session.create", "session": {"output_transport": "carrier-pigeon"}})
        await expect_error(ws, "invalid_session_config")
        await ws.send_json({"type": "session.create", "session": {"pacing": "input"}})
        await until(ws, "session.created")
        await ws.send_json({"type": "session.create", "session": {}})
        await expect_error(ws, "session_already_created")
        await ws.send_bytes(b"\0\0\0")                 # PCM16 needs whole 2-byte samples
        await expect_error(ws, "bad_audio")
        await ws.send_json({"type": "input_audio_buffer.append", "audio": "%%%"})
        await expect_error(ws, "bad_audio")
        await ws.send_json({"type": "what.now"})
        await expect_error(ws, "unknown_event")
        await ws.send_bytes(encode(speech_24k[:1920 * 2], "pcm16", 24000))   # still fine afterwards
        msg = await ws.receive(timeout=10)
        while msg.type is not aiohttp.WSMsgType.BINARY:
            msg = await ws.receive(timeout=10)
        assert len(msg.data) == 3840
