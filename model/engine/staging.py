"""Input frames written into their sessions' input rows as they arrive, between ticks, off the tick's path.

A tick reads every realtime session's next frame into the pinned input rows before it launches: at 250 sessions on
the H200's host that is 1.4-2.0 ms of Python a tick (5.5-8 us a session), on the path of every frame. An engine
process receives each worker's frames a few milliseconds before the tick (model/engine/client.py's input lead), so
a frame can go into its row then, while no tick runs, and the tick only takes it.

A frame is staged only where nothing can come between it and the tick that reads it: no tick is reading the rows
(from its first read until its outputs, and with them its upload of the rows, have landed), none is staged for the
row yet, and the session's source has no frame queued before it. Otherwise the caller queues it in the session's
source, as every frame was before, and the tick copies it. The lock orders each staging against the tick's reads
and against a session's start (which discards what a row's last session left), so a stale frame of a closed session
cannot reach the next session of its row.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from model.config import FRAME_SAMPLES


class StagedInputs:
    """The pinned input rows' staged frames: offered by the thread that receives them, taken by the tick."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows  # [B, FRAME_SAMPLES] float32, the runner's pinned input rows
        self._staged = np.zeros(len(rows), dtype=bool)
        self._lock = threading.Lock()
        self._reading = False
        self.staged = 0  # frames staged since the engine started (its stats' input_frames_staged)

    def offer(self, rows: list[int], frames: np.ndarray, admits: Callable[[int], bool]) -> list[bool]:
        """Write `frames[k]` into `rows[k]` (distinct) for the next tick where no tick is reading, the frame is
        finite, the row has none staged and `admits(k)` (checked under the lock) says its session may stage; for
        each, whether it was staged (False: the caller queues that frame as before, and the tick refuses a bad one
        as it refuses any). One finiteness check and one lock for a worker's whole `Frames` message: per frame they
        were ~8 us of the engine process's asyncio thread, 2 ms a message of 250 on a 2-core CPU."""
        staged = [False] * len(rows)
        # The cheap refusal first, outside the lock (it is taken again inside): a message that meets a tick's reads
        # costs the thread that receives it (and the tick, for the GIL) no check of its samples.
        if self._reading or frames.dtype != np.float32 or frames.shape != (len(rows), FRAME_SAMPLES):
            return staged
        finite = np.isfinite(frames).all(axis=1)
        targets = np.asarray(rows, dtype=np.int64)
        with self._lock:
            if self._reading:
                return staged
            taken = [k for k in np.flatnonzero(finite & ~self._staged[targets]).tolist() if admits(k)]
            if taken:  # one copy for them all: a row's copy each was 0.16 of 0.30 ms for 250 frames (2-core CPU)
                into = targets[taken]
                self._staged[into] = True
                self._rows[into] = frames if len(taken) == len(rows) else frames[taken]
                for k in taken:
                    staged[k] = True
            self.staged += len(taken)
        return staged

    def hold(self) -> None:
        """A tick begins reading the rows: no frame is staged until `release()`."""
        with self._lock:
            self._reading = True

    def release(self) -> None:
        """The tick's outputs landed: its upload of the rows is done, and frames may be staged again."""
        with self._lock:
            self._reading = False

    def take(self, rows: np.ndarray) -> np.ndarray:
        """For each of `rows` (int64), whether a frame is staged in it (now taken); for the tick, between `hold()`
        and `release()`."""
        staged = self._staged[rows]
        self._staged[rows] = False
        return staged

    def discard(self, row: int) -> None:
        """A session starts in `row`: what its row's last session staged is not its input."""
        with self._lock:
            self._staged[row] = False
