"""Model shapes: the PersonaPlex-7B LM and Mimi configs, their tiny test twins, and `config.json` overrides.

Key names follow the reference ecosystem (a flat dict of LM keyword names plus file names, and a Mimi JSON
with `seanet`, `quantizer` and `transformer` sections), so a checkpoint folder's `config.json` reads as-is.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FRAME_SAMPLES = 1920
SAMPLE_RATE = 24000
FRAME_MS = 80

TEXT_PAD = 3
TEXT_EPAD = 0
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)

MOSHI_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"
VOICES_NAME = "voices.tgz"
DEFAULT_REPO = "nvidia/personaplex-7b-v1"


@dataclass(frozen=True)
class LMConfig:
    """The LM's keyword arguments as the reference names them; defaults are PersonaPlex-7B."""

    dim: int = 4096
    num_heads: int = 32
    num_layers: int = 32
    hidden_scale: float = 4.125
    context: int = 3000
    max_period: float = 10000.0
    depformer_dim: int = 1024
    depformer_num_heads: int = 16
    depformer_num_layers: int = 6
    depformer_dim_feedforward: int = 4224
    n_q: int = 16
    dep_q: int = 16
    card: int = 2048
    text_card: int = 32000
    delays: tuple[int, ...] = (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)
    existing_text_padding_id: int = TEXT_PAD
    end_of_text_padding_id: int = TEXT_EPAD
    norm_eps: float = 1e-8

    @property
    def num_rows(self) -> int:
        """Token rows per frame: text + agent codebooks + user codebooks."""
        return 1 + self.n_q

    @property
    def num_audio_codebooks(self) -> int:
        """Codebooks per speaker (agent or user)."""
        return self.n_q // 2

    @property
    def ffn_hidden(self) -> int:
        return 2 * int(self.hidden_scale * self.dim) // 3

    @property
    def depformer_ffn_hidden(self) -> int:
        return 2 * self.depformer_dim_feedforward // 3

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def initial_text_token(self) -> int:
        return self.text_card

    @property
    def initial_audio_token(self) -> int:
        return self.card


@dataclass(frozen=True)
class SeanetConfig:
    channels: int = 1
    dimension: int = 512
    n_filters: int = 64
    n_residual_layers: int = 1
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    residual_kernel_size: int = 3
    last_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    true_skip: bool = True
    pad_mode: str = "constant"


@dataclass(frozen=True)
class QuantizerConfig:
    dimension: int = 256
    n_q: int = 32
    bins: int = 2048
    input_dimension: int = 512
    output_dimension: int = 512


@dataclass(frozen=True)
class MimiTransformerConfig:
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 8
    dim_feedforward: int = 2048
    context: int = 250
    max_period: float = 10000.0
    layer_scale: float = 0.01


@dataclass(frozen=True)
class MimiConfig:
    """Mimi codec shape; `num_codebooks` is how many RVQ levels the LM uses (8 of 32)."""

    seanet: SeanetConfig = field(default_factory=SeanetConfig)
    quantizer: QuantizerConfig = field(default_factory=QuantizerConfig)
    transformer: MimiTransformerConfig = field(default_factory=MimiTransformerConfig)
    sample_rate: int = SAMPLE_RATE
    frame_rate: float = 12.5
    num_codebooks: int = 8

    @property
    def frame_samples(self) -> int:
        return int(self.sample_rate / self.frame_rate)


@dataclass(frozen=True)
class ModelFiles:
    """File names inside a checkpoint folder or Hugging Face repo."""

    moshi_name: str = MOSHI_NAME
    mimi_name: str = MIMI_NAME
    tokenizer_name: str = TOKENIZER_NAME
    voices_name: str = VOICES_NAME
    mimi_config_name: str | None = None


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build a frozen dataclass from `data`, keeping only its own fields; lists become tuples."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            continue
        if isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def lm_config_from_dict(data: dict[str, Any], where: str = "config.json") -> LMConfig:
    cfg: LMConfig = _from_dict(LMConfig, data, where)
    if len(cfg.delays) != cfg.num_rows:
        raise ValueError(f"{where}: 'delays' has {len(cfg.delays)} entries, expected n_q + 1 = {cfg.num_rows}")
    if cfg.n_q != 16:
        raise ValueError(f"{where}: n_q must be 16 (8 agent + 8 user codebooks), got {cfg.n_q}")
    return cfg


def mimi_config_from_dict(data: dict[str, Any], where: str = "mimi config") -> MimiConfig:
    return MimiConfig(
        seanet=_from_dict(SeanetConfig, data.get("seanet", {}), where + " [seanet]"),
        quantizer=_from_dict(QuantizerConfig, data.get("quantizer", {}), where + " [quantizer]"),
        transformer=_from_dict(MimiTransformerConfig, data.get("transformer", {}), where + " [transformer]"),
        **{k: data[k] for k in ("sample_rate", "frame_rate", "num_codebooks") if k in data},
    )


def mimi_config_to_dict(cfg: MimiConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def files_from_dict(data: dict[str, Any]) -> ModelFiles:
    return _from_dict(ModelFiles, data, "config.json")


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from exc
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


TINY_LM = LMConfig(
    dim=64,
    num_heads=4,
    num_layers=2,
    context=16,
    depformer_dim=32,
    depformer_num_heads=2,
    depformer_num_layers=2,
    depformer_dim_feedforward=int(4.125 * 32),
)

# 2048 bins (not the 64 the spec's smallest Mimi uses) so every code the tiny LM emits decodes.
TINY_MIMI = MimiConfig(
    seanet=SeanetConfig(dimension=32, n_filters=8),
    quantizer=QuantizerConfig(dimension=16, n_q=8, bins=2048, input_dimension=32, output_dimension=32),
    transformer=MimiTransformerConfig(d_model=32, num_heads=2, num_layers=2, dim_feedforward=64, context=16),
)
