"""Webhooks (`--webhook-url`, `--webhook-secret`): a real HTTP receiver on loopback gets `call.started` and
`call.ended` for a Twilio call (the fake Twilio of tests/twilio_fake.py), signed, in order, though it was down when the
call began; what a stopped server could not deliver is delivered by the next one from the spool; and a worker killed
outright mid-call (kill -9) still has its call reported ended, `worker_lost`, with its recording playable up to the
kill. The backoff is made short (`--webhook-backoff-max-s`) so that minutes of a receiver being down take seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from process_support import free_port, health, start_tiny, stop, wait_ready
from server_support import eventually
from twilio_fake import FakeTwilio

from app.calls.webhooks import SIGNATURE_HEADER, sign, verify

SECRET = "whsec-test-secret"
ADMIN = "admin-key-for-tests"


@dataclass
class Receiver:
    """The customer's endpoint: keeps each event with its arrival time and whether its signature verified."""

    port: int = field(default_factory=free_port)
    events: list[tuple[float, dict[str, Any], bool]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    async def up(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            body = await request.read()
            self.events.append((time.monotonic(), json.loads(body),
                                verify(SECRET, request.headers.get(SIGNATURE_HEADER, ""), body)))
            return web.Response(status=204)
        app = web.Application()
        app.router.add_post("/hooks", hook)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def down(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def kinds(self) -> list[str]:
        return [event["type"] for _, event, _ in self.events]


async def twilio_call(url: str, seconds: float, **params: str) -> FakeTwilio:
    """A Twilio call of `seconds` of caller audio, stopped (hung up) at the end."""
    session = aiohttp.ClientSession()
    ws = await session.ws_connect(url.replace("http", "ws") + "/v1/twilio")
    twilio = FakeTwilio(ws)
    await twilio.start(**params)
    await twilio.speak(np.zeros(int(8000 * seconds), np.float32))
    await twilio.stop()
    twilio.close()
    await session.close()
    return twilio


def test_a_signature_verifies_with_its_secret_only():
    body = b'{"type": "call.started"}'
    header = sign(SECRET, int(time.time()), body)
    assert verify(SECRET, header, body)
    assert not verify("a-wrong-secret", header, body)
    assert not verify(SECRET, header, body + b" ")                          # the body was changed
    assert not verify(SECRET, sign(SECRET, int(time.time()) - 3600, body), body)   # too old: a replay
    assert not verify(SECRET, "v1=deadbeef", body)


async def test_a_receiver_down_when_the_call_starts_gets_both_events_in_order(start_server, tmp_path):
    receiver = Receiver()
    server = await start_server(webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_max_s=0.4,
                                spool_dir=tmp_path / "spool")
    began = time.monotonic()
    call = asyncio.ensure_future(twilio_call(server.url, 3.0, call_sid="CA9"))
    await asyncio.sleep(1.5)                           # down for the first half of the call: tries fail, then wait
    assert receiver.events == []
    await receiver.up()
    try:
        await call
        await eventually(lambda: len(receiver.events) == 2, 10, "both events")
    finally:
        await receiver.down()
    (at_start, started, ok1), (at_end, ended, ok2) = receiver.events
    assert [started["type"], ended["type"]] == ["call.started", "call.ended"] and ok1 and ok2
    assert started["data"]["call"]["id"] == ended["data"]["call"]["id"]
    assert started["data"]["call"]["caller"]["call_sid"] == "CA9"
    assert ended["data"]["call"]["end_reason"] == "stop" and ended["data"]["call"]["stats"]["frames_out"] > 0
    assert at_start - began >= 1.5 and at_end >= at_start
    assert server.ctx.metrics.webhooks["webhooks_retried"] >= 2
    assert server.ctx.metrics.webhooks["webhooks_delivered"] == 2
    assert list((tmp_path / "spool" / "webhooks").glob("*.json")) == []   # delivered: gone from the spool


async def test_what_a_stopped_server_could_not_deliver_the_next_one_delivers(start_server, tmp_path):
    receiver = Receiver()
    spool = tmp_path / "spool"
    first = await start_server(webhook_url=receiver.url, webhook_secret=SECRET, webhook_backoff_max_s=0.2,
                               spool_dir=spool)
    await twilio_call(first.url, 0.5, call_sid="CA1")
    await first.stop()
    assert len(list((spool / "webhooks").glob("*.json"))) == 2         # both waiting on the disk
    await receiver.up()
    try:
        await start_server(webhook_url=receiver.url, webhook_secret=SECRET, spool_dir=spool)
        await eventually(lambda: len(receiver.events) == 2, 10, "the spooled events")
    finally:
        await receiver.down()
    assert receiver.kinds() == ["call.started", "call.ended"] and all(ok for _, _, ok in receiver.events)


async def test_a_worker_killed_mid_call_leaves_a_playable_recording_and_call_ended_worker_lost(tiny_checkpoint,
                                                                                              tmp_path):
    """Two workers: the live-call list shows the call from either; the worker holding it is killed (-9); the one
    started in its place reports the call ended (`worker_lost`) and completes its call.json; the recording holds
    the call up to the kill, less at most its last second."""
    import av

    receiver = Receiver()
    await receiver.up()
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", "2", "--record-dir", str(tmp_path / "rec"),
                                 "--spool-dir", str(tmp_path / "spool"), "--webhook-url", receiver.url,
                                 "--webhook-secret", SECRET, "--webhook-backoff-max-s", "0.3", "--admin-key", ADMIN)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            await wait_ready(http, url, workers=2)
            ws = await http.ws_connect(url.replace("http", "ws") + "/v1/twilio")
            twilio = FakeTwilio(ws)
            await twilio.start(call_sid="CA-kill")
            speaking = asyncio.ensure_future(twilio.speak(np.zeros(8000 * 60, np.float32)))
            await eventually(lambda: receiver.kinds() == ["call.started"], 30, "call.started")

            async def listed() -> list[dict[str, Any]]:
                async with http.get(url + "/v1/calls", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                    return (await r.json())["data"]
            for _ in range(4):   # new connections land on either worker: each lists it, once it has heard (from the
                # engine's stats, a moment after start) that the other worker exists to ask
                [call] = await eventually(listed, 10, "the call in the live list")
            assert call["caller"]["call_sid"] == "CA-kill"
            await eventually(lambda: len(twilio.received) >= 150, 30, "three seconds of the model's audio")
            report = await health(http, url)
            victim = next(p for p in report["processes"]
                          if p["role"] == "worker" and p["worker"] == int(call["worker"]))
            [live] = await listed()
            os.kill(victim["pid"], signal.SIGKILL)
            made_s = live["stats"]["frames_out"] * 0.08
            await eventually(lambda: receiver.kinds() == ["call.started", "call.ended"], 60, "call.ended")
            speaking.cancel()
            twilio.close()
    finally:
        out = await stop(proc)
        await receiver.down()
    ended = receiver.events[1][1]["data"]["call"]
    assert ended["id"] == call["id"] and ended["end_reason"] == "worker_lost"
    assert all(ok for _, _, ok in receiver.events)
    folder = tmp_path / "rec"
    [facts_path] = list(folder.rglob("call.json"))
    facts = json.loads(facts_path.read_text())
    assert facts["end_reason"] == "worker_lost" and facts["call_id"] == call["id"]
    with av.open(str(facts_path.parent / "audio.ogg")) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        assert stream.channels == 2
        played = samples / stream.rate
    # Up to the kill, less at most its last second: the model's audio the call had got just before it, by its live
    # stats. Not what the fake Twilio had got: where the engine falls behind real time (a loaded machine) the door
    # fills the gaps with silence (`out_silence_ms`), which reaches the caller but is no frame of the call's timeline.
    assert made_s - 1.0 <= played <= made_s + 1.0, (played, live["stats"], out[-2000:])
    assert "was live in a process that died" in out
