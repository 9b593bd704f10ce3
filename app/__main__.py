"""`python -m app` / `personaplex-server`: parse flags and `PERSONAPLEX_*` variables, then serve until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence

from app.server import serve
from app.settings import parse_settings


async def _run(argv: Sequence[str] | None) -> None:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main = asyncio.current_task()
    assert main is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, main.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await serve(settings)


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(_run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
