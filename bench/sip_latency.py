"""What the SIP door adds to a call's latency on loopback, printed as JSON.

Starts the server in this process (the tiny model by default) with `--sip-port`, places `--calls` calls with the raw
caller of app/doors/sip/client.py, streams speech-like audio as 20 ms RTP packets for `--seconds`, and reads each call's
own measurements (app/doors/sip/call.py):
- inbound: a datagram's parse, decode, resample and push into the conversation's jitter buffer;
- outbound: from an engine frame's arrival on the event loop to the RTP packet that carries its first sample
  (the playout prebuffer and the 20 ms send clock's phase);
- resampler: the swr filters' held-back samples, codec rate <-> 24 kHz, both directions.
The outbound wait includes the audio queued ahead of each frame when it lands (`outbound_queued_ahead_p50_ms`): with
an engine that keeps time that is the packet still playing (<= 20 ms); after late ticks the engine's frames come
bunched and the playout buffer holds them (up to its prebuffer + 160 ms), so on a loaded machine the engine's
lateness shows up here. `engine_late_ticks` and `engine_tick_p99_ms` say how the engine kept time during the run.
`added_p50_ms` is their sum, the figure held against the 40 ms target. The jitter buffer's own wait (every door has
it) and the engine's 80 ms frame are not the SIP path's and are not counted. The caller also reports how evenly
the server's packets arrived (inter-arrival p50/p99) and how many came per second.

    python3 -m bench.sip_latency [--calls 1] [--seconds 6] [--codec PCMU] [--model tiny | --tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
from pathlib import Path

import numpy as np
from aiohttp import web

from app.doors.sip import SIP
from app.doors.sip.client import RtpPeer, SipClient, offer
from app.doors.sip.sdp import parse_offer
from app.shell.server import create_app
from app.shell.settings import TINY_MODEL, Settings
from media.resample import Resampler
from media.rtp import G722, MODEL_RATE, PCMA, PCMU, RtpCodec
from model.loading import load_model
from model.tiny import synthetic_voice, write_tiny_checkpoint

CODECS: dict[str, tuple[RtpCodec, int, str]] = {"PCMU": (PCMU, 0, "PCMU/8000"), "PCMA": (PCMA, 8, "PCMA/8000"),
                                                 "G722": (G722, 9, "G722/8000")}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_call(port: int, codec_name: str, seconds: float, seed: int) -> dict[str, float]:
    codec, pt, rtpmap = CODECS[codec_name]
    client = SipClient(("127.0.0.1", port))
    await client.open()
    rtp = RtpPeer()
    await rtp.open()
    d = client.dialog()
    final = (await client.invite(d, offer("127.0.0.1", rtp.port, [(pt, rtpmap)])))[-1]
    if final.code != 200:
        raise RuntimeError(f"the call was refused: {final.code} {final.phrase}")
    client.ack(d, final)
    media = parse_offer(final.body).media[0]
    audio = Resampler(MODEL_RATE, codec.sample_rate).process(synthetic_voice(seed, seconds))
    await rtp.stream(codec, pt, audio, (media.address or "127.0.0.1", media.port))
    arrivals = np.array([at for at, _ in rtp.received])
    gaps = np.diff(arrivals) * 1000.0 if arrivals.size > 2 else np.zeros(1)
    await client.bye(d)
    rtp.close()
    client.close()
    return {"packets_per_s": round(arrivals.size / seconds, 1), "interarrival_p50_ms": round(float(np.median(gaps)), 2),
            "interarrival_p99_ms": round(float(np.percentile(gaps, 99)), 2)}


async def run(args: argparse.Namespace) -> dict[str, object]:
    model = args.model
    if model == TINY_MODEL:
        model = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny"))
    settings = Settings(model=model, host="127.0.0.1", port=0, max_sessions=args.calls, sip_port=_free_port(),
                        rtp_ports="40000-40999")
    app = create_app(settings, model=load_model(model))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    sip = app[SIP]
    samples: dict[str, list[float]] = {"resampler": []}
    # Each call's recent timings as last seen (the call's own bounded windows, read and never cleared: its send
    # grid re-paces from the same window, so a reader that emptied it would stop the re-pacing it measures).
    recent: dict[str, dict[str, list[float]]] = {}

    async def watch() -> None:
        while True:
            await asyncio.sleep(0.5)
            for call_id, dialog in list(sip.dialogs.items()):
                media = dialog.media
                if media is None or media.receiver is None:
                    continue
                recent[call_id] = {"inbound": [t * 1000 for t in media.in_cost],
                                   "outbound": [t * 1000 for t in media.pacer.waits],
                                   "ahead": [t * 1000 for t in media.out_ahead]}
                held = media.receiver._resampler.held_back / MODEL_RATE + \
                    media.pacer.resampler.held_back / media.choice.codec.sample_rate
                samples["resampler"].append(held * 1000)

    watcher = asyncio.ensure_future(watch())
    try:
        clients = await asyncio.gather(*(one_call(sip.port, args.codec, args.seconds, seed)
                                         for seed in range(args.calls)))
        engine = sip.ctx.engine.stats() if sip.ctx.engine is not None else None
    finally:
        watcher.cancel()
        await runner.cleanup()
    for timings in recent.values():
        for name, values in timings.items():
            samples.setdefault(name, []).extend(values)

    def p50(name: str) -> float:
        return round(float(np.median(samples[name])), 2) if samples.get(name) else 0.0

    added = p50("inbound") + p50("outbound") + p50("resampler")
    outbound = samples.get("outbound") or [0.0]
    return {"bench": "sip_latency", "model": args.model, "codec": args.codec, "calls": args.calls,
            "seconds": args.seconds, "inbound_p50_ms": p50("inbound"), "outbound_p50_ms": p50("outbound"),
            "outbound_p99_ms": round(float(np.percentile(outbound, 99)), 2),
            "outbound_queued_ahead_p50_ms": p50("ahead"),
            "resampler_ms": p50("resampler"), "added_p50_ms": round(added, 2), "target_ms": 40.0,
            "within_target": added <= 40.0, "clients": clients,
            # A late engine tick empties the playout buffer, whose prebuffer then grows (media/playout.py): on a
            # loaded machine the outbound figure is the engine's lateness as much as the SIP path's.
            "engine_ticks": engine.ticks if engine else 0, "engine_late_ticks": engine.late_ticks if engine else 0,
            "engine_tick_p99_ms": round(engine.tick_ms_p99, 1) if engine else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--codec", choices=sorted(CODECS), default="PCMU")
    p.add_argument("--model", default=TINY_MODEL, help="'tiny' (default) or a checkpoint folder")
    p.add_argument("--tiny", action="store_true", help="the tiny model (the default; as the other benches take it)")
    args = p.parse_args()
    if args.tiny:
        args.model = TINY_MODEL
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
