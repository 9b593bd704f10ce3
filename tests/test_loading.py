"""Checkpoint loading on the tiny checkpoint: official layout, 8 or 16 depformer sets, strict errors, voices, config."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import keep_depformer_sets, make_tiny, speech_wav
from safetensors.torch import load_file, save_file

from model.config import (
    FRAME_SAMPLES,
    MIMI_NAME,
    MOSHI_NAME,
    SAMPLE_RATE,
    TOKENIZER_NAME,
    VOICES_NAME,
    LMConfig,
)
from model.generate import generate
from model.lm import LM, count_parameters
from model.loading import CheckpointError, PersonaPlex, lm_expected_shapes, load_model
from model.prompts import VoicePrompt, apply_prompt, persona_tokens, plan_prompt
from model.sampling import SamplingParams, row_sampling
from model.step import StepConstants, frame_step
from model.tiny import TINY_VOICES

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(greedy=True)
PERSONA = "You are a wise and friendly teacher."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, voice_cache) -> Path:
    return make_tiny(tmp_path_factory, "loading", seed=1)


@pytest.fixture(scope="module")
def model(tiny) -> PersonaPlex:
    return load_model(str(tiny))


def variant(tiny: Path, dest: Path, *, lm: dict[str, torch.Tensor] | None = None, config: str | None = None,
            drop: tuple[str, ...] = (), files: dict[str, bytes] | None = None) -> Path:
    """A copy of the tiny folder (symlinks) with its LM weights, config.json text or other files replaced."""
    dest.mkdir()
    replaced = {**(files or {})}
    if config is not None:
        replaced["config.json"] = config.encode()
    for item in tiny.iterdir():
        if item.name in drop or item.name in replaced or (lm is not None and item.name == MOSHI_NAME):
            continue
        (dest / item.name).symlink_to(item)
    for name, data in replaced.items():
        (dest / name).write_bytes(data)
    if lm is not None:
        save_file({k: v.contiguous() for k, v in lm.items()}, str(dest / MOSHI_NAME))
    return dest


def tiny_config(tiny: Path) -> dict:
    return json.loads((tiny / "config.json").read_text())


def test_tiny_checkpoint_loads(tiny, model):
    assert {p.name for p in tiny.iterdir()} >= {MOSHI_NAME, MIMI_NAME, TOKENIZER_NAME, VOICES_NAME, "config.json"}
    assert model.is_tiny and model.config.context == 250 and model.config.dep_q == 16
    # The file holds all 16 depformer sets; only the agent's 8 are built.
    assert load_file(str(tiny / MOSHI_NAME))["depformer.layers.0.self_attn.in_proj_weight"].shape[0] == 16 * 3 * 32
    assert model.lm.depformer_steps == 8 and len(model.lm.linears) == 8
    assert model.tokenizer.get_piece_size() > 100
    assert model.voices() == sorted(TINY_VOICES) and model.default_voice == "NATF2"


def test_eight_set_checkpoint_loads_and_matches(tiny, model, tmp_path):
    state = load_file(str(tiny / MOSHI_NAME))
    eight = keep_depformer_sets(state, model.config, 8)
    assert set(eight) == set(lm_expected_shapes(model.config, 8))
    folder = variant(tiny, tmp_path / "eight", lm=eight)
    loaded = load_model(str(folder))
    ours, theirs = model.lm.state_dict(), loaded.lm.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    samples = speech_wav(tmp_path / "in.wav", SAMPLE_RATE)[: 16 * FRAME_SAMPLES]
    a = generate(model, samples, "NATF2", PERSONA, GREEDY, seed=0)
    b = generate(loaded, samples, "NATF2", PERSONA, GREEDY, seed=0)
    assert a.tokens.shape == (16, 17)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def _drop(key: str) -> Callable[[dict], None]:
    return lambda s: s.pop(key)


def _replace(key: str, value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    return lambda s: s.__setitem__(key, value(s[key]))


def _add(key: str, value: torch.Tensor) -> Callable[[dict], None]:
    return lambda s: s.__setitem__(key, value)


# name: (edit of the tiny state dict, fragments the error must contain)
BAD_WEIGHTS = {
    "missing key": (_drop("transformer.layers.1.norm2.alpha"), ["'transformer.layers.1.norm2.alpha'", "[1, 1, 64]"]),
    "missing depformer set": (_drop("depformer.layers.1.gating.11.linear_out.weight"),
                              ["'depformer.layers.1.gating.11.linear_out.weight'", "[32, 88]"]),
    "wrong shape": (_replace("text_linear.weight", lambda t: t[:100]),
                    ["'text_linear.weight'", "[100, 64]", "[32000, 64]"]),
    "wrong depformer rows": (_replace("depformer.layers.0.self_attn.in_proj_weight", lambda t: t[:100]),
                             ["'depformer.layers.0.self_attn.in_proj_weight'", "[100, 32]", "[1536, 32]", "[768, 32]"]),
    "int tensor": (_replace("out_norm.alpha", lambda t: t.long()), ["'out_norm.alpha'", "I64", "floating-point"]),
    "int tensor in a user set": (_replace("depformer.layers.0.gating.12.linear_in.weight", lambda t: t.int()),
                                 ["'depformer.layers.0.gating.12.linear_in.weight'", "I32"]),
    "unexpected key": (_add("extra_heads.0.weight", torch.zeros(6, 64)), ["'extra_heads.0.weight'", "[6, 64]"]),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_bad_weights_name_file_key_and_shapes(tiny, tmp_path, case):
    edit, fragments = BAD_WEIGHTS[case]
    state = load_file(str(tiny / MOSHI_NAME))
    edit(state)
    folder = variant(tiny, tmp_path / "bad", lm=state)
    with pytest.raises(CheckpointError) as info:
        load_model(str(folder))
    message = str(info.value)
    assert str(folder / MOSHI_NAME) in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_bad_files_and_config(tiny, tmp_path):
    data = (tiny / MOSHI_NAME).read_bytes()
    cases: list[tuple[Path, type[Exception], list[str]]] = [
        (variant(tiny, tmp_path / "no_lm", drop=(MOSHI_NAME,)), CheckpointError, [MOSHI_NAME, "file not found"]),
        (variant(tiny, tmp_path / "no_tok", drop=(TOKENIZER_NAME,)), CheckpointError, [TOKENIZER_NAME, "not found"]),
        (variant(tiny, tmp_path / "trunc", files={MOSHI_NAME: data[: len(data) // 2]}), CheckpointError,
         [MOSHI_NAME, "not a readable safetensors file"]),
        (variant(tiny, tmp_path / "garbage", files={MOSHI_NAME: b"\x10" + bytes(7) + b"{not json}" * 3}),
         CheckpointError, [MOSHI_NAME, "not a readable safetensors file"]),
        (variant(tiny, tmp_path / "mimi", files={MIMI_NAME: b"garbage"}), ValueError, [MIMI_NAME]),
        (variant(tiny, tmp_path / "tok", files={TOKENIZER_NAME: b"garbage"}), CheckpointError,
         [TOKENIZER_NAME, "SentencePiece"]),
        (variant(tiny, tmp_path / "json", config='{"dim": 64,'), ValueError, ["config.json", "invalid JSON"]),
        (variant(tiny, tmp_path / "delays", config=json.dumps({**tiny_config(tiny), "delays": [0, 1, 1]})),
         ValueError, ["config.json", "'delays' has 3 entries", "17"]),
    ]
    for folder, error, fragments in cases:
        with pytest.raises(error) as info:
            load_model(str(folder))
        message = str(info.value)
        assert all(fragment in message for fragment in fragments), (folder.name, message)
    with pytest.raises(CheckpointError, match="not a folder"):
        load_model(str(tmp_path / "does-not-exist"))


def test_cli_bad_checkpoint_is_one_line_error(tiny, tmp_path):
    speech_wav(tmp_path / "in.wav", 16000)
    state = load_file(str(tiny / MOSHI_NAME))
    state["text_linear.weight"] = state["text_linear.weight"][:, :10]
    bad = {
        "shape": (variant(tiny, tmp_path / "shape", lm=state), "'text_linear.weight' has shape [32000, 10]"),
        "json": (variant(tiny, tmp_path / "json", config="{"), "invalid JSON"),
        "missing": (variant(tiny, tmp_path / "missing", drop=(MOSHI_NAME,)), "file not found"),
    }
    for name, (folder, fragment) in bad.items():
        out = tmp_path / f"{name}.wav"
        done = subprocess.run(
            [sys.executable, "-m", "model.generate", "--model", str(folder), "--input", str(tmp_path / "in.wav"),
             "--output", str(out), "--greedy"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 2, (name, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (name, done.stderr)
        assert "Traceback" not in done.stderr and not out.exists()


def test_voices_unpacked_once_into_cache(tiny, voice_cache):
    first = load_model(str(tiny))
    unpacked = sorted(first.voices_dir.glob("*.pt"))
    assert first.voices() == ["NATF2", "NATM1"] and [p.stem for p in unpacked] == ["NATF2", "NATM1"]
    assert first.voices_dir.is_relative_to(voice_cache)
    stamps = {p: p.stat().st_mtime_ns for p in unpacked}
    second = load_model(str(tiny))
    assert second.voices_dir == first.voices_dir
    assert {p: p.stat().st_mtime_ns for p in unpacked} == stamps
    assert len(list((voice_cache / "voices").iterdir())) == 1
    voice = second.load_voice("NATM1")
    assert isinstance(voice, VoicePrompt) and voice.embeddings.shape[1] == 64 and voice.ring.shape == (17, 4)


def test_voices_unpacked_by_another_process_leave_no_temp_folder(tiny, tmp_path, monkeypatch):
    """Two processes unpacking at once: the one that loses the rename drops its copy and uses the winner's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PERSONAPLEX_CACHE", str(cache))
    first = load_model(str(tiny)).voices_dir
    digest_dir = cache / "voices" / first.relative_to(cache / "voices").parts[0]
    (digest_dir / ".complete").unlink()  # as if the winner had renamed its folder but not yet marked it
    again = load_model(str(tiny))
    assert again.voices() == ["NATF2", "NATM1"] and again.voices_dir == first
    assert [p.name for p in (cache / "voices").iterdir()] == [digest_dir.name]


def test_voice_resolution(model, tmp_path):
    assert model.resolve_voice("NATF2") == model.voices_dir / "NATF2.pt"
    assert model.resolve_voice("NATM1.pt") == model.voices_dir / "NATM1.pt"
    wav = tmp_path / "me.wav"
    speech_wav(wav, 16000)
    pt = tmp_path / "me.pt"
    model.save_voice(wav, pt)
    assert model.resolve_voice(str(wav)) == wav and model.resolve_voice(str(pt)) == pt
    assert isinstance(model.load_voice(str(pt)), VoicePrompt)
    codes = model.load_voice(str(wav))
    assert isinstance(codes, torch.Tensor) and codes.shape[1] == 8
    for bad in ("NOBODY", str(tmp_path / "missing.wav"), str(tmp_path / "x.mp3")):
        with pytest.raises(ValueError) as info:
            model.resolve_voice(bad)
        assert f"'{bad}'" in str(info.value) and "NATF2, NATM1" in str(info.value)
    broken = tmp_path / "broken.pt"
    broken.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="broken.pt: cannot read voice"):
        model.load_voice(str(broken))
    torch.save({"embeddings": torch.zeros(3, 1, 1, 32), "cache": torch.zeros(1, 17, 4)}, broken)
    with pytest.raises(ValueError, match=r"'embeddings' has shape \(3, 1, 1, 32\)"):
        model.load_voice(str(broken))


def test_pt_voice_from_wav_replays_like_the_wav(model, tmp_path):
    """A `.pt` saved from a `.wav` leaves the row in the same state (ring, offset, KV) and the same next frames."""
    wav = tmp_path / "voice.wav"
    speech_wav(wav, 16000, "My name is Ada and this is my voice.")
    pt = tmp_path / "voice.pt"
    saved = model.save_voice(wav, pt)
    lm = model.lm
    persona = persona_tokens(model.tokenizer, PERSONA)
    from_wav = model.load_voice(str(wav))
    from_pt = model.load_voice(str(pt))
    assert isinstance(from_pt, VoicePrompt) and from_pt.frames == saved.frames == from_wav.shape[0] > 10

    states = []
    for voice in (from_wav, from_pt):
        state = lm.init_state(1)
        apply_prompt(lm, state, 0, plan_prompt(lm, voice, persona))
        states.append(state)
    a, b = states
    assert int(a.offset[0]) == int(b.offset[0]) == from_pt.frames + 12 + len(persona)
    for name in ("ring", "offset", "pos", "kpos", "forced"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.kv.k, b.kv.k, atol=1e-6, rtol=0)
    torch.testing.assert_close(a.kv.v, b.kv.v, atol=1e-6, rtol=0)

    const = StepConstants.make(lm, model.device)
    text_s, audio_s = row_sampling([GREEDY], [0], model.device)
    user = torch.randint(0, 2048, (20, 1, 8), generator=torch.Generator().manual_seed(3))
    frames = []
    with torch.no_grad():
        for state in states:
            cache = lm.depformer_cache(1)
            frames.append(torch.stack([frame_step(lm, state, u, text_s, audio_s, cache, const)[0] for u in user]))
    assert torch.equal(frames[0], frames[1])

    # The same through the whole model (Mimi in and out), as the CLI runs it.
    samples = speech_wav(tmp_path / "in.wav", SAMPLE_RATE)[: 20 * FRAME_SAMPLES]
    x = generate(model, samples, str(wav), PERSONA, GREEDY, seed=0)
    y = generate(model, samples, str(pt), PERSONA, GREEDY, seed=0)
    assert x.tokens.shape == (20, 17)
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.audio, y.audio)


def test_config_json_overrides(tiny, tmp_path):
    config = tiny_config(tiny)
    short = load_model(str(variant(tiny, tmp_path / "ctx", config=json.dumps({**config, "context": 8}))))
    assert short.config.context == 8
    state = short.lm.init_state(1)
    assert state.kv.k.shape[3] == 8 and state.kpos.shape == (1, 8)

    renamed = tmp_path / "renamed"
    variant(tiny, renamed, drop=(MOSHI_NAME,),
            config=json.dumps({**config, "moshi_name": "lm-weights.safetensors"}))
    (renamed / "lm-weights.safetensors").symlink_to(tiny / MOSHI_NAME)
    assert load_model(str(renamed)).lm.depformer_steps == 8


def test_full_shape_key_table():
    """spec/model.md §1.4: 475 tensors and 8,371,408,896 values with 16 sets, 355 tensors with 8."""
    cfg = LMConfig()
    full, eight = lm_expected_shapes(cfg, 16), lm_expected_shapes(cfg, 8)
    assert len(full) == 475 and sum(math.prod(s) for s in full.values()) == 8_371_408_896
    assert len(eight) == 355
    with torch.device("meta"):
        lm16, lm8 = LM(cfg), LM(cfg, depformer_steps=8)
    assert {k: tuple(v.shape) for k, v in lm16.state_dict().items()} == full
    assert {k: tuple(v.shape) for k, v in lm8.state_dict().items()} == eight
    assert sum(math.prod(s) for s in eight.values()) == count_parameters(lm8)
    assert full["depformer.layers.0.self_attn.in_proj_weight"] == (49152, 1024)
    assert eight["depformer.layers.0.self_attn.in_proj_weight"] == (24576, 1024)
