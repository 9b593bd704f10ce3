"""The native dialect's `session.link`: what the server measures of the client's link, and the playout buffer it
advises, on a clean loopback and behind a far link (bench/impair.py's TCP relay), side by side on one server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from bench.doors import FRAME, RATE, client_session
from bench.impair import FAR, Link, TcpRelay

SECONDS = 7.0


async def one_call(url: str, speech: np.ndarray) -> list[dict[str, Any]]:
    """A duplex session asking for a link report every second; streams `SECONDS` of speech on the clock."""
    pcm = (np.clip(np.resize(speech, int(SECONDS * RATE)), -1, 1) * 32767).astype("<i2").tobytes()
    reports: list[dict[str, Any]] = []
    async with client_session() as http, http.ws_connect(url) as ws:
        await ws.send_json({"type": "session.create", "session": {"link_report_s": 1}})
        created = await ws.receive_json(timeout=30)
        assert created["type"] == "session.created" and created["session"]["link_report_s"] == 1.0, created

        async def read() -> None:
            async for msg in ws:
                if msg.type.name == "TEXT" and json.loads(msg.data)["type"] == "session.link":
                    reports.append(json.loads(msg.data))

        reader = asyncio.ensure_future(read())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for k in range(len(pcm) // (2 * FRAME)):
            await asyncio.sleep(max(0.0, t0 + k * 0.08 - loop.time()))
            await ws.send_bytes(pcm[k * 2 * FRAME:(k + 1) * 2 * FRAME])
        await ws.send_json({"type": "session.close"})
        await asyncio.wait_for(reader, 10)
    return reports


async def test_session_link_reports_the_link_and_advises_a_playout_buffer(start_server, speech_24k):
    server = await start_server(max_sessions=2)
    relay = await TcpRelay(("127.0.0.1", server.port), FAR, FAR, seed=4).start()
    try:
        clean, far = await asyncio.gather(one_call(server.ws("/v1/duplex"), speech_24k),
                                          one_call(f"ws://127.0.0.1:{relay.port}/v1/duplex", speech_24k))
    finally:
        await relay.close()
    print(json.dumps({"clean": clean[-1], "far": far[-1]}))
    assert len(clean) >= SECONDS - 2 and len(far) >= SECONDS - 2
    for report in clean + far:
        link = report["input"]
        assert report["playout_ms"] >= max(40.0, link["jitter_ms"] + 20.0), report
        assert link["target_ms"] >= 80.0 and link["concealed_ms"] == 0.0, report   # TCP: nothing is lost
    # the far link's +-30 ms jitter is measured (a retransmission's bunch counts once), and the advice grows with it
    up = relay.models[0][0].stats
    assert far[-1]["input"]["jitter_ms"] >= clean[-1]["input"]["jitter_ms"] + 10.0, (far[-1], up.summary())
    assert far[-1]["playout_ms"] > clean[-1]["playout_ms"], (clean[-1], far[-1])


async def test_a_bad_link_report_period_is_refused(server):
    async with client_session() as http, http.ws_connect(server.ws("/v1/duplex")) as ws:
        for bad in (0.1, 120, "1", True):
            await ws.send_json({"type": "session.create", "session": {"link_report_s": bad}})
            error = await ws.receive_json(timeout=10)
            assert error["type"] == "error" and error["error"]["param"] == "session.link_report_s", error


def test_links_without_impairment_are_clean() -> None:
    assert not Link().impaired and FAR.impaired
