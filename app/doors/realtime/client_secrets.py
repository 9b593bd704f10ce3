"""Ephemeral client secrets, as OpenAI defines them: `POST /v1/realtime/client_secrets` mints a short-lived `ek_…`
key bound to a Realtime session config, so that a browser never holds the server's API key.

The request is `{"expires_after": {"anchor": "created_at", "seconds": N}, "session": {...}}` (both optional; N from
10 to 7200, default 600) and needs the server's API key when keys are configured; the answer is
`{"value": "ek_…", "expires_at": <unix seconds>, "session": {...}}`. The secret is then presented exactly like a key
(`Authorization: Bearer`, `?api_key=`, the `openai-insecure-api-key.` subprotocol) to `WS /v1/realtime` or
`POST /v1/realtime/calls`, and the session it opens starts with the bound config applied as a `session.update` would
apply it (on the WebSocket `session.created` already carries it; on a call the offer's own `session` part goes over
it). One secret opens one session (OpenAI's open any number until they expire: ours are stricter, so a leaked one
is worth one conversation). A second use, an expired secret, and one no key of this server signed get HTTP 401
(`client_secret_used`, `client_secret_expired`, `invalid_client_secret`) before any upgrade, offer or slot; the
request that presents a good one spends it, whatever happens to the session next (a full server, a bad offer). An
unspent secret may also read what opening its session needs (`GET /v1/voices`, `GET /v1/realtime/webrtc-config`)
without spending it; it opens nothing else.

Design. A secret describes itself: `ek_` + base64url(zlib(JSON {id, exp, session})) + `.` + base64url(HMAC-SHA256
of that). Any process holding the signing key checks signature and expiry from the value alone and reads the bound
session from it; nothing is stored about a secret until it is used. The signing key is derived from the API key
that minted it (HMAC of a fixed label), so every process of every server configured with that key accepts the
secret, and taking the key off a server revokes its secrets there. Without API keys it is a random key, made once
per server and kept with the single-use record. That record must be seen by every worker process of the server: it
is a SQLite table in the server's runtime folder (the supervisor's private temporary folder beside the engine
channel's sockets; in memory for a one-process server), where the first use inserts the secret's id and a second
insert of the same id fails, atomically across the processes (SQLite's file lock). Not the engine process: it owns
the GPU tick, and its channel carries frames; this needs no new channel message, no round trip to a busy process,
and survives a worker's restart.

Across several servers behind a balancer: a secret minted by one (with the API key they share) opens a session on
any of them, but each keeps its own single-use record, so within its lifetime one secret could open one session on
each server, and a restarted server (a new runtime folder) has forgotten what was used. Keep lifetimes short, or
make the balancer send a client's connect to the server that minted; a shared record (Redis `SET NX` with the
secret's expiry, say) would close the gap and is not built in. Without API keys a secret works only on the server
that minted it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import os
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from app.doors.realtime.update import read_update
from app.sessions.errors import ProtocolError, http_error_body
from app.sessions.session_config import default_config, with_update
from app.sessions.wire import WireError, parse_object
from app.shell.auth import CLIENT_SECRET, key_ok, origin_ok, presented_key, refusal
from app.shell.context import CONTEXT, ServerContext
from model.engine.pool import EnginePool

ROUTE = "/v1/realtime/client_secrets"
PREFIX = "ek_"
DEFAULT_TTL_S, MIN_TTL_S, MAX_TTL_S = 600, 10, 7200     # OpenAI's default and bounds
# A secret travels in one header line: aiohttp takes 8190 bytes, nginx 8 KiB by default; the rest is for the header's
# name and a browser's other subprotocols. English instructions of 8000 characters (the most a session takes) made
# secrets of 3800-4400 characters (two of our own documents).
MAX_SECRET_CHARS = 6144
OPENS = frozenset({("GET", "/v1/realtime"), ("POST", "/v1/realtime/calls")})
READS = frozenset({("GET", "/v1/voices"), ("GET", "/v1/realtime/webrtc-config")})
_LABEL = b"personaplex client secret v1"


@dataclass(frozen=True)
class Claim:
    """What a checked secret says: the id of the session it opens, its expiry, the session it is bound to."""

    id: str
    expires_at: int
    session: dict[str, Any]


class SecretRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def _derive(api_key: str) -> bytes:
    return hmac.new(api_key.encode(), _LABEL, hashlib.sha256).digest()


def _tag(key: bytes, body: str) -> bytes:
    return hmac.new(key, body.encode("ascii"), hashlib.sha256).digest()


class UsedSecrets:
    """The single-use record (the ids of spent secrets until they expire) and, for a server without API keys, its
    signing key: SQLite, in a file every process of the server opens, or in memory. Calls block for a moment (on
    another process's write at worst): run them off the event loop."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            # The record dies with the server's runtime folder: no fsync is worth its latency.
            self._db.execute("PRAGMA synchronous=OFF")
            self._db.execute("CREATE TABLE IF NOT EXISTS used (id TEXT PRIMARY KEY, expires_at INTEGER NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS server (name TEXT PRIMARY KEY, value BLOB NOT NULL)")

    def signing_key(self) -> bytes:
        """The server's own random key: the first process to ask makes it, the others read it."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO server VALUES ('signing_key', ?)", (os.urandom(32),))
            return bytes(self._db.execute("SELECT value FROM server WHERE name = 'signing_key'").fetchone()[0])

    def take(self, claim: Claim, now: float) -> bool:
        """Record the claim's use; False when it was used before. Expired ids are dropped on the way (an expired
        secret is refused before it gets here)."""
        with self._lock:
            self._db.execute("DELETE FROM used WHERE expires_at <= ?", (now,))
            try:
                self._db.execute("INSERT INTO used VALUES (?, ?)", (claim.id, claim.expires_at))
            except sqlite3.IntegrityError:
                return False
            return True

    def spent(self, claim: Claim) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM used WHERE id = ?", (claim.id,)).fetchone() is not None

    def close(self) -> None:
        with self._lock:
            self._db.close()


class ClientSecrets:
    """Mints, checks and spends one server's client secrets (an instance per process)."""

    def __init__(self, api_keys: tuple[str, ...], used: UsedSecrets) -> None:
        self.used = used
        self.clock: Callable[[], float] = time.time      # the expiry's clock (tests move it)
        self._derived = {key: _derive(key) for key in api_keys}
        self._keys = list(self._derived.values()) or [used.signing_key()]

    def mint(self, session: dict[str, Any], ttl_s: int, api_key: str | None) -> tuple[str, Claim]:
        """A secret for `session`, signed with the key derived from `api_key` (the one that authorized the mint;
        without API keys, the server's own key)."""
        claim = Claim(id=f"sess_{uuid.uuid4().hex[:24]}", expires_at=int(self.clock()) + ttl_s, session=session)
        payload = json.dumps({"id": claim.id, "exp": claim.expires_at, "session": session}, separators=(",", ":"))
        body = _b64(zlib.compress(payload.encode(), 9))
        key = self._derived.get(api_key or "", self._keys[0])
        return f"{PREFIX}{body}.{_b64(_tag(key, body))}", claim

    def check(self, value: str) -> Claim:
        """The claim of an unexpired secret signed by one of this server's keys; else `SecretRefused`."""
        invalid = SecretRefused("invalid_client_secret", "not a client secret of this server (a wrong signature or "
                                f"a garbled value): mint one with POST {ROUTE}")
        body, dot, tag = value[len(PREFIX):].rpartition(".")
        if not dot or len(value) > MAX_SECRET_CHARS:
            raise invalid
        try:
            given = _unb64(tag)
        except (binascii.Error, ValueError):
            raise invalid from None
        # Every key is compared, in constant time, so the timing tells nothing about which key matched.
        if not any([hmac.compare_digest(given, _tag(key, body)) for key in self._keys]):
            raise invalid
        try:   # signed by this server: only a bug of ours would fail here
            data = json.loads(zlib.decompress(_unb64(body)))
            claim = Claim(id=str(data["id"]), expires_at=int(data["exp"]), session=dict(data["session"]))
        except (binascii.Error, zlib.error, ValueError, KeyError, TypeError):
            raise invalid from None
        if self.clock() >= claim.expires_at:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(claim.expires_at))
            raise SecretRefused("client_secret_expired", f"this client secret expired at {when}: mint a new one")
        return claim

    async def redeem(self, value: str) -> Claim:
        """Check and spend the secret: a second redeem, by any process of the server, is refused."""
        claim = self.check(value)
        if not await asyncio.to_thread(self.used.take, claim, self.clock()):
            raise _used()
        return claim

    async def peek(self, value: str) -> Claim:
        """Check the secret without spending it (it must be unspent)."""
        claim = self.check(value)
        if await asyncio.to_thread(self.used.spent, claim):
            raise _used()
        return claim


def _used() -> SecretRefused:
    return SecretRefused("client_secret_used", "this client secret has already opened a session, and each opens "
                                               "one: mint a new one")


CLIENT_SECRETS = web.AppKey("personaplex_client_secrets", ClientSecrets)


def _error(status: int, code: str, message: str, param: str | None = None) -> web.Response:
    body = http_error_body(code, message)
    if param is not None:
        body["error"]["param"] = param
    headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


# ---- minting ---------------------------------------------------------------------------------------------------

def _ttl(value: object) -> int:
    if value is None:
        return DEFAULT_TTL_S
    if not isinstance(value, dict):
        raise ProtocolError("bad_event", "`expires_after` must be an object: {\"anchor\": \"created_at\", "
                            "\"seconds\": N}", param="expires_after")
    if value.get("anchor", "created_at") != "created_at":
        raise ProtocolError("bad_event", "`expires_after.anchor` must be \"created_at\"", param="expires_after.anchor")
    seconds = value.get("seconds", DEFAULT_TTL_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise ProtocolError("bad_event", f"`expires_after.seconds` must be a whole number of seconds from {MIN_TTL_S} "
                            f"to {MAX_TTL_S}, got {seconds!r}", param="expires_after.seconds")
    return seconds


def _session(ctx: ServerContext, value: object) -> dict[str, Any]:
    """The session to bind, checked now as a `session.update` would check it (so that a bad one fails the mint,
    not the connect)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError("invalid_session_config", "`session` must be an object (a realtime session config)",
                            param="session")
    with_update(ctx, default_config(ctx), read_update(value).config)
    return value


def session_view(ctx: ServerContext, claim: Claim) -> dict[str, Any]:
    """The mint answer's `session`: the bound config as a `realtime.session` with the id the session will have."""
    return {**claim.session, "type": "realtime", "object": "realtime.session", "id": claim.id,
            "model": ctx.model_id}


async def create_client_secret(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    refused = refusal(request, ctx.settings.api_keys, ctx.settings.allowed_origins)
    if refused is not None:
        return refused
    try:
        body = parse_object(await request.text()) if request.can_read_body else {}
        ttl_s, session = _ttl(body.get("expires_after")), _session(ctx, body.get("session"))
    except (WireError, UnicodeDecodeError) as e:
        return _error(400, "invalid_json", f"the body must be a JSON object: {e}")
    except ProtocolError as e:
        return _error(400, e.code, e.message, e.param)
    value, claim = request.app[CLIENT_SECRETS].mint(session, ttl_s, presented_key(request))
    if len(value) > MAX_SECRET_CHARS:
        return _error(400, "invalid_session_config", f"this session makes a {len(value)}-character secret; a "
                      f"secret travels in one header and may have {MAX_SECRET_CHARS}: shorten `instructions`, or send "
                      "the rest in a session.update once connected", "session")
    return web.json_response({"value": value, "expires_at": claim.expires_at, "session": session_view(ctx, claim)})


# ---- accepting -------------------------------------------------------------------------------------------------

@web.middleware
async def accept_client_secrets(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Check a presented `ek_` secret on the routes that take one (spending it on those that open a session) and
    mark the request with its claim; refuse a bad one with HTTP 401. Other requests pass untouched."""
    value = presented_key(request)
    door = (request.method, request.path)
    if value is None or not value.startswith(PREFIX) or (door not in OPENS and door not in READS):
        return await handler(request)
    ctx = request.app[CONTEXT]
    keys = ctx.settings.api_keys
    if (keys and key_ok(request, keys)) or not origin_ok(request, ctx.settings.allowed_origins):
        return await handler(request)   # an API key that looks like a secret; or the handler's 403, nothing spent
    secrets = request.app[CLIENT_SECRETS]
    try:
        claim = await (secrets.redeem(value) if door in OPENS else secrets.peek(value))
    except SecretRefused as e:
        ctx.metrics.rejections[(request.path, e.code)] += 1
        return _error(401, e.code, e.message)
    request[CLIENT_SECRET] = claim
    return await handler(request)


def merged_session(bound: dict[str, Any], given: dict[str, Any] | None) -> dict[str, Any]:
    """`given` (a call offer's own `session` part) over the secret's `bound` session, object by object."""
    out = dict(bound)
    for key, value in (given or {}).items():
        inner = out.get(key)
        out[key] = merged_session(inner, value) if isinstance(value, dict) and isinstance(inner, dict) else value
    return out


def setup_client_secrets(app: web.Application) -> None:
    """The mint route and the check of presented secrets; the single-use record in the server's runtime folder (a
    worker process) or in memory (one process)."""
    ctx = app[CONTEXT]
    folder = ctx.engine.folder if isinstance(ctx.engine, EnginePool) else None
    used = UsedSecrets(str(Path(folder) / "client-secrets.sqlite") if folder else ":memory:")
    app[CLIENT_SECRETS] = ClientSecrets(ctx.settings.api_keys, used)
    app.middlewares.append(accept_client_secrets)
    app.router.add_post(ROUTE, create_client_secret)

    async def close(app: web.Application) -> None:
        app[CLIENT_SECRETS].used.close()

    app.on_cleanup.append(close)
