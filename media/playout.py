"""Per-session output FIFO between the engine (80 ms frames from its own thread) and a paced consumer.

The consumer (a WebRTC track at 48/24 kHz, a Twilio sender at 8 kHz; resampling happens before `write`) calls
`read(n)` on its own clock, 20 ms at a time, and always gets exactly n samples: silence when nothing is ready.
- Prebuffer: when audio arrives into an empty buffer, playback starts only after the consumer's clock has
  advanced by the prebuffer (40 ms to begin with), so each engine frame lands while the previous one still
  has that much left: the slack against a late engine tick. An underrun (the buffer runs dry mid-stream)
  adds 20 ms (up to 120 ms); 10 s of reads without one takes 20 ms back (down to 20 ms), so the next
  restart is tighter. Time-based rather than depth-based because 80 ms writes would satisfy any
  depth threshold below a frame at once; a buffer already holding the prebuffer plus the largest write
  (the backlog of a stalled consumer) starts at once.
- No burst after a stall: if the consumer stops reading while the engine keeps writing, everything beyond
  prebuffer + 160 ms is shed (oldest first, counted) so latency stays bounded when reading resumes.
- `clear()` (barge-in, Twilio `clear`) empties the buffer and bumps `generation`; a writer passes the
  generation it started producing under, so a frame finished after the clear is dropped as stale.
`written_samples` and `drained_samples` (played, shed or cleared) are monotonic positions: audio written at
position p has left the buffer once drained >= p (what a Twilio `mark` echo waits for).

`advised_playout_ms` is the other end's share: the playout buffer a WebSocket client's own player needs for the link
the server measures (the native dialect's `session.link` tells the client).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


def advised_playout_ms(link_jitter_ms: float, tick_jitter_ms: float, floor_ms: float = 40.0) -> float:
    """How much a client's fixed-delay player should hold of the model's audio so that no frame comes after its
    time: the jitter of the link back to it (taken as that of the link from it, measured on its own audio's arrivals:
    one path, both ways), plus the spread of the engine's ticks (one frame leaves per tick), plus a 20 ms margin;
    rounded up to 10 ms, at least `floor_ms`."""
    need = max(0.0, link_jitter_ms) + max(0.0, tick_jitter_ms) + 20.0
    return max(floor_ms, 10.0 * math.ceil(need / 10.0))


@dataclass(frozen=True)
class PlayoutConfig:
    start_prebuffer_ms: float = 40.0
    min_prebuffer_ms: float = 20.0
    max_prebuffer_ms: float = 120.0
    underrun_step_ms: float = 20.0
    quiet_period_s: float = 10.0
    headroom_ms: float = 160.0


@dataclass(frozen=True)
class PlayoutStats:
    depth_ms: float
    prebuffer_ms: float
    underruns: int
    underrun_ms: float
    shed_ms: float
    cleared_ms: float
    stale_writes: int
    generation: int
    written_samples: int
    drained_samples: int


class PlayoutBuffer:
    def __init__(self, sample_rate: int, config: PlayoutConfig | None = None) -> None:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        self.sample_rate = sample_rate
        self.config = config or PlayoutConfig()
        self._lock = threading.Lock()
        self._chunks: deque[np.ndarray] = deque()
        self._offset = 0  # samples of _chunks[0] already read
        self._depth = 0
        self._prebuffer_ms = self.config.start_prebuffer_ms
        self._playing = False
        self._started = False  # has played since the last clear: silence after this is an underrun
        self._start_at: int | None = None  # consumer clock at which a pending start may play
        self._largest_write = 0
        self._clock = 0  # samples handed to the consumer so far
        self._quiet = 0  # samples read since the last underrun or prebuffer step
        self._generation = 0
        self._underruns = 0
        self._underrun = 0
        self._shed = 0
        self._cleared = 0
        self._stale = 0
        self._written = 0
        self._drained = 0

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def write(self, samples: np.ndarray, generation: int | None = None) -> bool:
        """Queue audio; False (and nothing queued) if `generation` is stale since a `clear()`."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"playout input must be 1-D mono, got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("playout input contains NaN or infinity")
        with self._lock:
            if generation is not None and generation != self._generation:
                self._stale += 1
                return False
            if x.size == 0:
                return True
            self._chunks.append(x.copy())
            self._largest_write = max(self._largest_write, x.size)
            self._depth += x.size
            self._written += x.size
            if not self._playing and self._start_at is None:
                self._start_at = self._clock + self._samples(self._prebuffer_ms)
            cap = self._samples(self._prebuffer_ms + self.config.headroom_ms)
            if self._depth > cap:
                keep = min(cap, self._samples(self._prebuffer_ms) + x.size)
                self._shed += self._discard(self._depth - keep)
            return True

    def read(self, n: int) -> np.ndarray:
        """Exactly n samples of float32: queued audio, or silence while prebuffering or empty."""
        if n <= 0:
            raise ValueError(f"read size must be positive, got {n}")
        out = np.zeros(n, dtype=np.float32)
        with self._lock:
            clock, self._clock = self._clock, self._clock + n
            if not self._playing and self._start_at is not None and (clock >= self._start_at or self._covered()):
                self._playing = self._started = True
                self._start_at = None
            if not self._playing:
                if self._started:
                    self._underrun += n
                return out
            got = self._take(out)
            if got < n:
                self._underruns += 1
                self._underrun += n - got
                self._playing = False
                self._quiet = 0
                self._prebuffer_ms = min(
                    self._prebuffer_ms + self.config.underrun_step_ms, self.config.max_prebuffer_ms
                )
            else:
                self._quiet += n
                if self._quiet >= self.config.quiet_period_s * self.sample_rate:
                    self._quiet = 0
                    step = self._prebuffer_ms - self.config.underrun_step_ms
                    self._prebuffer_ms = max(step, self.config.min_prebuffer_ms)
        return out

    def runs_dry(self, n: int) -> bool:
        """Whether a read of n samples now would underrun: playing, with less than n queued."""
        with self._lock:
            return self._playing and self._depth < n

    def clear(self) -> int:
        """Drop everything queued (barge-in); returns the new generation writers must use."""
        with self._lock:
            self._cleared += self._discard(self._depth)
            self._playing = self._started = False
            self._start_at = None
            self._generation += 1
            return self._generation

    def stats(self) -> PlayoutStats:
        with self._lock:
            ms = 1000.0 / self.sample_rate
            return PlayoutStats(
                depth_ms=self._depth * ms,
                prebuffer_ms=self._prebuffer_ms,
                underruns=self._underruns,
                underrun_ms=self._underrun * ms,
                shed_ms=self._shed * ms,
                cleared_ms=self._cleared * ms,
                stale_writes=self._stale,
                generation=self._generation,
                written_samples=self._written,
                drained_samples=self._drained,
            )

    # -- caller holds the lock --

    def _covered(self) -> bool:
        """Enough queued that the prebuffer is still there when the next write is due (after a stall)."""
        return self._depth >= self._samples(self._prebuffer_ms) + self._largest_write

    def _samples(self, ms: float) -> int:
        return round(ms * self.sample_rate / 1000.0)

    def _take(self, out: np.ndarray) -> int:
        """Fill `out` from the head of the queue; returns how many samples were there."""
        got = 0
        while got < out.size and self._chunks:
            head = self._chunks[0]
            k = min(out.size - got, head.size - self._offset)
            out[got : got + k] = head[self._offset : self._offset + k]
            got += k
            self._advance(k)
        return got

    def _discard(self, n: int) -> int:
        left = n
        while left and self._chunks:
            left -= self._advance(min(left, self._chunks[0].size - self._offset))
        return n - left

    def _advance(self, k: int) -> int:
        self._offset += k
        self._depth -= k
        self._drained += k
        if self._offset == self._chunks[0].size:
            self._chunks.popleft()
            self._offset = 0
        return k
