"""Numbered chunks back in order, within a small window: for vendors whose media messages may arrive out of order.

`Reorder.put(n, item)` returns the items now deliverable in order. A chunk older than the next one expected is late
and dropped (counted); a gap that more than `window` later chunks have passed is taken as lost and skipped. At most
`window` + 1 chunks are held.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Reorder(Generic[T]):
    def __init__(self, window: int = 8) -> None:
        self.window = window
        self.next: int | None = None
        self.held: dict[int, T] = {}
        self.late = 0
        self.skipped = 0

    def put(self, n: int, item: T) -> list[T]:
        if self.next is None:
            self.next = n
        if n < self.next:
            self.late += 1
            return []
        self.held[n] = item
        if len(self.held) > self.window and self.next not in self.held:
            first = min(self.held)
            self.skipped += first - self.next
            self.next = first
        out = []
        while self.next in self.held:
            out.append(self.held.pop(self.next))
            self.next += 1
        return out
