"""Asterisk AudioSocket: a TCP door (`--audiosocket-port PORT`, off unless set), Asterisk being the client.

Asterisk connects (dialplan `Answer()` then `AudioSocket(<uuid>,host:port)`, or `Dial(AudioSocket/host:port/<uuid>)`)
and sends frames `kind: u8 | length: u16 big-endian | payload`: first the call's UUID (kind 0x01, 16 bytes), which
reserves a slot and starts the conversation (server defaults for persona and voice: the protocol carries nothing
else); then signed-linear 16-bit little-endian mono audio, kind 0x10 at 8 kHz (0x11-0x16: 12, 16, 24, 32, 44.1,
48 kHz are taken too); DTMF (kind 0x03, one ASCII digit, counted); hang-up (kind 0x00) or an error (kind 0xff),
which end the call, as does closing the socket (how Asterisk says the caller hung up): the slot is freed at once.
Out: kind 0x10 frames of 20 ms (320 bytes at 8 kHz) paced one per 20 ms, since Asterisk plays what it gets without
re-timing; silence while the model's next frame is due.

Refusals and malformed frames: the protocol has no error frame towards Asterisk, so the server hangs up (`00 00 00`,
then closes the socket). That answers a full server (no free slot), a first frame that is not a UUID, an unknown
kind, a zero-length or odd-length audio frame, and a rate outside 8-48 kHz. No first frame within
`first_message_timeout_s`, or nothing for `idle_timeout_s`, closes the socket. AudioSocket has no credentials:
the door listens on `--host` only, so keep it on a private address reachable by the Asterisk servers alone; the
per-address connection limit applies.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from app.doors.phone.line import PhoneLine
from app.sessions.errors import ProtocolError
from app.sessions.tcp import TcpTransport
from app.sessions.transport import CLOSE_NORMAL, CLOSE_POLICY
from app.shell.context import CONTEXT, ServerContext
from media.codecs import AudioFormat

logger = logging.getLogger(__name__)

ROUTE = "audiosocket"
KIND_HANGUP = 0x00
KIND_UUID = 0x01
KIND_DTMF = 0x03
KIND_SLIN = 0x10
KIND_ERROR = 0xFF
RATES = {0x10: 8000, 0x11: 12000, 0x12: 16000, 0x13: 24000, 0x14: 32000, 0x15: 44100, 0x16: 48000}
HANGUP = bytes((KIND_HANGUP, 0, 0))
LINE = AudioFormat("pcm16", 8000)


def frame(kind: int, payload: bytes) -> bytes:
    return bytes((kind,)) + len(payload).to_bytes(2, "big") + payload


class AudioSocketSession(PhoneLine):
    route = ROUTE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_uuid: str | None = None

    async def on_binary(self, data: bytes) -> None:
        kind, payload = data[0], data[3:]
        try:
            await self._take(kind, payload)
        except ProtocolError as e:
            self.ctx.metrics.errors[e.code] += 1
            logger.info("audiosocket %s: %s; hanging up", self.call_uuid, e.message)
            await self.close(CLOSE_POLICY, e.code)

    async def _take(self, kind: int, payload: bytes) -> None:
        if self.call_uuid is None:
            if kind != KIND_UUID or len(payload) != 16:
                raise ProtocolError("bad_event", f"the first frame must be the call's UUID (kind 0x01, 16 bytes), "
                                    f"got kind 0x{kind:02x} with {len(payload)} bytes")
            self.call_uuid = str(uuid.UUID(bytes=payload))
            self.caller = {"uuid": self.call_uuid}
            await self.begin(self.call_config({}, ""), LINE)
        elif kind in RATES:
            if not payload:
                raise ProtocolError("bad_audio", "an audio frame with no samples")
            assert self.decoder is not None
            if RATES[kind] != self.decoder.format.sample_rate:
                self.decoder.set_format(AudioFormat("pcm16", RATES[kind]))
            self.hear(payload, "audio")
        elif kind == KIND_DTMF:
            self.dtmf(payload.decode("ascii", "replace"), "dtmf")
        elif kind == KIND_HANGUP:
            await self.close(CLOSE_NORMAL, "hangup")
        elif kind == KIND_ERROR:
            logger.info("audiosocket %s: Asterisk reports error %s", self.call_uuid, payload.hex() or "(none)")
            await self.close(CLOSE_NORMAL, "remote_error")
        else:
            raise ProtocolError("bad_event", f"unknown frame kind 0x{kind:02x}")

    def send_chunk(self, samples: np.ndarray) -> None:
        self.send_audio_nowait(frame(KIND_SLIN, LINE.encode(samples)))

    async def close(self, code: int, reason: str, *, send_closed: bool = True) -> None:
        if self.outbox.overflowed and not self.closed:   # an unread output was dropped: the hang-up still goes
            self.outbox.put_last(HANGUP)
        else:
            self.send_audio_nowait(HANGUP)   # the protocol's only word for "this call is over", whatever the reason
        await super().close(code, reason, send_closed=send_closed)


AUDIOSOCKET = web.AppKey("personaplex_audiosocket", asyncio.Server)


def setup_audiosocket(app: web.Application) -> None:
    """Listen for Asterisk on `--audiosocket-port` while the app runs (nothing when the port is 0)."""
    if app[CONTEXT].settings.audiosocket_port:
        app.on_startup.append(_listen)
        app.on_shutdown.append(_stop_listening)


async def _listen(app: web.Application) -> None:
    ctx: ServerContext = app[CONTEXT]

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await TcpTransport(ctx, reader, writer, AudioSocketSession(ctx)).serve()

    # reuse_port: each worker process listens on the same port, as they do on the HTTP one.
    app[AUDIOSOCKET] = await asyncio.start_server(connected, ctx.settings.host, ctx.settings.audiosocket_port,
                                                  reuse_port=True)


async def _stop_listening(app: web.Application) -> None:
    listening = app.get(AUDIOSOCKET)  # none when the start failed (a port another process holds)
    if listening is not None:
        listening.close()   # no new calls; the open ones end with the server's shutdown
