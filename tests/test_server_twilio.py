"""`/v1/twilio` against a fake Twilio that behaves as Twilio documents (tests/twilio_fake.py: paced 20 ms μ-law media,
the server's marks echoed once played, dtmf, stop), and the G.711 round trip through the server's per-session
converters."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
from server_support import b64, closed_with, eventually, expect_error, next_event
from twilio_fake import ULAW, FakeTwilio, start_event

from app.sessions.audio import InputDecoder, OutputEncoder
from media.codecs import AudioFormat
from media.resample import Resampler


async def test_realtime_a_call_as_twilio_speaks(server, speech_24k):
    """Real time: against a fake Twilio that plays what it gets at real time and echoes only our marks. The media it
    gets is paced on the wall clock (checked with room for a loaded machine); a mark follows each engine frame's
    audio; the server learns from the echoes how much the caller heard; a mark the client sends is not echoed."""
    caller = Resampler(24000, 8000).process(np.tile(speech_24k, 2)[: 24000 * 2])
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        twilio = FakeTwilio(ws, "MZ42")
        await twilio.start(persona="You answer the phone for a bakery.", voice="NATM1", seed="5",
                           text_temperature="0.6")
        arrivals: list[float] = []
        count = 0

        async def watch() -> None:
            nonlocal count
            while not twilio.closed.is_set():
                if len(twilio.received) > count:
                    arrivals.extend([time.monotonic()] * (len(twilio.received) - count))
                    count = len(twilio.received)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        await ws.send_json({"event": "mark", "streamSid": "MZ42", "mark": {"name": "mine"}})
        await ws.send_json({"event": "dtmf", "streamSid": "MZ42", "dtmf": {"track": "inbound_track", "digit": "5"}})
        await twilio.speak(caller)
        session = next(s.session for s in server.ctx.sockets if s.session.route == "/v1/twilio")
        await eventually(lambda: len(twilio.echoed) >= 10, 10, "Twilio echoes the marks of what it played")
        await asyncio.sleep(0.3)
        heard_s = session.heard_s
        await twilio.stop()
        watcher.cancel()
        twilio.close()
        assert ws.close_code == 1000

    kinds = [e["event"] for e in twilio.events]
    assert "error" not in kinds, twilio.events
    assert set(kinds) == {"mark"}, kinds                               # media and our marks only: no echo of "mine"
    names = [e["mark"]["name"] for e in twilio.events]
    assert names == [f"f{n}" for n in range(1, len(names) + 1)]        # one after each engine frame, in order
    assert all(e["streamSid"] == "MZ42" for e in twilio.events)
    assert {len(p) for p in twilio.received} == {160}
    assert float(np.sqrt(np.mean(ULAW.decode(b"".join(twilio.received)) ** 2))) > 1e-4
    # Paced at real time: one 20 ms chunk per 20 ms of wall clock, never a burst (and, however loaded the machine
    # that runs both ends, at least half of real time).
    span = arrivals[-1] - arrivals[0]
    assert len(arrivals) <= span / 0.02 + 6, (len(arrivals), span)
    assert len(arrivals) >= span / 0.02 * 0.5, (len(arrivals), span)
    # What the server says was heard is what the fake played: its echoes come after the audio they follow.
    echoed_frames = int(twilio.echoed[-1][1:]) if twilio.echoed else 0
    assert heard_s <= echoed_frames * 0.08 + 1e-9
    assert heard_s >= 0.08 * (echoed_frames - 5), (heard_s, echoed_frames)
    assert heard_s <= len(twilio.played) * 0.02 + 0.08, (heard_s, len(twilio.played))


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
