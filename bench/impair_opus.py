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

PyAV's libopus decoder can do neither, so the decoding goes through libopus itself (media/opus.py, which the
server's WebRTC input now uses for FEC).
"""

from __future__ import annotations

import argparse
import json

import av
import numpy as np

from bench.doors import speech
from bench.impair import Link, LinkModel
from media.opus import OpusDecoder
from media.resample import Resampler

RATE = 48000
PACKET = 960


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
    ways = {k: OpusDecoder(RATE) for k in ("clean", "silence", "plc", "fec")}
    out: dict[str, list[np.ndarray]] = {k: [] for k in ways}
    for i, pkt in enumerate(packets):
        out["clean"].append(ways["clean"].decode(pkt))
        if not lost[i]:
            for k in ("silence", "plc", "fec"):
                out[k].append(ways[k].decode(pkt))
            continue
        out["silence"].append(np.zeros(PACKET, np.float32))
        out["plc"].append(ways["plc"].conceal(PACKET))
        has_next = i + 1 < len(packets) and not lost[i + 1]
        out["fec"].append(ways["fec"].recover(packets[i + 1], PACKET) if has_next else ways["fec"].conceal(PACKET))
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
