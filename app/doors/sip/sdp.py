"""SDP offer/answer for one audio stream (RFC 4566, RFC 3264): parse a caller's offer, choose, write our answer.

The answer has as many `m=` lines as the offer, in order; every stream but the first usable audio one is refused
with port 0. For that one we pick the first offered codec we support (the caller's preference) and reuse its
payload-type number, plus telephone-event at the same clock when offered. Direction follows RFC 3264 §6.1 (a hold
offer, sendonly/inactive or `c=0.0.0.0`, is answered recvonly/inactive). Our `c=`/`m=` say where we receive and
`a=ptime:20` how we want packets; RTCP is on the next port (RFC 3605 implied).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from media.rtp import TELEPHONE_EVENT, RtpCodec, codec_named

MAX_SDP_BYTES = 8192
_DIRECTIONS = ("sendrecv", "sendonly", "recvonly", "inactive")
_ANSWER_DIRECTION = {"sendrecv": "sendrecv", "sendonly": "recvonly", "recvonly": "sendonly", "inactive": "inactive"}


class SdpError(ValueError):
    """The body is not an SDP we can read."""


@dataclass
class MediaOffer:
    kind: str
    port: int
    proto: str
    formats: list[str]
    rtpmap: dict[int, tuple[str, int]] = field(default_factory=dict)   # pt -> (encoding, clock)
    fmtp: dict[int, str] = field(default_factory=dict)
    direction: str = "sendrecv"
    address: str | None = None
    rtcp_port: int | None = None


@dataclass
class Offer:
    address: str
    media: list[MediaOffer]
    direction: str = "sendrecv"


@dataclass(frozen=True)
class Choice:
    """What we negotiated for the audio stream."""

    index: int                 # which m= line
    codec: RtpCodec
    payload_type: int
    dtmf_pt: int | None
    remote: tuple[str, int]    # where the caller receives RTP (before latching)
    remote_rtcp: tuple[str, int]
    direction: str             # ours, as in the answer
    fmtp: str | None = None    # the offer's fmtp for the chosen codec, echoed (Opus parameters)

    @property
    def sends(self) -> bool:
        return self.direction in ("sendrecv", "sendonly")


def parse_offer(body: bytes) -> Offer:
    if len(body) > MAX_SDP_BYTES:
        raise SdpError("SDP too large")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise SdpError("SDP is not UTF-8") from None
    session_addr: str | None = None
    session_dir = "sendrecv"
    media: list[MediaOffer] = []
    for raw in text.splitlines():
        line = raw.strip()
        if len(line) < 2 or line[1] != "=":
            continue
        kind, value = line[0], line[2:]
        current = media[-1] if media else None
        if kind == "c":
            parts = value.split()
            if len(parts) < 3 or parts[0] != "IN" or parts[1] not in ("IP4", "IP6"):
                raise SdpError(f"bad c= line {value!r}")
            if current is None:
                session_addr = parts[2].split("/")[0]
            else:
                current.address = parts[2].split("/")[0]
        elif kind == "m":
            parts = value.split()
            if len(parts) < 4:
                raise SdpError(f"bad m= line {value!r}")
            try:
                port = int(parts[1].split("/")[0])
            except ValueError:
                raise SdpError(f"bad m= port {parts[1]!r}") from None
            if not 0 <= port <= 65535:
                raise SdpError(f"bad m= port {port}")
            media.append(MediaOffer(parts[0], port, parts[2], parts[3:], direction=session_dir))
        elif kind == "a":
            name, _, arg = value.partition(":")
            if name in _DIRECTIONS:
                if current is None:
                    session_dir = name
                else:
                    current.direction = name
            elif current is not None and name in ("rtpmap", "fmtp", "rtcp"):
                _attribute(current, name, arg)
    if not media:
        raise SdpError("no m= line")
    address = session_addr or ""
    for m in media:
        m.address = m.address or address
        if not m.address:
            raise SdpError("no c= address")
    return Offer(address, media, session_dir)


def _attribute(m: MediaOffer, name: str, arg: str) -> None:
    pt_text, _, rest = arg.strip().partition(" ")
    try:
        pt = int(pt_text)
    except ValueError:
        return
    if name == "rtcp":
        m.rtcp_port = pt
    elif name == "rtpmap":
        enc, _, tail = rest.partition("/")
        clock = tail.split("/")[0]
        if clock.isdigit():
            m.rtpmap[pt] = (enc.strip(), int(clock))
    else:
        m.fmtp[pt] = rest.strip()


_STATIC = {0: ("PCMU", 8000), 8: ("PCMA", 8000), 9: ("G722", 8000)}


def negotiate(offer: Offer, allowed: tuple[RtpCodec, ...] | None = None) -> Choice | None:
    """The first usable audio stream and codec (the caller's order), or None: answer 488."""
    for index, m in enumerate(offer.media):
        if m.kind != "audio" or m.port == 0 or "RTP/AVP" not in m.proto or "SAVP" in m.proto:
            continue
        codec = pt = None
        for fmt in m.formats:
            if not fmt.isdigit():
                continue
            n = int(fmt)
            enc = m.rtpmap.get(n) or _STATIC.get(n)
            found = codec_named(*enc) if enc else None
            if found is not None and (allowed is None or found in allowed):
                codec, pt = found, n
                break
        if codec is None or pt is None:
            continue
        dtmf = next((n for n, (enc, clock) in m.rtpmap.items()
                     if enc.lower() == TELEPHONE_EVENT and clock == codec.clock_rate and str(n) in m.formats), None)
        held = m.address in ("0.0.0.0", "::")
        direction = _ANSWER_DIRECTION.get("inactive" if held and m.direction == "sendrecv" else m.direction,
                                          "sendrecv")
        assert m.address is not None
        return Choice(index, codec, pt, dtmf, (m.address, m.port), (m.address, m.rtcp_port or m.port + 1),
                      direction, m.fmtp.get(pt))
    return None


def answer(offer: Offer, choice: Choice, address: str, port: int, session_id: int, version: int) -> bytes:
    """Our SDP answer: the chosen stream on `address:port`, every other m= line refused (port 0)."""
    ip = "IP6" if ":" in address else "IP4"
    lines = ["v=0", f"o=personaplex {session_id} {version} IN {ip} {address}", "s=personaplex",
             f"c=IN {ip} {address}", "t=0 0"]
    for index, m in enumerate(offer.media):
        if index != choice.index:
            lines.append(f"m={m.kind} 0 {m.proto} {' '.join(m.formats[:1]) or '0'}")
            continue
        pts = [choice.payload_type] + ([choice.dtmf_pt] if choice.dtmf_pt is not None else [])
        lines.append(f"m=audio {port} {m.proto} {' '.join(map(str, pts))}")
        lines.append(f"a=rtpmap:{choice.payload_type} {choice.codec.rtpmap()}")
        if choice.fmtp:
            lines.append(f"a=fmtp:{choice.payload_type} {choice.fmtp}")
        if choice.dtmf_pt is not None:
            lines.append(f"a=rtpmap:{choice.dtmf_pt} {TELEPHONE_EVENT}/{choice.codec.clock_rate}")
            lines.append(f"a=fmtp:{choice.dtmf_pt} 0-16")
        lines.append("a=ptime:20")
        lines.append(f"a={choice.direction}")
    return ("\r\n".join(lines) + "\r\n").encode()
