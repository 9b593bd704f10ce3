"""The server as processes: one engine process that owns the GPU, and N worker processes that share the port.

`run(settings)` is `python -m app` with `--workers N` (N > 0). It binds the port (so that `--port 0` resolves once),
starts the engine process (model, engine, and the channel's Unix socket, model/engine/process.py) and the workers
(each an aiohttp server on its own SO_REUSEPORT socket of that port: the kernel spreads new connections over them;
each holds its own sockets, WebRTC peers, codecs, jitter buffers and playout, and reaches the engine through
model/engine/client.py). Then it watches them: a worker that dies is started again (its sessions' slots were freed
by the engine when its channel closed); an engine process that dies is reported by every worker's /health, its
sessions end with `engine_stopped`, and it is started again. SIGTERM or SIGINT stops the workers first (each tells
its clients `session.closed` and closes them), then the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import deque
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path

from app.settings import Settings

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"
MAX_RESTARTS = 5          # of one process within RESTART_WINDOW_S, before the server gives up
RESTART_WINDOW_S = 30.0


def port_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, so that every worker binds the same port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    if listen:
        sock.listen(1024)
        sock.setblocking(False)
    return sock


def _child_setup(settings: Settings, role: str) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT.format(role=role), force=True)
    # Ctrl-C reaches the whole process group: the supervisor alone decides the order of shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _until_sigterm(work: asyncio.Future) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, work.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await work


def engine_main(settings: Settings, path: str) -> None:
    """The engine process: load the model, start the engine, serve it on the channel until SIGTERM."""
    _child_setup(settings, "engine")
    from app.server import build_engine, load_for
    from model.engine.process import EngineHost

    model, note = load_for(settings)
    logger.info("%s", note)
    engine = build_engine(settings, model)
    engine.start()
    host = EngineHost(engine, model.info(), path, note)

    async def main() -> None:
        await _until_sigterm(asyncio.ensure_future(host.serve()))

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def worker_main(settings: Settings, path: str, worker: int) -> None:
    """A worker process: an aiohttp server on its own socket of the shared port, the engine over the channel."""
    _child_setup(settings, f"worker {worker}")
    from app.server import serve

    sock = port_socket(settings.host, settings.port, listen=True)

    async def main() -> None:
        await _until_sigterm(asyncio.ensure_future(serve(settings, sock=sock, engine_path=path, worker=worker)))

    asyncio.run(main())


class Supervisor:
    """Starts the engine process and the workers, restarts any that die, and stops them in order."""

    def __init__(self, settings: Settings) -> None:
        self._mp = multiprocessing.get_context("spawn")
        self._folder = Path(tempfile.mkdtemp(prefix="personaplex-"))
        self.path = str(self._folder / "engine.sock")
        self._port_holder = port_socket(settings.host, settings.port, listen=False)
        self.port = self._port_holder.getsockname()[1]
        self.settings = replace(settings, port=self.port)
        self.engine: BaseProcess | None = None
        self.workers: list[BaseProcess | None] = [None] * settings.workers
        self._restarts: dict[str, deque[float]] = {}
        self.stopping = threading.Event()

    def _start_engine(self) -> None:
        self.engine = self._mp.Process(target=engine_main, args=(self.settings, self.path),
                                       name="personaplex-engine", daemon=False)
        self.engine.start()

    def _start_worker(self, n: int) -> None:
        worker = self._mp.Process(target=worker_main, args=(self.settings, self.path, n),
                                  name=f"personaplex-worker-{n}", daemon=False)
        worker.start()
        self.workers[n] = worker

    def _may_restart(self, name: str) -> bool:
        times = self._restarts.setdefault(name, deque(maxlen=MAX_RESTARTS))
        now = time.monotonic()
        if len(times) == MAX_RESTARTS and now - times[0] < RESTART_WINDOW_S:
            return False
        times.append(now)
        return True

    def start(self) -> None:
        self._start_engine()
        for n in range(len(self.workers)):
            self._start_worker(n)
        logger.info("listening on http://%s:%d (%d worker processes, engine process %d)", self.settings.host,
                    self.port, len(self.workers), self.engine.pid if self.engine else 0)

    def watch(self) -> int:
        """Until stopped: restart what dies. Returns the exit status."""
        while not self.stopping.wait(0.1):
            if self.engine is not None and not self.engine.is_alive():
                logger.error("the engine process exited (%s); its sessions ended; starting it again",
                             self.engine.exitcode)
                if not self._may_restart("engine"):
                    logger.error("the engine process keeps failing: stopping the server")
                    return 1
                self._start_engine()
            for n, worker in enumerate(self.workers):
                if worker is not None and not worker.is_alive():
                    logger.error("worker %d (pid %d) exited (%s); its sessions' slots are free; starting it again",
                                 n, worker.pid, worker.exitcode)
                    if not self._may_restart(f"worker-{n}"):
                        logger.error("worker %d keeps failing: stopping the server", n)
                        return 1
                    self._start_worker(n)
        return 0

    def stop(self) -> None:
        """Workers first (each closes its sessions cleanly within the shutdown timeout), then the engine."""
        workers = [w for w in self.workers if w is not None and w.is_alive()]
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + 2.0
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
        if self.engine is not None and self.engine.is_alive():
            self.engine.terminate()
            self.engine.join(15.0)
            if self.engine.is_alive():
                self.engine.kill()
        self._port_holder.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def run(settings: Settings) -> int:
    """Serve with `settings.workers` worker processes until SIGTERM or SIGINT; the exit status."""
    supervisor = Supervisor(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.stopping.set())
    supervisor.start()
    try:
        return supervisor.watch()
    finally:
        supervisor.stop()
