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
per session (`bench.doors.RealtimeClient.report`) the frames in and out, missing frames, the received stream's
real-time factor (output seconds per wall second between 10 % and 90 % of the run), output lateness against an ideal
80 ms cadence (p50/p99/max), send lateness of the client itself, and time to first audio (after the open began and
after the first append). What has not arrived one `--drain-s` after the last append counts as missing; with
`--timeout-s`, a session's drain begins once its output covers its input less `--max-missing` frames, or that long
after the last append (for a machine that runs the engine slower than real time, where the first audio of the last
sessions opened comes seconds after the streams began).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from bench.doors import FRAME, RATE, RealtimeClient, client_session, speech


def realtime_url(url: str) -> tuple[str, str]:
    """(base URL, path with query) of the Realtime endpoint the user named."""
    parts = urlsplit(url)
    path = parts.path if parts.path not in ("", "/") else "/v1/realtime"
    return urlunsplit((parts.scheme, parts.netloc, "", "", "")), f"{path}?{parts.query or 'duplex=1'}"


async def open_session(http: Any, url: str, name: str, headers: dict[str, str],
                       persona: str) -> RealtimeClient | dict[str, Any]:
    """A started session, or the first event when the server refused (an `error`)."""
    base, path = realtime_url(url)
    s = RealtimeClient(name, base, headers, persona, path=path, keep_audio=True)
    refused = await s.open(http)
    return s if refused is None else refused


def audio_checks(s: RealtimeClient, max_missing: int) -> dict[str, Any]:
    pcm = s.samples()
    rms = float(np.sqrt(np.mean(pcm ** 2))) if pcm.size else 0.0
    voiced = int(sum(np.sqrt(np.mean(f ** 2)) >= 1e-3 for f in pcm[: pcm.size // FRAME * FRAME].reshape(-1, FRAME)))
    missing = s.frames_in - (s.frames_at_end if s.frames_at_end is not None else s.frames_out)
    result = {
        "session_id": s.session_id, "frames_in": s.frames_in, "frames_out": s.frames_out,
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
    url, headers = args.url, _headers(args)
    audio = speech(args.wav, args.seconds, espeak=False)
    tail = np.zeros(int(args.tail_s * RATE) // FRAME * FRAME, np.float32)
    stream_audio = np.concatenate([audio, tail])
    checks: dict[str, Any] = {}
    report: dict[str, Any] = {"mode": "lifecycle", "url": url, "input_frames": stream_audio.size // FRAME}
    async with client_session() as http:
        primary = await open_session(http, url, "primary", headers, args.persona)
        secondary = await open_session(http, url, "secondary", headers, args.secondary_persona)
        if not isinstance(primary, RealtimeClient) or not isinstance(secondary, RealtimeClient):
            refused = primary if not isinstance(primary, RealtimeClient) else secondary
            return {**report, "pass": False, "failure": f"could not open two sessions: {refused}"}
        caps = primary.session.get("capabilities", {})
        checks["distinct_ids"] = primary.session_id != secondary.session_id
        checks["same_capabilities"] = caps == secondary.session.get("capabilities")
        checks["capabilities"] = bool(
            caps.get("implementation_level") == "model_native_duplex" and caps.get("chunk_period_ms") == 80
            and caps.get("supports_multi_session") is True and caps.get("supports_barge_in") is False)
        full_url = "".join(realtime_url(url))
        fillers = []
        for _ in range(max(0, int(caps.get("max_sessions", 2)) - 2)):
            filler = await http.ws_connect(full_url, headers=headers)
            await filler.receive(timeout=30)
            fillers.append(filler)
        overflow = await http.ws_connect(full_url, headers=headers)
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
        checks["closed_event"] = primary.closed is not None and primary.ws is not None and \
            primary.ws.close_code == 1000

        replacement = await open_session(http, url, "replacement", headers, args.replacement_persona)
        if not isinstance(replacement, RealtimeClient):
            return {**report, "pass": False, "checks": checks, "failure": f"replacement refused: {replacement}"}
        checks["replacement_new_id"] = replacement.session_id not in (primary.session_id, secondary.session_id)
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


async def load(args: argparse.Namespace) -> dict[str, Any]:
    url, headers = args.url, _headers(args)
    audio = speech(args.wav, args.seconds or 20.0, espeak=False)
    async with client_session() as http:
        opened = [await open_session(http, url, f"s{i}", headers, args.persona) for i in range(args.sessions)]
        sessions = [s for s in opened if isinstance(s, RealtimeClient)]
        refused = [r for r in opened if not isinstance(r, RealtimeClient)]
        t0 = started = time.monotonic() + 0.3
        await asyncio.gather(*(s.stream(audio, t0) for s in sessions))
        # No waiting for a catch-up unless told: what has not arrived one drain after the last append is missing.
        await asyncio.gather(*(s.wait_output(args.drain_s, args.timeout_s, args.max_missing)
                               for s in sessions))
        wall = time.monotonic() - started
        for s in sessions:
            await s.close()
    per = [s.report() for s in sessions]
    missing = [p["missing_frames"] for p in per]
    rates = [p["rtf"] for p in per if p["rtf"] is not None]
    return {"mode": "load", "url": "".join(realtime_url(url)), "sessions_requested": args.sessions,
            "sessions_admitted": len(sessions),
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
    p.add_argument("--timeout-s", type=float,
                   help="how long output may take to cover the input (less --max-missing frames) after the last "
                        "append, before the drain (default: 10 in lifecycle mode, 0 in load mode)")
    p.add_argument("--max-missing", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.timeout_s is None:
        args.timeout_s = 0.0 if args.sessions else 10.0
    report = asyncio.run(load(args) if args.sessions else lifecycle(args))
    print(json.dumps(report))
    return 0 if report.get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
