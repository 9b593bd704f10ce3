"""CPU cost of the per-session media path, one JSON line per operation (microseconds per call).

    python -m bench.media_cost [--seconds 0.5]

Each operation runs in batches for about --seconds; the line reports the median and best batch mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from media.codecs import AudioFormat
from media.jitter import FRAME, JitterBuffer
from media.playout import PlayoutBuffer
from media.red import RedFormat, Redundancy, unpack
from media.resample import Resampler


def measure(name: str, op: Callable[[], object], seconds: float, **extra: object) -> dict[str, object]:
    op()  # warm up (first-call setup, caches)
    batch = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(batch):
            op()
        if time.perf_counter() - t0 > 0.01:
            break
        batch *= 2
    means = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(means) < 5:
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            op()
        means.append((time.perf_counter_ns() - t0) / batch / 1000.0)
    return {"op": name, "us_per_call": round(statistics.median(means), 2), "best_us": round(min(means), 2), **extra}


def resample_op(in_rate: int, out_rate: int, ms: int) -> Callable[[], object]:
    r = Resampler(in_rate, out_rate)
    x = (np.random.default_rng(0).standard_normal(in_rate * ms // 1000) * 0.1).astype(np.float32)
    return lambda: r.process(x)


def jitter_op() -> Callable[[], object]:
    """One engine tick of a WebRTC session: four 20 ms packets pushed, one 80 ms frame read."""
    jb = JitterBuffer()
    packet = (np.random.default_rng(1).standard_normal(480) * 0.1).astype(np.float32)
    state = {"pts": 0, "now": 0.0}

    def tick() -> object:
        for _ in range(4):
            state["now"] += 0.02
            jb.push(state["pts"], packet, now=state["now"])
            state["pts"] += 480
        return jb.read_frame(now=state["now"])

    for _ in range(3):  # prime it, so the measured ticks read frames
        tick()
    return tick


def playout_op() -> Callable[[], object]:
    """One engine tick of output at 48 kHz: one 80 ms write, four 20 ms reads."""
    buf = PlayoutBuffer(48000)
    frame = np.full(3840, 0.1, np.float32)

    def tick() -> object:
        buf.write(frame)
        return [buf.read(960) for _ in range(4)]

    return tick


def red_wrap_op() -> Callable[[], object]:
    """A WebRTC sender's RED (media/red.py) around one 20 ms Opus packet of ~120 bytes (48 kb/s)."""
    red = Redundancy(RedFormat(63, 111, 1))
    packet = bytes(120)
    state = {"ts": 0}

    def wrap() -> object:
        state["ts"] += 960
        return red.wrap(packet, state["ts"])

    return wrap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="measuring time per operation")
    seconds = parser.parse_args().seconds
    ulaw = AudioFormat("pcmu", 8000)
    chunk_8k = (np.random.default_rng(2).standard_normal(160) * 0.1).astype(np.float32)
    coded = ulaw.encode(chunk_8k)
    pcm16 = AudioFormat("pcm16", 24000)
    frame_bytes = pcm16.encode(np.zeros(FRAME, np.float32))
    sender = Redundancy(RedFormat(63, 111, 1))
    red_packet = [sender.wrap(bytes(120), ts) for ts in (0, 960)][-1]     # a packet and the one before it
    ops: list[tuple[str, Callable[[], object], dict[str, object]]] = [
        ("resample_48k_to_24k", resample_op(48000, 24000, 20), {"chunk_ms": 20}),
        ("resample_8k_to_24k", resample_op(8000, 24000, 20), {"chunk_ms": 20}),
        ("resample_24k_to_48k", resample_op(24000, 48000, 80), {"chunk_ms": 80}),
        ("resample_24k_to_8k", resample_op(24000, 8000, 80), {"chunk_ms": 80}),
        ("ulaw_encode", lambda: ulaw.encode(chunk_8k), {"chunk_ms": 20}),
        ("ulaw_decode", lambda: ulaw.decode(coded), {"chunk_ms": 20}),
        ("pcm16_decode_24k", lambda: pcm16.decode(frame_bytes), {"chunk_ms": 80}),
        ("jitter_push4_read1", jitter_op(), {"per_ms": 80}),
        ("playout_write1_read4_48k", playout_op(), {"per_ms": 80}),
        ("red_wrap", red_wrap_op(), {"chunk_ms": 20}),
        ("red_unpack", lambda: unpack(red_packet), {"chunk_ms": 20}),
    ]
    for name, op, extra in ops:
        print(json.dumps(measure(name, op, seconds, **extra)), flush=True)


if __name__ == "__main__":
    main()
