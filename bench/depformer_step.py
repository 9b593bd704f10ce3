"""A frame's depformer chain alone, graphed, by path: torch's products (the default) and the fused products
(`EngineConfig.fused_depformer`, model/depformer_kernels.py), each with its Triton kernels launched plainly and as
programmatic dependents (`EngineConfig.pdl_launches`, model/launch.py; sm_90 on). One process, the paths' replays
interleaved: an A/B on one machine.

    python3 -m bench.depformer_step [--rows 1] [--rounds 20] [--replays 10] [--frames 50] [--tiny]

The chain is the eight depformer steps of a frame, each token the argmax of its logits and the next step's input
its embedding (the engine's draw is left out: it is the same on every path). One JSON line per rows and path: ms per
frame (p50 over every replay), and `tokens_equal_to_torch`, the share of `--frames` frames' tokens (each from its
own random temporal hidden state) equal to the torch path's; a PDL path's logits must equal its plain launches'
bit for bit (`logits_equal_to_plain`). Without CUDA only the torch path runs, eagerly, to try the script.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from bench.fullsize import bench_model, machine
from bench.roofline import captured, event_ms, p50
from model import fused, launch
from model.lm import LM

# (fused products, PDL launches); a PDL path's plain twin is its name without "_pdl"
PATHS = {"torch": (False, False), "torch_pdl": (False, True), "fused": (True, False), "fused_pdl": (True, True)}


def frame_chain(lm: LM, rows: int, path: str) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chain as a function of static buffers: (run, hidden to write, tokens [rows, 8] out, last logits out)."""
    fused_products, pdl = PATHS[path]
    weight = lm.text_linear.weight
    hidden = torch.zeros(rows, lm.cfg.dim, device=weight.device, dtype=weight.dtype)
    text = torch.zeros(rows, dtype=torch.long, device=weight.device)
    steps = lm.cfg.num_audio_codebooks
    tokens = torch.zeros(rows, steps, dtype=torch.long, device=weight.device)
    logits_out = torch.zeros(rows, lm.cfg.card, device=weight.device)
    cache = lm.depformer_cache(rows)

    def run() -> None:
        launch.enable(pdl)  # read at each launch: a graph keeps the launches it captured
        previous = lm.depformer_text_emb(text)
        for k in range(steps):
            if fused_products:
                logits = lm.depformer_step_fused(k, hidden, previous, cache)
            else:
                logits = lm.depformer_step(k, lm.depformer_in[k](hidden) + previous, cache)
            token = logits.argmax(-1)
            tokens[:, k] = token
            if k + 1 < steps:
                previous = lm.depformer_emb[k](token)
        logits_out.copy_(logits)

    return run, hidden, tokens, logits_out


def timed_ms(fn: Callable[[], None], cuda: bool) -> float:
    if cuda:
        return event_ms(fn)
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000.0


def measure(lm: LM, rows: int, args: argparse.Namespace) -> list[dict]:
    cuda = lm.text_linear.weight.is_cuda
    paths = list(PATHS) if cuda else ["torch"]
    chains = {path: frame_chain(lm, rows, path) for path in paths}
    with torch.no_grad():
        runs = {path: captured(chain[0]).replay if cuda else chain[0] for path, chain in chains.items()}
        times: dict[str, list[float]] = {path: [] for path in paths}
        for _ in range(args.rounds):  # interleaved: a drift of the machine's clocks falls on every path alike
            for path in paths:
                times[path] += [timed_ms(runs[path], cuda) for _ in range(args.replays)]
        gen = torch.Generator().manual_seed(rows)
        equal = {path: 0 for path in paths}
        plain_equal = {path: True for path in paths if path.endswith("_pdl")}
        for _ in range(args.frames):
            hidden = torch.randn(rows, lm.cfg.dim, generator=gen)
            for path in paths:
                chains[path][1].copy_(hidden)
                runs[path]()
            for path in paths:
                equal[path] += int((chains[path][2] == chains["torch"][2]).sum())
            for path in plain_equal:
                plain_equal[path] &= torch.equal(chains[path][3], chains[path.removesuffix("_pdl")][3])
    total = args.frames * rows * lm.cfg.num_audio_codebooks
    lines = []
    for path in paths:
        line = {"bench": "depformer_step", "rows": rows, "path": path, "ms_p50": round(p50(times[path]), 4),
                "tokens_equal_to_torch": round(equal[path] / total, 4)}
        if path in plain_equal:
            line["logits_equal_to_plain"] = plain_equal[path]
        lines.append(line)
    launch.enable(False)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--frames", type=int, default=50, help="frames whose tokens are compared between paths")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    lm = bench_model(args.tiny).lm
    device = lm.text_linear.weight.device
    if device.type == "cuda":
        fused.enable()  # the engine's norms and gates compiled, as it runs them on CUDA
    pdl = launch.supported(device)
    print(json.dumps({"bench": "depformer_step", "pdl_supported": pdl, **machine()}), flush=True)
    for rows in args.rows:
        for line in measure(lm, rows, args):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
