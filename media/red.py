"""RFC 2198 redundant audio (RED) for Opus: each RTP packet carries the packets before it, whole.

Chromium offers `red/48000/2` with `a=fmtp:63 111/111` (Opus, once more redundant) on every call, and sends it when the
answer lists it first; its player (NetEq) takes it from us the same way. A lost packet is then rebuilt from the next
one bit for bit, where in-band FEC (media/opus.py) gives only a lower-rate copy, and only once the encoder expects
loss. The price is the bit rate: one redundant block doubles it (Opus at 48 kb/s: ~100 kb/s with the headers).

- `red_format(sdp, opus_pt)`: the RED payload type of a peer's SDP that wraps that Opus payload type only, and how
  many earlier packets it carries (its fmtp lists the blocks, the primary last).
- `pack(...)` / `unpack(payload)`: the payload format (RFC 2198 §3): a 4-byte header per redundant block (F bit,
  block payload type, 14-bit timestamp offset, 10-bit length), a 1-byte header for the primary, then the blocks.
- `Redundancy`: a sender's memory of its recent packets, wrapping each new one with them.
- `with_red_offer(sdp)`: an offer that proposes RED over its Opus format, as a browser's does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from media.opus import rtpmap_payload_types

RED_CODEC = "red/48000/2"
MAX_OFFSET = (1 << 14) - 1        # RTP clock ticks a redundant block may lie behind the primary
MAX_BLOCK = (1 << 10) - 1         # bytes in a redundant block
MAX_REDUNDANT = 2                 # earlier packets carried at the most, whatever a peer's fmtp lists


@dataclass(frozen=True)
class RedFormat:
    """A negotiated RED format over Opus."""

    payload_type: int       # the RED packets' own
    opus_type: int          # the blocks'
    redundant: int          # earlier packets each packet carries (1 for Chromium's `111/111`)


@dataclass(frozen=True)
class Block:
    """One block of a RED payload: `offset` RTP clock ticks before the packet's timestamp (0 for the primary)."""

    payload_type: int
    offset: int
    data: bytes


def red_format(sdp: str, opus_type: int) -> RedFormat | None:
    """The RED format an SDP's audio section offers over `opus_type` (every block Opus), or None."""
    audio = _audio_lines(sdp)
    red = rtpmap_payload_types(audio, RED_CODEC)
    for line in audio:
        if not line.startswith("a=fmtp:"):
            continue
        pt, _, blocks = line[7:].partition(" ")
        types = blocks.strip().split("/")
        if pt in red and pt.isdigit() and len(types) >= 2 and all(t == str(opus_type) for t in types):
            return RedFormat(int(pt), opus_type, min(len(types) - 1, MAX_REDUNDANT))
    return None


def pack(opus_type: int, primary: bytes, earlier: list[tuple[int, bytes]]) -> bytes:
    """A RED payload of `primary` after `earlier` ((offset, data), oldest first); blocks that cannot be carried (an
    offset past 14 bits, a block past 10 bits of length, an empty one) are left out."""
    kept = [(offset, data) for offset, data in earlier if 0 < offset <= MAX_OFFSET and 0 < len(data) <= MAX_BLOCK]
    head = bytearray()
    for offset, data in kept:
        word = (1 << 31) | (opus_type << 24) | (offset << 10) | len(data)
        head += word.to_bytes(4, "big")
    head.append(opus_type)
    return bytes(head) + b"".join(data for _, data in kept) + primary


def unpack(payload: bytes) -> list[Block]:
    """The blocks of a RED payload, oldest first, the primary last; ValueError if it is not well formed."""
    headers: list[tuple[int, int, int]] = []
    i = 0
    while True:
        if i >= len(payload):
            raise ValueError("a RED payload that ends inside its headers")
        first = payload[i]
        if not first & 0x80:
            headers.append((first & 0x7F, 0, -1))
            i += 1
            break
        if i + 4 > len(payload):
            raise ValueError("a RED payload that ends inside a block header")
        word = int.from_bytes(payload[i:i + 4], "big")
        headers.append(((word >> 24) & 0x7F, (word >> 10) & MAX_OFFSET, word & MAX_BLOCK))
        i += 4
    blocks = []
    for pt, offset, length in headers:
        end = len(payload) if length < 0 else i + length
        if end > len(payload):
            raise ValueError("a RED block longer than its payload")
        blocks.append(Block(pt, offset, payload[i:end]))
        i = end
    return blocks


class Redundancy:
    """What a RED sender keeps: its last `redundant` packets and their RTP times, each carried by the packets after."""

    def __init__(self, fmt: RedFormat) -> None:
        self.format = fmt
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=fmt.redundant)

    def wrap(self, primary: bytes, timestamp: int) -> bytes:
        """The RED payload for `primary` at RTP time `timestamp` (wrapping 32-bit arithmetic)."""
        earlier = [((timestamp - at) & 0xFFFFFFFF, data) for at, data in self._recent]
        self._recent.append((timestamp, primary))
        return pack(self.format.opus_type, primary, earlier)


def with_red_offer(sdp: str, payload_type: int = 63) -> str:
    """An offer whose audio also proposes RED over its first Opus format (once redundant), as Chromium's does; an
    offer without Opus, or with RED already, is returned as it is."""
    lines = sdp.split("\r\n")
    audio = _audio_lines(sdp)
    opus = rtpmap_payload_types(audio, "opus/")
    if not opus or rtpmap_payload_types(audio, RED_CODEC) or str(payload_type) in rtpmap_payload_types(audio):
        return sdp
    out = []
    for line in lines:
        if line.startswith("m=audio "):
            line = f"{line} {payload_type}"
        out.append(line)
        if line.startswith(f"a=rtpmap:{opus[0]} "):
            out += [f"a=rtpmap:{payload_type} {RED_CODEC}", f"a=fmtp:{payload_type} {opus[0]}/{opus[0]}"]
    return "\r\n".join(out)


def _audio_lines(sdp: str) -> list[str]:
    """The lines of an SDP's first audio media section."""
    out: list[str] = []
    inside = False
    for line in sdp.splitlines():
        if line.startswith("m="):
            if inside:
                break
            inside = line.startswith("m=audio ")
        if inside:
            out.append(line)
    return out
