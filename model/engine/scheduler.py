"""What each pass of the engine loop does, as plain Python on a clock it is given (no torch, no threads).

Every 80 ms (the deadline) a realtime tick runs; it never bursts to catch up: a pass that finds itself past the
next deadline re-anchors on the clock. Between ticks, a session's start runs as a job of steps (scheduled by the
recent duration of each kind, STEP_KINDS), one per pass where it fits before the next tick; input-clocked
sessions take turns (round robin) stepping one frame when nothing else is due. On CUDA a cached prompt's copy
may also run while a tick is in flight on the device, where it ends before the tick's outputs are expected.

The engine (core.py) asks; this module decides. tests/test_scheduler.py drives it on a fake clock.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

# A session start's step that never fits between ticks (ticks longer than planned, a slow first run) runs anyway,
# at the start of a gap, once it has waited this long: at worst one late tick, never an open that waits forever.
JOB_MAX_WAIT_S = 0.5
# A session start's steps, and a first guess at each one's seconds until it has run: "plan" (voice and text to
# prompt embeddings), "prefill" (the whole prompt on the scratch row, model/prompt_prefill.py), "chunk" (one piece
# of a prompt too long for it, eager), "copy" (a cached prompt into the slot), "first_half" (the session's first
# model half, which needs no input: see model/step.py).
STEP_KINDS = {"plan": 0.05, "prefill": 0.02, "chunk": 0.03, "copy": 0.005, "first_half": 0.03}
# A step runs where 1.5 times its recent duration, and this margin, fit before the next tick.
STEP_MARGIN_S = 0.002
# How close to a gap's full length the time left must be for a pass to count as the gap's start.
GAP_START_SLACK_S = 0.005

T = TypeVar("T")


@dataclass
class Job:
    """Work run on the engine thread between ticks, one step at a time (a session's start)."""

    steps: Iterator[str]  # each step yields the kind of the next one
    done: Callable[[BaseException | None], None]  # called once, with the exception that ended it or None
    next_kind: str
    row: int | None  # the slot it starts
    waiting_since: float  # clock time since its last step ran, or it was queued


class Scheduler:
    """The tick deadline, the queue of session-start jobs, and the recent durations that place their steps."""

    def __init__(self, tick_s: float, in_flight_copy_share: float = 0.9, first_half_tick_budget: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] = time.perf_counter):
        self.tick_s = tick_s
        self.in_flight_copy_share = in_flight_copy_share
        self.first_half_tick_budget = first_half_tick_budget
        self.clock, self.timer = clock, timer
        self.deadline = 0.0  # clock time of the next tick (start_clock)
        self.last_tick_s = 0.0  # the last realtime tick's duration, for the gap it leaves
        self.jobs: deque[Job] = deque()
        # Recent seconds per kind of step. The median of the last few: one slow run (a first use, a busy host)
        # must not keep every later step waiting.
        self.step_s: dict[str, deque[float]] = {kind: deque(maxlen=5) for kind in STEP_KINDS}
        # Per padded batch size, recent seconds from a tick's launch to its outputs on the host.
        self.in_flight_s: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=8))
        self._offline_turn = 0

    # ----- the tick ---------------------------------------------------------------------------------------

    def start_clock(self) -> None:
        self.deadline = self.clock() + self.tick_s

    def tick_due(self, now: float) -> bool:
        return now >= self.deadline

    def started_late(self, now: float) -> bool:
        """A tick that starts more than half a tick after its deadline counts as late whatever it takes."""
        return now - self.deadline > self.tick_s / 2

    def tick_done(self, now: float, tick_s: float | None) -> float:
        """The next deadline after a tick (that took `tick_s`, None when no session was live to step): one tick
        later, or one tick from `now` when that is already past (never a burst of ticks to catch up)."""
        if tick_s is not None:
            self.last_tick_s = tick_s
        self.deadline += self.tick_s
        if now > self.deadline:
            self.deadline = now + self.tick_s
        return self.deadline

    def wait_s(self, now: float, offline_live: bool) -> float:
        """How long an idle pass waits for work: until the tick, or a short poll while input-clocked sessions
        may get a frame."""
        return min(self.deadline - now, 0.002 if offline_live else 1.0)

    # ----- session-start jobs -----------------------------------------------------------------------------

    def add_job(self, steps: Iterator[str], done: Callable[[BaseException | None], None], next_kind: str,
                row: int | None) -> Job:
        job = Job(steps, done, next_kind, row, waiting_since=self.clock())
        self.jobs.append(job)
        return job

    def estimate(self, kind: str) -> float:
        runs = self.step_s[kind]
        return statistics.median(runs) if runs else STEP_KINDS[kind]

    def job_to_run(self, now: float, realtime_live: bool) -> Job | None:
        """The job whose next step runs in this pass, if any.

        With no realtime session live, every step runs at once. A step that waited JOB_MAX_WAIT_S runs at the
        next gap's start. Otherwise the oldest job whose next step fits before the deadline runs, so a short step
        (a cached prompt's copy) does not queue behind a long one; a step longer than any gap between ticks (a
        prompt chunk of the full model, beside many sessions) runs at the start of a gap, where it makes the next
        tick the least late.
        """
        if not self.jobs:
            return None
        if not realtime_live:
            return self.jobs[0]
        time_left = self.deadline - now
        gap = self.tick_s - self.last_tick_s
        gap_start = time_left >= gap - GAP_START_SLACK_S
        overdue = [job for job in self.jobs if now - job.waiting_since >= JOB_MAX_WAIT_S]
        if overdue and gap_start:
            return overdue[0]
        needed = [1.5 * self.estimate(job.next_kind) + STEP_MARGIN_S for job in self.jobs]
        for job, seconds in zip(self.jobs, needed):
            if time_left >= seconds:
                return job
        if gap_start:  # the oldest step that no gap would fit
            for job, seconds in zip(self.jobs, needed):
                if seconds > gap:
                    return job
        return None

    def run_step(self, job: Job) -> None:
        """Run the job's next step, timing it; a job that ends (or raises) leaves the queue and is told."""
        kind = job.next_kind
        started = self.timer()
        worked = True
        try:
            job.next_kind = next(job.steps)
        except StopIteration as stop:  # a last step that found nothing to do returns False: not timed
            worked = stop.value is not False
            self.jobs.remove(job)
            job.done(None)
        except BaseException as exc:  # handed to whoever waits on the job
            self.jobs.remove(job)
            job.done(exc)
        if worked:
            self.step_s[kind].append(self.timer() - started)
        job.waiting_since = self.clock()

    def step_seconds(self) -> dict[str, list[float]]:
        """The recent durations by kind, for stats read on other threads (list() of a deque holds the GIL)."""
        return {kind: list(runs) for kind, runs in self.step_s.items() if runs}

    # ----- around a tick ----------------------------------------------------------------------------------

    def first_halves_before_tick(self, pending: list[T], audio_waiting: Callable[[T], bool]) -> list[T]:
        """Of the realtime sessions whose first half is still to run (in slot order), those whose client audio
        already waits, as many as fit the budget: the last tick's duration plus 1.5 times the recent first half's
        for each stays within `first_half_tick_budget` of the tick period. Each runs as a one-row step before the
        tick's batch, so the tick takes its first frame. The others' first halves run in the batch, which takes no
        input from them: free, and no later for a client whose first frame has not come."""
        room = self.first_half_tick_budget * self.tick_s - self.last_tick_s
        cost = 1.5 * self.estimate("first_half")
        chosen: list[T] = []
        for session in pending:
            if room < cost * (len(chosen) + 1):
                break
            if audio_waiting(session):
                chosen.append(session)
        return chosen

    def record_in_flight(self, n: int, seconds: float) -> None:
        self.in_flight_s[n].append(seconds)

    def in_flight_until(self, n: int, launched: float) -> float | None:
        """Until when work may run beside a tick over `n` rows launched at `launched` (timer time): within
        `in_flight_copy_share` of the shortest recent launch-to-outputs time of this batch size. None before
        one is known."""
        recent = self.in_flight_s.get(n)
        if not recent:
            return None
        return launched + self.in_flight_copy_share * min(recent)

    def in_flight_copy(self, now: float, until: float, stepped: Callable[[int], bool]) -> Job | None:
        """A job whose next step is a cached prompt's copy into a row the tick does not step (a live session's
        restart is stepped: its frame is yet to be delivered), if the copy's recent duration ends by `until`."""
        job = next((job for job in self.jobs
                    if job.next_kind == "copy" and job.row is not None and not stepped(job.row)), None)
        if job is not None and now + 1.5 * self.estimate("copy") <= until:
            return job
        return None

    def next_offline(self, ready: list[T]) -> T:
        """The input-clocked session (of those with a frame ready) that steps next: round robin."""
        session = ready[self._offline_turn % len(ready)]
        self._offline_turn += 1
        return session
