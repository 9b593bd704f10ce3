"""Live calls: every conversation of every door in one list per process, what follows a call's start and end (its
recording, its webhooks), and the admin API over every worker.

A door opens a `LiveCall` for each conversation (`CallRegistry.open`, before the conversation starts) and ends it
once (`CallRegistry.end`, idempotent) with the reason the call ended. Opening starts the recording (when the
server records and the policy lets this call be recorded: app/calls/recording.py), writes a small marker file for the
call, and emits `call.started` (app/calls/webhooks.py); ending finishes the recording, writes `call.json`, emits
`call.ended` with the call's stats and the recording's paths, and removes the marker. A marker still there when a
process starts belongs to a call whose process died (kill -9, an out-of-memory kill): the process started in its
place (the same worker number, or the server started again) ends it with reason `worker_lost`: `call.ended`, and
`call.json` beside the recording, which holds the call up to the kill.

Admin API (`--admin-key`, never a client key): `GET /v1/calls` lists the live calls of every door and every
worker (each worker answers for its own over its private socket, app/shell/worker_routing.py); `DELETE /v1/calls/{id}`
hangs one up (the client hears why: `session.closed` or the close frame's reason, `admin_hangup`; SIP a BYE);
`POST /v1/calls/{id}/cut` drops what the caller is about to hear (a phone line's queued audio and the vendor's
buffer: Twilio's `clear`; a Realtime response is cut as a `response.cancel` would).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp import web

from app.calls.recording import FACTS, Recording, RecordingWriter, iso, wanted
from app.calls.webhooks import Webhooks
from app.sessions.errors import http_error_body
from app.sessions.link import input_report
from app.shell.auth import key_ok
from app.shell.context import CONTEXT
from app.shell.metrics import Metrics
from app.shell.settings import Settings
from app.shell.worker_routing import call_owner, forward, new_call_id, on_private_socket, worker_socket

if TYPE_CHECKING:
    from app.sessions.conversation import Conversation
    from model.engine import FrameOutput

logger = logging.getLogger(__name__)

CALLS_ROUTE = "/v1/calls"
ADMIN_HANGUP = "admin_hangup"
WORKER_LOST = "worker_lost"


class CallOwner(Protocol):
    """What a door gives the registry for each call."""

    async def hang_up(self, reason: str) -> None: ...   # end the call, telling the client why
    def cut_output(self) -> None: ...                     # drop what the caller is about to hear
    def call_details(self) -> dict[str, Any]: ...         # the door's own figures now (heard_s, codec stats...)


@dataclass
class LiveCall:
    id: str
    door: str
    conversation: Conversation
    owner: CallOwner
    caller: dict[str, Any]                   # the identity the door carries (SIP From/To, Twilio callSid, ...)
    codec: str
    worker: str
    started_at: float = field(default_factory=time.time)
    recording: Recording | None = None
    ended: bool = False
    configured: dict[str, Any] = field(default_factory=dict)   # persona and voice as the door set them up

    def agent(self) -> dict[str, Any]:
        """Persona and voice: the conversation's once it started, before that what the door configured."""
        params = self.conversation.params
        if params is None:
            return {"persona": self.configured.get("persona"), "voice": self.configured.get("voice")}
        return {"persona": params.persona, "voice": params.voice}

    def stats(self) -> dict[str, Any]:
        """The engine's counters, the door's own figures, and `input`: the caller's link as the input buffer saw it
        over the call so far (arrival jitter, target, the latency it added, concealment, underruns, cuts)."""
        link = input_report(self.conversation)
        return {**self.conversation.counters(), **self.owner.call_details(), **({"input": link} if link else {})}

    def describe(self) -> dict[str, Any]:
        """The call as `GET /v1/calls` and the webhooks show it."""
        return {"id": self.id, "door": self.door, "worker": self.worker, "started_at": iso(self.started_at),
                "caller": self.caller, "agent": self.agent(), "codec": self.codec,
                "state": self.conversation.state.value, "stats": self.stats(),
                "recording": self.recording.paths if self.recording else None}


class CallRegistry:
    """One process's live calls, recordings and webhooks (`ctx.calls`)."""

    def __init__(self, settings: Settings, metrics: Metrics, worker: int | None) -> None:
        self.settings = settings
        self.worker = worker
        self.worker_name = "main" if worker is None else str(worker)
        self.calls: dict[str, LiveCall] = {}
        self.spool = settings.spool_dir or settings.cache_dir / f"spool-{settings.port}"
        self.markers = self.spool / "live" / self.worker_name
        # Marker files are written and removed in order, off the event loop, by one thread of their own.
        self._disk = ThreadPoolExecutor(1, thread_name_prefix="call-markers")
        self.writer = RecordingWriter(settings.record_dir, metrics.recordings) if settings.record_dir else None
        self.webhooks = Webhooks(settings.webhook_url, settings.webhook_secret, self.spool / "webhooks",
                                 metrics.webhooks, retry_s=settings.webhook_retry_s,
                                 backoff_max_s=settings.webhook_backoff_max_s,
                                 first_backoff_s=min(1.0, settings.webhook_backoff_max_s)) \
            if settings.webhook_url else None

    @property
    def keeps_markers(self) -> bool:
        return self.writer is not None or self.webhooks is not None

    # ---- lifetime --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """At the process's start: end the calls a dead predecessor left live, then start sending webhooks."""
        for marker in sorted(self.markers.glob("*.json")) if self.markers.is_dir() else []:
            self._lost(marker)
        if self.webhooks is not None:
            self.webhooks.start()

    async def stop(self) -> None:
        if self.webhooks is not None:
            await self.webhooks.stop()
        if self.writer is not None:
            self.writer.close()
        self._disk.shutdown(wait=True)

    # ---- calls -----------------------------------------------------------------------------------------------

    def open(self, door: str, conversation: Conversation, owner: CallOwner, *, caller: dict[str, Any] | None = None,
             codec: str = "", record: bool | None = None, call_id: str | None = None,
             agent: dict[str, Any] | None = None, defer_record: bool = False) -> LiveCall:
        """Register a call (before its conversation starts); `record` is the session's or agent's wish, which the
        server's policy weighs (app.calls.recording.wanted); `agent` the persona and voice the door set up.
        `defer_record`: the session states its wish later, and `start_recording` decides as its conversation
        starts."""
        call = LiveCall(call_id or new_call_id(self.worker, "call"), door, conversation, owner, caller or {}, codec,
                        self.worker_name, configured=agent or {})
        self.calls[call.id] = call
        if not defer_record:
            self.start_recording(call, record)
        started = call.describe()
        if call.recording is not None:
            started["recording"] = call.recording.paths
        if self.keeps_markers:
            self._disk.submit(self._write_marker, call.id, {"call": started, "started_at": call.started_at})
        if self.webhooks is not None:
            self.webhooks.emit("call.started", started)
        return call

    def start_recording(self, call: LiveCall | None, record: bool | None) -> None:
        """Record the call if the server records and its policy takes the wish `record` (before the conversation's
        first frame; once per call)."""
        if call is None or call.recording is not None or call.ended or self.writer is None \
                or not wanted(self.settings.record_policy, record):
            return
        call.recording = self.writer.start(call.id, call.started_at, self._facts(call))
        call.conversation.add_input_tap(call.recording.input_frame)
        call.conversation.add_listener(lambda frame: self._recorded(call, frame))

    def _recorded(self, call: LiveCall, frame: FrameOutput) -> None:
        if call.recording is not None and not call.ended:
            call.recording.output_frame(frame, call.conversation.counters()["frames_in"])

    def end(self, call: LiveCall | None, reason: str) -> None:
        """The call is over (idempotent): finish its recording, say `call.ended`, forget it."""
        if call is None or call.ended:
            return
        call.ended = True
        self.calls.pop(call.id, None)
        ended_at = time.time()
        summary = {**call.describe(), "ended_at": iso(ended_at), "end_reason": reason,
                   "duration_s": round(ended_at - call.started_at, 3)}
        if call.recording is not None:
            call.recording.finish({**self._facts(call), "ended_at": summary["ended_at"], "end_reason": reason,
                                   "duration_s": summary["duration_s"], "stats": summary["stats"]})
        if self.webhooks is not None:
            self.webhooks.emit("call.ended", summary)
        if self.keeps_markers:
            self._disk.submit(self._remove_marker, call.id)

    def note(self, call: LiveCall | None, event: dict[str, Any]) -> None:
        """A line in the call's transcript (a cut, say), when it is recorded."""
        if call is not None and call.recording is not None and not call.ended:
            call.recording.note(event)

    def _facts(self, call: LiveCall) -> dict[str, Any]:
        return {"call_id": call.id, "door": call.door, "worker": call.worker, "codec": call.codec,
                "caller": call.caller, "agent": call.agent(), "started_at": iso(call.started_at)}

    # ---- markers: what a dead process leaves behind ----------------------------------------------------------

    def _write_marker(self, call_id: str, marker: dict[str, Any]) -> None:
        try:
            self.markers.mkdir(parents=True, exist_ok=True)
            partial = self.markers / f"{call_id}.json.partial"
            partial.write_text(json.dumps(marker))
            partial.replace(self.markers / f"{call_id}.json")
        except OSError as e:
            logger.error("call %s: its marker was not written (%s): a crash would not report it", call_id, e)

    def _remove_marker(self, call_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.markers / f"{call_id}.json").unlink(missing_ok=True)

    def _lost(self, marker: Path) -> None:
        """A call a dead process left live: `call.ended` (`worker_lost`) and its recording's `call.json`."""
        try:
            found = json.loads(marker.read_text())
            call, started_at = found["call"], float(found["started_at"])
        except (OSError, ValueError, KeyError, TypeError):
            logger.error("unreadable call marker %s; removed", marker)
            marker.unlink(missing_ok=True)
            return
        ended_at = time.time()
        recording = call.get("recording") or {}
        audio = Path(recording["audio"]) if recording.get("audio") else None
        with contextlib.suppress(OSError):
            if audio is not None and audio.is_file():
                ended_at = audio.stat().st_mtime       # its last write: about when the process died
        summary = {**call, "ended_at": iso(ended_at), "end_reason": WORKER_LOST,
                   "duration_s": round(ended_at - started_at, 3)}
        logger.warning("call %s was live in a process that died: ended (%s)", call.get("id"), WORKER_LOST)
        if recording.get("folder"):
            with contextlib.suppress(OSError, ValueError):
                facts_path = Path(recording["folder"]) / FACTS
                facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
                facts.update(ended_at=summary["ended_at"], end_reason=WORKER_LOST, duration_s=summary["duration_s"])
                facts_path.write_text(json.dumps(facts, indent=1, ensure_ascii=False))
        if self.webhooks is not None:
            self.webhooks.emit("call.ended", summary)
        marker.unlink(missing_ok=True)


# ---- the admin API ---------------------------------------------------------------------------------------------

def _admin_refusal(request: web.Request) -> web.Response | None:
    settings = request.app[CONTEXT].settings
    if not settings.admin_key:
        return web.json_response(http_error_body("unauthorized", "the admin API is off: start the server with "
                                                 "--admin-key"), status=403)
    if not key_ok(request, (settings.admin_key,)):
        return web.json_response(http_error_body("unauthorized", "the admin key is required"), status=401)
    return None


async def list_calls(request: web.Request) -> web.Response:
    refused = _admin_refusal(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    calls = [call.describe() for call in ctx.calls.calls.values()]
    engine = ctx.engine
    if not on_private_socket(request) and hasattr(engine, "workers"):
        for number in sorted(int(n) for n in engine.workers if int(n) != engine.worker):
            calls += await _calls_of(request, worker_socket(engine.folder, number))
    calls.sort(key=lambda c: c["started_at"])
    return web.json_response({"object": "list", "data": calls})


async def _calls_of(request: web.Request, path: str) -> list[dict[str, Any]]:
    """Another worker's own calls (none when it does not answer: it is gone, and its calls with it)."""
    headers = {"Authorization": request.headers["Authorization"]} if "Authorization" in request.headers else {}
    query = f"?api_key={request.query['api_key']}" if "api_key" in request.query else ""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http, \
                http.get(f"http://worker{CALLS_ROUTE}{query}", headers=headers,
                         timeout=aiohttp.ClientTimeout(total=5)) as answer:
            return (await answer.json())["data"] if answer.status == 200 else []
    except (aiohttp.ClientError, OSError, ValueError, KeyError):
        return []


async def _act(request: web.Request, act: Callable[[LiveCall], Awaitable[None]]) -> web.Response:
    refused = _admin_refusal(request)
    if refused is not None:
        return refused
    ctx = request.app[CONTEXT]
    call_id = request.match_info["call_id"]
    call = ctx.calls.calls.get(call_id)
    if call is None:
        owner, engine = call_owner(call_id), ctx.engine
        if owner is not None and hasattr(engine, "workers") and owner != engine.worker and \
                not on_private_socket(request):
            return await forward(request, worker_socket(engine.folder, owner))
        return web.json_response(http_error_body("bad_event", f"no live call {call_id!r}"), status=404)
    await act(call)
    return web.Response(status=204)


async def hang_up_call(request: web.Request) -> web.Response:
    return await _act(request, lambda call: call.owner.hang_up(ADMIN_HANGUP))


async def cut_call(request: web.Request) -> web.Response:
    async def cut(call: LiveCall) -> None:
        call.owner.cut_output()
    return await _act(request, cut)


def setup_calls(app: web.Application) -> None:
    """The admin routes, and the registry's start (lost calls, webhooks) and stop with the app."""
    async def start(app: web.Application) -> None:
        await app[CONTEXT].calls.start()

    async def stop(app: web.Application) -> None:
        await app[CONTEXT].calls.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get(CALLS_ROUTE, list_calls)
    app.router.add_delete(CALLS_ROUTE + "/{call_id}", hang_up_call)
    app.router.add_post(CALLS_ROUTE + "/{call_id}/cut", cut_call)
