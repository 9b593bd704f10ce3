"""Greedy tokens of an engine on a faster numeric path against today's path, frame by frame, on the same input.

    python -m bench.token_agreement --fp8-kv [--rows 64] [--frames 2000] [--mimi-encoder-bf16] [--mimi-decoder-bf16]
                                    [--tiny]

Two engines over one model (full 7B shape, random bf16 weights): the reference (Mimi in float32, as the reference
computes it) and the candidate (the flags given). Both step `--rows` fresh greedy rows through `--frames` frames of
the same speech-like input (a voiced, pitch-gliding signal with pauses and noise, different for every row), and
every emitted frame's 17 tokens (text, 8 agent codes, 8 user codes: the Mimi encoder's) are compared. One JSON line,
"token_agreement": frames compared and equal (all 17 tokens), per stream (text, agent, user codes), rows that ever
diverged and their first divergent frame, and the audio: the candidate's decoded audio against the reference's, as
an SNR in dB per row over the frames before that row's first divergence (where both decoded the same codes).
`--tiny` runs the tiny checkpoint on the CPU, to try the script.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from bench.fullsize import bench_model
from model.config import FRAME_SAMPLES, SAMPLE_RATE
from model.engine import Engine, EngineConfig


class SpeechLike:
    """Per row: harmonics of a gliding pitch under syllable-rate bursts with pauses, plus a little noise; loops
    over `seconds` of precomputed signal from a different offset in every row."""

    def __init__(self, rows: int, seconds: float, seed: int):
        rng = np.random.default_rng(seed)
        t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
        self.signals = []
        for _ in range(rows):
            f0 = rng.uniform(90, 240) * (1 + 0.15 * np.sin(2 * np.pi * rng.uniform(0.2, 0.8) * t))
            phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
            voice = sum(np.sin(k * phase + rng.uniform(0, 2 * np.pi)) / k for k in range(1, 5))
            syllables = np.clip(np.sin(2 * np.pi * rng.uniform(2.5, 5.0) * t), 0, None)
            pauses = np.sin(2 * np.pi * rng.uniform(0.1, 0.3) * t + rng.uniform(0, 2 * np.pi)) > -0.3
            noise = rng.uniform(0.003, 0.02) * rng.standard_normal(t.size)
            self.signals.append((rng.uniform(0.1, 0.3) * voice * syllables * pauses + noise).astype(np.float32))
        self.offsets = rng.integers(0, t.size // FRAME_SAMPLES, rows) * FRAME_SAMPLES
        self.length = (t.size // FRAME_SAMPLES) * FRAME_SAMPLES

    def frame(self, index: int) -> np.ndarray:
        starts = (self.offsets + index * FRAME_SAMPLES) % self.length
        return np.stack([s[a : a + FRAME_SAMPLES] for s, a in zip(self.signals, starts)])


def snr_db(signal: float, error: float) -> float | None:
    if signal <= 0:
        return None
    return math.inf if error == 0 else 10 * math.log10(signal / error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--fp8-kv", action="store_true")
    parser.add_argument("--mimi-encoder-bf16", action="store_true")
    parser.add_argument("--mimi-decoder-bf16", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    started = time.perf_counter()
    model = bench_model(args.tiny)
    rows, frames = args.rows, args.frames
    context, page = model.config.context, EngineConfig.kv_page_frames
    # Every row's frames (a ring at most), in pages of at most kv_page_frames (a divisor of the context).
    pages = rows * math.ceil(min(frames + 8, context) / min(page, context)) + rows
    engines = [Engine(model, EngineConfig(max_sessions=rows, fp8_kv=args.fp8_kv, kv_pages=pages, **flags))
               for flags in ({}, {"mimi_encoder_bf16": args.mimi_encoder_bf16,
                                  "mimi_decoder_bf16": args.mimi_decoder_bf16})]
    source = SpeechLike(rows, 30.0, seed=1)
    streams = {"text": slice(0, 1), "agent": slice(1, 9), "user_codes": slice(9, 17)}
    compared = equal = 0
    stream_equal = dict.fromkeys(streams, 0)
    first_divergence = np.full(rows, -1)
    signal, error = np.zeros(rows), np.zeros(rows)
    for index in range(frames):
        pcm = source.frame(index)
        (ref_tokens, ref_emitted, ref_audio), (tokens, emitted, audio) = (
            tuple(a.copy() for a in engine.step_rows(rows, pcm)) for engine in engines)
        if not np.array_equal(ref_emitted, emitted):
            raise SystemExit(f"frame {index}: the engines emitted different rows")
        rows_emitted = np.flatnonzero(ref_emitted)
        if rows_emitted.size == 0:
            continue
        same = ref_tokens[rows_emitted] == tokens[rows_emitted]
        compared += rows_emitted.size
        equal += int(same.all(axis=1).sum())
        for name, cols in streams.items():
            stream_equal[name] += int(same[:, cols].all(axis=1).sum())
        diverged = rows_emitted[~same.all(axis=1)]
        first_divergence[diverged[first_divergence[diverged] < 0]] = index
        agreeing = rows_emitted[first_divergence[rows_emitted] < 0]
        signal[agreeing] += np.square(ref_audio[agreeing].astype(np.float64)).sum(axis=1)
        error[agreeing] += np.square(ref_audio[agreeing].astype(np.float64) - audio[agreeing]).sum(axis=1)
    snrs = [snr_db(s, e) for s, e in zip(signal, error) if s > 0]
    finite = [v for v in snrs if v is not None and math.isfinite(v)]
    diverged = first_divergence[first_divergence >= 0]
    print(json.dumps({
        "bench": "token_agreement", "rows": rows, "frames": frames, "fp8_kv": args.fp8_kv,
        "mimi_encoder_bf16": args.mimi_encoder_bf16, "mimi_decoder_bf16": args.mimi_decoder_bf16,
        "frames_compared": compared, "frames_equal": equal, "agreement": round(equal / max(compared, 1), 6),
        "stream_agreement": {name: round(n / max(compared, 1), 6) for name, n in stream_equal.items()},
        "rows_diverged": int(diverged.size),
        "first_divergence_min": int(diverged.min()) if diverged.size else None,
        "first_divergence_p50": float(np.median(diverged)) if diverged.size else None,
        "audio_snr_db_min": round(min(finite), 2) if finite else None,
        "audio_snr_db_p50": round(float(np.median(finite)), 2) if finite else None,
        "audio_rows_bit_equal": sum(1 for v in snrs if v == math.inf),
        "seconds": round(time.perf_counter() - started, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
