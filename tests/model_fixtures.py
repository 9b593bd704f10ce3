"""Shared helpers for the model-level tests: a tiny checkpoint folder, depformer-set slicing, a speech wav, and the
fusable helpers compiled for a block.

Imported by test modules as `from model_fixtures import ...` (pytest puts `tests/` on the path); each module
builds its own tiny checkpoint once (module scope) so the files stay independent.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from model import fused
from model.audio import read_wav, resample, write_wav
from model.config import LMConfig
from model.tiny import synthetic_voice, write_tiny_checkpoint


def make_tiny(tmp_path_factory, name: str = "tiny", seed: int = 0, context: int = 250) -> Path:
    """A tiny random checkpoint folder in the official layout (16 depformer sets)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=seed, context=context)


def keep_depformer_sets(state: dict[str, torch.Tensor], cfg: LMConfig, sets: int) -> dict[str, torch.Tensor]:
    """The same weights as a checkpoint holding only the first `sets` depformer weight sets.

    Per-step attention projections are stacked along dim 0, so the first sets are the leading rows; the
    per-step modules (`depformer_in`, `linears`, `gating`) keep indices < sets and `depformer_emb` < sets - 1.
    """
    dd = cfg.depformer_dim
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] in ("depformer_in", "linears") and int(parts[1]) >= sets:
            continue
        if parts[0] == "depformer_emb" and int(parts[1]) >= sets - 1:
            continue
        if parts[0] == "depformer" and parts[3] == "gating" and int(parts[4]) >= sets:
            continue
        if parts[0] == "depformer" and key.endswith("self_attn.in_proj_weight"):
            value = value[: sets * 3 * dd]
        elif parts[0] == "depformer" and key.endswith("self_attn.out_proj.weight"):
            value = value[: sets * dd]
        out[key] = value.contiguous()
    return out


def speech_wav(path: Path, rate: int, text: str = "Hello there, how are you doing today?") -> np.ndarray:
    """Write `text` spoken by espeak-ng (or, without it, a synthetic voiced signal) as a mono wav at `rate`."""
    samples: np.ndarray | None = None
    if shutil.which("espeak-ng"):
        raw = path.with_suffix(".espeak.wav")
        done = subprocess.run(["espeak-ng", "-w", str(raw), text], capture_output=True, timeout=60)
        if done.returncode == 0 and raw.is_file():
            speech, speech_rate = read_wav(raw)
            samples = resample(speech, speech_rate, rate)
    if samples is None:
        samples = resample(synthetic_voice(seed=3, seconds=2.0), 24000, rate)
    write_wav(path, samples, rate)
    return samples


@contextlib.contextmanager
def compiled_helpers() -> Iterator[None]:
    """The fusable helpers compiled as the engine compiles them (Dynamo's caches fresh) inside the block, eager
    again after it; the block fails where a helper fell back to eager."""
    torch._dynamo.reset()
    fused.enable()
    try:
        yield
        assert not fused.fallen_back(), fused.fallen_back()
    finally:
        fused.disable()
