"""An Opus decoder that can use a lost packet's in-band FEC and conceal, through libopus itself.

PyAV's libopus decoder does neither (measured with PyAV 18.1: its only private option is `apply_phase_inv`, an empty
packet is the end of the stream and the decoder answers EOF after it, and no packet side data asks for FEC), so the
three decoder calls we need are bound here with ctypes, to the libopus inside PyAV's wheel (the one aiortc already
decodes with; no second copy, no system package), else the system's. `OpusDecoder` decodes straight to the rate
asked for (libopus resamples internally: 24 kHz here, so no resampler and no resampler delay).

- `decode(payload)`: one packet; `samples_in(payload)`: how many samples it decodes to.
- `has_fec(payload)`: the packet carries redundancy for the one before it (a sender with in-band FEC on, once it
  expects loss: browsers do when RTCP reports some and the answer said `useinbandfec=1`).
- `recover(next_payload, samples)`: the packet before `next_payload`, from that redundancy (libopus conceals
  instead when there is none). Call it before decoding `next_payload`.
- `conceal(samples)`: packet-loss concealment, continuing the signal.

And what the server's own Opus senders (WebRTC, SIP) do about in-band FEC: `asks_inband_fec(fmtp)` reads a caller's
Opus format parameters, and `DOWNLINK_FEC_LOSS_PCT` is the loss they then encode redundancy for;
`rtpmap_payload_types(lines, "opus/")` finds an SDP's Opus formats.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

import av
import numpy as np

MAX_FRAME_S = 0.12          # Opus packets carry at most 120 ms
# In-band FEC on what the server sends a caller whose decoder uses it: libopus's redundancy for that much expected
# loss. Measured (`python3 -m bench.impair_opus --downlink`: speech, 24 kHz mono at 48 kb/s): the loss-free decode
# 0.09 dB under no FEC at the same bit rate; at 1 % random loss the lost stretches 7.9 dB from the speech against 0.6
# with the decoder's concealment alone. A fixed amount: PyAV's encoder takes its options once, at open.
DOWNLINK_FEC_LOSS_PCT = 10


def rtpmap_payload_types(lines: list[str], encoding: str = "") -> list[str]:
    """The payload types of an SDP's `a=rtpmap:` lines whose encoding (as `opus/48000/2`, in any case) starts with
    `encoding`; a line that names no encoding is skipped."""
    return [parts[0] for line in lines if line.startswith("a=rtpmap:")
            and len(parts := line[9:].split()) > 1 and parts[1].lower().startswith(encoding)]


def asks_inband_fec(fmtp: str) -> bool:
    """Whether Opus format parameters (an SDP `a=fmtp:` line's, after the payload type) say the decoder uses
    in-band FEC (`useinbandfec=1`, every browser's default)."""
    params = dict(p.strip().partition("=")[::2] for p in fmtp.split(";"))
    return params.get("useinbandfec") == "1"


@functools.cache
def _library() -> ctypes.CDLL:
    bundled = sorted((Path(av.__file__).parent.parent / "av.libs").glob("libopus*.so*"))
    name = str(bundled[0]) if bundled else ctypes.util.find_library("opus")
    if name is None:
        raise OSError("no libopus found (PyAV's wheel carries one; otherwise install the system's libopus)")
    lib = ctypes.CDLL(name)
    lib.opus_decoder_create.restype = ctypes.c_void_p
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_decode.restype = ctypes.c_int
    lib.opus_decode.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int16),
                                ctypes.c_int, ctypes.c_int]
    lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_packet_has_lbrr.restype = ctypes.c_int
    lib.opus_packet_has_lbrr.argtypes = [ctypes.c_char_p, ctypes.c_int32]
    lib.opus_packet_get_nb_samples.restype = ctypes.c_int
    lib.opus_packet_get_nb_samples.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32]
    return lib


class OpusDecoder:
    """Mono float32 at `rate` (8, 12, 16, 24 or 48 kHz) from Opus packets; raises ValueError on a bad packet."""

    def __init__(self, rate: int = 24000) -> None:
        self._state = None
        if rate not in (8000, 12000, 16000, 24000, 48000):
            raise ValueError(f"libopus decodes at 8, 12, 16, 24 or 48 kHz, not {rate}")
        self._lib = _library()
        self.rate = rate
        err = ctypes.c_int()
        self._state = self._lib.opus_decoder_create(rate, 1, ctypes.byref(err))
        if err.value or not self._state:
            raise OSError(f"opus_decoder_create failed ({err.value})")
        self._pcm = (ctypes.c_int16 * int(rate * MAX_FRAME_S))()

    def decode(self, payload: bytes) -> np.ndarray:
        if not payload:
            raise ValueError("an empty Opus packet")
        return self._run(payload, len(self._pcm), fec=False)

    def samples_in(self, payload: bytes) -> int:
        n = self._lib.opus_packet_get_nb_samples(payload, len(payload), self.rate)
        if n <= 0:
            raise ValueError(f"not an Opus packet (libopus error {n})")
        return n

    def has_fec(self, payload: bytes) -> bool:
        return bool(payload) and self._lib.opus_packet_has_lbrr(payload, len(payload)) > 0

    def recover(self, next_payload: bytes, samples: int) -> np.ndarray:
        return self._run(next_payload, samples, fec=True)

    def conceal(self, samples: int) -> np.ndarray:
        return self._run(None, samples, fec=False)

    def _run(self, data: bytes | None, samples: int, fec: bool) -> np.ndarray:
        if self._state is None:
            raise ValueError("the decoder is closed")
        samples = min(samples, len(self._pcm))
        n = self._lib.opus_decode(self._state, data, len(data) if data else 0, self._pcm, samples, int(fec))
        if n < 0:
            raise ValueError(f"undecodable Opus packet (libopus error {n})")
        return np.frombuffer(self._pcm, dtype=np.int16, count=n).astype(np.float32) / 32768.0

    def close(self) -> None:
        if self._state is not None:
            self._lib.opus_decoder_destroy(self._state)
            self._state = None

    def __del__(self) -> None:
        self.close()
