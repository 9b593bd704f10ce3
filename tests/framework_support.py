"""What the voice-agent framework tests share: the server under test (the real `python -m app` on the tiny model,
with an API key), the caller's audio at the real pace, the Agents SDK's browser bundle, and the verdict.

The verdict is issue 26's definition of a framework that works: audio flows both ways for the whole call, the
framework's receive loop is alive at the end, no `error` event arrived, every server event validates against the
openai SDK's types (tests/realtime_schema.py), and each framework call made during the call got its answer. Every
check runs; the failure lists them all, each with the server events that show it, so one run says everything that
is wrong with a framework.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pydantic
import pytest
from process_support import ROOT, start_tiny, wait_ready
from realtime_schema import EXTENSIONS, validate_server_event

MODEL = "personaplex-tiny"
API_KEY = "sk-framework-tests"
PERSONA = "You answer the phone for a small bakery. You are warm and brief."
CALL_S = 6.0               # audio each framework gets, at the real pace
RATE = 24000               # every framework's default: PCM16 at 24 kHz
# The least of a call each way whatever the engine's lag: audio must still flow. How fast the engine runs is the
# benches' to measure (bench/), not these tests': on a 2-core machine beside another test process the tiny engine's
# call fell 2-4 s behind in 6 s (two test processes, a browser, the frameworks and the server's processes at once).
LEAST_SHARE = 0.15

# The OpenAI Agents SDK for JavaScript, as a browser page loads it: the package ships a self-contained UMD bundle.
AGENTS_SDK = "@openai/agents-realtime@0.20.0"
AGENTS_BUNDLE = "package/dist/bundle/openai-realtime-agents.umd.js"
NPM_CACHE = ROOT / ".cache" / "npm"

# (seconds since the call started, sent by the server, the JSON event)
Timeline = list[tuple[float, bool, dict[str, Any]]]


def call_pcm(speech: np.ndarray, seconds: float = CALL_S) -> bytes:
    """`seconds` of the caller talking (speech, half a second of silence, again), PCM16 LE at 24 kHz."""
    turn = np.concatenate([speech, np.zeros(RATE // 2, np.float32)])
    audio = np.tile(turn, int(seconds * RATE) // turn.size + 1)[: int(seconds * RATE)]
    return (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()


async def paced(pcm: bytes, chunk_s: float) -> AsyncIterator[tuple[float, bytes]]:
    """(offset in seconds, chunk) for the whole of `pcm`, each chunk when its audio would start playing."""
    size = int(chunk_s * RATE) * 2
    start = time.monotonic()
    for i in range(0, len(pcm), size):
        offset = i / (2 * RATE)
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        yield offset, pcm[i:i + size]


class Cues:
    """Things to do at given offsets into a call: `await cues.run_due(offset)` from the loop that feeds the audio."""

    def __init__(self, cues: list[tuple[float, Callable[[], Awaitable[object] | object]]]) -> None:
        self.pending = sorted(cues, key=lambda c: c[0])

    async def run_due(self, offset: float) -> None:
        while self.pending and self.pending[0][0] <= offset:
            result = self.pending.pop(0)[1]()
            if inspect.isawaitable(result):
                await result


def appended_seconds(timeline: Timeline) -> list[tuple[float, float]]:
    """(time, seconds of PCM16 24 kHz audio) of each `input_audio_buffer.append` the client sent."""
    return [(t, len(base64.b64decode(e.get("audio", ""))) / (2 * RATE)) for t, from_server, e in timeline
            if not from_server and e.get("type") == "input_audio_buffer.append"]


async def eventually(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def agents_bundle() -> Path:
    """The Agents SDK's browser bundle, fetched from the npm registry into the ignored cache folder on first use."""
    name = AGENTS_SDK.lstrip("@").replace("/", "-")
    target = NPM_CACHE / name / Path(AGENTS_BUNDLE).name
    if target.exists():
        return target
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: it fetches {AGENTS_SDK} (apt-get install npm)")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([npm, "pack", AGENTS_SDK, "--pack-destination", tmp], check=True, capture_output=True,
                       timeout=300)
        with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tar:
            member = tar.extractfile(AGENTS_BUNDLE)
            assert member is not None, f"{AGENTS_SDK} has no {AGENTS_BUNDLE}"
            data = member.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)
    return target


# ---- the verdict --------------------------------------------------------------------------------------------------

def _sdk_member(kind: str, beta: bool) -> type[pydantic.BaseModel] | None:
    """The openai SDK's model for server events of type `kind` (to say which field fails, not whether)."""
    if beta:
        from openai.types.beta.realtime import RealtimeServerEvent
    else:
        from openai.types.realtime import RealtimeServerEvent
    union = typing.get_args(RealtimeServerEvent)[0]
    for model in typing.get_args(union):
        if isinstance(model, type) and issubclass(model, pydantic.BaseModel):
            field_ = model.model_fields.get("type")
            if field_ is not None and kind in typing.get_args(field_.annotation):
                return model
    return None


def _schema_reason(event: dict[str, Any], beta: bool, fallback: str) -> str:
    """What is wrong with `event`, field by field: the errors against the SDK's model of its type, for nested unions
    (an item's kind) those of the member that comes closest."""
    model = _sdk_member(str(event.get("type")), beta)
    if model is None:
        if event.get("type") in EXTENSIONS:
            return fallback.splitlines()[0][:300]
        return "not a server event type of the openai SDK, nor a documented extension"
    try:
        model.model_validate(event)
    except pydantic.ValidationError as e:
        by_member: dict[tuple[str, ...], list[Any]] = {}
        for err in e.errors():
            members = tuple(str(part) for part in err["loc"] if str(part)[:1].isupper())
            by_member.setdefault(members, []).append(err)
        closest = min(by_member.values(), key=len)
        return "; ".join(f"{'.'.join(str(p) for p in err['loc'] if not str(p)[:1].isupper())}: {err['msg']} "
                         f"(got {err.get('input')!r:.60})" for err in closest[:3])
    return fallback.splitlines()[0][:300]


@dataclass
class Verdict:
    """The checks of one framework call; `assert_works()` fails with every check that failed."""

    framework: str
    failures: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    engine_behind_s: float = 0.0   # how far the engine fell behind real time during the call (`EngineClock`)

    def least_audio_s(self, seconds: float) -> float:
        """The audio a `seconds` call must carry each way: 70 % of it, less the frames the engine did not run."""
        return max(0.7 * seconds - self.engine_behind_s, LEAST_SHARE * seconds)

    def behind(self) -> str:
        """What a failure says of the engine's lag, when there was one."""
        lag = self.engine_behind_s
        return f" (the engine ran {lag:.2f} s behind real time)" if lag >= 0.05 else ""

    def check(self, ok: bool, what: str, why: str = "") -> None:
        if ok:
            self.passed.append(what)
        else:
            self.failures.append(f"{what}: {why}" if why else what)

    def audio_out(self, chunks: list[tuple[float, float]], seconds: float, timeline: Timeline | None = None) -> None:
        """`chunks`: (seconds since the call started, seconds of audio) as the framework delivered them; with the
        call's `timeline`, a failure says what the server sent meanwhile."""
        heard = [(t, s) for t, s in chunks if 0.0 <= t <= seconds + 1.0]
        total = sum(s for _, s in heard)
        times = [t for t, _ in heard]
        gap, gap_at = max((b - a, a) for a, b in zip([0.0, *times], [*times, seconds]))
        ok = total >= self.least_audio_s(seconds) and gap <= 3.0
        why = (f"{total:.1f} s of audio in a {seconds:.0f} s call{self.behind()}; the longest silence: {gap:.1f} s "
               f"from {gap_at:.1f} s")
        if not ok and timeline is not None:
            deltas = sum(1 for t, from_server, e in timeline if from_server and gap_at < t < gap_at + gap
                         and e.get("type") in AUDIO_DELTAS)
            around = [f"{t:.1f} {e.get('type')}" for t, from_server, e in timeline
                      if from_server and gap_at - 0.5 <= t <= gap_at + 1.0 and e.get("type") not in NOISE]
            why += (f"; meanwhile the server sent {deltas} audio deltas (so the "
                    f"{'framework dropped them' if deltas else 'server sent none'}); server events around "
                    f"{gap_at:.1f} s: {around[:10]}")
        self.check(ok, "output audio through the end", why)

    def audio_in(self, chunks: list[tuple[float, float]], seconds: float) -> None:
        """`chunks`: (seconds since the call started, seconds of audio) as the framework sent them to the server."""
        total = sum(s for _, s in chunks)
        last = max((t for t, _ in chunks), default=-1.0)
        self.check(total >= 0.9 * seconds and last >= seconds - 1.0, "input audio through the end",
                   f"the framework sent {total:.1f} s of the {seconds:.0f} s, the last at {last:.1f} s")

    def loop_alive(self, alive: bool, why: str) -> None:
        self.check(alive, "receive loop alive at the end", why)

    def no_errors(self, timeline: Timeline) -> None:
        sent = {e.get("event_id"): e.get("type") for _, from_server, e in timeline if not from_server}
        errors = [(t, e.get("error") or {}) for t, from_server, e in timeline
                  if from_server and e.get("type") == "error"]
        for t, err in errors:
            eid = err.get("event_id")
            answering = sent.get(eid, f"event {eid}") if eid else "an event without event_id"
            self.failures.append(f"error event at {t:.1f} s answering {answering}: {err.get('code')} "
                                 f"(param {err.get('param')}): {err.get('message')}")
        if not errors:
            self.passed.append("no error event")

    def schema(self, timeline: Timeline, beta: bool = False) -> None:
        bad: dict[str, tuple[int, str]] = {}
        count = 0
        for _, from_server, event in timeline:
            if not from_server:
                continue
            count += 1
            try:
                validate_server_event(event, beta=beta)
            except AssertionError as e:
                n, reason = bad.get(str(event.get("type")), (0, ""))
                bad[str(event.get("type"))] = (n + 1, reason or _schema_reason(event, beta, str(e)))
        dialect = "beta" if beta else "GA"
        for kind, (n, reason) in bad.items():
            self.failures.append(f"schema ({dialect}): {n} × {kind} invalid: {reason}")
        if not bad:
            self.passed.append(f"all {count} server events valid ({dialect})")

    def answered(self, timeline: Timeline, request: str, answer: Callable[[dict[str, Any]], bool], what: str,
                 within_s: float = 3.0) -> None:
        """Each `request` the client sent is followed within `within_s` by a server event `answer` accepts."""
        asked = [t for t, from_server, e in timeline if not from_server and e.get("type") == request]
        if not asked:
            self.check(False, f"{request} → {what}", "the framework never sent it")
            return
        for t0 in asked:
            got = [t for t, from_server, e in timeline if from_server and t0 <= t <= t0 + within_s and answer(e)]
            after = [e.get("type") for t, from_server, e in timeline if from_server and t0 <= t <= t0 + within_s
                     and e.get("type") not in NOISE]
            self.check(bool(got), f"{request} at {t0:.1f} s → {what}", f"the server answered {after[:8]}")

    def step(self, name: str, error: BaseException | None) -> None:
        self.check(error is None, name, f"{type(error).__name__}: {error}" if error else "")

    def assert_works(self) -> None:
        if self.failures:
            lines = "\n".join(f"  - {f}" for f in self.failures)
            ok = "; ".join(self.passed)
            raise AssertionError(f"{self.framework} does not work against the server "
                                 f"({len(self.failures)} failures):\n{lines}\n  (passed: {ok})")


# Events that flow all through a call; left out of "the server answered ..." lists.
AUDIO_DELTAS = {"response.output_audio.delta", "response.audio.delta"}
NOISE = AUDIO_DELTAS | {"response.output_audio_transcript.delta", "response.audio_transcript.delta", "session.stats"}


def is_type(kind: str, **fields: Any) -> Callable[[dict[str, Any]], bool]:
    """A server-event predicate: type `kind`, and each of `fields` (a path with `__` between keys, as
    `response__status`) equal to its value."""
    def accept(event: dict[str, Any]) -> bool:
        if event.get("type") != kind:
            return False
        for path, want in fields.items():
            value: Any = event
            for key in path.split("__"):
                value = value.get(key) if isinstance(value, dict) else None
            if value != want:
                return False
        return True
    return accept


# ---- the server under test ----------------------------------------------------------------------------------------

@dataclass
class ServerUnderTest:
    url: str
    workers: int | None
    output: bytearray = field(default_factory=bytearray)

    def ws(self, url: str) -> str:
        return url.replace("http", "ws", 1)


@asynccontextmanager
async def framework_server(tiny_checkpoint: Path, folder: Path, workers: int | None) -> AsyncIterator[ServerUnderTest]:
    """`python -m app` on the tiny model with the tests' API key (and `--workers N`), as a user starts it."""
    flags = ["--api-key", API_KEY, "--engine-stalled-s", "10"] + (["--workers", str(workers)] if workers else [])
    proc, url = await start_tiny(tiny_checkpoint, folder, *flags)
    server = ServerUnderTest(url, workers)

    async def drain() -> None:              # a full pipe would stall the server: keep reading its log
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            server.output.extend(chunk)

    drainer = asyncio.ensure_future(drain())
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, workers=workers or 0)
        yield server
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
        await drainer
        log = server.output.decode(errors="replace")
        if "Traceback" in log:
            print(f"the server's log has tracebacks:\n{log[-6000:]}")
