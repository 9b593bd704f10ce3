"""A new SIP call's signalling: from an INVITE to an answered call (or its refusal), and CANCEL.

The checks that cost nothing come first (`Require` 420, allowlist 403, digest 401, `Session-Expires` 422, SDP 488,
agent 404), then 100 Trying, a slot (`admit`, the door's one admission step: 486 when full, 503 + Retry-After when
draining or the engine is down), the RTP ports, 180 Ringing, the conversation's prefill, and 200 OK with our SDP
answer. A CANCEL before the 200 gets 200 and the INVITE 487; the slot is freed. An answered call is in the live-call
list (app/calls/live.py: its recording and webhooks) with what SIP says of the caller (From, To, Call-ID) until it ends.
Agents (`--sip-agent NAME=voice,persona-file`): the request-URI's user picks one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from sipmessage import Request

from app.calls.live import LiveCall
from app.calls.recording import asked_to_record
from app.doors.sip.call import MediaSession, PortRange
from app.doors.sip.dialogs import MIN_SE, Dialog, Dialogs, capabilities
from app.doors.sip.digest import DigestAuth
from app.doors.sip.sdp import Choice, Offer, SdpError, answer, negotiate, parse_offer
from app.doors.sip.transactions import RETRY_AFTER_S, CacheKey, InviteTx, Transactions, invite_tx
from app.doors.sip.transport import Local, Peer
from app.sessions import admission
from app.sessions.errors import ProtocolError
from app.sessions.session_config import ConfigUpdate, SessionConfig, default_config, with_update
from app.shell.context import ServerContext
from media.rtp import TelephoneEvent
from model.engine import EngineError, Slot

logger = logging.getLogger(__name__)

ROUTE = "sip"                     # the route label of our admissions and rejections in /metrics


class Refusal(Exception):
    """A final non-2xx answer to an INVITE: `code` and `reason` on the wire, `label` in the metrics."""

    def __init__(self, code: int, reason: str, label: str, headers: list[tuple[str, str]] | None = None,
                 counted: bool = False) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason
        self.label = label
        self.headers = headers or []
        self.counted = counted  # in the rejection metrics already (by app.sessions.admission)


async def admit(ctx: ServerContext) -> Slot:
    """The SIP door's slot, through the one admission path every door takes (app.sessions.admission, which counts
    it), its refusals said in SIP: 486 when every slot is busy (the trunk tries no other server for it), 503 +
    Retry-After when draining or the engine is down (the failover signal)."""
    if ctx.shutting_down:
        raise Refusal(503, "Service Unavailable", "shutting_down", [("Retry-After", RETRY_AFTER_S)])
    try:
        return await admission.admit(ctx, ROUTE)
    except admission.Refused as r:
        if r.code == "resource_exhausted":
            raise Refusal(486, "Busy Here", r.code, counted=True) from None
        raise Refusal(503, "Service Unavailable", r.code, [("Retry-After", RETRY_AFTER_S)], counted=True) from None


@dataclass(frozen=True)
class Agent:
    name: str
    voice: str | None
    persona: str
    record: bool | None = None     # the agent's own wish to be recorded (`record` / `norecord` in its spec)


def parse_agents(specs: tuple[str, ...]) -> dict[str, Agent]:
    """`NAME=voice,persona-file[,record|norecord]` each (voice may be empty: the default voice; the persona file is
    read now; the last part is the agent's wish to be recorded, weighed by `--record-policy`)."""
    agents: dict[str, Agent] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        voice, _, persona_file = rest.partition(",")
        record = None
        head, comma, last = persona_file.rpartition(",")
        if comma and last.strip() in ("record", "norecord"):
            persona_file, record = head, last.strip() == "record"
        if not sep or not name.strip():
            raise ValueError(f"--sip-agent takes NAME=voice,persona-file[,record|norecord], got {spec!r}")
        persona = Path(persona_file.strip()).expanduser().read_text() if persona_file.strip() else ""
        agents[name.strip()] = Agent(name.strip(), voice.strip() or None, persona, record)
    return agents


class Invites:
    """New calls: each INVITE answered in a task of its own (`InviteTx.task`), which a CANCEL or shutdown cancels."""

    def __init__(self, ctx: ServerContext, transactions: Transactions, dialogs: Dialogs, local: Local) -> None:
        s = ctx.settings
        self.ctx = ctx
        self.settings = s
        self.transactions = transactions
        self.dialogs = dialogs
        self.local = local
        self.ports = PortRange(s.rtp_ports)
        self.agents = parse_agents(s.sip_agents)
        self.allow = [ipaddress.ip_network(c, strict=False) for c in s.sip_allow]
        self.auth = DigestAuth(s.sip_user, s.sip_password, s.sip_realm) if s.sip_user else None

    def on_invite(self, req: Request, peer: Peer, reply_to: tuple[str, int]) -> None:
        if self.transactions.full():
            self.ctx.metrics.sip["invite_overload"] += 1
            self.transactions.reply(req, peer, reply_to, 503, "Service Unavailable", to_tag=secrets.token_hex(6),
                                    headers=[("Retry-After", RETRY_AFTER_S)])
            return
        tx = self.transactions.open(invite_tx(req, peer, reply_to))
        tx.task = asyncio.get_running_loop().create_task(self._answer(req, tx))

    async def _answer(self, req: Request, tx: InviteTx) -> None:
        tag = secrets.token_hex(6)
        dialog: Dialog | None = None
        send = self.transactions.send
        try:
            offer, choice, agent, update = self._check(req, tx.peer)
            session_expires = self._session_timer(req)
            send(tx, req, 100, "Trying")
            slot = await admit(self.ctx)
            media = MediaSession(slot, choice, self.ctx.metrics, self.settings.host,
                                 on_event=lambda e: self._on_dtmf(req.call_id, e),
                                 on_failure=lambda e: self._on_engine_failure(req.call_id, e),
                                 on_timeout=lambda: self._on_rtp_timeout(req.call_id))
            dialog = self.dialogs.create(req, tx, tag, agent.name if agent else "", media)
            try:
                await media.open(self.ports)
            except OSError:
                raise Refusal(503, "Service Unavailable", "rtp_ports_exhausted",
                              [("Retry-After", RETRY_AFTER_S)]) from None
            send(tx, req, 180, "Ringing", tag, [("Contact", self.local.contact(req, tx.peer))])
            try:
                config = with_update(self.ctx, default_config(self.ctx), update, prefix="sip.")
                dialog.call = self._open_call(req, tx.peer, dialog, agent, choice, config)
                await media.start(config.params())
            except (ProtocolError, EngineError) as e:
                logger.warning("SIP call %s: the conversation did not start: %s", req.call_id, e)
                raise Refusal(500, "Server Internal Error", getattr(e, "code", "engine_error")) from None
            if dialog.ended:                    # the engine failed the conversation as it started
                raise Refusal(500, "Server Internal Error", "engine_error")
            dialog.offer_body = req.body
            dialog.answer_body = answer(offer, choice, self.local.advertised(tx.peer), media.port, dialog.session_id,
                                        dialog.version)
            headers = [("Contact", self.local.contact(req, tx.peer)), *capabilities()]
            if session_expires:
                dialog.session_expires = session_expires
                headers += [("Session-Expires", f"{session_expires};refresher=uac"), ("Require", "timer")]
                self.dialogs.arm_session_timer(dialog)
            send(tx, req, 200, "OK", tag, headers, dialog.answer_body)
            self.transactions.retransmit(
                tx, on_timeout=lambda: self.dialogs.end(dialog, "no_ack", send_bye=True) if dialog else None)
            logger.info("SIP call %s from %s: %s, agent %r", req.call_id, tx.peer.addr, choice.codec.rtpmap(),
                        dialog.agent or "default")
        except Refusal as r:
            if not r.counted:
                self.ctx.metrics.rejections[(ROUTE, r.label)] += 1
            if dialog is not None:
                self.dialogs.end(dialog, r.label, send_bye=False)
            send(tx, req, r.code, r.reason, tag, r.headers)
            self.transactions.retransmit(tx)
        except asyncio.CancelledError:
            if dialog is not None:
                self.dialogs.end(dialog, "cancelled", send_bye=False)
            raise

    def _check(self, req: Request, peer: Peer) -> tuple[Offer, Choice, Agent | None, ConfigUpdate]:
        """Everything refused before a slot is taken, cheapest first."""
        require = [o.strip() for o in (req.headers.get("Require") or "").split(",") if o.strip()]
        unsupported = [o for o in require if o != "timer"]
        if unsupported:
            raise Refusal(420, "Bad Extension", "bad_extension", [("Unsupported", ", ".join(unsupported))])
        source = ipaddress.ip_address(peer.addr[0])
        if self.allow and not any(source in net for net in self.allow):
            raise Refusal(403, "Forbidden", "address_not_allowed")
        if self.auth is not None:
            self._authenticate(req)
        try:
            offer = parse_offer(req.body) if req.body else None
        except SdpError as e:
            raise Refusal(488, "Not Acceptable Here", "bad_sdp", [("Warning", f'399 personaplex "{e}"')]) from None
        if offer is None:
            raise Refusal(488, "Not Acceptable Here", "no_offer",
                          [("Warning", '399 personaplex "an INVITE without an SDP offer is not supported"')])
        choice = negotiate(offer)
        if choice is None:
            raise Refusal(488, "Not Acceptable Here", "no_common_codec",
                          [("Warning", '305 personaplex "Incompatible media format"')])
        user = req.uri.user or ""
        agent = self.agents.get(user) or self.agents.get("default")
        if self.agents and agent is None:
            raise Refusal(404, "Not Found", "unknown_agent")
        update = ConfigUpdate(persona=agent.persona if agent else None)
        if agent is not None and agent.voice:
            update.voice = agent.voice
        if self.settings.sip_x_headers:
            if req.headers.get("X-Persona"):
                update.persona = req.headers.get("X-Persona")
            if req.headers.get("X-Voice"):
                update.voice = req.headers.get("X-Voice")
        try:
            with_update(self.ctx, default_config(self.ctx), update, prefix="sip.")
        except ProtocolError as e:
            raise Refusal(400, "Bad Request", e.code, [("Warning", f'399 personaplex "{e}"')]) from None
        return offer, choice, agent, update

    def _authenticate(self, req: Request) -> None:
        assert self.auth is not None
        creds = req.authorization
        if creds is not None and creds.scheme.lower() == "digest":
            params = {k: str(v) for k, v in creds.parameters.items() if v is not None}
            check = self.auth.check(params, req.method)
            if check.ok:
                return
            if check.stale:
                raise Refusal(401, "Unauthorized", "stale_nonce",
                              [("WWW-Authenticate", c) for c in self.auth.challenges(stale=True)])
            self.ctx.metrics.sip["auth_failed"] += 1
        raise Refusal(401, "Unauthorized", "unauthorized", [("WWW-Authenticate", c) for c in self.auth.challenges()])

    def _session_timer(self, req: Request) -> int:
        """The Session-Expires we accept (0: no session timer for this call); 422 below our minimum."""
        raw = req.headers.get("Session-Expires")
        if not raw:
            return 0
        try:
            value = int(raw.split(";")[0].strip())
        except ValueError:
            raise Refusal(400, "Bad Session-Expires", "bad_session_expires") from None
        if value < MIN_SE:
            raise Refusal(422, "Session Interval Too Small", "session_interval_too_small", [("Min-SE", str(MIN_SE))])
        supported = [o.strip() for o in (req.headers.get("Supported") or "").split(",")]
        return value if "timer" in supported else 0

    def on_cancel(self, req: Request, peer: Peer, reply_to: tuple[str, int], key: CacheKey) -> None:
        tx = self.transactions.pending(req)
        if tx is None:
            self.transactions.reply(req, peer, reply_to, 481, "Call/Transaction Does Not Exist", cache=key)
            return
        self.transactions.reply(req, peer, reply_to, 200, "OK", cache=key)
        if tx.final:
            return                             # answered already: the CANCEL has no effect (RFC 3261 §9.2)
        if tx.task is not None:
            tx.task.cancel()
        self.ctx.metrics.rejections[(ROUTE, "cancelled")] += 1
        dialog = self.dialogs.dialogs.get(req.call_id)
        if dialog is not None:
            self.dialogs.end(dialog, "cancelled", send_bye=False)
        self.transactions.send(tx, tx.request, 487, "Request Terminated", secrets.token_hex(6))
        self.transactions.retransmit(tx)

    # ---- the answered call -----------------------------------------------------------------------------------

    def _open_call(self, req: Request, peer: Peer, dialog: Dialog, agent: Agent | None, choice: Choice,
                   config: SessionConfig) -> LiveCall:
        """The call in the live-call list, with what SIP says of the caller (before the conversation starts)."""
        assert dialog.media is not None
        record = agent.record if agent is not None else None
        if self.settings.sip_x_headers and req.headers.get("X-Record"):
            record = asked_to_record(req.headers.get("X-Record"))
        caller = {"from": req.headers.get("From"), "to": req.headers.get("To"), "call_id": req.call_id,
                  "remote": f"{peer.addr[0]}:{peer.addr[1]}", "agent": dialog.agent or "default"}
        return self.ctx.calls.open(ROUTE, dialog.media.conversation, CallOwner(self.dialogs, dialog), caller=caller,
                                   codec=choice.codec.rtpmap(), record=record,
                                   agent={"persona": config.persona, "voice": config.voice})

    def _on_dtmf(self, call_id: str, event: TelephoneEvent) -> None:
        logger.info("SIP call %s: telephone-event %s", call_id, event.name)

    def _on_engine_failure(self, call_id: str, error: EngineError) -> None:
        dialog = self.dialogs.dialogs.get(call_id)
        if dialog is not None:
            logger.warning("SIP call %s: the engine failed it (%s); hanging up", call_id, error.message)
            self.dialogs.end(dialog, error.code, send_bye=dialog.confirmed)

    def _on_rtp_timeout(self, call_id: str) -> None:
        dialog = self.dialogs.dialogs.get(call_id)
        if dialog is not None:
            self.ctx.metrics.sip["rtp_timeout"] += 1
            self.dialogs.end(dialog, "rtp_timeout", send_bye=True)


class CallOwner:
    """A SIP call as the live-call list drives it: hung up with a BYE, its queued audio cut, its media figures."""

    def __init__(self, dialogs: Dialogs, dialog: Dialog) -> None:
        self.dialogs = dialogs
        self.dialog = dialog

    async def hang_up(self, reason: str) -> None:
        self.dialogs.end(self.dialog, reason, send_bye=True)

    def cut_output(self) -> None:
        if self.dialog.media is not None:
            self.dialog.media.cut()
            self.dialogs.ctx.calls.note(self.dialog.call, {"event": "cut", **self.call_details()})

    def call_details(self) -> dict[str, object]:
        media = self.dialog.media
        if media is None:
            return {}
        snapshot = media.snapshot()
        return {k: snapshot[k] for k in ("sent_s", "out_silence_ms", "out_underruns", "out_shed_ms", "packets_sent",
                                         "packets_received", "lost")}
