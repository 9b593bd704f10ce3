"""A PersonaPlex-7B of the official shape with random weights on the GPU, for speed and memory benchmarks.

Speed does not depend on weight values, so random bf16 weights measure what the real checkpoint would. The tiny
checkpoint on the CPU stands in where a script is only being tried (`--tiny`, and the tests that run the scripts).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from safetensors.torch import save_file

from model.audio import write_wav
from model.config import SAMPLE_RATE, LMConfig, MimiConfig
from model.lm import LM
from model.loading import DTYPES, PersonaPlex, load_model
from model.mimi import load_mimi, random_mimi_state_dict
from model.tiny import synthetic_voice, train_tokenizer, write_tiny_checkpoint


def random_personaplex(device: str = "cuda", dtype: str = "bfloat16", context: int = 3000) -> PersonaPlex:
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
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mimi.safetensors"
        save_file(random_mimi_state_dict(mimi_cfg, 1), str(path))
        mimi = load_mimi(path, mimi_cfg, device=device)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=train_tokenizer())
    return PersonaPlex(lm=lm, mimi=mimi, tokenizer=tokenizer, config=cfg, mimi_config=mimi_cfg, voices_dir=None,
                       source="random full-size weights", device=torch.device(device), dtype=torch_dtype)


def bench_model(tiny: bool) -> PersonaPlex:
    """The full-size random model on the GPU, or with `tiny` the tiny checkpoint on the CPU."""
    if tiny:
        return load_model(str(write_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)))
    return random_personaplex()


def voice_wav(seconds: float = 4.0) -> str:
    """A synthetic voice recording (a .wav path) for cold session opens."""
    path = Path(tempfile.mkdtemp()) / "voice.wav"
    write_wav(path, synthetic_voice(0, seconds), SAMPLE_RATE)
    return str(path)


def persona(words: int, salt: int = 0) -> str:
    rng = np.random.default_rng(salt)
    vocab = ["you", "are", "a", "helpful", "friendly", "agent", "who", "answers", "questions", "about",
             "travel", "music", "and", "science"]
    return " ".join(rng.choice(vocab, words))


def gpu_memory_gb() -> dict[str, float]:
    return {"allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 2),
            "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
