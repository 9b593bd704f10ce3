"""How long a full garbage collection holds the GIL in a loaded server, before and after the engine's freeze.

    python -m bench.gc_pause [--model PATH]

Builds the app on a model (the tiny checkpoint by default) and times `gc.collect()` with the start-up objects
visible to the collector, then frozen out of its view (what `Engine.start()` does). Prints one JSON line. A
collection can start on any thread; while it runs, the tick thread cannot take the GIL back, so its time lands
on a tick.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time

from app.shell.server import create_app
from app.shell.settings import Settings
from model.loading import load_model
from model.tiny import write_tiny_checkpoint


def collect_ms(repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - started) * 1000.0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="checkpoint folder (default: a freshly written tiny checkpoint)")
    args = parser.parse_args()
    path = args.model or str(write_tiny_checkpoint(tempfile.mkdtemp()))
    model = load_model(path)
    server = create_app(Settings(model=path, max_sessions=4), model=model)
    objects = len(gc.get_objects())
    visible_ms = collect_ms()
    gc.freeze()
    frozen_ms = collect_ms()
    gc.unfreeze()
    print(json.dumps({"bench": "gc_pause", "model": args.model or "tiny", "routes": len(server.router.routes()),
                      "tracked_objects": objects, "full_collect_ms": round(visible_ms, 2),
                      "full_collect_after_freeze_ms": round(frozen_ms, 2)}))


if __name__ == "__main__":
    main()
