"""End-to-end load: many sessions over every door at once, spread over several client processes; one JSON line.

    python -m bench.e2e --url http://127.0.0.1:8000 --sessions 144 --seconds 60 --procs 8 \\
        --mix realtime=0.4,webrtc=0.3,twilio=0.2,duplex=0.1 --open burst --burst-s 2 --extra-open \\
        --out docs/bench/h200_e2e.jsonl

Sessions are dealt to the doors by `--mix` (largest remainder), interleaved so that every part of the opening
wave mixes them, and dealt round-robin to `--procs` processes, each one asyncio loop (`bench.doors` clients). Opens:
`--open burst` spreads them evenly over `--burst-s`; `--open steady` opens one every `--interval-ms`. Each session
streams `--seconds` of speech (a wav, else espeak-ng, else a synthetic voice; each session starts at another point of
it) paced in real time from its own open, reads everything, waits `--drain-s`, and closes. `--extra-open`: once the
server counts every session live, one more (`--extra-door`) opens and its first audio is timed (the "one open while
N are live" figure; the server needs a free slot for it).

Reported: per session (`bench.doors`: real-time factor of the received stream, missing frames, output lateness
p50/p99, first audio after the open began; WebRTC adds the call's server-added latency), per door and overall
summaries (worst RTF, most missing frames, worst lateness p99, first audio p50/p99); the server's ticks, late ticks
and tick quantiles (`/health`'s recent window, and from the `/metrics` tick histogram over the run), underruns and
errors by code over the run (`/metrics` before and after); CPU % of each server process (`/health`'s `processes`
and `--server-pids`, read from /proc, so on this machine only) and of the driver's own processes, with each
process's own loop lag (`loop_lag_ms`) and where its loop was when it stalled over 30 ms (`loop_stalls`,
app/shell/loop_lag.py's StallWatch; the latest ones with when they began, `loop_stalls_at`, on the machine's
monotonic clock, whose value at the sessions' origin is `t0_monotonic`), and, per session, the driver's longest
stall around its latest piece (`output_lateness_ms.driver_lag_ms`; `worst_with_driver_stall` counts the sessions
whose worst moment came with a stall of their driver half its size or more). `--out FILE` appends the line.

Far callers: `--impair far` (any `bench.impair.Link` spec) puts `--impaired-share` of each door's sessions (every
other one at 0.5) behind that link both ways, seeded per session: WebSocket doors through a TCP relay in their
client process, WebRTC through a hook in the peer's ICE transport. Every session then also reports what its caller
hears (`hearing`: a fixed-delay player at 80/160/320 ms on the WebSocket doors, a NetEq-like adaptive player on
WebRTC's packets), impaired ones the link's record (`impairment`); WebRTC calls' server counters and the native
dialect's `session.link` give the server's input side. `conditions` summarises clean and impaired per door.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from app.shell.loop_lag import StallWatch
from bench.doors import (
    DOORS,
    RATE,
    DoorClient,
    SipClientDoor,
    TwilioClient,
    WebRTCClient,
    client_session,
    quantiles,
    speech,
)
from bench.impair import FEC_LOSS_PCT, Link, LinkModel, PeerImpairment, TcpRelay, UdpRelay, impair_peer
from bench.impair_report import adaptive_player, fixed_delay_player
from bench.server_probe import server_report, server_snapshot

DEFAULT_MIX = "realtime=0.4,webrtc=0.3,twilio=0.2,duplex=0.1"
PERSONA = "You are a helpful assistant at a restaurant."


@dataclass
class Planned:
    """One session of the run: its door, which process drives it, and when it opens (s after the common start)."""

    index: int
    door: str
    proc: int
    open_at_s: float
    link: str | None = None       # a bench.impair.Link spec: this session's caller is behind it


@dataclass
class ProcJob:
    url: str
    headers: dict[str, str]
    sessions: list[Planned]
    audio: np.ndarray
    seconds: float
    drain_s: float
    seed: int = 0
    sip_port: int | None = None
    admin_key: str | None = None
    piece_ms: float | None = None   # the PCM WebSocket doors' append (None: one 80 ms frame)
    pieces: dict[int, list[bytes]] = field(default_factory=dict)  # per session, made before the start

    def session_audio(self, p: Planned) -> np.ndarray:
        """The job's audio from the session's own point on (each session starts at another), whole frames."""
        return np.roll(self.audio, p.index * RATE // 3)[: int(self.seconds * RATE) // 1920 * 1920]

    def prepare(self) -> None:
        """Every WebSocket session's pieces (resampled and encoded), so that none is made while sessions run; and,
        with WebRTC sessions, aiortc imported and one offer made. The first peer's import held the client process's
        loop 0.4-0.65 s on the H200 host (0.26 s on an idle 2-core machine): every session of that process already
        streaming stalled, and the stall was counted as the server's lateness and first audio."""
        for p in self.sessions:
            if p.door != "webrtc":
                self.pieces[p.index] = make_client(p.door, "", self.url, self.headers, self.session_audio(p),
                                                   piece_ms=self.piece_ms).pieces(self.session_audio(p))
        if any(p.door == "webrtc" for p in self.sessions):
            asyncio.run(warm_webrtc())


async def warm_webrtc() -> None:
    from aiortc import RTCPeerConnection

    peer = RTCPeerConnection()
    peer.addTransceiver("audio")
    await peer.setLocalDescription(await peer.createOffer())
    await peer.close()


def parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in text.split(","):
        door, _, weight = part.partition("=")
        door = door.strip()
        if door not in DOORS:
            raise argparse.ArgumentTypeError(f"unknown door {door!r} (doors: {', '.join(DOORS)})")
        mix[door] = float(weight)
    if sum(mix.values()) <= 0 or min(mix.values()) < 0:
        raise argparse.ArgumentTypeError("mix weights must be >= 0 and not all 0")
    return mix


def deal_doors(mix: dict[str, float], n: int) -> list[str]:
    """`n` doors in the mix's proportions (largest remainder), interleaved by smooth weighted round-robin."""
    total = sum(mix.values())
    exact = {d: n * w / total for d, w in mix.items()}
    counts = {d: int(x) for d, x in exact.items()}
    for d in sorted(exact, key=lambda d: exact[d] - counts[d], reverse=True)[:n - sum(counts.values())]:
        counts[d] += 1
    credit = dict.fromkeys(counts, 0.0)
    left = dict(counts)
    order: list[str] = []
    for _ in range(n):
        for d in credit:
            credit[d] += counts[d] if left[d] else 0
        pick = max((d for d in credit if left[d]), key=lambda d: credit[d])
        credit[pick] -= n
        left[pick] -= 1
        order.append(pick)
    return order


def plan(args: argparse.Namespace) -> list[Planned]:
    doors = deal_doors(args.mix, args.sessions)
    if args.open == "burst":
        offsets = [i * args.burst_s / args.sessions for i in range(args.sessions)]
    else:
        offsets = [i * args.interval_ms / 1000.0 for i in range(args.sessions)]
    seen: dict[str, int] = {}
    links: list[str | None] = []
    for d in doors:          # each door's k-th session is impaired when the share's running count steps
        k = seen[d] = seen.get(d, -1) + 1
        impaired = args.impair is not None and int((k + 1) * args.impaired_share) > int(k * args.impaired_share)
        links.append(args.impair if impaired else None)
    return [Planned(i, d, i % args.procs, t, link) for i, (d, t, link) in enumerate(zip(doors, offsets, links))]


def make_client(door: str, name: str, url: str, headers: dict[str, str], audio: np.ndarray,
                on_answer: Any = None, relay: UdpRelay | None = None, piece_ms: float | None = None) -> DoorClient:
    if door == "webrtc":   # an impaired caller's microphone sends in-band FEC, as a browser's does seeing loss
        return WebRTCClient(name, url, headers, PERSONA, audio=audio, on_answer=on_answer,
                            fec_loss_pct=FEC_LOSS_PCT if on_answer is not None else 0)
    if door == "sip":
        return SipClientDoor(name, url, headers, PERSONA, relay=relay)
    if DOORS[door].any_piece:
        return DOORS[door](name, url, headers, PERSONA, piece_ms=piece_ms)
    return DOORS[door](name, url, headers, PERSONA)


PLAYERS_MS = (80.0, 160.0, 320.0)


def hearing(client: DoorClient) -> dict[str, Any]:
    """What the caller's player made of the model's audio (bench/impair_report.py)."""
    if isinstance(client, WebRTCClient):
        return {"adaptive": adaptive_player(client.call.recording.chunks if client.call else [])}
    return {"fixed": [fixed_delay_player(client.received.times, client.received.ends_s, ms) for ms in PLAYERS_MS]}


class LoopTrace:
    """A driver process's own event loop, sampled every 5 ms: how late each sleep woke, and when. A call whose worst
    output moment came with a stall of this loop measured the driver as much as the server: at full load most calls'
    worst moments fell in their last second, which a server and a driver busy with calls' ends would both explain."""

    PERIOD_S = 0.005
    HELD_MS = 10.0  # a wake-up this late marks a window in which this loop made what it read late

    def __init__(self) -> None:
        self.at: list[float] = []
        self.lag_ms: list[float] = []
        self.stalls = StallWatch()  # where the loop was when a wake-up came over 30 ms late

    async def run(self) -> None:
        self.stalls.start()
        try:
            while True:
                due = time.monotonic() + self.PERIOD_S
                self.stalls.expect(due)
                await asyncio.sleep(self.PERIOD_S)
                now = time.monotonic()
                self.at.append(now)
                self.lag_ms.append(max(0.0, (now - due) * 1000.0))
        finally:
            self.stalls.stop()

    def held(self) -> list[tuple[float, float]]:
        """The windows this loop was held at least HELD_MS: from each such wake-up's due time to a period after it
        woke (what arrived meanwhile was read as it caught up)."""
        return [(at - lag / 1000.0, at + self.PERIOD_S) for at, lag in zip(self.at, self.lag_ms, strict=True)
                if lag >= self.HELD_MS]

    def around(self, t: float, before_s: float = 0.1, after_s: float = 0.05) -> float:
        """The longest stall this loop woke from between `before_s` before t and `after_s` after it, ms."""
        at = np.asarray(self.at)
        near = np.asarray(self.lag_ms)[(at >= t - before_s) & (at <= t + after_s)]
        return round(float(near.max()), 1) if near.size else 0.0

    def summary(self, t0: float) -> dict[str, float]:
        if not self.lag_ms:
            return {}
        worst = int(np.argmax(self.lag_ms))
        return {**quantiles(self.lag_ms), "max_at_s": round(self.at[worst] - t0, 2)}


def hear(calls: list[tuple[dict[str, Any], DoorClient]], trace: LoopTrace | None = None) -> None:
    """Each ended call's report gets what its caller heard (`run_session`'s `to_hear`) and, with the process's
    `trace`, the driver's own longest stall around the call's latest piece (`output_lateness_ms.driver_lag_ms`) and
    the call's lateness p99 without the pieces read while the driver's loop was held
    (`output_lateness_ms.p99_outside_driver_stalls`; a SIP call's arrivals are the kernel's, none left out)."""
    held = trace.held() if trace is not None else []
    for report, client in calls:
        report["hearing"] = hearing(client)
        latest = client.received.latest_at()
        if trace is not None and latest is not None:
            lateness = report["output_lateness_ms"]
            lateness["driver_lag_ms"] = trace.around(latest)
            lateness["p99_outside_driver_stalls"] = client.received.lateness_p99_outside(
                [] if client.kernel_stamped else held)


def impairment(models: tuple[LinkModel, LinkModel], peer: PeerImpairment | None, spec: str) -> dict[str, Any]:
    up, down = models
    out = {"link": spec, "up": up.stats.summary(), "down": down.stats.summary()}
    if peer is not None:
        out["rtp_lost_ms"] = 20.0 * len(peer.rtp_lost_at)
    elif not up.reliable:
        out["rtp_lost_ms"] = 20.0 * up.stats.lost          # a SIP call's relay carries its RTP only
    return out


async def run_session(http: aiohttp.ClientSession, job: ProcJob, p: Planned, t0: float,
                      to_hear: list[tuple[dict[str, Any], DoorClient]]) -> dict[str, Any]:
    """Open at its time (behind its link, if any), stream, drain, close; its report (or why it has none). What its
    caller heard is worked out once every session of the process has ended (`to_hear`): WebRTC's adaptive player
    replays the whole call through a jitter buffer (~50-80 ms of this loop's time a call), and run as each call
    ended it stalled the calls still streaming beside it (their send and output lateness, at 250 sessions, up to
    200 ms in the last seconds of every call)."""
    await asyncio.sleep(max(0.0, t0 + p.open_at_s - time.monotonic()))
    audio = job.session_audio(p)
    link = Link.parse(p.link) if p.link else None
    seed = job.seed + 10 * p.index
    relay: TcpRelay | None = None
    udp: UdpRelay | None = None
    peers: list[PeerImpairment] = []
    url, on_answer = job.url, None
    if link is not None and p.door == "webrtc":
        def on_answer(pc: Any) -> None:
            peers.append(impair_peer(pc, link, link, seed))
    elif link is not None and p.door == "sip":
        udp = await UdpRelay(link, link, seed).start()
    elif link is not None:
        target = urlsplit(job.url)
        relay = await TcpRelay((target.hostname or "127.0.0.1", target.port or 80), link, link, seed).start()
        url = f"http://127.0.0.1:{relay.port}"
    client = make_client(p.door, f"{p.door}{p.index}", url, job.headers, audio, on_answer, udp, job.piece_ms)
    extra: dict[str, Any] = {}
    listened = False
    try:
        refused = await client.open(http)
        if refused is not None:
            return {"index": p.index, "door": p.door, "link": p.link, "name": client.name,
                    "refused": refused.get("error", refused)}
        await client.stream(audio, time.monotonic(), pieces=job.pieces.get(p.index))
        await client.wait_output(job.drain_s)
        listened = True
        await asyncio.wait_for(client.close(), 15)
    except Exception as e:   # one broken session is a finding of the run, not the end of it
        return {"index": p.index, "link": p.link, **client.report(), "failed": repr(e)}
    finally:
        if relay is not None:
            await relay.close()
        if udp is not None:
            udp.close()
    if p.link is not None:
        models = (peers[0].up, peers[0].down) if peers else (udp.up_model, udp.down_model) if udp else \
            relay.models[0] if relay and relay.models else None
        if models is not None:
            extra["impairment"] = impairment(models, peers[0] if peers else None, p.link)
    report = {"index": p.index, "open_at_s": p.open_at_s, "link": p.link, **client.report(), **extra}
    if listened:
        to_hear.append((report, client))
    return report


def rusage_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_proc(job: ProcJob, t0: float) -> dict[str, Any]:
    c0, w0 = rusage_cpu_s(), time.monotonic()
    to_hear: list[tuple[dict[str, Any], DoorClient]] = []
    trace = LoopTrace()
    sampling = asyncio.ensure_future(trace.run())
    try:
        async with client_session() as http:
            reports = await asyncio.gather(*(run_session(http, job, p, t0, to_hear) for p in job.sessions))
    finally:
        sampling.cancel()
        trace.stalls.stop()  # now: the players' replays below hold the loop before the cancel reaches the task
    wall = time.monotonic() - w0
    cpu_pct = round(100.0 * (rusage_cpu_s() - c0) / wall, 1)  # the calls', not the players' replays after them
    hear(to_hear, trace)
    return {"pid": os.getpid(), "sessions": len(job.sessions), "wall_s": round(wall, 2), "cpu_pct": cpu_pct,
            "loop_lag_ms": trace.summary(t0), "loop_stalls": trace.stalls.sites(),
            "loop_stalls_at": trace.stalls.recent(), "reports": reports}


def proc_main(conn: Connection, job: ProcJob) -> None:
    """A client process: prepare its sessions' audio, say it is ready, take the common start time, run its
    sessions, send back the reports."""
    SipClientDoor.sip_port = job.sip_port
    TwilioClient.admin_key = job.admin_key
    job.prepare()
    conn.send("ready")
    t0 = conn.recv()
    conn.send(asyncio.run(run_proc(job, t0)))
    conn.close()


# ---- summaries --------------------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 2) if values else None


def summarize(reports: list[dict[str, Any]]) -> dict[str, Any]:
    live = [r for r in reports if "refused" not in r and "failed" not in r]
    rtfs = [r["rtf"] for r in live if r["rtf"] is not None]
    firsts = [r["first_audio_ms"] for r in live if r["first_audio_ms"] is not None]
    out: dict[str, Any] = {
        "sessions": len(reports), "live": len(live),
        "refused": sum("refused" in r for r in reports), "failed": sum("failed" in r for r in reports),
        "no_audio": sum(r["first_audio_ms"] is None for r in live),
        "rtf_min": min(rtfs) if rtfs else None,
        "missing_frames_max": max((r["missing_frames"] for r in live), default=None),
        "lateness_p99_ms_max": max((r["output_lateness_ms"]["p99"] for r in live), default=None),
        "lateness_p50_ms_max": max((r["output_lateness_ms"]["p50"] for r in live), default=None),
        "first_audio_ms": quantiles(firsts) if firsts else None,
        "errors": sum(r.get("errors", 0) for r in live),
    }
    traced = [r["output_lateness_ms"] for r in live if "driver_lag_ms" in r["output_lateness_ms"]]
    if traced:
        # a call's worst moment that came with a stall of its driver's own loop half its size or more
        out["worst_with_driver_stall"] = sum(x["driver_lag_ms"] >= 0.5 * x["max"] > 0 for x in traced)
    servers = [r["server"] for r in live if "server" in r]
    if servers:
        out["server_added_ms"] = {f"{side}_{stat}_mean": _mean([s[f"{side}_added_ms"][stat] for s in servers
                                                                if s[f"{side}_added_ms"][stat] is not None])
                                  for side in ("input", "output") for stat in ("p50", "p95")}
        out["server_input"] = {
            "added_p50_ms_max": max((s["input_added_ms"]["p50"] or 0.0 for s in servers), default=None),
            "underruns_max": max((s["input_underruns"] or 0 for s in servers), default=None),
            "concealed_ms_max": max((s["concealed_ms"] for s in servers), default=None),
            "sound_cut_max_ms": max((s.get("sound_cut_max_ms") or 0.0 for s in servers), default=None),
            "hard_cuts": sum(s.get("hard_cuts") or 0 for s in servers)}
    sips = [(r["sip_server"]["input"], r.get("impairment", {}).get("rtp_lost_ms")) for r in live
            if (r.get("sip_server") or {}).get("input")]
    if sips:
        out["server_input"] = {
            "added_p50_ms_max": max(((x["added_ms"] or {}).get("p50") or 0.0 for x, _ in sips), default=None),
            "underruns_max": max(x["underruns"] for x, _ in sips),
            "concealed_ms_max": max(x["concealed_ms"] for x, _ in sips),
            "sound_cut_max_ms": max(x["sound_cut_max_ms"] for x, _ in sips),
            "hard_cuts": sum(x["hard_cuts"] for x, _ in sips)}
        lost = [(x["concealed_ms"], lost_ms) for x, lost_ms in sips if lost_ms is not None]
        if lost:
            out["sip_concealed_minus_lost_ms_max"] = round(max(c - ms for c, ms in lost), 1)
    links = [r["server_link"]["input"] for r in live if "server_link" in r]
    if links:
        out["server_input"] = {
            "added_p50_ms_max": max(((x["added_ms"] or {}).get("p50") or 0.0 for x in links), default=None),
            "underruns_max": max(x["underruns"] for x in links), "jitter_ms_max": max(x["jitter_ms"] for x in links),
            "sound_cut_max_ms": max(x["sound_cut_max_ms"] for x in links),
            "hard_cuts": sum(x["hard_cuts"] for x in links),
            "playout_ms_max": max(r["server_link"]["playout_ms"] for r in live if "server_link" in r)}
    heard = [r["hearing"] for r in live if "hearing" in r]
    fixed = [h["fixed"] for h in heard if "fixed" in h]
    if fixed:
        out["player_gaps"] = {f"{int(f['delay_ms'])}ms": sum(h[i]["gaps"] for h in fixed)
                              for i, f in enumerate(fixed[0])}
        out["player_needed_ms_max"] = max((h[0]["needed_ms"] or 0.0 for h in fixed), default=None)
    adaptive = [h["adaptive"] for h in heard if "adaptive" in h]
    if adaptive:
        out["player_concealed_ms_max"] = max(a["concealed_ms"] for a in adaptive)
        out["player_underruns_max"] = max(a["underruns"] for a in adaptive)
    links_up = [r["impairment"] for r in live if "impairment" in r]
    if links_up:
        out["link_jitter_p95_ms_max"] = max(x["up"]["jitter_p95_ms"] for x in links_up)
        out["link_up_loss_pct_mean"] = _mean([x["up"]["loss_pct"] for x in links_up])
        webrtc = [(r["impairment"]["rtp_lost_ms"], r["server"]["concealed_ms"]) for r in live
                  if "impairment" in r and "server" in r and "rtp_lost_ms" in r["impairment"]]
        if webrtc:
            out["webrtc_concealed_minus_lost_ms_max"] = round(max(c - lost for lost, c in webrtc), 1)
    return out


async def extra_open(http: aiohttp.ClientSession, args: argparse.Namespace, audio: np.ndarray,
                     headers: dict[str, str], t0: float, last_open_s: float) -> dict[str, Any]:
    """Once the server counts every session live, one more opens; its report, with how many were live."""
    deadline = t0 + last_open_s + 30.0
    await asyncio.sleep(max(0.0, t0 + last_open_s - time.monotonic()))
    in_use = 0
    while time.monotonic() < deadline:
        async with http.get(args.url + "/health") as res:
            in_use = (await res.json()).get("sessions", {}).get("in_use", 0)
        if in_use >= args.sessions:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(args.extra_settle_s)
    seconds = min(args.extra_seconds, args.seconds)
    job = ProcJob(args.url, headers, [], audio, seconds, args.drain_s, piece_ms=args.piece_ms)
    to_hear: list[tuple[dict[str, Any], DoorClient]] = []
    report = await run_session(http, job, Planned(args.sessions, args.extra_door, -1, 0.0), time.monotonic(), to_hear)
    hear(to_hear)
    return {"live_before": in_use, **report}


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    audio = speech(args.wav, max(args.seconds, 8.0))
    args.procs = max(1, min(args.procs, args.sessions))
    sessions = plan(args)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for k in range(args.procs):
        mine = [p for p in sessions if p.proc == k]
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=proc_main, args=(child, ProcJob(args.url, headers, mine, audio, args.seconds,
                                                                   args.drain_s, args.impair_seed, args.sip_port,
                                                                   args.admin_key, args.piece_ms)),
                           daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(parent)
    loop = asyncio.get_running_loop()
    waiters = ThreadPoolExecutor(max_workers=args.procs)     # one blocking `recv` per client process
    for conn in conns:
        await loop.run_in_executor(waiters, conn.recv)       # imported and ready
    pids = {pid: "given" for pid in args.server_pids}
    main_c0 = rusage_cpu_s()
    async with client_session() as http:
        before = await server_snapshot(http, args.url, pids)
        t0 = time.monotonic() + 0.5
        for conn in conns:
            conn.send(t0)
        results = [loop.run_in_executor(waiters, conn.recv) for conn in conns]
        extra = None
        if args.extra_open:
            extra = await extra_open(http, args, audio, headers, t0, sessions[-1].open_at_s)
        done = await asyncio.gather(*results)
        wall = time.monotonic() - t0
        after = await server_snapshot(http, args.url, pids)
    waiters.shutdown()
    for proc in procs:
        proc.join(10)
    reports = sorted((r for d in done for r in d["reports"]), key=lambda r: r["index"])
    by_door = {door: summarize([r for r in reports if r["door"] == door]) for door in args.mix}
    conditions = {cond: {door: summarize(subset) for door in args.mix
                         if (subset := [r for r in reports if r["door"] == door
                                        and (r.get("link") or "clean") == cond])}
                  for cond in {"clean", *(p.link for p in sessions if p.link)}}
    return {
        "bench": "e2e", "url": args.url, "sessions": args.sessions, "mix": args.mix, "seconds": args.seconds,
        "open": args.open, **({"burst_s": args.burst_s} if args.open == "burst" else {"interval_ms": args.interval_ms}),
        "procs": args.procs, "piece_ms": args.piece_ms,
        "wall_s": round(wall, 2), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "t0_monotonic": round(t0, 3),  # the sessions' time origin: the server's stall times are on this clock
        "summary": summarize(reports), "doors": by_door, "conditions": conditions,
        "impair": args.impair, "impaired_share": args.impaired_share if args.impair else 0.0,
        "extra_open": extra,
        "server": server_report(before, after, pids),
        "driver": {"main_cpu_pct": round(100.0 * (rusage_cpu_s() - main_c0) / wall, 1),
                   "procs": [{k: d[k] for k in ("pid", "sessions", "wall_s", "cpu_pct", "loop_lag_ms", "loop_stalls",
                                                "loop_stalls_at")}
                             for d in done]},
        "per_session": reports,
    }


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print the run's JSON line; with `out`, append it there too."""
    line = json.dumps(report)
    print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(line + "\n")


def add_common(p: argparse.ArgumentParser) -> None:
    """The flags every whole-server driver takes: where, which doors, what to say, which processes, where to save."""
    p.add_argument("--url", required=True, help="the server's base URL, http://host:port")
    p.add_argument("--mix", type=parse_mix, default=parse_mix(DEFAULT_MIX), help=f"door=weight,... ({DEFAULT_MIX})")
    p.add_argument("--wav", type=Path, help="speech to send (default: espeak-ng, else a synthetic voice)")
    p.add_argument("--server-pids", type=int, nargs="*", default=[], help="server processes on this machine")
    p.add_argument("--out", type=Path, help="append the JSON line to this file")


def cli(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
        argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    args.url = args.url.rstrip("/")
    emit(asyncio.run(run(args)), args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--seconds", type=float, default=20.0, help="audio each session streams")
    p.add_argument("--procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--open", choices=("burst", "steady"), default="burst")
    p.add_argument("--burst-s", type=float, default=2.0, help="burst: every open within this")
    p.add_argument("--interval-ms", type=float, default=250.0, help="steady: one open every this")
    p.add_argument("--extra-open", action="store_true", help="once all are live, time one more open's first audio")
    p.add_argument("--extra-door", choices=sorted(DOORS), default="realtime")
    p.add_argument("--extra-seconds", type=float, default=3.0)
    p.add_argument("--extra-settle-s", type=float, default=1.0, help="wait after all are live before the extra open")
    p.add_argument("--drain-s", type=float, default=1.0, help="after the last send, before counting what came")
    p.add_argument("--piece-ms", type=float, help="each append of the Realtime and duplex doors (default one 80 ms "
                   "frame; voice-agent frameworks send 20-100 ms); Twilio and SIP send 20 ms, WebRTC 20 ms of Opus")
    p.add_argument("--api-key")
    p.add_argument("--admin-key", help="the server's --admin-key: Twilio calls read their own stats from /v1/calls")
    p.add_argument("--impair", type=_link, help="put a share of each door's sessions behind this link (bench.impair: "
                   "a preset such as far, bursty, stalls, or fields: delay_ms=75,jitter_ms=30,loss=0.01)")
    p.add_argument("--impaired-share", type=float, default=0.5,
                   help="with --impair: this share of each door's sessions")
    p.add_argument("--impair-seed", type=int, default=0)
    p.add_argument("--sip-port", type=int, help="the server's --sip-port (for the sip door in --mix)")
    return p


def _link(text: str) -> str:
    try:
        Link.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv: list[str] | None = None) -> int:
    return cli(build_parser(), drive, argv)


if __name__ == "__main__":
    raise SystemExit(main())
