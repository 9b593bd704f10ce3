"""A worker process for the benches: sessions held on an engine process's channel as a server's worker holds them
(model/engine/client.py), each fed by a source that always has a frame; driven by lines on stdin.

    python -m bench.channel_worker SOCKET [WORKER]   (WORKER: its number, as the engine's stats show it; 0)
    stdin "open N"  -> N more realtime sessions started; answers "opened N"
    stdin "close"   -> every session closed; answers "closed F", F the sessions that failed meanwhile

In its own process, as in the server, the worker's side of each tick (reading the engine's Tick, a copy per row,
sending the next Frames) takes no GIL from the engine thread: measured beside it on one event loop, it made every
host phase of the tick look longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

import numpy as np

from model.engine.api import EngineError, FrameOutput, SamplingParams, SessionParams
from model.engine.client import RemoteEngine, RemoteSlot

CONNECT_TIMEOUT_S = 30.0


class EndlessSource:
    """A client that always has its next frame ready."""

    def __init__(self, seed: int):
        self.frame = (0.1 * np.random.default_rng(seed).standard_normal(1920)).astype(np.float32)

    def read_frame(self) -> np.ndarray:
        return self.frame

    def frames_ready(self) -> int:
        return 1


class Sessions:
    """The worker's sessions and the failures among them since the last close."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self.slots: list[RemoteSlot] = []
        self.failed = 0

    def _failed(self, error: EngineError) -> None:
        self.failed += 1
        print(f"channel_worker: a session failed: {error}", file=sys.stderr, flush=True)

    async def open(self, count: int) -> None:
        params = SessionParams(sampling=SamplingParams())
        for _ in range(count):
            slot = await self.engine.reserve_wait(0.0)
            await slot.start(params, EndlessSource(len(self.slots)), self._drop, self._failed)
            self.slots.append(slot)

    def close(self) -> int:
        for slot in self.slots:
            slot.close()
        self.slots.clear()
        failed, self.failed = self.failed, 0
        return failed

    @staticmethod
    def _drop(_: FrameOutput) -> None:
        pass


async def serve(path: str, worker: int) -> None:
    engine = RemoteEngine(path, worker=worker)
    running = asyncio.ensure_future(engine.run())
    try:
        if not await engine.wait_connected(CONNECT_TIMEOUT_S):
            raise SystemExit("channel_worker: the engine's channel did not answer")
        sessions = Sessions(engine)
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(sys.stdin.fileno()))
        while line := (await reader.readline()).decode().split():
            if line[0] == "open":
                await sessions.open(int(line[1]))
                print(f"opened {line[1]}", flush=True)
            elif line[0] == "close":
                print(f"closed {sessions.close()}", flush=True)
            else:
                raise SystemExit(f"channel_worker: unknown command {line!r}")
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 0))


if __name__ == "__main__":
    main()
