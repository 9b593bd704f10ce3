"""The engine process's side of the channel: one Engine served to the worker processes over a Unix socket.

The engine thread never waits for a worker. Input frames arrive on this process's asyncio thread and wait in a
per-session queue that the tick reads (`ChannelSource`); a tick's outputs for each worker are gathered by the
sessions' callbacks on the engine thread, encoded there in one message per worker by the tick listener, and handed
to the asyncio thread, whose transports write them. A worker that stops reading is dropped once its unsent output
passes `max_unsent_bytes` (its sessions close); one that disconnects or dies frees its sessions' slots at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from model.config import FRAME_SAMPLES
from model.engine import Engine, EngineError, FrameOutput, OutputRows, Slot, SlotStats
from model.engine.channel import (
    FRAME_BYTES,
    AddPrompt,
    Close,
    Failed,
    Frames,
    Hello,
    MessageReader,
    ModelInfo,
    Reply,
    Reserve,
    Restart,
    Start,
    Stats,
    StatsRequest,
    Tick,
    ToEngine,
    Welcome,
    WorkerCounters,
    WorkerCounterSet,
    WorkerInfo,
    encode,
    tail,
)
from model.engine.slots import ROW_COUNTS
from model.engine.stats import quantiles_ms

log = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5


class ChannelSource:
    """A session's input frames as they arrive from its worker; the tick takes one each (FrameSource)."""

    def __init__(self) -> None:
        self._frames: deque[np.ndarray] = deque()

    def push(self, frame: np.ndarray) -> None:
        self._frames.append(frame)

    def read_frame(self) -> np.ndarray | None:
        try:
            return self._frames.popleft()
        except IndexError:
            return None

    def frames_ready(self) -> int:
        return len(self._frames)


@dataclass
class HostSession:
    slot: Slot
    link: WorkerLink
    source: ChannelSource = field(default_factory=ChannelSource)
    offline: bool = False
    record: SlotStats = field(init=False)  # the engine's record of it, read in place: its counts once it ends
    row: int = field(init=False)
    serial: int = field(init=False)

    def __post_init__(self) -> None:
        self.record, self.row, self.serial = self.slot.record, self.slot.index, self.slot.serial

    def recorded_counts(self) -> list[int]:
        """Its counts as its record holds them once it has ended (slots.ROW_COUNTS' order)."""
        return [getattr(self.record, name) for name in ROW_COUNTS]


@dataclass(frozen=True)
class Roster:
    """A link's realtime sessions as of a count of changes to them: their ids, sessions, rows and serials."""

    changes: int
    sids: list[str]
    sessions: list[HostSession]
    rows: np.ndarray
    serials: np.ndarray


class WorkerLink:
    """One worker's connection: its sessions, its reader, and the outputs the engine thread gathers for it."""

    def __init__(self, host: EngineHost, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.reader = MessageReader(reader, ToEngine)
        self.writer = writer
        self.worker = -1
        self.pid = 0
        self.counters: WorkerCounterSet = {}
        self.sessions: dict[str, HostSession] = {}
        # Its realtime sessions as the engine thread counts them each tick (`_roster`), rebuilt when the asyncio
        # thread has changed `sessions` or a session's pacing since (`_roster_changes`).
        self._roster_changes = 0
        self._roster = Roster(-1, [], [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        # Engine thread only: this worker's realtime frames since the last Tick, blocks of rows (OutputRows taken).
        self.outbox: list[tuple[list[str], list[int], list[str], np.ndarray, np.ndarray]] = []
        self.output_group = host.engine.add_output_group(self._take_rows)
        self.closed = False
        self.late_frames = 0  # input frames that came after the tick they were meant for (in all)
        self._late_reported = 0
        self._late_by = 0.0  # the most a Frames message came after its deadline since the last Tick

    # ---- asyncio thread ---------------------------------------------------------------------------------------

    def send(self, *pieces: bytes | memoryview) -> None:
        """A message, framed (`encode`), then its tail's pieces if it has one."""
        if self.closed:
            return
        transport = self.writer.transport
        if transport.get_write_buffer_size() > self.host.max_unsent_bytes:
            log.error("worker %d (pid %d) does not read its outputs: dropping it", self.worker, self.pid)
            self.drop()
            return
        self.writer.writelines(pieces)

    def forget(self, sid: str, failed: bytes) -> None:
        """A session the engine failed: its worker forgets it as it reads `failed` (its Failed message) and sends
        no Close, so this link forgets it here, and no later tick counts it."""
        session = self.sessions.pop(sid, None)
        self._roster_changes += 1
        if session is not None:
            session.slot.close()
        self.send(failed)

    def drop(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.host.engine.remove_output_group(self.output_group)
        for session in list(self.sessions.values()):
            session.slot.close()
        self.sessions.clear()
        self._roster_changes += 1
        self.writer.transport.abort()

    async def serve(self) -> None:
        try:
            while (message := await self.reader.read()) is not None:
                self.dispatch(message)
        except (ConnectionError, OSError) as exc:
            log.warning("worker %d channel error: %s", self.worker, exc)
        finally:
            if self.sessions:
                log.warning("worker %d (pid %d) went away: freeing its %d sessions", self.worker, self.pid,
                            len(self.sessions))
            self.drop()
            self.host.remove_link(self)

    def dispatch(self, message: object) -> None:
        if isinstance(message, Frames):
            started = time.perf_counter()
            self._take_frames(message)
            self.host.frames_dispatch_s.append(time.perf_counter() - started)
        elif isinstance(message, Close):
            session = self.sessions.pop(message.sid, None)
            self._roster_changes += 1
            if session is not None:
                session.slot.close()
        elif isinstance(message, Hello):
            self.worker, self.pid = message.worker, message.pid
        elif isinstance(message, WorkerCounters):
            self.counters = message.counters
        else:
            self.host.spawn(self.answer(message))

    def _take_frames(self, message: Frames) -> None:
        """A worker's input frames for the next tick: staged in their rows where they may be, else queued."""
        # The tick reads its inputs as it starts, at its deadline: frames that come later wait for the next.
        late_by = time.monotonic() - message.deadline if message.deadline else 0.0
        if late_by > 0.0:
            self.late_frames += len(message.sids)
            self._late_by = max(self._late_by, late_by)
        if message.audio.nbytes != len(message.sids) * FRAME_BYTES:
            raise ConnectionError(f"a Frames message of {len(message.sids)} sessions and "
                                  f"{message.audio.nbytes} bytes of audio: the worker is broken")
        sessions = self.sessions
        rows = np.frombuffer(message.audio, dtype=np.float32).reshape(len(message.sids), FRAME_SAMPLES)
        known = [(k, session) for k, sid in enumerate(message.sids) if (session := sessions.get(sid)) is not None]
        frames = rows if len(known) == len(rows) else rows[[k for k, _ in known]]
        # Staged in their input rows, off the tick's path; else queued, views of the message (kept as it came).
        for (k, session), staged in zip(known, Slot.offer_all([s.slot for _, s in known], frames), strict=True):
            if not staged:
                session.source.push(rows[k])

    async def answer(self, message: object) -> None:
        req = getattr(message, "req", -1)
        try:
            reply = await self.request(message)
        except EngineError as exc:
            reply = Reply(req=req, ok=False, code=exc.code, message=exc.message, cause=exc.cause)
        except Exception as exc:  # a bug here must not take the channel down
            log.exception("engine request failed")
            reply = Reply(req=req, ok=False, code="internal_error", message=f"{type(exc).__name__}: {exc}")
        self.send(encode(reply))

    async def request(self, message: object) -> Reply:
        engine = self.host.engine
        if isinstance(message, Reserve):
            slot = await engine.reserve_wait(message.timeout_s)
            if self.closed:
                slot.close()
                raise EngineError("the worker went away", "session_closed")
            self.sessions[slot.id] = HostSession(slot, self)
            self._roster_changes += 1
            return Reply(req=message.req, ok=True, sid=slot.id, index=slot.index)
        if isinstance(message, Start):
            session = self._session(message.sid)
            params = message.params
            session.offline = params.pacing == "input"
            self._roster_changes += 1
            await session.slot.start(params, session.source, self._output_callback(session),
                                     self._error_callback(session),
                                     output_group=None if session.offline else self.output_group)
            return Reply(req=message.req, ok=True, sid=message.sid)
        if isinstance(message, Restart):
            await self._session(message.sid).slot.restart()
            return Reply(req=message.req, ok=True, sid=message.sid)
        if isinstance(message, AddPrompt):
            await self._session(message.sid).slot.add_prompt(message.text, message.persona)
            return Reply(req=message.req, ok=True, sid=message.sid)
        if isinstance(message, StatsRequest):
            return Reply(req=message.req, ok=True, stats=self.host.stats_message())
        raise EngineError(f"unknown request {type(message).__name__}", "bad_request")

    def _session(self, sid: str) -> HostSession:
        session = self.sessions.get(sid)
        if session is None:
            raise EngineError(f"no session {sid}", "session_closed")
        return session

    # ---- engine thread ----------------------------------------------------------------------------------------

    def _output_callback(self, session: HostSession):
        """An input-clocked session's frames (stepped between ticks, as fast as its input comes): sent at once. A
        realtime session's go through the link's output group (`_take_rows`)."""
        sid = session.slot.id

        def on_output(frame: FrameOutput) -> None:
            audio = frame.audio.astype(np.float32, copy=False).tobytes()
            tick = Tick(next_tick_at=0.0, sids=[sid], indices=[frame.index], texts=[frame.text],
                        tokens=frame.tokens.astype(np.int64, copy=False).tobytes(),
                        counted=[sid], counts=self._counts([session]).tobytes(),
                        audio=tail(len(audio)))
            self.host.post(self, encode(tick, len(audio)), audio)

        return on_output

    def _take_rows(self, rows: OutputRows) -> None:
        """This worker's realtime frames of a tick (or a session's first half), sent with the tick's Tick."""
        self.outbox.append((rows.ids, rows.indices, rows.texts, rows.audio, rows.frames))

    def _error_callback(self, session: HostSession):
        sid = session.slot.id

        def on_error(error: EngineError) -> None:
            self.host.post_failure(self, sid, encode(Failed(sid, error.code, error.message, error.cause)))

        return on_error

    def _realtime_roster(self) -> Roster:
        changes = self._roster_changes
        if self._roster.changes != changes:
            live = [(sid, s) for sid, s in list(self.sessions.items()) if not s.offline]
            self._roster = Roster(changes, [sid for sid, _ in live], [s for _, s in live],
                                  np.array([s.row for _, s in live], dtype=np.int64),
                                  np.array([s.serial for _, s in live], dtype=np.int64))
        return self._roster

    def _counts(self, sessions: list[HostSession], rows: np.ndarray | None = None,
                serials: np.ndarray | None = None) -> np.ndarray:
        """The counts of `sessions` (in `rows`, with `serials`, where the caller has them), int64 [n, 5] in
        slots.ROW_COUNTS' order: their rows', one copy for all; a session's record's if it has ended since."""
        if rows is None or serials is None:
            rows = np.array([s.row for s in sessions], dtype=np.int64)
            serials = np.array([s.serial for s in sessions], dtype=np.int64)
        counts, holding = self.host.engine.counts_of(rows, serials)
        for k in np.flatnonzero(~holding).tolist():
            counts[k] = sessions[k].recorded_counts()
        return counts

    def flush_tick(self, next_tick_at: float) -> list[bytes | memoryview] | None:
        """After a tick: this worker's outputs and its realtime sessions' counts, in one message (its pieces, for
        `send`), if it has any."""
        blocks, self.outbox = self.outbox, []
        # Every realtime session's counts, every tick: its worker paces its input by them. By column, from the rows
        # the link keeps for them: Counters built per session read 250 records the tick had not touched (~0.1 ms
        # of the hand-off at 250 on a 2-core CPU).
        roster = self._realtime_roster()
        total = self.late_frames
        late, self._late_reported = total - self._late_reported, total
        late_by, self._late_by = self._late_by, 0.0
        if not (blocks or roster.sids):
            return None
        counts = self._counts(roster.sessions, roster.rows, roster.serials)
        sids, indices, texts = [], [], []
        for block_sids, block_indices, block_texts, _, _ in blocks:
            sids += block_sids
            indices += block_indices
            texts += block_texts
        # The audio blocks go out as _take_rows copied them, the message's tail; the tokens (2% of the bytes) join.
        audio = [memoryview(block[3]).cast("B") for block in blocks]
        size = sum(piece.nbytes for piece in audio)
        tick = Tick(next_tick_at=next_tick_at, sids=sids, indices=indices, texts=texts,
                    tokens=b"".join(memoryview(block[4]) for block in blocks), counted=roster.sids,
                    counts=counts.tobytes(), late_frames=late, late_by_s=late_by, audio=tail(size))
        return [encode(tick, size), *audio]


class EngineHost:
    """Serves `engine` on the Unix socket `path` until stopped. Run `serve()` on an asyncio loop."""

    def __init__(self, engine: Engine, model: ModelInfo, path: str, note: str = "",
                 max_unsent_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.model = model
        self.path = path
        self.note = note
        self.max_unsent_bytes = max_unsent_bytes
        self.links: set[WorkerLink] = set()
        # How long each worker's Frames message took this (asyncio) thread, seconds, newest last: it shares the GIL
        # with the engine thread, and its frames must be staged before the tick's reads begin (EngineStats).
        self.frames_dispatch_s: deque[float] = deque(maxlen=4096)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self._links_lock = threading.Lock()
        engine.add_tick_listener(self._after_tick)

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def post(self, link: WorkerLink, *pieces: bytes | memoryview) -> None:
        """From the engine thread: have the asyncio thread write a message (`WorkerLink.send`'s pieces) to `link`."""
        if self._loop is not None and not link.closed:
            self._loop.call_soon_threadsafe(link.send, *pieces)

    def post_failure(self, link: WorkerLink, sid: str, failed: bytes) -> None:
        """From the engine thread: `link`'s session `sid` failed; the asyncio thread forgets it and sends `failed`."""
        if self._loop is not None and not link.closed:
            self._loop.call_soon_threadsafe(link.forget, sid, failed)

    def remove_link(self, link: WorkerLink) -> None:
        with self._links_lock:
            self.links.discard(link)

    def _after_tick(self, record: object, next_tick_at: float) -> None:
        """Each worker's Tick, handed to the asyncio thread in one wake-up once all are encoded: a wake-up per
        worker woke it to write the first while the engine thread still encoded the others, each of the two then
        waiting for the GIL (hand_off at 250 sessions over 8 worker processes, 2-core CPU: 0.57 -> 0.42 ms p50)."""
        with self._links_lock:
            links = list(self.links)
        messages = [(link, pieces) for link in links if not link.closed
                    and (pieces := link.flush_tick(next_tick_at)) is not None]
        if messages and self._loop is not None:
            self._loop.call_soon_threadsafe(self._send_ticks, messages)

    @staticmethod
    def _send_ticks(messages: list[tuple[WorkerLink, list[bytes | memoryview]]]) -> None:
        for link, pieces in messages:
            link.send(*pieces)

    def stats_message(self) -> Stats:
        links = [link for link in list(self.links) if link.worker >= 0]
        workers = {str(link.worker): WorkerInfo(link.pid, len(link.sessions), link.counters, link.late_frames)
                   for link in links}
        engine = self.engine.stats()
        engine.frames_dispatch_ms = quantiles_ms(self.frames_dispatch_s)
        return Stats(engine=engine, workers=workers, next_tick_at=self.engine.next_tick_at)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = WorkerLink(self, reader, writer)
        with self._links_lock:
            self.links.add(link)
        link.send(encode(Welcome(self.model, self.engine.max_sessions, os.getpid(), self.note,
                                 self.stats_message())))
        await link.serve()

    async def _push_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            if not self.links:
                continue
            data = encode(self.stats_message())
            for link in list(self.links):
                link.send(data)

    async def serve(self, started: asyncio.Event | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        server = await asyncio.start_unix_server(self._accept, self.path, limit=1 << 20)
        os.chmod(self.path, 0o600)
        pusher = asyncio.ensure_future(self._push_stats())
        log.info("engine process %d serving %d slots on its channel", os.getpid(), self.engine.max_sessions)
        if started is not None:
            started.set()
        try:
            async with server:
                await server.serve_forever()
        finally:
            pusher.cancel()
            for link in list(self.links):
                link.drop()

