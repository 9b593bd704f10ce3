"""StagedInputs (model/engine/staging.py): a worker's input frames written into their sessions' input rows as they
arrive, each by the rules for it alone."""

from __future__ import annotations

import numpy as np

from model.config import FRAME_SAMPLES
from model.engine.staging import StagedInputs


def test_a_message_of_frames_stages_each_admitted_frame_in_its_own_row_and_only_those() -> None:
    rows = np.zeros((6, FRAME_SAMPLES), np.float32)
    inputs = StagedInputs(rows)
    assert inputs.offer([2], np.full((1, FRAME_SAMPLES), 9.0, np.float32), lambda k: True) == [True]
    frames = np.stack([np.full(FRAME_SAMPLES, k + 1.0, np.float32) for k in range(5)])
    frames[3, 7] = np.nan
    # Frame 1's row has a frame staged already, frame 3 is not finite, and frame 4's session may not stage.
    assert inputs.offer([4, 2, 0, 5, 1], frames, lambda k: k != 4) == [True, False, True, False, False]
    assert [float(row[0]) for row in rows] == [3.0, 0.0, 9.0, 0.0, 1.0, 0.0]
    assert all(np.all(row == row[0]) for row in rows) and inputs.staged == 3
    inputs.hold()  # a tick reads the rows: nothing is staged until its outputs land
    assert inputs.offer([3], frames[:1], lambda k: True) == [False] and not np.any(rows[3])
    assert inputs.take(np.arange(6)).tolist() == [True, False, True, False, True, False]
    assert not inputs.take(np.arange(6)).any()  # taken once
    inputs.release()
    assert inputs.offer([3, 0], frames[:2], lambda k: True) == [True, True]
    assert float(rows[3][0]) == 1.0 and float(rows[0][0]) == 2.0 and inputs.staged == 5
