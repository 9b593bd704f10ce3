"""The model's audio onto a telephone line: resampled to the line's rate, buffered, sent one chunk per chunk period.

Telephone bridges (Twilio, Telnyx, Vonage, FreeSWITCH, Asterisk AudioSocket) play what they are sent as it comes,
with little or no buffering of their own, so the line needs one chunk (20 ms by default) per chunk period of wall
clock, silence while the model's next frame is due, never a burst and never a gap. `Pacer.write` takes each engine
frame (24 kHz) into a `PlayoutBuffer` (a small adaptive prebuffer); the first write starts the pacing task, which
calls `send(chunk)` on the clock; after a stall the clock moves on instead of catching up in a burst.

Marks: `mark(name)` is answered (`on_mark(name)`) once every sample written before it has been sent; `clear()`
drops the audio not sent yet and the marks placed in it (they will never be answered: their audio never leaves).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from media.playout import PlayoutBuffer
from media.resample import Resampler

MODEL_RATE = 24000
STALL_S = 0.040      # a send this late rebases the clock instead of catching up in a burst


class Pacer:
    def __init__(self, rate: int, send: Callable[[np.ndarray], None], *, chunk_ms: int = 20,
                 on_mark: Callable[[str], None] | None = None) -> None:
        self.rate = rate
        self.chunk = rate * chunk_ms // 1000
        self.period_s = chunk_ms / 1000.0
        self._send = send
        self._on_mark = on_mark
        self.resampler = Resampler(MODEL_RATE, rate)
        self.playout = PlayoutBuffer(rate)
        self.marks: deque[tuple[int, str]] = deque()   # (playout position, name)
        self.chunks_sent = 0
        self._task: asyncio.Task[None] | None = None

    def write(self, audio: np.ndarray) -> None:
        """One engine frame (24 kHz float32); the first starts the pacing."""
        self.playout.write(self.resampler.process(audio))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._pace())

    def mark(self, name: str) -> None:
        self.marks.append((self.playout.stats().written_samples, name))
        self._answer_marks()

    def clear(self) -> None:
        self.playout.clear()
        self.marks.clear()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _pace(self) -> None:
        due = time.monotonic()
        while True:
            self._send(self.playout.read(self.chunk))
            self.chunks_sent += 1
            self._answer_marks()
            due += self.period_s
            now = time.monotonic()
            if now - due > STALL_S:
                due = now
            await asyncio.sleep(max(0.0, due - now))

    def _answer_marks(self) -> None:
        drained = self.playout.stats().drained_samples
        while self.marks and self.marks[0][0] <= drained:
            _, name = self.marks.popleft()
            if self._on_mark is not None:
                self._on_mark(name)
