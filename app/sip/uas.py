"""The SIP user agent server (RFC 3261) a trunk calls: transports, transactions, dialogs, access, routing.

Transports: UDP and TCP on `--sip-port`. A datagram, or a TCP message framed by its Content-Length, is parsed with
`sipmessage` (parse only: it owns no I/O, and keeps raw header values, so Via/From/To/Record-Route are copied
into responses exactly). Anything it cannot parse is dropped and counted (`malformed`); a request missing a
mandatory header gets 400, one over `MAX_SIP_BYTES` gets 513; neither touches other calls.

Requests:
- INVITE (new): the checks that cost nothing first (`Require` 420, allowlist 403, digest 401, `Session-Expires`
  422, SDP 488, agent 404), then 100 Trying, a slot (`admit`, the door's one admission step: 486 when full, 503 +
  Retry-After when draining or the engine is down), the RTP ports, 180 Ringing, the conversation's prefill, and
  200 OK with our SDP answer. A CANCEL before the 200 gets 200 and the INVITE 487; the slot is freed.
- re-INVITE / UPDATE in a dialog: hold/resume, codec or address change (a new answer, `o=` version bumped), or an
  unchanged offer answered with our previous SDP; both refresh the session timer.
- ACK stops the final response's retransmissions; BYE 200s and ends the call (481 for no dialog); OPTIONS 200s.
Timers (UDP): non-2xx finals are retransmitted on Timer G until ACK, up to Timer H; a 2xx until ACK, and without
one after 64·T1 the call is ended with BYE. Responses to non-INVITE requests are repeated for retransmissions
(Timer J). Our BYE (engine failure, session timer expiry, shutdown) is retransmitted on Timer E until answered.
Session timers (RFC 4028): when the caller supports `timer`, we accept its Session-Expires (≥ 90 s) with the caller
as refresher, and send BYE if no refresh arrives by N - min(32, N/3) s.
Replies go where RFC 3581 says: with `rport`, to the source address and port; else to the source address at the
Via's port (never to another host than the one that sent the request, so we cannot be used to reflect traffic).

Each answered call is in the live-call list (app/calls.py: its recording and webhooks) with what SIP says of the
caller (From, To, Call-ID) until it ends; our BYE says why in a `Reason` header (RFC 3326).

Multi-process servers: the SIP and RTP sockets live in worker 0 only (one UDP port cannot be shared by workers
without breaking transactions and RTP latching); every worker's slots come from the same engine, so admission
is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sipmessage import URI, Message, Request, Response

from app import admission
from app.calls import LiveCall
from app.context import ServerContext
from app.errors import ProtocolError
from app.recording import asked_to_record
from app.session_config import ConfigUpdate, SessionConfig, default_config, with_update
from app.sip.call import MediaSession, PortRange
from app.sip.digest import DigestAuth
from app.sip.sdp import Choice, Offer, SdpError, answer, negotiate, parse_offer
from media.rtp import TelephoneEvent
from model.engine import EngineError, Slot

logger = logging.getLogger(__name__)

ROUTE = "sip"                     # the route label of our admissions and rejections in /metrics
T1, T2 = 0.5, 4.0
TIMEOUT_64T1 = 64 * T1
MAX_SIP_BYTES = 16 << 10          # larger requests get 513 (a trunk's INVITE is 1-4 KB)
MIN_SE = 90
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, UPDATE"
SUPPORTED = "timer"
MAX_CACHED = 10000                # responses kept for retransmitted requests (bounded against floods)
RETRY_AFTER_S = "30"
_DIALOG_METHODS = ("BYE", "UPDATE", "INFO")
_RPORT = re.compile(r";\s*rport(?=[;\s]|$)")
_LENGTH = re.compile(rb"^(?:content-length|l)[ \t]*:[ \t]*(\d+)[ \t]*\r?$", re.I | re.M)


class Refusal(Exception):
    """A final non-2xx answer to an INVITE: `code` and `reason` on the wire, `label` in the metrics."""

    def __init__(self, code: int, reason: str, label: str, headers: list[tuple[str, str]] | None = None,
                 counted: bool = False) -> None:
        super().__init__(f"{code} {reason}")
        self.code = code
        self.reason = reason
        self.label = label
        self.headers = headers or []
        self.counted = counted  # in the rejection metrics already (by app.admission)


async def admit(ctx: ServerContext) -> Slot:
    """The SIP door's slot, through the one admission path every door takes (app.admission, which counts it), its
    refusals said in SIP: 486 when every slot is busy (the trunk tries no other server for it), 503 + Retry-After
    when draining or the engine is down (the failover signal)."""
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


@dataclass
class Peer:
    """Where a request came from and how to answer it (a UDP socket, or the TCP connection it came on)."""

    addr: tuple[str, int]
    send: Callable[[bytes, tuple[str, int]], None]
    transport: str                 # "UDP" or "TCP"


@dataclass
class InviteTx:
    """An INVITE server transaction: the last response sent, for retransmissions, until the ACK."""

    call_id: str
    cseq: int
    branch: str
    peer: Peer
    reply_to: tuple[str, int]
    request: Request
    last: bytes | None = None
    final: int = 0
    acked: bool = False
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None


@dataclass
class Dialog:
    call_id: str
    local_tag: str
    remote_tag: str
    local_uri: str                 # our To header value, with our tag
    remote_uri: str                # their From header value
    target: str                    # their Contact URI
    route: list[str]               # Record-Route, in order
    peer: Peer
    reply_to: tuple[str, int]
    agent: str
    session_id: int = field(default_factory=lambda: secrets.randbelow(1 << 31))
    version: int = 1
    local_cseq: int = field(default_factory=lambda: secrets.randbelow(1 << 20) + 1)
    remote_cseq: int = 0
    media: MediaSession | None = None
    call: LiveCall | None = None   # in the live-call list (app/calls.py) while the call is up
    offer_body: bytes = b""
    answer_body: bytes = b""
    confirmed: bool = False
    session_expires: int = 0
    expiry: asyncio.TimerHandle | None = None
    ended: bool = False


def _tag(address: object) -> str | None:
    return getattr(address, "parameters", {}).get("tag") if address is not None else None


class SipServer:
    def __init__(self, ctx: ServerContext) -> None:
        s = ctx.settings
        self.ctx = ctx
        self.settings = s
        self.ports = PortRange(s.rtp_ports)
        self.agents = parse_agents(s.sip_agents)
        self.allow = [ipaddress.ip_network(c, strict=False) for c in s.sip_allow]
        self.auth = DigestAuth(s.sip_user, s.sip_password, s.sip_realm) if s.sip_user else None
        self.dialogs: dict[str, Dialog] = {}
        self.invites: dict[tuple[str, int], InviteTx] = {}
        self.responses: dict[tuple[str, str, str], bytes] = {}     # (call-id, branch, method) -> response
        self.byes: dict[str, asyncio.TimerHandle] = {}             # our BYEs' branches, retransmitting
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._local: dict[str, str] = {}

    # ---- transports ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.settings.host, self.settings.sip_port
        server = self

        class Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                server.receive(data, Peer(addr[:2], server._udp_send, "UDP"))

            def error_received(self, exc: Exception) -> None:
                pass  # ICMP errors for a caller that went away

        self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(host, port))
        self.port = self._udp.get_extra_info("sockname")[1]
        self._tcp = await asyncio.start_server(self._tcp_connection, host, self.port, limit=MAX_SIP_BYTES)
        logger.info("SIP on %s:%d (UDP and TCP), RTP ports %s", host, self.port, self.settings.rtp_ports)

    def _udp_send(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._udp is not None and not self._udp.is_closing():
            self._udp.sendto(data, addr)

    async def _tcp_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def send(data: bytes, _addr: tuple[str, int]) -> None:
            if not writer.is_closing():
                writer.write(data)
        peer = Peer(writer.get_extra_info("peername")[:2], send, "TCP")
        # A peer that hangs up mid-message, or sends a header section past the limit, loses its connection.
        with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.strip():
                    writer.write(b"\r\n")   # RFC 5626 keep-alive: a CRLF pong for a double-CRLF ping
                    continue
                match = _LENGTH.search(head)
                length = int(match.group(1)) if match else 0
                if length > MAX_SIP_BYTES:
                    self.ctx.metrics.sip["oversized"] += 1
                    break
                self.receive(head + await reader.readexactly(length), peer)
        writer.close()

    async def stop(self) -> None:
        for dialog in list(self.dialogs.values()):
            self._end(dialog, "shutdown", send_bye=dialog.confirmed)
        for tx in list(self.invites.values()):
            if tx.timer is not None:
                tx.timer.cancel()
            if tx.task is not None:
                tx.task.cancel()
            if not tx.final:                   # an INVITE still being answered: the trunk may try elsewhere
                self._send(tx, tx.request, 503, "Service Unavailable", secrets.token_hex(6),
                           [("Retry-After", RETRY_AFTER_S)])
        for timer in self.byes.values():
            timer.cancel()
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tcp.wait_closed(), 1.0)

    # ---- messages --------------------------------------------------------------------------------------------

    def receive(self, data: bytes, peer: Peer) -> None:
        if not data.strip():
            return                          # UDP keep-alive
        try:
            msg = Message.parse(data)
            if isinstance(msg, Response):
                self._on_response(msg)
                return
            via = msg.via[0]
        except Exception:  # a hostile datagram may break the parser in any way: it is counted, never raised
            self.ctx.metrics.sip["malformed"] += 1
            return
        assert isinstance(msg, Request)
        reply_to = peer.addr if peer.transport == "TCP" or "rport" in via.parameters \
            else (peer.addr[0], via.port or 5060)
        try:
            self._on_request(msg, data, peer, reply_to)
        except Exception:
            self.ctx.metrics.sip["malformed"] += 1
            logger.exception("SIP %s from %s: failed", msg.method, peer.addr)
            with contextlib.suppress(Exception):     # headers too broken to copy into a response: no answer
                self._reply(msg, peer, reply_to, 400, "Bad Request")

    def _on_request(self, req: Request, data: bytes, peer: Peer, reply_to: tuple[str, int]) -> None:
        missing = [h for h in ("From", "To", "Call-ID", "CSeq") if not req.headers.get(h)]
        if missing:
            self.ctx.metrics.sip["malformed"] += 1
            self._reply(req, peer, reply_to, 400, f"Missing {missing[0]}")
            return
        cseq = req.cseq
        if cseq.method != req.method:
            self.ctx.metrics.sip["malformed"] += 1
            self._reply(req, peer, reply_to, 400, "CSeq Method Mismatch")
            return
        if len(data) > MAX_SIP_BYTES:
            self.ctx.metrics.sip["oversized"] += 1
            self._reply(req, peer, reply_to, 513, "Message Too Large")
            return
        declared = req.content_length
        if declared is not None and declared > len(req.body):
            self.ctx.metrics.sip["malformed"] += 1
            self._reply(req, peer, reply_to, 400, "Truncated Body")
            return
        method, call_id = req.method, req.call_id
        if method == "ACK":
            self._on_ack(req)
            return
        if method == "INVITE":
            tx = self.invites.get((call_id, cseq.sequence))
            if tx is not None:                         # a retransmission: the last response again
                if tx.last is not None:
                    tx.peer.send(tx.last, tx.reply_to)
                return
            if _tag(req.to_address):
                self._reinvite(req, peer, reply_to)
            else:
                self._new_invite(req, peer, reply_to)
            return
        key = (call_id, req.via[0].parameters.get("branch") or "", method)
        cached = self.responses.get(key)
        if cached is not None:
            peer.send(cached, reply_to)
            return
        if method == "CANCEL":
            self._on_cancel(req, peer, reply_to, key)
        elif method == "OPTIONS":
            self._reply(req, peer, reply_to, 200, "OK", cache=key, headers=self._capabilities())
        elif method in _DIALOG_METHODS:
            self._in_dialog(req, peer, reply_to, key)
        else:
            self._reply(req, peer, reply_to, 405, "Method Not Allowed", cache=key, headers=[("Allow", ALLOW)])

    def _capabilities(self) -> list[tuple[str, str]]:
        return [("Allow", ALLOW), ("Accept", "application/sdp"), ("Supported", SUPPORTED)]

    def _reply(self, req: Request, peer: Peer, reply_to: tuple[str, int], code: int, reason: str, *,
               to_tag: str | None = None, headers: list[tuple[str, str]] | None = None, body: bytes = b"",
               cache: tuple[str, str, str] | None = None) -> bytes:
        """Send a response (Via, From, Call-ID, CSeq copied; our tag added to To) and return its bytes."""
        r = Response(code, reason, body)
        vias = req.headers.getlist("Via")
        if vias:
            top = vias[0]
            top = _RPORT.sub(f";rport={peer.addr[1]}", top, count=1) if peer.transport == "UDP" else top
            vias[0] = f"{top};received={peer.addr[0]}"
            r.headers.setlist("Via", vias)
        for name in ("From", "To", "Call-ID", "CSeq"):
            value = req.headers.get(name)
            if value is not None:
                if name == "To" and to_tag and not _tag(req.to_address):
                    value = f"{value};tag={to_tag}"
                r.headers.set(name, value)
        for name, value in headers or []:
            r.headers.add(name, value)
        r.headers.set("Server", "personaplex")
        if body:
            r.headers.set("Content-Type", "application/sdp")
        r.headers.set("Content-Length", str(len(body)))
        data = bytes(r)
        peer.send(data, reply_to)
        if cache is not None and len(self.responses) < MAX_CACHED:
            self.responses[cache] = data
            asyncio.get_running_loop().call_later(TIMEOUT_64T1, self.responses.pop, cache, None)
        return data

    # ---- INVITE ----------------------------------------------------------------------------------------------

    def _new_invite(self, req: Request, peer: Peer, reply_to: tuple[str, int]) -> None:
        if len(self.invites) >= MAX_CACHED:    # an INVITE flood: answered, but no transaction state kept
            self.ctx.metrics.sip["invite_overload"] += 1
            self._reply(req, peer, reply_to, 503, "Service Unavailable", to_tag=secrets.token_hex(6),
                        headers=[("Retry-After", RETRY_AFTER_S)])
            return
        tx = InviteTx(req.call_id, req.cseq.sequence, req.via[0].parameters.get("branch") or "", peer, reply_to, req)
        self.invites[(tx.call_id, tx.cseq)] = tx
        tx.task = asyncio.get_running_loop().create_task(self._answer(req, tx))

    async def _answer(self, req: Request, tx: InviteTx) -> None:
        tag = secrets.token_hex(6)
        dialog: Dialog | None = None
        try:
            offer, choice, agent, update = self._check_invite(req, tx.peer)
            session_expires = self._session_timer(req)
            self._send(tx, req, 100, "Trying")
            slot = await admit(self.ctx)
            media = MediaSession(slot, choice, self.ctx.metrics, self.settings.host,
                                 on_event=lambda e: self._on_dtmf(req.call_id, e),
                                 on_failure=lambda e: self._on_engine_failure(req.call_id, e),
                                 on_timeout=lambda: self._on_rtp_timeout(req.call_id))
            dialog = self._dialog(req, tx, tag, agent.name if agent else "", media)
            try:
                await media.open(self.ports)
            except OSError:
                raise Refusal(503, "Service Unavailable", "rtp_ports_exhausted",
                              [("Retry-After", RETRY_AFTER_S)]) from None
            self._send(tx, req, 180, "Ringing", tag, [("Contact", self._contact(req, tx.peer))])
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
            dialog.answer_body = answer(offer, choice, self._advertised(tx.peer), media.port, dialog.session_id,
                                        dialog.version)
            headers = [("Contact", self._contact(req, tx.peer)), *self._capabilities()]
            if session_expires:
                dialog.session_expires = session_expires
                headers += [("Session-Expires", f"{session_expires};refresher=uac"), ("Require", "timer")]
                self._arm_session_timer(dialog)
            self._send(tx, req, 200, "OK", tag, headers, dialog.answer_body)
            self._retransmit(tx, on_timeout=lambda: self._end(dialog, "no_ack", send_bye=True) if dialog else None)
            logger.info("SIP call %s from %s: %s, agent %r", req.call_id, tx.peer.addr, choice.codec.rtpmap(),
                        dialog.agent or "default")
        except Refusal as r:
            if not r.counted:
                self.ctx.metrics.rejections[(ROUTE, r.label)] += 1
            if dialog is not None:
                self._end(dialog, r.label, send_bye=False)
            self._send(tx, req, r.code, r.reason, tag, r.headers)
            self._retransmit(tx)
        except asyncio.CancelledError:
            if dialog is not None:
                self._end(dialog, "cancelled", send_bye=False)
            raise

    def _check_invite(self, req: Request, peer: Peer) -> tuple[Offer, Choice, Agent | None, ConfigUpdate]:
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

    def _dialog(self, req: Request, tx: InviteTx, tag: str, agent: str, media: MediaSession) -> Dialog:
        contacts = req.contact or []
        target = str(contacts[0].uri) if contacts else str(req.uri)
        dialog = Dialog(req.call_id, tag, _tag(req.from_address) or "", f"{req.headers.get('To')};tag={tag}",
                        req.headers.get("From") or "", target, req.headers.getlist("Record-Route"), tx.peer,
                        tx.reply_to, agent, remote_cseq=tx.cseq, media=media)
        self.dialogs[req.call_id] = dialog
        return dialog

    def _send(self, tx: InviteTx, req: Request, code: int, reason: str, tag: str | None = None,
              headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> None:
        tx.last = self._reply(req, tx.peer, tx.reply_to, code, reason, to_tag=tag, headers=headers, body=body)
        if code >= 200:
            tx.final = code

    def _retransmit(self, tx: InviteTx, on_timeout: Callable[[], object] | None = None) -> None:
        """Resend the final response at T1, doubling to T2, until the ACK; after 64·T1 give up (`on_timeout`).
        Over TCP the transport is reliable: nothing is resent, the ACK is still awaited."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT_64T1
        interval = T1

        def fire() -> None:
            nonlocal interval
            if tx.acked:
                return
            if loop.time() >= deadline:
                self.invites.pop((tx.call_id, tx.cseq), None)
                if on_timeout is not None:
                    on_timeout()
                return
            if tx.peer.transport == "UDP" and tx.last is not None:
                tx.peer.send(tx.last, tx.reply_to)
            interval = min(2 * interval, T2)
            tx.timer = loop.call_later(min(interval, max(0.0, deadline - loop.time())), fire)

        tx.timer = loop.call_later(T1, fire)

    def _on_ack(self, req: Request) -> None:
        tx = self.invites.pop((req.call_id, req.cseq.sequence), None)
        if tx is None:
            return                                    # a retransmitted ACK, or one for nothing
        tx.acked = True
        if tx.timer is not None:
            tx.timer.cancel()
        dialog = self.dialogs.get(req.call_id)
        if dialog is not None and 200 <= tx.final < 300:
            dialog.confirmed = True

    def _on_cancel(self, req: Request, peer: Peer, reply_to: tuple[str, int], key: tuple[str, str, str]) -> None:
        tx = self.invites.get((req.call_id, req.cseq.sequence))
        if tx is None or tx.branch != key[1]:
            self._reply(req, peer, reply_to, 481, "Call/Transaction Does Not Exist", cache=key)
            return
        self._reply(req, peer, reply_to, 200, "OK", cache=key)
        if tx.final:
            return                             # answered already: the CANCEL has no effect (RFC 3261 §9.2)
        if tx.task is not None:
            tx.task.cancel()
        self.ctx.metrics.rejections[(ROUTE, "cancelled")] += 1
        dialog = self.dialogs.get(req.call_id)
        if dialog is not None:
            self._end(dialog, "cancelled", send_bye=False)
        self._send(tx, tx.request, 487, "Request Terminated", secrets.token_hex(6))
        self._retransmit(tx)

    # ---- in a dialog -----------------------------------------------------------------------------------------

    def _dialog_of(self, req: Request) -> Dialog | None:
        dialog = self.dialogs.get(req.call_id)
        if dialog is None or dialog.ended or _tag(req.to_address) != dialog.local_tag:
            return None
        return dialog

    def _in_dialog(self, req: Request, peer: Peer, reply_to: tuple[str, int], key: tuple[str, str, str]) -> None:
        dialog = self._dialog_of(req)
        if dialog is None:
            self._reply(req, peer, reply_to, 481, "Call/Transaction Does Not Exist", cache=key)
            return
        if req.method == "BYE":
            self._reply(req, peer, reply_to, 200, "OK", cache=key)
            self._end(dialog, "bye", send_bye=False)
            return
        if req.method == "INFO":
            self._reply(req, peer, reply_to, 200, "OK", cache=key)
            return
        # UPDATE: a session refresh, maybe with a new offer (RFC 3311)
        code, reason, body = self._renegotiate(dialog, req)
        headers = self._refresh(dialog, req)
        self._reply(req, peer, reply_to, code, reason, headers=headers, body=body, cache=key)

    def _reinvite(self, req: Request, peer: Peer, reply_to: tuple[str, int]) -> None:
        dialog = self._dialog_of(req)
        tx = InviteTx(req.call_id, req.cseq.sequence, req.via[0].parameters.get("branch") or "", peer, reply_to, req)
        if dialog is None:
            self._send(tx, req, 481, "Call/Transaction Does Not Exist")
            self.invites[(tx.call_id, tx.cseq)] = tx
            self._retransmit(tx)
            return
        if req.cseq.sequence <= dialog.remote_cseq:
            self._send(tx, req, 500, "Server Internal Error", headers=[("Retry-After", "1")])
            return
        dialog.remote_cseq = req.cseq.sequence
        self.invites[(tx.call_id, tx.cseq)] = tx
        code, reason, body = self._renegotiate(dialog, req)
        headers = [("Contact", self._contact(req, peer)), *self._capabilities(), *self._refresh(dialog, req)]
        self._send(tx, req, code, reason, headers=headers, body=body)
        self._retransmit(tx)

    def _renegotiate(self, dialog: Dialog, req: Request) -> tuple[int, str, bytes]:
        """(code, reason, body) for a re-INVITE or UPDATE: our previous SDP for no or an unchanged offer."""
        if not req.body or req.body == dialog.offer_body or dialog.media is None:
            return 200, "OK", dialog.answer_body
        try:
            offer = parse_offer(req.body)
        except SdpError:
            return 488, "Not Acceptable Here", b""
        choice = negotiate(offer)
        if choice is None:
            return 488, "Not Acceptable Here", b""
        dialog.media.update(choice)
        dialog.offer_body = req.body
        dialog.version += 1
        dialog.answer_body = answer(offer, choice, self._advertised(dialog.peer), dialog.media.port,
                                    dialog.session_id, dialog.version)
        logger.info("SIP call %s: re-negotiated %s %s", dialog.call_id, choice.codec.rtpmap(), choice.direction)
        return 200, "OK", dialog.answer_body

    def _refresh(self, dialog: Dialog, req: Request) -> list[tuple[str, str]]:
        if not dialog.session_expires:
            return []
        raw = req.headers.get("Session-Expires") or ""
        with contextlib.suppress(ValueError):
            dialog.session_expires = max(MIN_SE, int(raw.split(";")[0].strip()))
        self._arm_session_timer(dialog)
        return [("Session-Expires", f"{dialog.session_expires};refresher=uac"), ("Require", "timer")]

    def _arm_session_timer(self, dialog: Dialog) -> None:
        if dialog.expiry is not None:
            dialog.expiry.cancel()
        n = dialog.session_expires
        dialog.expiry = asyncio.get_running_loop().call_later(
            n - min(32, n / 3), lambda: self._end(dialog, "session_expired", send_bye=True))

    # ---- ending ----------------------------------------------------------------------------------------------

    def _end(self, dialog: Dialog, why: str, *, send_bye: bool) -> None:
        if dialog.ended:
            return
        dialog.ended = True
        if self.dialogs.get(dialog.call_id) is dialog:
            del self.dialogs[dialog.call_id]
        if dialog.expiry is not None:
            dialog.expiry.cancel()
        if dialog.media is not None:
            rx = dialog.media.receiver
            if rx is not None:
                self.ctx.metrics.sip.update({f"rtp_dropped_{k}": n for k, n in rx.stats.dropped.items()})
            dialog.media.close()
            self.ctx.calls.end(dialog.call, why)
        if send_bye:
            self._bye(dialog, why)
        logger.info("SIP call %s ended: %s", dialog.call_id, why)

    def _bye(self, dialog: Dialog, why: str) -> None:
        dialog.local_cseq += 1
        branch = "z9hG4bK" + secrets.token_hex(8)
        host = self._advertised(dialog.peer)
        request = Request("BYE", URI.parse(dialog.target))
        h = request.headers
        h.add("Via", f"SIP/2.0/{dialog.peer.transport} {host}:{self.port};branch={branch};rport")
        h.add("Max-Forwards", "70")
        for route in dialog.route:
            h.add("Route", route)
        h.add("From", dialog.local_uri)
        h.add("To", dialog.remote_uri)
        h.add("Call-ID", dialog.call_id)
        h.add("CSeq", f"{dialog.local_cseq} BYE")
        h.add("Reason", f'SIP ;cause=200 ;text="{why}"')     # RFC 3326: why we hang up
        h.add("Content-Length", "0")
        data = bytes(request)
        addr = dialog.reply_to if dialog.peer.transport == "TCP" else self._target_addr(dialog)
        dialog.peer.send(data, addr)
        if dialog.peer.transport != "UDP":
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT_64T1
        interval = T1

        def fire() -> None:
            nonlocal interval
            if branch not in self.byes:
                return
            if loop.time() >= deadline:
                self.byes.pop(branch, None)
                return
            dialog.peer.send(data, addr)
            interval = min(2 * interval, T2)
            self.byes[branch] = loop.call_later(interval, fire)

        self.byes[branch] = loop.call_later(T1, fire)

    def _target_addr(self, dialog: Dialog) -> tuple[str, int]:
        """The next hop of our in-dialog request: the first Record-Route, else the caller's Contact."""
        uri = URI.parse(dialog.route[0].strip().lstrip("<").split(">")[0]) if dialog.route else \
            URI.parse(dialog.target)
        return uri.host, uri.port or 5060

    def _on_response(self, resp: Response) -> None:
        """A response to our BYE stops its retransmissions."""
        branch = resp.via[0].parameters.get("branch") if resp.via else None
        timer = self.byes.pop(branch or "", None)
        if timer is not None:
            timer.cancel()

    def _open_call(self, req: Request, peer: Peer, dialog: Dialog, agent: Agent | None, choice: Choice,
                   config: SessionConfig) -> LiveCall:
        """The call in the live-call list, with what SIP says of the caller (before the conversation starts)."""
        assert dialog.media is not None
        record = agent.record if agent is not None else None
        if self.settings.sip_x_headers and req.headers.get("X-Record"):
            record = asked_to_record(req.headers.get("X-Record"))
        caller = {"from": req.headers.get("From"), "to": req.headers.get("To"), "call_id": req.call_id,
                  "remote": f"{peer.addr[0]}:{peer.addr[1]}", "agent": dialog.agent or "default"}
        return self.ctx.calls.open(ROUTE, dialog.media.conversation, _CallOwner(self, dialog), caller=caller,
                                   codec=choice.codec.rtpmap(), record=record,
                                   agent={"persona": config.persona, "voice": config.voice})

    def _on_dtmf(self, call_id: str, event: TelephoneEvent) -> None:
        logger.info("SIP call %s: telephone-event %s", call_id, event.name)

    def _on_engine_failure(self, call_id: str, error: EngineError) -> None:
        dialog = self.dialogs.get(call_id)
        if dialog is not None:
            logger.warning("SIP call %s: the engine failed it (%s); hanging up", call_id, error.message)
            self._end(dialog, error.code, send_bye=dialog.confirmed)

    def _on_rtp_timeout(self, call_id: str) -> None:
        dialog = self.dialogs.get(call_id)
        if dialog is not None:
            self.ctx.metrics.sip["rtp_timeout"] += 1
            self._end(dialog, "rtp_timeout", send_bye=True)

    # ---- addresses -------------------------------------------------------------------------------------------

    def _advertised(self, peer: Peer) -> str:
        """The address we put in SDP and Contact: --sip-address, the bind address, or our side of the route to the
        caller when bound to every interface."""
        if self.settings.sip_address:
            return self.settings.sip_address
        host = self.settings.host
        if host not in ("0.0.0.0", "::", ""):
            return host
        found = self._local.get(peer.addr[0])
        if found is None:
            with socket.socket(socket.AF_INET6 if ":" in peer.addr[0] else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer.addr[0], 9))
                found = s.getsockname()[0]
            self._local[peer.addr[0]] = found
        return found

    def _contact(self, req: Request, peer: Peer) -> str:
        user = req.uri.user or "personaplex"
        transport = ";transport=tcp" if peer.transport == "TCP" else ""
        return f"<sip:{user}@{self._advertised(peer)}:{self.port}{transport}>"

    def calls(self) -> list[dict[str, object]]:
        """The live calls and their media stats (GET /v1/sip/calls)."""
        return [{"call_id": d.call_id, "agent": d.agent or "default", "confirmed": d.confirmed,
                 **(d.media.snapshot() if d.media is not None else {})} for d in self.dialogs.values()]


class _CallOwner:
    """A SIP call as the live-call list drives it: hung up with a BYE, its queued audio cut, its media figures."""

    def __init__(self, server: SipServer, dialog: Dialog) -> None:
        self.server = server
        self.dialog = dialog

    async def hang_up(self, reason: str) -> None:
        self.server._end(self.dialog, reason, send_bye=True)

    def cut_output(self) -> None:
        if self.dialog.media is not None:
            self.dialog.media.cut()
            self.server.ctx.calls.note(self.dialog.call, {"event": "cut", **self.call_details()})

    def call_details(self) -> dict[str, object]:
        media = self.dialog.media
        if media is None:
            return {}
        snapshot = media.snapshot()
        return {"sent_s": media.sent_s(), **{k: snapshot[k] for k in ("packets_sent", "packets_received", "lost")}}

