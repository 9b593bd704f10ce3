"""The impairment link model's statistics on seeded runs, and the UDP and TCP relays over real loopback sockets."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from bench.impair import FAR, PRESETS, Link, LinkModel, TcpRelay, UdpRelay

PERIOD = 0.02
N = 20000


def run(link: Link, n: int = N, seed: int = 1, reliable: bool = False) -> tuple[LinkModel, list[list[float]]]:
    model = LinkModel(link, seed, reliable=reliable)
    return model, [model.schedule(i * PERIOD) for i in range(n)]


def within(observed: float, p: float, n: int, sigmas: float = 4.0) -> bool:
    """A binomial count's rate within `sigmas` standard deviations of `p`."""
    return abs(observed - p) <= sigmas * math.sqrt(p * (1 - p) / n)


def test_the_same_seed_gives_the_same_link_and_another_seed_another() -> None:
    _, a = run(FAR, 2000, seed=5)
    _, b = run(FAR, 2000, seed=5)
    _, c = run(FAR, 2000, seed=6)
    assert a == b and a != c


def test_delay_and_jitter_keep_order_and_stay_in_bounds() -> None:
    model, out = run(Link(delay_ms=75, jitter_ms=30))
    times = [d[0] for d in out]
    transit = np.array([t - i * PERIOD for i, t in enumerate(times)]) * 1000
    assert all(b >= a for a, b in zip(times, times[1:]))          # a queue keeps order
    assert transit.min() >= 45 - 1e-9 and 70 <= np.median(transit) <= 82
    # +-30 ms around 75 ms, clipped, and pushed later only where an earlier packet was still ahead
    assert transit.max() <= 105 + 1e-9
    assert 35 <= model.stats.jitter_ms() <= 60
    assert model.stats.lost == 0 and model.stats.delivered == N


def test_random_loss_rate() -> None:
    model, out = run(Link(loss=0.01))
    lost = sum(not d for d in out)
    assert lost == model.stats.lost and within(lost / N, 0.01, N)


def test_gilbert_elliott_loss_rate_and_burst_length() -> None:
    model, out = run(Link(burst_loss=0.05, burst_len=3), n=60000)
    lost = np.array([not d for d in out])
    bursts = np.diff(np.flatnonzero(np.diff(np.concatenate([[0], lost.astype(int), [0]]))))[::2]
    assert 0.04 <= lost.mean() <= 0.06
    assert 2.6 <= bursts.mean() <= 3.4 and bursts.max() >= 8      # geometric lengths, mean 3
    assert model.stats.lost == lost.sum()


def test_reordering_rate_and_that_reordered_packets_come_after_their_successor() -> None:
    model, out = run(Link(delay_ms=75, reorder=0.005, reorder_ms=30))
    times = [d[0] for d in out]
    late = [i for i in range(N - 1) if times[i] > times[i + 1]]
    # (one held back right after another, or the last packet, has no successor passing it)
    assert model.stats.reordered - 2 <= len(late) <= model.stats.reordered and within(len(late) / N, 0.005, N)


def test_duplicates_follow_their_original() -> None:
    model, out = run(Link(delay_ms=10, duplicate=0.02))
    dups = [d for d in out if len(d) == 2]
    assert within(len(dups) / N, 0.02, N) and model.stats.duplicated == len(dups)
    assert all(0 <= b - a <= 0.010 for a, b in dups)


def test_stalls_hold_everything_then_deliver_it_in_order() -> None:
    link = Link(delay_ms=50, stall_ms=400, stall_every_s=20)
    model, out = run(link, n=2990)                                  # ~60 s: stalls at 20 and 40 s
    times = np.array([d[0] for d in out])
    assert model.stall_starts(60.0) == [20.0, 40.0]
    for start in (20.0, 40.0):
        end = start + 0.4
        held = [i for i in range(2990) if start <= i * PERIOD + 0.05 < end]
        assert len(held) == 20 and np.all(times[held] == pytest.approx(end))
        after = [i for i in range(2990) if end <= i * PERIOD + 0.05 < end + 1]
        assert np.allclose(times[after] - np.array(after) * PERIOD, 0.05)   # nothing lingers after the stall
    assert model.stats.stalled == 40 and np.all(np.diff(times) >= 0)


def test_a_heavy_tail_delays_a_few_packets_by_much_more() -> None:
    model, out = run(Link(delay_ms=20, tail=0.01, tail_ms=100))
    transit = np.array([d[0] - i * PERIOD for i, d in enumerate(out)]) * 1000
    extra = transit - 20
    # a tail packet's delay jumps by >= 100 ms (its followers, held behind it, come 20 ms less late each); one that
    # falls while an earlier one still holds the queue can hide, so the onsets count up to the 1 % drawn
    onsets = int(np.sum((extra[1:] >= 100 - 1e-9) & (extra[1:] > extra[:-1] + 20)))
    assert 0.006 <= onsets / N <= 0.01 + 4 * math.sqrt(0.01 * 0.99 / N)
    assert extra.max() > 300                                          # Pareto: a few far out


def test_a_reliable_link_retransmits_lost_segments_and_holds_what_follows() -> None:
    model, out = run(Link(delay_ms=75, loss=0.01), reliable=True)
    times = [d[0] for d in out]
    assert all(len(d) == 1 for d in out) and all(b >= a for a, b in zip(times, times[1:]))
    transit = np.array([t - i * PERIOD for i, t in enumerate(times)])
    assert transit.max() >= 0.075 + model.retransmit_s - 1e-9          # a lost segment came an RTO later
    blocked = int(np.sum(transit > 0.075 + 1e-9))
    assert blocked > model.stats.lost                                  # ... and held the ones behind it


def test_a_reliable_write_of_several_segments_meets_each_segments_loss() -> None:
    """A write of four segments (an 80 ms PCM append) waits for a retransmission at four times a one-segment
    write's rate, 1 - 0.99^4 at 1 % loss; each write still arrives whole, in order, once. A lost segment with
    three behind it in its write is resent a round trip later (fast retransmit); otherwise the next write's
    segments bring the duplicate ACKs, where a one-segment stream waits for three writes."""
    for segments, p, resend_s in ((1, 0.01, 3 * PERIOD), (4, 1 - 0.99 ** 4, PERIOD)):
        model = LinkModel(Link(delay_ms=75, loss=0.01), seed=3, reliable=True)
        out = [model.schedule(i * PERIOD, segments) for i in range(N)]
        assert all(len(d) == 1 for d in out)
        assert within(model.stats.lost / N, p, N), (segments, model.stats.lost)
        lost = [round(t / PERIOD) for t in model.stats.lost_at]
        transit = np.array([out[i][0] - i * PERIOD for i in lost])
        assert np.median(transit) == pytest.approx(0.075 + model.retransmit_s + resend_s), segments
        if segments == 4:
            assert np.mean(np.isclose(transit, 0.075 + model.retransmit_s)) > 0.15   # the first of four lost


def test_parse_presets_and_fields() -> None:
    assert Link.parse("far") == FAR == PRESETS["far"]
    assert Link.parse("far,stall_ms=400,stall_every_s=20") == Link(
        delay_ms=75, jitter_ms=30, loss=0.01, reorder=0.005, stall_ms=400, stall_every_s=20)
    assert Link.parse("") == Link() and not Link().impaired
    for bad in ("warp", "delay=5", "loss=1.5", "stall_ms=500,stall_every_s=0.2"):
        with pytest.raises(ValueError):
            Link.parse(bad)


class _Sink(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.got: list[tuple[bytes, float]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.got.append((data, asyncio.get_running_loop().time()))


async def test_udp_relay_carries_both_ways_through_its_links() -> None:
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(_Sink, local_addr=("127.0.0.1", 0))
    _, client = await loop.create_datagram_endpoint(_Sink, local_addr=("127.0.0.1", 0))
    relay = await UdpRelay(Link(delay_ms=30, loss=0.2), Link(delay_ms=10), seed=3,
                           server=server.transport.get_extra_info("sockname")[:2]).start()
    try:
        sent = {}
        for i in range(100):
            sent[i] = loop.time()
            client.transport.sendto(i.to_bytes(2, "big"), relay.near)
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)
        got = {int.from_bytes(d, "big"): t for d, t in server.got}
        assert len(got) == relay.up_model.stats.delivered == 100 - relay.up_model.stats.lost
        assert 5 <= relay.up_model.stats.lost <= 35
        assert all(got[i] - sent[i] >= 0.029 for i in got)
        server.transport.sendto(b"back", relay.far)                    # the server answers the relay's far side
        await asyncio.sleep(0.05)
        assert [d for d, _ in client.got] == [b"back"]
    finally:
        relay.close()
        server.transport.close()
        client.transport.close()


async def test_tcp_relay_delays_a_stream_and_keeps_it_whole() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    relay = await TcpRelay(target.sockets[0].getsockname()[:2], Link(delay_ms=40, loss=0.05),
                           Link(delay_ms=40), seed=2).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        loop = asyncio.get_running_loop()
        payload = bytes(range(256)) * 8
        t0 = loop.time()
        for k in range(40):
            writer.write(payload[k * 50:(k + 1) * 50])
            await writer.drain()
            await asyncio.sleep(0.01)
        echoed = await asyncio.wait_for(reader.readexactly(2000), 10)
        assert echoed == payload[:2000] and loop.time() - t0 >= 0.08
        writer.close()
        up, _ = relay.models[0]
        assert up.stats.sent >= 1 and up.stats.delivered == up.stats.sent
    finally:
        await relay.close()
        target.close()


async def test_packets_released_together_keep_their_order() -> None:
    """A stall releases what it held at one instant: the relay hands those packets on in the order they were sent
    (asyncio's timers alone do not keep the order of equal times)."""
    loop = asyncio.get_running_loop()
    _, server = await loop.create_datagram_endpoint(_Sink, local_addr=("127.0.0.1", 0))
    _, client = await loop.create_datagram_endpoint(_Sink, local_addr=("127.0.0.1", 0))
    link = Link(delay_ms=5, stall_ms=150, stall_every_s=1.0, stall_first_s=0.02)
    relay = await UdpRelay(link, Link(), seed=1, server=server.transport.get_extra_info("sockname")[:2]).start()
    try:
        for i in range(40):
            client.transport.sendto(i.to_bytes(2, "big"), relay.near)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.3)
        got = [int.from_bytes(d, "big") for d, _ in server.got]
        assert relay.up_model.stats.stalled >= 10 and got == list(range(40)), got
    finally:
        relay.close()
        server.transport.close()
        client.transport.close()
