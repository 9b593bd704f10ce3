"""The KV page pool (model/engine/pages.py) on the tiny model: tokens bit-exact with contiguous rings across the
ring's wrap while sessions grow, end and are replaced; windows shrunk under pressure hold exactly their last frames
and grow back; the engine refuses what its pages cannot cover and reports shrinks on the session and in its stats."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
import torch
from test_engine import GREEDY, Collector, QueueSource, speechlike, tiny_model  # noqa: F401 (fixture)

from model.config import TINY_LM
from model.engine import Engine, EngineConfig, ResourceExhausted, SamplingParams, SessionFailed, SessionParams
from model.engine.pages import PagePool
from model.lm import LM
from model.sampling import row_sampling
from model.step import StepConstants, frame_step

CONTEXT, PAGE = 16, 4


def make_lm() -> LM:
    torch.manual_seed(5)
    return LM(dataclasses.replace(TINY_LM, context=CONTEXT), depformer_steps=TINY_LM.num_audio_codebooks).eval()


def paged_state(lm: LM, rows: int, pages: int, floor_frames: int = CONTEXT) -> tuple:
    state = lm.init_state(rows, pool_pages=pages, page=PAGE)
    pool = PagePool(state, reserve_frames=1, floor_frames=floor_frames)
    random.Random(0).shuffle(pool.free)  # rows' pages interleave in no order
    return state, pool


def step_paged(pool: PagePool, rows: list[int]) -> None:
    assert pool.ensure_rows(rows) == []
    pool.flush()
    pool.advance(rows)


def reset(lm: LM, state, pool: PagePool | None, row: int) -> None:
    if pool is not None:
        pool.release(row)
        pool.flush()
    lm.reset_row(state, row, used=0 if pool is not None else None)


@torch.no_grad()
def test_tokens_are_bit_exact_with_contiguous_rings_across_the_wrap_as_sessions_end_and_are_replaced():
    lm, B, T = make_lm(), 3, 70
    const = StepConstants.make(lm, torch.device("cpu"))
    paged, pool = paged_state(lm, B, pages=3 * CONTEXT // PAGE)
    contiguous = lm.init_state(B)
    g = torch.Generator().manual_seed(1)
    user = torch.randint(0, TINY_LM.card, (T, B, 8), generator=g)
    samplers = [row_sampling([SamplingParams(greedy=True)] * B, [0] * B, torch.device("cpu")) for _ in range(2)]
    caches = [lm.depformer_cache(B), lm.depformer_cache(B)]
    ends = {23: [1], 41: [0], 50: [2], 58: [1]}  # a session ends, another takes its row at once
    idle = {1: range(5, 9), 2: range(30, 36)}  # rows that skip steps (a session not yet started, or paused)
    free_before = len(pool.free)
    for t in range(T):
        for row in ends.get(t, []):
            held = pool.held(row)
            reset(lm, paged, pool, row)
            reset(lm, contiguous, None, row)
            assert held > 0 and pool.held(row) == 0
        rows = [r for r in range(B) if t not in idle.get(r, ())]
        active = torch.zeros(B, dtype=torch.bool)
        active[rows] = True
        step_paged(pool, rows)
        outputs = [frame_step(lm, state, user[t], *sampler, cache, const, active)
                   for state, sampler, cache in zip((paged, contiguous), samplers, caches)]
        (frame_a, emitted_a), (frame_b, emitted_b) = outputs
        assert torch.equal(frame_a, frame_b) and torch.equal(emitted_a, emitted_b), f"step {t}"
    assert torch.equal(paged.pos, contiguous.pos) and torch.equal(paged.kpos, contiguous.kpos)
    assert int(paged.pos.max()) > CONTEXT  # the rings wrapped
    assert pool.shrinks == 0 and len(pool.free) == free_before - sum(pool.held(r) for r in range(B))


def last_frames_hold(lm: LM, state, reference, row: int) -> int:
    """Assert the row's valid slots hold exactly its last frames, with the keys the contiguous reference computed
    for them (layer 0's keys depend on the input and position only); the number of valid slots."""
    pos, origin, window = (int(t[row]) for t in (state.pos, state.origin, state.window))
    valid = min(pos - origin, window)
    frames = state.kpos[row, :valid]
    assert sorted(frames.tolist()) == list(range(pos - valid, pos))
    keys, _ = state.kv.read_row(0, row, torch.float32, valid)
    want, _ = reference.kv.read_row(0, row, torch.float32, CONTEXT)
    assert torch.equal(keys, want[:, frames % CONTEXT])
    return valid


@torch.no_grad()
def test_windows_shrink_under_pressure_keep_their_last_frames_and_grow_back():
    lm, B = make_lm(), 3
    floor = 2 * PAGE
    state, pool = paged_state(lm, B, pages=9, floor_frames=floor)  # 3 rows need 12 for full windows
    windows = []
    pool.on_window = lambda row, frames, shrunk: windows.append((row, frames, shrunk))
    reference = lm.init_state(B)
    g = torch.Generator().manual_seed(2)
    never_shrunk = set(range(B))
    for t in range(60):
        rows = [0, 1, 2] if t >= 6 else [0, 1]  # row 2 starts late: the others are longest when pages run out
        if t == 40:  # row 2's session ends: its pages free, the shrunk windows grow back
            reset(lm, state, pool, 2)
            reset(lm, reference, None, 2)
            rows = [0, 1]
        if t > 40:
            rows = [0, 1]
        active = torch.zeros(B, dtype=torch.bool)
        active[rows] = True
        step_paged(pool, rows)
        x = torch.randn(B, TINY_LM.dim, generator=g)
        hidden = lm.temporal_step(x, state, active)
        want = lm.temporal_step(x, reference, active)
        for held in (state, reference):
            held.pos += active.long()
        never_shrunk -= {row for row, _, shrunk in windows if shrunk}
        for row in rows:
            assert last_frames_hold(lm, state, reference, row) >= min(int(state.pos[row]), floor)
            if row in never_shrunk:
                assert torch.equal(hidden[row], want[row]), f"step {t} row {row}"
        assert all(frames >= floor for _, frames, _ in windows)
    shrunk = {row for row, _, was in windows if was}
    assert pool.shrinks > 0 and shrunk <= {0, 1}
    assert pool.grows > 0 and all(int(state.window[row]) == CONTEXT for row in shrunk)
    # Grown back, the ring fills on past what it kept: a full window of the last frames again.
    assert all(last_frames_hold(lm, state, reference, row) == CONTEXT for row in (0, 1))


def input_session(persona: str) -> SessionParams:
    return SessionParams(persona=persona, sampling=GREEDY, pacing="input")


async def feed(slot, frames, count: int) -> Collector:
    sink = Collector()
    source = QueueSource(frames)
    await slot.start(input_session("Be brief."), source, sink.on_output, sink.on_error)
    await sink.wait_for(count)
    return sink


@pytest.fixture
def engine_with(tiny_model):  # noqa: F811
    engines = []

    def make(**kwargs):
        engine = Engine(tiny_model, EngineConfig(**kwargs))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


async def test_admission_refuses_what_the_free_pages_cannot_cover(engine_with):
    # The fixture's context is 64 frames, in pages of 32. A 2 s reserve (25 frames) is one page per session.
    engine = engine_with(max_sessions=3, kv_pages=3, kv_page_frames=32, kv_reserve_s=2.0)
    first = engine.reserve()
    await feed(first, speechlike(10, 1), 8)
    assert engine.runner.pages.held(first.index) == 2  # the prompt and its frames filled a page: the next is held
    second = engine.reserve()  # one page free: the second's first page (the first is at its full window)
    with pytest.raises(ResourceExhausted) as refused:
        engine.reserve()  # none left for a third (a free slot, no page)
    assert refused.value.code == "resource_exhausted" and engine.stats().kv_refused == 1
    first.close()
    second.close()
    await _until(lambda: engine.stats().kv_pages_free == 3)
    engine.reserve().close()


async def test_a_long_session_shrinks_for_a_newcomer_then_grows_back(engine_with):
    engine = engine_with(max_sessions=2, kv_pages=3, kv_page_frames=32, kv_reserve_s=0.08, kv_floor_frames=32)
    frames = speechlike(140, 4)
    long = engine.reserve()
    long_sink = Collector()
    long_source = QueueSource(frames[:80])
    await long.start(input_session("Be brief."), long_source, long_sink.on_output, long_sink.on_error)
    await long_sink.wait_for(80)
    assert engine.runner.pages.held(long.index) == 2  # a full window of 64
    newcomer = engine.reserve()
    sink = await feed(newcomer, speechlike(70, 5), 70)  # its second page comes from the long session's oldest
    assert not sink.errors and not long_sink.errors
    stats = long.stats()
    assert stats.window_shrinks == 1 and stats.window_frames == 32
    assert engine.stats().kv_window_shrinks == 1 and newcomer.stats().window_shrinks == 0
    newcomer.close()
    await _until(lambda: engine.stats().kv_pages_free == 2)
    for frame in frames[80:]:  # at its next page boundary the long session takes its full window back
        long_source.push(frame)
    await long_sink.wait_for(140)
    assert long.stats().window_frames == 64 and engine.stats().kv_window_grows == 1
    assert int(engine.lm_state.window[long.index]) == 64


class ClosesTheLongSessionAsItsPagesAreTaken(QueueSource):
    """A newcomer's source that, as the engine reads the frame whose step takes a page no free one covers (the long
    session's oldest, by shrinking its window), closes the long session and reserves its row again: as another
    thread may between a step's choosing a window to shrink and its counting the shrink."""

    def __init__(self, engine: Engine, frames, long):
        super().__init__(frames)
        self.engine, self.long, self.slot, self.next_slot = engine, long, None, None

    def read_frame(self):
        frame = super().read_frame()
        pages, row = self.engine.runner.pages, self.slot.index
        rel = int(pages.pos[row] - pages.origin[row])
        if self.next_slot is None and frame is not None and rel and rel % pages.page == 0 and not pages.free:
            self.long.close()
            self.next_slot = self.engine.reserve()
        return frame


async def test_a_window_shrunk_as_its_session_closes_counts_nothing_for_the_next_session_of_its_row(engine_with):
    """The shrink lands on the row of a session that closed as the step ran (its pages not yet returned): the next
    session of that row starts with no shrink counted and the full window. Pages of 16 frames: the newcomer's prompt
    (35 frames) fills three of the seven, and its step at frame 48 takes the long session's oldest."""
    engine = engine_with(max_sessions=2, kv_pages=7, kv_page_frames=16, kv_reserve_s=0.08, kv_floor_frames=32)
    long = engine.reserve()
    long_sink = Collector()
    await long.start(input_session("Be brief."), QueueSource(speechlike(80, 4)), long_sink.on_output,
                     long_sink.on_error)
    await long_sink.wait_for(80)
    assert engine.runner.pages.held(long.index) == 4
    newcomer, sink = engine.reserve(), Collector()
    source = ClosesTheLongSessionAsItsPagesAreTaken(engine, speechlike(70, 5), long)
    source.slot = newcomer
    await newcomer.start(input_session("Be brief."), source, sink.on_output, sink.on_error)
    await sink.wait_for(70)
    assert source.next_slot is not None and source.next_slot.index == long.index
    assert engine.stats().kv_window_shrinks == 1  # the shrink ran, on the closed session's pages
    following = source.next_slot.stats()
    assert (following.window_shrinks, following.window_frames) == (0, 0), following
    assert long.stats().window_shrinks == 0
    source.next_slot.close()


async def test_a_session_with_no_page_to_grow_into_ends_and_the_tick_steps_the_others(engine_with):
    """Admitted on a page's reserve, a session reaches its next page with none free and no window above the floor
    to shrink: that session fails (cause kv_pages) and the same ticks go on stepping the one beside it."""
    # Context 64 frames in pages of 16, the floor the full window: nothing can shrink. The prompt is 34 frames, so
    # the first holds all 4 of its pages, the second's prompt takes the 3 left, and its next page is not there.
    engine = engine_with(max_sessions=2, kv_pages=7, kv_page_frames=16, kv_reserve_s=0.08, kv_floor_frames=64)
    frames = speechlike(160, 6)
    first, first_sink, first_source = engine.reserve(), Collector(), QueueSource(frames[:40])
    await first.start(SessionParams(persona="Be brief.", sampling=GREEDY), first_source, first_sink.on_output,
                      first_sink.on_error)
    await first_sink.wait_for(40)
    assert engine.runner.pages.held(first.index) == 4  # its full window: it grows no more
    second, second_sink = engine.reserve(), Collector()  # the pages free cover its reserve
    await second.start(SessionParams(persona="Be brief.", sampling=GREEDY), QueueSource(frames[40:100]),
                       second_sink.on_output, second_sink.on_error)
    for frame in frames[100:160]:
        first_source.push(frame)
    await _until(lambda: bool(second_sink.errors), timeout=30.0)
    error = second_sink.errors[0]
    assert isinstance(error, SessionFailed) and error.cause == "kv_pages"
    assert len(second_sink.outputs) < 40 and second.stats().state == "failed"
    outputs = await first_sink.wait_for(100)
    assert not first_sink.errors and [o.index for o in outputs] == list(range(len(outputs)))
    await _until(lambda: engine.stats().kv_pages_free == 3)  # the failed session's pages came back


async def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_the_pages_of_an_ended_session_count_as_free_before_they_return(tiny_model):  # noqa: F811
    """A close returns its pages on the engine thread, later: a session admitted in between is not refused for
    them (the engine here never runs its thread, so they stay held)."""
    engine = Engine(tiny_model, EngineConfig(max_sessions=2, kv_page_frames=32))  # 2 full windows: 4 pages
    first, second = engine.reserve(), engine.reserve()
    pages = engine.runner.pages
    for slot in (first, second):  # both at their full window of 64 frames
        assert pages.ensure(slot.index, 64)
        pages.advance([slot.index], 64)
    first.close()
    assert pages.held(first.index) == 2 and not pages.free
    engine.reserve().close()
