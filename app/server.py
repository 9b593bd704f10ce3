"""The aiohttp application: model loading with the tiny fallback, the engine's lifetime, and the routes.

`create_app(settings)` builds the app; startup loads the model (in a worker thread) and starts the engine, shutdown
tells every open session `session.closed` and closes it with 1001, cleanup stops the engine.

Routes: `GET /health`, `GET /metrics`, `GET /v1/models`, `GET /v1/voices`, `WS /v1/realtime` (`?duplex=1`),
`WS /v1/duplex`, `WS /v1/twilio`; `app.webrtc.setup_webrtc(app)` adds the WebRTC routes when that module exists
(it finds the shared `ServerContext` at `app[CONTEXT]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from aiohttp import web

from app.auth import RedactingAccessLogger, key_ok
from app.context import CONTEXT, ServerContext
from app.duplex import duplex_handler
from app.errors import http_error_body
from app.realtime import capabilities, realtime_handler
from app.settings import TINY_MODEL, Settings
from app.twilio import twilio_handler
from model.engine import Engine, EngineConfig
from model.loading import PersonaPlex, load_model
from model.tiny import write_tiny_checkpoint

logger = logging.getLogger(__name__)

_BANNER = "=" * 78


def resolve_device(settings: Settings) -> tuple[str, str]:
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def tiny_folder(settings: Settings) -> Path:
    """The built-in tiny checkpoint, written once into the cache folder."""
    folder = settings.cache_dir / "tiny-checkpoint"
    if not (folder / "config.json").is_file():
        logger.info("writing the built-in tiny checkpoint to %s", folder)
        write_tiny_checkpoint(folder)
    return folder


def load_for(settings: Settings) -> tuple[PersonaPlex, str]:
    """The model to serve and a note on why. A repo id without a GPU or a token, or any load failure, falls back to
    the built-in tiny model (unless `strict_model`), and the log says so loudly."""
    device, dtype = resolve_device(settings)
    source = settings.model
    local = Path(source).expanduser().is_dir()
    reason = ""
    if source == TINY_MODEL:
        reason = "the tiny model was asked for"
    elif not local and not device.startswith("cuda"):
        reason = f"no GPU for {source} (device {device})"
    if not reason:
        try:
            return load_model(source, device=device, dtype=dtype), f"loaded {source} on {device} ({dtype})"
        except Exception as e:
            if settings.strict_model:
                raise
            hint = "" if local or os.environ.get("HF_TOKEN") else " (HF_TOKEN is not set)"
            reason = f"{source} did not load{hint}: {type(e).__name__}: {e}"
    folder = tiny_folder(settings)
    model = load_model(str(folder), device=device, dtype="float32")
    note = f"serving the built-in TINY test model (random weights, not PersonaPlex-7B): {reason}"
    if source != TINY_MODEL:
        logger.warning("\n%s\n%s\n%s", _BANNER, note.upper(), _BANNER)
    return model, note


async def _startup(app: web.Application) -> None:
    ctx = app[CONTEXT]
    loop = asyncio.get_running_loop()
    if ctx.model is None:
        ctx.model, ctx.model_note = await loop.run_in_executor(None, load_for, ctx.settings)
    logger.info("%s", ctx.model_note or f"model {ctx.model.source}")
    fp8 = ctx.settings.kv_cache == "fp8"
    if fp8 and ctx.model.device.type != "cuda":
        logger.warning("--kv-cache fp8 needs a GPU; keeping the KV cache in %s", ctx.model.dtype)
    engine = Engine(ctx.model, EngineConfig(max_sessions=ctx.settings.max_sessions,
                                            fp8_kv=fp8 and ctx.model.device.type == "cuda"))
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
    if ctx.engine is not None:
        engine, ctx.engine = ctx.engine, None
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type="application/json")


def _unauthorized(request: web.Request) -> web.Response | None:
    if key_ok(request, request.app[CONTEXT].settings.api_keys):
        return None
    return _json(http_error_body("unauthorized", "a valid API key is required"), status=401)


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    if ctx.engine is None:
        return _json({"status": "shutting_down" if ctx.shutting_down else "starting", "ready": False}, status=503)
    s = ctx.engine.stats()
    status = "shutting_down" if ctx.shutting_down else ("ok" if ctx.engine.running else "engine_down")
    return _json({
        "status": status,
        "ready": ctx.ready,
        "model": ctx.model_id,
        "tiny": bool(ctx.model and ctx.model.is_tiny),
        "note": ctx.model_note,
        "sessions": {"in_use": s.sessions_in_use, "free": s.max_sessions - s.sessions_in_use,
                     "max": s.max_sessions},
        "tick": {"ticks": s.ticks, "late_ticks": s.late_ticks, "batch": s.batch, "last_ms": s.tick_ms,
                 "p50_ms": s.tick_ms_p50, "p99_ms": s.tick_ms_p99},
    }, status=200 if ctx.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    stats = ctx.engine.stats() if ctx.engine is not None else None
    return web.Response(text=ctx.metrics.render(stats), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"}, charset="utf-8")


async def models(request: web.Request) -> web.Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    max_sessions = ctx.engine.max_sessions if ctx.engine is not None else ctx.settings.max_sessions
    return _json({"object": "list", "data": [{
        "id": ctx.model_id, "object": "model", "created": 0, "owned_by": "personaplex-server",
        "source": ctx.model.source if ctx.model is not None else ctx.settings.model,
        "tiny": bool(ctx.model and ctx.model.is_tiny),
        "capabilities": capabilities(max_sessions),
    }]})


async def voices(request: web.Request) -> web.Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    bundled = set(ctx.model.voices()) if ctx.model is not None else set()
    return _json({"object": "list", "default": ctx.default_voice, "data": [
        {"id": name, "object": "voice", "source": "bundled" if name in bundled else "voices_dir",
         "default": name == ctx.default_voice} for name in ctx.voice_names()]})


def create_app(settings: Settings, *, model: PersonaPlex | None = None) -> web.Application:
    """The server; `model` skips loading (tests, embedding). Engine start and stop follow the app's lifetime."""
    app = web.Application(client_max_size=settings.max_message_bytes)
    app[CONTEXT] = ServerContext(settings=settings, model=model,
                                 model_note=f"model given by the caller: {model.source}" if model else "")
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/voices", voices)
    app.router.add_get("/v1/realtime", realtime_handler)
    app.router.add_get("/v1/duplex", duplex_handler)
    app.router.add_get("/v1/twilio", twilio_handler)
    if importlib.util.find_spec("app.webrtc") is not None:
        from app.webrtc import setup_webrtc
        setup_webrtc(app)
    app.on_startup.append(_startup)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def serve(settings: Settings) -> None:
    """Run until cancelled (SIGINT/SIGTERM through `python -m app`)."""
    app = create_app(settings)
    runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_timeout_s, access_log_class=RedactingAccessLogger)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    ctx = app[CONTEXT]
    for sock in site._server.sockets if site._server else ():  # type: ignore[union-attr]
        host, port = sock.getsockname()[:2]
        logger.info("listening on http://%s:%d (%s; %d sessions)", host, port, ctx.model_id,
                    settings.max_sessions)
    try:
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
