"""RFC 2198 redundant audio (RED) for Opus: each RTP packet carries the packets before it, whole.

Chromium offers `red/48000/2` with `a=fmtp:63 111/111` (Opus, once more redundant) on every call, and sends it when the
answer lists it first; its player (NetEq) takes it from us the same way. A lost packet is then rebuilt from the next
one bit for bit, where in-band FEC (media/opus.py) gives only a lower-rate copy, and only once the encoder expects
loss. The price is the bit rate: one redundant block doubles it (Opus at 48 kb/s: ~100 kb/s with the headers).

- `red_format(sdp, opus_pt)`: the RED payload type of a peer's SDP that wraps that Opus payload type only, and how
  many earlier packets it carries (its fmtp lists the blocks, the primary last).
- `pack(...)` / `unpack(payload)`: the payload format (RFC 2198 §3): a 4-byte header per redundant block (F bit,
  block payload type, 14-bit timestamp offset, 10-bit length), a 1-byte header for the primary, then the blocks.
- `Redundancy`: a sender's memory of its recent packets, wrapping each new one with the last `depth` of them.
- `RedDepth`: that depth from the loss a caller's RTCP receiver reports: once redundant as negotiated, twice while
  the link loses much (a burst's second packet comes back too).
- `with_red_offer(sdp)`: an offer that proposes RED over its Opus format, as a browser's does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from media.opus import rtpmap_payload_types

RED_CODEC = "red/48000/2"
MAX_OFFSET = (1 << 14) - 1        # RTP clock ticks a redundant block may lie behind the primary
MAX_BLOCK = (1 << 10) - 1         # bytes in a redundant block
MAX_REDUNDANT = 2                 # earlier packets carried at the most, whatever a peer's fmtp lists
# RedDepth: what a caller's receiver reports over an interval of at least REPORTED_PACKETS packets (5 s: Chromium
# reports about that often; over aiortc's 1 s, 50 packets, a far link's 1 % lost two or more in one of eleven). At
# DEEPEN_LOSS or more each packet carries two earlier ones (three times the bit rate); after CALM_REPORTS intervals
# under CALM_LOSS, one again. Measured (`python3 -m bench.impair_opus --downlink`, docs/benchmarks.md): bursts of
# three at 5 % lose half as many packets for good with two as with one; on a far link's 1 %, once redundant brings
# back all but 2 of 31 lost packets.
DEEPEN_LOSS = 0.03
CALM_LOSS = 0.01
CALM_REPORTS = 3
REPORTED_PACKETS = 250


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
    """What a RED sender keeps: its last packets and their RTP times, the last `depth` of them carried by each packet
    after (the format's count at first; `RedDepth` may deepen it, up to MAX_REDUNDANT: a receiver takes whatever
    blocks a packet has, as Chromium's and ours do)."""

    def __init__(self, fmt: RedFormat) -> None:
        self.format = fmt
        self.depth = fmt.redundant
        self._recent: deque[tuple[int, bytes]] = deque(maxlen=MAX_REDUNDANT)

    def wrap(self, primary: bytes, timestamp: int) -> bytes:
        """The RED payload for `primary` at RTP time `timestamp` (wrapping 32-bit arithmetic)."""
        depth = self.depth  # read once: another thread may change it between packets
        carried = list(self._recent)[-depth:] if depth > 0 else []
        earlier = [((timestamp - at) & 0xFFFFFFFF, data) for at, data in carried]
        self._recent.append((timestamp, primary))
        return pack(self.format.opus_type, primary, earlier)


@dataclass
class RedDepth:
    """How many earlier packets a RED sender carries, from its receiver's RTCP reports: `report(lost, received)`
    takes their running counts (a `remote-inbound-rtp` stat's `packetsLost` and `packetsReceived`) and gives the
    depth, `base` (the negotiated count) while the loss is low, MAX_REDUNDANT from an interval that loses DEEPEN_LOSS
    or more until CALM_REPORTS intervals in a row lose under CALM_LOSS. An interval is what came since the last one
    counted, once it spans REPORTED_PACKETS packets (Chromium reports every ~5 s, aiortc every ~1 s)."""

    base: int = 1
    depth: int = field(init=False)
    deepened: int = field(default=0, init=False)      # times it went to MAX_REDUNDANT
    _lost: int = field(default=0, init=False, repr=False)
    _received: int = field(default=0, init=False, repr=False)
    _calm: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.depth = self.base

    def report(self, lost: int, received: int) -> int:
        new_lost, new_received = max(0, lost - self._lost), max(0, received - self._received)
        if new_lost + new_received < REPORTED_PACKETS:
            return self.depth
        self._lost, self._received = lost, received
        loss = new_lost / (new_lost + new_received)
        if loss >= DEEPEN_LOSS:
            self._calm = 0
            if self.depth < MAX_REDUNDANT:
                self.depth = MAX_REDUNDANT
                self.deepened += 1
        elif loss < CALM_LOSS:
            self._calm += 1
            if self._calm >= CALM_REPORTS:
                self.depth = self.base
        else:
            self._calm = 0
        return self.depth


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
