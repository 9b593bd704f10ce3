"""Webhooks: `call.started` and `call.ended` POSTed to `--webhook-url`, signed, in order, through a small on-disk spool.

Each event is a JSON object `{"id", "type", "created", "data": {"call": {...}}}`, sent as the POST body with the
headers `PersonaPlex-Event-Id` and `PersonaPlex-Signature: t=<unix seconds>,v1=<hex>`, where v1 is
HMAC-SHA256(`--webhook-secret`, "<t>.<body>") (Stripe's scheme; docs/operations.md shows how to verify it, and to
refuse a stale `t`). A retried event keeps its id and body and is signed again with a new `t`.

Delivery: `emit` only appends to a bounded in-memory queue and wakes the sender task (the media path never waits);
the sender writes each event to the spool (one file per event, written whole: a crash leaves it there or not at
all), then POSTs the events one at a time in the order they were emitted, so a call's events arrive in order. A 2xx
delivers (the file goes); a 4xx other than 408 and 429 is refused for good; anything else (a refused connection, a
timeout, a 5xx) is retried after 1 s, 2 s, 4 s ... (at most `--webhook-backoff-max-s`) for up to
`--webhook-retry-s`, then given up. Given-up, refused and overflowed events are counted
(`personaplex_webhooks_total`) and logged with their body. The spool is read back when the process starts again, so
what a worker had not delivered when it died is delivered by the worker started in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "PersonaPlex-Signature"
EVENT_ID_HEADER = "PersonaPlex-Event-Id"
MAX_QUEUED = 10000          # events emitted but not yet spooled
FIRST_BACKOFF_S = 1.0
REQUEST_TIMEOUT_S = 10.0
RESULTS = ("delivered", "retried", "refused", "given_up", "overflowed")


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: str, header: str, body: bytes, tolerance_s: float | None = 300.0, now: float | None = None) -> bool:
    """Whether `header` signs `body` with `secret` (and, with a tolerance, was made within it of `now`)."""
    try:
        parts = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if tolerance_s is not None and abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), f"t={timestamp},v1={parts.get('v1', '')}")


class Webhooks:
    """One process's event sender: `emit` from the loop, `run()` as a task, `stop()` at shutdown."""

    def __init__(self, url: str, secret: str, spool: Path, counters: Counter[str], *, retry_s: float,
                 backoff_max_s: float, first_backoff_s: float = FIRST_BACKOFF_S) -> None:
        self.url = url
        self.secret = secret
        self.spool = spool
        self.counters = counters
        for result in RESULTS:
            counters.setdefault(f"webhooks_{result}", 0)
        self.retry_s = retry_s
        self.backoff_max_s = backoff_max_s
        self.first_backoff_s = first_backoff_s
        self._emitted: deque[dict[str, Any]] = deque()
        self._wake = asyncio.Event()
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    def emit(self, kind: str, call: dict[str, Any]) -> None:
        """Queue one event about `call`; never waits (past `MAX_QUEUED` it is dropped, counted and logged)."""
        event = {"id": f"evt_{uuid.uuid4().hex[:24]}", "type": kind, "created": round(time.time(), 3),
                 "data": {"call": call}}
        if len(self._emitted) >= MAX_QUEUED:
            self.counters["webhooks_overflowed"] += 1
            logger.error("webhook queue full: event dropped: %s", json.dumps(event))
            return
        self._emitted.append(event)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, flush_s: float = 2.0) -> None:
        """Send what can go within `flush_s`; the rest stays in the spool for the next start."""
        if self._task is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), flush_s)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        await asyncio.to_thread(self._spool_emitted)    # whatever is still only in memory

    async def _drained(self) -> None:
        while self._emitted or await asyncio.to_thread(self._pending):
            await asyncio.sleep(0.05)

    # ---- the spool -------------------------------------------------------------------------------------------

    def _pending(self) -> list[Path]:
        """Spooled events, oldest first (the names sort by when they were spooled)."""
        return sorted(self.spool.glob("*.json")) if self.spool.is_dir() else []

    def _spool_emitted(self) -> None:
        """Move what was emitted onto the disk, in order."""
        self.spool.mkdir(parents=True, exist_ok=True)
        while self._emitted:
            event = self._emitted[0]
            self._seq += 1
            name = f"{time.time_ns():020d}-{self._seq:06d}-{event['id']}.json"
            partial = self.spool / (name + ".partial")
            partial.write_text(json.dumps(event))
            partial.replace(self.spool / name)
            self._emitted.popleft()

    # ---- sending ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as http:
            while True:
                try:
                    await asyncio.to_thread(self._spool_emitted)
                    pending = await asyncio.to_thread(self._pending)
                except OSError as e:   # the spool cannot be written: keep the events in memory, try again later
                    logger.error("webhook spool %s: %s", self.spool, e)
                    pending = []
                    await asyncio.sleep(self.first_backoff_s)
                for path in pending:
                    await self._deliver(http, path)
                    if self._emitted:
                        break      # spool what came meanwhile, behind what is already spooled
                if not self._emitted:
                    self._wake.clear()
                    if not self._emitted:
                        await self._wake.wait()

    async def _deliver(self, http: aiohttp.ClientSession, path: Path) -> None:
        """POST one spooled event until it is delivered, refused, or its retry time is up; then drop its file."""
        try:
            body = path.read_bytes()
            event = json.loads(body)
        except (OSError, ValueError):
            logger.error("webhook spool: unreadable %s; dropped", path.name)
            path.unlink(missing_ok=True)
            return
        deadline = time.monotonic() + self.retry_s
        backoff = self.first_backoff_s
        while True:
            status, reason = await self._post(http, event["id"], body)
            if status is not None and 200 <= status < 300:
                self.counters["webhooks_delivered"] += 1
                break
            if status is not None and 400 <= status < 500 and status not in (408, 429):
                self.counters["webhooks_refused"] += 1
                logger.error("webhook %s refused (%d): %s", event["type"], status, body.decode())
                break
            if time.monotonic() + backoff > deadline:
                self.counters["webhooks_given_up"] += 1
                logger.error("webhook %s given up after %g s (%s): %s", event["type"], self.retry_s, reason,
                             body.decode())
                break
            self.counters["webhooks_retried"] += 1
            logger.info("webhook %s: %s; again in %g s", event["type"], reason, backoff)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, self.backoff_max_s)
        path.unlink(missing_ok=True)

    async def _post(self, http: aiohttp.ClientSession, event_id: str, body: bytes) -> tuple[int | None, str]:
        headers = {"Content-Type": "application/json", EVENT_ID_HEADER: event_id,
                   SIGNATURE_HEADER: sign(self.secret, int(time.time()), body)}
        try:
            async with http.post(self.url, data=body, headers=headers) as answer:
                await answer.read()
                return answer.status, f"HTTP {answer.status}"
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            return None, f"{type(e).__name__}: {e}"
