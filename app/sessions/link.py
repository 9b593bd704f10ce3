"""What the server measures of a client's link, for the dialects that report it: `session.link` every
`link_report_s` seconds (the input buffer's arrival jitter, target, depth, the latency it added over the period,
underruns, concealment, drops, and `playout_ms`, the playout buffer the client's own player needs to play the model's
audio without gaps over this link), and the shared part of `session.closed.stats`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from app.sessions.conversation import Conversation
from app.sessions.errors import ProtocolError
from app.sessions.session import Session
from media.jitter import FRAME, SAMPLE_RATE
from media.playout import advised_playout_ms
from model.engine import EngineStats

LINK_REPORT_S = (0.5, 60.0)


def link_report_s(value: object, param: str) -> float:
    """A `link_report_s` setting: 0 (off) or a period in LINK_REPORT_S."""
    value = value or 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (value and not LINK_REPORT_S[0] <= value <= LINK_REPORT_S[1]):
        raise ProtocolError("invalid_session_config", f"`link_report_s` must be 0 (off) or {LINK_REPORT_S[0]:g} to "
                            f"{LINK_REPORT_S[1]:g} seconds", param=param)
    return float(value)


def input_report(conv: Conversation, period_s: float | None = None) -> dict[str, Any] | None:
    """The input side of the link (the added latency over the last `period_s`, by default the whole call as far as
    the buffer's trace reaches: 5.5 minutes), or None before there is a buffer."""
    jb = conv.input
    if jb is None:
        return None
    st = jb.stats()
    reads = jb.config.trace_reads if period_s is None else max(1, round(period_s * SAMPLE_RATE / FRAME))
    added = jb.added_ms(reads)
    return {"jitter_ms": round(st.jitter_ms, 1), "target_ms": round(st.target_ms, 1), "depth_ms": round(st.depth_ms, 1),
            "added_ms": None if added is None else {"p50": round(added[0], 1), "p95": round(added[1], 1)},
            "underruns": st.underruns, "concealed_ms": round(st.concealed_ms, 1), "late_drops": st.late_drops,
            "overrun_drops_ms": round(st.overrun_drops_ms, 1), "sound_cut_max_ms": round(st.sound_cut_max_ms, 1),
            "hard_cuts": st.hard_cuts}


def link_event(session_id: str, conv: Conversation | None, engine: EngineStats | None,
               period_s: float) -> dict[str, Any] | None:
    """`session.link`, or None before the conversation has an input buffer."""
    report = None if conv is None or engine is None else input_report(conv, period_s)
    if report is None:
        return None
    return {"type": "session.link", "session_id": session_id, "input": report,
            "playout_ms": advised_playout_ms(report["jitter_ms"], engine.tick_ms_p99 - engine.tick_ms_p50)}


def closed_stats(conv: Conversation | None, frames_sent: int) -> dict[str, Any]:
    """`session.closed.stats`, as every dialect that says it gives them."""
    if conv is None:
        return {}
    stats: dict[str, Any] = {**conv.counters(), "frames_sent": frames_sent, "epoch": conv.epoch,
                             "backpressure_refusals": conv.backpressure_refusals}
    link = input_report(conv)
    if link is not None:
        stats |= {"input_ms": round(conv.input.stats().pushed_ms, 1), "concealed_ms": link["concealed_ms"],
                  "input_jitter_ms": link["jitter_ms"], "input_target_ms": link["target_ms"],
                  "input_sound_cut_max_ms": link["sound_cut_max_ms"], "input_hard_cuts": link["hard_cuts"]}
        if link["added_ms"] is not None:
            stats |= {"input_added_ms_p50": link["added_ms"]["p50"], "input_added_ms_p95": link["added_ms"]["p95"]}
    return stats


async def report_link(session: Session, session_id: str, period_s: Callable[[], float]) -> None:
    """Send `session.link` every `period_s()` seconds until the session closes or the period becomes 0."""
    while not session.closed and period_s():
        period = period_s()
        await asyncio.sleep(period)
        engine = session.ctx.engine
        event = link_event(session_id, session.conversation, engine.stats() if engine is not None else None, period)
        if event is not None and not session.closed:
            session.send_nowait(event)
