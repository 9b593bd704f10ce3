"""Offline generation: stream a wav through Mimi and the LM frame by frame, write the agent's audio and text.

    python -m model.generate --model DIR_OR_REPO --input in.wav --output out.wav [--voice NAME|PATH|none]
        [--persona TEXT] [--greedy | --temp-text T --topk-text K --temp-audio T --topk-audio K] [--seed N]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--tokens-out tokens.npy] [--text-out out.txt]

`tokens.npy` holds the emitted token frames [frames, 17] (text, 8 agent codes, 8 user codes) in emission order.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.audio import read_wav, resample, write_wav
from model.config import FRAME_SAMPLES, SAMPLE_RATE
from model.loading import CheckpointError, PersonaPlex, load_model
from model.prompts import apply_prompt, persona_tokens, plan_prompt
from model.sampling import SamplingParams, row_sampling
from model.sampling_params import MAX_TOP_K_AUDIO, MAX_TOP_K_TEXT
from model.step import StepConstants, frame_step

DEFAULT_SEED = 42424242


@dataclass
class Generation:
    audio: np.ndarray  # float32 at 24 kHz
    text: str
    tokens: np.ndarray  # [frames, 17] int64


@torch.no_grad()
def generate(model: PersonaPlex, samples: np.ndarray, voice: str | None, persona: str,
             sampling: SamplingParams, seed: int) -> Generation:
    """Run one conversation over `samples` (24 kHz mono float32) and collect what the agent emits."""
    lm, mimi, device = model.lm, model.mimi, model.device
    voice_prompt = model.load_voice(voice) if voice else None
    state = lm.init_state(1)
    apply_prompt(lm, state, 0, plan_prompt(lm, voice_prompt, persona_tokens(model.tokenizer, persona)))
    const = StepConstants.make(lm, device)
    text_s, audio_s = row_sampling([sampling], [seed], device)
    dep_cache = lm.depformer_cache(1)
    enc, dec = mimi.init_state(1, device), mimi.init_state(1, device)
    frames = -(-samples.size // FRAME_SAMPLES)
    pcm = torch.from_numpy(np.pad(samples, (0, frames * FRAME_SAMPLES - samples.size))).to(device)
    audio, text, tokens = [], [], []
    for i in range(frames):
        codes = mimi.encode_frame(pcm[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].view(1, -1), enc)
        frame, emitted = frame_step(lm, state, codes, text_s, audio_s, dep_cache, const)
        if not bool(emitted[0]):
            continue
        tokens.append(frame[0].cpu())
        audio.append(mimi.decode_frame(frame[:, 1:9], dec)[0].float().cpu())
        text.append(model.text_piece(int(frame[0, 0])))
    return Generation(
        audio=torch.cat(audio).numpy() if audio else np.zeros(0, np.float32),
        text="".join(text),
        tokens=torch.stack(tokens).numpy() if tokens else np.zeros((0, 17), np.int64),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--input", required=True, type=Path, help="input wav (any rate; resampled to 24 kHz)")
    p.add_argument("--output", required=True, type=Path, help="agent audio wav (24 kHz)")
    p.add_argument("--voice", default=None, help="bundled voice name, .pt/.wav path, or 'none' (default: NATF2)")
    p.add_argument("--persona", default="", help="role text; empty means no text prompt")
    p.add_argument("--greedy", action="store_true")
    d = SamplingParams()
    p.add_argument("--temp-text", type=float, default=d.temp_text)
    p.add_argument("--topk-text", type=int, default=d.topk_text)
    p.add_argument("--temp-audio", type=float, default=d.temp_audio)
    p.add_argument("--topk-audio", type=int, default=d.topk_audio)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tokens-out", type=Path)
    p.add_argument("--text-out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    sampling = SamplingParams(greedy=args.greedy, temp_text=args.temp_text, topk_text=args.topk_text,
                              temp_audio=args.temp_audio, topk_audio=args.topk_audio, seed=args.seed)
    try:
        sampling.validate(MAX_TOP_K_TEXT, MAX_TOP_K_AUDIO)
        model = load_model(args.model, device=args.device, dtype=dtype)
        samples, rate = read_wav(args.input)
        voice = args.voice if args.voice is not None else model.default_voice
        if voice is not None and voice.lower() == "none":
            voice = None
        result = generate(model, resample(samples, rate, SAMPLE_RATE), voice, args.persona, sampling, args.seed)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_wav(args.output, result.audio, SAMPLE_RATE)
    if args.tokens_out:
        np.save(args.tokens_out, result.tokens)
    if args.text_out:
        args.text_out.write_text(result.text)
    print(f"{result.tokens.shape[0]} frames, {result.audio.size / SAMPLE_RATE:.2f} s of audio; text: {result.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
