"""Per-session input jitter buffer: client audio at 24 kHz in, one 1920-sample (80 ms) frame out per engine tick.

Audio is placed on a timeline of sample positions (`pts`, in 24 kHz samples), so late and reordered packets land
where they belong and lost ones leave a gap that is read out as silence (concealment); the timeline is never
shortened by loss (a forward pts jump longer than the buffer is taken as a discontinuity and spliced out
instead). WebRTC passes the sender's pts; WebSocket and telephony appends pass `pts=None` ("right after
the last pushed sample"). `push` runs on the asyncio thread and `read_frame` on the engine thread; a lock guards
the ring, and the splicing work of a read happens outside it. Both take `now` from one clock (`time.monotonic()`).

Realtime sessions (the default) are read every 80 ms whatever arrived. Why these numbers (spec/webrtc.md s.5):
- The engine takes 80 ms at once while the network delivers ~20 ms at a time, so the level is a sawtooth. The
  buffer waits for `target = 1 frame + margin` before reading (primed), starting with a 40 ms margin (~120 ms).
- The margin is the 95th percentile of the measured arrival delay: for each packet, how much later its last
  sample arrived than the fastest packet's did (transit-time variation; the packet length is not counted, since
  a frame is complete once its last packet is in), from a histogram in 2 ms bins that forgets with a ~5 s
  memory. Many late packets raise it within a few hundred ms (fast rise); it takes ~10 s of calm to fall (slow
  decay). Packets that arrive bunched (closer together than a quarter of the audio they carry: a queue releasing
  what it held) count once, at the first, the one that waited longest, so a stalled link's burst is one late
  episode and lifts the margin for well under a second. The delay base may creep up 15 ms per second, so a
  sender clock up to 1.5 % slow reads as drift, not jitter. Clamped to 10..160 ms: on a clean link a frame is
  read within a few ms of its last sample's arrival.
- What a read keeps is judged in time, on the packet that completes each frame, not on the level: the level also
  counts packets that happened to come early, so where the reads fell on the packet grid decided the latency (on
  the far link, bench.jitter_phase: 20-75 ms added, the worst phases at the link's jitter p95 + 20). The buffer
  marks where each push ends and knows, from the delay base, when each packet was due by the fastest path. A
  read may move the frame's end (cut) only up to the end of the newest buffered packet that was due `margin +
  cover` ago: that distance is the excess. Ends move packet to packet, so at any read phase every frame's last
  packet gets that slack within a packet (far link: 20-60 ms added, median 40, and 6 underruns where there were
  20). The cover: the margin leaves the slowest 5 % of packets out, so on a jittery link the read keeps the
  margin's excess over its floor again, up to a packet (20 ms); and while a gap was read out within the last 10 s
  (the link loses packets), a whole packet, so a frame whose last packet is lost is completed by the next one
  instead of running dry. On a steady link there is no cover: a frame goes 10-30 ms after its last packet came.
  Where pushes are longer than a frame (a WebSocket client's 250 ms appends), the one a read ends on must have
  been due that much longer ago, or the next read would need the next push before it can come.
- Underrun (a primed read finds less than a frame): `read_frame` returns None (the engine feeds silence and
  counts it), the read position stays, so nothing the client sent is lost; the buffer re-primes and its margin
  rises by 20 ms, falling back by 20 ms per 5 s without an underrun. When no margin would have helped, the step
  is taken back as the buffer re-primes: the audio due when it ran dry never came while later audio did (lost: it
  is concealed), or the dry spell was longer than the largest margin, or the link was silent longer than the
  largest margin and a frame, which no margin covers at any read phase (a stalled link; a WebSocket client's TCP
  holding everything behind a lost segment for a round trip and more: kept, each step stood as latency for every
  frame of a far call, 20 ms more a retransmission, and the next one still ran it dry). Nor is a step kept that
  would not alone have covered the silence at every read phase: one longer than what the dry read waited (margin,
  cover, a push) and a step is a spike, which the jitter histogram's p95 judges, not the step. A shorter TCP
  retransmission (~210 ms at a 150 ms round trip, ~140 at 80) ran the buffer dry at every phase; the reads that fell
  near its end kept their steps, which stacked up to 60-100 ms on every frame while the next one still ran it dry
  (`bench.jitter_phase --tcp`, 6 seeds x 8 phases: added p50 median 140 -> 60 ms at 150 ms, 120 -> 60 at 80, where
  the link's jitter p95 is 149 and 79; 1.6-2x the dry reads, each after a retransmission). An underrun whose step
  is taken back leaves the steps' decay running.
- A stalled link delivers what it held at once: when the buffer re-primes more than a frame above its target it
  catches up (so does a first read that finds audio long waiting: a call's media flows from the answer and its
  first tick comes later, and a hard cut there took the talker's first 280-380 ms of sound): silence goes as in
  the gentle path below but judged on the current excess, and after two reads with no silence to cut, sound goes
  in two pitch cuts a read (see acceleration below; at most 25 ms per 80 ms read, ~30 % fast) until the level is
  back within a window of the target (a lost stretch just read has no packet end to cut to: the excess comes back
  a read later): a 400 ms stall drains in under 2 s with no hard cut.
- Latency is bounded from above by cutting the excess, in whole 10 ms windows joined by a 5 ms raised-cosine
  crossfade. Gently: when the lowest excess over the last 5 reads (400 ms, a whole cycle of 20/40/80/100 ms
  packets) is a window or more, up to 80 ms per read of windows the client sent as silence (below -50 dBFS,
  crossfade region included; never concealed gaps) are dropped, so clock drift and post-stall backlogs drain
  without cutting speech or shortening the timeline for loss.
  Reads that stopped for a few frames while the audio kept coming (a worker busy at load, whose frames reach the
  engine late) leave an excess above 160 ms (two frames of headroom): up to 320 ms (what catching up drains in about a
  second) what costs no sound (gaps, a short jump of the sender's timeline, silence) is cut at once and the rest is
  caught up as after a stall, where a cut at once took 160-230 ms of sound from 19 of 28 SIP calls in one H200 run.
  Hard: a larger excess, unless catching up, is cut at once, the quietest windows first (an engine that stopped
  reading while audio kept coming). A push beyond the 500 ms hard cap drops the oldest audio at once.
- Continuous sound never offers silence (a talker who starts before the first frame, background noise above
  -50 dBFS), so a backlog built while the session started would stay for the whole call. When there has been an
  excess for a second and a read finds no silence to cut, that read accelerates instead (as a phone's jitter
  buffer does): one pitch-synchronous cut, 2.5 to 12.5 ms long, where the audio after the cut best continues the
  audio before it, so voiced sound keeps its period across the crossfade. A cut never passes the packet end the
  excess reaches and never stops short of it by less than the shortest cut, so frames' ends come back onto packet
  ends (an excess under a window, which no silence window fits, goes this way too; a remainder no cut could take
  kept up to a packet more for the rest of the call). At most one cut per 80 ms read, so speech runs at most ~15 %
  fast while the backlog drains; catching up, of the lengths that join within 0.05 of the best correlation the
  longest is taken (a 400 ms stall under continuous sound: back within 20 ms of its latency before in 2 s at 190 of
  192 stalls over 6 seeds x 8 read phases, 162 when the best-joining length was taken however short).
- `trace()` keeps each realtime read's time and the latency it added (the depth it left: how long the newest
  sample of the frame it handed out had waited), None for a read that handed out nothing; stats count the most
  sound one read cut and the hard cuts.
Input-clocked sessions (`realtime=False`, offline evaluation) read a frame as soon as one is complete, never
drop, and refuse a push that would exceed the backlog bound with `BufferFull` (nothing is stored then).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24000
FRAME = 1920
_BIN_MS = 2.0
_CATCH_UP_WAIT_READS = 2
_HURRY_SLACK = 0.05  # correlation a catch-up cut may give up for length


class BufferFull(Exception):
    """An input-clocked buffer is at its backlog bound; the push was refused and nothing was stored."""


@dataclass(frozen=True)
class JitterConfig:
    sample_rate: int = SAMPLE_RATE
    frame: int = FRAME
    prime_margin_ms: float = 40.0
    min_margin_ms: float = 10.0
    max_margin_ms: float = 160.0
    underrun_step_ms: float = 20.0
    quiet_period_s: float = 5.0
    jitter_quantile: float = 0.95
    jitter_memory_s: float = 5.0
    drift_tolerance: float = 0.015
    cover_ms: float = 20.0      # the most slack kept beyond the margin: one packet (see the module docstring)
    loss_memory_s: float = 10.0  # how long a gap read out keeps the whole cover
    headroom_ms: float = 160.0
    catch_up_max_ms: float = 320.0   # an excess above the headroom up to this is caught up, not cut at once
    hard_cap_ms: float = 500.0
    level_window_reads: int = 5
    soft_drop_ms: float = 80.0
    drop_window_ms: float = 10.0
    silence_dbfs: float = -50.0
    backlog_s: float = 30.0
    accelerate_after_s: float | None = 1.0  # None: never accelerate (e.g. music, where tempo matters)
    accelerate_min_ms: float = 2.5
    accelerate_max_ms: float = 12.5
    trace_reads: int = 4096     # realtime reads kept in `trace()` (5.5 minutes)


@dataclass(frozen=True)
class JitterStats:
    depth_ms: float
    target_ms: float
    jitter_ms: float
    underruns: int
    late_drops: int
    overrun_drops_ms: float
    concealed_ms: float
    frames_out: int
    pushed_ms: float
    sound_cut_max_ms: float     # the most non-silent audio one read removed (acceleration's step, or a hard cut)
    hard_cuts: int              # reads that cut the level back to the target at once (not counting a cut of only
                                # gaps and silence)


@dataclass(frozen=True)
class ReadRecord:
    """One realtime read: when, and the input latency the buffer added to the frame it handed out (the depth left
    after it: how long that frame's newest sample had waited), or None when it handed out none (priming, underrun)."""

    at: float
    added_ms: float | None


class JitterBuffer:
    def __init__(self, realtime: bool = True, config: JitterConfig | None = None) -> None:
        cfg = config or JitterConfig()
        self.realtime = realtime
        self.config = cfg
        per_ms = cfg.sample_rate / 1000.0
        self._frame = cfg.frame
        self._window = round(cfg.drop_window_ms * per_ms)
        self._fade = self._window // 2
        if self._window < 2 or self._frame % self._window:
            raise ValueError("drop_window_ms must split the frame into whole windows of at least 2 samples")
        self._capacity = round(cfg.hard_cap_ms * per_ms) if realtime else round(cfg.backlog_s * cfg.sample_rate)
        if self._capacity < 2 * self._frame:
            raise ValueError("the buffer must hold at least two frames")
        self._headroom = round(cfg.headroom_ms * per_ms)
        self._catch_up_max = round(cfg.catch_up_max_ms * per_ms)
        self._cover = round(cfg.cover_ms * per_ms)
        self._loss_memory_reads = max(1, round(cfg.loss_memory_s * cfg.sample_rate / self._frame))
        self._soft_drop = round(cfg.soft_drop_ms * per_ms)
        self._silence_energy = 10 ** (cfg.silence_dbfs / 10) * (self._window + self._fade)
        self._quiet_reads = max(1, round(cfg.quiet_period_s * cfg.sample_rate / self._frame))
        self._accelerate_reads = (math.inf if cfg.accelerate_after_s is None
                                  else max(1, math.ceil(cfg.accelerate_after_s * cfg.sample_rate / self._frame)))
        self._accelerate_min = max(1, round(cfg.accelerate_min_ms * per_ms))
        self._accelerate_max = round(cfg.accelerate_max_ms * per_ms)
        if not self._accelerate_min <= self._accelerate_max <= round(cfg.min_margin_ms * per_ms) + self._window:
            raise ValueError("accelerate cuts must fit in the excess that triggers them (min margin + a window)")
        ramp = np.sin(0.5 * np.pi * (np.arange(self._fade) + 0.5) / self._fade) ** 2
        self._fade_in = ramp.astype(np.float32)
        self._fade_out = (1.0 - ramp).astype(np.float32)
        self._forget = 1.0 - 0.02 / cfg.jitter_memory_s  # per 20 ms of audio observed
        self._hist = np.zeros(math.ceil(cfg.hard_cap_ms / _BIN_MS), dtype=np.float64)
        self._measured: float | None = None  # the histogram's quantile, while it stands

        self._lock = threading.Lock()
        self._data = np.zeros(self._capacity, dtype=np.float32)
        self._have = np.zeros(self._capacity, dtype=bool)
        self._edge = np.zeros(self._capacity, dtype=bool)  # the last sample of a push: where a packet ends
        self._read: int | None = None  # timeline position of the next sample out; None until audio arrives
        self._end = 0  # one past the furthest sample pushed
        self._next = 0  # one past the last push: where a pts=None append goes
        self._shift = 0  # added to pts after the sender's timeline jumped
        self._primed = False
        self._ever_primed = False
        self._boost_ms = 0.0
        self._reads_since_underrun = 0
        self._quiet_before_dry = 0  # the quiet reads counted when the last underrun came
        self._excess_reads = 0
        self._reads_since_loss = self._loss_memory_reads  # reads since one handed out a gap (none yet)
        self._push_len = 0  # the last push's length
        self._dry_reads = 0  # reads that found the buffer dry since the last underrun
        self._dry_from = 0  # the timeline's end when it ran dry
        self._dry_covered_s = 0.0  # the longest silence a read waited out when it ran dry (margin, cover, a push)
        self._silent_s = 0.0  # the longest the link went without an arrival since the last underrun
        self._catch_up = False  # draining what a stalled link delivered at once (see _reprimed)
        self._excesses: deque[int] = deque(maxlen=cfg.level_window_reads)
        self._base: float | None = None  # smallest (arrival time - pts time of a packet's end) seen, drifting up
        self._last_arrival = 0.0
        self._observed_s = 0.0
        self._underruns = 0
        self._late_drops = 0
        self._dropped = 0  # samples removed from the timeline by overrun handling
        self._concealed = 0
        self._frames_out = 0
        self._pushed = 0
        self._sound_cut_max = 0
        self._hard_cuts = 0
        self._trace: deque[ReadRecord] = deque(maxlen=cfg.trace_reads)

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        """Place mono float32 24 kHz audio at `pts` (None: right after the previous push)."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise ValueError(f"jitter buffer input must be 1-D mono, got shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("jitter buffer input contains NaN or infinity")
        if pts is not None and (isinstance(pts, bool) or not isinstance(pts, (int, np.integer))):
            raise ValueError(f"pts must be an integer sample position or None, got {pts!r}")
        if x.size == 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._read is None:
                self._read = self._end = self._next = 0 if pts is None else int(pts)
            shift = self._shift
            pos = max(self._next, self._read) if pts is None else int(pts) + shift
            if pos > self._end and pos + x.size - self._end > self._capacity:
                # The sender's timeline jumped further than the buffer holds (a muted sender, DTX): a
                # discontinuity, not loss to conceal. Splice it on after what is buffered. (A short gap while the
                # buffer stands full is loss: the oldest audio is shed for it below, counted.)
                shift += self._end - pos
                pos = self._end
            end = pos + x.size
            late = pos < self._read
            if late:
                x, pos = x[max(0, self._read - pos) :], max(pos, self._read)
            if end - self._read > self._capacity:
                if not self.realtime:
                    ms = 1000.0 / self.config.sample_rate
                    raise BufferFull(
                        f"input backlog full: {(self._end - self._read) * ms:.0f} ms buffered, this append needs "
                        f"{(end - self._end) * ms:.0f} ms more, bound {self._capacity * ms:.0f} ms"
                    )
                self._drop_oldest(end - self._capacity)
                if x.size > self._capacity:
                    x, pos = x[-self._capacity :], end - self._capacity
            self._shift = shift
            self._late_drops += late
            if x.size == 0:
                return
            fresh = self._write(pos, x)
            self._edge[(end - 1) % self._capacity] = True
            self._pushed += x.size
            self._end = max(self._end, end)
            self._next = end
            self._push_len = end - pos
            if self.realtime and fresh:
                self._observe_arrival(pos, end, now)

    def read_frame(self, now: float | None = None) -> np.ndarray | None:
        """The next 1920 samples for this tick, or None when not primed or underrun (the engine feeds silence). `now`
        must come from the clock the pushes' `now` came from (both default to `time.monotonic()`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._read is None:
                return None
            level = self._end - self._read
            cuts: list[tuple[int, int]] = []
            if self.realtime:
                target = self._target()
                if not self._primed:
                    if level < target:
                        self._underruns += self._ever_primed
                        self._dry_reads += self._ever_primed
                        self._record(now, None)
                        return None
                    self._reprimed(level, target)
                elif level < self._frame:
                    self._underrun()
                    self._record(now, None)
                    return None
                data, have = self._plan_cuts(level, target, cuts, now)
            else:
                if level < self._frame:
                    return None
                data, have = self._copy(self._read, self._frame)
            span = self._frame + sum(b - a for a, b in cuts)
            keep = np.ones(span, dtype=bool)
            for a, b in cuts:
                keep[a:b] = False
            self._release(self._read, span)
            self._read += span
            self._dropped += span - self._frame
            gap = int(np.count_nonzero(~have[:span] & keep))
            self._concealed += gap
            self._reads_since_loss = 0 if gap else self._reads_since_loss + 1
            self._frames_out += 1
            if cuts:
                sound = sum(self._windows_of_sound(data[a:b]) for a, b in cuts)
                self._sound_cut_max = max(self._sound_cut_max, sound)
            if self.realtime:
                self._record(now, (self._end - self._read) * 1000.0 / self.config.sample_rate)
        return self._splice(data[:span], cuts)

    def trace(self) -> list[ReadRecord]:
        """The recent realtime reads, oldest first."""
        with self._lock:
            return list(self._trace)

    def added_ms(self, last: int) -> tuple[float, float] | None:
        """The added latency's median and 95th percentile over the last `last` reads that handed out a frame."""
        with self._lock:
            values = [r.added_ms for r in list(self._trace)[-last:] if r.added_ms is not None]
        if not values:
            return None
        p50, p95 = np.percentile(values, [50, 95])
        return float(p50), float(p95)

    def frames_ready(self) -> int:
        """Whole frames `read_frame` would hand out now, without waiting for more audio."""
        with self._lock:
            if self._read is None:
                return 0
            level = self._end - self._read
            if self.realtime and not self._primed and level < self._target():
                return 0
            return level // self._frame

    def clear(self) -> None:
        """Forget all buffered audio and the timeline; the next push starts a new one. Counters are kept."""
        with self._lock:
            self._data[:] = 0.0
            self._have[:] = False
            self._edge[:] = False
            self._read = None
            self._end = self._next = self._shift = 0
            self._primed = self._ever_primed = self._catch_up = False
            self._excesses.clear()
            self._base = None

    def stats(self) -> JitterStats:
        with self._lock:
            ms = 1000.0 / self.config.sample_rate
            depth = 0 if self._read is None else self._end - self._read
            return JitterStats(
                depth_ms=depth * ms,
                target_ms=self._target() * ms,
                jitter_ms=self._jitter_ms(),
                underruns=self._underruns,
                late_drops=self._late_drops,
                overrun_drops_ms=self._dropped * ms,
                concealed_ms=self._concealed * ms,
                frames_out=self._frames_out,
                pushed_ms=self._pushed * ms,
                sound_cut_max_ms=self._sound_cut_max * ms,
                hard_cuts=self._hard_cuts,
            )

    # -- timing (caller holds the lock) --

    def _observe_arrival(self, start: int, end: int, now: float) -> None:
        rate = self.config.sample_rate
        transit_end = now - end / rate
        if self._base is None:
            self._base = transit_end
        else:
            creep = self.config.drift_tolerance * max(0.0, now - self._last_arrival)
            self._base = min(transit_end, self._base + creep)
        gap = now - self._last_arrival
        self._last_arrival = now
        self._silent_s = max(self._silent_s, gap)
        delay = transit_end - self._base
        if delay * 1000.0 >= self.config.hard_cap_ms:
            # A pause in an append stream or a pts jump, not network jitter: re-anchor the timing.
            self._base = transit_end
            return
        weight = (end - start) / (0.02 * rate)
        self._hist *= self._forget**weight
        self._measured = None
        self._observed_s += (end - start) / rate
        if gap < 0.25 * (end - start) / rate:
            # Part of a burst: a queue releasing what it held (a stalled link, a bunch behind one slow packet) is
            # one late episode, already counted at its first packet, the one that waited longest. Counted packet by
            # packet, a 400 ms stall's twenty packets would be 8 % of the memory and lift the margin to the stall.
            return
        self._hist[int(delay * 1000.0 / _BIN_MS)] += weight

    def _measured_ms(self) -> float:
        """The arrival delay's quantile in the histogram, 0 before any arrival (kept until the histogram changes)."""
        if self._measured is None:
            cdf = np.cumsum(self._hist)
            self._measured = (0.0 if cdf[-1] <= 0.0 else
                              (int(np.searchsorted(cdf, self.config.jitter_quantile * cdf[-1])) + 1) * _BIN_MS)
        return self._measured

    def _jitter_ms(self) -> float:
        measured = self._measured_ms()
        if measured == 0.0:
            return self.config.prime_margin_ms
        # Trust a low measurement only after a second of arrivals; start with the priming margin.
        return measured if self._observed_s >= 1.0 else max(measured, self.config.prime_margin_ms)

    def _target(self) -> int:
        cfg = self.config
        margin = min(max(self._jitter_ms() + self._boost_ms, cfg.min_margin_ms), cfg.max_margin_ms)
        return self._frame + round(margin * cfg.sample_rate / 1000.0)

    def _cover_samples(self) -> int:
        """The slack kept beyond the margin: a whole packet while a gap was read out within the loss memory, else the
        measured jitter's excess over the floor margin, up to a packet (see the module docstring)."""
        if self._reads_since_loss < self._loss_memory_reads:
            return self._cover
        spread_ms = self._measured_ms() - self.config.min_margin_ms
        return min(self._cover, max(0, round(spread_ms * self.config.sample_rate / 1000.0)))

    def _excess(self, now: float, target: int) -> int:
        """How far this read may move the frame's end, in samples: to the end of the newest buffered packet that was
        due (by the fastest path seen, the delay base) a margin and a cover ago; 0 when none is."""
        if self._base is None or self._read is None:
            return 0
        frame_end = self._read + self._frame
        due = math.floor((now - self._base) * self.config.sample_rate) - (target - self._frame) - self._cover_samples()
        due -= max(0, self._push_len - self._frame)     # the next read needs the next push: due a push later
        ends = np.flatnonzero(self._edges(frame_end, min(due, self._end) - frame_end))
        return int(ends[-1]) + 1 if ends.size else 0

    def _underrun(self) -> None:
        self._underruns += 1
        waited = self._target() - self._frame + self._cover_samples() + self._push_len
        self._dry_covered_s = waited / self.config.sample_rate
        self._primed = self._catch_up = False
        self._boost_ms = min(self._boost_ms + self.config.underrun_step_ms, self.config.max_margin_ms)
        self._quiet_before_dry = self._reads_since_underrun
        self._reads_since_underrun = 0
        self._dry_reads = 0
        self._silent_s = 0.0  # the silence that ran it dry ends at the next arrival, which measures it whole
        assert self._read is not None
        self._dry_from = self._end
        self._excesses.clear()

    def _reprimed(self, level: int, target: int) -> None:
        """Enough audio to play (the first time, or again). The underrun's margin step is taken back when no margin
        would have helped: the audio that was due when the buffer ran dry never came while later audio did (it was
        lost: it is concealed, and waiting longer would not have brought it), or the dry spell was longer than the
        largest margin, or the link was silent longer than that and a frame (a stalled link). What a stalled link
        then delivered at once, like what came long before a first read, drains by catching up (`_plan_cuts`) rather
        than by a hard cut of sound."""
        if self._ever_primed:
            max_margin = self.config.max_margin_ms * self.config.sample_rate / 1000.0
            long_dry = (self._dry_reads * self._frame > max_margin
                        or self._silent_s * self.config.sample_rate > self._frame + max_margin)
            lost = not self._copy(self._dry_from, 1)[1][0]
            beyond_a_step = self._silent_s > self._dry_covered_s + self.config.underrun_step_ms / 1000.0
            if long_dry or lost or beyond_a_step:
                self._boost_ms = max(0.0, self._boost_ms - self.config.underrun_step_ms)
                self._reads_since_underrun = self._quiet_before_dry
        # A burst (not the packet that ended a short dry spell), or the first read long after the first audio (a
        # call's media flows from the answer, its first tick comes later): caught up, not cut.
        self._catch_up = level - target >= self._frame
        self._primed = self._ever_primed = True

    def _record(self, now: float, added_ms: float | None) -> None:
        self._trace.append(ReadRecord(now, added_ms))

    # -- overrun (caller holds the lock) --

    def _windows_of_sound(self, cut: np.ndarray) -> int:
        """Samples of a cut that are not silence (judged per drop window, as the gentle path judges them)."""
        w = self._window
        n = -(-cut.size // w)
        energy = np.square(np.pad(cut, (0, n * w - cut.size)), dtype=np.float64).reshape(n, w).sum(axis=1)
        sizes = np.minimum(w, cut.size - np.arange(n) * w)
        return int(sizes[energy >= 10 ** (self.config.silence_dbfs / 10) * sizes].sum())

    def _plan_cuts(self, level: int, target: int, cuts: list[tuple[int, int]],
                   now: float) -> tuple[np.ndarray, np.ndarray]:
        """Pick the sample ranges of the span read now to cut (sorted, disjoint); returns the span's data and mask."""
        self._reads_since_underrun += 1
        if self._reads_since_underrun >= self._quiet_reads and self._boost_ms > 0.0:
            self._boost_ms = max(0.0, self._boost_ms - self.config.underrun_step_ms)
            self._reads_since_underrun = 0
        excess = self._excess(now, target)
        self._excesses.append(excess + self._dropped)
        # Reads that stopped for a few frames: what costs no sound (gaps, a short jump of the sender's timeline, and
        # silence) is cut at once, the rest drains as a stalled link's burst does, from the next read on.
        quiet_only = not self._catch_up and self._headroom < excess <= self._catch_up_max
        catch_up = self._catch_up = self._catch_up and level - target >= self._window
        hard = excess > self._headroom and not catch_up
        if quiet_only:
            self._catch_up = True
        if hard:
            self._hard_cuts += not quiet_only
            budget = excess
        elif catch_up:
            budget = min(excess, self._soft_drop)
        elif len(self._excesses) == self._excesses.maxlen:
            budget = min(min(self._excesses) - self._dropped, self._soft_drop)
        else:
            budget = 0
        # Less than a window can only go by acceleration: what keeps a frame's end on a packet's end.
        self._excess_reads = self._excess_reads + 1 if budget >= self._accelerate_min else 0
        n = max(0, budget // self._window)
        data, have = self._copy(self._read, self._frame + n * self._window)
        if budget < self._accelerate_min:
            return data, have
        windows: list[int] = []
        if n:
            # Window i covers [i*W, (i+1)*W) plus the crossfade region just before it (blocks 2i-1..2i+1 of
            # W/2 samples); window 0 is never cut, its crossfade region was already played.
            blocks = np.square(data, dtype=np.float64).reshape(-1, self._fade).sum(axis=1)
            energy = blocks[1:-2:2] + blocks[2:-1:2] + blocks[3::2]
            if hard and not quiet_only:
                windows = sorted(int(i) + 1 for i in np.argsort(energy, kind="stable")[:n])
            else:
                quiet = energy < self._silence_energy
                if not hard:
                    # Gently, cut only silence the client actually sent: concealed gaps keep the timeline.
                    present = have.reshape(-1, self._fade).all(axis=1)
                    quiet &= present[1:-2:2] & present[2:-1:2] & present[3::2]
                for i in np.flatnonzero(quiet) + 1:
                    if len(windows) == n or i > self._frame // self._window + len(windows):
                        break
                    windows.append(int(i))
        if not hard:
            # Catching up after a stall, sound is cut after two reads without silence to cut, not a second, and in
            # two cuts a read (one per half frame: each joins its own stretch of sound) while the backlog holds them.
            wait = self._accelerate_reads
            if catch_up and wait != math.inf:
                wait = _CATCH_UP_WAIT_READS
            if not windows and self._excess_reads >= wait:
                longest = min(self._accelerate_max, budget)      # never past the packet end the excess reaches
                k = 2 if catch_up and budget >= 2 * self._accelerate_max else 1
                data, have = self._copy(self._read, self._frame + k * longest)
                if have.all():
                    half = self._frame // k
                    cuts.append(self._pitch_cut(data, 0, half, budget, catch_up))
                    start = max(half, cuts[-1][1])            # the second starts past the first's end
                    if k == 2 and start + 2 * self._fade <= self._frame:
                        reach = budget - (cuts[-1][1] - cuts[-1][0])
                        cuts.append(self._pitch_cut(data, start, self._frame, reach, catch_up))
                return data, have
        for i in windows:
            if cuts and cuts[-1][1] == i * self._window:
                cuts[-1] = (cuts[-1][0], (i + 1) * self._window)   # adjacent windows form one cut
            else:
                cuts.append((i * self._window, (i + 1) * self._window))
        return data, have

    def _pitch_cut(self, data: np.ndarray, first: int, last: int, reach: int, hurry: bool) -> tuple[int, int]:
        """The cut [a, a + L) whose crossfade joins the most alike audio: the crossfade blends the `fade` samples
        before `a` with the `fade` samples before `a + L`, so the best L is the one (near a pitch period, or a
        multiple) where those two stretches correlate most. L is at most the longest step and at most `reach` (the
        distance to the packet end the excess reaches), and never leaves less than the shortest step short of that
        end: what is left must be cuttable, or the frames' ends would stay off the packet grid, a packet's worth of
        latency kept for good. `hurry` (catching up): of the lengths that join almost as well as the best, the
        longest, so a backlog drains in fewer cuts. A few positions from `first` + fade to before `last` are tried,
        quarter frames apart (at least the first)."""
        f, lo, hi = self._fade, self._accelerate_min, min(self._accelerate_max, reach)
        lengths = np.arange(lo, hi + 1)
        allowed = (lengths <= reach - lo) | (lengths == reach)     # never empty: reach >= lo, max >= 2 lo
        best, cut = -np.inf, (first + f, first + f + int(lengths[np.flatnonzero(allowed)[0]]))
        for a in range(first + f, max(first + f + 1, min(last, self._frame - f + 1)), self._frame // 4):
            before = data[a - f : a]
            after = np.lib.stride_tricks.sliding_window_view(data[a - f + lo : a + hi], f)  # row j: L = lo + j
            norms = np.sqrt(np.einsum("ij,ij->i", after, after) * float(before @ before)) + 1e-12
            corr = np.where(allowed, (after @ before) / norms, -np.inf)
            j = int(np.argmax(corr))
            if hurry:
                j = int(np.flatnonzero(corr >= corr[j] - _HURRY_SLACK)[-1])
            if corr[j] > best:
                best, cut = float(corr[j]), (a, a + lo + j)
        return cut

    def _drop_oldest(self, new_read: int) -> None:
        assert self._read is not None
        self._dropped += max(0, min(new_read, self._end) - self._read)
        self._release(self._read, min(new_read - self._read, self._capacity))
        self._read = new_read
        self._next = max(self._next, new_read)

    # -- ring storage (caller holds the lock) --

    def _slices(self, pos: int, n: int) -> list[tuple[slice, slice]]:
        i = pos % self._capacity
        first = min(n, self._capacity - i)
        parts = [(slice(i, i + first), slice(0, first))]
        if first < n:
            parts.append((slice(0, n - first), slice(first, n)))
        return parts

    def _write(self, pos: int, x: np.ndarray) -> int:
        fresh = 0
        for ring, src in self._slices(pos, x.size):
            empty = ~self._have[ring]
            fresh += int(np.count_nonzero(empty))
            np.copyto(self._data[ring], x[src], where=empty)
            self._have[ring] = True
        return fresh

    def _gather(self, ring: np.ndarray, pos: int, n: int) -> np.ndarray:
        """`n` samples (none when `n` <= 0) of one of the ring's arrays from timeline position `pos`."""
        out = np.empty(max(0, n), dtype=ring.dtype)
        for src, dst in self._slices(pos, out.size):
            out[dst] = ring[src]
        return out

    def _copy(self, pos: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._gather(self._data, pos, n), self._gather(self._have, pos, n)

    def _edges(self, pos: int, n: int) -> np.ndarray:
        """Which of the `n` samples from `pos` end a push (none when `n` <= 0)."""
        return self._gather(self._edge, pos, n)

    def _release(self, pos: int, n: int) -> None:
        for ring, _ in self._slices(pos, n):
            self._data[ring] = 0.0
            self._have[ring] = False
            self._edge[ring] = False

    def _splice(self, data: np.ndarray, cuts: list[tuple[int, int]]) -> np.ndarray:
        """Cut the given sample ranges out of `data`, crossfading across each cut."""
        if not cuts:
            return data
        f = self._fade
        pieces = []
        kept_from = 0
        for a, b in cuts:
            head = data[kept_from:a].copy()
            head[-f:] = head[-f:] * self._fade_out + data[b - f : b] * self._fade_in
            pieces.append(head)
            kept_from = b
        pieces.append(data[kept_from:])
        return np.concatenate(pieces)
