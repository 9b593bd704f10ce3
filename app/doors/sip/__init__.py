"""The SIP door (`--sip-port`): a user agent server for SIP trunks, with RTP media (issue 16).

`setup_sip(app)` adds it to the aiohttp app: the SIP server starts after the engine (in a multi-process server, in
worker 0 only: see app/doors/sip/uas.py) and stops with the app; `GET /v1/sip/calls` lists the live calls and their
media stats (API key as for /v1/models; another worker forwards it to worker 0), `GET /v1/sip/calls/{call_id}`
one of them (404 when it is not live). Modules: uas (the server: what comes
in and where it goes), transport (UDP and TCP, where replies go), transactions (retransmissions), invite (a new
call's signalling), dialogs (in-dialog requests, session timers, the end), sdp (offer/answer), digest (auth), call
(one call's RTP and conversation), client (a SIP phone for tests and benchmarks); media/rtp.py has the codecs and the
RTP receive side.
"""

from __future__ import annotations

import json

from aiohttp import web

from app.doors.sip.uas import SipServer
from app.sessions.errors import http_error_body
from app.shell.auth import key_ok
from app.shell.context import CONTEXT
from app.shell.worker_routing import forward, on_private_socket, worker_socket
from model.engine.pool import EnginePool

SIP = web.AppKey("personaplex_sip", SipServer)


def setup_sip(app: web.Application) -> None:
    ctx = app[CONTEXT]
    server = app[SIP] = SipServer(ctx)

    async def start(app: web.Application) -> None:
        if isinstance(ctx.engine, EnginePool) and ctx.engine.worker != 0:
            return
        await server.start()

    async def stop(app: web.Application) -> None:
        await server.stop()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    app.router.add_get("/v1/sip/calls", calls)
    app.router.add_get("/v1/sip/calls/{call_id}", calls)


async def calls(request: web.Request) -> web.Response:
    """The live calls, or with a call id in the path that call (404 when it is not live)."""
    ctx = request.app[CONTEXT]
    engine = ctx.engine
    if isinstance(engine, EnginePool) and engine.worker != 0 and not on_private_socket(request):
        # The kernel hands this request to any worker of the port; the calls live in worker 0, with the door.
        return await forward(request, worker_socket(engine.folder, 0))
    call_id = request.match_info.get("call_id")
    if not key_ok(request, ctx.settings.api_keys):
        body, status = http_error_body("unauthorized", "a valid API key is required"), 401
    elif call_id is None:
        body, status = {"object": "list", "data": request.app[SIP].calls()}, 200
    else:
        one = request.app[SIP].call(call_id)
        body, status = (one, 200) if one is not None else (http_error_body("bad_event", f"no live call {call_id!r}"),
                                                           404)
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")
