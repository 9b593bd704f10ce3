"""Fidelity to NVIDIA's PersonaPlex fork at the edges (docs/fidelity.md): loudness, voice audio, prompt text.

The fork itself is not installed; its steps are rebuilt here from the libraries it calls (sphn, pyloudnorm) where
that is the check, and `bench/reference_fidelity.py` runs the fork beside `model.generate` where it is installed.
"""

from __future__ import annotations

import numpy as np
import pyloudnorm
import pytest
import soundfile
import sphn
import torch
from model_fixtures import make_tiny, speech_wav

from model.audio import loudness_lufs, normalize_loudness, read_wav, resample, write_wav
from model.config import FRAME_SAMPLES, SAMPLE_RATE, SILENCE_TOKENS, TEXT_PAD
from model.loading import PersonaPlex, load_model
from model.prompts import SPACER_FRAMES, forced_frame, persona_text, persona_tokens, plan_prompt, simulate_ring
from model.tiny import synthetic_voice


def sine(freq: float, amplitude: float, rate: int = SAMPLE_RATE, seconds: float = 3.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory, voice_cache) -> PersonaPlex:
    return load_model(str(make_tiny(tmp_path_factory, "fidelity", seed=2)))


# --- loudness ---------------------------------------------------------------------------------------------------


def test_loudness_reads_known_bs1770_values() -> None:
    # pyloudnorm's reading of a 1 kHz sine at 0.1 (the hand-written meter this replaces read -25.26).
    assert loudness_lufs(sine(1000, 0.1), SAMPLE_RATE) == pytest.approx(-23.06, abs=0.005)
    # A full-scale 997 Hz sine is -3.01 LUFS by BS.1770's definition; EBU Tech 3341 allows +-0.1 LU.
    assert loudness_lufs(sine(997, 1.0, 48000), 48000) == pytest.approx(-3.01, abs=0.1)
    # Twice the amplitude is 6.02 LU louder.
    quiet, loud = (loudness_lufs(sine(440, a), SAMPLE_RATE) for a in (0.05, 0.1))
    assert loud - quiet == pytest.approx(20 * np.log10(2), abs=1e-6)
    assert loudness_lufs(np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE) == -np.inf


def test_normalize_is_one_gain_to_minus_24_without_clipping() -> None:
    voice = synthetic_voice(4, 2.0)
    out = normalize_loudness(voice, SAMPLE_RATE)
    assert out.dtype == np.float32
    assert loudness_lufs(out, SAMPLE_RATE) == pytest.approx(-24.0, abs=1e-3)
    reference = pyloudnorm.normalize.loudness(voice, loudness_lufs(voice, SAMPLE_RATE), -24.0)
    np.testing.assert_array_equal(out, reference.astype(np.float32))  # to the last bit: Mimi's codes are discrete
    # Sparse clicks: -24 LUFS needs peaks far above full scale, and the reference passes them on unclipped.
    clicks = np.zeros(2 * SAMPLE_RATE, np.float32)
    clicks[::2400] = 0.5
    assert np.abs(normalize_loudness(clicks, SAMPLE_RATE)).max() > 1.5


def test_silence_is_kept_and_a_short_voice_is_refused() -> None:
    silence = np.zeros(SAMPLE_RATE, np.float32)
    np.testing.assert_array_equal(normalize_loudness(silence, SAMPLE_RATE), silence)  # the fork: NaN
    hum = np.full(SAMPLE_RATE, 1e-5, np.float32)  # under the -70 LUFS gate
    np.testing.assert_array_equal(normalize_loudness(hum, SAMPLE_RATE), hum)
    with pytest.raises(ValueError, match="shorter than one 0.4 s loudness block"):
        normalize_loudness(sine(440, 0.1, seconds=0.3), SAMPLE_RATE)


def test_short_wav_voice_is_a_value_error_naming_the_file(model, tmp_path) -> None:
    wav = tmp_path / "short.wav"
    write_wav(wav, sine(440, 0.1, seconds=0.3), SAMPLE_RATE)
    with pytest.raises(ValueError, match=r"short\.wav: not usable as a voice"):
        model.load_voice(str(wav))


# --- the voice's samples and codes --------------------------------------------------------------------------------


def reference_voice_samples(path) -> np.ndarray:
    """The fork's `load_voice_prompt` steps, with the libraries it calls: read, resample, then normalise."""
    pcm, rate = sphn.read(str(path))
    pcm = sphn.resample(pcm, src_sample_rate=rate, dst_sample_rate=SAMPLE_RATE)[0]
    loudness = pyloudnorm.Meter(SAMPLE_RATE).integrated_loudness(pcm)
    return pyloudnorm.normalize.loudness(pcm, loudness, -24.0).astype(np.float32)


@pytest.mark.parametrize("rate", [16000, SAMPLE_RATE, 44100])
def test_wav_voice_reaches_mimi_as_in_the_reference(model, tmp_path, rate) -> None:
    wav = tmp_path / f"voice{rate}.wav"
    speech_wav(wav, rate, "My name is Ada and this is my voice.")
    expected = reference_voice_samples(wav)
    samples, got_rate = read_wav(wav)
    ours = normalize_loudness(resample(samples, got_rate, SAMPLE_RATE), SAMPLE_RATE)
    np.testing.assert_array_equal(ours, expected)
    # The fork encodes frame by frame from a fresh streaming state, the last frame zero-padded.
    frames = -(-expected.size // FRAME_SAMPLES)
    pcm = torch.from_numpy(np.pad(expected, (0, frames * FRAME_SAMPLES - expected.size)))
    state = model.mimi.init_state(1, model.device)
    with torch.no_grad():
        streamed = torch.cat([model.mimi.encode_frame(pcm[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].view(1, -1),
                                                      state) for i in range(frames)])
    assert torch.equal(model.load_voice(str(wav)), streamed)


def test_read_wav_encodings_and_channels(tmp_path) -> None:
    """soundfile reads what the fork's reader reads (int PCM over 2^(bits-1)); channels are averaged (the fork
    refuses more than one: pyloudnorm takes its [channels, samples] array for thousands of channels)."""
    x = sine(300, 0.5, seconds=0.5)
    for subtype in ("PCM_16", "PCM_24", "PCM_32", "FLOAT", "PCM_U8"):
        path = tmp_path / f"{subtype}.wav"
        soundfile.write(str(path), x, 22050, subtype=subtype)
        got, rate = read_wav(path)
        assert rate == 22050 and got.dtype == np.float32
        np.testing.assert_array_equal(got, sphn.read(str(path))[0][0])
    stereo = tmp_path / "stereo.wav"
    soundfile.write(str(stereo), np.stack([x, np.zeros_like(x)], axis=1), 22050, subtype="FLOAT")
    np.testing.assert_array_equal(read_wav(stereo)[0], x / 2)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF0000WAVEjunk")
    with pytest.raises(ValueError, match="bad.wav: cannot read audio"):
        read_wav(bad)


def test_write_wav_clips_instead_of_wrapping(tmp_path) -> None:
    path = tmp_path / "loud.wav"
    write_wav(path, np.array([0.5, 1.5, -2.0], np.float32), SAMPLE_RATE)
    pcm, _ = soundfile.read(str(path), dtype="int16")
    assert pcm.tolist() == [16384, 32767, -32768]  # libsndfile scales by 32767 and rounds to the nearest


# --- the text prompt and the spacers ------------------------------------------------------------------------------


def test_persona_text_as_the_reference_wraps_it(model) -> None:
    assert persona_text("") == ""
    assert persona_text("   ") == persona_text("\n") == "<system>  <system>"
    assert persona_text("  Be kind. ") == "<system> Be kind. <system>"
    assert persona_text(" <system> Be kind. <system>\n") == "<system> Be kind. <system>"
    assert persona_tokens(model.tokenizer, "") == []
    tokens = persona_tokens(model.tokenizer, "   ")
    assert tokens and tokens == list(model.tokenizer.encode("<system>  <system>"))


def test_no_voice_and_no_persona_still_play_both_spacers(model) -> None:
    lm, cfg = model.lm, model.config
    plan = plan_prompt(lm, None, [])
    # 12 forced calls; the first is the fork's dummy call, which never reaches the transformer.
    assert plan.offset == 2 * SPACER_FRAMES and plan.embeddings.shape[0] == 2 * SPACER_FRAMES - 1
    silence = SILENCE_TOKENS[: cfg.num_audio_codebooks]
    spacer = forced_frame(cfg, TEXT_PAD, silence)
    columns, ring, _ = simulate_ring(cfg, lm.initial_column(), torch.zeros_like(plan.ring), 0,
                                     [spacer] * (2 * SPACER_FRAMES))
    assert torch.equal(plan.ring, ring)
    torch.testing.assert_close(plan.embeddings, lm.embed_column(columns), rtol=0, atol=0)
    # The whitespace persona is a prompt of its own between the spacers.
    spaced = plan_prompt(lm, None, persona_tokens(model.tokenizer, " "))
    assert spaced.offset == plan.offset + len(persona_tokens(model.tokenizer, " "))
