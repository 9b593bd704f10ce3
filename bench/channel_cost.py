"""The engine channel's per-tick messages (model/engine/channel.py) at N sessions of one worker: the time to frame and
to read the engine's `Tick` (N outputs) and the worker's `Frames` (N inputs), with the caches cold, as a tick leaves
them (a buffer larger than the last-level cache is walked before each run). One JSON line per session count.

    python -m bench.channel_cost [--sessions 32 250] [--runs 800]

`tick_encode_ms` is the Tick as the engine thread frames it, its audio the message's tail (written after it as it
is); `tick_encode_inline_ms` the audio copied into the message, as it was before the tail; `tick_encode_joined_ms`
that, encoded alone and then joined to its length header, as the channel framed its messages before `encode` wrote
the body in place after the header.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import msgspec
import numpy as np

from model.config import FRAME_SAMPLES
from model.engine.channel import FRAME_BYTES, HEADER, Frames, Tick, ToEngine, ToWorker, encode, tail

CACHE_SWEEP_BYTES = 64 << 20


def tick_message(sessions: int, rng: np.random.Generator) -> Tick:
    audio = rng.standard_normal((sessions, FRAME_SAMPLES)).astype(np.float32)
    tokens = rng.integers(0, 2048, (sessions, 17), dtype=np.int64)
    sids = [f"sid-{i:04d}" for i in range(sessions)]
    counts = np.tile(np.array([100, 99, 0, 0, 0], dtype=np.int64), (sessions, 1))
    return Tick(next_tick_at=time.monotonic(), sids=sids, indices=[100] * sessions, texts=[" word"] * sessions,
                tokens=tokens.tobytes(), counted=sids, counts=counts.tobytes(), audio=memoryview(audio.tobytes()))


def frames_message(sessions: int, rng: np.random.Generator) -> tuple[Frames, list[bytes]]:
    """A worker's Frames as it sends them: the message, then each session's frame as its tail."""
    rows = [row.tobytes() for row in rng.standard_normal((sessions, FRAME_SAMPLES)).astype(np.float32)]
    return Frames(sids=[f"sid-{i:04d}" for i in range(sessions)], deadline=time.monotonic(),
                  audio=tail(sessions * FRAME_BYTES)), rows


def cold_ms(run: Callable[[], object], runs: int, sweep: np.ndarray) -> float:
    """The median ms of `run`, each after a walk over `sweep` (caches cold, as after a tick's own work)."""
    times = []
    for _ in range(runs):
        sweep += 1
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000.0)
    return round(float(np.median(times)), 3)


def joined(message: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> bytes:
    body = encoder.encode(message)
    return HEADER.pack(len(body)) + body


def measure(sessions: int, runs: int, sweep: np.ndarray) -> dict:
    rng = np.random.default_rng(sessions)
    tick, (frames, frame_rows) = tick_message(sessions, rng), frames_message(sessions, rng)
    frames_bytes = len(frame_rows) * FRAME_BYTES
    encoder = msgspec.msgpack.Encoder()
    to_worker, to_engine = msgspec.msgpack.Decoder(ToWorker), msgspec.msgpack.Decoder(ToEngine)
    audio_bytes = tick.audio.nbytes
    with_tail = msgspec.structs.replace(tick, audio=tail(audio_bytes))
    tick_framed = encode(with_tail, audio_bytes) + tick.audio
    frames_framed = encode(frames, frames_bytes) + b"".join(frame_rows)
    tick_body, frames_body = bytes(tick_framed[HEADER.size:]), bytes(frames_framed[HEADER.size:])
    # The same message whichever way the audio goes (as the tail, its bin header is always bin 32's).
    assert to_worker.decode(tick_body) == to_worker.decode(joined(tick, encoder)[HEADER.size:])
    return {
        "bench": "channel_cost", "sessions": sessions, "runs": runs,
        "tick_bytes": len(tick_framed), "frames_bytes": len(frames_framed),
        "tick_encode_ms": cold_ms(lambda: encode(with_tail, audio_bytes), runs, sweep),
        "tick_encode_inline_ms": cold_ms(lambda: encode(tick), runs, sweep),
        "tick_encode_joined_ms": cold_ms(lambda: joined(tick, encoder), runs, sweep),
        "tick_decode_ms": cold_ms(lambda: to_worker.decode(tick_body), runs, sweep),
        "frames_encode_ms": cold_ms(lambda: encode(frames, frames_bytes), runs, sweep),
        "frames_decode_ms": cold_ms(lambda: to_engine.decode(frames_body), runs, sweep),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[32, 250])
    parser.add_argument("--runs", type=int, default=800)
    args = parser.parse_args()
    sweep = np.zeros(CACHE_SWEEP_BYTES // 8)
    for sessions in args.sessions:
        print(json.dumps(measure(sessions, args.runs, sweep)), flush=True)


if __name__ == "__main__":
    main()
