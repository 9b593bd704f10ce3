"""Call recordings (`--record-dir`): a Twilio call, a SIP call (a real baresip phone) and a WebRTC call (an aiortc
peer) are each recorded, and each file decodes to two channels at the rate call.json states, lasts the call's
frames within one frame, and its agent channel is the audio the client received (the same sound at a lag that holds,
but for the silence the door sent where the engine fell behind real time, which the call's record counts: both went
through lossy codecs, Opus in the file and the line's codec on the way to the client, and the waveforms still
correlate). A disk that refuses ends the recording, never the call. What the live-call
list says of a recorded call, and the admin API's cut, are checked on the way."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
from conftest import babble
from server_support import eventually, wait_in_use
from twilio_fake import ULAW, FakeTwilio
from webrtc_support import ensure_ice_host_address

from app.doors.sip import SIP
from app.doors.webrtc.client import RealtimeCall
from media.resample import Resampler
from tests.sip_support import BARESIP, baresip_call, read_wav, start_sip_server

ADMIN = "admin-key-for-tests"


def decode(path: Path) -> tuple[np.ndarray, int]:
    """(samples [channels, n], rate) of a recording, as any Ogg Opus reader (FFmpeg here) gives them."""
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        return np.concatenate(frames, axis=1), stream.rate


async def finished(root: Path) -> tuple[Path, dict[str, Any]]:
    """The one call folder under `root` once its call.json is final (it says how the call ended)."""
    def final() -> tuple[Path, dict[str, Any]] | None:
        for facts in root.rglob("call.json"):
            found = json.loads(facts.read_text())
            if found.get("end_reason") and found.get("recording"):
                return facts.parent, found
        return None
    return await eventually(final, 15, "a finished recording")


PIECE_S = 0.4  # short enough that most pieces miss every fill and cut
MATCH = 0.4  # a piece's correlation where it was found (clean: 0.85 over a phone line, 0.6-0.65 through Opus)


def best_match(piece: np.ndarray, received: np.ndarray, rate: int, earliest_s: float, latest_s: float
               ) -> tuple[float, float]:
    """Where in `received` between `earliest_s` and `latest_s` the audio `piece` starts (seconds), and the waveforms'
    correlation there."""
    n = 1 << int(np.ceil(np.log2(piece.size + received.size)))
    cross = np.fft.irfft(np.fft.rfft(received, n) * np.conj(np.fft.rfft(piece, n)), n)
    lo = min(max(0, int(earliest_s * rate)), received.size - 1)
    at = lo + int(np.argmax(cross[lo:max(lo + 1, min(received.size, int(latest_s * rate) + 1))]))
    b = received[at:at + piece.size]
    a = piece[: b.size]
    return at / rate, float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b) + 1e-12))


FILL_WINDOW_S = 0.005  # a line's packets are 20 ms: a fill is whole windows of this size from the audio's start


def without_fills(audio: np.ndarray, rate: int) -> np.ndarray:
    """`audio` less the fills a line sends where the engine has no frame ready: its windows of FILL_WINDOW_S whose
    peak is under a quarter of the loud windows' (the 90th percentile). A phone line's fill is the u-law silence code
    (6.1e-05 decoded), Opus's decodes to zeros after a ringing tail of ~40 ms that falls from ~0.05; the tiny model's
    sound peaks at ~0.22 in a window and never under 0.13. Where the engine runs far behind real time (the tiny model
    on a loaded 2-core machine: 2.1 s of fill in a 4 s call) fills fall inside most pieces; taken out, what is left
    is the model's sound end to end, as the recording holds it."""
    size = int(FILL_WINDOW_S * rate)
    windows = audio[: audio.size // size * size].reshape(-1, size)
    if windows.size == 0:
        return audio
    peaks = np.abs(windows).max(axis=1)
    return windows[peaks >= 0.25 * np.percentile(peaks, 90)].reshape(-1)


def assert_same_sound(recorded_24k: np.ndarray, received: np.ndarray, rate: int, band_rate: int,
                      filled_s: float = 0.0, cut_s: float = 0.0) -> None:
    """`received` (at `rate`) is `recorded_24k`, later by a lag that holds (within a client's jitter-buffer
    adjustments, and the `filled_s` of silence a line sent where the engine fell behind real time, which moves
    what follows, and the `cut_s` of sound an input buffer cut to catch up, which moves it earlier), compared at
    `band_rate`, the band both kept (a line's `received` sound comes through `without_fills`, so its fills move
    little; `filled_s` still widens where a piece is looked for, as a client's player may fill its own way).

    The recording in pieces of PIECE_S, each first looked for from 0.5 s before its place to 1.5 s after (with the
    fills out, a line that does not play the model's frame 0, as SIP's and WebRTC's do not (FIRST_PLAYED_FRAME in
    media/pacing.py), starts 80 ms early). The piece found surest sets the lag; from it outward, each piece is
    looked for at its neighbour's lag give or take those moves, and the lag moves no more than they say in all (and
    0.2 s of the input buffer's own adjustments). A piece across a fill or a cut lies in two places and matches
    neither well: a quarter of the pieces may miss, and one more for each 0.2 s the line filled or cut (on a loaded
    machine, where the engine falls behind real time, most of them)."""
    a = Resampler(24000, band_rate).process(recorded_24k.astype(np.float32))
    b = Resampler(rate, band_rate).process(received.astype(np.float32)) if rate != band_rate else received
    size = int(PIECE_S * band_rate)
    places = [start / band_rate for start in range(0, a.size - size + 1, size)]

    def find(t: float, earliest: float, latest: float) -> tuple[float, float]:
        start = int(round(t * band_rate))
        at, similar = best_match(a[start:start + size], b, band_rate, earliest, latest)
        return at - t, similar

    # Only pieces that `received` could hold whole: it may end before the recording does (the call ended first).
    places = [t for t in places if (t - 0.5) * band_rate + size <= b.size]
    assert places, (a.size, b.size)
    wide = [find(t, t - 0.5, t + 1.5 + filled_s) for t in places]
    anchor = max(range(len(wide)), key=lambda i: wide[i][1])
    found = {anchor: wide[anchor]}
    for outward in (range(anchor + 1, len(places)), range(anchor - 1, -1, -1)):
        lag, later = wide[anchor][0], outward.step > 0
        for i in outward:
            t = places[i]
            earliest = t + lag - 0.1 - (cut_s if later else filled_s)
            if earliest * band_rate + size > b.size:
                break
            found[i] = find(t, earliest, t + lag + 0.1 + (filled_s if later else cut_s))
            if found[i][1] > MATCH:
                lag = found[i][0]
    pieces = [(round(places[i], 2), round(found[i][0], 4), round(found[i][1], 3)) for i in sorted(found)]
    lags = [piece_lag for _, piece_lag, similar in pieces if similar > MATCH]
    found_at = (pieces, filled_s, cut_s)
    # A fill or a cut of the usual 80-200 ms spoils about one piece: the fewer of them, the more pieces must match.
    assert lags and len(pieces) - len(lags) <= 0.25 * len(pieces) + (filled_s + cut_s) / 0.2, found_at
    assert -0.2 - cut_s <= lags[-1] - lags[0] <= 0.2 + filled_s, found_at


def filled(facts: dict[str, Any]) -> float:
    """Seconds of silence the door sent where the engine fell behind real time (a loaded machine: 46 frames in a 4 s
    call): the model's later audio reached the caller that much later. The call's record says (`out_silence_ms`)."""
    return facts["stats"]["out_silence_ms"] / 1000.0


def check_file(folder: Path, facts: dict[str, Any]) -> np.ndarray:
    """The checks every recorded call passes; the agent channel at 24 kHz."""
    assert {p.name for p in folder.iterdir()} == {"audio.ogg", "transcript.jsonl", "call.json"}
    audio, rate = decode(folder / "audio.ogg")
    rec = facts["recording"]
    assert audio.shape[0] == 2 and rec["channels"] == 2 and rec["channel_layout"] == ["caller", "agent"]
    assert rate == rec["sample_rate"]
    duration = audio.shape[1] / rate
    assert abs(duration - rec["frames"] * 0.08) < 1e-6, (duration, rec)
    assert abs(duration - facts["stats"]["frames_out"] * 0.08) <= 0.08 + 1e-6, (duration, facts["stats"])
    assert rec["error"] is None and rec["dropped_frames"] == 0
    lines = [json.loads(line) for line in (folder / "transcript.jsonl").read_text().splitlines()]
    texts = [line for line in lines if "text" in line]
    assert texts and all(0 <= line["t"] < duration and line["t"] == round(line["frame"] * 0.08, 2) for line in texts)
    return Resampler(rate, 24000).process(audio[1].astype(np.float32))


async def admin_calls(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with http.get(url + "/v1/calls", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["data"]


async def test_a_twilio_call_is_recorded(start_server, speech_24k, tmp_path):
    root = tmp_path / "rec"
    server = await start_server(record_dir=root, admin_key=ADMIN)
    # Three seconds that never repeat, so that each piece of it is found in one place of the recording.
    caller = Resampler(24000, 8000).process(np.concatenate([speech_24k, babble(3.0, seed=1)])[: 24000 * 3])
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        twilio = FakeTwilio(ws, "MZ7")
        await twilio.start(call_sid="CA7", persona="You answer the phone for a bakery.", order="42")
        await twilio.speak(caller)
        [listed] = await admin_calls(http, server.url)
        await twilio.stop()
        twilio.close()
    folder, facts = await finished(root)
    assert listed["recording"]["audio"] == str(folder / "audio.ogg")
    assert facts["door"] == "/v1/twilio" and facts["codec"] == "pcmu/8000" and facts["end_reason"] == "stop"
    assert facts["caller"]["call_sid"] == "CA7" and facts["caller"]["custom_parameters"]["order"] == "42"
    assert facts["agent"]["persona"] == "You answer the phone for a bakery."
    assert facts["stats"]["heard_s"] > 0 and facts["ended_at"] > facts["started_at"]
    # The caller's link as the input buffer saw it, live and in call.json: a clean loopback line, nothing lost.
    for link in (listed["stats"]["input"], facts["stats"]["input"]):
        assert link["added_ms"]["p50"] >= 0 and link["jitter_ms"] >= 0 and link["target_ms"] >= 80
        assert link["concealed_ms"] == 0 and link["hard_cuts"] == 0
    agent = check_file(folder, facts)
    assert_same_sound(agent, without_fills(ULAW.decode(b"".join(twilio.received)), 8000), 8000, 8000, filled(facts))
    caller_channel = decode(folder / "audio.ogg")[0][0]         # the left channel is what the model heard
    heard = facts["stats"]["input"]               # what the input buffer concealed and cut, as the record says
    assert_same_sound(Resampler(8000, 24000).process(ULAW.decode(ULAW.encode(caller))), caller_channel, 48000, 8000,
                      heard["concealed_ms"] / 1000.0, heard["overrun_drops_ms"] / 1000.0)
    async with aiohttp.ClientSession() as http, http.get(server.url + "/metrics") as r:
        text = await r.text()
    assert 'personaplex_recordings_total{result="written"} 1' in text
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert f"personaplex_recording_bytes_total {size}" in text


@pytest.mark.skipif(BARESIP is None, reason="baresip is not installed (apt-get install baresip-core)")
async def test_a_sip_call_is_recorded(start_server, tmp_path):
    root = tmp_path / "rec"
    server = await start_sip_server(start_server, record_dir=root)
    uri = f"sip:agent@127.0.0.1:{server.app[SIP].port}"
    result = await baresip_call(tmp_path / "phone", uri, seconds=4, codec="PCMU/8000/1")
    assert result.returncode == 0 and result.heard is not None, result.log[-2000:]
    folder, facts = await finished(root)
    assert facts["door"] == "sip" and facts["codec"] == "PCMU/8000" and facts["end_reason"] == "bye"
    assert "sip:caller@127.0.0.1" in facts["caller"]["from"] and "sip:agent@" in facts["caller"]["to"]
    agent = check_file(folder, facts)
    heard, rate, _ = read_wav(result.heard)
    assert_same_sound(agent, without_fills(heard, rate), rate, 8000, filled(facts))


async def test_a_webrtc_call_is_recorded(start_server, speech_24k, tmp_path):
    ensure_ice_host_address()
    root = tmp_path / "rec"
    server = await start_server(record_dir=root, record_policy="opt-in")
    call = RealtimeCall(server.url, speech_24k, session={"instructions": "You are a receptionist.", "record": True})
    await call.connect()
    try:
        await eventually(lambda: len(call.recording.chunks) > 150, 20, "three seconds of the model's audio")
    finally:
        await call.hang_up()
    folder, facts = await finished(root)
    assert facts["door"] == "/v1/realtime/calls" and facts["codec"] == "opus/48000"
    assert facts["end_reason"] == "client_hangup" and facts["agent"]["persona"] == "You are a receptionist."
    agent = check_file(folder, facts)
    assert_same_sound(agent, without_fills(call.recording.audio(), 24000), 24000, 16000, filled(facts))


async def test_policy_and_a_refusing_disk_end_the_recording_never_the_call(start_server, tmp_path):
    """opt-in: a call that does not ask is not recorded; a record folder that cannot be written ends the
    recording (counted), and the call goes on to its own end."""
    blocked = tmp_path / "file-not-folder"
    server = await start_server(record_dir=tmp_path / "rec", record_policy="opt-in")
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        twilio = FakeTwilio(ws)
        await twilio.start()
        await twilio.speak(np.zeros(8000, np.float32))
        await twilio.stop()
        twilio.close()
    assert not (tmp_path / "rec").exists()
    blocked.write_text("")
    server = await start_server(record_dir=blocked / "rec")
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/twilio")) as ws:
        twilio = FakeTwilio(ws)
        await twilio.start()
        await twilio.speak(np.zeros(16000, np.float32))
        await eventually(lambda: server.ctx.metrics.recordings["recordings_failed"] == 1, 5, "the failure counted")
        await twilio.speak(np.zeros(8000, np.float32))     # the call goes on
        frames = len(twilio.received)
        await eventually(lambda: len(twilio.received) > frames + 10, 5, "more of the model's audio")
        await twilio.stop()
        twilio.close()
        assert ws.close_code == 1000
        await wait_in_use(http, server.url, 0)
    assert server.ctx.metrics.recordings["recordings_written"] == 0


async def test_the_admin_api_lists_cuts_and_hangs_up_every_door(start_server, speech_24k):
    server = await start_server(admin_key=ADMIN, api_keys=("client-key",), max_sessions=3)
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/v1/calls", headers={"Authorization": "Bearer client-key"}) as r:
            assert r.status == 401                                     # a client key is not the admin key
        ws = await http.ws_connect(server.ws("/v1/twilio?api_key=client-key"))
        twilio = FakeTwilio(ws, "MZ5")
        await twilio.start(call_sid="CA5")
        speaking = asyncio.ensure_future(twilio.speak(Resampler(24000, 8000).process(np.tile(speech_24k, 4))))
        realtime = await http.ws_connect(server.ws("/v1/realtime?duplex=1&api_key=client-key"))
        vonage = await http.ws_connect(server.ws("/v1/vonage?api_key=client-key"))
        await vonage.send_json({"event": "websocket:connected", "content-type": "audio/l16;rate=8000",
                                "caller": "+15550100"})
        await vonage.send_bytes(b"\0" * 320)

        async def three() -> list[dict[str, Any]]:
            found = await admin_calls(http, server.url)
            return found if len(found) == 3 else []
        listed = await eventually(three, 5, "three live calls")
        assert sorted(c["door"] for c in listed) == ["/v1/realtime", "/v1/twilio", "/v1/vonage"]
        assert next(c for c in listed if c["door"] == "/v1/vonage")["caller"] == {"caller": "+15550100"}
        phone = next(c for c in listed if c["door"] == "/v1/twilio")
        assert phone["caller"]["call_sid"] == "CA5" and phone["id"].startswith("call_")
        await eventually(lambda: len(twilio.received) > 50, 10, "the model's audio")
        async with http.post(f"{server.url}/v1/calls/{phone['id']}/cut",
                             headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 204
        await eventually(lambda: twilio.cleared == 1, 5, "Twilio told to clear")
        other = next(c for c in listed if c["door"] == "/v1/vonage")
        async with http.post(f"{server.url}/v1/calls/{other['id']}/cut",
                             headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 204
        msg = await vonage.receive(timeout=5)
        while msg.type is aiohttp.WSMsgType.BINARY or msg.json()["action"] == "notify":
            msg = await vonage.receive(timeout=5)
        assert msg.json() == {"action": "clear"}
        for call in listed:
            async with http.delete(f"{server.url}/v1/calls/{call['id']}",
                                   headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                assert r.status == 204
        closed = await realtime.receive(timeout=5)
        while closed.type is aiohttp.WSMsgType.TEXT and closed.json()["type"] != "session.closed":
            closed = await realtime.receive(timeout=5)
        assert closed.json()["reason"] == "admin_hangup"
        await asyncio.wait_for(twilio.closed.wait(), 5)
        assert ws.close_code == 1000 and twilio.close_reason == "admin_hangup"
        speaking.cancel()
        twilio.close()
        async with http.delete(f"{server.url}/v1/calls/{phone['id']}", headers={"Authorization": f"Bearer {ADMIN}"}) \
                as r:
            assert r.status == 404
        assert await admin_calls(http, server.url) == []
        await realtime.close()
        await vonage.close()
    off = await start_server()
    async with aiohttp.ClientSession() as http, http.get(off.url + "/v1/calls") as r:
        assert r.status == 403                                         # no --admin-key: the API is off


@pytest.mark.parametrize("policy,record,recorded", [("opt-in", True, True), ("opt-in", None, False),
                                                    ("opt-out", False, False)])
async def test_a_realtime_session_states_its_wish_before_audio(start_server, speech_24k, tmp_path, policy, record,
                                                               recorded):
    """The Realtime WebSocket's `session.record`, given before audio flows, is weighed by the server's policy as
    a phone door's parameter is; once the conversation started it is listed as ignored."""
    root = tmp_path / "rec"
    server = await start_server(record_dir=root, record_policy=policy)
    session: dict[str, Any] = {"pacing": "input"} if record is None else {"pacing": "input", "record": record}
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws("/v1/realtime?duplex=1")) as ws:
        await ws.receive_json()
        await ws.send_json({"type": "session.update", "session": session})
        assert (await ws.receive_json())["session"]["record"] is record
        pcm = (np.clip(speech_24k[: 6 * 1920], -1, 1) * 32767).astype("<i2").tobytes()
        await ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        deltas = 0
        while deltas < 6:
            deltas += (await ws.receive_json())["type"] == "response.output_audio.delta"
        await ws.send_json({"type": "session.update", "session": {"record": not record}})
        while (event := await ws.receive_json())["type"] != "session.updated":
            pass
        assert {"param": "session.record", "reason": "recording is decided as the conversation starts"} \
            in event["ignored"]
        await ws.send_json({"type": "session.close"})
        while (await ws.receive_json())["type"] != "session.closed":
            pass
        await wait_in_use(http, server.url, 0)
    if recorded:
        folder, call = await finished(root)
        assert call["door"] == "/v1/realtime" and decode(folder / "audio.ogg")[0].shape[0] == 2
    else:
        assert not list(root.rglob("audio.ogg"))
