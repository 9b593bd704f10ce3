"""`python -m app` / `personaplex-server`: parse flags and `PERSONAPLEX_*` variables, then serve until a signal.

With `--workers N` (N > 0; the default comes from the core count) the server runs as processes (app/shell/processes.py):
one engine process and N workers sharing the port. `--workers 0` runs everything in this process. Either way the
first SIGTERM drains (no new sessions, live ones run up to `--drain-timeout-s`), then every session is closed
(`session.closed`, 1001) and the server exits 0; a second SIGTERM, or SIGINT, closes at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.shell.model_choice import ModelUnavailable, check_strict
from app.shell.processes import engine_devices, port_in_use, run, setup_logging
from app.shell.settings import Settings, parse_settings
from model.engine import KVCacheTooSmall

if TYPE_CHECKING:
    from app.shell.context import ServerContext

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def _run(settings: Settings) -> None:
    """One process: the first SIGTERM drains (app/shell/server.py `drain`), a second one or SIGINT closes at once."""
    from app.shell.server import drain, serve

    loop = asyncio.get_running_loop()
    term, hurry = asyncio.Event(), asyncio.Event()

    def on_term() -> None:
        (hurry if term.is_set() else term).set()

    for sig, handler in ((signal.SIGTERM, on_term), (signal.SIGINT, hurry.set)):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, handler)

    async def until_signalled(ctx: ServerContext) -> None:
        waits = [asyncio.ensure_future(term.wait()), asyncio.ensure_future(hurry.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if not hurry.is_set():
            await drain(ctx, hurry)

    await serve(settings, until=until_signalled)


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
    if settings.strict_model:
        check_strict(settings.model, engine_devices(settings))
    setup_logging(settings, LOG_FORMAT)
    try:
        if settings.workers > 0:
            sys.exit(run(settings))
        asyncio.run(_run(settings))
    except (ModelUnavailable, KVCacheTooSmall) as e:  # a load --strict-model refused, a KV cache too small: in one line
        raise SystemExit(str(e)) from None
    except OSError as e:            # a port another process holds (a second server, most often): in one line
        if e.errno != errno.EADDRINUSE:
            raise
        raise SystemExit(port_in_use(e)) from None


if __name__ == "__main__":
    main()
