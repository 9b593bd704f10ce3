"""Streaming sample-rate conversion of mono float32 audio (libswresample through PyAV).

One `Resampler` per session and direction, fed chunk after chunk: the filter state carries across calls, so
chunk edges leave no artefacts, and output length tracks input length x out_rate / in_rate with a constant
held-back tail (about 0.7 ms at 48k<->24k, 2 ms at 8k<->24k) that only `flush()` releases. swr was chosen over
soxr for streaming because soxr emits in bursts (up to 150 ms held back at 8k->24k), and over stateless
per-chunk resampling, which gives only ~30 dB SNR at chunk edges (measurements: spec/webrtc.md section 6).
"""

from __future__ import annotations

import errno
import functools

import av
import numpy as np

_EMPTY = np.zeros(0, dtype=np.float32)


class MonoResampler:
    """PyAV's `AudioResampler` (abuffer -> aformat -> abuffersink, the same output) to float32 mono at `rate`, on a
    filter graph that starts no threads. FFmpeg gives every graph a pool of worker threads by default (3 on 2
    cores), which none of these filters uses; a session's graphs live until the garbage collector frees its
    call's reference cycles, so a worker kept ~100 idle threads after a soak."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._graph: av.filter.Graph | None = None

    def resample(self, frame: av.AudioFrame | None) -> list[av.AudioFrame]:
        """The converted frames that are ready; `None` flushes the tail."""
        if self._graph is None:
            if frame is None:
                return []
            self._graph = self._build(frame)
        self._graph.push(frame)
        out: list[av.AudioFrame] = []
        while True:
            try:
                out.append(self._graph.pull())
            except EOFError:
                return out
            except av.FFmpegError as exc:
                if exc.errno != errno.EAGAIN:
                    raise
                return out

    def _build(self, first: av.AudioFrame) -> av.filter.Graph:
        graph = av.filter.Graph()
        graph.threads = 1
        extra = {} if first.time_base is None else {"time_base": str(first.time_base)}
        source = graph.add("abuffer", sample_rate=str(first.sample_rate), sample_fmt=first.format.name,
                           channel_layout=first.layout.name, **extra)
        convert = graph.add("aformat", sample_rates=str(self.rate), sample_fmts="flt", channel_layouts="mono")
        sink = graph.add("abuffersink")
        source.link_to(convert)
        convert.link_to(sink)
        graph.configure()
        return graph


@functools.lru_cache(maxsize=64)
def _filter_delay_in(in_rate: int, out_rate: int) -> int:
    """The input samples whose output the filter holds back (its delay), as measured on a stream of silence."""
    probe = Resampler(in_rate, out_rate)
    probe.process(np.zeros(in_rate // 10, dtype=np.float32))
    return round(probe.held_back * in_rate / out_rate)


class Resampler:
    """`primed`: the stream starts with the filter's delay in silence (under 2 ms), so every chunk gives its full
    length from the first one on (1920 samples at 24 kHz -> 1280 at 16 kHz, not 1264 then 1280); for output that
    goes out in frames."""

    def __init__(self, in_rate: int, out_rate: int, *, primed: bool = False) -> None:
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = int(in_rate)
        self.out_rate = int(out_rate)
        self.primed = primed
        self._swr: MonoResampler | None = None
        self._lead = _EMPTY                  # what priming gave out: it goes before the first chunk's output
        self.samples_in = 0
        self.samples_out = 0
        self.reset()

    @property
    def held_back(self) -> float:
        """Output samples owed for the input so far (the resampler's current latency, in output samples)."""
        return self.samples_in * self.out_rate / self.in_rate - self.samples_out

    def process(self, samples: np.ndarray) -> np.ndarray:
        """Convert the next chunk (any length) of the stream; returns what is ready, float32 mono."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"resampler input must be 1-D mono, got shape {x.shape}")
        if x.size == 0:
            return _EMPTY
        self.samples_in += x.size
        if self._swr is None:
            self.samples_out += x.size
            return x.copy()
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x)[None, :], format="flt", layout="mono")
        frame.sample_rate = self.in_rate
        out = self._collect(self._swr.resample(frame))
        if self._lead.size:
            out, self._lead = np.concatenate([self._lead, out]), _EMPTY
        return out

    def flush(self) -> np.ndarray:
        """End of stream: return the held-back tail and start a fresh stream."""
        tail = _EMPTY if self._swr is None else self._collect(self._swr.resample(None))
        self.reset()
        return tail

    def reset(self) -> None:
        """Drop all state (and any held-back audio); the next chunk starts a new stream."""
        self.samples_in = 0
        self.samples_out = 0
        self._lead = _EMPTY
        if self.in_rate != self.out_rate:
            self._swr = MonoResampler(self.out_rate)
            if self.primed:
                self._lead = self.process(np.zeros(_filter_delay_in(self.in_rate, self.out_rate), np.float32))

    def _collect(self, frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return _EMPTY
        out = frames[0].to_ndarray()[0] if len(frames) == 1 else np.concatenate([f.to_ndarray()[0] for f in frames])
        self.samples_out += out.size
        return out.astype(np.float32, copy=False)
