"""A fake Twilio for the tests: the Twilio side of a bidirectional Media Stream as Twilio documents it.

It sends `connected`, `start` (with `callSid` and custom parameters), the caller's μ-law audio at 20 ms a message,
and `stop`; it keeps the server's `media` in a playback buffer that it plays at real time, echoes each of the server's
`mark`s once the audio before it has played, and on `clear` drops what it has not played and echoes the marks then
pending at once. It never sends a mark of its own.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from media.codecs import AudioFormat

ULAW = AudioFormat("pcmu", 8000)
CHUNK = 160


def start_event(sid: str = "MZ0001", call_sid: str = "CA1", **params: str) -> dict[str, Any]:
    return {"event": "start", "sequenceNumber": "1", "streamSid": sid, "start": {
        "streamSid": sid, "accountSid": "AC1", "callSid": call_sid, "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": params}}


@dataclass
class FakeTwilio:
    ws: aiohttp.ClientWebSocketResponse
    sid: str = "MZ0001"
    received: list[bytes] = field(default_factory=list)        # every media payload the server sent, in order
    played: list[bytes] = field(default_factory=list)          # what the caller heard, in order
    echoed: list[str] = field(default_factory=list)            # our mark echoes, in order
    events: list[dict[str, Any]] = field(default_factory=list)  # everything but media
    cleared: int = 0
    close_reason: str | None = None                             # the close frame's reason
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._queue: deque[bytes | str] = deque()             # audio chunks and mark names, in the order sent
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._play())]

    async def start(self, call_sid: str = "CA1", **params: str) -> None:
        await self.ws.send_json({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        await self.ws.send_json(start_event(self.sid, call_sid, **params))

    async def speak(self, samples_8k: np.ndarray) -> None:
        """The caller's audio, one 20 ms message per 20 ms."""
        data = ULAW.encode(samples_8k)
        t0 = time.monotonic()
        for n, at in enumerate(range(0, len(data) - CHUNK + 1, CHUNK)):
            if self.closed.is_set():
                return
            await self.ws.send_json({"event": "media", "sequenceNumber": str(n + 2), "streamSid": self.sid,
                                     "media": {"track": "inbound", "chunk": str(n + 1), "timestamp": str(n * 20),
                                               "payload": base64.b64encode(data[at:at + CHUNK]).decode()}})
            await asyncio.sleep(max(0.0, t0 + (n + 1) * 0.02 - time.monotonic()))

    async def stop(self) -> None:
        await self.ws.send_json({"event": "stop", "streamSid": self.sid,
                                 "stop": {"accountSid": "AC1", "callSid": "CA1"}})
        await asyncio.wait_for(self.closed.wait(), 10)

    async def _echo(self, name: str) -> None:
        self.echoed.append(name)
        await self.ws.send_json({"event": "mark", "sequenceNumber": "0", "streamSid": self.sid,
                                 "mark": {"name": name}})

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    self.close_reason = msg.extra if msg.type is aiohttp.WSMsgType.CLOSE else None
                    break
                event = msg.json()
                kind = event.get("event")
                if kind == "media":
                    chunk = base64.b64decode(event["media"]["payload"])
                    self.received.append(chunk)
                    self._queue.append(chunk)
                    continue
                self.events.append(event)
                if kind == "mark":
                    self._queue.append(event["mark"]["name"])
                elif kind == "clear":
                    self.cleared += 1
                    pending = [item for item in self._queue if isinstance(item, str)]
                    self._queue.clear()
                    for name in pending:
                        await self._echo(name)
        finally:
            self.closed.set()

    async def _play(self) -> None:
        """Play one 20 ms chunk per 20 ms; a mark at the head of the queue has had all its audio played."""
        t0, n = time.monotonic(), 0
        while not self.closed.is_set():
            while self._queue and isinstance(self._queue[0], str):
                await self._echo(self._queue.popleft())   # type: ignore[arg-type]
            if self._queue:
                self.played.append(self._queue.popleft())  # type: ignore[arg-type]
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * 0.02 - time.monotonic()))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()

    def heard(self) -> np.ndarray:
        return ULAW.decode(b"".join(self.played))
