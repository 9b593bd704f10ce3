"""`/v1/realtime?duplex=1` end to end: a real aiohttp WebSocket client against the server on the tiny model."""

from __future__ import annotations

import base64
from typing import Any

import aiohttp
import numpy as np
import pytest
from server_support import b64, encode, expect_error, next_event, until

from media.codecs import AudioFormat

FRAMES = 12
REALTIME = "/v1/realtime?duplex=1"
START_ORDER_GA = ["response.created", "conversation.item.added", "response.output_item.added",
                  "response.content_part.added"]
START_ORDER_BETA = ["response.created", "conversation.item.created", "response.output_item.added",
                    "response.content_part.added"]


async def stream(ws: aiohttp.ClientWebSocketResponse, samples24k: np.ndarray, fmt: AudioFormat,
                 chunk_ms: int = 50, extra: dict[str, Any] | None = None) -> None:
    """Send the audio as appends of `chunk_ms` (not frame-aligned on purpose) in the wire format."""
    from media.resample import Resampler
    wire = Resampler(24000, fmt.sample_rate).process(samples24k) if fmt.sample_rate != 24000 else samples24k
    step = fmt.sample_rate * chunk_ms // 1000
    for i in range(0, wire.size, step):
        await ws.send_json({"type": "input_audio_buffer.append",
                            "audio": b64(encode(wire[i:i + step], fmt.encoding, fmt.sample_rate)), **(extra or {})})


async def collect_frames(ws: aiohttp.ClientWebSocketResponse, frames: int, audio_type: str,
                         timeout: float = 20.0) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    count = 0
    while count < frames:
        event = await until(ws, audio_type, timeout, seen)
        assert event["type"] == audio_type
        count += 1
    return seen


def audio_of(events: list[dict[str, Any]], audio_type: str, fmt: AudioFormat) -> np.ndarray:
    chunks = [fmt.decode(base64.b64decode(e["delta"], validate=True)) for e in events if e["type"] == audio_type]
    return np.concatenate(chunks)


FORMATS = {
    "pcm16-24k": ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                             "output": {"format": {"type": "audio/pcm", "rate": 24000}}}},
                  AudioFormat("pcm16", 24000), AudioFormat("pcm16", 24000), None),
    "pcm16-16k": ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}},
                             "output": {"format": {"type": "audio/pcm", "rate": 16000}}}},
                  AudioFormat("pcm16", 16000), AudioFormat("pcm16", 16000), None),
    "f32-per-append": ({"output_audio_format": "pcm_f32le", "output_sample_rate_hz": 24000},
                       AudioFormat("f32", 24000), AudioFormat("f32", 24000),
                       {"format": "pcm_f32le", "sample_rate_hz": 24000}),
    "pcmu": ({"audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcmu"}}}},
             AudioFormat("pcmu", 8000), AudioFormat("pcmu", 8000), None),
    "pcma": ({"audio": {"input": {"format": {"type": "audio/pcma"}}, "output": {"format": {"type": "audio/pcma"}}}},
             AudioFormat("pcma", 8000), AudioFormat("pcma", 8000), None),
}


@pytest.mark.parametrize("name", list(FORMATS))
async def test_realtime_flow_each_format(server, speech_24k, name):
    update, fmt_in, fmt_out, per_append = FORMATS[name]
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        created = await next_event(ws)
        assert created["type"] == "session.created"
        caps = created["session"]["capabilities"]
        assert caps["implementation_level"] == "model_native_duplex"
        assert caps["chunk_period_ms"] == 80 and caps["supports_barge_in"] is False
        assert caps["supports_client_commit"] is False and caps["supports_external_turn_signal"] is False
        assert caps["supports_multi_session"] is True and caps["session_admission_mode"] == "engine_managed"
        await ws.send_json({"type": "session.update", "event_id": "evt_1",
                            "session": {**update, "instructions": "You answer briefly.", "voice": "NATM1",
                                        "extra_body": {"pacing": "input", "seed": 7}}})
        updated = await next_event(ws)
        assert updated["type"] == "session.updated"
        s = updated["session"]
        assert s["instructions"] == "You answer briefly." and s["voice"] == "NATM1" and s["pacing"] == "input"
        assert s["sampling"]["seed"] == 7
        if per_append is None:
            assert s["audio"]["input"]["format"]["rate"] == fmt_in.sample_rate
        assert s["audio"]["output"]["format"]["rate"] == fmt_out.sample_rate

        # One frame more than awaited: a resampler holds back a few samples until more input comes.
        await stream(ws, speech_24k[: (FRAMES + 1) * 1920], fmt_in, extra=per_append)
        events = await collect_frames(ws, FRAMES, "response.output_audio.delta")
        kinds = [e["type"] for e in events]
        assert kinds[:4] == START_ORDER_GA, kinds[:6]
        assert kinds[4] == "response.output_audio.delta"
        response_id = events[0]["response_id"]
        item_id = events[1]["item"]["id"]
        assert events[0]["response"]["status"] == "in_progress"
        assert events[3]["part"] == {"type": "audio", "transcript": ""}
        deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
        assert {e["response_id"] for e in deltas} == {response_id}
        assert {e["item_id"] for e in deltas} == {item_id}
        assert all(e["output_index"] == 0 and e["content_index"] == 0 for e in deltas)
        if fmt_out.sample_rate == 24000:
            assert {len(base64.b64decode(e["delta"])) for e in deltas} == {1920 * fmt_out.bytes_per_sample}
        audio = audio_of(events, "response.output_audio.delta", fmt_out)
        per_frame = fmt_out.sample_rate * 80 // 1000
        assert abs(audio.size - FRAMES * per_frame) <= per_frame // 10, audio.size
        assert np.isfinite(audio).all() and float(np.sqrt(np.mean(audio ** 2))) > 1e-4
        texts = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
        assert texts and all(t and "\u2581" not in t for t in texts)

        await ws.send_json({"type": "session.close"})
        closed = await until(ws, "session.closed")
        assert closed["reason"] == "client_close" and closed["stats"]["frames_out"] >= FRAMES
        assert (await ws.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == 1000


async def test_beta_names_with_beta_header(server, speech_24k):
    fmt = AudioFormat("pcmu", 8000)
    async with aiohttp.ClientSession() as http, \
            http.ws_connect(server.ws(REALTIME), headers={"OpenAI-Beta": "realtime=v1"}) as ws:
        assert (await next_event(ws))["type"] == "session.created"
        await ws.send_json({"type": "session.update", "session": {
            "input_audio_format": "g711_ulaw", "output_audio_format": "g711_alaw", "pacing": "input"}})
        s = (await next_event(ws))["session"]
        assert (s["input_audio_format"], s["output_audio_format"]) == ("g711_ulaw", "g711_alaw")
        await stream(ws, speech_24k[: 9 * 1920], fmt)
        events = await collect_frames(ws, 8, "response.audio.delta")
        kinds = [e["type"] for e in events]
        assert kinds[:4] == START_ORDER_BETA
        assert not any(k.startswith("response.output_audio") for k in kinds)
        assert "response.audio_transcript.delta" in kinds
        rid = events[0]["response_id"]
        await ws.send_json({"type": "response.cancel", "response_id": rid})
        seen: list[dict[str, Any]] = []
        done = await until(ws, "response.done", seen=seen)
        assert done["response"]["status"] == "cancelled"
        assert [e["type"] for e in seen if not e["type"].endswith("delta")][:5] == [
            "response.audio.done", "response.audio_transcript.done", "response.content_part.done",
            "response.output_item.done", "response.done"]
        await ws.send_json({"type": "response.create"})
        created = await until(ws, "response.created")
        assert created["response"]["id"] != rid


async def frames_of(ws: aiohttp.ClientWebSocketResponse, samples: np.ndarray, stepped: Any,
                    cut_after: int | None = None, create_after: int = 0, until_audio: bytes | None = None
                    ) -> tuple[list[tuple[str, bytes]], list[dict[str, Any]]]:
    """Stream `samples` frame by frame (input pacing, greedy) and collect each audio delta as (response id, bytes);
    with `cut_after`, cancel the response after that many deltas, ask for a new one `create_after` frames of input
    later, once the engine has stepped every frame sent (`stepped()`: its input-clocked frame count), and read until
    the delta `until_audio` (the uncut run's last)."""
    import asyncio
    seen: list[dict[str, Any]] = []
    frames, baseline = samples.size // 1920, stepped()
    for i in range(frames):
        if cut_after is not None and i == cut_after + create_after:
            while stepped() < baseline + i:
                await asyncio.sleep(0.01)
            await ws.send_json({"type": "response.create"})
        await ws.send_json({"type": "input_audio_buffer.append",
                            "audio": b64(encode(samples[i * 1920:(i + 1) * 1920], "pcm16", 24000))})
        if i == cut_after:
            while sum(e["type"] == "response.output_audio.delta" for e in seen) < cut_after:
                await until(ws, "response.output_audio.delta", seen=seen)
            await ws.send_json({"type": "response.cancel"})
            await until(ws, "response.done", seen=seen)
    # Input pacing: n frames in give n + 1 out; with a cut, until the last frame of the uncut run arrives.
    while until_audio is not None or sum(e["type"] == "response.output_audio.delta" for e in seen) <= frames:
        event = await until(ws, "response.output_audio.delta", timeout=30, seen=seen)
        if until_audio is not None and base64.b64decode(event["delta"]) == until_audio:
            break
    deltas = [(e["response_id"], base64.b64decode(e["delta"])) for e in seen
              if e["type"] == "response.output_audio.delta"]
    return deltas, seen


async def test_cancel_cuts_the_caller_off_and_keeps_the_context(start_server, speech_24k):
    """A cancelled response's audio stops at once (no later delta of it) and the model keeps its context: what it
    says once a new response opens is, frame for frame, what it says in a conversation nobody cut."""
    server = await start_server(max_sessions=1)
    speech = np.tile(speech_24k, 3)[: 40 * 1920]
    session = {"pacing": "input", "extra_body": {"greedy": True}}
    stepped = lambda: server.ctx.engine.stats().offline_frames
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            await ws.send_json({"type": "session.update", "session": session})
            await until(ws, "session.updated")
            whole, _ = await frames_of(ws, speech, stepped)
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            await ws.send_json({"type": "session.update", "session": session})
            await until(ws, "session.updated")
            cut, events = await frames_of(ws, speech, stepped, cut_after=10, create_after=6,
                                          until_audio=whole[-1][1])
    done = next(e for e in events if e["type"] == "response.done")
    first = done["response"]["id"]
    assert done["response"]["status"] == "cancelled" and done["response"]["output"][0]["status"] == "incomplete"
    after_done = events[events.index(done):]
    assert not [e for e in after_done if e.get("response_id") == first], "audio of the cut response after its end"
    later = [audio for rid, audio in cut if rid != first]
    assert later, "no response after the cut"
    audio_whole = [audio for _, audio in whole]
    start = audio_whole.index(later[0])                  # the same context: the later frames are the uncut ones
    assert later == audio_whole[start:start + len(later)]
    assert start > sum(rid == first for rid, _ in cut)    # the frames in between were withheld, not delayed


async def test_a_cut_with_no_new_response_asked_for_is_heard_again_within_a_second(start_server, speech_24k):
    """An agent framework whose own VAD interrupts sends response.cancel and waits: the model, muted until its next
    utterance, is heard again at the latest MAX_MUTED_FRAMES frames after the cut, in a response of its own."""
    import asyncio

    from app.doors.realtime.dialect import MAX_MUTED_FRAMES
    server = await start_server(max_sessions=1)
    stepped = lambda: server.ctx.engine.stats().offline_frames
    speech = np.tile(speech_24k, 3)[: 40 * 1920]
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "session.update", "session": {"pacing": "input"}})
        await until(ws, "session.updated")
        await stream(ws, speech[: 6 * 1920], AudioFormat("pcm16", 24000))
        first = (await until(ws, "response.created"))["response"]["id"]
        await ws.send_json({"type": "response.cancel"})
        seen: list[dict[str, Any]] = []
        await until(ws, "response.done", seen=seen)
        baseline = stepped()
        await stream(ws, speech[6 * 1920:], AudioFormat("pcm16", 24000))
        while stepped() < baseline + 34:
            await asyncio.sleep(0.01)
        later = await collect_frames(ws, 40 - 6 - MAX_MUTED_FRAMES - 1, "response.output_audio.delta")
    created = [e for e in later if e["type"] == "response.created"]
    assert created and created[0]["response"]["id"] != first
    assert not [e for e in seen + later if e["type"] == "error"]


async def test_cancel_with_restart_on_cancel_starts_a_fresh_context(server, speech_24k):
    fmt = AudioFormat("pcm16", 24000)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "session.update", "session": {"pacing": "input", "restart_on_cancel": True}})
        assert (await until(ws, "session.updated"))["session"]["restart_on_cancel"] is True
        await stream(ws, speech_24k[: 6 * 1920], fmt)
        first = await collect_frames(ws, 6, "response.output_audio.delta")
        rid = first[0]["response_id"]
        await ws.send_json({"type": "response.cancel", "response_id": "resp_not_this_one"})   # not open: met
        await ws.send_json({"type": "output_audio_buffer.clear"})
        seen: list[dict[str, Any]] = []
        cleared = await until(ws, "output_audio_buffer.cleared", seen=seen)
        assert cleared["response_id"] == rid
        assert not [e for e in seen if e["type"] == "error"]
        done = next(e for e in seen if e["type"] == "response.done")
        assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        assert "conversation.item.done" in [e["type"] for e in seen]
        await stream(ws, speech_24k[6 * 1920: 10 * 1920], fmt)
        again = await collect_frames(ws, 4, "response.output_audio.delta")
        kinds = [e["type"] for e in again]
        assert kinds[:4] == START_ORDER_GA
        new_ids = {e["response_id"] for e in again if e["type"] == "response.output_audio.delta"}
        assert len(new_ids) == 1 and rid not in new_ids


async def test_mid_call_updates(server, speech_24k):
    """Once audio flows: the voice and sampling stay (listed as ignored), new instructions are applied (prefilled
    into the live context: the conversation goes on), formats change."""
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "session.update", "session": {"voice": "NATF2", "instructions": "Be kind.",
                                                                   "pacing": "input"}})
        await until(ws, "session.updated")
        await stream(ws, speech_24k[: 3 * 1920], AudioFormat("pcm16", 24000))
        await until(ws, "response.output_audio.delta")
        await ws.send_json({"type": "session.update", "session": {"audio": {"output": {"voice": "NATM1"}},
                                                                   "temperature": 1.1,
                                                                   "instructions": "Be brief."}})
        updated = await until(ws, "session.updated")
        assert updated["session"]["voice"] == "NATF2" and updated["session"]["instructions"] == "Be brief."
        assert {i["param"] for i in updated["ignored"]} == {"session.audio.output.voice", "session.sampling"}
        # The same values, and a new output format, are fine mid-conversation.
        await ws.send_json({"type": "session.update", "session": {
            "voice": "NATF2.pt", "audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}})
        updated = await until(ws, "session.updated")
        assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 16000}
        assert updated["ignored"] == []
        # The prompt went into the live context: the same conversation keeps streaming, and no error came.
        await stream(ws, speech_24k[3 * 1920: 8 * 1920], AudioFormat("pcm16", 24000))
        # Input pacing: 3 frames gave 4 (one seen), the prompt's return to the conversation 1, and these 5 frames 5.
        seen = await collect_frames(ws, 9, "response.output_audio.delta")
        await ws.send_json({"type": "session.close"})
        closed = await until(ws, "session.closed", seen=seen)
        assert not [e for e in seen if e["type"] == "error"]
        assert closed["stats"]["frames_out"] == 10


async def test_session_update_errors_keep_the_session(server, speech_24k):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        cases = [
            ({"voice": "nobody"}, "invalid_voice", "session.voice"),
            ({"audio": {"output": {"voice": "nobody"}}}, "invalid_voice", "session.audio.output.voice"),
            ({"voice": "../etc/passwd"}, "invalid_voice", "session.voice"),
            ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "unsupported_audio_format",
             "session.audio.input.format"),
            ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 4000}}}}, "unsupported_audio_format",
             "session.audio.input.format"),
            ({"input_audio_format": "g711_ulaw", "input_sample_rate_hz": 16000}, "unsupported_audio_format",
             "session.input_audio_format"),
            ({"temperature": -1}, "invalid_session_config", "session.temperature"),
            ({"extra_body": {"audio_topk": 0}}, "invalid_session_config", "session.extra_body.audio_topk"),
            ({"extra_body": {"personaplex_model_path": "/x"}}, "invalid_duplex_runtime_config", "session.extra_body"),
            ({"output_modalities": ["text"]}, "invalid_session_config", "session.output_modalities"),
            ({"pacing": "warp"}, "invalid_session_config", "session.pacing"),
            ({"restart_on_cancel": "yes"}, "invalid_session_config", "session.restart_on_cancel"),
        ]
        for i, (session, code, param) in enumerate(cases):
            await ws.send_json({"type": "session.update", "event_id": f"u{i}", "session": session})
            err = await expect_error(ws, code)
            assert err["param"] == param and err["event_id"] == f"u{i}", err
        # What the server does not act on is listed, and the rest of the update applies.
        await ws.send_json({"type": "session.update", "session": {
            "turn_detection": {"type": "server_vad"}, "instructions": "Hi.", "voice": "alloy", "speed": 1.2,
            "tools": [{"type": "function", "name": "f"}], "max_response_output_tokens": 50, "bogus": 1}})
        updated = await until(ws, "session.updated")
        s = updated["session"]
        assert s["instructions"] == "Hi." and s["turn_detection"] == {"type": "server_vad"}
        assert s["voice"] == server.ctx.default_voice
        assert {i["param"] for i in updated["ignored"]} == {"session.voice", "session.speed", "session.tools",
                                                           "session.max_response_output_tokens", "session.bogus"}
        # Nothing above broke the session: audio still flows.
        await ws.send_json({"type": "session.update", "session": {"pacing": "input"}})
        await until(ws, "session.updated")
        await stream(ws, speech_24k[: 3 * 1920], AudioFormat("pcm16", 24000))
        await until(ws, "response.output_audio.delta")


async def test_bad_input_events(server, speech_24k):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_str("{not json")
        await expect_error(ws, "invalid_json")
        await ws.send_str("[1, 2]")
        await expect_error(ws, "invalid_json")
        await ws.send_json({"event_id": "e0"})
        assert (await expect_error(ws, "bad_event"))["event_id"] == "e0"
        await ws.send_json({"type": "no.such.event", "event_id": "e1"})
        assert (await expect_error(ws, "unknown_event"))["event_id"] == "e1"
        await ws.send_json({"type": "input_audio_buffer.append", "event_id": "e2", "audio": "***"})
        assert (await expect_error(ws, "bad_audio"))["event_id"] == "e2"
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(b"\x01\x02\x03")})
        await expect_error(ws, "bad_audio")
        await ws.send_json({"type": "input_audio_buffer.append"})
        await expect_error(ws, "bad_event")
        nan = np.array([0.1, np.nan, 0.2], dtype="<f4").tobytes()
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(nan), "format": "pcm_f32le",
                            "sample_rate_hz": 24000})
        await expect_error(ws, "bad_audio")
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(b"\0\0"), "format": "pcm16",
                            "sample_rate_hz": 96000})
        await expect_error(ws, "unsupported_audio_format")
        await ws.send_bytes(b"\0\0\0\0")
        await expect_error(ws, "binary_unsupported")
        # Item events get OpenAI's answers; bad ones a clear error, and the session goes on.
        await ws.send_json({"type": "conversation.item.create", "item": "text"})
        await expect_error(ws, "bad_event")
        await ws.send_json({"type": "conversation.item.truncate", "item_id": "x", "audio_end_ms": 10})
        assert (await expect_error(ws, "item_not_found"))["param"] == "item_id"
        await ws.send_json({"type": "conversation.item.create", "item": {"id": "u1", "type": "message",
                                                                        "role": "user", "content": []}})
        assert (await until(ws, "conversation.item.added"))["item"]["id"] == "u1"
        await ws.send_json({"type": "conversation.item.truncate", "item_id": "u1", "audio_end_ms": 10})
        await expect_error(ws, "invalid_item")
        await ws.send_json({"type": "response.create", "response": {"metadata": {"k": 5}}})
        assert (await expect_error(ws, "bad_event"))["param"] == "response.metadata"
        await ws.send_json({"type": "session.resume"})
        await expect_error(ws, "unsupported_session_resume")
        await ws.send_json({"type": "session.heartbeat"})
        assert (await until(ws, "session.heartbeat_ack"))["session_id"].startswith("sess_")
        await ws.send_json({"type": "playback.ack", "played_ms": 160})
        assert (await until(ws, "playback.acknowledged"))["event"]["played_ms"] == 160
        await ws.send_json({"type": "playback.ack"})
        await expect_error(ws, "bad_event")
        # The session still works after all of that.
        await ws.send_json({"type": "session.update", "session": {"pacing": "input",
                                                                   "input_audio_format": "pcm16"}})
        await until(ws, "session.updated")
        await stream(ws, speech_24k[: 3 * 1920], AudioFormat("pcm16", 24000))
        await until(ws, "response.output_audio.delta")
        await ws.send_json({"type": "input_audio_buffer.commit"})
        await until(ws, "input_audio_buffer.committed")
        await ws.send_json({"type": "input_audio_buffer.clear"})
        await until(ws, "input_audio_buffer.cleared")


async def test_input_backpressure_on_a_flooding_sender(start_server, speech_24k):
    server = await start_server(max_realtime_backlog_s=0.5)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        pcm = encode(np.tile(speech_24k, 2)[: 24000 * 2], "pcm16", 24000)
        await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(pcm[: 24000])})  # 0.5 s: fits
        await ws.send_json({"type": "input_audio_buffer.append", "event_id": "big", "audio": b64(pcm[24000:])})
        err = await expect_error(ws, "input_backpressure")
        assert err["type"] == "rate_limit_error" and err["event_id"] == "big"
        # The conversation goes on: output keeps coming.
        await until(ws, "response.output_audio.delta")


async def test_realtime_paced_output_keeps_up(server, speech_24k):
    """Realtime pacing: appends of one 80 ms frame every 80 ms; output covers the input within 4 frames."""
    import asyncio
    frames = 15
    pcm = encode(speech_24k[: frames * 1920], "pcm16", 24000)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        out = 0

        async def reader() -> None:
            nonlocal out
            while True:
                event = await next_event(ws, timeout=10)
                assert event["type"] != "error", event
                if event["type"] == "response.output_audio.delta":
                    out += 1

        task = asyncio.ensure_future(reader())
        for i in range(frames):
            await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(pcm[i * 3840:(i + 1) * 3840])})
            await asyncio.sleep(0.08)
        for _ in range(40):
            if out >= frames - 4:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        assert out >= frames - 4


async def test_link_report_and_closing_stats(server, speech_24k):
    """`link_report_s` asks for `session.link` (the link as the server measures it, and the playout buffer the
    client needs); `session.closed.stats` carries what the native dialect's does."""
    from realtime_schema import validate_server_event
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "session.update", "session": {"link_report_s": 0.5}})
        assert (await until(ws, "session.updated"))["session"]["link_report_s"] == 0.5
        await ws.send_json({"type": "session.update", "session": {"link_report_s": 0.1}})
        assert (await expect_error(ws, "invalid_session_config"))["param"] == "session.link_report_s"
        await stream(ws, speech_24k[: 10 * 1920], AudioFormat("pcm16", 24000))
        link = await until(ws, "session.link", timeout=15)
        validate_server_event(link)
        assert link["input"]["jitter_ms"] >= 0 and link["playout_ms"] > 0
        await ws.send_json({"type": "session.close"})
        closed = await until(ws, "session.closed", timeout=15)
        validate_server_event(closed)
        stats = closed["stats"]
        assert stats["frames_sent"] >= 1 and stats["input_ms"] == pytest.approx(10 * 80, abs=1)
        assert {"epoch", "backpressure_refusals", "concealed_ms", "frames_in", "frames_out"} <= set(stats)
        # The whole call's input link: a loopback socket, nothing concealed or cut, a frame read after it came.
        assert stats["input_added_ms_p95"] >= stats["input_added_ms_p50"] >= 0 and stats["input_target_ms"] >= 80
        assert stats["input_hard_cuts"] == 0 and stats["input_jitter_ms"] >= 0
