"""Greedy tokens of `python -m model.generate` beside NVIDIA's PersonaPlex fork (`moshi.offline.run_inference`).

The fork is not a dependency: point `--fork` at its `moshi/` folder (the one holding the `moshi` package) and
`--fork-deps` at a folder with its pure-Python pins installed there with `--no-deps` (sphn<0.2), e.g.

    python3 -m pip install --no-deps --target DEPS "sphn==0.1.12"
    python3 -m bench.reference_fidelity --fork FORK/moshi --fork-deps DEPS

Both run greedy on the CPU in float32 on one tiny checkpoint in the official layout, from the same wav files.
The fork runs in a subprocess with these patches only: its hard-coded 7B shapes become the tiny ones, its LM
loads in float32 (not bf16), its `hf_hub_download` of `config.json` (a download counter) returns the local file,
and its emitted frames are recorded. Cases it cannot express get one more patch each, said in the case's line:
no voice (it always loads one) and an empty persona (it crashes iterating `None` text tokens).
Prints one JSON line per case: frames compared, frames equal in all 17 columns, and per-column equal counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PERSONA = "hello there friend"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    voice: str  # a file name in the work folder, or "none"
    persona: str


CASES = (
    Case("persona_only", "none", PERSONA),
    Case("wav24k_persona", "voice24k.wav", PERSONA),
    Case("wav24k_empty_persona", "voice24k.wav", ""),
    Case("wav16k_persona", "voice16k.wav", PERSONA),
    Case("wav24k_whitespace_persona", "voice24k.wav", "   "),
    Case("pt_from_wav24k_persona", "voice24k.pt", PERSONA),
    Case("no_voice_empty_persona", "none", ""),
)


def prepare(work: Path, seconds: float, input_rate: int, mimi_context: int) -> None:
    """The tiny checkpoint, the user input (at `input_rate`) and the voices: 2.5 s at 24 kHz, 3 s at 16 kHz, a `.pt`.

    The fork's ring KV sees context - 1 keys once full, ours context (spec/model.md §1 item 10; docs/fidelity.md):
    the real Mimi's window is 250 steps (10 s), the tiny one's 16 (0.64 s), which would end parity after 7 frames.
    So the checkpoint's Mimi window is `mimi_context`, by default the real one's.
    """
    from model.audio import resample, write_wav
    from model.config import SAMPLE_RATE
    from model.loading import load_model
    from model.tiny import MIMI_CONFIG_NAME, synthetic_voice, write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(work / "ckpt", seed=7)
    mimi_config = json.loads((ckpt / MIMI_CONFIG_NAME).read_text())
    mimi_config["transformer"]["context"] = mimi_context
    (ckpt / MIMI_CONFIG_NAME).write_text(json.dumps(mimi_config))
    voice = synthetic_voice(11, 2.5)
    write_wav(work / "voice24k.wav", voice, SAMPLE_RATE)
    write_wav(work / "voice16k.wav", resample(synthetic_voice(12, 3.0), SAMPLE_RATE, 16000), 16000)
    write_wav(work / "user.wav", resample(synthetic_voice(13, seconds) * 0.5, SAMPLE_RATE, input_rate), input_rate)
    load_model(str(ckpt)).save_voice(work / "voice24k.wav", work / "voice24k.pt")


def run_ours(work: Path, case: Case, root: Path) -> np.ndarray:
    out = work / f"ours-{case.name}"
    out.mkdir()
    voice = case.voice if case.voice == "none" else str(work / case.voice)
    done = subprocess.run(
        [sys.executable, "-m", "model.generate", "--model", str(work / "ckpt"), "--input", str(work / "user.wav"),
         "--output", str(out / "out.wav"), "--tokens-out", str(out / "tokens.npy"), "--voice", voice,
         "--persona", case.persona, "--greedy", "--device", "cpu", "--dtype", "float32"],
        cwd=root, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"model.generate failed: {done.stderr[-2000:]}")
    return np.load(out / "tokens.npy")


def run_fork(work: Path, case: Case, fork: Path, deps: Path | None) -> np.ndarray:
    out = work / f"fork-{case.name}"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (deps, fork, ROOT) if p is not None)
    done = subprocess.run(
        [sys.executable, "-m", "bench.reference_fidelity", "--in-fork", json.dumps(dataclasses.asdict(case)),
         "--work", str(work)], cwd=out, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the fork failed: {done.stderr[-3000:]}")
    return np.load(out / "tokens.npy")


def fork_case(work: Path, case: Case) -> None:
    """Inside the subprocess, with the fork's `moshi` first on the path: run_inference with the patches above."""
    import torch
    from moshi import offline
    from moshi.models import loaders
    from moshi.models.lm import LMGen

    from model.config import MIMI_NAME, MOSHI_NAME, TOKENIZER_NAME, lm_config_from_dict, mimi_config_from_dict

    ckpt = work / "ckpt"
    cfg = lm_config_from_dict(json.loads((ckpt / "config.json").read_text()))
    mimi = mimi_config_from_dict(json.loads((ckpt / "mimi_config.json").read_text()))
    loaders._lm_kwargs.update(
        dim=cfg.dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers, hidden_scale=cfg.hidden_scale,
        context=cfg.context, text_card=cfg.text_card, card=cfg.card, depformer_dim=cfg.depformer_dim,
        depformer_num_heads=cfg.depformer_num_heads, depformer_num_layers=cfg.depformer_num_layers,
        depformer_dim_feedforward=cfg.depformer_dim_feedforward)
    loaders._seanet_kwargs.update(dimension=mimi.seanet.dimension, n_filters=mimi.seanet.n_filters)
    q = mimi.quantizer
    loaders._quantizer_kwargs.update(dimension=q.dimension, n_q=q.n_q, bins=q.bins, input_dimension=q.input_dimension,
                                     output_dimension=q.output_dimension)
    t = mimi.transformer
    loaders._transformer_kwargs.update(d_model=t.d_model, num_heads=t.num_heads, num_layers=t.num_layers,
                                       dim_feedforward=t.dim_feedforward, context=t.context,
                                       input_dimension=mimi.seanet.dimension,
                                       output_dimensions=[mimi.seanet.dimension])
    get_lm = loaders.get_moshi_lm
    loaders.get_moshi_lm = lambda *a, **k: get_lm(*a, **{**k, "dtype": torch.float32})
    offline.hf_hub_download = lambda repo, name: str(ckpt / name)
    frames: list[np.ndarray] = []
    decode = offline.decode_tokens_to_pcm

    def record(mimi_, other, gen, tokens):
        frames.append(tokens[0, :, 0].cpu().numpy())
        return decode(mimi_, other, gen, tokens)

    offline.decode_tokens_to_pcm = record
    if case.voice == "none":
        LMGen.load_voice_prompt = lambda self, path: None
    if not case.persona:
        text_core = LMGen._step_text_prompt_core
        LMGen._step_text_prompt_core = lambda self: iter(()) if self.text_prompt_tokens is None else text_core(self)
    with torch.no_grad():
        offline.run_inference(
            input_wav=str(work / "user.wav"), output_wav="out.wav", output_text="out.json", text_prompt=case.persona,
            voice_prompt_path=str(work / case.voice), tokenizer_path=str(ckpt / TOKENIZER_NAME),
            moshi_weight=str(ckpt / MOSHI_NAME), mimi_weight=str(ckpt / MIMI_NAME), hf_repo="local", device="cpu",
            seed=42424242, temp_audio=0.8, temp_text=0.7, topk_audio=250, topk_text=25, greedy=True,
            save_voice_prompt_embeddings=False)
    np.save("tokens.npy", np.stack(frames))


def compare(case: Case, ours: np.ndarray, fork: np.ndarray) -> dict:
    n = min(len(ours), len(fork))
    same = ours[:n] == fork[:n]
    patched = [p for p, on in (("no voice loaded", case.voice == "none"), ("None text tokens iterate as none",
                                                                           not case.persona)) if on]
    return {"bench": "reference_fidelity", "case": case.name, "voice": case.voice, "persona": case.persona,
            "fork_patched": patched, "frames_ours": len(ours), "frames_fork": len(fork), "frames_compared": n,
            "frames_equal": int(same.all(axis=1).sum()), "column_equal": same.sum(axis=0).tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reference_fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fork", type=Path, help="the fork's moshi/ folder (holding the moshi package)")
    p.add_argument("--fork-deps", type=Path, help="folder with the fork's --no-deps pins (sphn<0.2)")
    p.add_argument("--ours", type=Path, default=ROOT, help="checkout whose model.generate runs (default: this one)")
    p.add_argument("--seconds", type=float, default=3.2, help="user input length (40 frames by default)")
    p.add_argument("--input-rate", type=int, default=16000, help="the user input wav's sample rate")
    p.add_argument("--mimi-context", type=int, default=250, help="the tiny Mimi's attention window, in 25 Hz steps")
    p.add_argument("--cases", nargs="*", default=[c.name for c in CASES])
    p.add_argument("--in-fork", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_fork:
        fork_case(args.work, Case(**json.loads(args.in_fork)))
        return 0
    if args.fork is None or not (args.fork / "moshi" / "offline.py").is_file():
        p.error("--fork must name the fork's moshi/ folder (with moshi/offline.py inside)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(work, args.seconds, args.input_rate, args.mimi_context)
        for case in CASES:
            if case.name in args.cases:
                ours = run_ours(work, case, args.ours.resolve())
                fork = run_fork(work, case, args.fork.resolve(), args.fork_deps.resolve() if args.fork_deps else None)
                print(json.dumps(compare(case, ours, fork)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
