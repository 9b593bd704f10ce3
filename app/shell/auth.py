"""API-key, Origin and per-address checks, made on the HTTP request before any upgrade or slot; and the access log
that never writes a credential.

A key is accepted from `Authorization: Bearer <key>`, `?api_key=<key>`, or the WebSocket subprotocol
`openai-insecure-api-key.<key>` that browser Realtime clients send (browsers cannot set headers on a WebSocket). Keys
are compared in constant time. An ephemeral client secret (`ek_…`, app/doors/realtime/client_secrets.py) is presented
the same way; that module checks it first and marks the request (`CLIENT_SECRET`), which `authorized` then lets through.
`RedactingAccessLogger` replaces the value of every credential-like query parameter (`api_key`, `token`, `key`,
`secret`, `password`, …) with `REDACTED` in the access log, and any `ek_…` value wherever it appears.
"""

from __future__ import annotations

import hmac
import json
import re
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger

from app.sessions.errors import http_error_body

KEY_SUBPROTOCOL = "openai-insecure-api-key."
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


TELNYX_TOKEN_HEADER = "x-telnyx-streaming-auth-token"
# The request key of a checked client secret's claim (app/doors/realtime/client_secrets.py). aiohttp 3.14 typed request
# storage (and warns on plain string keys); older releases have only strings.
CLIENT_SECRET: Any = (web.RequestKey("personaplex_client_secret", object) if hasattr(web, "RequestKey")
                      else "personaplex_client_secret")


def offered_subprotocols(request: web.Request) -> list[str]:
    raw = request.headers.get("Sec-WebSocket-Protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def presented_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    if "api_key" in request.query:
        return request.query["api_key"]
    if TELNYX_TOKEN_HEADER in request.headers:   # Telnyx's `stream_auth_token`, the one credential it can send
        return request.headers[TELNYX_TOKEN_HEADER]
    for proto in offered_subprotocols(request):
        if proto.startswith(KEY_SUBPROTOCOL):
            return proto[len(KEY_SUBPROTOCOL):]
    return None


def key_ok(request: web.Request, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    key = presented_key(request)
    if key is None:
        return False
    # Every key is compared, in constant time, so neither the timing nor the number of comparisons tells which
    # key (or how much of one) matched.
    matches = [hmac.compare_digest(key.encode(), k.encode()) for k in keys]
    return any(matches)


def authorized(request: web.Request, keys: tuple[str, ...]) -> bool:
    """A configured key, or a client secret that app/doors/realtime/client_secrets.py checked for this request's
    route."""
    return CLIENT_SECRET in request or key_ok(request, keys)


def origin_ok(request: web.Request, allowed: tuple[str, ...]) -> bool:
    """No list, or no Origin header (not a browser): allowed. Else the Origin must be listed (or the list has '*')."""
    origin = request.headers.get("Origin")
    return not allowed or origin is None or "*" in allowed or origin in allowed


def refusal(request: web.Request, keys: tuple[str, ...], allowed: tuple[str, ...]) -> web.Response | None:
    """The HTTP refusal for this request, or None when it may go on."""
    if not origin_ok(request, allowed):
        body = http_error_body("origin_not_allowed", f"Origin {request.headers.get('Origin')!r} is not allowed")
        return web.Response(status=403, text=json.dumps(body), content_type="application/json")
    if not authorized(request, keys):
        body = http_error_body("unauthorized", "a valid API key is required (Authorization: Bearer, ?api_key=, "
                                               f"or the {KEY_SUBPROTOCOL}<key> subprotocol)")
        return web.Response(status=401, text=json.dumps(body), content_type="application/json",
                            headers={"WWW-Authenticate": "Bearer"})
    return None


def response_subprotocols(request: web.Request) -> tuple[str, ...]:
    """What the server may answer in `Sec-WebSocket-Protocol`: browsers fail a socket whose offer gets no answer,
    so prefer `realtime`, else any offered name that is not a key."""
    offered = offered_subprotocols(request)
    if "realtime" in offered:
        return ("realtime",)
    return tuple(p for p in offered if not p.startswith(KEY_SUBPROTOCOL))[:1]


class AddressLimit:
    """Open connections (WebSockets and WebRTC calls) per client address: one address cannot take every socket."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def take(self, request: web.Request, limit: int) -> str | None:
        """The address now counted, or None when it already has `limit` open (0: no limit)."""
        return self.take_address(request.remote or "", limit)

    def take_address(self, address: str, limit: int) -> str | None:
        if limit > 0 and self.open[address] >= limit:
            return None
        self.open[address] += 1
        return address

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def too_many_connections(limit: int) -> web.Response:
    body = http_error_body("too_many_connections", f"this address has {limit} connections open "
                                                   "(--max-connections-per-ip); close one and retry")
    return web.Response(status=429, text=json.dumps(body), content_type="application/json",
                        headers={"Retry-After": "1"})


_CREDENTIAL = re.compile(r"(?i)((?:^|[?&;])[^=&;#\s]*(?:key|token|secret|passw|credential|auth|signature|sig)"
                         r"[^=&;#\s]*=)[^&;#\s]*")
_CLIENT_SECRET_VALUE = re.compile(r"(?<![A-Za-z0-9_])ek_[A-Za-z0-9_.%-]+")


def redact_query(target: str) -> str:
    """A request target with the value of every credential-like query parameter replaced by `REDACTED`, and every
    client secret (`ek_…`), wherever it stands, by `ek_REDACTED`."""
    path, sep, query = target.partition("?")
    if sep:
        target = path + sep + _CREDENTIAL.sub(r"\1REDACTED", query)
    return _CLIENT_SECRET_VALUE.sub("ek_REDACTED", target)


class RedactingAccessLogger(AccessLogger):
    """aiohttp's access log with query-string credentials redacted in every field (the request line, the Referer):
    a `?api_key=` must never reach a log."""

    def _format_line(self, request: web.BaseRequest, response: web.StreamResponse,
                     time: float) -> list[tuple[Any, Any]]:
        return [(key, redact_query(value) if isinstance(value, str) else value)
                for key, value in super()._format_line(request, response, time)]
