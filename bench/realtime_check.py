"""Validation and load driver for `WS /v1/realtime?duplex=1` against any running server; prints JSON.

    python -m bench.realtime_check --url ws://127.0.0.1:8000 [--wav speech.wav] [--api-key KEY]
    python -m bench.realtime_check --url ws://127.0.0.1:8000 --sessions 8 --seconds 20

Lifecycle mode (default) checks what a deployment must do: two sessions stream the wav (plus a short silent
tail) paced at 80 ms per append; the server is then full (idle fillers take any slots beyond two), so one more
connection must get `resource_exhausted`; the first session closes (`session.closed`) and a replacement is admitted
with a new id and the same capabilities and streams beside the survivor, which keeps its response id. Per session:
no `error` event, non-silent PCM16 24 kHz output in whole 1920-sample frames, at most `--max-missing` frames fewer
out than in, exactly one response id. Exit status 0 when every check passed.

Load mode (`--sessions N`) admits N sessions, starts them together on one 80 ms grid for `--seconds`, and reports
per session the frames in and out, missing frames, the server's stream rate (output frames per 80 ms of wall clock
between 10 % and 90 % of the run, 1.0 = real time), output lateness against an ideal 80 ms cadence (p50/p99/max),
send lateness of the client itself, and time to first audio.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import numpy as np

FRAME = 1920
RATE = 24000
FRAME_S = 0.08
AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")


def realtime_url(url: str) -> str:
    parts = urlsplit(url)
    path = parts.path if parts.path not in ("", "/") else "/v1/realtime"
    query = parts.query or "duplex=1"
    return urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def load_audio(wav: Path | None, seconds: float | None) -> np.ndarray:
    """The wav (mono, resampled to 24 kHz) or a synthetic voice; cut or looped to `seconds` when given."""
    if wav is not None:
        from media.resample import Resampler
        from model.audio import read_wav
        samples, rate = read_wav(wav)
        audio = Resampler(rate, RATE).process(samples.astype(np.float32)) if rate != RATE else samples
    else:
        t = np.arange(int((seconds or 4.0) * RATE)) / RATE
        f0 = 140 * (1 + 0.1 * np.sin(2 * np.pi * 1.5 * t))
        phase = 2 * np.pi * np.cumsum(f0) / RATE
        audio = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2) * 0.2
    if seconds is not None:
        n = int(seconds * RATE)
        audio = np.resize(audio, n) if audio.size < n else audio[:n]
    frames = -(-audio.size // FRAME)
    return np.pad(audio.astype(np.float32), (0, frames * FRAME - audio.size))


@dataclass
class Session:
    """One Realtime connection: its events, output frames and timing."""

    name: str
    ws: aiohttp.ClientWebSocketResponse
    session: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    out_times: list[float] = field(default_factory=list)
    bad_deltas: list[str] = field(default_factory=list)
    frames_sent: int = 0
    send_late_ms: list[float] = field(default_factory=list)
    first_send: float | None = None
    frames_at_end: int | None = None      # output frames counted when the measurement window ended
    closed: dict[str, Any] | None = None
    reader: asyncio.Task[None] | None = None

    @property
    def frames_out(self) -> int:
        return sum(len(a) for a in self.audio) // (2 * FRAME)

    async def read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                continue
            event = json.loads(msg.data)
            kind = event.get("type")
            if kind == "error":
                self.errors.append(event)
            elif kind == "response.created":
                self.response_ids.append(event["response_id"])
            elif kind in AUDIO_DELTAS:
                try:
                    data = base64.b64decode(event["delta"], validate=True)
                except (binascii.Error, ValueError):
                    self.bad_deltas.append("not strict base64")
                    continue
                if len(data) % 2:
                    self.bad_deltas.append(f"odd byte count {len(data)}")
                if not event.get("response_id"):
                    self.bad_deltas.append("no response_id")
                self.audio.append(data)
                self.out_times.append(time.monotonic())
            elif kind == "session.closed":
                self.closed = event

    async def stream(self, audio: np.ndarray, t0: float) -> None:
        """One 80 ms append per grid point t0 + k*80 ms (no catch-up burst: a late append just goes late)."""
        pcm = audio.astype("<f4").tobytes()
        for k in range(audio.size // FRAME):
            due = t0 + k * FRAME_S
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic()
            self.send_late_ms.append(max(0.0, (now - due) * 1000))
            if self.first_send is None:
                self.first_send = now
            chunk = pcm[k * FRAME * 4:(k + 1) * FRAME * 4]
            await self.ws.send_json({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode(),
                                     "format": "pcm_f32le", "sample_rate_hz": RATE, "duration_ms": 80,
                                     "audio_end_ms": (self.frames_sent + 1) * 80})
            self.frames_sent += 1

    async def wait_output(self, drain_s: float, timeout_s: float, max_missing: int) -> None:
        deadline = time.monotonic() + timeout_s
        while self.frames_out < self.frames_sent - max_missing and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(drain_s)
        self.frames_at_end = self.frames_out

    async def close(self) -> None:
        if not self.ws.closed:
            await self.ws.send_json({"type": "session.close"})
        if self.reader is not None:
            await asyncio.wait_for(self.reader, 10)

    def samples(self) -> np.ndarray:
        return np.frombuffer(b"".join(self.audio), dtype="<i2").astype(np.float32) / 32768.0


async def open_session(http: aiohttp.ClientSession, url: str, name: str, headers: dict[str, str],
                       persona: str) -> Session | dict[str, Any]:
    """A started Session, or the first event when the server refused (an `error`)."""
    ws = await http.ws_connect(url, headers=headers, max_msg_size=0)
    first = json.loads((await ws.receive(timeout=30)).data)
    if first.get("type") != "session.created":
        await ws.close()
        return first
    s = Session(name=name, ws=ws, session=first["session"])
    await ws.send_json({"type": "session.update", "session": {
        "instructions": persona, "input_audio_format": "pcm_f32le", "output_audio_format": "pcm16",
        "output_sample_rate_hz": RATE, "turn_detection": None, "extra_body": {"auto_response": True}}})
    updated = json.loads((await ws.receive(timeout=30)).data)
    if updated.get("type") != "session.updated":
        s.errors.append(updated)
    s.reader = asyncio.ensure_future(s.read())
    return s


def audio_checks(s: Session, max_missing: int) -> dict[str, Any]:
    pcm = s.samples()
    rms = float(np.sqrt(np.mean(pcm ** 2))) if pcm.size else 0.0
    voiced = int(sum(np.sqrt(np.mean(f ** 2)) >= 1e-3 for f in pcm[: pcm.size // FRAME * FRAME].reshape(-1, FRAME)))
    missing = s.frames_sent - (s.frames_at_end if s.frames_at_end is not None else s.frames_out)
    result = {
        "session_id": s.session.get("id"), "frames_in": s.frames_sent, "frames_out": s.frames_out,
        "frames_out_at_end": s.frames_at_end, "missing_frames": max(0, missing),
        "whole_frames": pcm.size % FRAME == 0, "rms": round(rms, 6),
        "voiced_frames": voiced, "response_ids": len(set(s.response_ids)), "errors": len(s.errors),
        "bad_deltas": len(s.bad_deltas),
    }
    result["ok"] = bool(
        not s.errors and not s.bad_deltas and result["whole_frames"] and rms > 1e-5 and voiced >= 5
        and missing <= max_missing and len(set(s.response_ids)) == 1 and len(s.audio) >= 2
    )
    if s.errors:
        result["first_error"] = s.errors[0].get("error")
    return result


async def lifecycle(args: argparse.Namespace) -> dict[str, Any]:
    url, headers = realtime_url(args.url), _headers(args)
    audio = load_audio(args.wav, args.seconds)
    tail = np.zeros(int(args.tail_s * RATE) // FRAME * FRAME, np.float32)
    stream_audio = np.concatenate([audio, tail])
    checks: dict[str, Any] = {}
    report: dict[str, Any] = {"mode": "lifecycle", "url": url, "input_frames": stream_audio.size // FRAME}
    async with aiohttp.ClientSession() as http:
        primary = await open_session(http, url, "primary", headers, args.persona)
        secondary = await open_session(http, url, "secondary", headers, args.secondary_persona)
        if not isinstance(primary, Session) or not isinstance(secondary, Session):
            refused = primary if not isinstance(primary, Session) else secondary
            return {**report, "pass": False, "failure": f"could not open two sessions: {refused}"}
        caps = primary.session.get("capabilities", {})
        checks["distinct_ids"] = primary.session["id"] != secondary.session["id"]
        checks["same_capabilities"] = caps == secondary.session.get("capabilities")
        checks["capabilities"] = bool(
            caps.get("implementation_level") == "model_native_duplex" and caps.get("chunk_period_ms") == 80
            and caps.get("supports_multi_session") is True and caps.get("supports_barge_in") is False)
        fillers = []
        for _ in range(max(0, int(caps.get("max_sessions", 2)) - 2)):
            filler = await http.ws_connect(url, headers=headers)
            await filler.receive(timeout=30)
            fillers.append(filler)
        overflow = await http.ws_connect(url, headers=headers)
        refusal = json.loads((await overflow.receive(timeout=30)).data)
        await overflow.receive(timeout=10)
        checks["overflow_refused"] = refusal.get("type") == "error" and \
            refusal.get("error", {}).get("code") == "resource_exhausted" and overflow.close_code == 1013
        report["overflow"] = {"event": refusal.get("error", refusal), "close_code": overflow.close_code}

        t0 = time.monotonic() + 0.2
        await asyncio.gather(primary.stream(stream_audio, t0), secondary.stream(stream_audio, t0))
        await asyncio.gather(*(s.wait_output(args.drain_s, args.timeout_s, args.max_missing)
                               for s in (primary, secondary)))
        await primary.close()
        checks["closed_event"] = primary.closed is not None and primary.ws.close_code == 1000

        replacement = await open_session(http, url, "replacement", headers, args.replacement_persona)
        if not isinstance(replacement, Session):
            return {**report, "pass": False, "checks": checks, "failure": f"replacement refused: {replacement}"}
        checks["replacement_new_id"] = replacement.session["id"] not in (primary.session["id"],
                                                                         secondary.session["id"])
        checks["replacement_same_capabilities"] = replacement.session.get("capabilities") == caps
        survivor_ids = set(secondary.response_ids)
        t1 = time.monotonic() + 0.2
        await asyncio.gather(secondary.stream(stream_audio, t1), replacement.stream(stream_audio, t1))
        await asyncio.gather(*(s.wait_output(args.drain_s, args.timeout_s, args.max_missing)
                               for s in (secondary, replacement)))
        checks["survivor_kept_response_id"] = set(secondary.response_ids) == survivor_ids
        for s in (secondary, replacement):
            await s.close()
        for filler in fillers:
            await filler.close()
        sessions = {s.name: audio_checks(s, args.max_missing) for s in (primary, secondary, replacement)}
        checks["response_ids_unique"] = len({r for s in (primary, secondary, replacement) for r in s.response_ids}) \
            == sum(len(s.response_ids) for s in (primary, secondary, replacement))
    report["sessions"] = sessions
    report["checks"] = checks
    report["pass"] = all(checks.values()) and all(s["ok"] for s in sessions.values())
    return report


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    a = np.asarray(values)
    return {"p50": round(float(np.percentile(a, 50)), 2), "p99": round(float(np.percentile(a, 99)), 2),
            "max": round(float(a.max()), 2)}


def load_stats(s: Session) -> dict[str, Any]:
    times = np.asarray(s.out_times)
    n = times.size
    stream_rate = None
    if n >= 10:
        lo, hi = int(n * 0.1), int(n * 0.9) - 1
        if times[hi] > times[lo]:
            stream_rate = round((hi - lo) * FRAME_S / float(times[hi] - times[lo]), 4)
    lateness: list[float] = []
    if n:
        ideal = times[0] + np.arange(n) * FRAME_S
        lag = times - ideal
        lateness = list((lag - lag.min()) * 1000)  # relative to the best frame: jitter of the cadence
    first_audio = round((times[0] - s.first_send) * 1000, 1) if n and s.first_send is not None else None
    at_end = s.frames_at_end if s.frames_at_end is not None else s.frames_out
    return {"session_id": s.session.get("id"), "frames_in": s.frames_sent, "frames_out": at_end,
            "missing_frames": max(0, s.frames_sent - at_end), "server_stream_rtf": stream_rate,
            "output_lateness_ms": _quantiles(lateness), "send_lateness_ms": _quantiles(s.send_late_ms),
            "first_audio_ms": first_audio, "errors": len(s.errors), "response_ids": len(set(s.response_ids))}


async def load(args: argparse.Namespace) -> dict[str, Any]:
    url, headers = realtime_url(args.url), _headers(args)
    audio = load_audio(args.wav, args.seconds or 20.0)
    async with aiohttp.ClientSession() as http:
        opened = [await open_session(http, url, f"s{i}", headers, args.persona) for i in range(args.sessions)]
        sessions = [s for s in opened if isinstance(s, Session)]
        refused = [r for r in opened if not isinstance(r, Session)]
        t0 = started = time.monotonic() + 0.3
        await asyncio.gather(*(s.stream(audio, t0) for s in sessions))
        # No waiting for a catch-up here: what has not arrived one drain after the last append is missing.
        await asyncio.gather(*(s.wait_output(args.drain_s, 0.0, 0) for s in sessions))
        wall = time.monotonic() - started
        for s in sessions:
            await s.close()
    per = [load_stats(s) for s in sessions]
    missing = [p["missing_frames"] for p in per]
    rates = [p["server_stream_rtf"] for p in per if p["server_stream_rtf"] is not None]
    return {"mode": "load", "url": url, "sessions_requested": args.sessions, "sessions_admitted": len(sessions),
            "refused": [r.get("error", r) for r in refused], "audio_s": audio.size / RATE,
            "wall_s": round(wall, 2), "client_rtf": round((wall - args.drain_s) / (audio.size / RATE), 4),
            "server_stream_rtf_min": min(rates) if rates else None, "missing_frames_max": max(missing, default=0),
            "output_lateness_p99_ms_max": max((p["output_lateness_ms"]["p99"] for p in per), default=0.0),
            "per_session": per}


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="ws://host:port (the /v1/realtime?duplex=1 path is added)")
    p.add_argument("--wav", type=Path, help="input speech (any rate, mono or mixed down); default: synthetic")
    p.add_argument("--seconds", type=float, help="cut or loop the input to this length")
    p.add_argument("--sessions", type=int, help="load mode: this many concurrent sessions")
    p.add_argument("--api-key")
    p.add_argument("--persona", default="You are a wise and friendly teacher.")
    p.add_argument("--secondary-persona", default="You are a cheerful barista taking orders.")
    p.add_argument("--replacement-persona", default="You are a calm librarian.")
    p.add_argument("--tail-s", type=float, default=0.4, help="silence appended to the input (lifecycle)")
    p.add_argument("--drain-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="lifecycle: how long output may take to cover the input after the last append")
    p.add_argument("--max-missing", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(load(args) if args.sessions else lifecycle(args))
    print(json.dumps(report))
    return 0 if report.get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
