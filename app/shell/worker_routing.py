"""Requests for state that lives in another worker process.

A WebRTC call lives in the worker that answered its offer (its peer connection, UDP ports and conversation), but
the kernel spreads later requests (`GET`/`DELETE /v1/realtime/calls/{id}`, the admin API's `/v1/calls/{id}`) over
every worker of the port. A call's id names its worker (`rtc_w3_...`, `call_w3_...`), each worker also listens on a
private Unix socket beside the engine's channel, and a worker that gets a request for another's call forwards it
there and relays the answer.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web

_OWNER = re.compile(r"(?:rtc|call)_w(\d+)_[0-9a-f]+")
# What a forwarded request keeps of the client's: its credentials and body type (not hop-by-hop headers).
_FORWARDED_HEADERS = ("Authorization", "Origin", "Content-Type", "Sec-WebSocket-Protocol")


def new_call_id(worker: int | None, kind: str = "rtc") -> str:
    """A call id naming its worker: `rtc_…` for WebRTC calls, `call_…` for the other doors' calls."""
    suffix = uuid.uuid4().hex[:24]
    return f"{kind}_{suffix}" if worker is None else f"{kind}_w{worker}_{suffix}"


def call_owner(call_id: str) -> int | None:
    """The worker a call id names, or None (a one-process server's id, or not an id of ours)."""
    match = _OWNER.fullmatch(call_id)
    return int(match.group(1)) if match else None


def worker_socket(folder: str | Path, worker: int) -> str:
    return str(Path(folder) / f"worker-{worker}.sock")


def on_private_socket(request: web.Request) -> bool:
    """A request another worker forwarded (it came on this worker's Unix socket): answer for this worker only."""
    return isinstance(request.transport.get_extra_info("sockname"), str) if request.transport else False


async def forward(request: web.Request, socket_path: str) -> web.Response:
    """Send `request` to the worker listening on `socket_path`; its answer, or 404 when that worker is gone."""
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    body = await request.read()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=socket_path)) as session, \
                session.request(request.method, f"http://worker{request.rel_url}", headers=headers,
                                data=body or None, timeout=aiohttp.ClientTimeout(total=10)) as answer:
            payload = await answer.read()
            return web.Response(status=answer.status, body=payload,
                                content_type=answer.content_type if payload else None)
    except (aiohttp.ClientError, OSError):
        return web.json_response({"type": "error", "error": {
            "type": "invalid_request_error", "code": "bad_event",
            "message": f"no live call {request.match_info.get('call_id', '')!r}"}}, status=404)
