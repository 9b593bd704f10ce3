"""A tiny random PersonaPlex checkpoint in the official file layout, for tests and the no-GPU demo.

`python -m model.tiny DIR` writes `model.safetensors` (16 depformer sets), the Mimi file, `mimi_config.json`,
`config.json`, a small SentencePiece tokenizer and `voices.tgz` with two voices made from synthetic recordings.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from safetensors.torch import save_file

from model.config import (
    MIMI_NAME,
    MOSHI_NAME,
    SAMPLE_RATE,
    TINY_LM,
    TINY_MIMI,
    TOKENIZER_NAME,
    VOICES_NAME,
    LMConfig,
    mimi_config_to_dict,
)
from model.lm import LM
from model.mimi import random_mimi_state_dict

MIMI_CONFIG_NAME = "mimi_config.json"
TOKENIZER_VOCAB = 200
TINY_VOICES = ("NATF2", "NATM1")

_CORPUS = """\
<system> You are a wise and friendly teacher. Answer questions or provide advice in a clear and engaging way. <system>
Hello there, how are you doing today? I am doing well, thank you for asking.
What would you like to talk about? We could talk about the weather, music, science or travel.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Please tell me more about your plans for the weekend. I would love to hear about them.
That sounds wonderful. Let me think about that for a moment before I answer your question.
You are a helpful customer service agent for a bank. Greet the caller and ask how you can help.
Yes, of course. No, I do not think so. Maybe later. Thank you very much. Goodbye and have a nice day.
"""


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB) -> bytes:
    """A SentencePiece model with the reference's special ids (0 unk/EPAD, 1 BOS, 2 EOS, 3 PAD)."""
    model = io.BytesIO()
    lines = [line for line in _CORPUS.splitlines() if line.strip()] * 4
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, character_coverage=1.0, hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def random_lm_state_dict(cfg: LMConfig, seed: int, text_vocab: int) -> dict[str, torch.Tensor]:
    """Random LM weights; text logits favour ids the tiny tokenizer knows so transcripts are readable."""
    torch.manual_seed(seed)
    lm = LM(cfg)
    with torch.no_grad():
        lm.text_linear.weight[:text_vocab] *= 4.0
        lm.text_linear.weight[text_vocab:] *= 0.1
    return {k: v.contiguous() for k, v in lm.state_dict().items()}


def synthetic_voice(seed: int, seconds: float = 1.6) -> np.ndarray:
    """A voiced, pitch-gliding harmonic signal with a little noise: something for Mimi to encode."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = (120 + 90 * (seed % 2)) * (1 + 0.1 * np.sin(2 * np.pi * 1.5 * t))
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2)
    return (0.2 * voice + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def write_tiny_checkpoint(folder: Path, seed: int = 0, context: int = 250) -> Path:
    """Write the tiny checkpoint into `folder` (created) and return it."""
    from model.audio import write_wav
    from model.loading import load_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(TINY_LM, context=context)
    (folder / TOKENIZER_NAME).write_bytes(train_tokenizer())
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(folder / TOKENIZER_NAME)).get_piece_size()
    save_file(random_lm_state_dict(cfg, seed, vocab), str(folder / MOSHI_NAME))
    save_file(random_mimi_state_dict(TINY_MIMI, seed + 1), str(folder / MIMI_NAME))
    (folder / MIMI_CONFIG_NAME).write_text(json.dumps(mimi_config_to_dict(TINY_MIMI), indent=1))
    lm_keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    lm_keys["delays"] = list(cfg.delays)
    config = {**lm_keys, "moshi_name": MOSHI_NAME, "mimi_name": MIMI_NAME, "tokenizer_name": TOKENIZER_NAME,
              "mimi_config_name": MIMI_CONFIG_NAME, "tiny": True}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    model = load_model(str(folder))
    with tempfile.TemporaryDirectory() as tmp:
        voices = Path(tmp) / "voices"
        voices.mkdir()
        for i, name in enumerate(TINY_VOICES):
            wav = Path(tmp) / f"{name}.wav"
            write_wav(wav, synthetic_voice(seed + i), SAMPLE_RATE)
            model.save_voice(wav, voices / f"{name}.pt")
        with tarfile.open(folder / VOICES_NAME, "w:gz") as tar:
            tar.add(voices, arcname="voices")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=250, help="temporal context in frames")
    args = parser.parse_args()
    print(write_tiny_checkpoint(args.folder, args.seed, args.context))


if __name__ == "__main__":
    main()
