"""Probes, the HAProxy agent-check answer, and the SIGTERM drain, on the real CLI over real sockets.

`/health/live` answers while the process serves; `/health/ready` and the agent follow the free slots (`ready up N%`,
`0%` when full), say `draining`/`drain` from the first SIGTERM on, when new sessions are refused with
`server_draining` while live ones run on to their end; at the drain timeout the rest get `session.closed` and 1001;
a second SIGTERM closes at once; the server exits 0. In one process and in the multi-process server (where the
supervisor alone answers the agent port). With its engine process dead the server is live but not ready, and the
agent says `down` until the engine is back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from process_support import DuplexCaller, free_port, start_tiny, stop, wait_ready

from app.shell.probes import agent_answer, readiness


async def agent(port: int) -> str:
    """One agent-check exchange, as HAProxy has it: connect, read the line, the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    line = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return line.decode()


async def ready(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url + "/health/ready", headers={"Connection": "close"}) as r:
        return r.status, await r.json()


async def until_status(http: aiohttp.ClientSession, url: str, status: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        code, body = await ready(http, url)
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.05)


async def refused_while_draining(http: aiohttp.ClientSession, url: str) -> None:
    """A new session is refused before the upgrade: HTTP 503, `server_draining`."""
    async with http.get(url + "/v1/duplex", headers={"Connection": "close"}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "server_draining"


@pytest.mark.parametrize("workers", ["0", "2"])
async def test_probes_and_agent_follow_free_slots(tiny_checkpoint, tmp_path, workers):
    agent_port = free_port()
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", workers, "--max-sessions", "2",
                                 "--agent-port", str(agent_port))
    callers: list[DuplexCaller] = []
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, workers=int(workers))
            async with http.get(url + "/health/live") as r:
                assert r.status == 200 and (await r.json()) == {"status": "live"}
            assert await ready(http, url) == (200, {"ready": True, "status": "ready",
                                                    "sessions": {"in_use": 0, "free": 2, "max": 2}})
            assert await agent(agent_port) == "ready up 100%\n"
            for expected in ("ready up 50%\n", "ready up 0%\n"):
                callers.append(DuplexCaller(url))
                await callers[-1].open()
                assert await agent(agent_port) == expected
            code, body = await ready(http, url)
            assert code == 503 and body["status"] == "full" and body["sessions"]["free"] == 0
            async with http.get(url + "/health/live") as r:   # full is not dead
                assert r.status == 200
            await callers.pop().close()
            deadline = time.monotonic() + 10
            while (line := await agent(agent_port)) != "ready up 50%\n":
                assert time.monotonic() < deadline, line
                await asyncio.sleep(0.05)
    finally:
        for caller in callers:
            await caller.close()
        out = await stop(proc)
    assert proc.returncode == 0, out


@pytest.mark.parametrize("workers", ["0", "1"])
async def test_sigterm_drains_live_sessions_to_their_end_and_refuses_new_ones(tiny_checkpoint, tmp_path, workers):
    agent_port = free_port()
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", workers, "--max-sessions", "3",
                                 "--agent-port", str(agent_port), "--drain-timeout-s", "60")
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, workers=int(workers))
            caller = DuplexCaller(url)
            await caller.open()
            stream = asyncio.ensure_future(caller.stream(4.0))
            while len(caller.frames) < 5:
                await asyncio.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            at_term = len(caller.frames)
            body = await until_status(http, url, "draining")
            assert body["ready"] is False and body["sessions"]["in_use"] == 1
            async with http.get(url + "/health/ready") as r:
                assert r.status == 503
            assert await agent(agent_port) == "drain\n"
            await refused_while_draining(http, url)
            async with http.get(url + "/health/live") as r:
                assert r.status == 200
            await stream            # the live session runs to its own end
            assert not caller.ended and caller.error is None and caller.closed_event is None
            assert len(caller.frames) > at_term + 10 and caller.gaps() == []
            await caller.close()
            out = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "draining: no new sessions" in out and "drained" in out and "drain timeout" not in out, out[-3000:]


async def _live_session_closed_by_the_server(tiny_checkpoint, tmp_path, workers: str, drain_s: str,
                                             second_sigterm: bool) -> tuple[DuplexCaller, int, str]:
    """A session that would stream for ten minutes, SIGTERM (twice if asked): the caller once the server closed
    it, and the server's exit status and log."""
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", workers, "--max-sessions", "2",
                                 "--drain-timeout-s", drain_s)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, workers=int(workers))
            caller = DuplexCaller(url)
            await caller.open()
            stream = asyncio.ensure_future(caller.stream(600.0))
            proc.send_signal(signal.SIGTERM)
            await until_status(http, url, "draining")
            if second_sigterm:
                proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(stream, 60)   # ends when the server closes the session
            out = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
            await caller.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return caller, proc.returncode, out


@pytest.mark.parametrize("workers", ["0", "1"])
async def test_drain_timeout_closes_the_rest_cleanly(tiny_checkpoint, tmp_path, workers):
    caller, code, out = await _live_session_closed_by_the_server(tiny_checkpoint, tmp_path, workers, "2", False)
    assert code == 0, out[-3000:]
    assert caller.closed_event is not None and caller.closed_event["reason"] == "server_shutdown", caller.closed_event
    assert caller.close_code == 1001 and caller.error is None
    assert "drain timeout: closing 1 live sessions" in out, out[-3000:]


@pytest.mark.parametrize("workers", ["0", "1"])
async def test_a_second_sigterm_closes_at_once(tiny_checkpoint, tmp_path, workers):
    # 600 s of drain: the session's end within the 60 s wait is the second signal's doing.
    caller, code, out = await _live_session_closed_by_the_server(tiny_checkpoint, tmp_path, workers, "600", True)
    assert code == 0, out[-3000:]
    assert caller.closed_event is not None and caller.closed_event["reason"] == "server_shutdown"
    assert caller.close_code == 1001
    assert "second signal: closing at once" in out, out[-3000:]


async def test_a_webrtc_call_is_told_on_its_data_channel_when_the_drain_ends(tiny_checkpoint, tmp_path, speech_24k):
    pytest.importorskip("aiortc")
    from webrtc_support import ensure_ice_host_address

    from app.doors.webrtc.client import CallRefused, RealtimeCall

    ensure_ice_host_address()
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", "0", "--max-sessions", "2",
                                 "--drain-timeout-s", "2")
    call = RealtimeCall(url, speech_24k)
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url)
            await call.connect()
            await call.wait_event("session.created")
            proc.send_signal(signal.SIGTERM)
            await until_status(http, url, "draining")
            late = RealtimeCall(url, speech_24k)
            with pytest.raises(CallRefused) as refused:
                await late.connect()
            await late.close()
            assert refused.value.status == 503 and refused.value.error()["code"] == "server_draining"
            assert not any(e["type"] == "session.closed" for e in call.events)   # the live call goes on
            closed = await call.wait_event("session.closed", timeout_s=30)
            assert closed["reason"] == "server_shutdown"
            out = (await asyncio.wait_for(proc.communicate(), 30))[0].decode()
    finally:
        await call.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "drain timeout: closing 1 live sessions" in out, out[-3000:]


async def test_no_engine_means_not_ready_and_agent_down_until_it_is_back(tiny_checkpoint, tmp_path):
    agent_port = free_port()
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", "1", "--max-sessions", "2",
                                 "--agent-port", str(agent_port))
    try:
        async with aiohttp.ClientSession() as http:
            report = await wait_ready(http, url, workers=1)
            engine = next(p for p in report["processes"] if p["role"] == "engine")
            os.kill(engine["pid"], signal.SIGKILL)
            body = await until_status(http, url, "engine_down")
            assert body["ready"] is False
            async with http.get(url + "/health/ready") as r:
                assert r.status == 503
            async with http.get(url + "/health/live") as r:     # the server itself is alive
                assert r.status == 200
            seen = set()
            deadline = time.monotonic() + 90
            while (line := await agent(agent_port)) != "ready up 100%\n":   # down, then back once restarted
                seen.add(line)
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            assert seen <= {"down#engine_down\n", "down#starting\n", "down#no_answer\n"}, seen
            assert "down#engine_down\n" in seen
    finally:
        out = await stop(proc)
    assert proc.returncode == 0, out


def test_agent_answers_for_each_readiness():
    assert agent_answer(readiness("ready", 1, 3)) == "ready up 66%\n"
    assert agent_answer(readiness("ready", 143, 144)) == "ready up 1%\n"   # one slot free still counts
    assert agent_answer(readiness("ready", 3, 3)) == "ready up 0%\n"       # full
    assert agent_answer(readiness("draining", 1, 3)) == "drain\n"
    assert agent_answer(readiness("engine_down")) == "down#engine_down\n"
    assert agent_answer(None) == "down#no_answer\n"
