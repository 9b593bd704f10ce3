"""Fixtures for tests that need a running server: a tiny checkpoint (once per run), a server factory on an
ephemeral loopback port (real engine, real sockets), and speech-like input audio.

    async def test_x(server):                      # a server with the default test settings
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(server.ws("/v1/realtime?duplex=1")) as ws: ...

    async def test_y(start_server):                # custom settings
        srv = await start_server(max_sessions=1, api_keys=("k",))
"""

from __future__ import annotations

import os

import torch

# Without CUDA, our Triton kernels run through Triton's interpreter (numpy), so that their tests run on any machine
# (tests/test_stream_kernels.py). It is read as triton is first imported, which no import above does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from app.shell.context import CONTEXT, ServerContext
from app.shell.server import create_app, set_up
from app.shell.settings import Settings
from media.resample import Resampler
from model.loading import load_model
from model.tiny import synthetic_voice, write_tiny_checkpoint

RATE = 24000

# Files whose tests hold live calls on the wall clock (a server, clients, often a browser or a phone peer). Under
# `-n 2 --dist loadgroup` they are one group, run one after another in one test process, while the other process
# takes the rest a file at a time (as `--dist loadfile` does): two of them at once on a 2-core machine put the tiny
# engine 3.2-3.8 s behind in a 6 s call, one beside a CPU-bound process 0.03-2.25 s (tests/test_frameworks.py).
LIVE_CALL_FILES = frozenset({
    "test_bridges.py", "test_browser.py", "test_drain.py", "test_duplex_link.py", "test_frameworks.py",
    "test_haproxy.py", "test_impaired_doors.py", "test_load_drivers.py", "test_processes.py", "test_recording.py",
    "test_server_cli.py", "test_server_realtime.py", "test_sip.py", "test_webhooks.py", "test_webrtc_call.py",
    "test_webrtc_impairment.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("live_calls" if name in LIVE_CALL_FILES else name))


# Beside the live calls, the other test process's work (benches, oracle comparisons, codecs) has no clock to keep:
# it runs at this nice value, and the live-call files at 0, so that the CPU goes first to the calls. The value is
# set as each test is set up, before its fixtures start servers, engines and subprocesses (which inherit it).
# Lowering it back needs root (CI runs as root); elsewhere, or without xdist, nothing changes.
BACKGROUND_NICE = 10


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and os.geteuid() == 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0 if item.path.name in LIVE_CALL_FILES else BACKGROUND_NICE)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random checkpoint in the official layout, written once per test run."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@dataclass
class RunningServer:
    app: web.Application
    runner: web.AppRunner
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    @property
    def ctx(self) -> ServerContext:
        return self.app[CONTEXT]

    async def stop(self) -> None:
        """Graceful shutdown: open sessions get `session.closed` and close code 1001."""
        await self.runner.cleanup()


def server_settings(checkpoint: Path, **overrides: Any) -> Settings:
    # engine_stalled_s: the tiny CPU engine shares its process and the GIL with the test's event loop; beside a busy
    # loop on a 2-core machine that other processes keep busy, its ticks were measured up to 1.8 s apart (the fuzz
    # suites), so a server under test reports its engine down only after 10 s (the stall test sets the default 2 s).
    base = Settings(model=str(checkpoint), host="127.0.0.1", port=0, max_sessions=2, first_message_timeout_s=10.0,
                    shutdown_timeout_s=3.0, engine_stalled_s=10.0)
    return replace(base, **overrides)


@pytest.fixture
async def start_server(tiny_checkpoint: Path) -> AsyncIterator[Callable[..., Awaitable[RunningServer]]]:
    """`await start_server([checkpoint], **settings)`: a server (by default on the tiny checkpoint) at
    127.0.0.1:<ephemeral>; stopped after."""
    started: list[RunningServer] = []

    async def start(checkpoint: Path | None = None, **overrides: Any) -> RunningServer:
        checkpoint = checkpoint or tiny_checkpoint
        settings = server_settings(checkpoint, **overrides)
        app = create_app(settings, model=load_model(str(checkpoint)))
        runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_timeout_s)
        await set_up(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        server = RunningServer(app=app, runner=runner, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.runner.cleanup()


@pytest.fixture
async def server(start_server: Callable[..., Awaitable[RunningServer]]) -> RunningServer:
    return await start_server()


def speech_like(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """Voiced, syllable-shaped audio (harmonics on a moving pitch with a 3 Hz envelope), float32 at `rate`."""
    x = synthetic_voice(seed, seconds)
    if rate != RATE:
        x = Resampler(RATE, rate).process(x)
    return x.astype(np.float32)


def babble(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """Speech-shaped audio that never repeats itself, float32 at `rate`: syllables of their own pitch glide, length
    and timbre, some with a pause after. Where espeak-ng is missing, the tests that find where a piece of the caller's
    audio landed need this: `speech_like` is periodic (its pitch and envelope repeat every 2/3 s), so a piece of it
    matches at several places."""
    rng = np.random.default_rng(seed)
    pieces, total = [], 0
    while total < int(seconds * RATE):
        n = int(rng.uniform(0.12, 0.3) * RATE)
        f0 = np.linspace(*rng.uniform(90, 220, 2), n)
        phase = 2 * np.pi * np.cumsum(f0) / RATE + rng.uniform(0, 2 * np.pi)
        tilt = rng.uniform(0.5, 1.5)
        voiced = sum(np.sin(k * phase) / k**tilt for k in range(1, 8)) * np.hanning(n)
        pause = np.zeros(int(rng.uniform(0.03, 0.15) * RATE) if rng.random() < 0.3 else 0)
        pieces += [rng.uniform(0.1, 0.25) * voiced, pause]
        total += n + pause.size
    x = np.concatenate(pieces)[: int(seconds * RATE)] + 0.005 * rng.standard_normal(int(seconds * RATE))
    if rate != RATE:
        x = Resampler(RATE, rate).process(x.astype(np.float32))
    return x.astype(np.float32)


def espeak(text: str, rate: int = RATE) -> np.ndarray | None:
    """Speech from espeak-ng at `rate`, or None when espeak-ng is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    from model.audio import read_wav
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run([exe, "-w", str(path), text], check=True, capture_output=True)
        samples, sr = read_wav(path)
    return Resampler(sr, rate).process(samples.astype(np.float32))


@pytest.fixture(scope="session")
def speech_24k() -> np.ndarray:
    """About two seconds of speech at 24 kHz (espeak-ng when installed, else a synthetic voice that never repeats)."""
    spoken = espeak("Hello, can you hear me? I would like to book a table for two.")
    return spoken if spoken is not None else babble(2.0)


@pytest.fixture(scope="module")
def voice_cache(tmp_path_factory) -> Iterator[Path]:
    """Voices unpack into a private cache for the module that asks, never the user's."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERSONAPLEX_CACHE", str(cache))
        yield cache
