"""The channel between the engine process and the worker processes: typed messages and their framing.

One Unix stream socket per worker. Each message is a msgpack body (msgspec) behind a 4-byte big-endian length.
Audio crosses as raw float32 bytes, one frame (1920 samples) per session, batched per tick in both directions:
a worker sends one `Frames` message a tick for all its realtime sessions, the engine one `Tick` message a tick with
all that worker's outputs and session counters. Each carries its frames as one block, the message's tail (`encode`):
the last field's bytes, written after the body as they are and read where they landed. Requests (`Reserve`,
`Start`, `Restart`, `AddPrompt`, `StatsRequest`) carry a request number that their `Reply` echoes.

Nothing here imports torch: a worker process needs only this to talk to the engine.
"""

from __future__ import annotations

import asyncio
import struct

import msgspec

from model.config import FRAME_SAMPLES
from model.engine.api import EngineStats, SessionParams

# A worker's own metrics counters by kind (each a count by name), and its loop's latest stalls as (when, where).
WorkerCounterSet = dict[str, dict[str, int] | list[tuple[float, str]]]

HEADER = struct.Struct(">I")
FRAME_BYTES = FRAME_SAMPLES * 4  # one session's frame, float32, in a message's audio
MAX_MESSAGE_BYTES = 256 << 20  # a tick of 256 sessions is ~2 MB; anything near this is a broken peer


class ModelInfo(msgspec.Struct, frozen=True):
    """What the doors need to know of the loaded model (for /health, /v1/models, voices, the page)."""

    source: str
    device: str                  # where the engine runs, as torch names it ("cuda:0", "cpu")
    is_tiny: bool
    random_weights: bool
    voices: list[str]
    default_voice: str | None


# ---- worker -> engine -------------------------------------------------------------------------------------------

class Hello(msgspec.Struct, tag=True):
    worker: int
    pid: int


class Reserve(msgspec.Struct, tag=True):
    req: int
    timeout_s: float


class Start(msgspec.Struct, tag=True):
    req: int
    sid: str
    params: SessionParams  # the engine's own dataclasses cross as they are


class Restart(msgspec.Struct, tag=True):
    req: int
    sid: str


class AddPrompt(msgspec.Struct, tag=True):
    req: int
    sid: str
    text: str
    persona: str | None = None


class Close(msgspec.Struct, tag=True):
    sid: str


class Frames(msgspec.Struct, tag=True, kw_only=True):
    """Input frames, one per listed session: row k of `audio` (1920 float32 samples at 24 kHz) is session
    `sids[k]`'s; `deadline` is the tick they are meant for (time.monotonic(), 0 for input-clocked frames). `audio`
    is the message's tail (`encode`): each frame goes out as its session gave it, and the engine process reads the
    rows where they landed (a bytes object per frame, and a copy into the message, were ~0.6 ms a tick of 250 on
    the two ends, `bench.channel_cost`)."""

    sids: list[str]
    deadline: float = 0.0
    audio: memoryview  # float32 [len(sids), 1920]; last, as a tail must be


class StatsRequest(msgspec.Struct, tag=True):
    req: int


class WorkerCounters(msgspec.Struct, tag=True):
    """A worker's own metrics counters (sent now and then), so that any worker can serve the server's totals."""

    counters: WorkerCounterSet


# ---- engine -> worker -------------------------------------------------------------------------------------------

class Reply(msgspec.Struct, tag=True):
    req: int
    ok: bool
    sid: str = ""
    index: int = -1
    code: str = ""
    message: str = ""
    cause: str = ""
    stats: Stats | None = None  # a StatsRequest's answer


class Counters(msgspec.Struct):
    """A session's counts as its worker last heard them: after its id, the fields of a row of `Tick.counts`, which
    is a row of the engine's counts in slots.ROW_COUNTS' order."""

    sid: str
    frames_in: int
    frames_out: int
    underruns: int
    window_shrinks: int = 0
    window_frames: int = 0


class Tick(msgspec.Struct, tag=True, kw_only=True):
    """One realtime tick's outputs for one worker (or, with `next_tick_at` 0, an input-clocked step's), by column:
    session `sids[k]`'s frame `indices[k]` with text piece `texts[k]` is row k of `audio` and `tokens` (one block
    each, not a struct and two byte strings per session: the engine thread builds this message on every frame's
    path). Every realtime session's counts come too, by column as well: session `counted[k]`'s are row k of
    `counts`. `audio` is the message's tail (`encode`): its rows go out as the engine copied them from the tick, and
    a worker reads them where they landed."""

    next_tick_at: float
    sids: list[str]
    indices: list[int]
    texts: list[str]
    tokens: bytes  # int64 [len(sids), 17]
    counted: list[str]  # the sessions whose counts `counts` holds, in its row order
    counts: bytes  # int64 [len(counted), 5]: each row a session's Counters fields after its id
    late_frames: int = 0  # this worker's input frames that reached the engine after their tick, since the last Tick
    late_by_s: float = 0.0  # how far after its tick the latest of those came (0: none late)
    audio: memoryview  # float32 [len(sids), 1920]; last, as a tail must be


class Failed(msgspec.Struct, tag=True):
    sid: str
    code: str
    message: str
    cause: str


class WorkerInfo(msgspec.Struct, frozen=True):
    pid: int
    sessions: int
    counters: WorkerCounterSet  # the worker's own metrics counters, as it last sent them
    late_frames: int = 0  # input frames of this worker that reached the engine after their tick, in all


class Stats(msgspec.Struct, tag=True):
    """The engine's stats and every connected worker's: pushed to every worker twice a second."""

    engine: EngineStats
    workers: dict[str, WorkerInfo]  # by worker number
    next_tick_at: float


class Welcome(msgspec.Struct, tag=True):
    model: ModelInfo
    max_sessions: int
    engine_pid: int
    note: str
    stats: Stats


ToEngine = Hello | Reserve | Start | Restart | AddPrompt | Close | Frames | StatsRequest | WorkerCounters
ToWorker = Welcome | Reply | Tick | Failed | Stats

_encoder = msgspec.msgpack.Encoder()
BIN32 = struct.Struct(">BI")  # msgpack's bin 32 header: 0xc6, then the length of the bytes that follow


def tail(size: int) -> msgspec.Raw:
    """The value of a message's last field whose `size` bytes are the message's tail (`encode`): a msgpack bin
    header, which the tail's bytes complete."""
    return msgspec.Raw(BIN32.pack(0xC6, size))


def encode(message: msgspec.Struct, tail_bytes: int = 0) -> bytearray:
    """One framed message: length header and body, the body encoded in place after the header (joining the two
    copied a tick's 2 MB once more: 0.16-0.25 ms of 0.8-1.0 for a message of 250 outputs, caches cold, on a 2-core
    CPU, `bench.channel_cost`).

    With `tail_bytes`, the message's last field is `tail(tail_bytes)`, and the frame's last `tail_bytes` bytes are
    the caller's to write after it as they are: a tick's audio goes out from where the engine copied it, not
    copied once more into a joined block and again into the message (two of the tick's three copies of 2 MB on
    the engine thread). The frame is plain msgpack all the same."""
    framed = bytearray(HEADER.size)
    _encoder.encode_into(message, framed, HEADER.size)
    HEADER.pack_into(framed, 0, len(framed) - HEADER.size + tail_bytes)
    return framed


class MessageReader:
    """Reads framed messages of one union type from an asyncio stream."""

    def __init__(self, reader: asyncio.StreamReader, kind: type) -> None:
        self._reader = reader
        self._decoder = msgspec.msgpack.Decoder(kind)

    async def read(self) -> object | None:
        """The next message, or None at the end of the stream."""
        try:
            header = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(header)
            if size > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"a channel message of {size} bytes: the peer is broken")
            body = await self._reader.readexactly(size)
        except asyncio.IncompleteReadError:
            return None
        return self._decoder.decode(body)
