"""A session's one bounded output path: every message for the client waits in one queue drained by one writer task.

Events keep their order because there is one queue and one writer. The writer leaves a message queued while it is
being sent, so its age counts until the transport has taken it. When the oldest queued message has waited
`max_backlog_s`, or more than `max_bytes` would be queued, the outbox overflows: the queue is dropped (its memory
freed), nothing more is taken, and `on_overflow` is called once (the session frees its slot, queues its last word
with `put_last` and closes). The transport supplies only how one message is sent (`start(send)`); `stop` flushes
what is queued for a bounded time and ends the writer. Messages may carry a tag: `drop_tagged` withdraws the queued
ones not yet being sent (a cut response's audio the client has not been given).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable

Message = str | bytes
Sender = Callable[[Message], Awaitable[bool]]   # False: the transport is gone, the writer ends


class Outbox:
    def __init__(self, max_backlog_s: float, max_bytes: int, on_overflow: Callable[[], None]) -> None:
        self.max_backlog_s = max_backlog_s
        self.max_bytes = max_bytes
        self._on_overflow = on_overflow
        self._queue: deque[tuple[float, Message, str | None]] = deque()   # (queued at, message, tag), oldest first
        self._bytes = 0
        self._ready = asyncio.Event()
        self._done = False                   # the writer ends once the queue is empty
        self.overflowed = False              # past the bound: nothing more is queued
        self._writer: asyncio.Task[None] | None = None

    def put(self, message: Message, tag: str | None = None) -> None:
        """Queue one message, or overflow (past the time or byte bound) instead."""
        if self.overflowed:
            return
        now = time.monotonic()
        if self._queue and (now - self._queue[0][0] > self.max_backlog_s
                            or self._bytes + len(message) > self.max_bytes):
            self.overflowed = True
            self._drop()
            self._on_overflow()
            return
        self._push(now, message, tag)

    def put_last(self, message: Message) -> None:
        """After an overflow: the one message still sent (the error saying why the session ends)."""
        self._drop()
        self._push(time.monotonic(), message)

    def drop_tagged(self, tag: str) -> int:
        """Withdraw the queued messages tagged `tag`, except the one being sent; how many were withdrawn."""
        if not self._queue:
            return 0
        head, rest = self._queue[0], list(self._queue)[1:]
        kept = [entry for entry in rest if entry[2] != tag]
        self._queue = deque([head, *kept])
        self._bytes = sum(len(entry[1]) for entry in self._queue)
        return len(rest) - len(kept)

    def _push(self, now: float, message: Message, tag: str | None = None) -> None:
        self._queue.append((now, message, tag))
        self._bytes += len(message)
        self._ready.set()

    def _drop(self) -> None:
        self._queue.clear()
        self._bytes = 0

    def start(self, send: Sender) -> None:
        """Run the writer: `send` each message in order until it returns False or the outbox stops."""
        self._writer = asyncio.get_running_loop().create_task(self._write_loop(send))

    async def _next(self) -> Message | None:
        while not self._queue:
            if self._done:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._queue[0][1]

    async def _write_loop(self, send: Sender) -> None:
        while True:
            message = await self._next()
            if message is None or not await send(message):
                return
            # Unqueued only now (unless an overflow dropped the queue while it was being sent).
            if self._queue and self._queue[0][1] is message:
                self._bytes -= len(self._queue.popleft()[1])

    async def stop(self, flush_wait_s: float) -> None:
        """Flush what is queued (for at most `flush_wait_s`), then end the writer and drop the rest."""
        writer, self._writer = self._writer, None
        self._done = True
        self._ready.set()
        if writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(writer), timeout=flush_wait_s)
            if not writer.done():
                writer.cancel()
        self._drop()
