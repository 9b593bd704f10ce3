"""The slot table's state machine per session: reserved -> prefill -> live -> closed / failed, and restarts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.engine.api import ResourceExhausted, SessionParams
from model.engine.slots import MOVES, SlotTable

STATES = tuple(MOVES)
ROOT = Path(__file__).resolve().parents[1]


def test_a_session_goes_from_reserved_through_prefill_to_live_and_closed():
    table = SlotTable(2)
    session = table.reserve()
    assert session.state == "reserved" and table.in_use() == 1 and table.holds(session)
    assert not table.move(session, "live")  # no session goes live without its prompt
    assert table.move(session, "prefill") and table.move(session, "live")
    assert session.live and table.live(offline=False) == (session,) and table.live(offline=True) == ()
    assert table.move(session, "prefill")  # a restart
    assert table.live(offline=False) == ()
    assert table.move(session, "live") and table.move(session, "closed")
    assert not table.holds(session) and table.in_use() == 0


def test_the_live_sessions_follow_every_move_by_pacing_and_in_row_order():
    """live() is kept between moves (the engine asks for it several times a tick): each move shows at once."""
    table = SlotTable(4)
    sessions = [table.reserve() for _ in range(4)]
    for session, pacing in zip(sessions, ["realtime", "input", "realtime", "realtime"], strict=True):
        session.params = SessionParams(pacing=pacing)
    for session in reversed(sessions):
        assert table.live(offline=False) == tuple(s for s in sessions if s.live and not s.offline)
        assert table.move(session, "prefill") and table.move(session, "live")
    assert table.live(offline=False) == (sessions[0], sessions[2], sessions[3])
    assert table.live(offline=True) == (sessions[1],)
    assert table.move(sessions[2], "prefill")  # a restart leaves the live sessions until it is live again
    assert table.live(offline=False) == (sessions[0], sessions[3])
    assert table.move(sessions[2], "live") and table.move(sessions[0], "failed") and table.move(sessions[1], "closed")
    assert table.live(offline=False) == (sessions[2], sessions[3]) and table.live(offline=True) == ()
    again = table.reserve()  # row 0 again, not live until its prompt ran
    assert again.index == 0 and table.live(offline=False) == (sessions[2], sessions[3])
    again.params = SessionParams(pacing="realtime")
    assert table.move(again, "prefill") and table.move(again, "live")
    assert table.live(offline=False) == (again, sessions[2], sessions[3])


def test_the_output_order_puts_each_groups_sessions_together_and_keeps_them_so_when_some_are_not_handed():
    """A tick gathers its outputs once in the plan's output order: each output group's sessions side by side, then
    those of their own; when some rows are not handed (a session that went live mid-step, one that failed), the
    others keep their order and each group's bounds follow."""
    table = SlotTable(6)
    sessions = [table.reserve() for _ in range(6)]
    for session, group in zip(sessions, [7, None, 3, 7, None, 3], strict=True):
        session.params, session.output_group = SessionParams(), group
        assert table.move(session, "prefill") and table.move(session, "live")
    out = table.realtime().out
    assert out.keys == [7, 3] and out.starts.tolist() == [0, 2, 4]
    assert out.rows.tolist() == [0, 3, 2, 5, 1, 4] and out.members == tuple(sessions[k] for k in (0, 3, 2, 5, 1, 4))
    assert out.ids == [sessions[k].id for k in (0, 3, 2, 5, 1, 4)]
    assert out.handed(np.ones(6, dtype=bool)) is out

    handed = np.ones(6, dtype=bool)
    handed[[3, 2, 5]] = False  # group 3 loses both its rows, group 7 one of its two
    part = out.handed(handed)
    assert part.rows.tolist() == [0, 1, 4] and part.members == (sessions[0], sessions[1], sessions[4])
    assert part.keys == [7, 3] and part.starts.tolist() == [0, 1, 1]  # group 3's part is empty
    assert part.ids == [sessions[k].id for k in (0, 1, 4)]
    # A tick's outputs came back gathered in the whole order: each handed row is found where it was gathered.
    gathered = out.rows * 10  # a row's output, tagged by its row
    assert out.positions_in(out.rows) is None
    assert gathered[part.positions_in(out.rows)].tolist() == [0, 10, 40]

    assert table.move(sessions[0], "closed")  # a move builds the order again (groups by their first row)
    moved = table.realtime().out
    assert moved.keys == [3, 7] and moved.rows.tolist() == [2, 5, 3, 1, 4] and moved.starts.tolist() == [0, 2, 3]
    assert moved.positions_in(out.rows).tolist() == [2, 3, 1, 4, 5]  # a plan that moved while a step was in flight


@pytest.mark.parametrize("ended", ["closed", "failed"])
def test_an_ended_session_leaves_its_row_and_never_comes_back(ended):
    table = SlotTable(1)
    session = table.reserve()
    assert table.move(session, "prefill") and table.move(session, "live") and table.move(session, ended)
    assert table.in_use() == 0 and not table.holds(session)
    assert not any(table.move(session, state) for state in ("reserved", "prefill", "live", "failed"))
    assert session.state == ended
    again = table.reserve()  # the row is free for the next session
    assert again.index == session.index and again.id != session.id and again.state == "reserved"


def test_a_failed_session_can_still_be_closed_once():
    table = SlotTable(1)
    session = table.reserve()
    assert table.move(session, "failed") and table.move(session, "closed")
    assert not table.move(session, "closed") and not table.move(session, "failed")
    assert session.state == "closed"


def test_a_closed_session_does_not_free_the_row_of_the_next_one():
    table = SlotTable(1)
    first = table.reserve()
    assert table.move(first, "closed")
    second = table.reserve()
    table.move(first, "failed")  # refused: `first` ended already
    assert table.holds(second) and table.in_use() == 1


def test_every_refused_move_changes_nothing():
    table = SlotTable(len(STATES) ** 2)
    for state in STATES:
        for target in STATES:
            session = table.reserve()
            path = {"reserved": [], "prefill": ["prefill"], "live": ["prefill", "live"], "failed": ["failed"],
                    "closed": ["closed"]}[state]
            assert all(table.move(session, step) for step in path) and session.state == state
            held = table.holds(session)
            assert table.move(session, target) == (target in MOVES[state])
            if target not in MOVES[state]:
                assert session.state == state and table.holds(session) == held


def test_a_full_table_refuses_with_its_limit():
    table = SlotTable(2)
    table.reserve(), table.reserve()
    with pytest.raises(ResourceExhausted, match="limit=2"):
        table.reserve()


def test_the_api_and_the_slot_handle_import_no_torch():
    """Worker processes import them without the model."""
    code = "import sys, model.engine, model.engine.api, model.engine.slots; assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
