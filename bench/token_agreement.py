"""Tokens of engines on faster numeric paths against today's path, frame by frame, on the same input.

    python -m bench.token_agreement --fp8-kv [--rows 64] [--frames 2000] [--candidates decoder_bf16 bf16]
                                    [--wider 186] [--sampled] [--forced] [--tiny]

Engines over one model (full 7B shape, random bf16 weights): the reference (Mimi in float32 on the torch path, as
the reference computes it: every choice of bench/fullsize.py's ARITHMETIC_FLAGS off) and one per candidate, the
reference with its own choices on: `decoder_bf16` (Mimi's streaming decoder in bf16), `encoder_bf16`, `bf16`
(both), `fused_encoder` / `fused_seanet` (Mimi's SEANet kernels), `fp8_weights` (the temporal products with e4m3
weights, `LM.with_fp8_weights`), and the other CANDIDATES. With `--wider N` one more: the reference's own arithmetic
stepping N more rows (other input) beside the compared ones, in a larger batch, where cuBLAS and cuDNN may choose
other kernels: how much a row's tokens move with the number of calls beside it, today's path against itself. All
step `--rows` fresh greedy rows (with `--sampled`, rows drawing as the reference server does by default, row r seeded
r in every engine: for candidates that change the draw itself, such as `fused_draw`) through `--frames` frames of the
same speech-like input (a voiced, pitch-gliding signal with pauses and noise, different for every row), and every
emitted frame's 17 tokens (text, 8 agent codes, 8 user codes: the Mimi encoder's) are compared. One JSON line per
candidate, "token_agreement": frames compared and equal (all 17 tokens), per stream (text, agent, user codes), rows
that ever diverged and their first divergent frame, and the audio: the candidate's decoded audio against the
reference's, as an SNR in dB per row over the frames before that row's first divergence (where both decoded the same
codes).
With `--forced` (teacher forcing) each candidate's token ring takes the reference's after every step, so every frame
is stepped from the reference's history and compared: a flip counts in its own frame only, where greedy decoding
from a flip on diverges (over random weights' flat logits, within a few frames whatever moved the flip), and the
first divergence is then a row's first flip.
`--tiny` runs the tiny checkpoint on the CPU (where every engine runs float32), to try the script.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from bench.fullsize import ARITHMETIC_FLAGS, bench_model
from model.config import FRAME_SAMPLES, SAMPLE_RATE
from model.engine import Engine, EngineConfig
from model.sampling_params import SamplingParams


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


CANDIDATES = {"decoder_bf16": {"mimi_decoder_bf16": True}, "encoder_bf16": {"mimi_encoder_bf16": True},
              "bf16": {"mimi_encoder_bf16": True, "mimi_decoder_bf16": True},
              "fused_seanet": {"mimi_fused_encoder": True, "mimi_fused_decoder": True},
              "fused_encoder": {"mimi_fused_encoder": True},
              "decoder_bf16_fused_decoder": {"mimi_decoder_bf16": True, "mimi_fused_decoder": True},
              "decoder_bf16_fused_seanet": {"mimi_decoder_bf16": True, "mimi_fused_encoder": True,
                                            "mimi_fused_decoder": True},
              "fp8_weights": {"fp8_weights": True}, "decoder_bf16_fp8_weights": {"mimi_decoder_bf16": True,
                                                                                 "fp8_weights": True},
              "fused_draw": {"fused_draw": True}, "fused_depformer": {"fused_depformer": True},
              "pdl_launches": {"pdl_launches": True}}
# Every arithmetic choice off: the reference's float32 Mimi on the torch path; a candidate turns on its own.
REFERENCE = dict.fromkeys(ARITHMETIC_FLAGS, False)
STREAMS = {"text": slice(0, 1), "agent": slice(1, 9), "user_codes": slice(9, 17)}


class Agreement:
    """One candidate's counts against the reference."""

    def __init__(self, rows: int):
        self.compared = self.equal = 0
        self.stream_equal = dict.fromkeys(STREAMS, 0)
        self.first_divergence = np.full(rows, -1)
        self.signal, self.error = np.zeros(rows), np.zeros(rows)

    def add(self, index: int, reference: tuple[np.ndarray, ...], candidate: tuple[np.ndarray, ...],
            same: np.ndarray | None = None) -> None:
        """One step's frames; `same` [rows, 17]: which tokens agree, where not the emitted frames' (forced steps)."""
        (ref_tokens, ref_emitted, ref_audio), (tokens, emitted, audio) = reference, candidate
        if not np.array_equal(ref_emitted, emitted):
            raise SystemExit(f"frame {index}: the engines emitted different rows")
        rows = np.flatnonzero(ref_emitted)
        if rows.size == 0:
            return
        same = ref_tokens[rows] == tokens[rows] if same is None else same[rows]
        self.compared += rows.size
        self.equal += int(same.all(axis=1).sum())
        for name, cols in STREAMS.items():
            self.stream_equal[name] += int(same[:, cols].all(axis=1).sum())
        diverged = rows[~same.all(axis=1)]
        self.first_divergence[diverged[self.first_divergence[diverged] < 0]] = index
        agreeing = rows[self.first_divergence[rows] < 0]
        ref = ref_audio[agreeing].astype(np.float64)
        self.signal[agreeing] += np.square(ref).sum(axis=1)
        self.error[agreeing] += np.square(ref - audio[agreeing]).sum(axis=1)

    def summary(self) -> dict:
        snrs = [snr_db(s, e) for s, e in zip(self.signal, self.error) if s > 0]
        finite = [v for v in snrs if math.isfinite(v)]
        diverged = self.first_divergence[self.first_divergence >= 0]
        compared = max(self.compared, 1)
        return {
            "frames_compared": self.compared, "frames_equal": self.equal, "agreement": round(self.equal / compared, 6),
            "stream_agreement": {name: round(n / compared, 6) for name, n in self.stream_equal.items()},
            "rows_diverged": int(diverged.size),
            "first_divergence_min": int(diverged.min()) if diverged.size else None,
            "first_divergence_p50": float(np.median(diverged)) if diverged.size else None,
            "audio_snr_db_min": round(min(finite), 2) if finite else None,
            "audio_snr_db_p50": round(float(np.median(finite)), 2) if finite else None,
            "audio_rows_bit_equal": sum(1 for v in snrs if v == math.inf),
        }


def force_history(reference: Engine, candidate: Engine, rows: int) -> np.ndarray:
    """After both engines stepped rows [0, rows) from the same token history: which of the step's tokens the
    candidate wrote as the reference did, [rows, 17] (the step changed only its own cells of each row's token ring);
    then the candidate's ring takes the reference's, so that its next step reads the same history (teacher forcing:
    its KV is computed from the reference's tokens, by its own arithmetic)."""
    ring, expected = candidate.lm_state.ring[:rows], reference.lm_state.ring[:rows]
    same = (ring == expected).all(dim=-1).cpu().numpy()
    ring.copy_(expected)
    return same


def snr_db(signal: float, error: float) -> float:
    return math.inf if error == 0 else 10 * math.log10(signal / error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--frames", type=int, default=2000)
    parser.add_argument("--candidates", nargs="+", choices=sorted(CANDIDATES), default=["decoder_bf16", "bf16"])
    parser.add_argument("--wider", type=int, default=0,
                        help="also the reference's own arithmetic stepping this many more rows (other input) beside "
                             "the compared ones: whether a row's tokens depend on how many rows share its step")
    parser.add_argument("--fp8-kv", action="store_true")
    parser.add_argument("--sampled", action="store_true",
                        help="rows draw with the reference server's default sampling, row r seeded r, not greedily")
    parser.add_argument("--forced", action="store_true",
                        help="teacher forcing: after each step every candidate's token history becomes the "
                             "reference's, so each frame is compared from the same history (a flip counts once, "
                             "not every frame after it as greedy decoding's divergence does)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    started = time.perf_counter()
    model = bench_model(args.tiny)
    rows, frames = args.rows, args.frames
    context, page = model.config.context, EngineConfig.kv_page_frames
    # (name, arithmetic, rows stepped) of each candidate; the first `rows` rows are compared.
    candidates = [(name, {**REFERENCE, **CANDIDATES[name]}, rows) for name in args.candidates]
    if args.wider:
        candidates.append((f"batch_of_{rows + args.wider}", REFERENCE, rows + args.wider))

    def engine(flags: dict[str, bool], stepped: int) -> Engine:
        # Every row's frames (a ring at most), in pages of at most kv_page_frames (a divisor of the context).
        pages = stepped * math.ceil(min(frames + 8, context) / min(page, context)) + stepped
        made = Engine(model, EngineConfig(max_sessions=stepped, fp8_kv=args.fp8_kv, kv_pages=pages, **flags))
        if args.sampled:
            made.sample_rows(stepped, SamplingParams())
        return made

    reference = engine(REFERENCE, rows)
    engines = [(engine(flags, stepped), stepped) for _, flags, stepped in candidates]
    agreements = [Agreement(rows) for _ in candidates]
    source = SpeechLike(rows, 30.0, seed=1)
    beside = SpeechLike(args.wider, 30.0, seed=2) if args.wider else None
    for index in range(frames):
        pcm = source.frame(index)
        wide_pcm = np.concatenate([pcm, beside.frame(index)]) if beside else pcm
        expected = tuple(a.copy() for a in reference.step_rows(rows, pcm))
        for (candidate, stepped), agreement in zip(engines, agreements):
            outputs = candidate.step_rows(stepped, wide_pcm[:stepped])
            same = force_history(reference, candidate, rows) if args.forced else None
            agreement.add(index, expected, tuple(a[:rows] for a in outputs), same)
    for (name, flags, stepped), agreement in zip(candidates, agreements):
        print(json.dumps({"bench": "token_agreement", "candidate": name, **flags, "rows": rows,
                          "rows_stepped": stepped, "frames": frames, "fp8_kv": args.fp8_kv, "sampled": args.sampled,
                          "forced": args.forced,
                          **agreement.summary(),
                          "seconds": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
