"""What Opus itself could do for lost input packets, measured: silence (what the server does now), the decoder's
packet-loss concealment, and in-band FEC; prints one JSON line.

    python3 -m bench.impair_opus [--seconds 60] [--link far|bursty|...] [--fec-loss-pct 10]

Speech (espeak-ng, else a synthetic voice) is encoded as a browser would send it: 20 ms mono Opus packets at 48 kHz,
with in-band FEC on (`fec=1`, `packet_loss`, as a browser does once RTCP reports loss). Packets are lost by a seeded
`bench.impair` link and decoded three ways, each against the same stream decoded with no loss:
- `silence`: the lost 20 ms stay zeros (media/tracks.py's InboundAudio with media/jitter.py today);
- `plc`: libopus conceals each lost packet (`opus_decode` with no data);
- `fec`: a lost packet whose successor arrived is rebuilt from the successor's in-band redundancy
  (`decode_fec=1`), PLC otherwise (what a receiver that holds one packet back can do).
Reported per way: SNR over the lost stretches only and over the whole stream, in dB.

PyAV's libopus decoder cannot do either (measured, PyAV 18.1: its only private option is `apply_phase_inv`, an empty
packet is the end of the stream and the decoder answers EOF afterwards, and no packet side data asks for FEC), so
this bench calls libopus through ctypes: the copy inside PyAV's wheel (the one aiortc decodes with), else the
system's libopus.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
from pathlib import Path

import av
import numpy as np

from bench.doors import speech
from bench.impair import Link, LinkModel
from media.resample import Resampler

RATE = 48000
PACKET = 960


def libopus() -> ctypes.CDLL:
    bundled = sorted((Path(av.__file__).parent.parent / "av.libs").glob("libopus*.so*"))
    name = str(bundled[0]) if bundled else ctypes.util.find_library("opus")
    if name is None:
        raise OSError("no libopus found (PyAV's wheel carries one; else install the system's libopus)")
    lib = ctypes.CDLL(name)
    lib.opus_decoder_create.restype = ctypes.c_void_p
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_decode.restype = ctypes.c_int
    lib.opus_decode.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int16),
                                ctypes.c_int, ctypes.c_int]
    lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    return lib


class Decoder:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        err = ctypes.c_int()
        self._st = lib.opus_decoder_create(RATE, 1, ctypes.byref(err))
        if err.value:
            raise OSError(f"opus_decoder_create failed: {err.value}")
        self._pcm = (ctypes.c_int16 * PACKET)()

    def decode(self, data: bytes | None, fec: bool = False) -> np.ndarray:
        n = self._lib.opus_decode(self._st, data, len(data) if data else 0, self._pcm, PACKET, int(fec))
        if n < 0:
            raise ValueError(f"opus_decode failed: {n}")
        return np.frombuffer(self._pcm, dtype=np.int16, count=n).astype(np.float32) / 32768.0

    def close(self) -> None:
        self._lib.opus_decoder_destroy(self._st)


def encode(x: np.ndarray, loss_pct: int) -> list[bytes]:
    enc = av.CodecContext.create("libopus", "w")
    enc.sample_rate, enc.layout, enc.format, enc.bit_rate = RATE, "mono", "s16", 32000
    enc.options = {"application": "voip", "fec": "1", "packet_loss": str(loss_pct)}
    pcm = np.clip(np.rint(x * 32767), -32768, 32767).astype(np.int16)
    out: list[bytes] = []
    for i in range(pcm.size // PACKET):
        frame = av.AudioFrame.from_ndarray(pcm[None, i * PACKET:(i + 1) * PACKET], format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, i * PACKET
        out += [bytes(p) for p in enc.encode(frame)]
    return out


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((ref - got) ** 2))
    return round(10 * np.log10(float(np.sum(ref**2)) / noise), 2) if noise > 0 else float("inf")


def run(seconds: float, link: Link, loss_pct: int, seed: int) -> dict[str, object]:
    x = Resampler(24000, RATE).process(speech(None, seconds))
    packets = encode(x, loss_pct)
    model = LinkModel(link, seed)
    lost = [not model.schedule(i * 0.02) for i in range(len(packets))]
    lib = libopus()
    ways = {"clean": Decoder(lib), "silence": Decoder(lib), "plc": Decoder(lib), "fec": Decoder(lib)}
    out: dict[str, list[np.ndarray]] = {k: [] for k in ways}
    for i, pkt in enumerate(packets):
        out["clean"].append(ways["clean"].decode(pkt))
        if not lost[i]:
            for k in ("silence", "plc", "fec"):
                out[k].append(ways[k].decode(pkt))
            continue
        out["silence"].append(np.zeros(PACKET, np.float32))
        out["plc"].append(ways["plc"].decode(None))
        has_next = i + 1 < len(packets) and not lost[i + 1]
        out["fec"].append(ways["fec"].decode(packets[i + 1], fec=True) if has_next else ways["fec"].decode(None))
    for d in ways.values():
        d.close()
    ref = np.concatenate(out["clean"])
    mask = np.repeat(np.asarray(lost), PACKET)[: ref.size]
    report: dict[str, object] = {"bench": "impair_opus", "seconds": seconds, "link": link.__dict__,
                                 "packets": len(packets), "lost": int(sum(lost)), "fec_packet_loss_pct": loss_pct}
    for k in ("silence", "plc", "fec"):
        got = np.concatenate(out[k])[: ref.size]
        report[k] = {"snr_lost_db": snr_db(ref[mask], got[mask]), "snr_all_db": snr_db(ref, got)}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--link", type=Link.parse, default=Link.parse("far"))
    p.add_argument("--fec-loss-pct", type=int, default=10, help="the encoder's expected loss (libopus `packet_loss`)")
    p.add_argument("--seed", type=int, default=30)
    args = p.parse_args()
    print(json.dumps(run(args.seconds, args.link, args.fec_loss_pct, args.seed)))


if __name__ == "__main__":
    main()
