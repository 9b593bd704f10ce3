"""SIP transactions (RFC 3261 §17) as a server that answers calls and hangs them up needs them.

- INVITE server transactions (`InviteTx`): the last response is sent again for a retransmitted INVITE; over UDP a
  final response is retransmitted on Timer G (T1, doubling to T2) until the ACK, and given up after 64·T1 (Timer H;
  for a 2xx, the caller's `on_timeout` ends the call). Over TCP nothing is resent; the ACK is still awaited.
- Non-INVITE requests: each response is kept for 64·T1 under (Call-ID, branch, method), so a retransmitted request
  is answered with it again (Timer J); the cache is bounded against floods (`MAX_CACHED`).
- Our own BYE, a client transaction: retransmitted on Timer E until a response with its branch comes, or 64·T1.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sipmessage import Request, Response

from app.doors.sip.transport import Peer, response

T1, T2 = 0.5, 4.0
TIMEOUT_64T1 = 64 * T1
MAX_CACHED = 10000                # responses kept for retransmitted requests (bounded against floods)
RETRY_AFTER_S = "30"
CacheKey = tuple[str, str, str]   # (Call-ID, branch, method)


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


def invite_tx(req: Request, peer: Peer, reply_to: tuple[str, int]) -> InviteTx:
    return InviteTx(req.call_id, req.cseq.sequence, req.via[0].parameters.get("branch") or "", peer, reply_to, req)


class Transactions:
    def __init__(self) -> None:
        self.invites: dict[tuple[str, int], InviteTx] = {}
        self.responses: dict[CacheKey, bytes] = {}                 # non-INVITE responses, for retransmissions
        self.byes: dict[str, asyncio.TimerHandle] = {}             # our BYEs' branches, retransmitting

    # ---- responses -------------------------------------------------------------------------------------------

    def reply(self, req: Request, peer: Peer, reply_to: tuple[str, int], code: int, reason: str, *,
              to_tag: str | None = None, headers: list[tuple[str, str]] | None = None, body: bytes = b"",
              cache: CacheKey | None = None) -> bytes:
        """Send a response (app.doors.sip.transport.response) and return its bytes; with `cache`, kept for the request's
        retransmissions."""
        data = response(req, peer, code, reason, to_tag=to_tag, headers=headers, body=body)
        peer.send(data, reply_to)
        if cache is not None and len(self.responses) < MAX_CACHED:
            self.responses[cache] = data
            asyncio.get_running_loop().call_later(TIMEOUT_64T1, self.responses.pop, cache, None)
        return data

    def resent(self, req: Request, peer: Peer, reply_to: tuple[str, int]) -> bool:
        """A retransmitted request answered again from its transaction (INVITE) or the cache (others)."""
        if req.method == "INVITE":
            tx = self.invites.get((req.call_id, req.cseq.sequence))
            if tx is not None and tx.last is not None:
                tx.peer.send(tx.last, tx.reply_to)
            return tx is not None
        cached = self.responses.get(cache_key(req))
        if cached is not None:
            peer.send(cached, reply_to)
        return cached is not None

    # ---- INVITE server transactions --------------------------------------------------------------------------

    def full(self) -> bool:
        """An INVITE flood: answer, but keep no transaction state."""
        return len(self.invites) >= MAX_CACHED

    def open(self, tx: InviteTx) -> InviteTx:
        self.invites[(tx.call_id, tx.cseq)] = tx
        return tx

    def send(self, tx: InviteTx, req: Request, code: int, reason: str, tag: str | None = None,
             headers: list[tuple[str, str]] | None = None, body: bytes = b"") -> None:
        """A response in `tx`, kept as its last (a final one marks it answered)."""
        tx.last = self.reply(req, tx.peer, tx.reply_to, code, reason, to_tag=tag, headers=headers, body=body)
        if code >= 200:
            tx.final = code

    def retransmit(self, tx: InviteTx, on_timeout: Callable[[], object] | None = None) -> None:
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

    def ack(self, req: Request) -> InviteTx | None:
        """The ACK ends its INVITE's transaction; None for a retransmitted ACK, or one for nothing."""
        tx = self.invites.pop((req.call_id, req.cseq.sequence), None)
        if tx is None:
            return None
        tx.acked = True
        if tx.timer is not None:
            tx.timer.cancel()
        return tx

    def pending(self, req: Request) -> InviteTx | None:
        """The INVITE transaction a CANCEL names (same Call-ID, CSeq number and branch), if any."""
        tx = self.invites.get((req.call_id, req.cseq.sequence))
        return tx if tx is not None and tx.branch == cache_key(req)[1] else None

    # ---- our BYE ---------------------------------------------------------------------------------------------

    def request(self, data: bytes, peer: Peer, addr: tuple[str, int], branch: str) -> None:
        """Send our request; over UDP again on Timer E until its response comes (`on_response`) or 64·T1."""
        peer.send(data, addr)
        if peer.transport != "UDP":
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
            peer.send(data, addr)
            interval = min(2 * interval, T2)
            self.byes[branch] = loop.call_later(interval, fire)

        self.byes[branch] = loop.call_later(T1, fire)

    def on_response(self, resp: Response) -> None:
        """A response to our BYE stops its retransmissions."""
        branch = resp.via[0].parameters.get("branch") if resp.via else None
        timer = self.byes.pop(branch or "", None)
        if timer is not None:
            timer.cancel()

    def stop(self) -> None:
        """Every timer stops; an INVITE still being answered gets 503 + Retry-After (the trunk may try elsewhere)."""
        for tx in list(self.invites.values()):
            if tx.timer is not None:
                tx.timer.cancel()
            if tx.task is not None:
                tx.task.cancel()
            if not tx.final:
                self.send(tx, tx.request, 503, "Service Unavailable", secrets.token_hex(6),
                          [("Retry-After", RETRY_AFTER_S)])
        for timer in self.byes.values():
            timer.cancel()


def cache_key(req: Request) -> CacheKey:
    return req.call_id, req.via[0].parameters.get("branch") or "", req.method
