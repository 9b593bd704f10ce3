"""Admission, slot recycling, disconnects, auth, limits, shutdown and the HTTP routes, over real loopback sockets."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_support import b64, closed_with, encode, expect_error, next_event, until, wait_in_use

from model.config import MIMI_NAME
from model.engine import FrameOutput, SessionParams
from model.engine.api import ENGINE_STALLED_S

REALTIME = "/v1/realtime?duplex=1"


async def _speak(ws: aiohttp.ClientWebSocketResponse, samples: np.ndarray, frames: int = 4) -> None:
    await ws.send_json({"type": "session.update", "session": {"pacing": "input"}})
    await until(ws, "session.updated")
    await ws.send_json({"type": "input_audio_buffer.append",
                        "audio": b64(encode(samples[: frames * 1920], "pcm16", 24000))})
    await until(ws, "response.output_audio.delta")


async def test_overflow_then_recycled_slot(start_server, speech_24k):
    server = await start_server(max_sessions=1)
    async with aiohttp.ClientSession() as http:
        first = await http.ws_connect(server.ws(REALTIME))
        assert (await next_event(first))["type"] == "session.created"
        await _speak(first, speech_24k)

        extra = await http.ws_connect(server.ws(REALTIME))
        err = await expect_error(extra, "resource_exhausted")
        assert err["type"] == "rate_limit_error" and "limit=1" in err["message"]
        code, _ = await closed_with(extra)
        assert code == 1013

        await first.send_json({"type": "session.close"})
        code, seen = await closed_with(first)
        assert code == 1000 and seen[-1]["type"] == "session.closed"
        await wait_in_use(http, server.url, 0)

        replacement = await http.ws_connect(server.ws(REALTIME))
        created = await next_event(replacement)
        assert created["type"] == "session.created"
        await _speak(replacement, speech_24k)
        await replacement.close()

        async with http.get(server.url + "/metrics") as r:
            text = await r.text()
        assert 'personaplex_rejections_total{code="resource_exhausted",route="/v1/realtime"} 1' in text
        assert 'personaplex_admissions_total{route="/v1/realtime"} 2' in text


def _kv_pages(metrics: str) -> int:
    return sum(int(float(m)) for m in re.findall(r'^personaplex_engine_kv_pages\{state="\w+"\} (\S+)$', metrics, re.M))


async def test_kv_cache_gib_bounds_the_kv_cache_and_sessions_run_in_it(start_server, speech_24k):
    """`--kv-cache-gib` (a GPU shared with another service): the KV cache holds no more than it says, here the
    tiny model's one full context (0.000238 GiB) of the two that two sessions would take, and sessions run in it."""
    capped, full = await start_server(max_sessions=2, kv_cache_gib=0.00025), await start_server(max_sessions=2)
    async with aiohttp.ClientSession() as http:
        pages = [_kv_pages(await (await http.get(server.url + "/metrics")).text()) for server in (capped, full)]
        assert pages[0] > 0 and 2 * pages[0] == pages[1], pages
        health = await (await http.get(capped.url + "/health")).json()
        assert health["kv_cache"] == {"pages": pages[0], "free": pages[0], "window_shrinks": 0}, health
        ws = await http.ws_connect(capped.ws(REALTIME))
        assert (await next_event(ws))["type"] == "session.created"
        await _speak(ws, speech_24k)
        await ws.close()


async def test_vanished_client_frees_its_slot_at_once(server, speech_24k):
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(server.ws(REALTIME))
        await next_event(ws)
        await ws.send_json({"type": "input_audio_buffer.append",
                            "audio": b64(encode(speech_24k[:4800], "pcm16", 24000))})
        await until(ws, "response.output_audio.delta")
        assert (await (await http.get(server.url + "/health")).json())["sessions"]["in_use"] == 1
        ws._response.connection.transport.abort()  # the TCP connection drops without a close frame
        await wait_in_use(http, server.url, 0, timeout=2.0)


def _small_receive_buffer(addr_info) -> socket.socket:
    """A client socket whose kernel receive buffer stays small, so a client that stops reading stalls soon."""
    sock = socket.socket(addr_info[0], addr_info[1], addr_info[2])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


async def test_a_client_that_stops_reading_is_closed_and_the_others_go_on(start_server, speech_24k):
    server = await start_server(max_output_backlog_s=0.8, max_input_backlog_s=120.0)
    stalled_connector = aiohttp.TCPConnector(socket_factory=_small_receive_buffer)
    async with aiohttp.ClientSession() as http, aiohttp.ClientSession(connector=stalled_connector) as stalled_http:
        pcm = encode(np.tile(speech_24k, 20), "pcm16", 24000)
        reader = await http.ws_connect(server.ws(REALTIME))
        stalled = await stalled_http.ws_connect(server.ws(REALTIME))
        for ws in (reader, stalled):  # input-paced, so the engine answers faster than real time
            assert (await next_event(ws))["type"] == "session.created"
            await ws.send_json({"type": "session.update", "session": {"pacing": "input"}})
            await until(ws, "session.updated")
        stalled_transport = stalled._conn.transport  # this client application stops reading its socket
        stalled_transport.pause_reading()
        for ws in (reader, stalled):
            for second in range(min(100, len(pcm) // 48000)):
                await ws.send_json({"type": "input_audio_buffer.append",
                                    "audio": b64(pcm[second * 48000 : (second + 1) * 48000])})
        deadline = time.monotonic() + 60
        while server.ctx.metrics.errors["output_backpressure"] == 0:
            assert time.monotonic() < deadline, "the stalled client was never closed"
            await until(reader, "response.output_audio.delta")
        # It still writes: its next message wakes the server's read loop while the close waits on the flush.
        await stalled.send_json({"type": "input_audio_buffer.append", "audio": b64(pcm[:3840])})
        await wait_in_use(http, server.url, 1)  # its slot is free at once
        for _ in range(5):  # and the other conversation goes on
            await until(reader, "response.output_audio.delta")
        stalled_transport.resume_reading()
        code, _ = await closed_with(stalled, timeout=15)  # what it reads now ends in the policy close
        assert code == 1008



@pytest.mark.parametrize("how", ["bearer", "query", "subprotocol"])
async def test_auth_accepts_each_key_form(start_server, how):
    server = await start_server(api_keys=("k1", "sekret"))
    kwargs: dict = {}
    url = server.ws(REALTIME)
    if how == "bearer":
        kwargs["headers"] = {"Authorization": "Bearer sekret"}
    elif how == "query":
        url += "&api_key=sekret"
    else:
        kwargs["protocols"] = ("realtime", "openai-insecure-api-key.sekret", "openai-beta.realtime-v1")
    async with aiohttp.ClientSession() as http, http.ws_connect(url, **kwargs) as ws:
        assert (await next_event(ws))["type"] == "session.created"
        if how == "subprotocol":
            assert ws.protocol == "realtime"


async def test_auth_refuses_before_any_slot(start_server):
    server = await start_server(api_keys=("sekret",))
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(server.ws(REALTIME), headers=headers)
            assert e.value.status == 401
        async with http.get(server.url + "/v1/realtime", headers={"Connection": "Upgrade", "Upgrade": "websocket"}) \
                as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        for path in ("/v1/duplex", "/v1/twilio"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(server.ws(path))
            assert e.value.status == 401
        async with http.get(server.url + "/v1/models") as r:
            assert r.status == 401
        async with http.get(server.url + "/v1/models", headers={"Authorization": "Bearer sekret"}) as r:
            assert r.status == 200
        health = await (await http.get(server.url + "/health")).json()
        assert health["sessions"]["in_use"] == 0
        metrics = await (await http.get(server.url + "/metrics")).text()
        assert 'personaplex_rejections_total{code="unauthorized",route="/v1/realtime"} 3' in metrics
        assert "personaplex_admissions_total{" not in metrics


async def test_origin_allow_list(start_server):
    server = await start_server(allowed_origins=("https://app.example",))
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await http.ws_connect(server.ws(REALTIME), headers={"Origin": "https://evil.example"})
        assert e.value.status == 403
        async with http.ws_connect(server.ws(REALTIME), headers={"Origin": "https://app.example"}) as ws:
            assert (await next_event(ws))["type"] == "session.created"


async def test_graceful_shutdown_says_session_closed_and_1001(start_server, speech_24k):
    server = await start_server()
    async with aiohttp.ClientSession() as http:
        rt = await http.ws_connect(server.ws(REALTIME))
        await next_event(rt)
        await _speak(rt, speech_24k)
        native = await http.ws_connect(server.ws("/v1/duplex"))
        await native.send_json({"type": "session.create", "session": {}})
        await until(native, "session.created")
        stop = asyncio.ensure_future(server.stop())
        for ws in (rt, native):
            code, seen = await closed_with(ws)
            closed = [e for e in seen if e["type"] == "session.closed"]
            assert code == 1001 and closed and closed[0]["reason"] == "server_shutdown", (code, seen[-3:])
        await stop


async def test_first_message_timeout(start_server):
    server = await start_server(first_message_timeout_s=0.4)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await expect_error(ws, "config_timeout")
        code, seen = await closed_with(ws)
        assert code == 1008 and seen[-1]["type"] == "session.closed" and seen[-1]["reason"] == "config_timeout"
        await wait_in_use(http, server.url, 0)


async def test_idle_timeout_closes_the_session(server):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "session.update", "session": {"idle_timeout_s": 1}})
        assert (await until(ws, "session.updated"))["session"]["idle_timeout_s"] == 1
        code, seen = await closed_with(ws, timeout=4)
        assert code == 1000 and seen[-1]["reason"] == "idle_timeout"


async def test_oversized_message_closes_1009(start_server):
    server = await start_server(max_message_bytes=32 * 1024)
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            await ws.send_json({"type": "input_audio_buffer.append", "audio": "A" * 40_000})
            await expect_error(ws, "event_too_large")
            code, _ = await closed_with(ws)
            assert code == 1009
        async with http.ws_connect(server.ws(REALTIME)) as ws:   # far over: aiohttp's own bound closes it
            await next_event(ws)
            await ws.send_str("x" * 200_000)
            code, _ = await closed_with(ws)
            assert code == 1009
        await wait_in_use(http, server.url, 0)


async def test_flood_is_rate_limited_then_closed(start_server):
    server = await start_server(max_events_per_s=20)
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            for _ in range(50):   # a burst just over the bucket: some are dropped, the session stays
                await ws.send_json({"type": "session.heartbeat"})
            err = await expect_error(ws, "rate_limited")
            assert err["type"] == "rate_limit_error"
            await asyncio.sleep(1.0)
            await ws.send_json({"type": "session.heartbeat"})
            await until(ws, "session.heartbeat_ack")
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            for _ in range(300):  # a sustained flood: closed
                await ws.send_json({"type": "session.heartbeat"})
            code, seen = await closed_with(ws)
            assert code == 1008 and any(e.get("error", {}).get("code") == "rate_limited" for e in seen)


async def test_http_routes(server):
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url + "/health") as r:
            health = await r.json()
        assert r.status == 200 and health["status"] == "ok" and health["ready"] and health["tiny"]
        assert health["sessions"] == {"in_use": 0, "free": 2, "max": 2}
        assert {"ticks", "late_ticks", "p50_ms", "p99_ms"} <= set(health["tick"])
        async with http.get(server.url + "/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list" and models["data"][0]["id"] == "personaplex-tiny"
        assert models["data"][0]["capabilities"]["chunk_period_ms"] == 80
        async with http.get(server.url + "/v1/voices") as r:
            voices = await r.json()
        assert [v["id"] for v in voices["data"]] == ["NATF2", "NATM1"] and voices["default"] == "NATF2"
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            await ws.send_str("nope")
            await expect_error(ws, "invalid_json")
            await ws.send_json({"type": "input_audio_buffer.append", "audio": b64(b"\0" * 7680)})
            for _ in range(2):  # the start's frame, then one from a tick
                await until(ws, "response.output_audio.delta")
            async with http.get(server.url + "/metrics") as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
        for line in ("personaplex_sessions_in_use 1", "personaplex_sessions_max 2",
                     'personaplex_errors_total{code="invalid_json"} 1',
                     'personaplex_connections{route="/v1/realtime"} 1',
                     "# TYPE personaplex_engine_tick_ms histogram", 'personaplex_engine_tick_ms_bucket{le="+Inf"}'):
            assert line in text, line
        values = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
        for name in ("personaplex_frames_in_total", "personaplex_underruns_total",
                     "personaplex_engine_late_ticks_total"):
            assert values[name] >= 0
        assert values["personaplex_frames_out_total"] > 0 and values["personaplex_engine_ticks_total"] > 0
        starts = values['personaplex_engine_prompt_cache_total{result="hit"}'] + values[
            'personaplex_engine_prompt_cache_total{result="miss"}']
        assert starts >= 1 and values["personaplex_engine_open_work_last_ms"] > 0
        assert values["personaplex_engine_prompt_copies_in_flight_total"] == 0  # CPU: no tick is ever in flight
        assert all(values[f'personaplex_engine_open_step_ms{{kind="{k}"}}'] > 0 for k in ("plan", "prefill", "lead"))
        assert all(values[f'personaplex_engine_host_ms{{phase="{p}"}}'] > 0 for p in ("prepare", "deliver"))
        assert values["personaplex_engine_gc_max_ms"] >= 0 and values["personaplex_engine_gc_collections_total"] >= 0
        assert values["personaplex_engine_input_frames_staged_total"] >= 0
        assert values['personaplex_engine_session_start_ms{quantile="0.99",until="first_frame"}'] > 0
        assert values['personaplex_event_loop_lag_ms{process="main",quantile="0.99"}'] >= 0
        async with http.get(server.url + "/v1/realtime?duplex=0") as r:
            assert r.status == 400


async def test_engine_stop_under_a_live_session(server, speech_24k):
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME)) as ws:
        await next_event(ws)
        await ws.send_json({"type": "input_audio_buffer.append",
                            "audio": b64(encode(speech_24k[:4800], "pcm16", 24000))})
        await until(ws, "response.output_audio.delta")
        engine = server.ctx.engine
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        seen: list[dict] = []
        done = await until(ws, "response.done", seen=seen)
        assert done["response"]["status"] == "failed"
        await expect_error(ws, "engine_stopped")
        code, rest = await closed_with(ws)
        # The close frame too (it once came about 1 run in 10 as 1006: a close beside a pending receive dropped the
        # connection with the client's last messages unread, a reset that took the frame with it).
        assert code == 1011 and rest[-1]["type"] == "session.closed" and rest[-1]["reason"] == "engine_stopped", (
            code, rest, seen)


async def test_voices_folder(start_server, tiny_checkpoint, tmp_path, speech_24k):
    from model.loading import load_model
    bundled = load_model(str(tiny_checkpoint)).voices_dir
    voices = tmp_path / "voices"
    voices.mkdir()
    (voices / "Receptionist.pt").write_bytes((bundled / "NATM1.pt").read_bytes())
    (voices / "notes.txt").write_text("not a voice")
    server = await start_server(voices_dir=voices)
    async with aiohttp.ClientSession() as http:
        listing = await (await http.get(server.url + "/v1/voices")).json()
        assert {(v["id"], v["source"]) for v in listing["data"]} == {
            ("NATF2", "bundled"), ("NATM1", "bundled"), ("Receptionist", "voices_dir")}
        async with http.ws_connect(server.ws(REALTIME)) as ws:
            await next_event(ws)
            await ws.send_json({"type": "session.update", "session": {"voice": "Receptionist.pt"}})
            assert (await until(ws, "session.updated"))["session"]["voice"] == "Receptionist.pt"
            await _speak(ws, speech_24k)


@pytest.fixture(scope="module")
def overflowing_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a finite Mimi decoder weight so large that the decoded audio overflows."""
    folder = tmp_path_factory.mktemp("overflowing")
    shutil.copytree(tiny_checkpoint, folder, dirs_exist_ok=True)
    state = load_file(str(folder / MIMI_NAME))
    convs = [k for k in state if re.fullmatch(r"decoder\.model\.\d+\.conv\.conv\.weight", k)]
    last = max(convs, key=lambda k: int(k.split(".")[2]))
    state[last] = torch.full_like(state[last], 1e38)
    save_file(state, str(folder / MIMI_NAME))
    return folder


async def test_a_failing_step_reaches_the_client_and_the_server_stays_up(start_server, overflowing_checkpoint,
                                                                        speech_24k):
    server = await start_server(overflowing_checkpoint)
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # each conversation fails on its own; the server and its engine go on
            async with http.ws_connect(server.ws(REALTIME)) as ws:
                assert (await next_event(ws))["type"] == "session.created"
                await ws.send_json({"type": "input_audio_buffer.append",
                                    "audio": b64(encode(speech_24k[:4800], "pcm16", 24000))})
                err = await expect_error(ws, "runtime_failed")
                assert err["type"] == "server_error" and "non-finite" in err["message"]
                code, _ = await closed_with(ws)
                assert code == 1011
        await wait_in_use(http, server.url, 0)
        health = await (await http.get(f"{server.url}/health")).json()
        assert server.ctx.engine.running and health["status"] == "ok", health
        metrics = await (await http.get(f"{server.url}/metrics")).text()
        assert 'personaplex_engine_errors_total{cause="non_finite_output"} 2' in metrics


class BlockingSource:
    """A frame source that blocks the engine's tick (a stuck read) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def read_frame(self) -> np.ndarray | None:
        self.release.wait(10.0)
        return None

    def frames_ready(self) -> int:
        return 1


async def test_an_engine_that_stops_ticking_is_not_ready_realtime(start_server):
    """A tick stuck for over ENGINE_STALLED_S (2 s, the default) makes /health 503 with ready false, and ready again
    once it ticks: a balancer stops sending calls to a server whose engine hangs, not only to one whose thread died."""
    server = await start_server(engine_stalled_s=ENGINE_STALLED_S)
    engine = server.ctx.engine
    slot, source = engine.reserve(), BlockingSource()
    sink: list[FrameOutput] = []
    await slot.start(SessionParams(), source, sink.append, lambda error: None)
    async with aiohttp.ClientSession() as http:
        stuck_at = time.monotonic()
        while True:
            async with http.get(server.url + "/health") as r:
                health = await r.json()
            if not health["ready"]:
                assert r.status == 503 and health["status"] == "engine_down", health
                break
            assert time.monotonic() - stuck_at < 8.0, health
            await asyncio.sleep(0.1)
        source.release.set()
        slot.close()
        deadline = time.monotonic() + 10
        while not (await (await http.get(server.url + "/health")).json())["ready"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
