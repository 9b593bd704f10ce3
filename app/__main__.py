"""`python -m app` / `personaplex-server`: parse flags and `PERSONAPLEX_*` variables, then serve until a signal.

With `--workers N` (N > 0; the default comes from the core count) the server runs as processes (app/processes.py):
one engine process and N workers sharing the port. `--workers 0` runs everything in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from app.settings import Settings, parse_settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def _run(settings: Settings) -> None:
    from app.server import serve

    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serve(settings)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    if settings.workers > 0:
        from app.processes import run

        sys.exit(run(settings))
    asyncio.run(_run(settings))


if __name__ == "__main__":
    main()
