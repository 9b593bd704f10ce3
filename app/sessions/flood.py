"""Flood limits on what a client sends: a token bucket per session, shared by every transport that reads messages.

`FloodGuard.admit()` is asked once per received message. Over the rate the message is dropped and the client told
(`rate_limited`, at most once a second); when more messages in a row than the bucket's burst were dropped, the
flood is sustained and the session is closed (`on_flood`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class FloodGuard:
    def __init__(self, rate: float, on_drop: Callable[[], None], on_flood: Callable[[], None]) -> None:
        self._bucket = TokenBucket(rate, 2 * rate)
        self._on_drop = on_drop          # tell the client its events are being dropped
        self._on_flood = on_flood        # close the session
        self._dropped = 0
        self._last_warning = 0.0

    def admit(self) -> bool:
        """Whether this message is taken (False: dropped)."""
        if self._bucket.take():
            self._dropped = 0
            return True
        self._dropped += 1
        now = time.monotonic()
        if self._dropped > self._bucket.burst:
            self._on_flood()
        elif now - self._last_warning >= 1.0:
            self._last_warning = now
            self._on_drop()
        return False
