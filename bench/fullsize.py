"""A PersonaPlex-7B of the official shape with random weights on the GPU, for speed and memory benchmarks.

Speed does not depend on weight values, so random bf16 weights measure what the real checkpoint would. The tiny
checkpoint on the CPU stands in where a script is only being tried (`--tiny`, and the tests that run the scripts).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch

from model.audio import write_wav
from model.config import SAMPLE_RATE
from model.engine.api import EngineConfig
from model.loading import PersonaPlex, load_model
from model.random_model import random_personaplex
from model.tiny import synthetic_voice, write_tiny_checkpoint


def bench_model(tiny: bool) -> PersonaPlex:
    """The full-size random model on the GPU, or with `tiny` the tiny checkpoint on the CPU."""
    if tiny:
        return load_model(str(write_tiny_checkpoint(Path(tempfile.mkdtemp()), seed=0)))
    return random_personaplex()


# The engine's arithmetic (and launch) choices a bench can turn each way (EngineConfig's fields of these names).
ARITHMETIC_FLAGS = {
    "mimi_encoder_bf16": "Mimi's streaming encoder in bf16 (CUDA)",
    "mimi_decoder_bf16": "Mimi's streaming decoder in bf16 (CUDA)",
    "mimi_fused_encoder": "the encoder's SEANet steps with the largest activations as Triton kernels (CUDA)",
    "mimi_fused_decoder": "the decoder's SEANet steps with the largest activations as Triton kernels (CUDA)",
    "fp8_weights": "the temporal transformer's products with e4m3 weights (LM.with_fp8_weights)",
    "fused_draw": "each audio codebook's draw as one Triton kernel, no sort (CUDA)",
    "fused_depformer": "a lone row's depformer products as Triton GEMVs with norms and gates fused in (CUDA)",
    "pdl_launches": "every Triton kernel launched as a programmatic dependent (CUDA sm_90 on; the same arithmetic)",
}


def add_arithmetic_flags(parser: argparse.ArgumentParser) -> None:
    """A --(no-)FLAG for each arithmetic choice of ARITHMETIC_FLAGS, defaulting to the engine's."""
    for name, help_text in ARITHMETIC_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                            default=getattr(EngineConfig, name), help=help_text)


def arithmetic_config(args: argparse.Namespace) -> dict[str, bool]:
    """The EngineConfig fields of ARITHMETIC_FLAGS as the arguments set them (also what a bench's JSON reports)."""
    return {name: getattr(args, name) for name in ARITHMETIC_FLAGS}


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


def machine() -> dict[str, object]:
    """What a bench ran on: the host's processor and the cores this process may use, the GPU and its CUDA build. The
    machines lent differ by about a millisecond a tick (docs/benchmarks.md), and these say which one a line is
    from."""
    processor = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            processor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                             processor)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"host_cpu": processor, "host_cpus": len(os.sched_getaffinity(0)), "gpu": gpu, "cuda": torch.version.cuda}


def gpu_memory_gb() -> dict[str, float]:
    """The CUDA allocator's figures and the card's free memory; none on a machine without CUDA (`--tiny`)."""
    if not torch.cuda.is_available():
        return {}
    return {"allocated_gb": round(torch.cuda.memory_allocated() / 1e9, 2),
            "reserved_gb": round(torch.cuda.memory_reserved() / 1e9, 2),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "device_free_gb": round(torch.cuda.mem_get_info()[0] / 1e9, 2)}
