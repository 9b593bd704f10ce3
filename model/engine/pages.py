"""The KV page pool: which pages of the temporal transformer's cache each row holds, admission by memory, and
windows shrunk under pressure and grown back.

A row's ring (model/lm.py) holds `window` slots counted from frame `origin`, and its slot s lives at offset
s % page of page table[row, s // page] (model/attention.py). A row takes a page when its next frame enters a slot
of an unmapped one, so memory follows the frames a session has (its first `window` frames; then the ring slides
over the pages it holds), and it gives every page back when it ends.

Admission: a new session is admitted while the free pages cover `reserve_frames` more frames for it and for every
row in use still growing (the pages they will take soon). Under pressure anyway (no free page for a growing row),
the row holding most pages gives up its oldest page: its window shrinks by one page, as if the ring had that many
slots (window down to `floor_frames`); the frames kept stay at their offset, so this is a permutation of the
table plus, when the ring's cursor is inside a page, one copy of that page's older part. A shrunk row grows back
to the full window when its cursor reaches a page boundary and the pool would admit a session: its origin moves to
its oldest frame kept, so the kept pages become the first of a ring that fills on from there.

The host keeps the books (numpy) and mirrors changed rows to the device state (`flush`) before a step; device
work (zeroing released pages, the copy of a shrink) is queued on the current stream, behind any tick in flight.
Positions here run ahead of the device by the step in flight: `advance` counts a step when it is launched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from model.lm import LMState


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`. On CUDA pinned and asynchronous: a pageable copy may wait for the tick in flight.
    The pinned block is not reused before the copy ran (the caching host allocator records it on the stream)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class PoolCounts:
    pages: int
    free: int
    shrinks: int
    grows: int


class PagePool:
    """Pages 1..pages of the state's KV pool (page 0 is the never-mapped page) and the rows' page tables."""

    def __init__(self, state: LMState, reserve_frames: int, floor_frames: int,
                 on_window: Callable[[int, int, bool], None] | None = None):
        self.state = state
        kv = state.kv
        self.page, self.context = kv.page, kv.slots
        self.pages = kv.k.shape[1] - 1
        rows, per_row = kv.table.shape
        self.device = kv.table.device
        self.free = list(range(self.pages, 0, -1))
        self.table = np.zeros((rows, per_row), dtype=np.int64)
        self.pos = np.zeros(rows, dtype=np.int64)
        self.origin = np.zeros(rows, dtype=np.int64)
        self.window = np.full(rows, self.context, dtype=np.int64)
        self.reserve_frames = reserve_frames
        self.floor_pages = min(per_row, max(1, math.ceil(floor_frames / self.page)))
        self.on_window = on_window  # (row, window frames, shrunk) after a shrink (True) or a grow-back (False)
        self.shrinks = self.grows = 0
        self._dirty: set[int] = set()

    # ----- what rows hold -----------------------------------------------------------------------------------

    def held(self, row: int) -> int:
        return int(np.count_nonzero(self.table[row]))

    def counts(self) -> PoolCounts:
        return PoolCounts(self.pages, len(self.free), self.shrinks, self.grows)

    def admits(self, rows_in_use: list[int]) -> bool:
        """Whether the free pages cover `reserve_frames` more for a new session and for each growing row in use,
        with no row shrunk. Pages of rows not in use count as free: their session ended, and the engine returns
        them before any later start."""
        if any(self.window[r] < self.context for r in rows_in_use):
            return False
        ended = np.count_nonzero(self.table, axis=1)
        ended[rows_in_use] = 0
        return self._covers(rows_in_use, self.reserve_frames, int(ended.sum()))

    def _covers(self, rows: list[int], extra_frames: int, returning: int = 0) -> bool:
        """Whether the free pages (and `returning` more) cover `reserve_frames` of growth of each of `rows` (a
        shrunk row grows back to the full window) and a fresh row's first `extra_frames`."""
        rows_np = np.asarray(rows, dtype=np.int64)
        valid = np.minimum(self.pos[rows_np] - self.origin[rows_np], self.window[rows_np])
        held = -(-valid // self.page)
        grown = -(-np.minimum(valid + self.reserve_frames, self.context) // self.page)
        needed = int((grown - held).sum()) + math.ceil(min(extra_frames, self.context) / self.page)
        return len(self.free) + returning >= needed

    # ----- taking and returning pages -----------------------------------------------------------------------

    def ensure(self, row: int, frames: int = 1) -> bool:
        """Map the pages the row's next `frames` frames write (shrinking others' windows if none is free); False
        if no page could be found."""
        rel, window = int(self.pos[row] - self.origin[row]), int(self.window[row])
        if window < self.context and rel % self.page == 0 and self._may_grow(row):
            self._grow(row)
            rel, window = int(self.pos[row] - self.origin[row]), int(self.window[row])
        for index in range(math.ceil(min(rel + frames, window) / self.page)):
            if self.table[row, index]:
                continue
            if not self.free and not self._shrink_other(row):
                return False
            self.table[row, index] = self.free.pop()
            self._dirty.add(row)
        return True

    def ensure_rows(self, rows: list[int]) -> list[int]:
        """ensure() one frame for each of `rows`; those it failed for."""
        rows_np = np.asarray(rows, dtype=np.int64)
        rel = self.pos[rows_np] - self.origin[rows_np]
        slot = rel % self.window[rows_np]
        # Only rows entering a page do anything: a page to take, or a window to grow back.
        entering = (slot % self.page == 0) | (self.table[rows_np, slot // self.page] == 0)
        return [row for row in rows_np[entering].tolist() if not self.ensure(row)]

    def advance(self, rows: list[int] | np.ndarray, frames: int | np.ndarray = 1) -> None:
        np.add.at(self.pos, rows, frames)

    def set_position(self, row: int, pos: int) -> None:
        self.pos[row] = pos

    def release(self, row: int) -> None:
        """Return the row's pages (zeroed: a recycled page never leaks into masked arithmetic, 0 * nan) and make it
        a fresh full-window ring."""
        mapped = self.table[row][self.table[row] > 0]
        if mapped.size:
            self._zero(mapped)
            self.free.extend(mapped.tolist())
        self.table[row] = 0
        self.pos[row] = self.origin[row] = 0
        self.window[row] = self.context
        self._dirty.add(row)

    def flush(self) -> None:
        """Mirror the changed rows' tables, origins and windows to the device."""
        if not self._dirty:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        index = upload(np.asarray(rows, dtype=np.int64), self.device)
        state = self.state
        state.kv.table.index_copy_(0, index, upload(self.table[rows], self.device))
        state.origin.index_copy_(0, index, upload(self.origin[rows], self.device))
        state.window.index_copy_(0, index, upload(self.window[rows], self.device))

    def _zero(self, pages: np.ndarray) -> None:
        self.state.kv.zero_pages(upload(pages, self.device))

    # ----- shrinking and growing windows --------------------------------------------------------------------

    def _shrink_other(self, needy: int) -> bool:
        """Free a page by shrinking the window of the row (not `needy`) that holds most pages, above the floor."""
        held = np.count_nonzero(self.table, axis=1)
        held[needy] = 0
        victim = int(np.argmax(held))
        if held[victim] <= self.floor_pages:
            return False
        self._shrink(victim, int(held[victim]) - 1)
        return True

    def _shrink(self, row: int, keep: int) -> None:
        """Shrink the row's ring to `keep` pages holding its last keep * page frames (origin kept: frame f stays at
        offset (f - origin) % page), and free the others."""
        P = self.page
        rel = int(self.pos[row] - self.origin[row])
        old = self.table[row].copy()
        n = int(self.window[row]) // P
        current, cursor = divmod(rel, P)
        new = np.zeros_like(old)
        for block in range(current - keep + 1, current):  # whole blocks of frames kept
            new[block % keep] = old[block % n]
        oldest = old[(current - keep) % n]  # the block whose frames from offset `cursor` on are the oldest kept
        if cursor == 0:
            new[current % keep] = oldest
        else:  # the cursor's page holds the newest frames below the cursor; the oldest kept go above it
            page = int(old[current % n])
            for t in self.state.kv.tensors():
                t[:, page, :, cursor:].copy_(t[:, int(oldest), :, cursor:])
            new[current % keep] = page
        freed = np.setdiff1d(old[old > 0], new[new > 0])
        self._zero(freed)
        self.free.extend(freed.tolist())
        self.table[row] = new
        self.window[row] = keep * P
        self._moved(row)
        self.shrinks += 1
        if self.on_window is not None:
            self.on_window(row, keep * P, True)

    def _may_grow(self, row: int) -> bool:
        return self._covers(np.flatnonzero(self.table.any(axis=1)).tolist(), 0)

    def _grow(self, row: int) -> None:
        """At a page boundary of a shrunk (full) ring: its pages, oldest first, become the first of a full
        window whose origin is the oldest frame kept."""
        P = self.page
        n = int(self.window[row]) // P
        rel = int(self.pos[row] - self.origin[row])
        current = rel // P
        old = self.table[row].copy()
        self.table[row] = 0
        for i, block in enumerate(range(current - n, current)):
            self.table[row, i] = old[block % n]
        self.origin[row] += (current - n) * P
        self.window[row] = self.context
        self._moved(row)
        self.grows += 1
        if self.on_window is not None:
            self.on_window(row, self.context, False)

    def _moved(self, row: int) -> None:
        """The row's slots moved: its device kpos follows (slot s holds the newest frame f < pos with
        (f - origin) % window == s)."""
        self._dirty.add(row)
        rel, window, origin = int(self.pos[row] - self.origin[row]), int(self.window[row]), int(self.origin[row])
        slots = torch.arange(self.context, device=self.device)
        frame = (rel - 1) - torch.remainder(rel - 1 - slots, window)
        self.state.kpos[row] = torch.where((slots < window) & (frame >= 0), frame + origin, -1)
