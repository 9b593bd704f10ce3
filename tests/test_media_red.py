"""media/red.py: the RFC 2198 payload both ways, a sender's memory, and RED in the SDPs a browser and we write."""

from __future__ import annotations

import pytest

from media.red import Block, RedDepth, RedFormat, Redundancy, pack, red_format, unpack, with_red_offer

# The audio section of Chromium 150's offer (its own createOffer, headless), as the server receives it.
CHROMIUM_AUDIO = "\r\n".join([
    "v=0", "o=- 1 2 IN IP4 127.0.0.1", "s=-", "t=0 0",
    "m=audio 9 UDP/TLS/RTP/SAVPF 111 63 9 0 8 13 110 126",
    "a=rtpmap:111 opus/48000/2", "a=fmtp:111 minptime=10;useinbandfec=1",
    "a=rtpmap:63 red/48000/2", "a=fmtp:63 111/111",
    "a=rtpmap:9 G722/8000", "a=rtpmap:0 PCMU/8000", "a=rtpmap:8 PCMA/8000", "a=rtpmap:13 CN/8000",
    "a=rtpmap:110 telephone-event/48000", "a=rtpmap:126 telephone-event/8000",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", ""])


def test_a_payload_is_the_rfc_2198_layout_and_reads_back():
    payload = pack(111, b"primary", [(1920, b"older"), (960, b"newer")])
    # F=1, PT 111, offset 1920, length 5: 1 1101111 00000111100000 0000000101
    assert payload[:4] == ((1 << 31) | (111 << 24) | (1920 << 10) | 5).to_bytes(4, "big")
    assert payload[8] == 111 and payload[9:] == b"oldernewerprimary"
    assert unpack(payload) == [Block(111, 1920, b"older"), Block(111, 960, b"newer"), Block(111, 0, b"primary")]
    assert unpack(pack(111, b"alone", [])) == [Block(111, 0, b"alone")]


def test_blocks_a_payload_cannot_carry_are_left_out():
    too_far, too_long = (1 << 14, b"x"), (960, b"y" * 1024)
    assert unpack(pack(111, b"p", [too_far, too_long, (960, b""), (960, b"ok")])) == [
        Block(111, 960, b"ok"), Block(111, 0, b"p")]


@pytest.mark.parametrize("payload", [b"", b"\x80\x00", bytes([0xEF, 0, 0x3C, 0x05]),
                                     pack(111, b"p", [(960, b"abc")])[:6]])
def test_a_payload_that_is_cut_short_is_refused(payload):
    with pytest.raises(ValueError):
        unpack(payload)


def test_the_sender_carries_its_last_packet_with_its_offset_across_the_wrap():
    red = Redundancy(RedFormat(63, 111, 1))
    first = red.wrap(b"one", (1 << 32) - 480)
    second = red.wrap(b"two", 480)                       # the 32-bit RTP clock wrapped: 960 ticks on
    third = red.wrap(b"three", 480 + 20000)              # a jump past 14 bits of offset: nothing to carry
    assert unpack(first) == [Block(111, 0, b"one")]
    assert unpack(second) == [Block(111, 960, b"one"), Block(111, 0, b"two")]
    assert unpack(third) == [Block(111, 0, b"three")]


def test_the_format_a_browser_offers_and_what_it_names():
    assert red_format(CHROMIUM_AUDIO, 111) == RedFormat(63, 111, 1)
    assert red_format(CHROMIUM_AUDIO, 96) is None                     # RED over another Opus type: not ours
    twice = CHROMIUM_AUDIO.replace("a=fmtp:63 111/111", "a=fmtp:63 111/111/111")
    assert red_format(twice, 111) == RedFormat(63, 111, 2)
    many = CHROMIUM_AUDIO.replace("a=fmtp:63 111/111", "a=fmtp:63 " + "/".join(["111"] * 6))
    assert red_format(many, 111).redundant == 2                       # carried at the most
    mixed = CHROMIUM_AUDIO.replace("a=fmtp:63 111/111", "a=fmtp:63 111/0")
    assert red_format(mixed, 111) is None
    assert red_format(CHROMIUM_AUDIO.replace("a=fmtp:63 111/111\r\n", ""), 111) is None


def test_our_offer_proposes_red_once_over_its_opus_as_chromium_does():
    aiortc_like = CHROMIUM_AUDIO.replace(" 111 63 9", " 111 9").replace(
        "a=rtpmap:63 red/48000/2\r\na=fmtp:63 111/111\r\n", "")
    assert red_format(aiortc_like, 111) is None
    offered = with_red_offer(aiortc_like)
    assert red_format(offered, 111) == RedFormat(63, 111, 1)
    assert "m=audio 9 UDP/TLS/RTP/SAVPF 111 9 0 8 13 110 126 63" in offered
    assert with_red_offer(offered) == offered and with_red_offer(CHROMIUM_AUDIO) == CHROMIUM_AUDIO
    no_opus = "\r\n".join(["m=audio 9 RTP/AVP 0", "a=rtpmap:0 PCMU/8000", ""])
    assert with_red_offer(no_opus) == no_opus


def test_a_deepened_sender_carries_its_last_two_packets_and_one_again_once_shallow():
    sender = Redundancy(RedFormat(63, 111, 1))
    sender.wrap(b"a", 0)
    sender.depth = 2
    assert unpack(sender.wrap(b"b", 960)) == [Block(111, 960, b"a"), Block(111, 0, b"b")]  # only one to carry yet
    assert unpack(sender.wrap(b"c", 1920)) == [Block(111, 1920, b"a"), Block(111, 960, b"b"), Block(111, 0, b"c")]
    sender.depth = 1
    assert unpack(sender.wrap(b"d", 2880)) == [Block(111, 960, b"c"), Block(111, 0, b"d")]


def test_red_deepens_on_an_interval_that_loses_much_and_comes_back_after_calm_ones():
    depth, lost, received = RedDepth(base=1), 0, 0

    def interval(new_lost: int, new_received: int) -> int:
        nonlocal lost, received
        lost, received = lost + new_lost, received + new_received
        return depth.report(lost, received)

    assert interval(2, 248) == 1                     # 0.8 %: a far link's isolated losses, once is enough
    assert interval(8, 60) == 1                      # too few packets to say: counted with the next
    assert interval(0, 190) == 2                     # 8 of 258 since the last interval counted: 3.1 %
    assert depth.report(lost, received) == 2         # the same report read again changes nothing
    assert [interval(0, 250), interval(0, 250)] == [2, 2]
    assert interval(5, 245) == 2                     # 2 %: not calm, the calm count starts again
    assert [interval(0, 250), interval(0, 250), interval(0, 250)] == [2, 2, 1]
    assert interval(25, 225) == 2 and depth.deepened == 2
    assert interval(-5, 250) == 2                    # a report whose lost count went down (duplicates): none lost
