"""CPU cost of recording a call (app/calls/recording.py), as JSON lines.

    python -m bench.recording_cost [--calls 8] [--seconds 60] [--audio speech|noise]

`calls` recordings of `seconds` each go through the real writer (one thread, Ogg Opus files in a temporary folder),
fed as fast as it takes them. One line per measure:
- `writer`: the writer thread's CPU time per second of call (encoding, muxing, the transcript), i.e. the share of one
  core a live call costs; the bytes written per minute of call;
- `media_path`: what the event loop spends per engine frame handing one on (`Recording.output_frame`), microseconds.
Speech is the built-in synthetic voice on both channels; noise is what the tiny random model says (Opus's worst
case).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from app.calls.recording import FRAME, RecordingWriter
from model.engine import FrameOutput
from model.tiny import synthetic_voice


def audio(kind: str, seconds: float, seed: int) -> np.ndarray:
    if kind == "noise":
        return (np.random.default_rng(seed).standard_normal(int(24000 * seconds)) * 0.1).astype(np.float32)
    return synthetic_voice(seed, seconds).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--audio", choices=("speech", "noise"), default="speech")
    args = parser.parse_args()
    frames = int(args.seconds / 0.08)
    caller, agent = audio(args.audio, args.seconds, 1), audio(args.audio, args.seconds, 2)
    counters: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as folder:
        writer = RecordingWriter(Path(folder), counters)
        recordings = [writer.start(f"call_{n}", time.time(), {"call_id": f"call_{n}"}) for n in range(args.calls)]
        handed_ns = 0
        cpu0 = time.thread_time()          # this thread's: the loop side alone
        wall0 = time.perf_counter()
        writer_cpu0 = _thread_cpu(writer)
        for i in range(frames):
            heard = caller[i * FRAME:(i + 1) * FRAME]
            said = FrameOutput(index=i, audio=agent[i * FRAME:(i + 1) * FRAME], text=" a" if i % 5 == 0 else "",
                               tokens=np.zeros(17, np.int64))
            for recording in recordings:
                t0 = time.perf_counter_ns()
                recording.input_frame(heard)
                recording.output_frame(said, recording.frames + 1)
                handed_ns += time.perf_counter_ns() - t0
            while writer._frames_waiting > 1000:          # keep within the queue bound: none dropped
                time.sleep(0.001)
        for recording in recordings:
            recording.finish({"call_id": recording.call_id})
        while counters["recordings_written"] < args.calls:
            time.sleep(0.01)
        writer_cpu = _thread_cpu(writer) - writer_cpu0
        writer.close()
        wall = time.perf_counter() - wall0
        loop_cpu = time.thread_time() - cpu0
        size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    call_seconds = args.calls * frames * 0.08
    print(json.dumps({"measure": "writer", "audio": args.audio, "calls": args.calls, "seconds_each": args.seconds,
                      "writer_cpu_s": round(writer_cpu, 3), "cpu_per_call_second": round(writer_cpu / call_seconds, 5),
                      "core_share_per_call_pct": round(100 * writer_cpu / call_seconds, 3),
                      "bytes_per_call_minute": round(size / call_seconds * 60), "wall_s": round(wall, 2),
                      "dropped_frames": counters["recording_dropped_frames"],
                      "written": counters["recordings_written"]}))
    print(json.dumps({"measure": "media_path", "us_per_frame": round(handed_ns / (frames * args.calls) / 1000, 2),
                      "loop_thread_cpu_s": round(loop_cpu, 3)}))


def _thread_cpu(writer: RecordingWriter) -> float:
    """The writer thread's CPU seconds so far (Linux: from /proc)."""
    fields = Path(f"/proc/self/task/{writer._thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
