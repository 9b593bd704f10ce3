"""Shared pieces of the property-based fuzz suites: hostile JSON and frame strategies, a module-wide server on the
tiny model, a bystander session that must keep being served, and the invariant every client message must meet (a
clear error event with a registered code, or a documented close)."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from conftest import RunningServer, server_settings
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from app.sessions.errors import CODES
from app.shell.server import create_app
from model.loading import load_model

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
               database=None)
MAX_MESSAGE_BYTES = 64 << 10
DOCUMENTED_CLOSES = {1000, 1008, 1009, 1013}   # 1011 is for engine failures: never for what a client sent
HUGE = st.integers(1, 3 * MAX_MESSAGE_BYTES).map(lambda n: "x" * n)

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(10**30), 10**30)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=16)
# Keys the dialects look for inside their objects (session, start, media, mark, dtmf): objects made of these reach
# the validation of each field, not only the "is it an object" check.
NESTED_KEYS = ["instructions", "persona", "voice", "audio", "input", "output", "format", "rate", "type", "pacing",
               "sampling", "temperature", "seed", "greedy", "text_topk", "audio_temperature", "turn_detection",
               "extra_body", "idle_timeout_s", "output_transport", "output_modalities", "input_audio_format",
               "output_audio_format", "streamSid", "mediaFormat", "encoding", "sampleRate", "channels",
               "customParameters", "payload", "track", "name", "digit"]
known_objects = st.recursive(st.dictionaries(st.sampled_from(NESTED_KEYS), json_values, max_size=4),
                             lambda inner: st.dictionaries(st.sampled_from(NESTED_KEYS), inner | json_values,
                                                           max_size=4), max_leaves=8)


def events(type_key: str, types: list[str], fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Events of the dialect's types (and junk types) whose known fields hold arbitrary JSON of any type."""
    kind = st.sampled_from(types) | st.text(max_size=30) | json_values
    return st.builds(lambda k, known, extra: {type_key: k, **known, **extra}, kind,
                     st.dictionaries(st.sampled_from(fields), json_values | known_objects
                                     | HUGE.map(lambda s: s[:2000]), max_size=4),
                     st.dictionaries(st.text(max_size=8), json_values, max_size=2))


def non_finite(event: dict[str, Any]) -> st.SearchStrategy[str]:
    """The event's text with one field set to a non-finite number, as a sloppy client's encoder writes it."""
    return st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999"]).flatmap(
        lambda bad: st.sampled_from(sorted(event) or ["x"]).map(
            lambda key: json.dumps({**event, key: 0}).replace(json.dumps(key) + ": 0", json.dumps(key) + ": " + bad)))


def frames(type_key: str, types: list[str], fields: list[str]) -> st.SearchStrategy[str | bytes]:
    """What a hostile client puts on the wire: events, their truncations, non-finite numbers, deep nesting, huge
    strings, arbitrary text and binary junk."""
    evs = events(type_key, types, fields)
    text = evs.map(json.dumps)
    return st.one_of(
        text,
        text.flatmap(lambda t: st.integers(0, max(0, len(t) - 1)).map(lambda i: t[:i])),   # truncated
        evs.flatmap(non_finite),
        st.integers(33, 3000).map(lambda n: f'{{"{type_key}": "x", "a": ' + "[" * n + "]" * n + "}"),
        st.integers(33, 3000).map(lambda n: "{" + '"a":{' * n + "}" * (n + 1)),
        HUGE.map(lambda s: json.dumps({type_key: s})),
        st.text(max_size=200),
        json_values.map(json.dumps),
        st.binary(max_size=2000),
    )


async def start_fuzz_server(checkpoint: Any) -> RunningServer:
    """The server the fuzz suites share: small messages (huge ones are cheap to send), no event-rate limit (the
    probes must not be dropped), room for a session per dialect beside the bystander."""
    settings_ = server_settings(checkpoint, max_sessions=6, max_message_bytes=MAX_MESSAGE_BYTES,
                                max_events_per_s=100_000.0)
    app = create_app(settings_, model=load_model(str(checkpoint)))
    runner = web.AppRunner(app, shutdown_timeout=settings_.shutdown_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return RunningServer(app=app, runner=runner, port=runner.addresses[0][1])


@dataclass
class Bystander:
    """A live duplex conversation on the same server: it reads everything and must answer a heartbeat at any time."""

    ws: aiohttp.ClientWebSocketResponse
    acks: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    frames: int = 0
    task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, http: aiohttp.ClientSession, server: RunningServer) -> Bystander:
        ws = await http.ws_connect(server.ws("/v1/duplex"))
        await ws.send_json({"type": "session.create", "session": {}})
        created = await ws.receive_json(timeout=30)
        assert created["type"] == "session.created", created
        me = cls(ws)
        me.task = asyncio.ensure_future(me._read())
        return me

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is aiohttp.WSMsgType.BINARY:
                self.frames += 1
            elif msg.type is aiohttp.WSMsgType.TEXT:
                event = json.loads(msg.data)
                if event["type"] == "session.heartbeat_ack":
                    self.acks.put_nowait(event)

    async def assert_served(self) -> None:
        assert not self.ws.closed, f"the bystander was closed ({self.ws.close_code})"
        frames = self.frames
        await self.ws.send_json({"type": "session.heartbeat"})
        await asyncio.wait_for(self.acks.get(), 15)
        assert self.frames >= frames


def check_event(event: dict[str, Any], type_key: str) -> None:
    """Every server event is strict JSON already (parsed by the caller); an error carries a registered code that is
    not a server bug, and never echoes more than a short prefix. Every event is named: by its type, or by `action`
    for Vonage's commands to the platform (`notify`, once a second of audio is sent: seen under load)."""
    if event.get("type") == "error":
        err = event["error"]
        assert err["code"] in CODES and err["code"] != "internal_error", err
        assert len(err["message"]) <= 301 and len(err.get("event_id", "")) <= 65, err
    assert any(event.get(key) is not None for key in ("type", type_key, "action")), event


def strict_json(text: str) -> dict[str, Any]:
    def refuse(name: str) -> Any:
        raise AssertionError(f"the server sent non-standard JSON ({name})")
    value = json.loads(text, parse_constant=refuse)
    assert isinstance(value, dict)
    for number in _numbers(value):
        assert math.isfinite(number)
    return value


def _numbers(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, float) else []
