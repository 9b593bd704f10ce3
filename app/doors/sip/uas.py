"""The SIP user agent server (RFC 3261) a trunk calls: what comes in on the SIP port, and where each request goes.

The parts, each readable on its own: app/doors/sip/transport.py (UDP and TCP, framing, where replies go, our address),
app/doors/sip/transactions.py (retransmissions and their timers), app/doors/sip/invite.py (a new call: its checks,
admission, the RTP ports and the answer; CANCEL), app/doors/sip/dialogs.py (in-dialog requests, session timers, the
call's end and our BYE), app/doors/sip/call.py (one call's RTP and conversation).

Each message is parsed with `sipmessage` (parse only: it owns no I/O, and keeps raw header values, so Via, From, To
and Record-Route are copied into responses exactly). Anything it cannot parse is dropped and counted (`malformed`); a
request missing a mandatory header gets 400, one over `MAX_SIP_BYTES` gets 513; neither touches other calls.
Routing: ACK ends its INVITE's transaction; a retransmitted request gets its response again; an INVITE without a To
tag is a new call, with one a re-INVITE; CANCEL, OPTIONS (200 with our capabilities), BYE, INFO and UPDATE; anything
else 405.

Multi-process servers: the SIP and RTP sockets live in worker 0 only (one UDP port cannot be shared by workers
without breaking transactions and RTP latching); every worker's slots come from the same engine, so admission
is the same.
"""

from __future__ import annotations

import contextlib
import logging

from sipmessage import Message, Request, Response

from app.doors.sip.dialogs import ALLOW, Dialog, Dialogs, capabilities
from app.doors.sip.invite import Invites
from app.doors.sip.transactions import Transactions, cache_key
from app.doors.sip.transport import MAX_SIP_BYTES, Local, Peer, Sockets, reply_address, tag
from app.shell.context import ServerContext

logger = logging.getLogger(__name__)

_DIALOG_METHODS = ("BYE", "UPDATE", "INFO")


class SipServer:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.local = Local(ctx.settings)
        self.sockets = Sockets(ctx.metrics, self.receive)
        self.transactions = Transactions()
        self.in_dialog = Dialogs(ctx, self.transactions, self.local)
        self.invites = Invites(ctx, self.transactions, self.in_dialog, self.local)

    @property
    def port(self) -> int:
        return self.sockets.port

    @property
    def dialogs(self) -> dict[str, Dialog]:
        """The answered calls by Call-ID."""
        return self.in_dialog.dialogs

    async def start(self) -> None:
        await self.sockets.start(self.settings.host, self.settings.sip_port)
        self.local.port = self.sockets.port
        logger.info("SIP on %s:%d (UDP and TCP), RTP ports %s", self.settings.host, self.port,
                    self.settings.rtp_ports)

    async def stop(self) -> None:
        self.in_dialog.end_all()
        self.transactions.stop()
        await self.sockets.stop()

    def receive(self, data: bytes, peer: Peer) -> None:
        if not data.strip():
            return                          # UDP keep-alive
        try:
            msg = Message.parse(data)
            if isinstance(msg, Response):
                self.transactions.on_response(msg)
                return
            via = msg.via[0]
        except Exception:  # a hostile datagram may break the parser in any way: it is counted, never raised
            self.ctx.metrics.sip["malformed"] += 1
            return
        assert isinstance(msg, Request)
        reply_to = reply_address(peer, via.parameters, via.port)
        try:
            self._on_request(msg, data, peer, reply_to)
        except Exception:
            self.ctx.metrics.sip["malformed"] += 1
            logger.exception("SIP %s from %s: failed", msg.method, peer.addr)
            with contextlib.suppress(Exception):     # headers too broken to copy into a response: no answer
                self.transactions.reply(msg, peer, reply_to, 400, "Bad Request")

    def _on_request(self, req: Request, data: bytes, peer: Peer, reply_to: tuple[str, int]) -> None:
        reply = self.transactions.reply
        missing = [h for h in ("From", "To", "Call-ID", "CSeq") if not req.headers.get(h)]
        if missing:
            self.ctx.metrics.sip["malformed"] += 1
            reply(req, peer, reply_to, 400, f"Missing {missing[0]}")
            return
        if req.cseq.method != req.method:
            self.ctx.metrics.sip["malformed"] += 1
            reply(req, peer, reply_to, 400, "CSeq Method Mismatch")
            return
        if len(data) > MAX_SIP_BYTES:
            self.ctx.metrics.sip["oversized"] += 1
            reply(req, peer, reply_to, 513, "Message Too Large")
            return
        declared = req.content_length
        if declared is not None and declared > len(req.body):
            self.ctx.metrics.sip["malformed"] += 1
            reply(req, peer, reply_to, 400, "Truncated Body")
            return
        method = req.method
        if method == "ACK":
            tx = self.transactions.ack(req)
            if tx is not None:
                self.in_dialog.acked(tx)
            return
        if self.transactions.resent(req, peer, reply_to):
            return
        if method == "INVITE":
            if tag(req.to_address):
                self.in_dialog.reinvite(req, peer, reply_to)
            else:
                self.invites.on_invite(req, peer, reply_to)
            return
        key = cache_key(req)
        if method == "CANCEL":
            self.invites.on_cancel(req, peer, reply_to, key)
        elif method == "OPTIONS":
            reply(req, peer, reply_to, 200, "OK", cache=key, headers=capabilities())
        elif method in _DIALOG_METHODS:
            self.in_dialog.on_request(req, peer, reply_to, key)
        else:
            reply(req, peer, reply_to, 405, "Method Not Allowed", cache=key, headers=[("Allow", ALLOW)])

    def calls(self) -> list[dict[str, object]]:
        """The live calls and their media stats (GET /v1/sip/calls)."""
        return [self._report(d) for d in self.dialogs.values()]

    def call(self, call_id: str) -> dict[str, object] | None:
        """One live call's (GET /v1/sip/calls/{call_id}), for a caller that wants its own: each call's report is
        ~0.13 ms of the door's loop (2-core CPU), so the list at 24 calls is ~3 ms more a request."""
        dialog = self.dialogs.get(call_id)
        return None if dialog is None else self._report(dialog)

    @staticmethod
    def _report(d: Dialog) -> dict[str, object]:
        return {"call_id": d.call_id, "agent": d.agent or "default", "confirmed": d.confirmed,
                **(d.media.snapshot() if d.media is not None else {})}
