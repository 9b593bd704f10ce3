"""Mimi alone, as the engine runs it: graphed streaming encode and decode times per batch size, and its outputs
over a few frames saved or compared bit for bit with another tree's (a layout or kernel change that claims to
compute the same thing is checked by this, not assumed).

    python3 -m bench.mimi_step --rows 1 64 250 --save base.pt          # on the tree before
    python3 -m bench.mimi_step --rows 1 64 250 --compare base.pt       # on the tree after
    python3 -m bench.mimi_step --rows 1 64 250 --fused residual strided ends seanet --residual-tiles 32x4

Full-size Mimi with seeded random weights (as `random-7b`'s), the engine's precisions (encoder float32 with TF32
products, decoder bf16 on CUDA) on the torch path (the engine runs the decoder's SEANet steps as kernels: the
`--fused` lines), cuDNN's algorithms chosen by its heuristics as in the engine. One JSON line per
batch size: encode/decode p50 ms of `--steps` graph replays, kernels per step, and with `--compare` whether every
code and audio sample of `--frames` frames equals the saved ones. Row r hears the same noise at every batch size,
and a "mimi_across_batches" line compares each smaller batch's rows with the same rows of the largest batch, for
the torch path and each `--fused` kind: whether a session's codes depend on how many calls share its step (cuBLAS
and cuDNN choose their kernels, and so their sums' order, by shape; the SEANet kernels run one program per row).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from bench.roofline import kernel_profile, time_mimi
from model import fused, seanet_kernels
from model.config import FRAME_SAMPLES, TINY_MIMI, MimiConfig
from model.engine.api import EngineConfig
from model.engine.runner import streaming_mimi
from model.mimi import Mimi
from model.random_model import random_mimi


def build_mimi(tiny: bool) -> Mimi:
    """The codec in the engine's precisions on the torch path (no SEANet kernel, which the `--fused` lines add):
    full size on CUDA (random weights), the tiny one on the CPU."""
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    config = EngineConfig(mimi_fused_encoder=False, mimi_fused_decoder=False)
    return streaming_mimi(random_mimi(TINY_MIMI if tiny else MimiConfig(), device), config, torch.device(device))


def row_noise(rows: int, frames: int) -> torch.Tensor:
    """[frames, rows, FRAME_SAMPLES] of noise, row r's seeded by r: a row hears the same at every batch size."""
    return torch.stack([0.1 * torch.randn(frames, FRAME_SAMPLES, generator=torch.Generator().manual_seed(row))
                        for row in range(rows)], dim=1)


def outputs(mimi: Mimi, rows: int, frames: int, decoded: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Codes and audio of `frames` streaming steps over `row_noise` at `rows` rows, on the host: the audio of its
    own codes, or of `decoded` (another codec's [frames, rows, codebooks]), so that the audio's difference is the
    decoder's own and not the codes'."""
    device = next(mimi.parameters()).device
    noise = row_noise(rows, frames).to(device)
    state = mimi.init_state(rows, device)
    codes, audio = [], []
    with torch.no_grad():
        for frame in range(frames):
            step_codes = mimi.encode_frame(noise[frame], state)
            codes.append(step_codes.cpu())
            audio.append(mimi.decode_frame(step_codes if decoded is None else decoded[frame].to(device), state).cpu())
    return {"codes": torch.stack(codes), "audio": torch.stack(audio)}


def compare(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict:
    codes_equal = float((mine["codes"] == theirs["codes"]).float().mean())
    error = mine["audio"].float() - theirs["audio"].float()
    noise = float(error.square().sum())
    snr = 10 * math.log10(float(theirs["audio"].float().square().sum()) / noise) if noise else None
    return {"bit_equal": bool(torch.equal(mine["codes"], theirs["codes"]) and torch.equal(mine["audio"],
                                                                                          theirs["audio"])),
            "codes_equal": round(codes_equal, 6), "audio_max_abs_diff": float(error.abs().max()),
            "audio_snr_db": None if snr is None else round(snr, 2)}


def across_batches(codec: str, by_rows: dict[int, dict[str, torch.Tensor]]) -> list[dict]:
    """A codec's rows at each smaller batch size against the same rows (the same audio) at the largest: whether its
    codes and audio depend on how many rows share the step, as a session's would on how many calls are live."""
    largest = max(by_rows)
    return [{"bench": "mimi_across_batches", "codec": codec, "rows": rows, "against_rows": largest,
             **compare(out, {name: value[:, :rows] for name, value in by_rows[largest].items()})}
            for rows, out in sorted(by_rows.items()) if rows < largest]


def kernels(mimi: Mimi, rows: int) -> dict:
    """Kernels a step launches, and the six that take most device time, per direction (one eager step each)."""
    state = mimi.init_state(rows, "cuda")
    pcm = 0.1 * torch.randn(rows, FRAME_SAMPLES, device="cuda")
    codes = mimi.encode_frame(pcm, state)
    profiled = kernel_profile({"encode": lambda: mimi.encode_frame(pcm, state),
                               "decode": lambda: mimi.decode_frame(codes, state)}, 1)
    out = {}
    for part, part_kernels in profiled.items():
        out[f"{part}_kernels"] = sum(calls for _, calls in part_kernels.values())
        top = sorted(part_kernels.items(), key=lambda kv: -kv[1][0])[:6]
        out[f"{part}_top"] = [[name[:60], round(ms, 3), calls] for name, (ms, calls) in top]
    return out


def tiles(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tile is sizes joined by x, e.g. 64x4: got {text!r}") from None


def fused_variants(args: argparse.Namespace) -> list[tuple[dict, dict[str, bool]]]:
    """(what the line says, which of Mimi.with_fused_seanet's parts are fused), each with the tiles it sets."""
    parts = ("residual", "strided", "ends")
    variants = [({"fused": name}, {part: name in (part, "seanet") for part in parts}) for name in args.fused]
    for part, key, given in (("residual", "residual_tile", args.residual_tiles),
                             ("strided", "strided_tile", args.strided_tiles),
                             ("strided", "transposed_tile", args.transposed_tiles),
                             ("ends", "thin_tile", args.thin_tiles)):
        variants += [({"fused": part, key: tile}, {p: p == part for p in parts}) for tile in given]
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 250])
    parser.add_argument("--frames", type=int, default=8, help="streaming steps whose outputs are saved/compared")
    parser.add_argument("--steps", type=int, default=30, help="graph replays timed per direction")
    parser.add_argument("--save", help="write the outputs here (torch.save)")
    parser.add_argument("--compare", help="compare the outputs with those saved here")
    parser.add_argument("--tiny", action="store_true", help="the tiny codec on the CPU (no timing)")
    parser.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=False,
                        help="cuDNN times its algorithms per shape (a choice that differs between processes); off, as "
                             "the engine's warm-up runs, its heuristics choose, the same in every process")
    parser.add_argument("--fused", nargs="*", choices=["residual", "strided", "ends", "seanet"], default=[],
                        help="also the codec with SEANet steps as Triton kernels (Mimi.with_fused_seanet, CUDA): its "
                             "residual units, its strided convolutions (down and up), its convolutions from and to "
                             "audio, or all; a line each, outputs compared with the codec's own (its codes with "
                             "the codec's, its audio of the codec's codes with the codec's)")
    parser.add_argument("--residual-tiles", type=tiles, nargs="*", default=[],
                        help="the residual units fused with each tile SAMPLESxWARPS (warps per 64 channels; "
                             "ResidualTile)")
    parser.add_argument("--strided-tiles", type=tiles, nargs="*", default=[],
                        help="the strided convolutions fused with each downsampling tile FRAMESxCHANNELSxWARPS "
                             "(StridedTile)")
    parser.add_argument("--transposed-tiles", type=tiles, nargs="*", default=[],
                        help="the strided convolutions fused with each upsampling tile FRAMESxROWSxWARPS "
                             "(TransposedTile)")
    parser.add_argument("--thin-tiles", type=tiles, nargs="*", default=[],
                        help="the convolutions from and to audio fused with each tile SAMPLESxWARPS (ThinTile)")
    args = parser.parse_args()
    mimi = build_mimi(args.tiny)
    cuda = next(mimi.parameters()).device.type == "cuda"
    if cuda:  # as the engine's runner sets them before its capture
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
        fused.enable()
    saved = torch.load(args.compare) if args.compare else {}
    mine: dict[int, dict[str, torch.Tensor]] = {}
    fused_by_rows: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for rows in args.rows:
        line: dict = {"bench": "mimi_step", "rows": rows, "device": str(next(mimi.parameters()).device),
                      "cudnn_benchmark": args.cudnn_benchmark}
        mine[rows] = outputs(mimi, rows, args.frames)
        if rows in saved:
            line.update(compare(mine[rows], saved[rows]))
        if cuda:
            line.update(time_mimi(mimi, rows, torch.device("cuda"), args.steps))
            line.update(kernels(mimi, rows))
        print(json.dumps(line), flush=True)
        for said, parts in fused_variants(args) if cuda else []:
            seanet_kernels.RESIDUAL_TILE = seanet_kernels.ResidualTile(*said.get("residual_tile", []))
            seanet_kernels.STRIDED_TILE = seanet_kernels.StridedTile(*said.get("strided_tile", []))
            seanet_kernels.TRANSPOSED_TILE = seanet_kernels.TransposedTile(*said.get("transposed_tile", []))
            seanet_kernels.THIN_TILE = seanet_kernels.ThinTile(*said.get("thin_tile", []))
            fused_mimi = mimi.with_fused_seanet(**parts)
            fused_outputs = outputs(fused_mimi, rows, args.frames, decoded=mine[rows]["codes"])
            if len(said) == 1:  # a kind of kernel with its default tiles
                fused_by_rows.setdefault(said["fused"], {})[rows] = outputs(fused_mimi, rows, args.frames)
            fused_line = {**line, **said, **compare(fused_outputs, mine[rows]),
                          **time_mimi(fused_mimi, rows, torch.device("cuda"), args.steps), **kernels(fused_mimi, rows)}
            print(json.dumps(fused_line), flush=True)
    for codec, by_rows in (("torch", mine), *fused_by_rows.items()):
        for line in across_batches(codec, by_rows):
            print(json.dumps(line), flush=True)
    if args.save:
        torch.save(mine, args.save)


if __name__ == "__main__":
    main()
