"""A session's one bounded output path: every message for the client waits in one queue drained by one writer task.

Events keep their order because there is one queue and one writer. The writer leaves a message queued while it is
being sent, so its age counts until the transport has taken it. A transport that can say how many bytes it holds
that the peer has not acknowledged (`held`: its write buffer and the kernel's send queue, `held_by`) has those
counted too: the writer notes when each message was handed over, so the output's age is that of its oldest byte the
peer has not taken, wherever it waits. (A phone line's audio is slow: the buffers between the outbox and the peer
hold tens of seconds of it, which a bound on the queue alone never saw.) When that age passes `max_backlog_s`, or
more than `max_bytes` would be waiting, the outbox overflows: the queue is dropped (its memory freed), nothing more
is taken, and `on_overflow` is called once (the session frees its slot, queues its last word with `put_last` and
closes). The transport supplies how one message is sent (`start(send, held)`); `stop` flushes what is queued for a
bounded time and ends the writer. Bytes a peer's own kernel has acknowledged but its application has not read are
out of sight (bounded by that peer's receive buffer). Messages may carry a tag: `drop_tagged` withdraws the queued
ones not yet being sent (a cut response's audio the client has not been given).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import struct
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable

Message = str | bytes
Sender = Callable[[Message], Awaitable[bool]]   # False: the transport is gone, the writer ends
Held = Callable[[], int]                        # bytes the transport holds that the peer has not acknowledged


def held_by(transport: asyncio.BaseTransport | None) -> int:
    """Bytes an asyncio socket transport holds for its peer: its write buffer plus the kernel's send queue (sent
    but not acknowledged, or not yet sent: SIOCOUTQ, which is TIOCOUTQ on Linux)."""
    if transport is None or transport.is_closing():
        return 0
    held = transport.get_write_buffer_size()   # type: ignore[attr-defined]
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            held += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return held


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
        self._held: Held | None = None
        self._handed = 0                     # bytes handed to the transport so far
        self._handed_at: deque[tuple[int, float]] = deque()   # (bytes handed once it was, when), not yet acked

    def put(self, message: Message, tag: str | None = None) -> None:
        """Queue one message, or overflow (past the time or byte bound) instead."""
        if self.overflowed:
            return
        now = time.monotonic()
        if self._past_bound(now, len(message)):
            self.overflowed = True
            self._drop()
            self._on_overflow()
            return
        self._push(now, message, tag)

    def _past_bound(self, now: float, size: int) -> bool:
        held, held_since = self._in_transport()
        oldest = self._queue[0][0] if self._queue else None
        if held_since is not None and (oldest is None or held_since < oldest):
            oldest = held_since
        if oldest is not None and now - oldest > self.max_backlog_s:
            return True
        return bool(self._queue or held) and self._bytes + held + size > self.max_bytes

    def _in_transport(self) -> tuple[int, float | None]:
        """(bytes the transport holds, when the oldest of them was handed over), forgetting what was acked."""
        if self._held is None:
            return 0, None
        held = self._held()
        acked = self._handed - held
        while self._handed_at and self._handed_at[0][0] <= acked:
            self._handed_at.popleft()
        return held, self._handed_at[0][1] if self._handed_at and held else None

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

    def start(self, send: Sender, held: Held | None = None) -> None:
        """Run the writer: `send` each message in order until it returns False or the outbox stops; `held`, when
        the transport can tell, gives the bytes it holds that the peer has not acknowledged."""
        self._held = held
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
            if message is None:
                return
            if self._held is not None:
                # Noted before the send: a transport takes the bytes at once, then may wait for room.
                self._handed += len(message)
                self._handed_at.append((self._handed, time.monotonic()))
            if not await send(message):
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
