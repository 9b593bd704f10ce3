"""Loading a PersonaPlex checkpoint: local folder or Hugging Face repo, strict key/shape checks, tokenizer, voices.

The official layout: `model.safetensors` (LM, 16 or 8 depformer weight sets), the Mimi file, the SentencePiece
tokenizer, `voices.tgz` (voice `.pt` files) and an optional `config.json` overriding the 7B shape. Only the
agent's depformer sets are loaded (spec/model.md §5.3): the user's are never needed at inference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from safetensors import safe_open

from model.audio import normalize_loudness, read_wav, resample
from model.config import (
    DEFAULT_REPO,
    FRAME_SAMPLES,
    SAMPLE_RATE,
    TEXT_EPAD,
    TEXT_PAD,
    LMConfig,
    MimiConfig,
    ModelFiles,
    files_from_dict,
    lm_config_from_dict,
    mimi_config_from_dict,
    read_json,
)
from model.engine.channel import ModelInfo
from model.lm import LM
from model.mimi import Mimi, load_mimi
from model.prompts import VoicePrompt, plan_voice

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors header names


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file, the key and the shapes."""


def cache_root() -> Path:
    return Path(os.environ.get("PERSONAPLEX_CACHE", Path.home() / ".cache" / "personaplex-server"))


def lm_expected_shapes(cfg: LMConfig, sets: int) -> dict[str, tuple[int, ...]]:
    """Every LM key and its shape for a checkpoint holding `sets` depformer weight sets."""
    d, dd, h, dh = cfg.dim, cfg.depformer_dim, cfg.ffn_hidden, cfg.depformer_ffn_hidden
    shapes: dict[str, tuple[int, ...]] = {f"emb.{i}.weight": (cfg.card + 1, d) for i in range(cfg.n_q)}
    shapes["text_emb.weight"] = (cfg.text_card + 1, d)
    shapes["text_linear.weight"] = (cfg.text_card, d)
    shapes["out_norm.alpha"] = (1, 1, d)
    for i in range(cfg.num_layers):
        p = f"transformer.layers.{i}."
        shapes[p + "self_attn.in_proj_weight"] = (3 * d, d)
        shapes[p + "self_attn.out_proj.weight"] = (d, d)
        shapes[p + "norm1.alpha"] = (1, 1, d)
        shapes[p + "norm2.alpha"] = (1, 1, d)
        shapes[p + "gating.linear_in.weight"] = (2 * h, d)
        shapes[p + "gating.linear_out.weight"] = (d, h)
    shapes["depformer_text_emb.weight"] = (cfg.text_card + 1, dd)
    for s in range(sets):
        shapes[f"depformer_in.{s}.weight"] = (dd, d)
        shapes[f"linears.{s}.weight"] = (cfg.card, dd)
        if s < sets - 1:
            shapes[f"depformer_emb.{s}.weight"] = (cfg.card + 1, dd)
    for i in range(cfg.depformer_num_layers):
        p = f"depformer.layers.{i}."
        shapes[p + "self_attn.in_proj_weight"] = (sets * 3 * dd, dd)
        shapes[p + "self_attn.out_proj.weight"] = (sets * dd, dd)
        shapes[p + "norm1.alpha"] = (1, 1, dd)
        shapes[p + "norm2.alpha"] = (1, 1, dd)
        for s in range(sets):
            shapes[p + f"gating.{s}.linear_in.weight"] = (2 * dh, dd)
            shapes[p + f"gating.{s}.linear_out.weight"] = (dd, dh)
    return shapes


def _depformer_sets(path: Path, cfg: LMConfig, header: dict[str, tuple[int, ...]]) -> int:
    key = "depformer.layers.0.self_attn.in_proj_weight"
    if key not in header:
        raise CheckpointError(f"{path}: missing key '{key}'")
    rows = header[key][0]
    sets, rest = divmod(rows, 3 * cfg.depformer_dim)
    if rest or sets not in (cfg.num_audio_codebooks, cfg.dep_q):
        raise CheckpointError(
            f"{path}: '{key}' has shape {list(header[key])}; expected [{cfg.dep_q * 3 * cfg.depformer_dim}, "
            f"{cfg.depformer_dim}] ({cfg.dep_q} depformer sets) or [{cfg.num_audio_codebooks * 3 * cfg.depformer_dim}, "
            f"{cfg.depformer_dim}] ({cfg.num_audio_codebooks} sets)"
        )
    return sets


def _slice_for_steps(key: str, tensor: torch.Tensor, cfg: LMConfig, steps: int) -> torch.Tensor:
    if key.endswith("self_attn.in_proj_weight") and key.startswith("depformer."):
        return tensor[: steps * 3 * cfg.depformer_dim]
    if key.endswith("self_attn.out_proj.weight") and key.startswith("depformer."):
        return tensor[: steps * cfg.depformer_dim]
    return tensor


def _wanted(key: str, steps: int) -> bool:
    """Keys of depformer sets beyond `steps` are checked but not loaded."""
    parts = key.split(".")
    if parts[0] in ("depformer_in", "linears"):
        return int(parts[1]) < steps
    if parts[0] == "depformer_emb":
        return int(parts[1]) < steps - 1
    if parts[0] == "depformer" and len(parts) > 4 and parts[3] == "gating":
        return int(parts[4]) < steps
    return True


def load_lm(path: Path, cfg: LMConfig, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LM:
    """Load `model.safetensors` strictly into an LM that runs the agent's depformer steps only."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    with handle as f:
        header = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        sets = _depformer_sets(path, cfg, header)
        expected = lm_expected_shapes(cfg, sets)
        missing = sorted(set(expected) - set(header))
        if missing:
            raise CheckpointError(f"{path}: missing key '{missing[0]}' (expected shape {list(expected[missing[0]])})"
                                  + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        unexpected = sorted(set(header) - set(expected))
        if unexpected:
            raise CheckpointError(f"{path}: unexpected key '{unexpected[0]}' with shape {list(header[unexpected[0]])}"
                                  + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""))
        for key, shape in expected.items():
            if header[key] != shape:
                raise CheckpointError(f"{path}: key '{key}' has shape {list(header[key])}, expected {list(shape)}")
            if f.get_slice(key).get_dtype() not in FLOAT_DTYPES:
                raise CheckpointError(f"{path}: key '{key}' has dtype {f.get_slice(key).get_dtype()}, expected a "
                                      f"floating-point tensor ({', '.join(FLOAT_DTYPES)})")
        steps = cfg.num_audio_codebooks
        with torch.device("meta"):
            lm = LM(cfg, depformer_steps=steps)
        lm = lm.to_empty(device=device).to(dtype)
        params = dict(lm.named_parameters())
        for key in expected:
            if not _wanted(key, steps):
                continue
            tensor = _slice_for_steps(key, f.get_tensor(key), cfg, steps)
            with torch.no_grad():
                params[key].copy_(tensor.to(dtype))
    return lm.eval()


def _safe_extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            target = (dest / m.name).resolve()
            if not str(target).startswith(str(dest.resolve())) or m.issym() or m.islnk():
                raise CheckpointError(f"{archive}: unsafe member '{m.name}'")
            members.append(m)
        tar.extractall(dest, members=members)


def unpack_voices(archive: Path) -> Path:
    """Unpack `voices.tgz` once into the cache (keyed by the archive's content) and return the folder of `.pt`s."""
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    dest = cache_root() / "voices" / digest
    done = dest / ".complete"
    if not done.exists():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        _safe_extract(archive, tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process unpacked it first: use theirs
            shutil.rmtree(tmp)
        (dest / ".complete").touch()
    pts = list(dest.rglob("*.pt"))
    return pts[0].parent if pts else dest


@dataclass
class PersonaPlex:
    """Everything a session needs: the LM, Mimi, tokenizer, voices, and where they came from."""

    lm: LM
    mimi: Mimi
    tokenizer: sentencepiece.SentencePieceProcessor
    config: LMConfig
    mimi_config: MimiConfig
    voices_dir: Path | None
    source: str
    device: torch.device
    dtype: torch.dtype
    is_tiny: bool = False
    random_weights: bool = False  # the official shape with random weights (`random-7b`): for sizing hardware

    def info(self) -> ModelInfo:
        """What the doors need to know of this model, in a form that crosses to worker processes."""
        return ModelInfo(source=self.source, device=str(self.device), is_tiny=self.is_tiny,
                         random_weights=self.random_weights, voices=self.voices(), default_voice=self.default_voice)

    def voices(self) -> list[str]:
        if self.voices_dir is None:
            return []
        return sorted(p.stem for p in self.voices_dir.glob("*.pt"))

    @property
    def default_voice(self) -> str | None:
        names = self.voices()
        return "NATF2" if "NATF2" in names else (names[0] if names else None)

    def text_piece(self, token: int) -> str:
        """The text of one emitted text token ('' for PAD, EPAD and ids outside the tokenizer)."""
        table = self._text_piece_table
        return table[token] if 0 <= token < len(table) - 1 else ""

    def text_pieces(self, tokens: np.ndarray) -> list[str]:
        """`text_piece` of each of `tokens` (int), looked up at once: a tick's frames for a worker."""
        table = self._text_piece_table
        outside = len(table) - 1  # its '' stands for every id outside the tokenizer
        return table[np.where((tokens >= 0) & (tokens < outside), tokens, outside)].tolist()

    @functools.cached_property
    def _text_piece_table(self) -> np.ndarray:
        """Every token's text, looked up once (each tick hands out one per conversation), and a last '' for the ids
        outside the tokenizer."""
        sp = self.tokenizer
        pieces = ["" if token in (TEXT_PAD, TEXT_EPAD) or sp.is_control(token) or sp.is_unknown(token)
                  else sp.id_to_piece(token).replace("\u2581", " ") for token in range(sp.get_piece_size())]
        return np.array([*pieces, ""], dtype=object)

    @torch.no_grad()
    def encode_wav_voice(self, samples: np.ndarray, rate: int) -> torch.Tensor:
        """Mimi codes [N, 8] of a voice recording: resampled to 24 kHz, then normalised to -24 LUFS, as the
        reference does (at least 0.4 s, one loudness block, or ValueError)."""
        audio = normalize_loudness(resample(samples, rate, SAMPLE_RATE), SAMPLE_RATE)
        frames = -(-audio.size // FRAME_SAMPLES)
        audio = np.pad(audio, (0, frames * FRAME_SAMPLES - audio.size))
        # One forward over the whole recording: equal to streaming it frame by frame from a fresh state.
        pcm = torch.from_numpy(audio).to(self.device).view(1, frames * FRAME_SAMPLES)
        return self.mimi.encode(pcm)[0].T.cpu()

    def _wav_voice_codes(self, path: Path) -> torch.Tensor:
        samples, rate = read_wav(path)
        try:
            return self.encode_wav_voice(samples, rate)
        except ValueError as exc:
            raise ValueError(f"{path}: not usable as a voice ({exc})") from exc

    def resolve_voice(self, voice: str) -> Path:
        """A bundled name ('NATF2' or 'NATF2.pt') or a path to a `.pt` / `.wav` file."""
        name = voice[:-3] if voice.endswith(".pt") else voice
        if self.voices_dir is not None and "/" not in name and "\\" not in name and name in self.voices():
            return self.voices_dir / f"{name}.pt"
        path = Path(voice).expanduser()
        if path.suffix in (".pt", ".wav") and path.is_file():
            return path
        known = ", ".join(self.voices()) or "none bundled"
        raise ValueError(f"unknown voice '{voice}' (bundled: {known}; or give a path to a .pt or .wav file)")

    def load_voice(self, voice: str) -> VoicePrompt | torch.Tensor:
        """A replayable VoicePrompt (`.pt`) or Mimi codes [N, 8] (`.wav`)."""
        path = self.resolve_voice(voice)
        if path.suffix == ".wav":
            return self._wav_voice_codes(path)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{path}: cannot read voice ({exc})") from exc
        return VoicePrompt.from_reference(data, self.config.dim, str(path))

    def save_voice(self, wav: Path, out: Path) -> VoicePrompt:
        """Make a bundled-style `.pt` from a `.wav` voice."""
        voice = plan_voice(self.lm, self._wav_voice_codes(wav))
        torch.save(voice.to_reference(), out)
        return voice


def fetch(source: str, files: list[str], token: str | None = None) -> Path:
    """A local folder as it is, or the named files of a Hugging Face repo downloaded into its cache."""
    local = Path(source).expanduser()
    if local.is_dir():
        return local
    if local.exists() or source.startswith((".", "/")):
        raise CheckpointError(f"{source}: not a folder")
    from huggingface_hub import hf_hub_download

    folder: Path | None = None
    for name in files:
        try:
            got = Path(hf_hub_download(repo_id=source, filename=name, token=token))
        except Exception as exc:
            if name == "config.json":
                continue
            raise CheckpointError(f"{source}: cannot download '{name}' ({type(exc).__name__}: {exc})") from exc
        folder = got.parent
    assert folder is not None
    return folder


def load_model(source: str = DEFAULT_REPO, device: str = "cpu", dtype: str = "float32",
               token: str | None = None) -> PersonaPlex:
    """Load a PersonaPlex checkpoint from a folder or a Hugging Face repo id (`HF_TOKEN` for gated repos)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got '{dtype}'")
    token = token or os.environ.get("HF_TOKEN")
    local = Path(source).expanduser()
    config_data: dict = {}
    if local.is_dir() and (local / "config.json").exists():
        config_data = read_json(local / "config.json")
    names = files_from_dict(config_data)
    wanted = ["config.json", names.moshi_name, names.mimi_name, names.tokenizer_name, names.voices_name]
    if names.mimi_config_name:
        wanted.append(names.mimi_config_name)
    folder = fetch(source, wanted, token)
    if not config_data and (folder / "config.json").exists():
        config_data = read_json(folder / "config.json")
        names = files_from_dict(config_data)
    return _load_folder(folder, source, config_data, names, torch.device(device), DTYPES[dtype])


def _load_folder(folder: Path, source: str, config_data: dict, names: ModelFiles, device: torch.device,
                 dtype: torch.dtype) -> PersonaPlex:
    cfg = lm_config_from_dict(config_data, str(folder / "config.json"))
    mimi_cfg = MimiConfig()
    if names.mimi_config_name:
        mimi_path = folder / names.mimi_config_name
        mimi_cfg = mimi_config_from_dict(read_json(mimi_path), str(mimi_path))
    for name in (names.moshi_name, names.mimi_name, names.tokenizer_name):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: file not found")
    lm = load_lm(folder / names.moshi_name, cfg, str(device), dtype)
    mimi = load_mimi(folder / names.mimi_name, mimi_cfg, device=str(device), dtype=torch.float32)
    try:
        tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(folder / names.tokenizer_name))
    except Exception as exc:
        raise CheckpointError(f"{folder / names.tokenizer_name}: not a SentencePiece model ({exc})") from exc
    voices_dir = None
    if (folder / names.voices_name).is_file():
        voices_dir = unpack_voices(folder / names.voices_name)
    elif not config_data.get("tiny"):
        log.warning("%s: no %s; only .pt/.wav voice paths will work", folder, names.voices_name)
    return PersonaPlex(lm=lm, mimi=mimi, tokenizer=tokenizer, config=cfg, mimi_config=mimi_cfg, voices_dir=voices_dir,
                       source=source, device=device, dtype=dtype, is_tiny=bool(config_data.get("tiny", False)))
