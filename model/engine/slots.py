"""The slot table: one row of the batch per session, and one state machine per session.

    reserved --start--> prefill --prompt in place--> live
                           ^                           |
                           +----------restart----------+
    (any but closed, failed) --fail--> failed        (any but closed) --close--> closed

A session is `reserved` by admission, in `prefill` while its start runs on the engine thread (a restart goes back
there), `live` once the engine steps it, and leaves the table when `closed` or `failed`. Every change of state goes
through SlotTable.move, which refuses what the machine does not allow; callers decide whether a refusal is an error.

No torch here: `Slot`, the asyncio side's handle, reaches its engine through the narrow `SessionHost` interface.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from model.engine.api import (
    EngineError,
    FrameOutput,
    FrameSource,
    ResourceExhausted,
    SessionParams,
    SlotStats,
)

# The states each state may move to.
MOVES: dict[str, frozenset[str]] = {
    "reserved": frozenset({"prefill", "closed", "failed"}),
    "prefill": frozenset({"prefill", "live", "closed", "failed"}),  # a restart may follow a start still running
    "live": frozenset({"prefill", "closed", "failed"}),
    "failed": frozenset({"closed"}),
    "closed": frozenset(),
}
ENDED = ("closed", "failed")
# A session's counts while it holds a row, kept by row in the slot table (SlotTable.counts, columns in this order;
# the SlotStats fields of these names), and in its record once it ends.
ROW_COUNTS = ("frames_in", "frames_out", "underruns", "window_shrinks", "window_frames")
FRAMES_IN, FRAMES_OUT, UNDERRUNS, WINDOW_SHRINKS, WINDOW_FRAMES = range(len(ROW_COUNTS))


@dataclass
class Session:
    """Engine-side record of the session in one slot."""

    index: int
    id: str
    serial: int  # this session's number among all the table has reserved (SlotTable.holders)
    stats: SlotStats = field(default_factory=SlotStats)  # its counts once it ends (ROW_COUNTS); its state
    params: SessionParams | None = None
    source: FrameSource | None = None
    on_output: Callable[[FrameOutput], None] | None = None
    on_error: Callable[[EngineError], None] | None = None
    seed: int = 0
    first_half_pending: bool = False  # a realtime session's first half is still to run, in or before its first tick
    start_requested_at: float = 0.0  # time.monotonic() of the last start's (or restart's) request
    output_group: int | None = None  # its frames go to this group's call (Engine.add_output_group), not on_output

    @property
    def state(self) -> str:
        return self.stats.state

    @property
    def live(self) -> bool:
        return self.stats.state == "live"

    @property
    def offline(self) -> bool:
        return self.params is not None and self.params.pacing == "input"


@dataclass(frozen=True)
class OutputOrder:
    """The live realtime sessions in the order a tick hands out their frames: each output group's together (group
    `keys[k]` is `members[starts[k]:starts[k + 1]]`), then the sessions of their own (from `starts[-1]`); `members[j]`
    (id `ids[j]`) is in `rows[j]`. One gather of a tick's outputs in this order gives every group its rows as one
    slice."""

    rows: np.ndarray  # int64
    members: tuple[Session, ...]
    ids: list[str]
    keys: list[int]
    starts: np.ndarray  # int64, len(keys) + 1

    def __post_init__(self) -> None:
        self.rows.flags.writeable = False  # a tick gathers by these rows as they are

    def handed(self, handed: np.ndarray) -> OutputOrder:
        """The sessions whose rows `handed` (a flag by row) marks, in the same order, each group's bounds moved to
        match: this order itself when it marks all of them."""
        taken = handed[self.rows]
        if taken.all():
            return self
        kept = np.flatnonzero(taken)
        return OutputOrder(self.rows[kept], tuple(self.members[k] for k in kept), [self.ids[k] for k in kept],
                           self.keys, np.searchsorted(kept, self.starts))

    def positions_in(self, gathered: np.ndarray) -> np.ndarray | None:
        """Where each of these rows is in `gathered` (rows in some order that hold all of these), or None when
        `gathered` is these rows themselves."""
        if gathered is self.rows:
            return None
        where = np.empty(int(max(gathered.max(initial=-1), self.rows.max(initial=-1))) + 1, dtype=np.int64)
        where[gathered] = np.arange(len(gathered))
        return where[self.rows]


@dataclass(frozen=True)
class RealtimePlan:
    """The live realtime sessions as a tick takes them: all of them in row order (`sessions[k]` in `rows[k]`), and
    the order their frames go out in (`out`)."""

    sessions: tuple[Session, ...]
    rows: np.ndarray  # int64
    serials: np.ndarray  # int64, `sessions[k].serial`: whose row each was as the plan was built (SlotTable.holders)
    out: OutputOrder

    def __post_init__(self) -> None:
        self.rows.flags.writeable = False  # a tick's rows when every session reads a staged frame


class SlotTable:
    """Which session holds each row. `lock` (reentrant) also guards what other threads read of a session while
    the engine thread hands out its frames: close() waits for a callback in flight, so none follows it."""

    def __init__(self, size: int):
        self.lock = threading.RLock()
        self._rows: list[Session | None] = [None] * size
        # live(offline) as last built, until a session's state next moves: the engine thread asks for it several
        # times a tick and between ticks (a pass over every row, ~10 % of its host time at 250 sessions).
        self._live: dict[bool, tuple[Session, ...]] = {}
        self._realtime: RealtimePlan | None = None  # the same, for realtime()
        # Each held row's counts (ROW_COUNTS), by array: a tick of 250 counted them on each session's record, passes
        # over objects it had not touched since the last tick (~80 us each on a 2-core CPU), and so did the channel's
        # hand-off after it. A session's record takes its counts as it leaves its row; `holders` is the serial of
        # the session in each row (0: none), so that a reader of a copy can tell whose they are (Engine.counts_of).
        self.counts = np.zeros((size, len(ROW_COUNTS)), dtype=np.int64)
        # The columns a tick counts in, as views: a 1-D index is about half the work of a 2-D one.
        self.frames_in, self.frames_out = self.counts[:, FRAMES_IN], self.counts[:, FRAMES_OUT]
        self.holders = np.zeros(size, dtype=np.int64)
        self._serials = itertools.count(1)

    def reserve(self) -> Session:
        with self.lock:
            for i, held in enumerate(self._rows):
                if held is None:
                    session = Session(index=i, id=f"slot-{uuid.uuid4().hex[:12]}", serial=next(self._serials))
                    self._rows[i] = session
                    self.counts[i] = 0
                    self.holders[i] = session.serial
                    return session
        raise ResourceExhausted(f"duplex_session_capacity_exhausted: limit={len(self._rows)}")

    def move(self, session: Session, state: str) -> bool:
        """Move `session` to `state` if its machine allows it (False, and nothing changes, if not). An ended
        session leaves its row."""
        with self.lock:
            if state not in MOVES[session.state]:
                return False
            if state in ENDED and self._rows[session.index] is session:
                vars(session.stats).update(self._row_counts(session.index))
                self.holders[session.index] = 0
                self._rows[session.index] = None
            session.stats.state = state
            self._live.clear()
            self._realtime = None
            return True

    def stats(self, session: Session) -> SlotStats:
        """A copy of `session`'s record with its counts so far."""
        with self.lock:
            if self._rows[session.index] is not session:  # it left its row: its record holds them
                return replace(session.stats)
            return replace(session.stats, **self._row_counts(session.index))

    def _row_counts(self, row: int) -> dict[str, int]:
        """The counts in `row` by their SlotStats names (lock held)."""
        return dict(zip(ROW_COUNTS, self.counts[row].tolist(), strict=True))

    def at(self, row: int) -> Session | None:
        return self._rows[row]

    def holds(self, session: Session) -> bool:
        return self._rows[session.index] is session

    def held(self) -> list[Session]:
        with self.lock:
            return [s for s in self._rows if s is not None]

    def in_use(self) -> int:
        with self.lock:
            return sum(held is not None for held in self._rows)

    def live(self, offline: bool) -> tuple[Session, ...]:
        """The live sessions of one pacing (input-clocked or realtime), in row order. A session's pacing is its
        params', set before it goes live and kept while it is."""
        with self.lock:
            live = self._live.get(offline)
            if live is None:
                live = self._live[offline] = tuple(s for s in self._rows if s is not None and s.live
                                                   and s.offline == offline)
            return live

    def realtime(self) -> RealtimePlan:
        """The live realtime sessions, their rows, and by output group (`Session.output_group`), as a tick takes
        their inputs and hands out their frames: built again only after a session's state moves, so a tick's
        bookkeeping is a few array operations rather than passes over its sessions."""
        with self.lock:
            plan = self._realtime
            if plan is None:
                sessions = self.live(offline=False)
                grouped: dict[int | None, list[Session]] = {}  # None: the sessions of their own
                for session in sessions:
                    grouped.setdefault(session.output_group, []).append(session)
                alone = grouped.pop(None, [])
                keys = list(grouped)
                ordered = [*(s for key in keys for s in grouped[key]), *alone]
                starts = np.cumsum([0, *(len(grouped[key]) for key in keys)], dtype=np.int64)
                out = OutputOrder(np.array([s.index for s in ordered], dtype=np.int64), tuple(ordered),
                                  [s.id for s in ordered], keys, starts)
                rows = np.array([s.index for s in sessions], dtype=np.int64)
                serials = np.array([s.serial for s in sessions], dtype=np.int64)
                plan = self._realtime = RealtimePlan(sessions, rows, serials, out)
            return plan

    # A session may end on another thread (a close) while the engine thread reads its frame, and the next session
    # reserve its row and count from zero: what was read for the one that left counts for no one (its record took
    # its counts as it left). So the engine thread counts only where the row's holder is still the one it read for.

    def count(self, column: int, session: Session) -> None:
        """One more in `column` (ROW_COUNTS) of `session`'s row, if it still holds it."""
        with self.lock:
            if self._rows[session.index] is session:
                self.counts[session.index, column] += 1

    def count_rows(self, column: int, rows: np.ndarray, serials: np.ndarray, amounts: np.ndarray | int = 1) -> None:
        """`amounts` more in `column` of `rows` (distinct), of each whose holder is still the session of its serial
        (`serials[k]` for `rows[k]`)."""
        with self.lock:
            held = self.holders[rows] == serials
            self.counts[:, column][rows] += held * amounts

    def window_changed(self, row: int, serial: int, frames: int, shrunk: bool) -> None:
        """The context window of `row`'s pages became `frames` (shrunk, or grown back), if they are its holder's:
        the session of `serial` (0: no session's)."""
        with self.lock:
            if serial and self.holders[row] == serial:
                self.counts[row, WINDOW_FRAMES] = frames
                self.counts[row, WINDOW_SHRINKS] += int(shrunk)


class SessionHost(Protocol):
    """What a Slot needs of its engine."""

    def validate(self, params: SessionParams) -> None: ...

    async def start_session(self, session: Session) -> None: ...

    async def add_prompt(self, session: Session, text: str, persona: str | None) -> None: ...

    def offer_inputs(self, sessions: list[Session], frames: np.ndarray) -> list[bool]: ...

    def release(self, session: Session) -> None: ...

    def session_stats(self, session: Session) -> SlotStats: ...


class Slot:
    """The asyncio side's handle on one reserved slot."""

    def __init__(self, host: SessionHost, session: Session):
        self._host = host
        self._session = session
        self.id = session.id
        self.index = session.index
        self.serial = session.serial

    async def start(self, params: SessionParams, source: FrameSource, on_output: Callable[[FrameOutput], None],
                    on_error: Callable[[EngineError], None], output_group: int | None = None) -> None:
        """Validate, run the voice + persona prompt between ticks, and go live. With `output_group`, the session's
        frames go to that group's call (`Engine.add_output_group`), a tick's with the group's other sessions', and
        not to `on_output`."""
        self._host.validate(params)
        session = self._session
        if session.state != "reserved":
            raise EngineError(f"slot {self.id} is {session.state}, not reserved", "invalid_state")
        session.params, session.source, session.on_output, session.on_error = params, source, on_output, on_error
        session.output_group = output_group
        seed = params.sampling.seed
        session.seed = seed if seed is not None else secrets.randbits(63)
        await self._host.start_session(session)

    async def restart(self) -> None:
        """A fresh context with the same parameters; output indices restart at 0."""
        if self._session.params is None:
            raise EngineError("session not started", "invalid_state")
        await self._host.start_session(self._session)

    async def add_prompt(self, text: str, persona: str | None = None) -> None:
        """Prefill `text` as a `<system>` prompt into the live context at the next frame boundary (the context and
        the output's frame indices go on); `persona`, when given, is what a later restart prompts with."""
        if self._session.params is None:
            raise EngineError("session not started", "invalid_state")
        await self._host.add_prompt(self._session, text, persona)

    def offer(self, frame: np.ndarray) -> bool:
        """Hand the session's next input frame straight to the next tick if it can take it from there (a realtime
        session with no frame queued in its source, while no tick reads its inputs: model/engine/staging.py); False,
        and the frame belongs in the session's source, behind any queued there."""
        return self.offer_all([self], np.asarray(frame, dtype=np.float32)[None])[0]

    @staticmethod
    def offer_all(slots: list[Slot], frames: np.ndarray) -> list[bool]:
        """`offer` for slots of one engine at once, `frames[k]` (float32 [len(slots), 1920]) slot k's: one check
        of the samples and one lock for them all (a worker's Frames message in an engine process)."""
        if not slots:
            return []
        return slots[0]._host.offer_inputs([slot._session for slot in slots], frames)

    def close(self) -> None:
        self._host.release(self._session)

    def stats(self) -> SlotStats:
        return self._host.session_stats(self._session)

    @property
    def record(self) -> SlotStats:
        """The engine's own record of the session, read in place: its counts once it has ended (until then they
        are its row's, SlotTable.counts)."""
        return self._session.stats
