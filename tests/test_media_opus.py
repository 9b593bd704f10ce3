"""media/opus.py (libopus with FEC and concealment) and the answer's `useinbandfec`, on real Opus packets."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import speech_like

from media.opus import DOWNLINK_FEC_LOSS_PCT, OpusDecoder, asks_inband_fec
from media.rtp import OPUS, AudioCodec
from media.tracks import ContainedOpusEncoder, decodes_inband_fec, pcm_frame, with_inband_fec

PACKET = 480


def packets(x: np.ndarray, loss_pct: int) -> list[bytes]:
    enc = ContainedOpusEncoder(expected_loss_pct=loss_pct)
    out: list[bytes] = []
    for i in range(x.size // PACKET):
        out += enc.encode(pcm_frame(x[i * PACKET:(i + 1) * PACKET], i * PACKET))[0]
    return out


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum((ref - got) ** 2), 1e-12)))


def test_a_lost_packet_comes_back_from_its_successors_fec() -> None:
    x = speech_like(3.0)
    pkts = packets(x, loss_pct=10)
    clean = OpusDecoder()
    ref = [clean.decode(p) for p in pkts]
    lost = [i for i in range(10, len(pkts) - 1, 5) if clean.has_fec(pkts[i + 1])]
    assert len(lost) >= 8            # the encoder adds redundancy where it judges the speech worth it
    rebuilt = OpusDecoder()
    concealed = OpusDecoder()
    got_fec, got_plc = [], []
    for i, p in enumerate(pkts):
        if i in lost:
            got_fec.append(rebuilt.recover(pkts[i + 1], PACKET))
            got_plc.append(concealed.conceal(PACKET))
        else:
            rebuilt.decode(p)
            concealed.decode(p)
    want = np.concatenate([ref[i] for i in lost])
    fec, plc = np.concatenate(got_fec), np.concatenate(got_plc)
    assert fec.size == plc.size == want.size == PACKET * len(lost)
    # FEC's redundancy is coarser than the packet, but far nearer to it than concealment or silence (0 dB)
    assert snr_db(want, fec) > max(3.0, snr_db(want, plc) + 2.0), (snr_db(want, fec), snr_db(want, plc))


def test_without_fec_there_is_no_redundancy_and_bad_input_is_refused() -> None:
    pkts = packets(speech_like(1.0), loss_pct=0)
    dec = OpusDecoder()
    assert not any(dec.has_fec(p) for p in pkts) and dec.samples_in(pkts[3]) == PACKET
    for bad in (b"", b"\xff" * 3):
        with pytest.raises(ValueError):
            dec.decode(bad)
    with pytest.raises(ValueError):
        OpusDecoder(44100)


def test_the_answer_asks_for_inband_fec() -> None:
    bare = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 96 0\r\na=rtpmap:96 opus/48000/2\r\na=rtpmap:0 PCMU/8000\r\n"
    assert with_inband_fec(bare).split("\r\n")[3] == "a=fmtp:96 useinbandfec=1"
    params = "v=0\r\nm=audio 9 RTP/AVP 111\r\na=rtpmap:111 opus/48000/2\r\na=fmtp:111 minptime=10\r\n"
    assert "a=fmtp:111 minptime=10;useinbandfec=1" in with_inband_fec(params)
    assert with_inband_fec(with_inband_fec(bare)) == with_inband_fec(bare)


def test_an_offer_whose_opus_decoder_uses_inband_fec_is_told_apart() -> None:
    chrome = ("v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111 63 0\r\na=rtpmap:111 opus/48000/2\r\n"
              "a=fmtp:111 minptime=10;useinbandfec=1\r\na=rtpmap:63 red/48000/2\r\na=fmtp:63 111/111\r\n")
    assert decodes_inband_fec(chrome)
    assert not decodes_inband_fec(chrome.replace("useinbandfec=1", "useinbandfec=0"))
    assert not decodes_inband_fec("v=0\r\nm=audio 9 RTP/AVP 96\r\na=rtpmap:96 opus/48000/2\r\n")   # aiortc's own
    # the parameter on another codec's format line is not the Opus decoder's
    assert not decodes_inband_fec("v=0\r\nm=audio 9 RTP/AVP 96 97\r\na=rtpmap:96 opus/48000/2\r\n"
                                  "a=rtpmap:97 G722/8000\r\na=fmtp:97 useinbandfec=1\r\n")
    assert decodes_inband_fec(with_inband_fec("v=0\r\nm=audio 9 RTP/AVP 96\r\na=rtpmap:96 opus/48000/2\r\n"))


def test_opus_format_parameters_that_ask_for_inband_fec() -> None:
    assert asks_inband_fec("minptime=10;useinbandfec=1") and asks_inband_fec(" useinbandfec=1 ")
    assert not asks_inband_fec("minptime=10") and not asks_inband_fec("useinbandfec=0") and not asks_inband_fec("")


@pytest.mark.parametrize("fec_loss_pct", [0, DOWNLINK_FEC_LOSS_PCT])
def test_the_sip_senders_opus_carries_inband_fec_when_asked(fec_loss_pct: int) -> None:
    codec, probe = AudioCodec(OPUS, fec_loss_pct=fec_loss_pct), OpusDecoder(48000)
    voice = speech_like(1.0, rate=48000)
    packets = [codec.encode(voice[i:i + 960]) for i in range(0, voice.size - 959, 960)]
    with_fec = sum(probe.has_fec(p) for p in packets)
    assert (with_fec > len(packets) // 2) if fec_loss_pct else with_fec == 0, with_fec


class Timeline:
    """A PtsSink keeping which 24 kHz positions received audio."""

    def __init__(self) -> None:
        self.have: set[int] = set()

    def push(self, pts: int | None, samples: np.ndarray, now: float | None = None) -> None:
        self.have.update(range(int(pts or 0), int(pts or 0) + samples.size))


def test_a_sip_opus_packet_lost_before_one_with_fec_is_rebuilt_in_place() -> None:
    import av

    from media.resample import Resampler
    from media.rtp import OPUS, RtpReceiver, build_rtp

    enc = av.CodecContext.create("libopus", "w")
    enc.sample_rate, enc.layout, enc.format, enc.bit_rate = 48000, "mono", "s16", 32000
    enc.options = {"application": "voip", "fec": "1", "packet_loss": "10"}
    x = np.clip(np.rint(Resampler(24000, 48000).process(speech_like(2.0)) * 32767), -32768, 32767).astype(np.int16)
    payloads: list[bytes] = []
    for i in range(x.size // 960):
        frame = av.AudioFrame.from_ndarray(x[None, i * 960:(i + 1) * 960], format="s16", layout="mono")
        frame.sample_rate, frame.pts = 48000, i * 960
        payloads += [bytes(p) for p in enc.encode(frame)]
    check = OpusDecoder(48000)
    lost = next(i for i in range(30, len(payloads) - 1) if check.has_fec(payloads[i + 1]))
    sink = Timeline()
    rx = RtpReceiver(OPUS, 111, None, sink)
    for i, payload in enumerate(payloads):
        if i != lost:
            rx.receive(build_rtp(111, 1000 + i, 5000 + 960 * i, 42, payload))
    assert (rx.stats.lost, rx.stats.fec) == (1, 1)
    first = min(sink.have)
    end = first + (len(payloads) - 1) * 480                 # the last packet's start, at 24 kHz
    assert all(p in sink.have for p in range(first + 480, end)), "a gap was left where FEC rebuilt the packet"
