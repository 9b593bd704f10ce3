"""Admission, written once for every door: whether a new session may start, and the engine slot it gets.

`gate(ctx, route)` is asked before a door does any work for a new connection (before a WebSocket upgrade, before a
WebRTC offer is read): a draining server or an engine that is not running refuses. `admit(ctx, route)` takes a slot
(`reserve_wait` with the server's queue timeout) or refuses: draining, every slot taken (`resource_exhausted`), or
the engine process down (its own code). A refusal is a `Refused` carrying the client-visible code and message and
the HTTP status a door without an open channel answers with; each door says it in its own protocol (an `error`
event and close 1013 on a WebSocket, an HTTP status for a WebRTC offer). Admissions and rejections are counted here,
per route, so `/metrics` sees every door alike.
"""

from __future__ import annotations

from app.sessions.errors import DRAINING_MESSAGE
from app.shell.context import ServerContext
from model.engine import EngineError, ResourceExhausted, Slot


class Refused(Exception):
    """No session: `code`/`message` for the client, `status` for a door that answers over HTTP."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def gate(ctx: ServerContext, route: str) -> Refused | None:
    """The refusal for a new connection on `route` before any work is done for it, or None."""
    if ctx.draining:
        ctx.metrics.rejections[(route, "server_draining")] += 1
        return Refused("server_draining", DRAINING_MESSAGE, 503)
    if not ctx.ready:
        return Refused("engine_stopped", "the server is starting or shutting down", 503)
    return None


async def admit(ctx: ServerContext, route: str) -> Slot:
    """A slot for a session on `route`, waiting at most the server's queue timeout; raises `Refused`."""
    engine = ctx.engine
    if ctx.draining:
        ctx.metrics.rejections[(route, "server_draining")] += 1
        raise Refused("server_draining", DRAINING_MESSAGE, 503)
    if engine is None:
        raise Refused("engine_stopped", "the server is starting or shutting down", 503)
    try:
        slot = await engine.reserve_wait(ctx.settings.queue_timeout_s)
    except ResourceExhausted:
        ctx.metrics.rejections[(route, "resource_exhausted")] += 1
        raise Refused("resource_exhausted", f"duplex_session_capacity_exhausted: limit={engine.max_sessions}",
                      429) from None
    except EngineError as e:  # the engine process is down or restarting
        ctx.metrics.rejections[(route, e.code)] += 1
        raise Refused(e.code, e.message, 503) from None
    ctx.metrics.admissions[route] += 1
    return slot
