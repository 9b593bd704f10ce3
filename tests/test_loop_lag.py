"""A worker's collector report (app/shell/loop_lag.py): after the start-up freeze, each full collection is timed, so
that a stall of a worker's loop in a load run can be told from one."""

from __future__ import annotations

import gc

from app.shell import loop_lag


def test_a_full_collection_after_the_freeze_is_timed() -> None:
    loop_lag.freeze_startup_objects()
    try:
        before = loop_lag.collector_report()
        heap = [[i] for i in range(400_000)]  # what sessions made since the freeze: tracked, walked by a full one
        gc.collect()
        after = loop_lag.collector_report()
        assert after["full_collections"] > before["full_collections"]
        assert after["full_max_ms"] >= 1, (after, len(heap))
    finally:
        gc.callbacks.remove(loop_lag._time_full_collections)
        gc.unfreeze()
