"""The aiohttp application: the engine's lifetime (the model loads through app/shell/model_load.py), and the routes.

`create_app(settings)` builds the app; startup loads the model (in a worker thread) and starts the engine, shutdown
tells every open session `session.closed` and closes it with 1001, cleanup stops the engine.

Routes: `GET /health`, `GET /health/live`, `GET /health/ready` (probes for a balancer, app/shell/probes.py),
`GET /metrics`, `GET /v1/models`, `GET /v1/voices`, then each door's: `WS /v1/realtime` (`?duplex=1`) and
`POST /v1/realtime/client_secrets` (app/doors/realtime/; client_secrets.py also checks the `ek_` secrets presented
to the session routes), `WS /v1/duplex`, the phone bridges `WS /v1/twilio`,
`WS /v1/telnyx`, `WS /v1/vonage`, `WS /v1/freeswitch` and the Asterisk AudioSocket TCP door (`--audiosocket-port`,
app/doors/phone/), the WebRTC calls and the page (`app.doors.webrtc.routes.setup_webrtc`, which finds the shared
`ServerContext` at `app[CONTEXT]`), and with `--sip-port` the SIP door (`app.doors.sip.setup_sip`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from app.calls.live import CallRegistry, setup_calls
from app.doors.duplex import duplex_handler
from app.doors.phone.audiosocket import setup_audiosocket
from app.doors.phone.freeswitch import freeswitch_handler
from app.doors.phone.telnyx import telnyx_handler
from app.doors.phone.twilio import twilio_handler
from app.doors.phone.vonage import vonage_handler
from app.doors.realtime.client_secrets import setup_client_secrets
from app.doors.realtime.dialect import capabilities, realtime_handler
from app.doors.webrtc.routes import setup_webrtc
from app.sessions.errors import http_error_body
from app.shell.auth import RedactingAccessLogger, authorized
from app.shell.context import CONTEXT, ServerContext
from app.shell.loop_lag import collector_report, freeze_startup_objects
from app.shell.probes import DRAINING, READY, readiness, serve_agent
from app.shell.settings import Settings
from app.shell.worker_routing import worker_socket
from model.engine import EngineError, EngineStats
from model.engine.pool import EnginePool

if TYPE_CHECKING:
    from model.loading import PersonaPlex

logger = logging.getLogger(__name__)


async def _startup(app: web.Application) -> None:
    ctx = app[CONTEXT]
    ctx.tasks.add(asyncio.ensure_future(ctx.metrics.loop_lag.run()))
    if isinstance(ctx.engine, EnginePool):  # a worker: the engine processes have the model
        pool = ctx.engine
        pool.set_counters_source(ctx.metrics.snapshot)
        task = asyncio.ensure_future(pool.run())
        ctx.tasks.add(task)
        return
    from app.shell.model_load import build_engine, load_for  # here only: a worker process never loads torch

    loop = asyncio.get_running_loop()
    if ctx.model is None:
        ctx.model, ctx.model_note = await loop.run_in_executor(None, load_for, ctx.settings)
    logger.info("%s", ctx.model_note or f"model {ctx.model.source}")
    engine = build_engine(ctx.settings, ctx.model)
    engine.start()
    ctx.engine = engine


async def _shutdown(app: web.Application) -> None:
    ctx = app[CONTEXT]
    ctx.shutting_down = True
    sockets = list(ctx.sockets)
    if sockets:
        await asyncio.wait([asyncio.ensure_future(s.shutdown()) for s in sockets],
                           timeout=ctx.settings.shutdown_timeout_s)
    for task in list(ctx.tasks):
        task.cancel()


async def _cleanup(app: web.Application) -> None:
    ctx = app[CONTEXT]
    if ctx.engine is not None and not isinstance(ctx.engine, EnginePool):    # this process's own engine
        engine, ctx.engine = ctx.engine, None
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _unauthorized(request: web.Request) -> web.Response | None:
    if authorized(request, request.app[CONTEXT].settings.api_keys):
        return None
    return _json(http_error_body("unauthorized", "a valid API key is required"), status=401)


async def _engine_stats(ctx: ServerContext) -> EngineStats | None:
    """The engine's stats now (a worker asks the engine process), or None while there is no engine to ask."""
    engine = ctx.engine
    if engine is None:
        return None
    try:
        if isinstance(engine, EnginePool):
            return await asyncio.wait_for(engine.fresh_stats(), 1.0)
        return engine.stats()
    except (EngineError, asyncio.TimeoutError):
        return None


def processes(ctx: ServerContext) -> list[dict[str, object]]:
    """The server's processes: the engines' and every worker's in a multi-process server, else this one."""
    engine = ctx.engine
    if not isinstance(engine, EnginePool):
        lag = ctx.metrics.loop_lag
        return [{"role": "main", "pid": os.getpid(), "loop_lag_ms": lag.quantiles(), "loop_stalls": lag.stall_sites(),
                 "loop_stalls_at": lag.stall_times(), "gc": collector_report()}]
    found: list[dict[str, object]] = [{"role": "main", "pid": os.getppid()}]
    found += [{"role": "engine", "engine": view.index, "device": view.device, "pid": view.pid}
              for view in engine.engines_now() if view.pid]
    for number, worker in sorted(engine.workers.items(), key=lambda item: int(item[0])):
        found.append({"role": "worker", "worker": int(number), "pid": worker.pid, "sessions": worker.sessions,
                      "input_late_frames": worker.late_frames, "loop_lag_ms": worker.counters.get("loop_lag_ms", {}),
                      "loop_stalls": worker.counters.get("loop_stalls", {}),
                      "loop_stalls_at": worker.counters.get("loop_stalls_at", []), "gc": worker.counters.get("gc", {}),
                      "this": worker.pid == os.getpid()})
    for entry in found:
        if entry.get("this"):
            entry["input_lead_ms"] = round(engine.input_lead_s * 1000.0, 1)
    return found


def _status(ctx: ServerContext, stats: EngineStats | None) -> str:
    """Why this instance may not take a new session (shutting_down, draining, engine_down, starting), else ready:
    what /health and /health/ready both report."""
    if ctx.shutting_down:
        return "shutting_down"
    if ctx.draining:
        return DRAINING
    if stats is None:
        return "engine_down" if isinstance(ctx.engine, EnginePool) and ctx.engine.connects else "starting"
    return READY if ctx.ready else "engine_down"


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    s = await _engine_stats(ctx)
    status = _status(ctx, s)
    if s is None:
        return _json({"status": status, "ready": False, "processes": processes(ctx)}, status=503)
    ready = ctx.ready
    status = "ok" if status == READY else status
    info = ctx.model_info
    return _json({
        "status": status,
        "ready": ready,
        "model": ctx.model_id,
        "tiny": bool(info and info.is_tiny),
        "random_weights": bool(info and (info.random_weights or info.is_tiny)),
        "note": ctx.model_note or getattr(ctx.engine, "note", ""),
        "sessions": {"in_use": s.sessions_in_use, "free": s.max_sessions - s.sessions_in_use,
                     "max": s.max_sessions},
        "tick": {"ticks": s.ticks, "late_ticks": s.late_ticks, "batch": s.batch, "last_ms": s.tick_ms,
                 "p50_ms": s.tick_ms_p50, "p99_ms": s.tick_ms_p99},
        "session_start_ms": {"live": s.start_ms, "first_frame": s.first_frame_ms},
        "kv_cache": kv_report(s),
        "engines": engines_report(ctx),
        "processes": processes(ctx),
    }, status=200 if ready else 503)


def engines_report(ctx: ServerContext) -> list[dict[str, object]]:
    """Each engine process on its own (several with --gpus): its device, whether it ticks, its slots and ticks."""
    engine = ctx.engine
    if not isinstance(engine, EnginePool):
        return []
    report: list[dict[str, object]] = []
    for view in engine.engines_now():
        entry: dict[str, object] = {"engine": view.index, "device": view.device, "pid": view.pid,
                                    "running": view.running}
        if view.stats is not None:
            s = view.stats
            entry["sessions"] = {"in_use": s.sessions_in_use, "free": s.max_sessions - s.sessions_in_use,
                                 "max": s.max_sessions}
            entry["tick"] = {"ticks": s.ticks, "late_ticks": s.late_ticks, "p50_ms": s.tick_ms_p50,
                             "p99_ms": s.tick_ms_p99}
            entry["kv_cache"] = kv_report(s)
        report.append(entry)
    return report


def kv_report(s: EngineStats) -> dict[str, int]:
    """The KV cache's pages (every session's context), how many are free, and how often a context was shrunk."""
    return {"pages": s.kv_pages, "free": s.kv_pages_free, "window_shrinks": s.kv_window_shrinks}


async def live(request: web.Request) -> web.Response:
    """The process serves HTTP (a liveness probe: nothing else is asked, so a busy engine never fails it)."""
    return _json({"status": "live"})


async def ready_report(ctx: ServerContext) -> dict[str, object]:
    """`/health/ready`'s body: whether this instance can take a new session now, and its slots."""
    stats = await _engine_stats(ctx)
    return readiness(_status(ctx, stats), stats.sessions_in_use if stats else 0, stats.max_sessions if stats else 0)


async def ready(request: web.Request) -> web.Response:
    """200 while a new session would be admitted; 503 when full, draining, shutting down, or no engine is up."""
    body = await ready_report(request.app[CONTEXT])
    return _json(body, status=200 if body["ready"] else 503)


async def drain(ctx: ServerContext, hurry: asyncio.Event) -> None:
    """Stop admitting at once, then let the live sessions run to their end, for up to the drain timeout or until
    `hurry` is set (a second SIGTERM). The final close (session.closed, 1001) follows at the app's shutdown."""
    ctx.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ctx.settings.drain_timeout_s
    stats = await _engine_stats(ctx)
    logger.info("draining: no new sessions; %d live may run up to %g s", stats.sessions_in_use if stats else 0,
                ctx.settings.drain_timeout_s)
    while stats is not None and stats.sessions_in_use > 0 and not hurry.is_set():
        left = deadline - loop.time()
        if left <= 0:
            logger.info("drain timeout: closing %d live sessions", stats.sessions_in_use)
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(hurry.wait(), min(0.1, left))
        stats = await _engine_stats(ctx)
    logger.info("drained" if not hurry.is_set() else "second signal: closing at once")


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    stats = await _engine_stats(ctx)
    others, name, engines = {}, "main", []
    if isinstance(ctx.engine, EnginePool):
        others = {f"worker-{n}": w.counters for n, w in ctx.engine.workers.items() if w.pid != os.getpid()}
        name = f"worker-{ctx.engine.worker}"
        engines = ctx.engine.engines_now()
    return web.Response(text=ctx.metrics.render(stats, others, name, engines), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")


async def models(request: web.Request) -> web.Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    max_sessions = ctx.engine.max_sessions if ctx.engine is not None else ctx.settings.max_sessions
    info = ctx.model_info
    return _json({"object": "list", "data": [{
        "id": ctx.model_id, "object": "model", "created": 0, "owned_by": "personaplex-server",
        "source": info.source if info is not None else ctx.settings.model,
        "tiny": bool(info and info.is_tiny),
        "random_weights": bool(info and (info.random_weights or info.is_tiny)),
        "capabilities": capabilities(max_sessions),
        "engines": [{"engine": view.index, "device": view.device, "running": view.running,
                     "max_sessions": view.stats.max_sessions if view.stats else 0}
                    for view in ctx.engine.engines_now()] if isinstance(ctx.engine, EnginePool) else [],
    }]})


async def voices(request: web.Request) -> web.Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    info = ctx.model_info
    bundled = set(info.voices) if info is not None else set()
    return _json({"object": "list", "default": ctx.default_voice, "data": [
        {"id": name, "object": "voice", "source": "bundled" if name in bundled else "voices_dir",
         "default": name == ctx.default_voice} for name in ctx.voice_names()]})


def create_app(settings: Settings, *, model: PersonaPlex | None = None,
               engine: EnginePool | None = None) -> web.Application:
    """The server; `model` skips loading (tests, embedding). Engine start and stop follow the app's lifetime; with
    `engine` (a worker process) the engine process has the model, and this app only talks to it."""
    app = web.Application(client_max_size=settings.max_message_bytes)
    app[CONTEXT] = ServerContext(settings=settings, model=model, engine=engine,
                                 model_note=f"model given by the caller: {model.source}" if model else "")
    app[CONTEXT].calls = CallRegistry(settings, app[CONTEXT].metrics, engine.worker if engine else None)
    setup_calls(app)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/voices", voices)
    app.router.add_get("/v1/realtime", realtime_handler)
    app.router.add_get("/v1/duplex", duplex_handler)
    app.router.add_get("/v1/twilio", twilio_handler)
    app.router.add_get("/v1/telnyx", telnyx_handler)
    app.router.add_get("/v1/vonage", vonage_handler)
    app.router.add_get("/v1/freeswitch", freeswitch_handler)
    setup_client_secrets(app)
    setup_audiosocket(app)
    setup_webrtc(app)
    app.on_startup.append(_startup)
    if settings.sip_port:  # after _startup: the SIP door needs the engine
        from app.doors.sip import setup_sip
        setup_sip(app)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def set_up(runner: web.AppRunner) -> None:
    """`runner.setup()`; when the app's startup fails, what it had started (the engine, a door's sockets) stops
    before the error goes on."""
    try:
        await runner.setup()
    except BaseException:
        runner.app.freeze()  # the runner freezes it only after a startup that returned
        try:
            await runner.app.shutdown()
        finally:
            await runner.cleanup()  # the engine stops here (on_cleanup), whatever a door's shutdown raised
        raise


async def serve(settings: Settings, *, sock: socket.socket | None = None,
                engines: tuple[list[str], list[str]] | None = None, worker: int = 0,
                until: Callable[[ServerContext], Awaitable[None]] | None = None) -> None:
    """Run until `until(ctx)` returns (by default: until cancelled), then close every session and stop. In one
    process by default (with the agent-check port, when set); a worker process gets the listening socket it
    shares with the other workers and the engine processes' channels and devices (`engines`), or, the SIP door's
    own worker (app/shell/processes.sip_alone), no socket: it answers only on its private one."""
    engine = None
    if engines:
        paths, devices = engines
        engine = EnginePool(paths, devices, worker, settings.input_lead_ms / 1000.0)
    app = create_app(settings, engine=engine)
    runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_timeout_s,
                            access_log_class=RedactingAccessLogger)
    await set_up(runner)
    agent = None
    try:
        site = None
        if sock is not None or engine is None:
            site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, settings.host, settings.port)
            await site.start()
        if engine is not None:  # where the other workers forward requests for this one's calls (worker_routing.py)
            await web.UnixSite(runner, worker_socket(engine.folder, worker)).start()
            freeze_startup_objects()  # one process alone: the engine's start freezes it (model/engine/core.py)
        ctx = app[CONTEXT]
        if engine is None and settings.agent_port:
            agent = await serve_agent(settings.host, settings.agent_port, lambda: ready_report(ctx))
            logger.info("agent-check on %s:%d", settings.host, settings.agent_port)
        if engine is None and site is not None:
            for bound in site._server.sockets if site._server else ():  # type: ignore[union-attr]
                host, port = bound.getsockname()[:2]
                logger.info("listening on http://%s:%d (%s; %d sessions)", host, port, ctx.model_id,
                            settings.max_sessions)
        await (until(ctx) if until is not None else asyncio.Event().wait())
    finally:  # also when a port could not be bound: the engine and the doors stop, and the process can end
        with contextlib.suppress(Exception):
            await runner.cleanup()
        if agent is not None:
            agent.close()
