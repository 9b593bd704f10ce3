"""media/pacing.py on a clock the test moves: the send grid (stalls, moves, slots) and the rules by which a door's
sends follow the engine's frames, for each door's rules, with the real playout buffer and resampler."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from media.pacing import PHONE_LINE, SIP_RTP, WEBRTC_TRACK, Pacer, PacingRules, SendGrid

FRAME_S = 0.080


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def frame(k: int) -> np.ndarray:
    """Engine frame k: 1920 samples of the value (k + 1) / 1000, so what is sent tells which frame it came from."""
    return np.full(1920, (k + 1) / 1000.0, np.float32)


async def drive(pacer: Pacer, clock: Clock, writes: list[float], until: float, stalls: dict[int, float] | None = None
                ) -> list[tuple[float, int, float]]:
    """Writes engine frames at the given times and makes every send when it is due, in time order, until `until`:
    each send's (time, slot, first sample). `stalls[i]`: send i is made that long after it was due (its loop
    stalled), the frames that came meanwhile written first."""
    sends: list[tuple[float, int, float]] = []
    pacer.grid.start(clock.t)
    k = 0
    while True:
        due = pacer.grid.due
        assert due is not None
        write_at = writes[k] if k < len(writes) else math.inf
        if min(due, write_at) > until:
            return sends
        if write_at <= due:
            clock.t = max(clock.t, write_at)
            pacer.write(frame(k))
            k += 1
        else:
            clock.t = max(clock.t, due + (stalls or {}).get(len(sends), 0.0))
            while k < len(writes) and writes[k] <= clock.t:
                pacer.write(frame(k))
                k += 1
            sending = asyncio.ensure_future(pacer.due())
            await asyncio.sleep(0)
            if not sending.done():
                # The send waits for a late frame (the rules' grace): the frame lands before the grace runs out, or
                # the send goes at its end; either way the clock moves to the send's new time.
                write_at = writes[k] if k < len(writes) else math.inf
                if write_at <= pacer.grid.due:
                    clock.t = max(clock.t, write_at)
                    pacer.write(frame(k))
                    k += 1
                clock.t = max(clock.t, pacer.grid.due)
            slot = await sending
            sends.append((clock.t, slot, float(pacer.read()[0])))


def ticks(first: float, n: int, shift: dict[int, float] | None = None) -> list[float]:
    """n engine ticks 80 ms apart from `first`; `shift` moves tick k and every later one."""
    out, extra = [], 0.0
    for k in range(n):
        extra += (shift or {}).get(k, 0.0)
        out.append(first + k * FRAME_S + extra)
    return out


def ms(values) -> list[float]:
    return [round(v * 1000.0, 3) for v in values]


# ---- the grid ---------------------------------------------------------------------------------------------------

async def test_the_grid_sends_every_period_and_skips_what_a_stall_missed_instead_of_bursting():
    clock = Clock()
    grid = SendGrid(0.020, clock)
    slots = []
    for _ in range(3):
        slots.append(await grid.wait())
        clock.t = grid.due
    clock.t += 0.105                                   # the loop was away: the next send is 105 ms overdue
    slots.append(await grid.wait())
    assert slots == [0, 1, 2, 8] and grid.missed == 5 and grid.stalls == 1 and grid.skipped == 5
    assert grid.due == pytest.approx(0.180)           # the next one is on the old phase, not a burst
    clock.t = grid.due - 0.001                         # 39 ms late is not a stall
    clock.t += 0.039
    assert await grid.wait() == 9 and grid.missed == 0 and grid.stalls == 1


async def test_a_move_retimes_the_send_waiting_now_and_skips_slots_only_when_asked():
    clock = Clock()
    grid = SendGrid(0.020, clock)
    grid.align(5.0)                                    # before the first send: nothing to move
    assert grid.moves == 0
    assert await grid.wait() == 0
    clock.t -= 5.0                                     # the next send is 5 s away now
    waiting = asyncio.ensure_future(grid.wait())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    grid.align(clock.t - 0.001)                        # its new time has passed: it leaves at once
    assert await asyncio.wait_for(waiting, 2.0) == 1
    grid.align(grid.due + 0.057, skip=True)            # a move 57 ms later skips the two whole slots it spans
    assert grid.slot == 4 and grid.skipped == 2
    grid.align(grid.due + 0.057)                       # without skip the slots stay continuous
    assert grid.slot == 4
    due = grid.due
    grid.advance(0.007)
    grid.advance(0.020)                                # a period or more is not an advance
    assert grid.due == pytest.approx(due - 0.007) and grid.moves == 4


# ---- following the engine's frames ------------------------------------------------------------------------------

async def test_sends_land_just_after_each_frame_and_every_frame_waits_the_hold():
    """SIP's rules: the first frame moves the next send to 2 ms after it; each frame then waits one packet (the
    previous frame's last) plus 2 ms, and the grid stays put."""
    clock = Clock()
    pacer = Pacer(24000, SIP_RTP, clock=clock)
    sends = await drive(pacer, clock, ticks(0.085, 40), until=3.3)
    assert pacer.grid.moves == 1
    assert any(t == pytest.approx(0.087) for t, _, _ in sends)
    assert set(ms(pacer.waits)) == {22.0}
    # Every frame's audio went out whole and in order, 20 ms per send, none shed.
    firsts = [round(v * 1000) for _, _, v in sends if v]
    assert firsts == [k + 1 for k in range(len(firsts) // 4) for _ in range(4)][: len(firsts)]
    assert pacer.shed_ms == 0.0


@pytest.mark.parametrize("rate", [8000, 16000, 48000])
async def test_a_frame_is_timed_from_its_own_first_sample_at_any_line_rate(rate: int):
    """The resampler to the line's rate gives out the previous frame's last 2 ms with each frame (its filter's delay):
    the frame's own audio starts after them, one send later, so it waits one packet plus 2 ms, as at 24 kHz."""
    clock = Clock()
    pacer = Pacer(rate, SIP_RTP, clock=clock)
    await drive(pacer, clock, ticks(0.085, 40), until=3.3)
    assert set(ms(pacer.waits)) == {22.0} and pacer.grid.moves == 1


@pytest.mark.parametrize("rate", [8000, 16000])
async def test_a_sip_frame_up_to_a_packet_late_goes_out_with_no_silence(rate: int):
    """The SIP sender holds one packet: a frame 3 to 21 ms late still comes before the send that needs it (the line's
    resampler is primed, so the packets do not wait for the next frame's first 2 ms, which made 3 ms an underrun)."""
    for late in (0.003, 0.012, 0.021):
        clock = Clock()
        pacer = Pacer(rate, SIP_RTP, clock=clock)
        sends = await drive(pacer, clock, ticks(0.085, 40, shift={20: late, 21: -late}), until=3.3)
        assert pacer.playout.stats().underruns == 0 and pacer.grid.moves == 1
        assert [t for t, _, first in sends if first == 0.0 and t > 0.1] == []      # the silence before frame 0 only
        assert ms(pacer.waits)[20] == pytest.approx(22.0 - late * 1000)


async def test_the_webrtc_track_holds_the_prebuffer_and_the_grid_comes_forward_to_it():
    clock = Clock()
    pacer = Pacer(24000, WEBRTC_TRACK, clock=clock)
    await drive(pacer, clock, ticks(0.085, 60), until=4.9)
    waits = ms(pacer.waits)
    assert waits[:24] == [22.0] * 24                  # before the first check, as aligned
    assert set(waits[30:]) == {12.0}                  # then the prebuffer (10 ms) plus 2 ms
    assert pacer.grid.moves == 2


@pytest.mark.parametrize("rules", [SIP_RTP, WEBRTC_TRACK], ids=["sip", "webrtc"])
async def test_when_the_ticks_come_earlier_the_grid_follows_them(rules: PacingRules):
    clock = Clock()
    pacer = Pacer(24000, rules, clock=clock)
    writes = ticks(0.085, 120, shift={60: -0.007})
    await drive(pacer, clock, writes, until=writes[-1] + 0.030)
    waits = ms(pacer.waits)
    steady = waits[59]
    assert waits[60:70] == [steady + 7.0] * 10       # the earlier frames wait 7 ms longer for their send
    assert waits[-20:] == [steady] * 20               # until the grid moved 7 ms earlier
    assert pacer.playout.stats().underruns == 0


@pytest.mark.parametrize("late", [0.025, 0.030, 0.041])
async def test_a_sip_frame_up_to_a_packet_later_than_the_hold_goes_out_late_not_as_silence(late: float):
    """From frame 10 on the ticks' outputs come `late` later (a busier engine and worker, as when many calls open at
    once): the send that finds the playout dry waits for the frame and leaves 2 ms after it lands, the grid with it,
    so no packet of silence goes out and the sends' slots stay continuous (before, one packet of silence went out
    and the playout's prebuffer grew by 20 ms)."""
    clock = Clock()
    pacer = Pacer(24000, SIP_RTP, clock=clock)
    sends = await drive(pacer, clock, ticks(0.085, 20, shift={10: late}), until=1.7)
    assert pacer.playout.stats().underruns == 0
    assert [t for t, _, first in sends if first == 0.0 and t > 0.1] == []       # the silence before frame 0 only
    assert [slot for _, slot, _ in sends] == list(range(len(sends)))
    lands = 0.085 + 10 * FRAME_S + late
    assert any(t == pytest.approx(lands + 0.002) and first == pytest.approx(0.011) for t, _, first in sends)
    assert ms(pacer.waits)[10:] == [2.0] * 10


async def test_a_frame_later_than_the_hold_and_the_grace_realigns_the_grid_after_the_playout_ran_dry():
    clock = Clock()
    pacer = Pacer(24000, SIP_RTP, clock=clock)
    await drive(pacer, clock, ticks(0.085, 20, shift={10: 0.050}), until=1.7)
    st = pacer.playout.stats()
    assert st.underruns == 1 and pacer.grid.moves == 3   # the first frame, the grace, the frame after the underrun
    assert ms(pacer.waits)[-5:] == [22.0 + 20.0] * 5  # the prebuffer grew by 20 ms after the underrun


@pytest.mark.parametrize(("rules", "shed"), [(SIP_RTP, True), (WEBRTC_TRACK, False)], ids=["sip", "webrtc"])
async def test_a_standing_backlog_is_shed_where_the_rules_say_so(rules: PacingRules, shed: bool):
    """A tick comes 80 ms late, its frame with the next one: the playout runs dry (the grid realigns), then 80 ms
    more stands before every later frame. SIP sheds it in whole packets; WebRTC leaves it to the playout buffer."""
    clock = Clock()
    pacer = Pacer(24000, rules, clock=clock)
    writes = ticks(0.085, 100)
    writes[30] = writes[31]
    await drive(pacer, clock, writes, until=writes[-1] + 0.030)
    waits = ms(pacer.waits)
    assert min(waits[35:55]) > 80.0
    if shed:
        assert pacer.shed_ms > 0.0 and pacer.shed_ms % 20.0 == 0.0 and waits[-10:] == [22.0] * 10
    else:
        assert pacer.shed_ms == 0.0 and min(waits[-10:]) > 80.0


@pytest.mark.parametrize(("rules", "dropped"), [(SIP_RTP, True), (WEBRTC_TRACK, False), (PHONE_LINE, True)],
                         ids=["sip", "webrtc", "phone"])
async def test_a_stall_skips_its_slots_and_drops_their_audio_where_the_rules_say_so(rules, dropped):
    clock = Clock()
    pacer = Pacer(24000, rules, clock=clock)
    sends = await drive(pacer, clock, ticks(0.005, 10), until=0.5)
    pacer.write(frame(10))                             # 160 ms queued (within the playout's bound)
    drained = pacer.playout.stats().drained_samples
    clock.t = pacer.grid.due + 0.101                   # 5 sends' time missed
    slot = await pacer.due()
    pacer.read()
    assert slot == sends[-1][1] + 1 + 5 and pacer.grid.stalls == 1
    assert pacer.playout.stats().drained_samples - drained == 480 * (6 if dropped else 1)


@pytest.mark.parametrize("rules", [SIP_RTP, PHONE_LINE], ids=["sip", "phone"])
async def test_a_lines_latency_stays_at_its_hold_through_its_workers_stalls(rules: PacingRules):
    """A worker whose loop stalls 60 ms now and then (at load on a contended H100, every worker's loop stalled 43-82
    ms) makes each stalled send skip the slots it missed. The line drops their audio and every later frame waits
    what it waited before: the caller hears the stall's gap and nothing more. A phone line used to keep that audio,
    so each stall stood behind every later frame as 60 ms more latency until the playout's bound shed 200 ms at once
    (21 of 29 Twilio calls in that run lost 220-500 ms so)."""
    clock = Clock()
    pacer = Pacer(8000, rules, clock=clock)
    writes = ticks(0.085, 190)  # 15 s
    stalled = (150, 300, 450, 600)  # sends 3, 6, 9 and 12 s in
    await drive(pacer, clock, writes, until=writes[-1] + 0.030, stalls=dict.fromkeys(stalled, 0.060))
    waits = ms(pacer.waits)
    assert pacer.grid.stalls == len(stalled)
    before = waits[30:35]
    assert max(before) <= 42.0 and all(max(waits[k:k + 5]) <= max(before) for k in (60, 100, 140, 180)), waits
    sent = pacer.sent()
    assert sent["out_shed_ms"] == pytest.approx(60.0 * len(stalled), abs=20.0) and sent["out_silence_ms"] == 0.0


async def test_a_cut_drops_the_audio_and_its_marks_and_the_next_frame_realigns():
    clock = Clock()
    marks: list[str] = []
    pacer = Pacer(24000, PHONE_LINE, clock=clock, on_mark=marks.append)
    await drive(pacer, clock, ticks(0.005, 5), until=0.3)
    pacer.mark("kept")                                 # its audio is still queued
    moves = pacer.grid.moves
    pacer.clear()
    pacer.mark("after")                                # nothing is queued: answered at once
    assert marks == ["after"]
    clock.t += 0.013
    pacer.write(frame(9))
    assert pacer.grid.moves == moves + 1 and pacer.grid.due == pytest.approx(clock.t + 0.002)


async def test_a_line_sends_on_its_own_and_answers_a_mark_once_its_audio_is_out():
    """The phone doors' loop, on the real clock: chunks go out every 20 ms from the first frame, and a mark placed
    after a frame is answered after the chunk that carries that frame's last sample."""
    sent: list[np.ndarray] = []
    marked = asyncio.Event()
    pacer = Pacer(8000, PHONE_LINE, on_mark=lambda name: marked.set())

    def send(chunk: np.ndarray) -> None:
        assert not marked.is_set()
        sent.append(chunk)

    pacer.start(send)
    pacer.write(frame(0))
    pacer.mark("end")
    try:
        await asyncio.wait_for(marked.wait(), 5.0)
    finally:
        pacer.stop()
    audio = np.concatenate(sent)
    assert all(c.size == 160 for c in sent) and np.count_nonzero(audio) >= 640 - 16   # the frame, less the filter's
    assert pacer.chunks_sent == len(sent)                                             # held-back tail


@pytest.mark.parametrize("rules", [SIP_RTP, WEBRTC_TRACK, PHONE_LINE], ids=["sip", "webrtc", "phone"])
async def test_the_silence_sent_while_a_frame_was_late_goes_in_the_calls_record(rules: PacingRules):
    """A tick 150 ms late: the door sends silence until its frame lands, and `sent()` (the call's record) counts
    every silent send between the model's first and last audio, and the audio sent."""
    clock = Clock()
    pacer = Pacer(24000, rules, clock=clock)
    writes = ticks(0.005, 30, shift={15: 0.150})
    sends = await drive(pacer, clock, writes, until=writes[-1] + 0.030)
    audible = [i for i, s in enumerate(sends) if s[2] != 0.0]
    silent = sum(1 for s in sends[audible[0]:audible[-1]] if s[2] == 0.0)
    sent = pacer.sent()
    assert silent >= 6 and sent["out_silence_ms"] == 20.0 * silent and sent["out_underruns"] == 1, (silent, sent)
    assert abs(sent["sent_s"] - 0.02 * len(audible)) <= 0.02 and sent["sent_s"] > 2.0, (len(audible), sent)


@pytest.mark.parametrize("late", [0.003, 0.030, 0.041])
async def test_a_phone_line_frame_late_past_its_shrunk_hold_goes_out_late_not_as_silence(late: float):
    """After 10 s with no underrun a phone line's playout takes 20 ms of its prebuffer back and the grid comes
    forward to it: each frame then waits 22 ms for its first send. A tick's output `late` later than that (on the
    H200 at 144 calls, 10 of 29 Twilio calls were sent 20-60 ms of silence at one instant 14 s in) leaves late instead
    of as a chunk of silence that also grows the prebuffer and moves what follows later still."""
    clock = Clock()
    pacer = Pacer(8000, PHONE_LINE, clock=clock)
    writes = ticks(0.085, 200, shift={190: late, 191: -late})
    sends = await drive(pacer, clock, writes, until=writes[-1] + 0.030)
    assert ms(pacer.waits)[180:190] == [22.0] * 10         # the hold had shrunk to 20 ms before the late tick
    assert pacer.playout.stats().underruns == 0 and pacer.sent()["out_silence_ms"] == 0.0
    assert [t for t, _, first in sends if first == 0.0 and t > 0.2] == []   # the primed filter's 2 ms lead first
    assert [slot for _, slot, _ in sends] == list(range(len(sends)))
