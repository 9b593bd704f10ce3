"""The audio draws alone: torch's path (topk, argmax and the compiled `_choose`) against the one-kernel draw
(`EngineConfig.fused_draw`, `model.sampling.draw_triton`), graphed, per batch size, and whether both draw the same.

    python3 -m bench.draw_step --rows 1 64 250 [--calls 8] [--steps 50]

Logits of the codebooks' 2048 entries rounded to bf16, as the 7B's products leave them (values tie); every fourth
row greedy, the others sampling with the server's defaults (temperature 0.8, top-k 250), row r seeded r. One JSON
line per batch size and path: microseconds per draw (p50 of `--steps` replays of a graph of `--calls` draws, a tick's
eight by default, each on its own logits) and, for the fused path, the share of its tokens equal to torch's path's
(they may differ only where equal logits straddle a row's top-k boundary). Without CUDA only torch's path runs,
eagerly, to try the script.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.fullsize import machine
from bench.roofline import p50, replay_ms
from model import fused
from model.sampling import row_sampling, sample
from model.sampling_params import MAX_TOP_K_AUDIO, SamplingParams

CODEBOOK = 2048


def measure(rows: int, calls: int, steps: int, device: torch.device) -> list[dict]:
    """The lines of one batch size: each path's time per draw, and the fused path's tokens against torch's."""
    gen = torch.Generator().manual_seed(rows)
    logits = (2.0 * torch.randn(calls, rows, CODEBOOK, generator=gen)).bfloat16().float().to(device)
    _, params = row_sampling([SamplingParams(greedy=row % 4 == 0) for row in range(rows)], list(range(rows)), device)
    counter = torch.arange(rows, device=device)
    paths = {"torch": False, "fused": True} if device.type == "cuda" else {"torch": False}
    tokens = {name: torch.zeros(calls, rows, dtype=torch.long, device=device) for name in paths}

    def draws(name: str) -> None:
        for call in range(calls):
            tokens[name][call] = sample(logits[call], params, counter, 1 + call % 8, MAX_TOP_K_AUDIO, paths[name])

    if device.type == "cuda":
        times = replay_ms({name: lambda name=name: draws(name) for name in paths}, steps)
    else:
        times = {}
        for name in paths:
            runs = []
            for _ in range(steps):
                started = time.perf_counter()
                draws(name)
                runs.append((time.perf_counter() - started) * 1000.0)
            times[name] = p50(runs)
    lines = []
    for name in paths:
        line = {"bench": "draw_step", "rows": rows, "path": name, "us_per_draw": round(times[name] * 1000.0 / calls, 2)}
        if name != "torch":
            line["tokens_equal"] = round(float((tokens[name] == tokens["torch"]).float().mean()), 6)
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 250])
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        fused.enable()  # the engine compiles `_choose` on CUDA
    print(json.dumps({"bench": "draw_step", "calls": args.calls, **machine()}), flush=True)
    for rows in args.rows:
        for line in measure(rows, args.calls, args.steps, device):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
