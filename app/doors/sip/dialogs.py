"""SIP dialogs: one per answered call, what in-dialog requests do to it, its session timer, and its end.

- re-INVITE / UPDATE: hold/resume, codec or address change (a new answer, `o=` version bumped), or an unchanged
  offer answered with our previous SDP; both refresh the session timer. BYE 200s and ends the call (481 for no
  dialog); INFO 200s.
- Session timers (RFC 4028): when the caller supports `timer`, we accept its Session-Expires (≥ `MIN_SE`) with the
  caller as refresher, and send BYE if no refresh arrives by N - min(32, N/3) s.
- The end: the call's media closed, the live-call list told why; our BYE (engine failure, session timer expiry, no
  ACK, shutdown, the admin API) says why in a `Reason` header (RFC 3326) and goes to the first Record-Route, else
  the caller's Contact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field

from sipmessage import URI, Request

from app.calls.live import LiveCall
from app.doors.sip.call import MediaSession
from app.doors.sip.sdp import SdpError, answer, negotiate, parse_offer
from app.doors.sip.transactions import CacheKey, InviteTx, Transactions, invite_tx
from app.doors.sip.transport import Local, Peer, tag
from app.shell.context import ServerContext

logger = logging.getLogger(__name__)

MIN_SE = 90
ALLOW = "INVITE, ACK, BYE, CANCEL, OPTIONS, UPDATE"
SUPPORTED = "timer"


def capabilities() -> list[tuple[str, str]]:
    """What our OPTIONS, 200 OK and re-INVITE answers say we take."""
    return [("Allow", ALLOW), ("Accept", "application/sdp"), ("Supported", SUPPORTED)]


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
    call: LiveCall | None = None   # in the live-call list (app/calls/live.py) while the call is up
    offer_body: bytes = b""
    answer_body: bytes = b""
    confirmed: bool = False
    session_expires: int = 0
    expiry: asyncio.TimerHandle | None = None
    ended: bool = False


class Dialogs:
    def __init__(self, ctx: ServerContext, transactions: Transactions, local: Local) -> None:
        self.ctx = ctx
        self.transactions = transactions
        self.local = local
        self.dialogs: dict[str, Dialog] = {}

    def create(self, req: Request, tx: InviteTx, local_tag: str, agent: str, media: MediaSession) -> Dialog:
        contacts = req.contact or []
        target = str(contacts[0].uri) if contacts else str(req.uri)
        dialog = Dialog(req.call_id, local_tag, tag(req.from_address) or "", f"{req.headers.get('To')};tag={local_tag}",
                        req.headers.get("From") or "", target, req.headers.getlist("Record-Route"), tx.peer,
                        tx.reply_to, agent, remote_cseq=tx.cseq, media=media)
        self.dialogs[req.call_id] = dialog
        return dialog

    def acked(self, tx: InviteTx) -> None:
        """The ACK of a 2xx confirms its dialog."""
        dialog = self.dialogs.get(tx.call_id)
        if dialog is not None and 200 <= tx.final < 300:
            dialog.confirmed = True

    def of(self, req: Request) -> Dialog | None:
        dialog = self.dialogs.get(req.call_id)
        if dialog is None or dialog.ended or tag(req.to_address) != dialog.local_tag:
            return None
        return dialog

    # ---- in a dialog -----------------------------------------------------------------------------------------

    def on_request(self, req: Request, peer: Peer, reply_to: tuple[str, int], key: CacheKey) -> None:
        """BYE, INFO or UPDATE."""
        dialog = self.of(req)
        if dialog is None:
            self.transactions.reply(req, peer, reply_to, 481, "Call/Transaction Does Not Exist", cache=key)
            return
        if req.method == "BYE":
            self.transactions.reply(req, peer, reply_to, 200, "OK", cache=key)
            self.end(dialog, "bye", send_bye=False)
            return
        if req.method == "INFO":
            self.transactions.reply(req, peer, reply_to, 200, "OK", cache=key)
            return
        # UPDATE: a session refresh, maybe with a new offer (RFC 3311)
        code, reason, body = self._renegotiate(dialog, req)
        headers = self._refresh(dialog, req)
        self.transactions.reply(req, peer, reply_to, code, reason, headers=headers, body=body, cache=key)

    def reinvite(self, req: Request, peer: Peer, reply_to: tuple[str, int]) -> None:
        dialog = self.of(req)
        tx = invite_tx(req, peer, reply_to)
        if dialog is None:
            self.transactions.send(tx, req, 481, "Call/Transaction Does Not Exist")
            self.transactions.open(tx)
            self.transactions.retransmit(tx)
            return
        if req.cseq.sequence <= dialog.remote_cseq:
            self.transactions.send(tx, req, 500, "Server Internal Error", headers=[("Retry-After", "1")])
            return
        dialog.remote_cseq = req.cseq.sequence
        self.transactions.open(tx)
        code, reason, body = self._renegotiate(dialog, req)
        headers = [("Contact", self.local.contact(req, peer)), *capabilities(), *self._refresh(dialog, req)]
        self.transactions.send(tx, req, code, reason, headers=headers, body=body)
        self.transactions.retransmit(tx)

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
        dialog.answer_body = answer(offer, choice, self.local.advertised(dialog.peer), dialog.media.port,
                                    dialog.session_id, dialog.version)
        logger.info("SIP call %s: re-negotiated %s %s", dialog.call_id, choice.codec.rtpmap(), choice.direction)
        return 200, "OK", dialog.answer_body

    def _refresh(self, dialog: Dialog, req: Request) -> list[tuple[str, str]]:
        if not dialog.session_expires:
            return []
        raw = req.headers.get("Session-Expires") or ""
        with contextlib.suppress(ValueError):
            dialog.session_expires = max(MIN_SE, int(raw.split(";")[0].strip()))
        self.arm_session_timer(dialog)
        return [("Session-Expires", f"{dialog.session_expires};refresher=uac"), ("Require", "timer")]

    def arm_session_timer(self, dialog: Dialog) -> None:
        if dialog.expiry is not None:
            dialog.expiry.cancel()
        n = dialog.session_expires
        dialog.expiry = asyncio.get_running_loop().call_later(
            n - min(32, n / 3), lambda: self.end(dialog, "session_expired", send_bye=True))

    # ---- ending ----------------------------------------------------------------------------------------------

    def end(self, dialog: Dialog, why: str, *, send_bye: bool) -> None:
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

    def end_all(self) -> None:
        """Shutdown: every call ends, with our BYE where the dialog was confirmed."""
        for dialog in list(self.dialogs.values()):
            self.end(dialog, "shutdown", send_bye=dialog.confirmed)

    def _bye(self, dialog: Dialog, why: str) -> None:
        dialog.local_cseq += 1
        branch = "z9hG4bK" + secrets.token_hex(8)
        host = self.local.advertised(dialog.peer)
        request = Request("BYE", URI.parse(dialog.target))
        h = request.headers
        h.add("Via", f"SIP/2.0/{dialog.peer.transport} {host}:{self.local.port};branch={branch};rport")
        h.add("Max-Forwards", "70")
        for route in dialog.route:
            h.add("Route", route)
        h.add("From", dialog.local_uri)
        h.add("To", dialog.remote_uri)
        h.add("Call-ID", dialog.call_id)
        h.add("CSeq", f"{dialog.local_cseq} BYE")
        h.add("Reason", f'SIP ;cause=200 ;text="{why}"')     # RFC 3326: why we hang up
        h.add("Content-Length", "0")
        addr = dialog.reply_to if dialog.peer.transport == "TCP" else _target_addr(dialog)
        self.transactions.request(bytes(request), dialog.peer, addr, branch)


def _target_addr(dialog: Dialog) -> tuple[str, int]:
    """The next hop of our in-dialog request: the first Record-Route, else the caller's Contact."""
    uri = URI.parse(dialog.route[0].strip().lstrip("<").split(">")[0]) if dialog.route else URI.parse(dialog.target)
    return uri.host, uri.port or 5060
