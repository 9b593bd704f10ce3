"""PersonaPlex-7B of the official shape with random weights: for sizing hardware without the gated checkpoint.

Speed and memory do not depend on weight values, so a server on these weights (`--model random-7b`) holds as many
sessions, at the same tick times, as one on the real checkpoint; what it says is noise. Everything that reports the
model says "random weights"; the server never loads it unless asked by name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import sentencepiece
import torch
from safetensors.torch import save_file

from model.config import LMConfig, MimiConfig
from model.lm import LM
from model.loading import DTYPES, PersonaPlex
from model.mimi import Mimi, load_mimi, random_mimi_state_dict
from model.tiny import train_tokenizer

RANDOM_7B = "random-7b"


def random_mimi(cfg: MimiConfig, device: str, seed: int = 1) -> Mimi:
    """A Mimi of `cfg` with seeded random weights, loaded through the checkpoint path as a real one is."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mimi.safetensors"
        save_file(random_mimi_state_dict(cfg, seed), str(path))
        return load_mimi(path, cfg, device=device)


def random_personaplex(device: str = "cuda", dtype: str = "bfloat16", context: int = 3000) -> PersonaPlex:
    """The full 7B shape (LM, depformer, Mimi) with seeded random weights, built on `device`."""
    cfg = LMConfig(context=context)
    torch_dtype = DTYPES[dtype]
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            lm = LM(cfg, depformer_steps=cfg.num_audio_codebooks).eval()
    finally:
        torch.set_default_dtype(previous)
    mimi_cfg = MimiConfig()
    mimi = random_mimi(mimi_cfg, device)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tokenizer())
    return PersonaPlex(lm=lm, mimi=mimi, tokenizer=tokenizer, config=cfg, mimi_config=mimi_cfg, voices_dir=None,
                       source=f"{RANDOM_7B} (random full-size weights)", device=torch.device(device),
                       dtype=torch_dtype, random_weights=True)
