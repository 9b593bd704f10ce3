"""Call recordings: per call one stereo file (caller left, agent right) on the server's frame timeline, the agent's
text pieces (`transcript.jsonl`) and the call's facts (`call.json`), written by one writer thread per process.

Where: `<record dir>/<UTC date>/<call id>/` holds `audio.ogg`, `transcript.jsonl` and `call.json` (docs/operations.md
says how to expire them). Position n of the file is the n-th engine frame of the call: the left channel is the
input frame the engine took for it (what the model heard; silence where the caller's audio was late or missing), the
right one the frame's output (what the model said, whether or not the caller got to hear it: a cut is noted in the
transcript with how much the caller had heard by then).

Format: Opus (24 kHz in, 48 kbit/s, two channels) in Ogg, through PyAV. For size: a minute of a call is at most 0.6 MB,
where 16-bit FLAC at 24 kHz is about 4 MB (lossless, which a review of a phone call does not need). For being
readable while it is written: Ogg is a sequence of self-contained, checksummed pages; each page (at most 0.25 s of
audio) goes to the file while the next one fills, so a process killed mid-call leaves a file that decodes up to its
last whole page, about half a second before the kill at most. Decoders give Opus at 48 kHz: `call.json` states that
rate.

Threads: the media path only hands frames on. The input tap (the engine's thread in one process) appends to the
call's own small deque; the event loop pairs each output frame with the input frame the engine took for it (by the
conversation's `frames_in`) and puts one item on the writer's bounded queue, never waiting: when the queue is full
the item is dropped and counted, and the writer fills the gap with silence so the timeline holds. The writer thread
encodes and writes; a full or unwritable disk ends that recording (counted, logged, said in `call.json` when it can
be written), never the call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO

import av
import numpy as np

from model.engine import FrameOutput

logger = logging.getLogger(__name__)

RATE = 24000                 # what the engine hears and says; the encoder's input
FRAME = 1920                 # one engine frame (80 ms)
OPUS_FRAME = 480             # 20 ms: the encoder takes four per engine frame
DECODED_RATE = 48000         # what an Opus decoder gives
BIT_RATE = 48000
PAGE_US = 250_000            # an Ogg page holds at most this much audio; the muxer writes one as the next fills
QUEUE_ITEMS = 4096           # frames waiting for the writer, all calls together (about 3 s of 100 calls)
TAP_FRAMES = 64              # input frames taken but not yet paired with their output, per call
POLICIES = ("all", "opt-in", "opt-out")
AUDIO, TRANSCRIPT, FACTS = "audio.ogg", "transcript.jsonl", "call.json"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")


def wanted(policy: str, asked: bool | None) -> bool:
    """Whether a call is recorded: `all` every call; `opt-out` unless its session or agent said no; `opt-in` only
    when it said yes."""
    if policy == "opt-in":
        return asked is True
    if policy == "opt-out":
        return asked is not False
    return True


def asked_to_record(value: object) -> bool | None:
    """A session's or agent's `record` wish from a vendor parameter ("true"/"false", "1"/"0", yes/no), or None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    return None


@dataclass
class Recording:
    """One call's recording, as the media path sees it (the writer thread owns the files)."""

    call_id: str
    folder: Path
    facts: dict[str, Any]                    # call.json as known at the start
    writer: RecordingWriter
    frames: int = 0                          # engine frames handed to the writer
    dropped: int = 0                         # of them, dropped at a full queue (silence in the file)
    error: str | None = None                 # why the writer gave up on it (set by the writer thread)
    frames_written: int = 0                  # frames the file holds (the writer's count, once it is closed)
    _heard: deque[np.ndarray] = field(default_factory=lambda: deque(maxlen=TAP_FRAMES))
    _taken: int = 0                          # input frames paired so far

    @property
    def paths(self) -> dict[str, str]:
        return {"folder": str(self.folder), "audio": str(self.folder / AUDIO),
                "transcript": str(self.folder / TRANSCRIPT), "call": str(self.folder / FACTS)}

    def input_frame(self, frame: np.ndarray) -> None:
        """An input frame the engine took (the conversation's input tap; any thread)."""
        self._heard.append(frame)

    def output_frame(self, frame: FrameOutput, frames_in: int) -> None:
        """An output frame, with how many input frames the engine had taken by then (on the event loop)."""
        heard = None
        if self._taken < frames_in and self._heard:
            heard = self._heard.popleft()
            self._taken += 1
        if not self.writer.put(("frame", self, self.frames, heard, frame.audio, frame.text, frame.index)):
            self.dropped += 1
        self.frames += 1

    def note(self, event: dict[str, Any]) -> None:
        """A line in the transcript at the current frame (a cut, say)."""
        self.writer.put(("note", self, self.frames, event))

    def finish(self, facts: dict[str, Any]) -> None:
        """The call is over: `facts` completes call.json; the writer closes the files. Never dropped."""
        self.writer.put(("finish", self, self.frames, facts))


@dataclass
class _Files:
    """What the writer holds open for one recording."""

    raw: BinaryIO
    container: Any
    stream: Any
    transcript: BinaryIO
    written: int = 0                         # frames in the file
    pts: int = 0


class RecordingWriter:
    """The process's recording writer: one thread, one queue (bounded in frames), every call's files."""

    COUNTERS = ("recordings_started", "recordings_written", "recordings_failed", "recording_bytes",
                "recording_dropped_frames")

    def __init__(self, folder: Path, counters: Counter[str]) -> None:
        self.folder = folder
        self.counters = counters
        for name in self.COUNTERS:            # every key there from the start: the loop reads while this thread adds
            counters.setdefault(name, 0)
        self._items: deque[tuple[Any, ...] | None] = deque()
        self._frames_waiting = 0
        self._ready = threading.Condition()
        self._open: dict[str, _Files] = {}
        self._thread = threading.Thread(target=self._run, name="recording-writer", daemon=True)
        self._thread.start()

    def start(self, call_id: str, started_at: float, facts: dict[str, Any]) -> Recording:
        day = datetime.fromtimestamp(started_at, timezone.utc).strftime("%Y-%m-%d")
        recording = Recording(call_id, self.folder / day / call_id, facts, self)
        self.put(("start", recording, 0))
        return recording

    def put(self, item: tuple[Any, ...] | None) -> bool:
        """Queue one item without waiting. A frame past the bound is dropped and counted (False); a start, a note
        or a finish is always taken (a handful per call)."""
        with self._ready:
            if item is not None and item[0] == "frame":
                if self._frames_waiting >= QUEUE_ITEMS:
                    self.counters["recording_dropped_frames"] += 1
                    return False
                self._frames_waiting += 1
            self._items.append(item)
            self._ready.notify()
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish what is queued and stop the thread (server shutdown)."""
        self.put(None)
        self._thread.join(timeout_s)

    def _next(self) -> tuple[Any, ...] | None:
        with self._ready:
            while not self._items:
                self._ready.wait()
            item = self._items.popleft()
            if item is not None and item[0] == "frame":
                self._frames_waiting -= 1
            return item

    # ---- the writer thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            kind, recording = item[0], item[1]
            if recording.error is not None:
                if kind == "finish":
                    self._facts_after_failure(recording, item[3])
                continue
            try:
                if kind == "start":
                    self._begin(recording)
                elif kind == "frame":
                    self._frame(recording, *item[2:])
                elif kind == "note":
                    self._note(recording, item[2], item[3])
                else:
                    self._finish(recording, item[3])
            except (OSError, av.FFmpegError) as e:
                self._fail(recording, e)

    def _begin(self, recording: Recording) -> None:
        recording.folder.mkdir(parents=True, exist_ok=True)
        _write_json(recording.folder / FACTS, recording.facts)
        # Unbuffered: each Ogg page PyAV flushes is one write to the file, so a killed process loses only the page
        # being filled.
        raw = open(recording.folder / AUDIO, "wb", buffering=0)  # noqa: SIM115 - kept open for the whole call
        container = av.open(raw, "w", format="ogg", buffer_size=4096,
                            options={"page_duration": str(PAGE_US), "flush_packets": "1"})
        stream = container.add_stream("libopus", rate=RATE, layout="stereo")
        stream.bit_rate = BIT_RATE
        stream.codec_context.options = {"application": "voip"}
        transcript = open(recording.folder / TRANSCRIPT, "ab", buffering=0)  # noqa: SIM115
        self._open[recording.call_id] = _Files(raw, container, stream, transcript)
        self.counters["recordings_started"] += 1

    def _frame(self, recording: Recording, position: int, heard: np.ndarray | None, said: np.ndarray, text: str,
               index: int) -> None:
        files = self._open[recording.call_id]
        silence = np.zeros(FRAME, dtype=np.float32)
        while files.written < position:                  # frames dropped at a full queue: silence holds the timeline
            self._encode(files, silence, silence)
        self._encode(files, silence if heard is None else heard, said)
        if text:
            _append(files.transcript, {"t": round(position * 0.08, 2), "frame": position, "index": index,
                                       "text": text})

    def _encode(self, files: _Files, left: np.ndarray, right: np.ndarray) -> None:
        planes = np.stack([left, right]).astype(np.float32, copy=False)
        for at in range(0, FRAME, OPUS_FRAME):
            chunk = av.AudioFrame.from_ndarray(np.ascontiguousarray(planes[:, at:at + OPUS_FRAME]), format="fltp",
                                               layout="stereo")
            chunk.sample_rate = RATE
            chunk.pts = files.pts
            files.pts += OPUS_FRAME
            for packet in files.stream.encode(chunk):
                files.container.mux(packet)
        files.written += 1

    def _note(self, recording: Recording, position: int, event: dict[str, Any]) -> None:
        _append(self._open[recording.call_id].transcript, {"t": round(position * 0.08, 2), "frame": position,
                                                           **event})

    def _finish(self, recording: Recording, facts: dict[str, Any]) -> None:
        files = self._open.pop(recording.call_id)
        try:
            for packet in files.stream.encode(None):
                files.container.mux(packet)
        finally:
            files.container.close()
            files.raw.close()
            files.transcript.close()
        recording.frames_written = files.written
        _write_json(recording.folder / FACTS, {**facts, "recording": self.describe(recording, files.written)})
        size = sum(p.stat().st_size for p in recording.folder.iterdir() if p.is_file())
        self.counters["recordings_written"] += 1
        self.counters["recording_bytes"] += size

    def _fail(self, recording: Recording, error: Exception) -> None:
        """The disk said no: this recording ends (the call goes on), counted and logged once."""
        recording.error = f"{type(error).__name__}: {error}"
        self.counters["recordings_failed"] += 1
        logger.error("recording %s ended: %s", recording.call_id, recording.error)
        files = self._open.pop(recording.call_id, None)
        if files is not None:
            recording.frames_written = files.written
            for closing in (files.container.close, files.raw.close, files.transcript.close):
                with contextlib.suppress(Exception):
                    closing()
        self._facts_after_failure(recording, recording.facts)

    def _facts_after_failure(self, recording: Recording, facts: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            _write_json(recording.folder / FACTS, {**facts, "recording": self.describe(recording,
                                                                                        recording.frames_written)})

    @staticmethod
    def describe(recording: Recording, written: int) -> dict[str, Any]:
        return {"audio": AUDIO, "transcript": TRANSCRIPT, "format": "ogg/opus", "channels": 2,
                "channel_layout": ["caller", "agent"], "sample_rate": DECODED_RATE, "encoded_rate": RATE,
                "bit_rate": BIT_RATE, "frames": written, "duration_s": round(written * 0.08, 2),
                "dropped_frames": recording.dropped, "error": recording.error}


def _append(handle: BinaryIO, line: dict[str, Any]) -> None:
    handle.write((json.dumps(line, ensure_ascii=False) + "\n").encode())


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Whole or not at all: a reader (or a crash) never sees half a file."""
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(value, indent=1, ensure_ascii=False))
    partial.replace(path)
