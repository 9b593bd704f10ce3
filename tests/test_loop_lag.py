"""A door process's own loop (app/shell/loop_lag.py): after the start-up freeze each full collection is timed, and a
stall of the loop is reported with where and when the loop was, so that a stall in a load run can be told apart and
found; and what numpy imports at a process's first percentile, and aiortc at its first call, is imported before a
server process serves (an import while serving holds the loop: 35-54 ms for numpy's on a busy host)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest

from app.shell import loop_lag


def test_a_full_collection_after_the_freeze_is_timed() -> None:
    loop_lag.freeze_startup_objects()
    try:
        before = loop_lag.collector_report()
        heap = [[i] for i in range(400_000)]  # what sessions made since the freeze: tracked, walked by a full one
        gc.collect()
        after = loop_lag.collector_report()
        assert after["full_collections"] > before["full_collections"]
        assert after["full_max_ms"] >= 1, (after, len(heap))
    finally:
        gc.callbacks.remove(loop_lag._time_full_collections)
        gc.unfreeze()


def _holds_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # busy in Python, as a callback that does too much is
        pass


async def test_a_stall_of_the_loop_is_reported_with_where_the_loop_was() -> None:
    lag = loop_lag.LoopLag()
    watching = asyncio.ensure_future(lag.run())
    try:
        await asyncio.sleep(0.2)
        held_at = []
        for _ in range(3):
            held_at.append(time.monotonic())
            _holds_the_loop(0.25)
            await asyncio.sleep(loop_lag.PERIOD_S * 2)  # the next wake-up after each stall
        sites = lag.stall_sites()
        ours = {site: n for site, n in sites.items() if " _holds_the_loop" in site}
        assert sum(ours.values()) == 3, sites  # once a stall (its line: the loop's test or its body)
        assert all(site.startswith("test_loop_lag.py:") for site in ours), sites  # not ours: named by its file
        assert lag.quantiles()["max"] >= 200
        times = [at for at, site in lag.stall_times() if " _holds_the_loop" in site]
        assert len(times) == 3, lag.stall_times()
        for began, held in zip(times, held_at, strict=True):  # began: the wake-up that was due within the hold
            assert held - 0.01 <= began <= held + loop_lag.PERIOD_S + 0.001, (times, held_at)
    finally:
        watching.cancel()


class Held:
    """An object a stalled callback's frame holds (a session's buffers, a model's tensors)."""


def _holds_the_loop_with(held: Held, seconds: float) -> None:
    _holds_the_loop(seconds)


async def test_the_stall_watch_keeps_nothing_of_the_stack_it_named_and_is_gone_once_stopped() -> None:
    """The watch names a stall's place and lets go of the loop's frames: else it held every object of the stalled
    stack until the next stall (a stopped server's tensors, freed by that thread as the interpreter ended: a C++
    abort at exit)."""
    lag = loop_lag.LoopLag()
    watching = asyncio.ensure_future(lag.run())
    await asyncio.sleep(0.2)
    held = Held()
    alive = weakref.ref(held)
    _holds_the_loop_with(held, 0.25)
    del held
    await asyncio.sleep(loop_lag.PERIOD_S * 2)
    assert any(" _holds_the_loop" in site for site in lag.stall_sites()), lag.stall_sites()
    assert alive() is None  # freed as the callback returned: no collection needed (a full one may stall the loop)
    thread = lag.stalls.thread
    watching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watching
    assert thread is not None and not thread.is_alive()  # joined as it stops: no daemon left to the interpreter


def test_a_place_in_our_packages_is_named_by_its_file_and_what_it_was_in() -> None:
    """The innermost frame of app/, media/, model/ or bench/, relative to the tree, then the innermost of all: here
    a StallWatch's own thread, waiting in threading's Event.wait."""
    watch = loop_lag.StallWatch()
    watch.start()
    try:
        assert watch.thread is not None and watch.thread.ident is not None
        for _ in range(20):  # it waits nearly all the time; a sample may catch it between two waits
            time.sleep(0.013)
            site = loop_lag.stall_site(sys._current_frames()[watch.thread.ident])
            if " > " in site:
                break
        assert site.startswith("app/shell/loop_lag.py:") and " _watch > wait" in site, site
    finally:
        watch.stop()


def _imported_while_serving(script: str, *args: str) -> str:
    """What `script` prints, run in a fresh process from the repository: the modules it found imported late."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


_IMPORT_THEN_TAKE_A_PERCENTILE = """
import importlib, sys
import numpy as np
importlib.import_module(sys.argv[1])
before = set(sys.modules)
np.percentile(np.arange(4.0), 99.0)
print(" ".join(sorted(set(sys.modules) - before)))
"""


# A door worker's, a load-driver process's and an engine process's entry, each in a process of its own.
@pytest.mark.parametrize("entry", ["app.shell.server", "bench.e2e", "model.engine.process"])
def test_a_door_driver_or_engine_process_imports_nothing_at_its_first_percentile(entry: str) -> None:
    """numpy imports numpy.ma at a process's first median or percentile (35-54 ms of a busy host's loop); a door
    worker, a load-driver process and an engine process have it from their start, so the first quantiles a call's
    end, a /health or the engine's first stats take import nothing."""
    assert _imported_while_serving(_IMPORT_THEN_TAKE_A_PERCENTILE, entry) == ""


_FIRST_WEBRTC_CALL = """
import asyncio, sys
import app.shell.server  # a door worker's entry
from aiortc import RTCPeerConnection
before = set(sys.modules)

async def call() -> None:
    offerer, answerer = RTCPeerConnection(), RTCPeerConnection()
    connected = asyncio.Event()

    @answerer.on("connectionstatechange")
    def changed() -> None:
        if answerer.connectionState == "connected":
            connected.set()

    offerer.createDataChannel("oai-events")
    offerer.addTransceiver("audio")
    await offerer.setLocalDescription(await offerer.createOffer())
    await answerer.setRemoteDescription(offerer.localDescription)
    await answerer.setLocalDescription(await answerer.createAnswer())
    await offerer.setRemoteDescription(answerer.localDescription)
    await asyncio.wait_for(connected.wait(), 30)
    await offerer.close()
    await answerer.close()

asyncio.run(call())
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_a_door_workers_first_webrtc_call_imports_nothing() -> None:
    """aiortc's first peer connection, DTLS handshake included, imports cryptography's OpenSSL backend and its key
    serialization (pyOpenSSL asks for them inside functions); a door worker has them from its start."""
    assert _imported_while_serving(_FIRST_WEBRTC_CALL) == ""
