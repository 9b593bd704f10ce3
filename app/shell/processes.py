"""The server as processes: one engine process per GPU, and N worker processes that share the port.

`run(settings)` is `python -m app` with `--workers N` (N > 0). It binds the port (so that `--port 0` resolves once),
starts the engine processes (one per `--gpus` device, else one on `--device`: model, engine, and the channel's Unix
socket, model/engine/process.py) and the workers (each an aiohttp server on its own SO_REUSEPORT socket of that
port: the kernel spreads new connections over them; each holds its own sockets, WebRTC peers, codecs, jitter buffers
and playout, and reaches every engine through model/engine/pool.py, which places each new session; with the SIP door
and two workers or more, worker 0 holds the door alone and not the port: `sip_alone`). Then it watches
them: a worker that dies is started again (its sessions' slots were freed by the engines when its channels closed);
an engine process that dies is reported by every worker's /health, its sessions (only its own) end with
`engine_stopped`, the workers keep placing sessions on the other engines, and it is started again.
The first SIGTERM drains: every worker stops admitting (a flag they watch), the supervisor waits until the engine
holds no session, up to `--drain-timeout-s`, restarting no worker meanwhile. Then, or on a second SIGTERM or on
SIGINT, it stops the workers first (each tells its clients `session.closed` and closes them within the shutdown
timeout), then the engine. The supervisor alone listens on `--agent-port` (app/shell/probes.py): it answers `drain`
while draining, else from a worker's `/health/ready` on the shared port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import replace
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

from app.shell.probes import agent_answer
from app.shell.settings import Settings, split_csv

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"
EXIT_MODEL_UNAVAILABLE = 3   # an engine process's when it cannot serve the model as configured (--strict-model
                             # refused it, or the KV cache holds no context): not restarted
EXIT_PORT_IN_USE = 4         # a worker's when a door's port is another process's (the SIP door's): not restarted
MAX_RESTARTS = 5          # of one process within RESTART_WINDOW_S, before the server gives up
RESTART_WINDOW_S = 30.0
DRAIN_POLL_S = 0.2        # how often a draining supervisor asks whether sessions are left


def port_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, so that every worker binds the same port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"the port {port} on {host}: {exc.strerror}") from None
    if listen:
        sock.listen(1024)
        sock.setblocking(False)
    return sock


def setup_logging(settings: Settings, log_format: str) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=log_format, force=True)
    if logging.getLogger().level > logging.DEBUG:
        # aioice logs each ICE candidate pair's every state at INFO: six lines a WebRTC call, a worker's log
        # mostly made of them under load.
        logging.getLogger("aioice").setLevel(logging.WARNING)


def _child_setup(settings: Settings, role: str) -> None:
    setup_logging(settings, LOG_FORMAT.format(role=role))
    # Ctrl-C reaches the whole process group: the supervisor alone decides the order of shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def _until_sigterm(work: asyncio.Future) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, work.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await work


def engine_devices(settings: Settings) -> list[str]:
    """Where engine processes run: one per `--gpus` entry (indices, "all", or device names), else `--device`."""
    spec = settings.gpus.strip()
    if not spec:
        return [settings.device]
    if spec == "all":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise SystemExit("--gpus all: no CUDA device is visible")
        return [f"cuda:{i}" for i in range(count)]
    return [f"cuda:{part}" if part.isdigit() else part for part in split_csv(spec)]


def engine_main(settings: Settings, path: str, index: int) -> None:
    """An engine process: load the model, start the engine, serve it on the channel until SIGTERM."""
    _child_setup(settings, f"engine {index}")
    from app.shell.model_choice import ModelUnavailable
    from app.shell.model_load import build_engine, load_for
    from model.engine import KVCacheTooSmall
    from model.engine.process import EngineHost

    try:
        model, note = load_for(settings)
        logger.info("%s", note)
        engine = build_engine(settings, model)
    except (ModelUnavailable, KVCacheTooSmall) as e:
        logger.error("%s", e)
        sys.exit(EXIT_MODEL_UNAVAILABLE)
    engine.start()
    host = EngineHost(engine, model.info(), path, note)

    async def main() -> None:
        await _until_sigterm(asyncio.ensure_future(host.serve()))

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def worker_main(settings: Settings, paths: list[str], devices: list[str], worker: int, drain: ProcessEvent) -> None:
    """A worker process: an aiohttp server on its own socket of the shared port, the engine over the channel; it
    stops admitting once the supervisor sets `drain`."""
    _child_setup(settings, f"worker {worker}")
    from app.shell.server import serve

    sock = None if sip_alone(settings, worker) else port_socket(settings.host, settings.port, listen=True)

    async def drain_when_told(ctx: Any) -> None:
        while not drain.is_set():
            await asyncio.sleep(0.05)
        ctx.draining = True
        await asyncio.Event().wait()

    async def main() -> None:
        await _until_sigterm(asyncio.ensure_future(serve(settings, sock=sock, engines=(paths, devices),
                                                         worker=worker, until=drain_when_told)))

    try:
        asyncio.run(main())
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        logger.error("worker %d: %s", worker, port_in_use(e))
        sys.exit(EXIT_PORT_IN_USE)


def port_in_use(error: OSError) -> str:
    """The line a port another process holds ends the server with (a second server, most often)."""
    return (f"{error.strerror}: another process listens there (--port, --sip-port, --agent-port and "
            f"--audiosocket-port choose the ports)")


def sip_alone(settings: Settings, worker: int) -> bool:
    """Whether this worker serves the SIP door and nothing else: worker 0 holds the door (one UDP port: every call's
    signalling and RTP), and with its share of the shared HTTP port besides it ran at twice the others' CPU at full
    load (144 calls over 8 workers, a fifth of them SIP) and fell behind first. Then the others share the port."""
    return worker == 0 and bool(settings.sip_port) and settings.sip_own_worker and settings.workers >= 2


def _loopback(host: str) -> str:
    """Where the supervisor reaches its own port."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


class Supervisor:
    """Starts the engine processes and the workers, restarts any that die, and stops them in order."""

    def __init__(self, settings: Settings) -> None:
        self._mp = multiprocessing.get_context("spawn")
        self._folder = Path(tempfile.mkdtemp(prefix="personaplex-"))
        self.devices = engine_devices(settings)
        self.paths = [str(self._folder / f"engine-{i}.sock") for i in range(len(self.devices))]
        self._port_holder = port_socket(settings.host, settings.port, listen=False)
        self.port = self._port_holder.getsockname()[1]
        self.settings = replace(settings, port=self.port)
        self.engines: list[BaseProcess | None] = [None] * len(self.devices)
        self.workers: list[BaseProcess | None] = [None] * settings.workers
        self._restarts: dict[str, deque[float]] = {}
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self._drain = self._mp.Event()          # the workers' copy of `draining`
        self._agent: socketserver.ThreadingTCPServer | None = None

    def _start_engine(self, n: int) -> None:
        settings = replace(self.settings, device=self.devices[n])
        engine = self._mp.Process(target=engine_main, args=(settings, self.paths[n], n),
                                  name=f"personaplex-engine-{n}", daemon=False)
        engine.start()
        self.engines[n] = engine

    def _start_worker(self, n: int) -> None:
        worker = self._mp.Process(target=worker_main, args=(self.settings, self.paths, self.devices, n, self._drain),
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
        if self.settings.agent_port:  # first: a port another process holds ends the start before any process
            self._start_agent()
        for n in range(len(self.engines)):
            self._start_engine(n)
        for n in range(len(self.workers)):
            self._start_worker(n)
        alone = " (worker 0: the SIP door alone)" if sip_alone(self.settings, 0) else ""
        logger.info("listening on http://%s:%d (%d worker processes%s; engine processes %s)", self.settings.host,
                    self.port, len(self.workers), alone, ", ".join(f"{e.pid} on {d}" for e, d in zip(
                        self.engines, self.devices, strict=True) if e is not None))

    def signal(self, sig: int) -> None:
        """SIGTERM: drain, and a second one stops at once; SIGINT stops at once."""
        if sig == signal.SIGTERM and not self.draining.is_set():
            self.draining.set()
        else:
            self.stopping.set()

    def ready_report(self) -> dict[str, Any] | None:
        """A worker's `/health/ready` body (whichever worker the kernel picks), or None when none answers."""
        url = f"http://{_loopback(self.settings.host)}:{self.port}/health/ready"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as refused:   # 503: not ready, and the body says why
            with contextlib.suppress(ValueError):
                return json.loads(refused.read())
        except (OSError, ValueError):
            pass
        return None

    def _start_agent(self) -> None:
        supervisor = self

        class Answer(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                line = "drain\n" if supervisor.draining.is_set() else agent_answer(supervisor.ready_report())
                with contextlib.suppress(OSError):
                    self.request.sendall(line.encode())

        family = socket.getaddrinfo(self.settings.host, self.settings.agent_port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("AgentServer", (socketserver.ThreadingTCPServer,), {
            "address_family": family, "allow_reuse_address": True, "daemon_threads": True})
        try:
            self._agent = server_class((self.settings.host, self.settings.agent_port), Answer)
        except OSError as exc:
            raise OSError(exc.errno, f"the agent-check port {self.settings.agent_port} on {self.settings.host}: "
                                     f"{exc.strerror}") from None
        threading.Thread(target=self._agent.serve_forever, name="agent-check", daemon=True).start()
        logger.info("agent-check on %s:%d", self.settings.host, self.settings.agent_port)

    def watch(self) -> int:
        """Until stopped or drained: restart what dies. Returns the exit status."""
        while not self.stopping.wait(0.1):
            if self.draining.is_set():
                return self._drain_sessions()
            for n, engine in enumerate(self.engines):
                if engine is not None and not engine.is_alive():
                    if engine.exitcode == EXIT_MODEL_UNAVAILABLE:
                        logger.error("engine %d cannot serve the model as configured (its reason above): stopping",
                                     n)
                        return 1
                    logger.error("engine %d (%s, pid %d) exited (%s); its sessions ended; starting it again",
                                 n, self.devices[n], engine.pid, engine.exitcode)
                    if not self._may_restart(f"engine-{n}"):
                        logger.error("engine %d keeps failing: stopping the server", n)
                        return 1
                    self._start_engine(n)
            for n, worker in enumerate(self.workers):
                if worker is not None and not worker.is_alive():
                    if worker.exitcode == EXIT_PORT_IN_USE:
                        logger.error("worker %d cannot listen where it is told: stopping the server", n)
                        return 1
                    logger.error("worker %d (pid %d) exited (%s); its sessions' slots are free; starting it again",
                                 n, worker.pid, worker.exitcode)
                    if not self._may_restart(f"worker-{n}"):
                        logger.error("worker %d keeps failing: stopping the server", n)
                        return 1
                    self._start_worker(n)
        return 0

    def _drain_sessions(self) -> int:
        """Tell the workers to admit no more, then wait for the engine's sessions to end (or the drain timeout, or
        a second signal). A worker that dies meanwhile is not started again: its sessions are gone."""
        self._drain.set()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        live = self._live_sessions()
        logger.info("draining: no new sessions; %s live may run up to %g s", live, self.settings.drain_timeout_s)
        while live != 0 and not self.stopping.wait(DRAIN_POLL_S):
            if time.monotonic() >= deadline:
                logger.info("drain timeout: closing %s live sessions", live)
                return 0
            live = self._live_sessions()
        logger.info("drained" if live == 0 else "second signal: closing at once")
        return 0

    def _live_sessions(self) -> int | None:
        """Sessions the engines hold now; 0 when no engine or worker is alive; None when unknown."""
        if not any(e and e.is_alive() for e in self.engines) or not any(w and w.is_alive() for w in self.workers):
            return 0
        report = self.ready_report()
        return report["sessions"]["in_use"] if report else None

    def stop(self) -> None:
        """Workers first (each closes its sessions cleanly within the shutdown timeout), then the engine."""
        started = time.monotonic()
        workers = [w for w in self.workers if w is not None and w.is_alive()]
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + 2.0
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
        engines = [e for e in self.engines if e is not None and e.is_alive()]
        for engine in engines:
            engine.terminate()
        deadline = time.monotonic() + 15.0
        for engine in engines:
            engine.join(max(0.0, deadline - time.monotonic()))
            if engine.is_alive():
                engine.kill()
        if self._agent is not None:
            self._agent.shutdown()
            self._agent.server_close()
        self._port_holder.close()
        shutil.rmtree(self._folder, ignore_errors=True)
        logger.info("stopped in %.1f s", time.monotonic() - started)


def run(settings: Settings) -> int:
    """Serve with `settings.workers` worker processes until SIGTERM or SIGINT; the exit status."""
    supervisor = Supervisor(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda received, _frame: supervisor.signal(received))
    try:
        supervisor.start()
        return supervisor.watch()
    finally:
        supervisor.stop()
