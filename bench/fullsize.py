"""A PersonaPlex-7B of the official shape with random weights on the GPU, for speed and memory benchmarks.

Speed does not depend on weight values, so random bf16 weights measure what the real checkpoint would. The tiny
checkpoint on the CPU stands in where a script is only being tried (`--tiny`, and the tests that run the scripts).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from model.audio import write_wav
from model.config import SAMPLE_RATE
from model.loading import PersonaPlex, load_model
from model.random_model import random_personaplex
from model.tiny import synthetic_voice, write_tiny_checkpoint


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
    """The CUDA allocator's figures and the card's free memory; none on a machine without CUDA (`--tiny`)."""
    if not torch.cuda.is_available():
        return {}
    return {"allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 2),
            "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "device_free_gb": round(torch.cuda.mem_get_info()[0] / 1e9, 2)}
