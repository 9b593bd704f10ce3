"""A fleet behind a real HAProxy running deploy/haproxy.cfg: two servers on the tiny model on loopback ports.

One server runs in one process (`--workers 0`), the other as supervisor, engine and one worker (`--workers 1`);
both answer HAProxy's agent check. A WebRTC call's follow-up requests reach the server holding the call; sessions
spread over both; a full server gets no new session; SIGTERM on one lets its live sessions run to their end while
new ones land on the other, and it exits 0; started again (a rolling upgrade), it takes sessions again; the other
killed outright, its clients' sockets close and new sessions go to the survivor. Every session opened through
HAProxy is admitted: none is refused while the fleet has a free slot.
The drain's timeline is printed (`pytest -s`) and kept as the test's `drain_timeline` property.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from process_support import ROOT, DuplexCaller, free_port, open_call, start_tiny, wait_ready

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="the haproxy binary is not installed (Debian: apt-get install haproxy; "
                                       ".ci/run installs it)")

# Room for the worst placement: up to 3 of the first 4 sessions on gpu1, then 2 more while gpu2 drains.
MAX_SESSIONS = 5


@dataclass
class Instance:
    name: str           # its `server` name in deploy/haproxy.cfg
    port: int
    agent_port: int
    flags: tuple[str, ...]
    proc: asyncio.subprocess.Process | None = None
    output: bytearray = field(default_factory=bytearray)
    _reader: asyncio.Future | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, tiny_checkpoint: Path, tmp_path: Path) -> None:
        self.proc, _ = await start_tiny(tiny_checkpoint, tmp_path / self.name, "--max-sessions", str(MAX_SESSIONS),
                                        "--agent-port", str(self.agent_port), *self.flags, port=self.port)
        self.output.clear()
        self._reader = asyncio.ensure_future(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Its log, read as it comes (HAProxy's checks fill the access log: an unread pipe would stall it)."""
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            self.output += chunk

    async def exited(self) -> tuple[int, str]:
        """Its exit status and log, once it exits."""
        assert self.proc is not None and self._reader is not None
        code = await self.proc.wait()
        await self._reader
        return code, self.output.decode(errors="replace")

    async def in_use(self, http: aiohttp.ClientSession) -> int:
        async with http.get(self.url + "/health/ready", headers={"Connection": "close"}) as r:
            return (await r.json())["sessions"]["in_use"]


@dataclass
class Timeline:
    start: float = field(default_factory=time.monotonic)
    events: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.start:7.2f} s  {what}")

    def __str__(self) -> str:
        return "\n".join(self.events)


async def haproxy_servers(admin: Path) -> dict[str, dict[str, str]]:
    """HAProxy's own view of the backend's servers (the runtime API's `show stat`): status, weight, sessions."""
    reader, writer = await asyncio.open_unix_connection(str(admin))
    writer.write(b"show stat\n")
    await writer.drain()
    text = (await reader.read()).decode()
    writer.close()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {row["svname"]: row for row in rows if row["pxname"] == "personaplex" and row["svname"] != "BACKEND"}


async def until_haproxy(admin: Path, name: str, status: str, weight: str | None = None) -> None:
    """Until HAProxy shows the server in `status` with `weight` ("+": any above 0)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            row = (await haproxy_servers(admin)).get(name, {})
        except OSError as e:   # HAProxy is still starting
            row = {"error": str(e)}
        if row.get("status", "").startswith(status) and (weight is None or row.get("weight") == weight or (
                weight == "+" and row.get("weight", "0") != "0")):
            return
        assert time.monotonic() < deadline, (name, status, weight, {k: row.get(k) for k in (
            "status", "weight", "check_status", "agent_status", "error")})
        await asyncio.sleep(0.1)


async def open_via(http: aiohttp.ClientSession, lb: str, fleet: list[Instance]) -> tuple[DuplexCaller, Instance]:
    """A session through HAProxy (admitted, or the test fails), and the server it landed on (whose slot count
    rose: sessions are opened one at a time and hold their slot from `session.created` on)."""
    before = {i.name: await i.in_use(http) for i in fleet}
    caller = DuplexCaller(lb)
    await caller.open()
    after = {i.name: await i.in_use(http) for i in fleet}
    landed = [i for i in fleet if after[i.name] == before[i.name] + 1]
    assert len(landed) == 1, (before, after)
    return caller, landed[0]


async def check_call_routing(http: aiohttp.ClientSession, lb: str, fleet: list[Instance]) -> None:
    aiortc = pytest.importorskip("aiortc")
    pc = aiortc.RTCPeerConnection()
    try:
        headers = await open_call(http, lb, pc)
        location, served_by = headers["Location"], headers["X-Personaplex-Server"]
        for _ in range(6):
            async with http.get(lb + location, headers={"Connection": "close"}) as r:
                assert r.status == 200 and r.headers["X-Personaplex-Server"] == served_by, await r.text()
        async with http.delete(lb + location, headers={"Connection": "close"}) as r:
            assert r.status == 204
        deadline = time.monotonic() + 10
        while sum([await i.in_use(http) for i in fleet]):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        await pc.close()


async def test_a_fleet_behind_haproxy_spreads_fills_drains_and_survives_a_kill(tiny_checkpoint, tmp_path,
                                                                               record_property):
    a = Instance("gpu1", free_port(), free_port(), ("--workers", "0"))
    b = Instance("gpu2", free_port(), free_port(), ("--workers", "1", "--drain-timeout-s", "30"))
    lb_port, admin = free_port(), tmp_path / "haproxy.sock"
    env = {**os.environ, "PERSONAPLEX_LB_BIND": f"127.0.0.1:{lb_port}", "HAPROXY_ADMIN_SOCKET": str(admin),
           "PERSONAPLEX_SERVER_1": f"127.0.0.1:{a.port}", "PERSONAPLEX_AGENT_1": str(a.agent_port),
           "PERSONAPLEX_SERVER_2": f"127.0.0.1:{b.port}", "PERSONAPLEX_AGENT_2": str(b.agent_port)}
    lb = f"http://127.0.0.1:{lb_port}"
    timeline = Timeline()
    callers: list[DuplexCaller] = []
    streams: list[asyncio.Future] = []
    haproxy = None
    try:
        await asyncio.gather(a.start(tiny_checkpoint, tmp_path), b.start(tiny_checkpoint, tmp_path))
        log = (tmp_path / "haproxy.log").open("wb")
        haproxy = await asyncio.create_subprocess_exec(
            "haproxy", "-db", "-f", str(ROOT / "deploy" / "haproxy.cfg"), env=env,
            stdout=log, stderr=asyncio.subprocess.STDOUT)
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(wait_ready(http, a.url), wait_ready(http, b.url, workers=1))
            for instance in (a, b):
                await until_haproxy(admin, instance.name, "UP", "100")
            timeline.note("both servers up in HAProxy, weight 100")

            def keep(caller: DuplexCaller, seconds: float) -> None:
                callers.append(caller)
                streams.append(asyncio.ensure_future(caller.stream(seconds)))

            # 0. A WebRTC call's follow-up requests reach the server that holds it (HAProxy's stick table on the
            # call's Location), though least connections would send a fresh request to the other one.
            await check_call_routing(http, lb, [a, b])
            timeline.note("a WebRTC call's GET and DELETE all reached its server")

            # 1. Sessions spread over both.
            placed: dict[str, list[DuplexCaller]] = {a.name: [], b.name: []}
            for _ in range(4):
                caller, where = await open_via(http, lb, [a, b])
                placed[where.name].append(caller)
                keep(caller, 120.0)
            assert placed[a.name] and placed[b.name], {k: len(v) for k, v in placed.items()}

            # 2. A full server receives no new session: fill gpu1 directly, then ask HAProxy.
            direct = []
            for _ in range(MAX_SESSIONS - await a.in_use(http)):
                direct.append(DuplexCaller(a.url))
                await direct[-1].open()
            await until_haproxy(admin, a.name, "UP", "0")     # the agent's "ready up 0%"
            timeline.note("gpu1 full: HAProxy weight 0")
            caller, where = await open_via(http, lb, [a, b])
            assert where is b
            placed[b.name].append(caller)
            keep(caller, 120.0)
            for caller in direct:
                await caller.close()
            await until_haproxy(admin, a.name, "UP", "+")     # the agent's next answer tells the freed slots
            timeline.note("gpu1's direct sessions closed: HAProxy weight above 0 again")

            # 3. SIGTERM on gpu2: its live sessions run on to their end, new ones land on gpu1, it exits 0.
            draining = placed[b.name]
            at_term = {id(c): len(c.frames) for c in draining}
            assert b.proc is not None
            b.proc.send_signal(signal.SIGTERM)
            timeline.note(f"SIGTERM to gpu2 ({len(draining)} live sessions on it)")
            caller, where = await open_via(http, lb, [a, b])      # at once, before HAProxy has heard
            timeline.note(f"a session opened right after the SIGTERM: admitted on {where.name}")
            (placed[where.name] if where is a else draining).append(caller)
            keep(caller, 120.0)
            await until_haproxy(admin, b.name, "DRAIN")
            timeline.note("HAProxy: gpu2 DRAIN (agent said drain)")
            caller, where = await open_via(http, lb, [a, b])
            assert where is a
            placed[a.name].append(caller)
            keep(caller, 120.0)
            timeline.note("a new session while gpu2 drains: admitted on gpu1")
            # The drained sessions go on meanwhile, 10 frames each at least (an engine below real time on a loaded
            # machine needs longer than the 0.8 s they take in real time) ... and end by themselves.
            deadline = time.monotonic() + 15.0  # well inside gpu2's 30 s drain timeout
            while any(len(c.frames) <= at_term.get(id(c), 0) + 10 for c in draining) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            for caller in draining:
                assert not caller.ended and caller.error is None and caller.closed_event is None
                assert len(caller.frames) > at_term.get(id(caller), 0) + 10 and caller.gaps() == []
                await caller.close()
            timeline.note(f"gpu2's {len(draining)} sessions ended by their clients, every frame received")
            code, out = await asyncio.wait_for(b.exited(), 60)
            assert code == 0 and "drained" in out, out[-3000:]
            timeline.note("gpu2 drained and exited 0")

            # 4. gpu2 comes back (the upgrade); gpu1 is killed outright: its clients' sockets close, new sessions
            # go to gpu2.
            await b.start(tiny_checkpoint, tmp_path)
            await wait_ready(http, b.url, workers=1)
            await until_haproxy(admin, b.name, "UP", "100")
            timeline.note("gpu2 started again: HAProxy UP, weight 100 (the agent's ready cancels the drain)")
            assert a.proc is not None
            a.proc.kill()
            await a.proc.wait()
            timeline.note(f"gpu1 killed outright ({len(placed[a.name])} live sessions on it)")
            for caller in placed[a.name]:
                deadline = time.monotonic() + 30
                while not caller.ended:
                    assert time.monotonic() < deadline, "a killed server's client was left hanging"
                    await asyncio.sleep(0.05)
            codes = sorted({str(c.close_code) for c in placed[a.name]})
            timeline.note(f"every gpu1 client saw its socket close (WebSocket close code {', '.join(codes)})")
            survivors = []
            for _ in range(2):
                caller, where = await open_via(http, lb, [b])
                survivors.append(caller)
                keep(caller, 2.0)
            timeline.note("two new sessions admitted on gpu2")
            await asyncio.gather(*streams[-2:])
            for caller in survivors:
                assert caller.error is None and caller.frames and caller.gaps() == []
    finally:
        print("\ndrain timeline:\n" + str(timeline))
        record_property("drain_timeline", str(timeline))
        for stream in streams:
            stream.cancel()
        for caller in callers:
            await caller.close()
        for proc in (a.proc, b.proc, haproxy):   # SIGINT: a server closes at once, no drain
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM if proc is haproxy else signal.SIGINT)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
