"""The engine's scheduler on a fake clock: the tick deadline, where a session start's steps run between ticks,
which first halves run before a tick, in-flight copies and the offline round robin. No engine, no model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from model.engine.scheduler import JOB_MAX_WAIT_S, STEP_KINDS, Job, Scheduler

TICK_S = 0.08


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def scheduler(clock: FakeClock) -> Scheduler:
    scheduler = Scheduler(TICK_S, in_flight_copy_share=0.9, clock=clock, timer=clock)
    scheduler.start_clock()
    return scheduler


def steps(clock: FakeClock, durations: list[tuple[str, float]], last: bool | None = None) -> Iterator[str]:
    """A job's steps: each (kind, seconds) announces its kind, then takes its seconds on the clock."""

    def run():
        for kind, seconds in durations:
            yield kind
            clock.advance(seconds)
        return last

    return run()


def job(scheduler: Scheduler, clock: FakeClock, kind: str, row: int | None = 0, seconds: float = 0.0,
        done: list | None = None) -> Job:
    gen = steps(clock, [(kind, seconds)])
    return scheduler.add_job(gen, (done if done is not None else []).append, next(gen), row)


def after_tick(scheduler: Scheduler, clock: FakeClock, tick_s: float) -> None:
    """A tick that starts at its deadline (or now, if that is later) and takes `tick_s`; the clock ends where the
    tick did."""
    clock.now = max(clock.now, scheduler.deadline) + tick_s
    scheduler.tick_done(clock.now, tick_s)


def test_ticks_every_tick_s_and_never_burst_to_catch_up(scheduler, clock):
    first = scheduler.deadline
    assert first == pytest.approx(clock.now + TICK_S)
    assert not scheduler.tick_due(first - 1e-6) and scheduler.tick_due(first)
    assert not scheduler.started_late(first + TICK_S / 2 - 1e-6) and scheduler.started_late(first + TICK_S / 2 + 1e-6)
    assert scheduler.tick_done(first + 0.03, 0.03) == pytest.approx(first + TICK_S)  # on the grid
    stalled = first + 1.0  # a pass that comes back long after: one tick, then one tick from now, not a burst
    assert scheduler.tick_done(stalled, 0.03) == pytest.approx(stalled + TICK_S)
    assert not scheduler.tick_due(stalled + TICK_S / 2)


def test_idle_passes_wait_for_the_tick_or_poll_for_offline_frames(scheduler):
    now = scheduler.deadline - 0.05
    assert scheduler.wait_s(now, offline_live=False) == pytest.approx(0.05)
    assert scheduler.wait_s(now, offline_live=True) == pytest.approx(0.002)


def test_with_no_realtime_session_every_step_runs_at_once(scheduler, clock):
    long = job(scheduler, clock, "chunk")
    scheduler.step_s["chunk"].extend([1.0, 1.0])
    clock.now = scheduler.deadline - 0.001  # no time left before the tick
    assert scheduler.job_to_run(clock.now, realtime_live=False) is long
    assert scheduler.job_to_run(clock.now, realtime_live=True) is None


def test_a_step_runs_where_its_recent_median_duration_fits_before_the_tick(scheduler, clock):
    after_tick(scheduler, clock, 0.03)  # a 50 ms gap: a pass counts as its start while 45 ms are left
    chunk = job(scheduler, clock, "chunk")
    scheduler.step_s["chunk"].extend([0.010, 0.200, 0.012])  # one slow run does not hold every later step back
    needed = 1.5 * 0.012 + 0.002
    clock.now = scheduler.deadline - (needed - 0.001)
    assert scheduler.job_to_run(clock.now, realtime_live=True) is None
    clock.now = scheduler.deadline - (needed + 0.001)
    assert scheduler.job_to_run(clock.now, realtime_live=True) is chunk


def test_an_unmeasured_kind_is_placed_by_its_first_guess(scheduler, clock):
    after_tick(scheduler, clock, 0.03)
    plan = job(scheduler, clock, "plan")
    needed = 1.5 * STEP_KINDS["plan"] + 0.002
    clock.now = scheduler.deadline - needed
    assert scheduler.job_to_run(clock.now, realtime_live=True) is plan


def test_a_short_step_does_not_queue_behind_a_long_one(scheduler, clock):
    after_tick(scheduler, clock, 0.03)
    prefill = job(scheduler, clock, "prefill", row=0)
    copy = job(scheduler, clock, "copy", row=1)
    scheduler.step_s["prefill"].append(0.040)
    scheduler.step_s["copy"].append(0.003)
    clock.now = scheduler.deadline - 0.030  # past the gap's start; fits the copy, not the prefill
    assert scheduler.job_to_run(clock.now, realtime_live=True) is copy
    clock.now = scheduler.deadline - 0.065  # fits both: the oldest goes first
    assert scheduler.job_to_run(clock.now, realtime_live=True) is prefill


def test_a_step_that_fits_no_gap_runs_at_a_gaps_start(scheduler, clock):
    after_tick(scheduler, clock, 0.06)  # 20 ms gaps
    chunk = job(scheduler, clock, "chunk")
    scheduler.step_s["chunk"].append(0.030)  # needs 47 ms: no gap fits it
    assert scheduler.job_to_run(clock.now, realtime_live=True) is chunk  # the gap's start
    clock.advance(0.006)
    assert scheduler.job_to_run(clock.now, realtime_live=True) is None  # later in the gap: the tick would wait


def test_a_step_that_fits_a_gap_waits_for_one_it_fits(scheduler, clock):
    after_tick(scheduler, clock, 0.03)  # 50 ms gaps
    chunk = job(scheduler, clock, "chunk")
    scheduler.step_s["chunk"].append((0.048 - 0.002) / 1.5)  # needs 48 ms
    clock.advance(0.004)  # still the gap's start, but 46 ms left
    assert scheduler.job_to_run(clock.now, realtime_live=True) is None
    after_tick(scheduler, clock, 0.03)
    assert scheduler.job_to_run(clock.now, realtime_live=True) is chunk


def test_a_step_that_waited_too_long_runs_first_at_a_gaps_start(scheduler, clock):
    after_tick(scheduler, clock, 0.03)
    old = job(scheduler, clock, "prefill", row=0)
    scheduler.step_s["prefill"].append(0.040)  # fits a 50 ms gap only near its start
    clock.advance(JOB_MAX_WAIT_S - 0.1)
    young = job(scheduler, clock, "copy", row=1)
    after_tick(scheduler, clock, 0.03)
    assert clock.now - old.waiting_since < JOB_MAX_WAIT_S
    assert scheduler.job_to_run(clock.now, realtime_live=True) is old  # fits: the oldest
    clock.now = scheduler.deadline - 0.03  # later in the gap only the copy fits
    assert scheduler.job_to_run(clock.now, realtime_live=True) is young
    scheduler.step_s["prefill"].extend([0.2, 0.2])  # now it fits no gap, and has waited
    after_tick(scheduler, clock, 0.03)
    clock.advance(0.2)
    assert scheduler.job_to_run(clock.now, realtime_live=True) is None  # not at a gap's start
    after_tick(scheduler, clock, 0.03)
    assert clock.now - old.waiting_since >= JOB_MAX_WAIT_S
    assert scheduler.job_to_run(clock.now, realtime_live=True) is old


def test_running_a_step_times_it_and_ends_the_job_after_its_last(scheduler, clock):
    done: list = []
    gen = steps(clock, [("plan", 0.01), ("prefill", 0.02)])
    started = scheduler.add_job(gen, done.append, next(gen), row=0)
    scheduler.run_step(started)
    assert started.next_kind == "prefill" and list(scheduler.step_s["plan"]) == [pytest.approx(0.01)]
    assert started.waiting_since == clock.now and not done
    scheduler.run_step(started)
    assert list(scheduler.step_s["prefill"]) == [pytest.approx(0.02)]
    assert done == [None] and not scheduler.jobs


def test_a_last_step_that_did_nothing_is_not_timed(scheduler, clock):
    gen = steps(clock, [("first_half", 0.0)], last=False)
    scheduler.run_step(scheduler.add_job(gen, [].append, next(gen), row=0))
    assert not scheduler.step_s["first_half"] and not scheduler.jobs


def test_a_step_that_raises_ends_its_job_with_the_error(scheduler, clock):
    def failing():
        yield "plan"
        raise ValueError("bad voice")

    done: list = []
    gen = failing()
    scheduler.run_step(scheduler.add_job(gen, done.append, next(gen), row=0))
    assert isinstance(done[0], ValueError) and not scheduler.jobs


def test_first_halves_before_a_tick_are_those_whose_audio_waits_as_many_as_the_budget_fits(scheduler):
    asked: list[str] = []

    def audio_waiting(name: str) -> bool:
        asked.append(name)
        return name.endswith("+audio")

    pending = ["a", "b+audio", "c", "d+audio", "e+audio", "f+audio"]
    scheduler.step_s["first_half"].append(0.008)  # 12 ms budgeted each
    scheduler.last_tick_s = 0.015  # 40 ms budget (half the tick) - 15 ms: room for two
    chosen = scheduler.first_halves_before_tick(pending, audio_waiting)
    assert chosen == ["b+audio", "d+audio"]
    assert asked == pending[: pending.index(chosen[-1]) + 1]  # nobody is asked once the tick has its share


def test_no_first_half_runs_before_a_tick_that_is_already_long(scheduler):
    """At full load (a 46 ms tick) every first half the gaps did not fit rides in the batch: opens do not
    lengthen the tick."""
    scheduler.step_s["first_half"].append(0.008)
    scheduler.last_tick_s = 0.046
    assert scheduler.first_halves_before_tick(["a+audio", "b+audio"], lambda name: True) == []


def test_a_cached_copy_runs_in_flight_where_it_ends_before_the_outputs(scheduler, clock):
    assert scheduler.in_flight_until(8, launched=5.0) is None  # no launch-to-outputs time known yet
    scheduler.record_in_flight(8, 0.020)
    scheduler.record_in_flight(8, 0.015)
    until = scheduler.in_flight_until(8, launched=5.0)
    assert until == pytest.approx(5.0 + 0.9 * 0.015)
    job(scheduler, clock, "prefill", row=6)
    stepped_row = job(scheduler, clock, "copy", row=2)  # a live session's restart: its row is in the tick
    idle_row = job(scheduler, clock, "copy", row=5)
    scheduler.step_s["copy"].append(0.003)
    stepped = lambda row: row < 4
    assert scheduler.in_flight_copy(5.0, until, stepped) is idle_row
    assert scheduler.in_flight_copy(until - 1.5 * 0.003 + 1e-4, until, stepped) is None  # would end too late
    assert stepped_row.next_kind == "copy"


def test_offline_sessions_take_turns(scheduler):
    assert [scheduler.next_offline(["a", "b", "c"]) for _ in range(4)] == ["a", "b", "c", "a"]
    assert [scheduler.next_offline(["a", "b"]) for _ in range(3)] == ["a", "b", "a"]  # the count goes on
