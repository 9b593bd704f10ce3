"""WebRTC calls' routes: `POST /v1/realtime/calls` (SDP offer in, 201 + SDP answer out), and the call's own routes.

As OpenAI Realtime does it over WebRTC. The body is the offer as `application/sdp`, or `multipart/form-data` with an
`sdp` part and an optional `session` part (the JSON of a `session.update`'s `session`: persona as `instructions`,
`voice`, sampling); `application/json` `{"sdp", "session"?}` is taken too. The answer is `201` with the answer SDP and
`Location: /v1/realtime/calls/<call id>`; `GET` there gives the call's counters, `DELETE` (or `POST …/hangup`) hangs up.
Admission is `app.sessions.admission`'s, answered over HTTP before any peer is made: a full server answers `429` with a
JSON error, a draining or stopped one `503`. An ephemeral client secret (app/doors/realtime/client_secrets.py) opens a
call as a key does, and its bound session is applied first, the offer's `session` part over it.

One call is one `app.doors.webrtc.call.Call`: the WebRTC transport (data channel `oai-events` + RTP media track)
carrying the Realtime dialect. The call ends, and its slot is freed at once, on DELETE, when ICE fails or does not
connect within `connect_timeout_s`, when the peer closes (DTLS close or RTCP BYE), or at server shutdown
(`session.closed` first, reason `server_shutdown`).

ICE servers: none by default (host candidates only: localhost and LAN). `--stun-url`, `--turn-url` (with
`--turn-username`, `--turn-credential`) and `--ice-relay-only` set them (or their `PERSONAPLEX_*` environment twins),
`--ice-connect-timeout-s` the connect deadline; browsers get the same list from `GET /v1/realtime/webrtc-config`
(which needs the API key, as it carries the TURN credential).
aiortc uses one STUN and one TURN URL.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from app.doors.realtime.client_secrets import merged_session
from app.doors.webrtc.call import CALLS_ROUTE, CHANNEL_LABEL, Call, OfferError, WebRTCConfig
from app.sessions.admission import Refused, admit, gate
from app.sessions.errors import ProtocolError, http_error_body
from app.sessions.transport import CLOSE_NORMAL
from app.sessions.wire import WireError, parse_object
from app.shell.auth import CLIENT_SECRET, refusal, too_many_connections
from app.shell.context import CONTEXT
from app.shell.worker_routing import call_owner, forward, worker_socket
from model.engine.pool import EnginePool

logger = logging.getLogger(__name__)

__all__ = ["CALLS", "CALLS_ROUTE", "WEBRTC", "WebRTCConfig", "setup_webrtc"]

STATIC_DIR = Path(__file__).resolve().parents[3] / "static"   # app/doors/webrtc/ -> the repository

WEBRTC = web.AppKey("personaplex_webrtc", WebRTCConfig)
CALLS = web.AppKey("personaplex_webrtc_calls", dict)


async def read_offer(request: web.Request) -> tuple[str, dict[str, Any] | None]:
    """(offer SDP, session object or None) from an `application/sdp`, multipart or JSON body."""
    try:
        sdp, session = await _read_body(request)
    except (ValueError, LookupError, HttpProcessingError) as e:  # not text in its charset, a broken multipart body
        # (HttpProcessingError: a part whose header block aiohttp cannot parse, e.g. an SDP part with no headers)
        raise OfferError(f"the body cannot be read as {request.content_type}: {type(e).__name__}") from None
    if not isinstance(sdp, str) or not sdp.lstrip().startswith("v=0"):
        raise OfferError("no SDP offer: the `sdp` must be a session description starting with v=0")
    if "m=audio" not in sdp:
        raise OfferError("the offer has no audio (m=audio): add the microphone track before creating the offer")
    if session is not None and not isinstance(session, dict):
        raise OfferError("`session` must be a JSON object", code="invalid_session_config")
    return sdp, session


async def _read_body(request: web.Request) -> tuple[object, object]:
    ctype = request.content_type
    session: object = None
    if ctype == "application/sdp":
        sdp = await request.text()
    elif ctype == "multipart/form-data":
        sdp = ""
        reader = await request.multipart()
        async for part in reader:
            if not isinstance(part, BodyPartReader):
                raise OfferError("nested multipart bodies are not taken")
            if part.name == "sdp":
                sdp = await part.text()
            elif part.name == "session":
                session = _json_object(await part.text(), "session")
    elif ctype == "application/json":
        body = _json_object(await request.text(), "body")
        sdp = body.get("sdp", "")
        session = body.get("session")
    else:
        raise OfferError(f"Content-Type {ctype or 'none'!r}: send the offer as application/sdp, or multipart/form-data "
                         "with an `sdp` part (and an optional `session` part)", status=415)
    return sdp, session


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        return parse_object(text)
    except WireError as e:
        raise OfferError(f"`{what}`: {e}", code="invalid_json") from None




# ---- routes --------------------------------------------------------------------------------------------------

def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(http_error_body(code, message), status=status)


async def create_call(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    settings = ctx.settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        ctx.metrics.rejections[(CALLS_ROUTE, "unauthorized" if refused.status == 401 else "origin_not_allowed")] += 1
        return refused
    closed = gate(ctx, CALLS_ROUTE)
    if closed is not None:
        return _error(closed.status, closed.code, closed.message)
    try:
        offer, session = await read_offer(request)
    except OfferError as e:
        return _error(e.status, e.code, str(e))
    claim = request.get(CLIENT_SECRET)   # a client secret opened this call: its session, then the offer's over it
    if claim is not None:
        session = merged_session(claim.session, session) or None
    try:
        slot = await admit(ctx, CALLS_ROUTE)
    except Refused as e:
        later = "; try again later" if e.code == "resource_exhausted" else ""
        return _error(e.status, e.code, e.message + later)
    call = Call(request, slot, request.app[WEBRTC], offer, request.app[CALLS])
    if claim is not None:
        call.session.session_id = claim.id               # the id the mint answered
    try:
        await call.open(session)
        answer = await call.negotiate()
    except (ProtocolError, OfferError) as e:
        await call.hang_up(CLOSE_NORMAL, "bad_offer", send_closed=False)
        return _error(getattr(e, "status", 400), e.code, str(e))
    except Exception as e:
        logger.exception("call set-up failed")
        await call.hang_up(CLOSE_NORMAL, "internal_error", send_closed=False)
        return _error(500, "internal_error", f"call set-up failed: {type(e).__name__}: {e}")
    if call.closed:                                   # shut down while negotiating
        return _error(503, "engine_stopped", "the server is shutting down")
    request.app[CALLS][call.call_id] = call
    ctx.sockets.add(call)
    ctx.metrics.connections[CALLS_ROUTE] += 1
    location = f"{CALLS_ROUTE}/{call.call_id}"
    return web.Response(status=201, text=answer, content_type="application/sdp", headers={"Location": location})


async def create_call_limited(request: web.Request) -> web.Response:
    """`create_call` under the per-address connection limit: the address stays counted while the call lives."""
    ctx = request.app[CONTEXT]
    limit = ctx.settings.max_connections_per_ip
    address = ctx.addresses.take(request, limit)
    if address is None:
        ctx.metrics.rejections[(CALLS_ROUTE, "too_many_connections")] += 1
        return too_many_connections(limit)
    call = None
    try:
        response = await create_call(request)
        if response.status == 201:
            call = request.app[CALLS].get(response.headers["Location"].rsplit("/", 1)[-1])
    finally:
        if call is not None and not call.closed:
            call.address = address                       # released by the call's close
        else:
            ctx.addresses.release(address)
    return response


def _find_call(request: web.Request) -> Call | web.Response:
    settings = request.app[CONTEXT].settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        return refused
    call_id = request.match_info["call_id"]
    call = request.app[CALLS].get(call_id)
    if call is None:
        return _error(404, "bad_event", f"no live call {call_id!r}")
    return call


def _other_worker(request: web.Request) -> str | None:
    """The private socket of the worker that holds this request's call, when that is another process."""
    engine = request.app[CONTEXT].engine
    owner = call_owner(request.match_info["call_id"])
    if not isinstance(engine, EnginePool) or owner is None or owner == engine.worker:
        return None
    return worker_socket(engine.folder, owner)


async def hang_up(request: web.Request) -> web.Response:
    found = _find_call(request)
    if isinstance(found, web.Response):
        other = _other_worker(request) if found.status == 404 else None
        return await forward(request, other) if other else found
    await found.hang_up(CLOSE_NORMAL, "client_hangup")
    return web.Response(status=204)


async def call_stats(request: web.Request) -> web.Response:
    found = _find_call(request)
    if isinstance(found, web.Response):
        other = _other_worker(request) if found.status == 404 else None
        return await forward(request, other) if other else found
    return web.json_response(await found.stats())


async def webrtc_config(request: web.Request) -> web.Response:
    """The ICE servers for browsers: they carry the TURN credential, so the API key is required (when keys are set)."""
    settings = request.app[CONTEXT].settings
    refused = refusal(request, settings.api_keys, settings.allowed_origins)
    if refused is not None:
        return refused
    return web.json_response({"ice_servers": request.app[WEBRTC].browser_ice_servers(),
                              "calls_url": CALLS_ROUTE, "data_channel": CHANNEL_LABEL})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def favicon(request: web.Request) -> web.FileResponse:
    """Browsers ask for /favicon.ico on every page load: the icon, not a 404."""
    return web.FileResponse(STATIC_DIR / "favicon.ico", headers={"Cache-Control": "public, max-age=86400"})


def setup_webrtc(app: web.Application, config: WebRTCConfig | None = None) -> None:
    """Add the call routes and the browser page (`/`, `/favicon.ico`, `/static/`) to the server."""
    app[WEBRTC] = config or WebRTCConfig.from_settings(app[CONTEXT].settings)
    app[CALLS] = {}
    app.router.add_post(CALLS_ROUTE, create_call_limited)
    app.router.add_get(CALLS_ROUTE + "/{call_id}", call_stats)
    app.router.add_delete(CALLS_ROUTE + "/{call_id}", hang_up)
    app.router.add_post(CALLS_ROUTE + "/{call_id}/hangup", hang_up)
    app.router.add_get("/v1/realtime/webrtc-config", webrtc_config)
    app.router.add_get("/", index)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_static("/static/", STATIC_DIR)

