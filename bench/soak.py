"""Soak and churn: clients of every door open and close without pause for a set time, many of them badly; one JSON
line on what the server did with them and what it kept.

    python -m bench.soak --url http://127.0.0.1:8000 --seconds 1800 --clients 16 [--server-pids PID ...]

`--clients` loops run side by side; each opens one client after another (`bench.doors`, a door by `--mix`) with a
random lifetime (`--min-life-s`..`--max-life-s`) and one behaviour (`--behaviours`):

- `normal`: streams real-time speech, reads everything, closes the door's way;
- `vanish`: streams a while, then writes half of a WebSocket frame and drops the TCP connection (WebRTC: closes
  its peer without hanging up);
- `fast` / `slow`: streams at 3x / 0.5x real time;
- `nonreader`: streams and never reads a byte (its socket's receive side is paused), then drops the connection;
- `hostile`: first sends junk (not JSON, a JSON array, 1000-deep nesting, unknown and mistyped events, bad base64,
  NaN, binary on a JSON dialect, sometimes one message over the size bound), then streams what time is left.

WebRTC clients are `normal` or `vanish`. Reported: clients started, served (heard model audio), refused (no free
slot), failed (the client broke: an exception, by type), per door and behaviour; error codes the clients saw and the
server counted (`/metrics`), and any outside the codes these behaviours should draw (`unexplained_errors`); leaked
slots (`/health` still counting sessions in use `--settle-s` after the last client left: must be 0); per server
process (`/health`'s `processes`, or `--server-pids`, on this machine) resident memory and open file descriptors at
the start, after `--warmup-s`, at the peak, at the end and at each tenth of the run; ticks, late ticks and tick
quantiles over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import struct
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from bench.doors import DOORS, RATE, DoorClient, WebRTCClient, WebSocketDoor, client_session, speech
from bench.e2e import PERSONA, add_common, cli
from bench.server_probe import open_fds, rss_mb, server_report, server_snapshot

BEHAVIOURS = "normal=0.4,vanish=0.15,fast=0.1,slow=0.1,nonreader=0.1,hostile=0.15"
PACE = {"fast": 3.0, "slow": 0.5}
# What the behaviours above should draw from a correct server; anything else is a finding.
EXPECTED_CODES = frozenset({
    "resource_exhausted", "invalid_json", "bad_event", "unknown_event", "unsupported_event", "event_too_large",
    "binary_unsupported", "bad_audio", "input_backpressure", "rate_limited", "output_backpressure",
    "session_not_created", "invalid_session_config",
})


def parse_weights(text: str) -> dict[str, float]:
    weights = {k.strip(): float(v) for k, _, v in (part.partition("=") for part in text.split(","))}
    unknown = set(weights) - {"normal", "vanish", "fast", "slow", "nonreader", "hostile"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown behaviours: {sorted(unknown)}")
    return weights


@dataclass
class Outcome:
    door: str
    behaviour: str
    lifetime_s: float
    opened: bool = False
    refused: str | None = None
    heard_audio: bool = False
    error_codes: list[str] = field(default_factory=list)
    failed: str | None = None


def hostile_messages(door: str, max_message_bytes: int, rng: random.Random) -> list[str | bytes]:
    """Junk a broken or hostile client sends on this door; the last one may be over the size bound (a close)."""
    deep = '{"type": "session.update", "session": ' + "[" * 1000 + "]" * 1000 + "}"
    msgs: list[str | bytes] = ["not json {", "[1, 2, 3]", deep, '{"type": 5}', '{"type": "no.such.event"}']
    if door == "twilio":
        msgs += ['{"event": "media", "media": {"payload": "@@not base64@@"}}', '{"event": "mark"}',
                 '{"event": "dtmf", "dtmf": {"digit": 7}}']
    else:
        msgs += ['{"type": "input_audio_buffer.append", "audio": "@@not base64@@"}',
                 '{"type": "playback.ack", "played_ms": NaN}', '{"type": "session.heartbeat", "x": 1e400}']
    msgs.append(bytes(rng.getrandbits(8) for _ in range(333)))
    if rng.random() < 0.3:
        msgs.append("x" * (max_message_bytes + 1))
    return msgs


def half_a_frame(payload_len: int = 3840) -> bytes:
    """The first half of a masked binary WebSocket frame of `payload_len` bytes (the header says all of it)."""
    header = bytes([0x82, 0x80 | 126]) + struct.pack(">H", payload_len) + b"\x01\x02\x03\x04"
    return header + b"\x00" * (payload_len // 2)


def transport_of(client: WebSocketDoor) -> asyncio.Transport | None:
    conn = getattr(client.ws, "_conn", None)        # aiohttp keeps the connection on the response
    return getattr(conn, "transport", None)


async def run_client(http: aiohttp.ClientSession, url: str, door: str, behaviour: str, lifetime_s: float,
                     audio: np.ndarray, max_message_bytes: int, rng: random.Random) -> Outcome:
    out = Outcome(door, behaviour, round(lifetime_s, 2))
    clip = np.roll(audio, rng.randrange(audio.size))[: max(1, int(lifetime_s * RATE) // 1920) * 1920]
    client: DoorClient = WebRTCClient("soak", url, {}, PERSONA, audio=clip) if door == "webrtc" else \
        DOORS[door]("soak", url, {}, PERSONA)
    try:
        refused = await client.open(http)
        if refused is not None:
            out.refused = str(refused.get("error", {}).get("code", refused.get("type")))
            return out
        out.opened = True
        if isinstance(client, WebRTCClient):
            await client.stream(clip, time.monotonic())
            await (client.call.close() if behaviour == "vanish" else client.close())
            client.take_recording()
        else:
            await drive_websocket(client, behaviour, clip, max_message_bytes, rng)
    except Exception as e:    # a client that breaks is counted, the soak goes on
        out.failed = type(e).__name__
    out.heard_audio = client.first_audio_at is not None
    out.error_codes = [str(ev.get("error", {}).get("code")) for ev in client.errors]
    if out.refused is None and "resource_exhausted" in out.error_codes:   # Twilio learns of a full server late
        out.refused, out.opened = "resource_exhausted", False
    return out


async def drive_websocket(client: WebSocketDoor, behaviour: str, clip: np.ndarray, max_message_bytes: int,
                          rng: random.Random) -> None:
    assert client.ws is not None
    if behaviour == "nonreader" and client.reader is not None:
        client.reader.cancel()
        transport = transport_of(client)
        if transport is not None:
            transport.pause_reading()
    if behaviour == "hostile":
        for msg in hostile_messages(client.door, max_message_bytes, rng):
            if client.ws.closed:
                break
            await (client.ws.send_bytes(msg) if isinstance(msg, bytes) else client.ws.send_str(msg))
    if behaviour == "vanish":
        clip = clip[: max(1920, int(clip.size * rng.random()) // 1920 * 1920)]
    if not client.ws.closed:
        # A client that misbehaves may be cut off while it sends: that is the server's answer, not a failure.
        expected = (ConnectionError, aiohttp.ClientConnectionError) if behaviour != "normal" else ()
        with contextlib.suppress(*expected):
            await client.stream(clip, time.monotonic(), PACE.get(behaviour, 1.0))
    if behaviour in ("vanish", "nonreader"):
        transport = transport_of(client)
        if transport is not None:
            if behaviour == "vanish":
                transport.write(half_a_frame())
            transport.abort()
        if client.reader is not None:
            client.reader.cancel()
        with contextlib.suppress(Exception):    # the socket is gone: this only lets aiohttp let go of it
            await client.ws.close()
        return
    await asyncio.sleep(0.2)
    await asyncio.wait_for(client.close(), 15)


@dataclass
class Sampler:
    """Resident memory and open descriptors of each server process, sampled every `every_s`."""

    pids: dict[int, str]
    every_s: float = 0.5
    rss: dict[int, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    fds: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: defaultdict(list))

    def sample(self) -> None:
        now = time.monotonic()
        for pid in self.pids:
            r, f = rss_mb(pid), open_fds(pid)
            if r is not None:
                self.rss[pid].append((now, r))
            if f is not None:
                self.fds[pid].append((now, f))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(self.every_s)

    def report(self, warm_at: float) -> list[dict[str, Any]]:
        def span(series: list[tuple[float, float]]) -> dict[str, Any] | None:
            if not series:
                return None
            warm = next((v for t, v in series if t >= warm_at), series[-1][1])
            # The value at each tenth of the run: whether what grew keeps growing or levels off.
            first, last = series[0][0], series[-1][0]
            tenths = [next(v for t, v in series if t >= first + (last - first) * i / 10) for i in range(10)]
            return {"start": series[0][1], "warm": warm, "peak": max(v for _, v in series), "end": series[-1][1],
                    "by_tenth": [*tenths, series[-1][1]]}
        return [{"pid": pid, "role": role, "rss_mb": span(self.rss[pid]), "fds": span(self.fds[pid])}
                for pid, role in self.pids.items()]


def tally(outcomes: list[Outcome]) -> dict[str, Any]:
    return {"started": len(outcomes), "opened": sum(o.opened for o in outcomes),
            "served": sum(o.heard_audio for o in outcomes), "refused": sum(o.refused is not None for o in outcomes),
            "failed": sum(o.failed is not None for o in outcomes),
            "errors_by_code": dict(Counter(code for o in outcomes for code in o.error_codes))}


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    audio = speech(args.wav, 20.0)
    pids = {pid: "given" for pid in args.server_pids}
    outcomes: list[Outcome] = []
    end = time.monotonic() + args.seconds
    doors, door_w = zip(*args.mix.items())
    behaviours, beh_w = zip(*args.behaviours.items())

    async def loop(k: int, http: aiohttp.ClientSession) -> None:
        rng = random.Random(args.seed * 1000 + k)
        while time.monotonic() < end:
            door = rng.choices(doors, door_w)[0]
            behaviour = rng.choices(behaviours, beh_w)[0]
            if door == "webrtc" and behaviour not in ("normal", "vanish"):
                behaviour = "normal"
            life = min(rng.uniform(args.min_life_s, args.max_life_s), max(0.5, end - time.monotonic()))
            outcomes.append(await run_client(http, args.url, door, behaviour, life, audio, args.max_message_bytes,
                                             rng))
            await asyncio.sleep(rng.uniform(0.0, args.gap_s))

    async with client_session() as http:
        before = await server_snapshot(http, args.url, pids)
        sampler = Sampler(pids)
        stop = asyncio.Event()
        sampling = asyncio.ensure_future(sampler.run(stop))
        warm_at = time.monotonic() + args.warmup_s
        await asyncio.gather(*(loop(k, http) for k in range(args.clients)))
        settle_end = time.monotonic() + args.settle_s
        in_use = -1
        while time.monotonic() < settle_end:
            async with http.get(args.url + "/health") as res:
                in_use = (await res.json()).get("sessions", {}).get("in_use", -1)
            if in_use == 0:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        stop.set()
        await sampling
        sampler.sample()
        after = await server_snapshot(http, args.url, pids)
    server = server_report(before, after, pids)
    seen = Counter(code for o in outcomes for code in o.error_codes)
    codes = set(seen) | set(server["errors_by_code"]) | set(server["rejections_by_code"])
    by = defaultdict(list)
    for o in outcomes:
        by[(o.door, o.behaviour)].append(o)
    return {
        "bench": "soak", "url": args.url, "seconds": args.seconds, "clients": args.clients, "mix": args.mix,
        "behaviours": args.behaviours, "seed": args.seed, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sessions": tally(outcomes),
        "by_door_behaviour": {f"{d}/{b}": tally(v) for (d, b), v in sorted(by.items())},
        "failures": dict(Counter(o.failed for o in outcomes if o.failed)),
        "leaked_slots": in_use,
        "client_errors_by_code": dict(seen),
        "unexplained_errors": sorted(codes - EXPECTED_CODES),
        "processes": sampler.report(warm_at),
        "server": server,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--clients", type=int, default=6, help="client loops at once")
    p.add_argument("--behaviours", type=parse_weights, default=parse_weights(BEHAVIOURS), help=BEHAVIOURS)
    p.add_argument("--min-life-s", type=float, default=1.0)
    p.add_argument("--max-life-s", type=float, default=12.0)
    p.add_argument("--gap-s", type=float, default=0.5, help="a loop waits up to this between clients")
    p.add_argument("--warmup-s", type=float, default=15.0, help="when the 'warm' memory and fd figures are read")
    p.add_argument("--settle-s", type=float, default=10.0, help="how long freed slots may take after the last client")
    p.add_argument("--max-message-bytes", type=int, default=4 << 20, help="the server's message size bound")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    return cli(build_parser(), soak, argv)


if __name__ == "__main__":
    raise SystemExit(main())
