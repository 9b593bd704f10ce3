"""Output pacing, one for every door: when each send of the model's audio leaves, and how the sends follow the engine.

The engine hands out one 80 ms frame per tick on its own clock; a door sends 20 ms (or another chunk) per period on
the wall clock: the WebRTC track's reads (media/tracks.py), the SIP sender's RTP packets, the phone lines' chunks.

`SendGrid` is the clock: a send every `period_s` from the first one; a send that comes a stall (40 ms) late skips the
slots it missed instead of catching up in a burst; `align(at)` puts the next send at `at` and `advance(s)` brings the
grid `s` earlier, both cutting short a wait in progress. `slot` numbers the sends, skipped ones included (a door's
timestamps).

`Pacer` is what a door writes the engine's frames into and takes its sends from: the frames (24 kHz, resampled to the
line's rate) queue in a `PlayoutBuffer`, and each send reads one chunk of it (silence when there is none). Its grid
follows the frames by one set of rules:
- the first frame written, the first after `clear()` (a cut) or a rate change, and the first after the playout ran
  dry put the next send `after_s` (2 ms) after that frame lands: it finds the frame, and each later frame waits only
  what the door holds (its hold) plus `after_s`;
- the tick's phase moves with the engine's load: every `repace_frames` frames (25, 2 s), when every one of the last
  25 waited longer than that by more than `tolerance_s` (3 ms), the grid is brought forward by the smallest excess;
  whole periods of it are a standing backlog (frames that came bunched after a late tick): shed where the door's
  rules say so, else left to the playout buffer's own bound;
- where the rules give a `late_grace_s`, a send that would find the playout dry while it plays waits up to that long
  for the frame that is due, and leaves `after_s` after it lands, the grid with it: the other end gets that packet
  late, which its jitter buffer absorbs, instead of a packet of silence and a grid moved later still by the
  playout's grown prebuffer. (On the H200 with 144 calls opening in 2 s, every SIP call opened in the first second
  sent one packet of silence: its frames came later than its hold as the load rose; with the grace, none did.)
What differs between doors is named in `PacingRules`, each door's choice beside it (`WEBRTC_TRACK`, `SIP_RTP`,
`PHONE_LINE`). Each frame's wait, from its write until the send that carries its first sample, is kept in `waits`:
the output side's added latency. `mark(name)` is answered once every sample written before it has been sent;
`clear()` drops the marks with the audio.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from media.playout import PlayoutBuffer, PlayoutConfig
from media.resample import Resampler

MODEL_RATE = 24000
STALL_S = 0.040          # a send this late skips the slots it missed instead of sending them in a burst
# A context's frame 0 comes straight after the prompt prefill, 0-80 ms behind the tick grid: playing it would leave
# that much standing latency for the rest of the call. It is the model's answer to the first 80 ms of the call, i.e.
# to nothing yet; the doors whose sends follow the tick closely (WebRTC, SIP) start playing at frame 1.
FIRST_PLAYED_FRAME = 1


@dataclass(frozen=True)
class PacingRules:
    """How a door's sends follow the engine's frames, where doors differ."""

    playout: PlayoutConfig = field(default_factory=PlayoutConfig)
    hold_s: float | None = None       # what a frame should wait for its first send, beyond after_s; None: the
                                      # playout's prebuffer now (it grows after underruns)
    shed_backlog: bool = False        # whole periods of excess wait are dropped from the playout (else left to it)
    drop_on_stall: bool = False       # the slots a stall skips take their audio with them (else it is sent late)
    skip_on_late_align: bool = False  # an align a period or more later skips those slots' timestamps (else the
                                      # sends just leave later, once, with continuous timestamps)
    after_s: float = 0.002            # where a send lands after the frame it should find
    primed: bool = False              # the line's resampler starts with its filter's delay in silence (see SIP_RTP)
    repace_frames: int = 25           # frames between checks of the grid's phase
    late_grace_s: float = 0.0         # how long a send that would run dry waits for the frame that is due
    tolerance_s: float = 0.003        # an excess wait below this is left alone


# The outbound WebRTC track: the browser's jitter buffer conceals a timestamp gap and keeps its delay, where a step in
# delay would stand in it as latency; its 10 ms prebuffer is the slack of a late tick (an underrun adds 20 ms).
WEBRTC_TRACK = PacingRules(playout=PlayoutConfig(start_prebuffer_ms=10.0, min_prebuffer_ms=10.0),
                           skip_on_late_align=True)
# SIP's RTP sender: each frame waits one packet (the previous frame's last) plus after_s; a backlog is shed and a
# stall drops its audio, so a phone's latency stays where it was; timestamps stay continuous across a move. Primed:
# else the first frame comes out of the 8/16 kHz resampler short by its filter's delay (2 ms), the packets fall on the
# frames' edges, and each frame's last packet waits for its last 2 ms, which come with the next frame: a frame more
# than 2 ms late (not a packet) left the caller 2 ms, then 40 ms of silence (the prebuffer, grown by the underrun).
# A frame up to a packet later still than the hold goes out late rather than as a packet of silence.
SIP_RTP = PacingRules(playout=PlayoutConfig(start_prebuffer_ms=10.0, min_prebuffer_ms=10.0), hold_s=0.020,
                      shed_backlog=True, drop_on_stall=True, primed=True, late_grace_s=0.020)
# The telephone bridges' WebSockets (Twilio, Telnyx, Vonage, FreeSWITCH, AudioSocket): the platform plays what comes as
# it comes, with little buffering of its own, so the playout holds the slack (40 ms to begin with). After 10 s with no
# underrun the hold is 20 ms, as tight as SIP's, so the same guards as SIP: primed (else a frame 3 ms late ran the
# line dry), a frame up to a chunk later than the hold goes out late, not as silence (on the H200 at 144 calls, 10 of
# 29 Twilio calls sent 20-60 ms of silence at one instant 14 s in), and a stall drops the audio of the sends it
# skipped: the caller hears the stall's gap either way, and kept, that audio stood behind every later frame as
# latency until the playout's bound shed 200 ms or more at once (at load on a contended H100, 21 of 29 Twilio calls
# lost 220-500 ms that way, their workers' loops stalling 43-82 ms: docs/benchmarks.md, the fifteenth far-caller run).
PHONE_LINE = PacingRules(primed=True, late_grace_s=0.020, drop_on_stall=True)


def _wake(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class SendGrid:
    """When each send leaves: every `period_s` on `clock`, from the first `wait()`."""

    def __init__(self, period_s: float, clock: Callable[[], float] = time.monotonic, stall_s: float = STALL_S) -> None:
        self.period_s = period_s
        self.stall_s = stall_s
        self._clock = clock
        self.slot = 0                        # the next send's number
        self.due: float | None = None        # the next send's time; None before the first
        self.started_at: float | None = None
        self.missed = 0                      # slots the last wait skipped for a stall
        self.stalls = 0                      # waits that came a stall late
        self.skipped = 0                     # slots skipped: by stalls, and by late aligns that skip
        self.moves = 0                       # aligns and advances
        self._sleeping: asyncio.Future[None] | None = None

    def start(self, at: float) -> None:
        """The first send is due at `at` (else at the first `wait()`)."""
        if self.due is None:
            self.due = self.started_at = at

    async def until_due(self) -> None:
        """Until the next send is due, without taking its slot (nothing before the first)."""
        while self.due is not None and (delay := self.due - self._clock()) > 0:
            await self._sleep(delay)

    async def wait(self) -> int:
        """Until the next send is due; its slot. The first is due at once; one that comes a stall late skips the
        slots it missed (`missed`) and is due at once."""
        now = self._clock()
        self.missed = 0
        if self.due is None:
            self.due = self.started_at = now
        elif now - self.due >= self.stall_s:
            self.missed = int((now - self.due) / self.period_s)
            self._skip(self.missed)
            self.stalls += 1
        while (delay := self.due - self._clock()) > 0:
            await self._sleep(delay)
        slot = self.slot
        self.slot += 1
        self.due += self.period_s
        return slot

    def align(self, at: float, *, skip: bool = False) -> None:
        """The next send leaves at `at` (the one waiting now, if any, is re-timed), and the grid with it. With `skip`,
        a move a period or more later skips the whole slots it spans. Nothing before the first send."""
        if self.due is None:
            return
        if skip and at > self.due:
            self._skip(int((at - self.due) / self.period_s))
        self.due = at
        self.moves += 1
        _wake(self._sleeping)

    def advance(self, seconds: float) -> None:
        """Bring the grid `seconds` (under a period) earlier; the sends' slots stay continuous."""
        if self.due is None or not 0.0 < seconds < self.period_s:
            return
        self.due -= seconds
        self.moves += 1
        _wake(self._sleeping)

    def _skip(self, slots: int) -> None:
        self.slot += slots
        self.skipped += slots
        assert self.due is not None
        self.due += slots * self.period_s

    async def _sleep(self, seconds: float) -> None:
        """asyncio.sleep that `align()` and `advance()` cut short."""
        loop = asyncio.get_running_loop()
        self._sleeping = loop.create_future()
        timer = loop.call_later(seconds, _wake, self._sleeping)
        try:
            await self._sleeping
        finally:
            timer.cancel()
            self._sleeping = None


class Pacer:
    """The engine's frames in, one chunk per period out, on a grid that follows the frames (see the module's rules)."""

    def __init__(self, rate: int, rules: PacingRules, *, chunk_ms: int = 20,
                 clock: Callable[[], float] = time.monotonic, on_mark: Callable[[str], None] | None = None) -> None:
        self.rules = rules
        self.period_s = chunk_ms / 1000.0
        self.grid = SendGrid(self.period_s, clock)
        self._clock = clock
        self._on_mark = on_mark
        self.waits: deque[float] = deque(maxlen=2000)    # seconds, per frame: from its write to its first send
        self.shed_ms = 0.0                               # standing backlog dropped
        self.chunks_sent = 0                             # sends made by `run`
        self._task: asyncio.Task[None] | None = None
        self.set_rate(rate)

    def set_rate(self, rate: int) -> None:
        """A new line rate (a SIP re-INVITE's codec): a fresh resampler and playout; the next frame re-aligns."""
        self.rate = rate
        self.chunk = round(rate * self.period_s)
        self.resampler = Resampler(MODEL_RATE, rate, primed=self.rules.primed)
        self.playout = PlayoutBuffer(rate, self.rules.playout)
        self.marks: deque[tuple[int, str]] = deque()     # (playout position, name)
        self._pending: deque[tuple[int, float]] = deque()  # frames not sent yet: (first sample's position, written at)
        self._restart = True
        self._underruns_seen = 0
        self._paced = 0
        self._graced = False                             # a send is waiting for a late frame

    # ---- in: the engine's frames -----------------------------------------------------------------------------

    def write(self, audio: np.ndarray) -> None:
        """One engine frame (24 kHz float32); the grid follows it."""
        now = self._clock()
        owed = round(self.resampler.held_back)    # the earlier frames' tail the resampler gives out first
        samples = self.resampler.process(audio)
        before = self.playout.stats()
        self._follow(before.underruns, before.prebuffer_ms / 1000.0, now)
        if self.playout.write(samples):
            self._pending.append((before.written_samples + owed, now))
        if self._graced:
            self._graced = False
            self.grid.align(now + self.rules.after_s)

    def _follow(self, underruns: int, prebuffer_s: float, now: float) -> None:
        rules = self.rules
        if self._restart or underruns != self._underruns_seen:
            self.grid.align(now + rules.after_s, skip=rules.skip_on_late_align)
            self._restart = False
            self._underruns_seen = underruns
            self._paced = 0
            return
        self._paced += 1
        if self._paced < rules.repace_frames or len(self.waits) < rules.repace_frames:
            return
        self._paced = 0
        hold = prebuffer_s if rules.hold_s is None else rules.hold_s
        excess = min(list(self.waits)[-rules.repace_frames:]) - hold - rules.after_s
        whole = max(0, int(excess / self.period_s))
        if whole:
            if not rules.shed_backlog:
                return
            self.playout.read(whole * self.chunk)
            self.shed_ms += whole * self.period_s * 1000.0
            excess -= whole * self.period_s
        if excess > rules.tolerance_s:
            self.grid.advance(excess)

    def sent(self) -> dict[str, float | int]:
        """What the other end has been sent, for a call's record: `sent_s` of the model's audio, and the silence
        sent where the model's next frame was due and had not come (the engine behind real time): `out_silence_ms`
        in `out_underruns` spells, each moving what follows that much later; `out_shed_ms` of a standing backlog
        dropped, and of the sends a stall skipped where the rules drop their audio. Since the line's last rate change
        (a SIP re-INVITE)."""
        st = self.playout.stats()
        return {"sent_s": round(st.drained_samples / self.rate, 2), "out_silence_ms": round(st.underrun_ms, 1),
                "out_underruns": st.underruns, "out_shed_ms": round(self.shed_ms + st.shed_ms, 1)}

    def mark(self, name: str) -> None:
        self.marks.append((self.playout.stats().written_samples, name))
        self._answer_marks()

    def clear(self) -> None:
        """A cut: the audio not sent yet goes, with its marks (never answered); the next frame re-aligns the grid."""
        self.playout.clear()
        self.marks.clear()
        self._pending.clear()
        self._restart = True

    # ---- out: the sends --------------------------------------------------------------------------------------

    async def due(self) -> int:
        """Until the next send is due; its slot (a stall's skipped slots drop their audio where the rules say so; a
        send that would run dry waits the rules' grace for the frame that is due)."""
        if self.rules.late_grace_s:
            await self.grid.until_due()
            if self.grid.due is not None and self.playout.runs_dry(self.chunk):
                self._graced = True
                self.grid.align(self.grid.due + self.rules.late_grace_s)
        slot = await self.grid.wait()
        self._graced = False
        if self.rules.drop_on_stall and self.grid.missed:
            drained = self.playout.stats().drained_samples
            self.playout.read(self.grid.missed * self.chunk)
            self.shed_ms += (self.playout.stats().drained_samples - drained) / self.rate * 1000.0
        return slot

    def read(self, n: int | None = None) -> np.ndarray:
        """The send's audio: one chunk (or `n` samples) at the line's rate; times the frames it starts."""
        out = self.playout.read(self.chunk if n is None else n)
        if self._pending:
            drained = self.playout.stats().drained_samples
            now = self._clock()
            while self._pending and self._pending[0][0] < drained:
                self.waits.append(now - self._pending.popleft()[1])
        return out

    def start(self, send: Callable[[np.ndarray], None]) -> None:
        """Send each chunk with `send` on the grid from now on (the doors with no timestamps of their own); again is
        a no-op."""
        if self._task is None:
            self.grid.start(self._clock())
            self._task = asyncio.get_running_loop().create_task(self._run(send))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, send: Callable[[np.ndarray], None]) -> None:
        while True:
            await self.due()
            send(self.read())
            self.chunks_sent += 1
            self._answer_marks()

    def _answer_marks(self) -> None:
        drained = self.playout.stats().drained_samples
        while self.marks and self.marks[0][0] <= drained:
            _, name = self.marks.popleft()
            if self._on_mark is not None:
                self._on_mark(name)
