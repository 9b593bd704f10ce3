"""The batched engine on the tiny checkpoint: exactness, admission, underruns, pacing modes, failure isolation."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import itertools
import os
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from model.batch_step import BATCH_BUCKETS, bucket
from model.engine import (
    Engine,
    EngineConfig,
    EngineError,
    FrameOutput,
    InvalidSessionParams,
    ResourceExhausted,
    SamplingParams,
    SessionParams,
)
from model.engine.core import ENGINE_SWITCH_INTERVAL_S
from model.engine.slots import Slot
from model.loading import load_model
from model.precision import Fp8Linear
from model.tiny import write_tiny_checkpoint

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, context=64)
    return load_model(str(folder))


class QueueSource:
    """Frames handed over in order, as a client that already sent them; thread-safe like the jitter buffer."""

    def __init__(self, frames=(), fail_after: int | None = None):
        self._frames = collections.deque(frames)
        self._lock = threading.Lock()
        self._reads = 0
        self._fail_after = fail_after

    def push(self, frame: np.ndarray) -> None:
        with self._lock:
            self._frames.append(frame)

    def read_frame(self):
        with self._lock:
            self._reads += 1
            if self._fail_after is not None and self._reads > self._fail_after:
                raise RuntimeError("source broke")
            return self._frames.popleft() if self._frames else None

    def frames_ready(self) -> int:
        with self._lock:
            return len(self._frames)


class Collector:
    def __init__(self):
        self.outputs: list[FrameOutput] = []
        self.errors: list[EngineError] = []
        self.lock = threading.Lock()

    def on_output(self, out: FrameOutput) -> None:
        with self.lock:
            self.outputs.append(out)

    def on_error(self, err: EngineError) -> None:
        self.errors.append(err)

    async def wait_for(self, count: int, timeout: float = 30.0) -> list[FrameOutput]:
        deadline = time.monotonic() + timeout
        while len(self.outputs) < count and not self.errors:
            assert time.monotonic() < deadline, f"only {len(self.outputs)} of {count} outputs"
            await asyncio.sleep(0.01)
        return self.outputs[:count]


def speechlike(frames: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(frames * 1920) / 24000
    signal = 0.2 * np.sin(2 * np.pi * (150 + 50 * np.sin(2 * np.pi * 0.7 * t)) * t) + 0.02 * rng.standard_normal(t.size)
    return list(signal.astype(np.float32).reshape(frames, 1920))


async def run_session(engine: Engine, params: SessionParams, frames: list[np.ndarray], count: int):
    slot = engine.reserve()
    sink = Collector()
    await slot.start(params, QueueSource(frames), sink.on_output, sink.on_error)
    outputs = await sink.wait_for(count)
    slot.close()
    return slot, outputs


def same(a: list[FrameOutput], b: list[FrameOutput]) -> bool:
    return all(np.array_equal(x.tokens, y.tokens) and np.array_equal(x.audio, y.audio) for x, y in zip(a, b))


@pytest.fixture
def make_engine(tiny_model):
    engines = []

    def make(**kwargs) -> Engine:
        engine = Engine(tiny_model, EngineConfig(**{"max_sessions": 3, **kwargs}))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


PARAMS = SessionParams(voice="NATF2", persona="You are a helpful agent.", sampling=GREEDY, pacing="input")


def test_a_cpu_engine_takes_half_the_cores_for_torch_unless_told(tiny_model):
    """On the CPU the engine's tiny operations pay a thread hand-off each on every extra core, and the server's loops
    want the cores too (EngineConfig.cpu_threads)."""
    before = torch.get_num_threads()
    try:
        Engine(tiny_model, EngineConfig(max_sessions=1))
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        Engine(tiny_model, EngineConfig(max_sessions=1, cpu_threads=3))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_a_cpu_engine_streams_through_the_float32_codec_whatever_the_bf16_flags(tiny_model):
    """Mimi in bf16 is a CUDA option: on the CPU the engine's steps run the model's own float32 codec."""
    engine = Engine(tiny_model, EngineConfig(max_sessions=1, mimi_encoder_bf16=True, mimi_decoder_bf16=True))
    assert engine.runner.mimi is tiny_model.mimi
    state = engine.runner.mimi_state
    assert all(t.dtype == torch.float32 for t in (*state.encoder.convs, state.decoder.kv.keys))


async def test_an_engine_with_fp8_weights_runs_its_prompts_and_steps_on_them_and_leaves_the_model_alone(
        make_engine, tiny_model):
    """EngineConfig.fp8_weights: the engine's steps and its prompt prefill run a sibling of the model with e4m3
    temporal products; the loaded model's own weights stay what they were, so an engine without the flag beside
    it still gives the float path's tokens."""
    exact_before = await run_session(make_engine(), PARAMS, speechlike(12, 3), 10)
    fp8 = make_engine(fp8_weights=True)
    assert isinstance(fp8.runner.lm.transformer.layers[0].gating.linear_in, Fp8Linear)
    assert fp8.runner.scratch.lm is fp8.runner.lm and fp8.runner.lm is not tiny_model.lm
    assert type(tiny_model.lm.transformer.layers[0].gating.linear_in) is torch.nn.Linear
    _, outputs = await run_session(fp8, PARAMS, speechlike(12, 3), 10)
    assert len(outputs) == 10 and all(np.isfinite(o.audio).all() for o in outputs)
    exact_after = await run_session(make_engine(), PARAMS, speechlike(12, 3), 10)
    assert same(exact_before[1], exact_after[1])


def test_batch_sizes_past_the_table_step_by_32_rows_so_few_graphs_are_captured():
    sizes = {n: bucket(n, 290) for n in range(1, 291)}
    assert all(n <= size <= 290 for n, size in sizes.items())
    assert set(sizes.values()) == set(BATCH_BUCKETS) | {288, 290}
    assert bucket(300, 1000) == 320 and bucket(3, 2) == 2


async def test_recycled_slot_is_bit_exact_with_a_fresh_engine(make_engine):
    frames = speechlike(12, 1)
    used = make_engine()
    first, _ = await run_session(used, SessionParams(voice="NATM1", persona="Other text.", sampling=GREEDY,
                                                     pacing="input"), speechlike(15, 9), 10)
    recycled_slot, recycled = await run_session(used, PARAMS, frames, 11)
    assert recycled_slot.index == first.index
    fresh_slot, fresh = await run_session(make_engine(), PARAMS, frames, 11)
    assert fresh_slot.index == recycled_slot.index
    assert same(recycled, fresh)
    # Sampled sessions with the same seed are reproducible too.
    seeded = SessionParams(voice="NATF2", persona="", sampling=SamplingParams(seed=77), pacing="input")
    _, a = await run_session(used, seeded, frames, 11)
    _, b = await run_session(make_engine(), seeded, frames, 11)
    assert same(a, b)


async def test_a_recycled_slot_keeps_no_key_or_value_of_its_last_session(make_engine, tiny_model):
    """A session's end returns its KV pages zeroed: past the new session's own frames its ring reads zeros only, as
    a fresh engine's does, and so does every page no session holds."""
    engine = make_engine()
    params = SessionParams(persona="Be brief.", sampling=GREEDY, pacing="input")
    first, _ = await run_session(engine, params, speechlike(12, 3), 10)
    slot = engine.reserve()
    assert slot.index == first.index
    await slot.start(params, QueueSource([]), Collector().on_output, Collector().on_error)  # prompt from the cache
    engine.stop()
    state = engine.lm_state
    written, held = int(state.pos[slot.index]), tiny_model.config.context
    assert engine.stats().prompt_cache_hits == 1 and written + 10 <= held
    assert all(not entries[:, :, written:].any() for entries in state.kv.read_slots(slot.index, held))
    free = sorted(set(range(state.kv.k.shape[1])) - set(engine.runner.pages.table.flatten().tolist()))
    assert all(not tensor[:, free].any() for tensor in state.kv.tensors())


async def test_prompt_cache_keys_on_the_persona_text_the_model_sees(make_engine):
    """'' plays only the spacers and a whitespace persona is '<system>  <system>' (as the reference wraps it): two
    prompts; '   ' and '\n' are the same text, so the second is a cache hit."""
    engine = make_engine()
    frames = speechlike(6, 4)
    outputs = []
    for persona in ("", "   ", "\n"):
        params = SessionParams(persona=persona, sampling=GREEDY, pacing="input")
        outputs.append((await run_session(engine, params, frames, 6))[1])
    stats = engine.stats()
    assert (stats.prompt_cache_misses, stats.prompt_cache_hits) == (2, 1)
    assert same(outputs[1], outputs[2]) and not same(outputs[0], outputs[1])


async def test_a_voice_file_too_short_to_measure_is_an_invalid_voice(make_engine, tmp_path):
    """The reference's loudness meter needs one 400 ms block; a shorter `.wav` is refused at the start, and the
    slot serves the next session."""
    from model.audio import write_wav

    wav = tmp_path / "short.wav"
    write_wav(wav, np.full(7200, 0.1, np.float32), 24000)
    engine = make_engine(max_sessions=1)
    slot = engine.reserve()
    with pytest.raises(InvalidSessionParams, match="short.wav: not usable as a voice") as info:
        await slot.start(SessionParams(voice=str(wav), sampling=GREEDY), QueueSource(), Collector().on_output,
                         Collector().on_error)
    assert info.value.code == "invalid_voice"
    slot.close()
    _, outputs = await run_session(engine, PARAMS, speechlike(3, 1), 4)
    assert len(outputs) == 4


async def test_batch_invariance_with_sessions_opened_at_different_ticks(make_engine):
    """A realtime session's tokens do not depend on a second session that joins mid-way."""
    frames = speechlike(14, 2)
    realtime = SessionParams(voice="NATF2", persona="Hello.", sampling=GREEDY)
    alone_engine = make_engine()
    _, alone = await run_session(alone_engine, realtime, frames, 12)

    engine = make_engine()
    slot_a, sink_a = engine.reserve(), Collector()
    await slot_a.start(realtime, QueueSource(frames), sink_a.on_output, sink_a.on_error)
    await sink_a.wait_for(4)
    slot_b, sink_b = engine.reserve(), Collector()
    await slot_b.start(SessionParams(voice="NATM1", sampling=GREEDY), QueueSource(speechlike(20, 5)),
                       sink_b.on_output, sink_b.on_error)
    together = await sink_a.wait_for(12)
    assert len(sink_b.outputs) > 0
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(alone, together))
    assert [o.index for o in together] == list(range(12))
    slot_a.close()
    slot_b.close()


async def test_input_clocked_sessions_stepped_in_turn_on_the_spare_row_keep_their_own_state(make_engine):
    """Every one-row step (input-clocked frames, first halves) runs on one spare row, each row's state copied in
    and back: three input-clocked sessions whose frames interleave, with different prompts, give each the tokens and
    audio it gives alone in slot 0."""
    params = [dataclasses.replace(PARAMS, voice=voice, persona=persona)
              for voice, persona in (("NATF2", "Be brief."), ("NATM1", "Hello."), ("NATF2", PARAMS.persona))]
    feeds = [speechlike(16, seed) for seed in (11, 12, 13)]
    alone = []
    for one, frames in zip(params, feeds, strict=True):
        _, outputs = await run_session(make_engine(), one, frames, 14)
        alone.append(outputs)
    engine = make_engine()
    sinks, slots, sources = [Collector() for _ in params], [], [QueueSource() for _ in params]
    for one, source, sink in zip(params, sources, sinks, strict=True):
        slot = engine.reserve()
        await slot.start(one, source, sink.on_output, sink.on_error)
        slots.append(slot)
    assert sorted(slot.index for slot in slots) == [0, 1, 2]
    for i in range(16):
        for source, sink, frames in zip(sources, sinks, feeds, strict=True):
            source.push(frames[i])
            await sink.wait_for(min(i + 1, 14))
    together = [await sink.wait_for(14) for sink in sinks]
    for slot in slots:
        slot.close()
    assert all(same(a, b) for a, b in zip(alone, together, strict=True))


async def test_overflow_and_slot_reuse(make_engine):
    engine = make_engine(max_sessions=2)
    a, b = engine.reserve(), engine.reserve()
    with pytest.raises(ResourceExhausted) as info:
        engine.reserve()
    assert info.value.code == "resource_exhausted" and "limit=2" in info.value.message
    assert engine.sessions_in_use() == 2
    b.close()
    b.close()  # idempotent
    c = engine.reserve()
    assert c.index == b.index and c.id != b.id
    sink = Collector()
    await c.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(5, 3)), sink.on_output, sink.on_error)
    await sink.wait_for(2)
    # A bounded wait for a slot: times out while full, succeeds once one frees.
    with pytest.raises(ResourceExhausted):
        await engine.reserve_wait(0.1)
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, a.close)
    d = await engine.reserve_wait(2.0)
    assert d.index == a.index
    c.close()
    d.close()


async def test_a_realtime_session_whose_audio_waits_loses_no_frame_of_latency_to_its_first_half(make_engine):
    """The open returns once the prompt is in the slot; the session's first model half runs after it (in a gap,
    or right before the first tick's batch when no gap fits). Its client's audio already waits, so the first tick
    after that half takes the first frame; from then on each tick takes one frame and hands out that input's.
    (No budget: the first half always runs right before the tick when no gap came first. A budget of 10 tick
    periods still put it in the batch on a loaded 2-core machine, whose slow first halves raised the estimate.)"""
    engine = make_engine(first_half_tick_budget=float("inf"))
    slot, source, sink = engine.reserve(), QueueSource(speechlike(4, 2)), Collector()
    seen: list[tuple[int, int, int]] = []  # (output index, frames read, ticks done)

    def on_output(out: FrameOutput) -> None:
        seen.append((out.index, source._reads, engine.stats().ticks))
        sink.on_output(out)

    await slot.start(SessionParams(voice="NATF2", persona="Hello there.", sampling=GREEDY), source, on_output,
                     sink.on_error)
    await sink.wait_for(5)
    assert [(index, reads) for index, reads, _ in seen[:5]] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)]
    assert seen[0][2] == seen[1][2]  # no tick between the first half's frame and the first input's
    assert slot.stats().frames_in == 4
    slot.close()


async def test_a_realtime_session_counts_no_underrun_before_its_first_half(make_engine):
    """With no client audio yet, the session's first frame (its first model half: in a gap, or in the first tick's
    batch, which then reads nothing from it) comes without a read or an underrun. Frames that come later are taken
    one per tick. (They are pushed as the first frame is handed out, on the engine thread, so they wait before the
    next tick: pushed from the test's loop, a loaded machine let a tick come first and underrun.)"""
    engine = make_engine()
    slot, source, sink = engine.reserve(), QueueSource(), Collector()
    at_output: list[tuple[int, int]] = []  # (frames read, underruns) when each output was handed out

    def on_output(out: FrameOutput) -> None:
        at_output.append((source._reads, slot.stats().underruns))
        if out.index == 0:
            for frame in speechlike(3, 5):
                source.push(frame)
        sink.on_output(out)

    await slot.start(SessionParams(voice="NATF2", persona="Hello there.", sampling=GREEDY), source, on_output,
                     sink.on_error)
    outputs = await sink.wait_for(4)
    assert at_output[0] == (0, 0)
    assert [out.index for out in outputs] == [0, 1, 2, 3]
    assert slot.stats().frames_in == 3
    slot.close()
    starts = engine.stats()  # the start's request to live, and to the first frame, as quantiles over recent starts
    assert 0 < starts.start_ms["p50"] <= starts.first_frame_ms["p50"] == starts.first_frame_ms["max"]


async def test_a_sessions_frame_counts_go_on_across_a_restart_stay_once_it_ends_and_its_row_counts_anew(make_engine):
    """The frames a session took in and handed out go on across a restart, are what they were once it ends, and the
    next session in its row counts from zero: a realtime session read by the tick, an input-clocked one read between
    ticks."""
    engine = make_engine(max_sessions=1)
    first, source, sink = engine.reserve(), QueueSource(speechlike(6, 7)), Collector()
    await first.start(SessionParams(sampling=GREEDY), source, sink.on_output, sink.on_error)
    deadline = time.monotonic() + 10
    while first.stats().frames_in < 6:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await first.restart()
    for frame in speechlike(4, 8):
        source.push(frame)
    while first.stats().frames_in < 10:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    first.close()
    ended = first.stats()
    assert ended.frames_in == 10 and ended.frames_out == len(sink.outputs) > 10 and ended.state == "closed"

    second, second_sink = engine.reserve(), Collector()
    assert second.index == first.index and second.stats().frames_in == second.stats().frames_out == 0
    await second.start(SessionParams(sampling=GREEDY, pacing="input"), QueueSource(speechlike(5, 9)),
                       second_sink.on_output, second_sink.on_error)
    await second_sink.wait_for(6)  # input-clocked: its first half's frame, then one for each frame in
    second.close()
    assert (second.stats().frames_in, second.stats().frames_out) == (5, len(second_sink.outputs))
    assert first.stats() == ended


class HandsOverItsRow(QueueSource):
    """A source that, as the engine reads its `read`-th frame, closes its session and reserves the next in the
    same row, as another thread may between the engine's choosing the session and its counting what it read."""

    def __init__(self, engine: Engine, frames, read: int):
        super().__init__(frames)
        self.engine, self.read, self.slot, self.next_slot = engine, read, None, None

    def read_frame(self):
        frame = super().read_frame()
        if self._reads == self.read:
            self.slot.close()
            self.next_slot = self.engine.reserve()
        return frame


@pytest.mark.parametrize(("pacing", "read", "underrun"), [("input", 3, False), ("realtime", 3, False),
                                                          ("realtime", 5, True)])
async def test_a_frame_read_as_its_session_closes_counts_nothing_for_the_next_session_of_its_row(
        make_engine, pacing, read, underrun):
    """A session closed, and its row reserved again, while the engine thread read its frame (an input-clocked
    step's, a tick's, or a tick's underrun): the next session's counts start at zero, and the closed one's stay as
    they were when it closed."""
    engine = make_engine(max_sessions=1)
    slot, sink = engine.reserve(), Collector()
    source = HandsOverItsRow(engine, speechlike(4 if underrun else 8, 2), read)
    source.slot = slot
    await slot.start(SessionParams(sampling=GREEDY, pacing=pacing), source, sink.on_output, sink.on_error)
    deadline = time.monotonic() + 10
    while source.next_slot is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # the engine thread has counted what it read, wherever it counts it
    second = source.next_slot.stats()
    assert (second.frames_in, second.frames_out, second.underruns) == (0, 0, 0), second
    ended = slot.stats()
    assert ended.state == "closed" and ended.frames_in == read - 1, ended
    source.next_slot.close()


async def test_underrun_feeds_silence_and_is_counted(make_engine):
    engine = make_engine()
    slot, sink = engine.reserve(), Collector()
    source = QueueSource(speechlike(2, 4))
    await slot.start(SessionParams(sampling=GREEDY), source, sink.on_output, sink.on_error)
    await sink.wait_for(7)  # the start's frame (the last prompt spacer), then one per tick
    stats = slot.stats()
    assert stats.frames_in == 2
    assert stats.frames_out >= 7
    # Every frame out after the first half's took an input frame or counted an underrun (the tick that runs a
    # first half in its batch takes neither).
    assert stats.underruns >= stats.frames_out - stats.frames_in - 2
    # The session keeps running on silence (its timeline advances with the clock) and recovers when input arrives.
    source.push(speechlike(1, 6)[0])
    deadline = time.monotonic() + 5
    while slot.stats().frames_in < 3:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    slot.close()
    assert engine.stats().ticks > 0


async def test_input_clocked_gets_a_frame_a_tick_or_more_beside_a_realtime_session(make_engine):
    """Never slower than real time by the engine's own clock, its ticks: the input-clocked session gets at least a
    frame a tick, stepped between them, and the realtime one keeps one frame a tick. How much faster is the machine's
    to say: on the 2-core CPU a tiny tick and a one-row step each take ~38 ms, so a second step fits in some gaps
    only (36 ticks for 40 frames idle; 40 for 40 with a busy loop beside it), and the speed is a bench's to measure."""
    engine = make_engine()
    rt_slot, rt_sink = engine.reserve(), Collector()
    await rt_slot.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(50, 1)), rt_sink.on_output,
                        rt_sink.on_error)
    await rt_sink.wait_for(1)
    off_slot, off_sink = engine.reserve(), Collector()
    frames = 40
    ticks_before, realtime_before = engine.stats().ticks, len(rt_sink.outputs)
    await off_slot.start(SessionParams(sampling=GREEDY, pacing="input"), QueueSource(speechlike(frames, 2)),
                         off_sink.on_output, off_sink.on_error)
    await off_sink.wait_for(frames)
    ticks_during, realtime_during = engine.stats().ticks - ticks_before, len(rt_sink.outputs) - realtime_before
    assert ticks_during <= frames
    assert 1 <= realtime_during <= ticks_during + 1
    assert off_slot.stats().underruns == 0
    # Input-clocked output equals the same session stepped in realtime lockstep (the two paths agree).
    rt_slot.close()
    off_slot.close()
    _, lockstep = await run_session(make_engine(), SessionParams(sampling=GREEDY), speechlike(frames, 2), 20)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(off_sink.outputs[:20], lockstep))


async def test_a_failing_slot_does_not_stop_the_others(make_engine):
    engine = make_engine(max_sessions=5)
    good, good_sink = engine.reserve(), Collector()
    await good.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(40, 1)), good_sink.on_output,
                     good_sink.on_error)
    bad, bad_sink = engine.reserve(), Collector()
    await bad.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(40, 2), fail_after=3),
                    bad_sink.on_output, bad_sink.on_error)
    nan, nan_sink = engine.reserve(), Collector()
    await nan.start(SessionParams(sampling=GREEDY), QueueSource([np.full(1920, np.nan, np.float32)]),
                    nan_sink.on_output, nan_sink.on_error)
    # Frames of the wrong length, among the others' in one tick: one of 960 samples, and one of a single sample
    # (which numpy would spread over the whole row).
    misshapen = []
    for frame in (np.zeros(960, np.float32), np.ones(1, np.float32)):
        slot, sink = engine.reserve(), Collector()
        await slot.start(SessionParams(sampling=GREEDY), QueueSource([frame]), sink.on_output, sink.on_error)
        misshapen.append((slot, sink))
    before = len(good_sink.outputs)
    await good_sink.wait_for(before + 8)
    assert bad_sink.errors and bad_sink.errors[0].code == "runtime_failed" and "source broke" in str(bad_sink.errors[0])
    assert nan_sink.errors and "finite" in str(nan_sink.errors[0])
    for slot, sink in misshapen:
        assert sink.errors and "1920 finite samples" in str(sink.errors[0]) and slot.stats().state == "failed"
    assert bad.stats().state == "failed" and good.stats().state == "live"
    assert not good_sink.errors
    # Failed slots are free again.
    assert engine.sessions_in_use() == 1
    assert engine.stats().errors == 4
    good.close()


async def test_invalid_params_are_refused_before_prefill(make_engine):
    engine = make_engine()
    slot = engine.reserve()
    sink = Collector()
    with pytest.raises(InvalidSessionParams) as info:
        await slot.start(SessionParams(voice="NOPE"), QueueSource(), sink.on_output, sink.on_error)
    assert info.value.code == "invalid_voice" and "NATF2" in info.value.message
    with pytest.raises(InvalidSessionParams, match="topk_audio"):
        await slot.start(SessionParams(sampling=SamplingParams(topk_audio=0)), QueueSource(), sink.on_output,
                         sink.on_error)
    with pytest.raises(InvalidSessionParams, match="pacing"):
        await slot.start(SessionParams(pacing="fast"), QueueSource(), sink.on_output, sink.on_error)
    slot.close()


async def test_restart_gives_a_fresh_context(make_engine):
    engine = make_engine()
    frames = speechlike(30, 8)
    source = QueueSource(frames[:10])
    slot, sink = engine.reserve(), Collector()
    await slot.start(PARAMS, source, sink.on_output, sink.on_error)
    first = list(await sink.wait_for(11))  # the start's frame, then one per input frame
    sink.outputs.clear()
    await slot.restart()
    for f in frames[:10]:
        source.push(f)
    again = await sink.wait_for(11)
    assert again[0].index == 0
    assert same(first, again)
    slot.close()
    stats = engine.stats()
    assert stats.prompt_cache_hits >= 1
    assert set(stats.parts_ms) >= {"encode", "temporal", "depformer", "decode"} or stats.ticks == 0


async def test_stop_answers_pending_opens(tiny_model):
    engine = Engine(tiny_model, EngineConfig(max_sessions=2))
    engine.start()
    slot = engine.reserve()
    sink = Collector()
    opening = asyncio.ensure_future(slot.start(PARAMS, QueueSource(), sink.on_output, sink.on_error))
    engine.stop()
    try:
        await asyncio.wait_for(opening, 5)
    except EngineError as exc:
        assert exc.code in ("engine_stopped", "session_closed")
    with pytest.raises(EngineError, match="not running"):
        await engine.reserve().start(PARAMS, QueueSource(), sink.on_output, sink.on_error)


def test_start_takes_the_loaded_model_out_of_the_collectors_view(tiny_model):
    """A full collection would walk the model, graphs and imports with the GIL held, stalling ticks."""
    gc.unfreeze()
    engine = Engine(tiny_model, EngineConfig(max_sessions=1))
    engine.start()
    try:
        collectable = gc.get_objects()
        assert gc.get_freeze_count() > len(collectable)
        assert not any(o is tiny_model or o is engine for o in collectable)
    finally:
        engine.stop()
    assert gc.get_freeze_count() == 0  # a stopped engine's objects can be collected again


async def test_the_engine_thread_runs_the_garbage_collector_between_ticks(make_engine):
    """While an engine runs, allocations no longer start collections (one could fall inside a tick); its thread
    collects after each tick instead, and garbage cycles made on other threads still go."""
    engine = make_engine()
    assert not gc.isenabled()

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle
    gone = weakref.ref(cycle)
    del cycle
    allocations = [[] for _ in range(5 * gc.get_threshold()[0])]  # past the youngest generation's threshold
    deadline = time.monotonic() + 5
    while gone() is not None:
        assert time.monotonic() < deadline, "the cycle was never collected"
        await asyncio.sleep(0.02)
    del allocations
    engine.stop()
    assert gc.isenabled()


async def test_a_ticks_outputs_go_out_before_the_engine_thread_collects_garbage(make_engine):
    """The worker processes' outputs leave through the engine host's asyncio thread after the tick's listeners ran,
    and a collection holds the GIL that thread needs: collecting between the tick and its listeners held every
    worker's frame at once. A collection now waits for the last tick's listeners (COLLECT_AFTER_TICK_S after them,
    or just before the next tick where none left that gap)."""
    engine = make_engine()
    listened: list[float] = []
    collections: list[tuple[float, float, float]] = []  # (started, the last tick's end, its listeners' call)

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start" and threading.current_thread().name == "engine-tick":
            collections.append((time.monotonic(), engine.counters.last_tick_at, listened[-1] if listened else 0.0))

    engine.add_tick_listener(lambda record, next_tick_at: listened.append(time.monotonic()))
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # every pass of the engine's collector finds work
    gc.callbacks.append(on_collection)
    try:
        slot = engine.reserve()
        sink = Collector()
        source = QueueSource(speechlike(40, seed=5))
        await slot.start(dataclasses.replace(PARAMS, pacing="realtime"), source, sink.on_output, sink.on_error)
        await sink.wait_for(8)
        closed_at = time.monotonic()  # ticks with no live session call no listener
        slot.close()
    finally:
        gc.callbacks.remove(on_collection)
        gc.set_threshold(*thresholds)
    after_ticks = [c for c in collections if c[0] < closed_at and c[1] > 0 and c[2] > 0]
    assert len(after_ticks) >= 4, collections
    assert all(listener_at >= tick_end for _, tick_end, listener_at in after_ticks), \
        "a collection ran between a tick and its listeners"
    stats = engine.stats()  # what operators see of them (the metrics' personaplex_engine_gc_*)
    assert stats.gc_collections >= len(after_ticks) and stats.gc_ms_max > 0


def test_threads_hand_over_the_gil_every_half_millisecond_while_an_engine_runs(tiny_model):
    """Each torch op of a CPU tick gives up the GIL and waits to take it back; at Python's 5 ms a busy event loop
    made every one of those waits 5 ms (a 14 ms tick took ~750 ms). The last engine to stop restores the interval."""
    before = sys.getswitchinterval()
    first, second = Engine(tiny_model, EngineConfig(max_sessions=1)), Engine(tiny_model, EngineConfig(max_sessions=1))
    first.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S)
        second.start()
        second.stop()
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S)  # the first still runs
    finally:
        first.stop()
    assert sys.getswitchinterval() == pytest.approx(before)


async def test_a_step_hands_out_the_frame_of_the_input_it_took(make_engine, tiny_model):
    """The model runs one call ahead of the reference's order: a session has a frame as soon as it starts, and
    the frame handed out after input frame i is frame i itself, carrying that input's own user codes (the
    reference would hand out frame i - 1 at that point)."""
    engine = make_engine()
    source, sink = QueueSource(), Collector()
    await engine.reserve().start(PARAMS, source, sink.on_output, sink.on_error)
    assert len(sink.outputs) == 1 and sink.outputs[0].index == 0
    mimi = tiny_model.mimi
    fresh = mimi.init_state(1, "cpu")
    for i, frame in enumerate(speechlike(6, 4)):
        own_codes = mimi.encode_frame(torch.from_numpy(frame)[None], fresh)[0].numpy()
        source.push(frame)
        outputs = await sink.wait_for(i + 2)
        assert np.array_equal(outputs[i + 1].tokens[9:], own_codes)


async def test_a_session_opened_while_others_tick_starts_fresh(make_engine):
    """Ticks that run between the chunks of a session's prompt leave its row untouched: its output equals the same
    session's on an idle engine, audio included (the Mimi state it starts from is fresh)."""
    joiner = SessionParams(voice="NATM1", persona="You are a patient tutor.", sampling=GREEDY)
    frames = speechlike(10, 6)
    _, alone = await run_session(make_engine(prefill_chunk=4), joiner, frames, 8)

    engine = make_engine(prefill_chunk=4)  # a prompt of many steps, with ticks in between
    first, busy = engine.reserve(), engine.reserve()
    sink = Collector()
    for slot in (first, busy):
        await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), QueueSource(speechlike(60, 7)),
                         sink.on_output, sink.on_error)
    first.close()  # the joiner takes row 0, inside the batch that keeps ticking for row 1
    await sink.wait_for(6)
    ticks = engine.stats().ticks
    slot, together = await run_session(engine, joiner, frames, 8)
    assert slot.index == 0 and engine.stats().ticks > ticks
    for a, b in zip(alone, together, strict=True):  # audio to float rounding: a batch of 2 sums in another order
        assert np.array_equal(a.tokens, b.tokens) and np.allclose(a.audio, b.audio, atol=1e-5)
    busy.close()


async def test_a_session_opens_even_when_no_gap_between_ticks_fits_its_steps(make_engine):
    """Ticks longer than planned (here a 1 ms budget that every tick overruns) leave no gap that fits a prompt
    chunk: the start's steps run anyway once they have waited, so the open completes and the live session goes on."""
    engine = make_engine(tick_ms=1.0, prefill_chunk=4)
    live_sink = Collector()
    await engine.reserve().start(SessionParams(voice="NATF2", sampling=GREEDY), QueueSource(speechlike(400, 8)),
                                 live_sink.on_output, live_sink.on_error)
    await live_sink.wait_for(5)
    before = len(live_sink.outputs)
    slot = engine.reserve()
    sink = Collector()
    await asyncio.wait_for(slot.start(PARAMS, QueueSource(speechlike(2, 9)), sink.on_output, sink.on_error), 30)
    assert [out.index for out in await sink.wait_for(1)] == [0]
    assert len(live_sink.outputs) > before and not live_sink.errors
    assert engine.stats().late_ticks > 0


class SlowSource(QueueSource):
    """A source whose every read takes `seconds` (a jitter buffer splicing under a loaded host)."""

    def __init__(self, frames, seconds: float):
        super().__init__(frames)
        self.seconds = seconds

    def read_frame(self):
        time.sleep(self.seconds)
        return super().read_frame()


async def test_a_ticks_time_and_its_prepare_phase_count_reading_the_inputs(make_engine):
    """Reading each session's frame is the tick's host work: its time and its "prepare" phase count it (they
    began after the reads, leaving out ~1 ms at 250 sessions), and so does prepare's part "prepare_inputs", apart
    from its part "prepare_launch" (the runner's uploads and launches)."""
    engine = make_engine()
    slot, sink, records = engine.reserve(), Collector(), []
    engine.add_tick_listener(lambda record, _: records.append(record))
    await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), SlowSource(speechlike(10, 1), 0.03),
                     sink.on_output, sink.on_error)
    await sink.wait_for(4)
    slot.close()
    read = [r for r in records if r.batch >= 1][1:]  # the first tick ran the session's first half, reading nothing
    assert read and all(r.ms >= 30.0 and r.host_ms["prepare"] >= 30.0 for r in read), read
    for record in read:
        host = record.host_ms
        assert 30.0 <= host["prepare_inputs"] <= host["prepare"] - host["prepare_launch"], host


async def test_warming_the_ticks_first_calls_before_each_deadline_changes_no_frame(make_engine):
    """EngineConfig.warm_lead_ms: the engine thread wakes that long before each tick's deadline and makes the tick's
    first host calls once on samples of their own: the ticks are warmed, and a session's frames are those of an
    engine that does not warm them."""
    params = dataclasses.replace(PARAMS, pacing="realtime")
    unwarmed = make_engine(warm_lead_ms=0.0)
    _, plain = await run_session(unwarmed, params, speechlike(12, 3), 10)
    assert unwarmed.runner.tick_warm_ups == 0
    engine = make_engine(warm_lead_ms=2.0)
    _, warmed = await run_session(engine, params, speechlike(12, 3), 10)
    assert len(warmed) == 10 and same(plain, warmed)
    # Ticks were warmed, once a deadline at most (the one after the last tick may have had its lead too). Not every
    # tick: the engine thread wakes into the lead only when the machine lets it (on the 2-core CPU beside another
    # test run, 6 of 10 ticks did, none of them late).
    assert 0 < engine.runner.tick_warm_ups <= engine.stats().ticks + 1, engine.runner.tick_warm_ups


async def test_prepare_launch_splits_into_uploads_steps_and_outputs_around_the_step(make_engine):
    """"prepare_launch" is its three parts end to end: the uploads before the step, the step's parts (on the CPU,
    run: every device part's time falls in "prepare_steps"), and the outputs' queueing after them."""
    engine = make_engine()
    slot, sink, records = engine.reserve(), Collector(), []
    engine.add_tick_listener(lambda record, _: records.append(record))
    await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), QueueSource(speechlike(8, 1)), sink.on_output,
                     sink.on_error)
    await sink.wait_for(5)
    slot.close()
    stepped = [r for r in records if r.batch >= 1 and r.parts_ms]
    assert stepped, records
    for record in stepped:
        host = record.host_ms
        parts = [host[name] for name in ("prepare_uploads", "prepare_steps", "prepare_outputs")]
        assert min(parts) >= 0.0 and sum(parts) == pytest.approx(host["prepare_launch"], abs=1e-6), host
        assert host["prepare_steps"] >= sum(record.parts_ms.values()) > 0.0, (host, record.parts_ms)


async def test_tick_listeners_hear_each_tick_after_its_frames_with_the_next_deadline(make_engine):
    """An engine process forwards each tick's frames as one batch: after a realtime tick's deliveries, on the
    engine thread, a listener gets the tick's record and the monotonic deadline of the next tick; the stats say
    when the engine last ticked."""
    before = time.monotonic()
    engine = make_engine()
    slot, sink, heard = engine.reserve(), Collector(), []

    def listener(record, next_tick_at):
        heard.append((record, next_tick_at, engine.next_tick_at, threading.current_thread().name, len(sink.outputs)))

    engine.add_tick_listener(listener)
    await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), QueueSource(speechlike(10, 1)), sink.on_output,
                     sink.on_error)
    await sink.wait_for(6)
    slot.close()
    calls = list(heard)
    assert len(calls) >= 4
    for k, (record, next_tick_at, current, thread, delivered) in enumerate(calls, start=1):
        assert record.batch >= 1 and thread == "engine-tick" and next_tick_at == current
        assert delivered >= k  # this tick's frame (and every earlier one) was handed out first
    deadlines = [call[1] for call in calls]
    tick_s = engine.config.tick_ms / 1000
    assert all(b - a >= tick_s - 1e-9 for a, b in itertools.pairwise(deadlines))
    assert before < engine.stats().last_tick_at <= time.monotonic()


async def test_a_prompt_added_mid_call_goes_on_in_the_context_and_a_restart_takes_the_new_persona(make_engine):
    """Slot.add_prompt: the row's context goes on (frame indices continue, the frames before are untouched, the
    frames after answer the longer context), and the persona it sets is the one a later restart prompts with."""
    engine = make_engine()
    frames = speechlike(16, 11)
    new = "You speak only about the weather."

    async def call(add: bool) -> tuple[list[FrameOutput], list[FrameOutput]]:
        source, sink, slot = QueueSource(frames[:6]), Collector(), engine.reserve()
        await slot.start(PARAMS, source, sink.on_output, sink.on_error)
        before = list(await sink.wait_for(7))
        if add:
            await slot.add_prompt(new, persona=new)
        for f in frames[6:]:
            source.push(f)
        after = await sink.wait_for(7 + 10 + int(add))   # an input-clocked row's return gives one frame more
        assert not sink.errors
        if add:
            sink.outputs.clear()
            await slot.restart()
            for f in frames[:6]:
                source.push(f)
            restarted = await sink.wait_for(7)
            fresh_source, fresh_sink, fresh = QueueSource(frames[:6]), Collector(), engine.reserve()
            await fresh.start(dataclasses.replace(PARAMS, persona=new), fresh_source, fresh_sink.on_output,
                              fresh_sink.on_error)
            assert same(restarted, await fresh_sink.wait_for(7))
            fresh.close()
        slot.close()
        return before, after

    plain_before, plain_after = await call(add=False)
    before, after = await call(add=True)
    assert same(before, plain_before)
    assert [f.index for f in after] == list(range(len(after)))
    assert not same(after[7:], plain_after[7:])


async def test_a_prompt_added_to_a_realtime_call_costs_the_caller_no_frame(make_engine):
    """A realtime row leaves the ticks only between two of them: every tick still hands it its frame."""
    engine = make_engine()
    source, sink, slot = QueueSource(speechlike(200, 12)), Collector(), engine.reserve()
    await slot.start(dataclasses.replace(PARAMS, pacing="realtime"), source, sink.on_output, sink.on_error)
    await sink.wait_for(5)
    ticks_before = engine.stats().ticks
    await slot.add_prompt("Be brief.")
    await sink.wait_for(len(sink.outputs) + 10)
    ticks = engine.stats().ticks - ticks_before
    outputs = list(sink.outputs)
    slot.close()
    assert [f.index for f in outputs] == list(range(len(outputs)))
    assert not sink.errors and slot.stats().underruns == 0
    assert len(outputs) - 5 >= ticks - 1     # one frame per tick since the prompt was asked for


class ArrivingFrames:
    """An engine process's feed, run by a tick listener (the engine thread, between ticks): each of its calls a
    frame arrives, offered to the next tick (`Slot.offer`) and queued in the session's source where it is refused.
    Its `double`-th call sends two (the second finds the first staged), the call after it one more (behind the
    queued one); any other call finding a frame queued sends none, so the tick drains the queue."""

    def __init__(self, frames: list[np.ndarray], source: QueueSource, double: int = 2):
        self.frames, self.source, self.double = collections.deque(frames), source, double
        self.slot = None
        self.calls = 0
        self.offers: list[tuple[bool, bool]] = []  # (staged, what the rules say: nothing queued, nothing staged)

    def __call__(self, record, next_tick_at) -> None:
        if self.slot is None or (self.source.frames_ready() > 0 and self.calls != self.double):
            return
        self.calls += 1
        staged_now = False
        for _ in range(2 if self.calls == self.double else 1):
            if not self.frames:
                return
            frame = self.frames.popleft()
            expected = self.source.frames_ready() == 0 and not staged_now
            staged = self.slot.offer(frame)
            self.offers.append((staged, expected))
            staged_now |= staged
            if not staged:
                self.source.push(frame)


async def test_frames_staged_as_they_arrive_step_in_order_as_queued_ones(make_engine):
    """A realtime session fed as the engine process feeds it (frames offered to the next tick as they arrive
    between ticks, queued where they cannot be staged) steps exactly what a session whose frames were all queued
    steps: in order, none lost, no underrun. A frame is staged where none is queued before it and none is staged
    yet, and only there."""
    frames = speechlike(14, 2)
    realtime = SessionParams(voice="NATF2", persona="Hello.", sampling=GREEDY)
    _, queued = await run_session(make_engine(), realtime, frames, 12)

    engine = make_engine()
    slot, sink, source = engine.reserve(), Collector(), QueueSource(frames[:1])  # the first sent with the start
    arriving = ArrivingFrames(frames[1:], source)
    engine.add_tick_listener(arriving)
    arriving.slot = slot
    await slot.start(realtime, source, sink.on_output, sink.on_error)
    outputs = await sink.wait_for(12)
    stats = slot.stats()
    slot.close()
    assert [o.index for o in outputs] == list(range(12))
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(queued, outputs))
    assert stats.underruns == 0 and stats.frames_in >= 11
    assert all(staged == expected for staged, expected in arriving.offers), arriving.offers
    assert sum(staged for staged, _ in arriving.offers) >= 6
    assert engine.stats().input_frames_staged == sum(staged for staged, _ in arriving.offers)
    assert arriving.offers[arriving.double - 1 : arriving.double + 2] == [(True, True), (False, False), (False, False)]


async def test_a_frame_staged_for_a_closed_session_never_reaches_the_next_session_of_its_row(make_engine):
    """A frame staged in a row whose session then closes, before any tick took it, is not the input of the next
    session in that row: that session steps what it would step on a fresh engine. And a frame with non-finite
    samples is never staged: queued, the tick refuses it and fails its session, as any."""
    frames = speechlike(10, 4)
    realtime = SessionParams(voice="NATM1", sampling=GREEDY)
    _, fresh = await run_session(make_engine(), realtime, frames, 8)

    engine = make_engine()
    first, first_sink = engine.reserve(), Collector()
    stale = speechlike(1, 9)[0]
    closed = asyncio.get_running_loop().create_future()

    def stage_then_close(record, next_tick_at) -> None:
        if not closed.done() and first_sink.outputs and first.offer(stale):
            first.close()
            closed.get_loop().call_soon_threadsafe(closed.set_result, None)

    engine.add_tick_listener(stage_then_close)
    await first.start(realtime, QueueSource(), first_sink.on_output, first_sink.on_error)
    await asyncio.wait_for(closed, 30)
    second, sink = engine.reserve(), Collector()
    assert second.index == first.index and not second.offer(stale)  # not live yet
    await second.start(realtime, QueueSource(frames), sink.on_output, sink.on_error)
    outputs = await sink.wait_for(8)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(fresh, outputs))
    assert second.stats().underruns == 0
    second.close()

    nan, nan_sink = engine.reserve(), Collector()
    source = QueueSource()
    await nan.start(realtime, source, nan_sink.on_output, nan_sink.on_error)
    await nan_sink.wait_for(2)
    frame = np.full(1920, np.nan, np.float32)
    assert not nan.offer(frame)
    source.push(frame)
    deadline = time.monotonic() + 10
    while not nan_sink.errors:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert "finite" in str(nan_sink.errors[0]) and nan.stats().state == "failed"


async def test_a_messages_frames_are_staged_at_once_each_by_the_rules_for_it_alone(make_engine):
    """`Slot.offer_all`, as an engine process offers a worker's Frames message: one check and one lock for all,
    and each frame staged or not by the rules for it alone. A finite frame of a session with nothing queued is; one
    with a non-finite sample, or whose session has a frame queued, is not, and neither stops the others; a row
    staged already takes no second."""
    engine = make_engine()
    slots, sinks, sources = [], [], []
    for _ in range(3):
        slot, sink, source = engine.reserve(), Collector(), QueueSource()
        await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), source, sink.on_output, sink.on_error)
        slots.append(slot), sinks.append(sink), sources.append(source)
    frames = np.stack(speechlike(3, 2))
    frames[1, 7] = np.nan
    offers = asyncio.get_running_loop().create_future()

    def offer_between_ticks(record, next_tick_at) -> None:
        if not offers.done() and all(sink.outputs for sink in sinks):
            sources[2].push(speechlike(1, 1)[0])  # its next frame, queued before this message's
            staged = engine.stats().input_frames_staged
            first, second = Slot.offer_all(slots, frames), Slot.offer_all(slots[:1], frames[:1])
            result = (first, second, engine.stats().input_frames_staged - staged)
            offers.get_loop().call_soon_threadsafe(offers.set_result, result)

    engine.add_tick_listener(offer_between_ticks)
    assert await asyncio.wait_for(offers, 30) == ([True, False, False], [False], 1)
    for slot in slots:
        slot.close()


async def test_an_engine_with_staging_off_queues_every_frame_it_is_offered(make_engine):
    """EngineConfig.stage_inputs off: every offer is refused, so every frame queues and the tick copies it."""
    frames = speechlike(8, 3)
    engine = make_engine(stage_inputs=False)
    slot, sink, source = engine.reserve(), Collector(), QueueSource(frames[:1])
    arriving = ArrivingFrames(frames[1:], source)
    engine.add_tick_listener(arriving)
    arriving.slot = slot
    await slot.start(SessionParams(voice="NATF2", sampling=GREEDY), source, sink.on_output, sink.on_error)
    await sink.wait_for(6)
    slot.close()
    assert arriving.offers and not any(staged for staged, _ in arriving.offers)
    assert slot.stats().underruns == 0


class RowsCollector:
    """An output group's calls (the engine thread), each row as a FrameOutput."""

    def __init__(self, fail: bool = False):
        self.calls: list[list[str]] = []
        self.frames: dict[str, list[FrameOutput]] = collections.defaultdict(list)
        self.fail = fail

    def __call__(self, rows) -> None:
        if self.fail:
            raise RuntimeError("group broke")
        self.calls.append(list(rows.ids))
        for sid, index, text, audio, tokens in zip(rows.ids, rows.indices, rows.texts, rows.audio, rows.frames,
                                                   strict=True):
            self.frames[sid].append(FrameOutput(index, audio, text, tokens))


async def test_an_output_groups_sessions_get_their_frames_as_rows_once_a_tick(make_engine):
    """Sessions started in an output group get no FrameOutput each: the group's call takes a tick's frames of all
    of them at once, as rows of the tick's outputs, each with what it gets as a session of its own (index, text,
    tokens): inputs that differ keep each session's rows its own."""
    inputs = [speechlike(12, 2), speechlike(12, 5)]
    params = SessionParams(voice="NATF2", persona="Hello.", sampling=GREEDY)
    alone = [(await run_session(make_engine(), params, frames, 10))[1] for frames in inputs]
    assert not all(np.array_equal(x.tokens, y.tokens) for x, y in zip(*alone))  # the inputs tell them apart

    engine = make_engine()
    group = RowsCollector()
    key = engine.add_output_group(group)
    slots, sinks = [engine.reserve(), engine.reserve()], [Collector(), Collector()]
    for slot, sink, frames in zip(slots, sinks, inputs):
        await slot.start(params, QueueSource(frames), sink.on_output, sink.on_error, output_group=key)
    deadline = time.monotonic() + 30
    while min(len(group.frames[slot.id]) for slot in slots) < 10:
        assert time.monotonic() < deadline and not any(sink.errors for sink in sinks)
        await asyncio.sleep(0.02)
    for slot in slots:
        slot.close()
    assert not any(sink.outputs for sink in sinks)  # nothing per session
    for slot, own in zip(slots, alone):
        rows = group.frames[slot.id][:10]
        assert [o.index for o in rows] == list(range(10)) and slot.stats().frames_out >= 10
        assert all(np.array_equal(x.tokens, y.tokens) and x.text == y.text for x, y in zip(own, rows))
    assert any(call == [slots[0].id, slots[1].id] for call in group.calls)  # both in one call once both ticked


async def test_an_output_groups_rows_count_each_sessions_frames_beside_a_session_of_its_own(make_engine):
    """A tick hands a group the rows of its live sessions and a session of its own its FrameOutput: each session's
    frame indices run 0, 1, 2, ... (from 0 again after a restart), a closed session gets no row after its close,
    and no session's frame goes both ways."""
    engine = make_engine()
    group = RowsCollector()
    key = engine.add_output_group(group)
    slots, sinks = [engine.reserve() for _ in range(3)], [Collector() for _ in range(3)]
    for k, (slot, sink) in enumerate(zip(slots, sinks)):
        await slot.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(80, k)), sink.on_output,
                         sink.on_error, output_group=None if k == 2 else key)
    grouped, alone = slots[:2], slots[2]

    async def until(done) -> None:
        deadline = time.monotonic() + 30
        while not done():
            assert time.monotonic() < deadline and not any(sink.errors for sink in sinks)
            await asyncio.sleep(0.02)

    await until(lambda: min(len(group.frames[s.id]) for s in grouped) >= 4 and len(sinks[2].outputs) >= 4)
    grouped[0].close()
    closed_at = len(group.frames[grouped[0].id])
    before_restart = len(group.frames[grouped[1].id])
    await grouped[1].restart()
    await until(lambda: len(group.frames[grouped[1].id]) >= before_restart + 4)
    alone.close()
    grouped[1].close()

    assert len(group.frames[grouped[0].id]) == closed_at
    assert [o.index for o in group.frames[grouped[0].id]] == list(range(closed_at))
    indices = [o.index for o in group.frames[grouped[1].id]]
    restarted = len(indices) - 1 - indices[::-1].index(0)  # where the last run from 0 begins
    assert restarted >= before_restart and indices[:restarted] == list(range(restarted))
    assert indices[restarted:] == list(range(len(indices) - restarted))
    assert [o.index for o in sinks[2].outputs] == list(range(len(sinks[2].outputs)))
    assert alone.id not in group.frames and not sinks[0].outputs and not sinks[1].outputs
    assert all(set(call) <= {s.id for s in grouped} for call in group.calls)
    assert slots[0].stats().frames_out == closed_at and slots[2].stats().frames_out == len(sinks[2].outputs)


async def test_an_output_group_that_raises_fails_its_sessions_and_no_other(make_engine):
    engine = make_engine()
    key = engine.add_output_group(RowsCollector(fail=True))
    grouped, grouped_sink = engine.reserve(), Collector()
    await grouped.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(20, 1)), grouped_sink.on_output,
                        grouped_sink.on_error, output_group=key)
    other, other_sink = engine.reserve(), Collector()
    await other.start(SessionParams(sampling=GREEDY), QueueSource(speechlike(20, 2)), other_sink.on_output,
                      other_sink.on_error)
    await other_sink.wait_for(5)
    assert grouped_sink.errors and "group broke" in str(grouped_sink.errors[0])
    assert grouped.stats().state == "failed" and other.stats().state == "live" and not other_sink.errors
    other.close()
