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

`--downlink` measures the other direction, what the server sends a browser: its own encoder (media/tracks.py's
ContainedOpusEncoder, 24 kHz mono at 48 kb/s) without in-band FEC, with `DOWNLINK_FEC_LOSS_PCT`, and with that and RED
(media/red.py, once redundant, as with a browser that offers it: `fec_10_red`; twice: `fec_10_red2`), each decoded
as a browser's player does (a lost packet from a RED block of the first of its successors that came, else from its
next packet's FEC where that has some, concealed otherwise), in dB against the speech itself: over the lost
stretches, over the whole stream, and the whole stream with no loss (what the redundancy costs the packets that
arrive), with the bit rate (RED's headers included) and the share of lost packets that decoded bit for bit as if
they had arrived (`lost_as_if_received`).
"""

from __future__ import annotations

import argparse
import fractions
import json

import av
import numpy as np

from bench.doors import speech
from bench.impair import Link, LinkModel
from media.opus import DOWNLINK_FEC_LOSS_PCT, OpusDecoder
from media.red import Block, RedFormat, Redundancy, unpack
from media.resample import Resampler
from media.tracks import ContainedOpusEncoder

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


def downlink(seconds: float, link: Link, seed: int) -> dict[str, object]:
    x = speech(None, seconds)
    pcm = np.clip(np.rint(x * 32767), -32768, 32767).astype(np.int16)
    step = 480                                  # the server's 20 ms packets at 24 kHz
    model = LinkModel(link, seed)
    lost = [not model.schedule(i * 0.02) for i in range(pcm.size // step)]
    report: dict[str, object] = {"bench": "impair_opus_downlink", "seconds": seconds, "link": link.__dict__,
                                 "packets": len(lost), "lost": int(sum(lost))}
    fec = f"fec_{DOWNLINK_FEC_LOSS_PCT}"
    for variant, loss_pct, red in (("fec_0", 0, 0), (fec, DOWNLINK_FEC_LOSS_PCT, 0),
                                   (f"{fec}_red", DOWNLINK_FEC_LOSS_PCT, 1), (f"{fec}_red2", DOWNLINK_FEC_LOSS_PCT, 2)):
        encoder, sent = ContainedOpusEncoder(expected_loss_pct=loss_pct), []
        encoder.red = Redundancy(RedFormat(63, 111, red)) if red else None
        for i in range(len(lost)):
            frame = av.AudioFrame.from_ndarray(pcm[None, i * step:(i + 1) * step], format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 24000, i * step, fractions.Fraction(1, 24000)
            sent += encoder.encode(frame)[0]
        blocks = [unpack(pkt) if red else [Block(111, 0, pkt)] for pkt in sent]
        packets = [b[-1].data for b in blocks]
        decoded, per_packet = {}, {}
        for name, dropped in (("no_loss", [False] * len(packets)), ("lossy", lost)):
            decoder, out = OpusDecoder(24000), []
            for i, pkt in enumerate(packets):
                arrived = i + 1 < len(packets) and not dropped[i + 1]
                # The first of the next `red` packets that came carries this one `k` packets back (48 kHz offsets).
                copy = next((b.data for k in range(1, red + 1) if i + k < len(packets) and not dropped[i + k]
                             for b in blocks[i + k][:-1] if b.offset == 2 * step * k), None)
                if not dropped[i]:
                    out.append(decoder.decode(pkt))
                elif copy is not None:
                    out.append(decoder.decode(copy))
                elif arrived and decoder.has_fec(packets[i + 1]):
                    out.append(decoder.recover(packets[i + 1], step))
                else:
                    out.append(decoder.conceal(step))
            decoder.close()
            decoded[name], per_packet[name] = np.concatenate(out), out
        # Opus delays its output by its lookahead: align on the loss-free decode
        n = decoded["no_loss"].size - 400
        lag = max(range(400), key=lambda d: float(np.dot(x[:n], decoded["no_loss"][d:d + n])))
        ref = x[:n]
        mask = np.repeat(np.asarray(lost), step)[:n]
        got = decoded["lossy"][lag:lag + n]
        probe = OpusDecoder(24000)
        with_fec = sum(probe.has_fec(pkt) for pkt in packets)
        probe.close()
        report[variant] = {
            "kbps": round(sum(map(len, sent)) * 8 / (len(sent) * 20.0), 1),
            "with_fec_share": round(with_fec / len(packets), 3),
            "snr_no_loss_db": snr_db(ref, decoded["no_loss"][lag:lag + n]),
            "snr_lost_db": snr_db(ref[mask], got[mask]), "snr_all_db": snr_db(ref, got),
            "lost_as_if_received": round(sum(np.array_equal(per_packet["lossy"][i], per_packet["no_loss"][i])
                                             for i in np.flatnonzero(lost)) / max(1, sum(lost)), 3)}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--link", type=Link.parse, default=Link.parse("far"))
    p.add_argument("--fec-loss-pct", type=int, default=10, help="the encoder's expected loss (libopus `packet_loss`)")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--downlink", action="store_true",
                   help="the server's own encoder: without FEC, with it, with it and RED once or twice redundant")
    args = p.parse_args()
    if args.downlink:
        print(json.dumps(downlink(args.seconds, args.link, args.seed)))
    else:
        print(json.dumps(run(args.seconds, args.link, args.fec_loss_pct, args.seed)))


if __name__ == "__main__":
    main()
