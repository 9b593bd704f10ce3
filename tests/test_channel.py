"""The engine served over its channel (model/engine/process.py) to a worker's client (model/engine/client.py): a real
engine on the tiny model, a real Unix socket, both ends on one event loop here (in the server they are processes)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from test_engine import GREEDY, Collector, QueueSource, speechlike, tiny_model  # noqa: F401 (fixture)

from model.engine import Engine, EngineConfig, SessionParams
from model.engine.channel import Counters, Frames, encode
from model.engine.client import LEAD_STEP_S, RemoteEngine, RemoteSlot
from model.engine.process import EngineHost
from model.engine.slots import ROW_COUNTS


@pytest.fixture
async def served(tiny_model, tmp_path) -> AsyncIterator[tuple[Engine, EngineHost, str]]:  # noqa: F811
    engine = Engine(tiny_model, EngineConfig(max_sessions=2))
    engine.start()
    path = str(tmp_path / "engine.sock")
    host = EngineHost(engine, tiny_model.info(), path)
    started = asyncio.Event()
    serving = asyncio.ensure_future(host.serve(started))
    await started.wait()
    yield engine, host, path
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    engine.stop()


async def connect(path: str, lead_s: float = 0.008) -> tuple[RemoteEngine, asyncio.Task]:
    client = RemoteEngine(path, worker=0, input_lead_s=lead_s)
    task = asyncio.ensure_future(client.run())
    assert await client.wait_connected(10.0)
    return client, task


async def open_session(client: RemoteEngine, source: QueueSource) -> tuple[RemoteSlot, Collector]:
    """A realtime session of the worker's client with the default voice, greedy, and its outputs collected."""
    slot, out = await client.reserve_wait(0.0), Collector()
    await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), source, out.on_output, out.on_error)
    return slot, out


async def test_a_session_over_the_channel_gives_the_tokens_of_one_in_the_engine(served):
    engine, _, path = served
    params = SessionParams(voice="NATF2", persona="You are kind.", sampling=GREEDY, pacing="input")
    frames = speechlike(8, 4)
    local, local_out = engine.reserve(), Collector()
    await local.start(params, QueueSource(frames), local_out.on_output, local_out.on_error)
    await local_out.wait_for(8)
    local.close()
    client, task = await connect(path)
    try:
        remote, remote_out = await client.reserve_wait(0.0), Collector()
        await remote.start(params, QueueSource(frames), remote_out.on_output, remote_out.on_error)
        # Every frame taken: an input-paced session then waits for the next, so its counters (which come with each
        # tick's frames) hold still. Read after the eighth output, they raced the ninth's tick on a busy machine.
        await remote_out.wait_for(9)
        assert [o.index for o in remote_out.outputs[:9]] == list(range(9))
        for mine, theirs in zip(local_out.outputs[:8], remote_out.outputs[:8]):
            assert np.array_equal(mine.tokens, theirs.tokens) and mine.text == theirs.text
            assert np.array_equal(mine.audio, theirs.audio)
        await asyncio.sleep(0.3)
        stats = remote.stats()  # the session's first model half runs before any frame, then one frame an output
        assert (stats.frames_in, stats.frames_out, len(remote_out.outputs)) == (8, 9, 9), stats
        remote.close()
        deadline = time.monotonic() + 5
        while engine.sessions_in_use():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        task.cancel()


def test_a_sessions_counters_on_the_channel_are_its_rows_counts_in_their_order():
    """The engine process sends each session's counts as its row's counts as they are (a row of `Tick.counts`), and
    a worker reads that row into a session's Counters, field after field."""
    assert Counters.__struct_fields__ == ("sid", *ROW_COUNTS)


async def test_a_realtime_session_over_the_channel_stages_its_frames_and_gets_its_rows_as_its_own(served):
    """Realtime over the channel, as the server runs: the worker's frames arrive before their tick and are staged
    in their rows (the engine counts them), and the tick's frames come back by column, each row handed out as a
    FrameOutput of its own (no view of the whole tick's block)."""
    engine, _, path = served
    client, task = await connect(path)
    try:
        slot, out = await open_session(client, QueueSource(speechlike(40, 3)))
        outputs = await out.wait_for(12)
        slot.close()
        assert [o.index for o in outputs] == list(range(12))
        assert all(o.audio.shape == (1920,) and o.audio.base is None and o.tokens.shape == (17,) for o in outputs)
        assert engine.stats().input_frames_staged > 0
        # The engine process's time on the worker's Frames messages reaches the worker with the engine's stats.
        dispatch = (await client.fresh_stats()).frames_dispatch_ms
        assert set(dispatch) == {"p50", "p99", "max"} and 0 < dispatch["p50"] <= dispatch["p99"] <= dispatch["max"]
    finally:
        task.cancel()


async def test_a_session_that_ended_in_the_engine_keeps_its_own_counts_when_its_row_goes_to_another(served):
    """The link counts its realtime sessions by column, from the rows it keeps for them. A session the engine has
    ended (here: closed there, before its worker hears of it) may still be on the link's roster while its row
    already holds another session: its worker must go on hearing its own counts (its record's), not the row's
    new holder's."""
    _, host, path = served
    client, task = await connect(path)
    try:
        first, first_out = await open_session(client, QueueSource(speechlike(40, 8)))
        await first_out.wait_for(6)
        link = next(iter(host.links))
        link.sessions[first.id].slot.close()  # the engine's side only: the link and the worker still have it
        record = link.sessions[first.id].record  # its counts, as it left its row
        second, second_out = await open_session(client, QueueSource(speechlike(40, 9)))
        assert second.index == first.index  # the ended session's row, taken by the new one
        await second_out.wait_for(record.frames_out + 3)  # the row's counts now past the ended session's
        counted = first.stats()
        assert counted.frames_out >= 6 and (counted.frames_in, counted.frames_out) == (record.frames_in,
                                                                                      record.frames_out), counted
        second.close()
        first.close()
    finally:
        task.cancel()


async def test_realtime_input_that_misses_its_tick_is_counted_and_the_lead_grows(served):
    """A worker whose frames land after their tick (here: sent 6 ms after each deadline) hears of it with the
    next tick, and how late they came, and sends that much earlier at once, with a step to spare, so its frames
    make their ticks again. (It grew one step a late tick before: four late ticks here, each putting every session
    of the worker a frame behind.) Real time: the sends are timed against the engine's ticks on the wall clock (a
    loaded machine may make a few of them late anyway)."""
    _, host, path = served
    client, task = await connect(path, lead_s=-0.006)
    try:
        slot, out = await client.reserve_wait(0.0), Collector()
        source = QueueSource()
        await slot.start(SessionParams(sampling=GREEDY), source, out.on_output, out.on_error)
        link = next(iter(host.links))
        deadline = time.monotonic() + 20
        while client.input_lead_s == -0.006:
            assert time.monotonic() < deadline, link.late_frames
            for frame in speechlike(2, 1):  # the client has audio for every tick
                source.push(frame)
            await asyncio.sleep(0.08)
        assert link.late_frames > 0
        assert client.input_lead_s >= -0.006 + 0.006 + LEAD_STEP_S   # one late tick was enough
        late = link.late_frames
        for _ in range(12):
            source.push(speechlike(1, 2)[0])
            await asyncio.sleep(0.08)
        assert link.late_frames <= late + 4  # with a lead of a few ms most of its 12 frames make their ticks
        assert not out.errors
        slot.close()
    finally:
        task.cancel()


@pytest.mark.parametrize("bad_frame", [np.full(1920, np.nan, dtype=np.float32), np.zeros(1000, dtype=np.float32)],
                         ids=["nan", "short"])
async def test_a_session_that_fails_on_its_input_leaves_its_link_and_the_other_goes_on(served, bad_frame):
    """A frame of NaN fails its session in the engine; a frame of the wrong length, in the worker (frames cross as
    one block, so none may be short), with the engine's own message. Either way the session leaves its link (the
    engine's failure: its worker forgets it and sends no Close, and the link kept it, its counters in every tick's
    message, until the worker went away) and its slot is free; the worker's other session is not disturbed."""
    engine, host, path = served
    client, task = await connect(path)
    try:
        bad_source = QueueSource(speechlike(3, 5))
        bad, bad_out = await open_session(client, bad_source)
        good, good_out = await open_session(client, QueueSource(speechlike(60, 6)))
        link = next(iter(host.links))
        await bad_out.wait_for(2)
        bad_source.push(bad_frame)
        deadline = time.monotonic() + 10
        while bad.id in link.sessions or not bad_out.errors or engine.sessions_in_use() > 1:
            assert time.monotonic() < deadline, (list(link.sessions), bad_out.errors)
            await asyncio.sleep(0.02)
        assert "must be 1920 finite samples" in bad_out.errors[0].message and bad.state == "failed"
        assert set(link.sessions) == {good.id}
        before = len(good_out.outputs)
        await good_out.wait_for(before + 3)
        assert not good_out.errors and good.stats().frames_out >= before + 3
        good.close()
    finally:
        task.cancel()


async def test_a_worker_whose_frames_do_not_match_their_sessions_is_dropped_and_no_other_notices(served):
    """A Frames message whose audio block is not one frame per listed session is a broken worker: its link is
    dropped (the engine closes its connection) and another worker's session goes on."""
    engine, host, path = served
    client, task = await connect(path)
    try:
        good, good_out = await open_session(client, QueueSource(speechlike(60, 7)))
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(encode(Frames(sids=["slot-nobody", "slot-nobody-else"], audio=memoryview(bytes(7680)))))
        await writer.drain()
        deadline = time.monotonic() + 10
        while await asyncio.wait_for(reader.read(1 << 16), timeout=deadline - time.monotonic()):
            pass  # the Welcome, then the end of the stream
        assert len(host.links) == 1
        before = len(good_out.outputs)
        await good_out.wait_for(before + 3)
        assert not good_out.errors
        good.close()
        writer.close()
    finally:
        task.cancel()
