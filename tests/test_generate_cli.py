"""`python -m model.generate` end to end on the tiny checkpoint: files written, frame counts, prompts, determinism."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import make_tiny, speech_wav

from model.audio import read_wav, resample
from model.config import FRAME_SAMPLES, SAMPLE_RATE, SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD
from model.generate import generate
from model.loading import PersonaPlex, load_model
from model.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
INPUT_RATE = 16000
PERSONA = "You are a helpful customer service agent for a bank."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, voice_cache) -> Path:
    return make_tiny(tmp_path_factory, "cli", seed=2)


@pytest.fixture(scope="module")
def model(tiny) -> PersonaPlex:
    return load_model(str(tiny))


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "in.wav"
    speech_wav(path, INPUT_RATE)
    return path


@pytest.fixture(scope="module")
def input_frames(speech) -> int:
    samples, rate = read_wav(speech)
    assert rate == INPUT_RATE
    return -(-resample(samples, rate, SAMPLE_RATE).size // FRAME_SAMPLES)


class Run:
    """One CLI run's outputs."""

    def __init__(self, folder: Path):
        self.tokens = np.load(folder / "tokens.npy")
        self.audio, self.rate = read_wav(folder / "out.wav")
        self.wav_bytes = (folder / "out.wav").read_bytes()
        self.text = (folder / "out.txt").read_text()


def run_cli(tiny: Path, speech: Path, out: Path, *args: str) -> Run:
    out.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "model.generate", "--model", str(tiny), "--input", str(speech),
         "--output", str(out / "out.wav"), "--tokens-out", str(out / "tokens.npy"), "--text-out", str(out / "out.txt"),
         "--device", "cpu", *args],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return Run(out)


def test_greedy_end_to_end(tiny, speech, input_frames, model, tmp_path):
    run = run_cli(tiny, speech, tmp_path / "a", "--greedy", "--persona", PERSONA)
    tokens = run.tokens
    # With a prompt (the default voice NATF2 and a persona) every input frame emits one token frame.
    assert tokens.dtype.kind == "i" and tokens.shape == (input_frames, 17)
    assert tokens[0].tolist() == [TEXT_PAD, *SILENCE_TOKENS, *SINE_TOKENS]  # the last prompt spacer frame
    assert run.rate == SAMPLE_RATE and run.audio.size == input_frames * FRAME_SAMPLES
    assert np.abs(run.audio).max() > 0
    assert run.text == "".join(model.text_piece(int(t)) for t in tokens[:, 0])
    assert ((tokens[:, 1:] >= 0) & (tokens[:, 1:] < 2048)).all() and len(np.unique(tokens[:, 0])) > 2

    # The user rows carry the input: frame j holds the Mimi codes of input frame j - 1.
    samples, rate = read_wav(speech)
    pcm = resample(samples, rate, SAMPLE_RATE)
    pcm = torch.from_numpy(np.pad(pcm, (0, input_frames * FRAME_SAMPLES - pcm.size)))
    state = model.mimi.init_state(1, model.device)
    with torch.no_grad():
        codes = torch.cat([model.mimi.encode_frame(pcm[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].view(1, -1), state)
                           for i in range(input_frames)]).numpy()
    np.testing.assert_array_equal(tokens[1:, 9:], codes[:-1])
    assert len({tuple(c) for c in codes}) > input_frames // 2  # speech, not one repeated code

    again = run_cli(tiny, speech, tmp_path / "b", "--greedy", "--persona", PERSONA)
    np.testing.assert_array_equal(again.tokens, tokens)
    assert again.wav_bytes == run.wav_bytes and again.text == run.text


def test_seeded_sampling_is_reproducible(tiny, speech, input_frames, tmp_path):
    a = run_cli(tiny, speech, tmp_path / "a", "--seed", "7")
    b = run_cli(tiny, speech, tmp_path / "b", "--seed", "7")
    c = run_cli(tiny, speech, tmp_path / "c", "--seed", "8", "--temp-audio", "0.8", "--topk-audio", "250")
    assert a.tokens.shape == (input_frames, 17)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.wav_bytes == b.wav_bytes
    assert not np.array_equal(a.tokens[:, :9], c.tokens[:, :9])


def test_prompt_phases(tiny, speech, input_frames, model, tmp_path):
    # No voice and no persona: the two spacers still play, as in the reference.
    bare = run_cli(tiny, speech, tmp_path / "bare", "--greedy", "--voice", "none")
    assert bare.audio.size == input_frames * FRAME_SAMPLES

    both = run_cli(tiny, speech, tmp_path / "both", "--greedy", "--voice", "NATM1", "--persona", PERSONA)
    # The other prompt shapes in-process, through the function the CLI runs.
    samples, rate = read_wav(speech)
    samples = resample(samples, rate, SAMPLE_RATE)
    greedy = SamplingParams(greedy=True)
    voice = generate(model, samples, "NATM1", "", greedy, seed=0).tokens
    persona = generate(model, samples, None, PERSONA, greedy, seed=0).tokens
    for tokens in (both.tokens, voice, persona, bare.tokens):
        assert tokens.shape == (input_frames, 17)
        assert tokens[0].tolist() == [TEXT_PAD, *SILENCE_TOKENS, *SINE_TOKENS]
    # Each prompt reaches the model: each leads to a different conversation.
    agents = [t[1:, :9] for t in (both.tokens, voice, persona, bare.tokens)]
    for i in range(len(agents)):
        for j in range(i + 1, len(agents)):
            assert not np.array_equal(agents[i], agents[j]), (i, j)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--voice", "NOBODY"), "unknown voice 'NOBODY'"),
        (("--topk-text", "0"), "'topk_text'"),
    ],
)
def test_bad_arguments_are_one_line_errors(tiny, speech, tmp_path, args, fragment):
    done = subprocess.run(
        [sys.executable, "-m", "model.generate", "--model", str(tiny), "--input", str(speech),
         "--output", str(tmp_path / "out.wav"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], done.stderr
    assert not (tmp_path / "out.wav").exists()
