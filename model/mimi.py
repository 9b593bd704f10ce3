"""Mimi codec: 24 kHz audio <-> 12.5 Hz RVQ codes, one-shot and streaming with per-row state.

Encode: SEANet encoder (25 Hz latents) -> windowed transformer -> stride-2 downsample -> split RVQ.
Decode: split RVQ sum -> depthwise stride-2 upsample -> windowed transformer -> SEANet decoder.

The streaming path (`encode_frame`/`decode_frame`) takes one 1920-sample frame (or one code column) for each of
B rows and updates a `MimiState` of fixed-shape tensors in place, with no host sync and no data-dependent shapes,
so a frame step can be captured in a CUDA graph. Streaming output equals the one-shot output.

Checkpoints use the reference (moshi) key layout; `checkpoint_key` maps our parameter names onto it.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from model.config import MimiConfig
from model.mimi_modules import (
    Attention,
    CausalConv1d,
    CausalConvTranspose1d,
    KVCache,
    LayerScale,
    MimiTransformer,
    ResidualBlock,
    SeanetDecoder,
    SeanetEncoder,
    SplitResidualVQ,
)
from model.precision import sibling
from model.seanet_kernels import residual_fits, strided_fits, thin_fits, transposed_fits
from model.stream_kernels import StreamBuffers, reset_idle


@dataclass
class StreamState:
    """One direction's streaming state: the convolutions' input windows and the transposed convolutions' overlap
    tails (each [B, C, L], in the order a frame runs them; a step carries the first `carried[i]` samples of buffer i
    to the next, and rewrites the rest before reading it) and the transformer's ring KV."""

    convs: list[Tensor]
    kv: KVCache
    carried: list[int]
    reset_arrays: StreamBuffers = field(default_factory=StreamBuffers)  # what reset_idle's kernel reads

    def rows(self, index: slice) -> StreamState:
        """A view of some rows: writes through it land in this state."""
        return StreamState([buf[index] for buf in self.convs], self.kv.rows(index), self.carried)

    def clone(self) -> StreamState:
        return StreamState([buf.clone() for buf in self.convs], KVCache(*(t.clone() for t in (
            self.kv.keys, self.kv.values, self.kv.key_pos, self.kv.pos))), self.carried)

    def copy_(self, other: StreamState) -> None:
        for mine, theirs in zip(self.convs, other.convs):
            mine.copy_(theirs)
        for mine, theirs in zip((self.kv.keys, self.kv.values, self.kv.key_pos, self.kv.pos),
                                (other.kv.keys, other.kv.values, other.kv.key_pos, other.kv.pos)):
            mine.copy_(theirs)

    def reset_rows(self, rows: Tensor) -> None:
        # Only the carried samples: a step rewrites the rest of each window before it reads it (the class docstring).
        for buf, carried in zip(self.convs, self.carried, strict=True):
            buf[..., :carried].masked_fill_(rows[:, None, None], 0.0)
        self.kv.reset_rows(rows)

    def reset_idle(self, emitted: Tensor, active: Tensor | None) -> None:
        """The rows that emitted nothing (of the `active` ones) marked fresh as `reset_rows` would, their ring's keys
        and values left in place (nothing reads an empty slot: its attention weight is exactly 0, times a finite
        value): every tick's decode does it, in one kernel on CUDA (model/stream_kernels.py)."""
        reset_idle(self.convs, self.carried, self.kv.key_pos, self.kv.pos, emitted, active, self.reset_arrays)


@dataclass
class MimiState:
    encoder: StreamState
    decoder: StreamState

    @property
    def batch_size(self) -> int:
        return self.encoder.kv.pos.shape[0]

    def rows(self, index: slice) -> MimiState:
        """A view of some rows: writes through it land in this state."""
        return MimiState(self.encoder.rows(index), self.decoder.rows(index))


class Mimi(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        seanet, tcfg, qcfg = cfg.seanet, cfg.transformer, cfg.quantizer
        if tcfg.d_model != seanet.dimension:
            raise ValueError(f"transformer d_model {tcfg.d_model} must equal seanet dimension {seanet.dimension}")
        if not (qcfg.input_dimension == qcfg.output_dimension == seanet.dimension):
            raise ValueError("quantizer input/output dimensions must equal seanet dimension")
        if not 2 <= cfg.num_codebooks <= qcfg.n_q:
            raise ValueError(f"num_codebooks {cfg.num_codebooks} must be in [2, n_q={qcfg.n_q}]")
        hop = math.prod(seanet.ratios)
        stride = cfg.frame_samples // hop
        if stride * hop != cfg.frame_samples:
            raise ValueError(f"frame of {cfg.frame_samples} samples is not a multiple of the SEANet hop {hop}")
        self.cfg = cfg
        self.frame_samples = cfg.frame_samples
        self.num_codebooks = cfg.num_codebooks
        self.latent_steps = stride  # transformer steps per frame
        dim = seanet.dimension
        self.encoder = SeanetEncoder(seanet)
        self.decoder = SeanetDecoder(seanet)
        self.encoder_transformer = MimiTransformer(tcfg)
        self.decoder_transformer = MimiTransformer(tcfg)
        self.downsample = CausalConv1d(dim, dim, 2 * stride, stride=stride, bias=False, pad_mode="replicate")
        self.upsample = CausalConvTranspose1d(dim, dim, 2 * stride, stride, groups=dim, bias=False)
        self.quantizer = SplitResidualVQ(qcfg, cfg.num_codebooks)

    # ---- one-shot ----

    @torch.no_grad()
    def encode(self, pcm: Tensor) -> Tensor:
        """pcm [B, T * frame_samples] -> codes [B, num_codebooks, T] (long)."""
        if pcm.dim() != 2 or pcm.shape[1] == 0 or pcm.shape[1] % self.frame_samples:
            raise ValueError(f"pcm must be [B, T * {self.frame_samples}] with T >= 1, got {list(pcm.shape)}")
        x = self.encoder(pcm[:, None].to(self.encoder_dtype))
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(self.downsample(x).float())

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, num_codebooks, T] -> pcm [B, T * frame_samples] (float32)."""
        self._check_codes(codes, 3)
        bins = self.cfg.quantizer.bins
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= bins):
            raise ValueError(f"codes must lie in [0, {bins})")
        x = self.upsample(self.quantizer.decode(codes).to(self.decoder_dtype))
        x = self.decoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.decoder(x)[:, 0].float()

    # ---- streaming ----

    def init_state(self, batch_size: int, device: torch.device | str) -> MimiState:
        """Fresh streaming state; each direction's in the dtype of its own weights (`with_precision`)."""
        def stream(shapes: list[tuple[int, int, int]], transformer: MimiTransformer, dtype: torch.dtype
                   ) -> StreamState:
            return StreamState(convs=[torch.zeros(batch_size, c, n, device=device, dtype=dtype) for c, n, _ in shapes],
                               kv=transformer.init_cache(batch_size, steps, device, dtype),
                               carried=[carried for _, _, carried in shapes])

        steps = self.latent_steps
        encoder = stream(self.encoder.buffer_shapes(self.frame_samples) + self.downsample.buffer_shapes(steps),
                         self.encoder_transformer, self.encoder_dtype)
        decoder = stream(self.upsample.buffer_shapes(1) + self.decoder.buffer_shapes(steps),
                         self.decoder_transformer, self.decoder_dtype)
        return MimiState(encoder=encoder, decoder=decoder)

    def with_precision(self, encoder: torch.dtype, decoder: torch.dtype) -> Mimi:
        """This codec with its encoder side (SEANet encoder, transformer, downsample) in `encoder` and its decoder
        side in `decoder`: itself when both are its own, else a codec that shares the parts that keep theirs. The
        quantizer stays float32 either way (its nearest-centroid search picks the codes; its lookups are a few
        kilobytes a row)."""
        if encoder == self.encoder_dtype and decoder == self.decoder_dtype:
            return self
        other = sibling(self)
        for dtype, names in ((encoder, ("encoder", "encoder_transformer", "downsample")),
                             (decoder, ("upsample", "decoder_transformer", "decoder"))):
            for name in names:
                part = getattr(self, name)
                if next(part.parameters()).dtype != dtype:
                    setattr(other, name, copy.deepcopy(part).to(dtype))
        return other

    @torch.no_grad()
    def encode_frame(self, pcm: Tensor, state: MimiState) -> Tensor:
        """pcm [B, frame_samples] -> codes [B, num_codebooks] (long); advances the encoder state of every row."""
        if tuple(pcm.shape) != (state.batch_size, self.frame_samples):
            raise ValueError(f"pcm must be [{state.batch_size}, {self.frame_samples}], got {list(pcm.shape)}")
        return self._encode_step(pcm, state.encoder)

    def _encode_step(self, pcm: Tensor, enc: StreamState) -> Tensor:
        first = enc.kv.pos == 0  # rows on their first frame: the downsample pads by replicating
        buffers = iter(enc.convs)
        x = self.encoder.step(pcm[:, None].to(self.encoder_dtype), buffers)
        x = self.encoder_transformer.step(x.transpose(1, 2), enc.kv).transpose(1, 2)
        x = self.downsample.step(x, buffers, first)
        return self.quantizer.encode(x.float())[:, :, 0]

    @torch.no_grad()
    def decode_frame(self, codes: Tensor, state: MimiState) -> Tensor:
        """codes [B, num_codebooks] in [0, bins) (not checked: no host sync) -> pcm [B, frame_samples] (float32)."""
        self._check_codes(codes, 2)
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes must have {state.batch_size} rows, got {codes.shape[0]}")
        return self._decode_step(codes, state.decoder)

    def _decode_step(self, codes: Tensor, dec: StreamState) -> Tensor:
        buffers = iter(dec.convs)
        x = self.upsample.step(self.quantizer.decode(codes[:, :, None]).to(self.decoder_dtype), buffers)
        x = self.decoder_transformer.step(x.transpose(1, 2), dec.kv).transpose(1, 2)
        return self.decoder.step(x, buffers)[:, 0].float()

    def with_fused_seanet(self, residual: bool = True, strided: bool = True, ends: bool = True,
                          encoder: bool = True, decoder: bool = True) -> Mimi:
        """This codec with some SEANet steps as one Triton kernel each (model/seanet_kernels.py), where the
        activations are largest: the residual units of 32-128 channels (`residual`: the encoder's first two, the
        decoder's last two), the strided convolutions with the ELU before them (`strided`: the encoder's first two
        downsampling ones, the decoder's last two upsampling ones), and the convolutions from and to audio (`ends`),
        in the `encoder`, the `decoder` or both. Not bit-equal to the torch path: the engine fuses the decoder's,
        whose audio is never fed back, and not the encoder's, whose codes are (EngineConfig). A fused layer holds its
        weight in its kernel's order as it is here: fuse after loading the weights."""
        other = sibling(self)
        for name in [name for name, chosen in (("encoder", encoder), ("decoder", decoder)) if chosen]:
            seanet = copy.deepcopy(getattr(self, name))
            for layer in seanet.model:
                if isinstance(layer, ResidualBlock):
                    conv = layer.block[1].conv
                    fits = residual and residual_fits(conv.in_channels, conv.out_channels)
                elif isinstance(layer, CausalConv1d) and layer.pad_mode == "constant":
                    conv = layer.conv
                    fits = (strided and strided_fits(conv.in_channels, conv.out_channels, conv.stride[0])
                            or ends and thin_fits(conv.in_channels, conv.out_channels, conv.stride[0],
                                                  conv.dilation[0]))
                elif isinstance(layer, CausalConvTranspose1d):
                    convtr = layer.convtr
                    fits = strided and transposed_fits(convtr.in_channels, convtr.out_channels, convtr.kernel_size[0],
                                                       convtr.stride[0], convtr.groups)
                else:
                    continue
                layer.fuse(fits)
            setattr(other, name, seanet)
        return other

    def reset_rows(self, state: MimiState, rows: Tensor) -> None:
        """Rows where `rows` (bool [B]) is True become exactly fresh, in both directions."""
        if rows.dtype != torch.bool or tuple(rows.shape) != (state.batch_size,):
            raise ValueError(
                f"rows must be a bool mask of shape [{state.batch_size}], got {rows.dtype} {list(rows.shape)}"
            )
        state.encoder.reset_rows(rows)
        state.decoder.reset_rows(rows)

    # ---- helpers ----

    @property
    def encoder_dtype(self) -> torch.dtype:
        """The encoder side's dtype."""
        return self.downsample.conv.weight.dtype

    @property
    def decoder_dtype(self) -> torch.dtype:
        return self.upsample.convtr.weight.dtype

    def _check_codes(self, codes: Tensor, dims: int) -> None:
        if (
            codes.dim() != dims
            or codes.shape[1] != self.num_codebooks
            or codes.dtype != torch.long
            or (dims == 3 and codes.shape[2] == 0)
        ):
            want = "[B, K, T >= 1]" if dims == 3 else "[B, K]"
            raise ValueError(
                f"codes must be long {want} with K = {self.num_codebooks}, got {codes.dtype} {list(codes.shape)}"
            )


# ---- checkpoint layout ----

# Our names -> reference (moshi) names; the first matching rule applies. The reference nests every conv two or
# three wrapper modules deep, and its transformers and codebooks one more.
_CHECKPOINT_RULES = (
    (re.compile(r"^downsample\.conv\."), "downsample.conv.conv.conv."),
    (re.compile(r"^upsample\.convtr\."), "upsample.convtr.convtr.convtr."),
    (re.compile(r"^(encoder|decoder)\.model\.(.+)\.(conv|convtr)\."), r"\1.model.\2.\3.\3."),
    (re.compile(r"^(encoder|decoder)_transformer\."), r"\1_transformer.transformer."),
    (re.compile(r"^quantizer\.(rvq_first|rvq_rest)\.layers\.(\d+)\."), r"quantizer.\1.vq.layers.\2._codebook."),
)
_CODEBOOK_KEY = re.compile(r"^quantizer\.rvq_rest\.vq\.layers\.(\d+)\._codebook\.(.+)$")


def checkpoint_key(name: str) -> str:
    """The reference checkpoint key of one of our state-dict names."""
    for pattern, repl in _CHECKPOINT_RULES:
        if pattern.search(name):
            return pattern.sub(repl, name, count=1)
    return name


def _codebook_tensors(center: Tensor, spread: Tensor, bins: int, gen: torch.Generator) -> dict[str, Tensor]:
    usage = 0.5 + 1.5 * torch.rand(bins, generator=gen)
    centroids = center + spread * torch.randn(bins, center.shape[0], generator=gen)
    return {"_initialized": torch.ones(1), "cluster_usage": usage, "embedding_sum": centroids * usage[:, None]}


@torch.no_grad()
def random_mimi_state_dict(cfg: MimiConfig, seed: int) -> dict[str, Tensor]:
    """A random checkpoint in the reference key layout, all `n_q` quantizer levels included.

    Convs and linears get variance-preserving normal weights and nonzero biases; codebooks are random but
    scattered over the latents they quantize (so different audio gives different codes), with positive usage
    counts and `_initialized` = 1; the decoder's last conv is scaled so decoded audio has a std near 0.1.
    """
    gen = torch.Generator().manual_seed(seed)
    model = Mimi(cfg)

    def normal(t: Tensor, std: float) -> None:
        t.copy_(std * torch.randn(t.shape, generator=gen))

    for module in model.modules():
        if isinstance(module, nn.Conv1d):
            normal(module.weight, (module.in_channels // module.groups * module.kernel_size[0]) ** -0.5)
        elif isinstance(module, nn.ConvTranspose1d):
            taps = module.in_channels // module.groups * module.kernel_size[0] // module.stride[0]
            normal(module.weight, taps**-0.5)
        elif isinstance(module, nn.Linear):
            normal(module.weight, module.in_features**-0.5)
        elif isinstance(module, nn.LayerNorm):
            normal(module.weight, 0.1)
            module.weight.add_(1.0)
        elif isinstance(module, LayerScale):
            module.scale.copy_(0.1 + 0.2 * torch.rand(module.scale.shape, generator=gen))
        elif isinstance(module, Attention):
            normal(module.in_proj_weight, module.in_proj_weight.shape[1] ** -0.5)
        if isinstance(getattr(module, "bias", None), Tensor):
            normal(module.bias, 0.1)

    # Codebooks: centroids scattered around the projected latents of a short noise signal, at a fraction of their
    # spread, like a (much cruder) k-means initialisation.
    qcfg = cfg.quantizer
    noise = 0.1 * torch.randn(1, 4 * cfg.frame_samples, generator=gen)
    latent = model.encoder(noise[:, None])
    latent = model.downsample(model.encoder_transformer(latent.transpose(1, 2)).transpose(1, 2))
    halves = {"rvq_first": (model.quantizer.rvq_first, 1), "rvq_rest": (model.quantizer.rvq_rest, qcfg.n_q - 1)}
    codebooks: dict[str, Tensor] = {}
    for name, (rvq, levels) in halves.items():
        projected = rvq.input_proj(latent)[0]  # [dimension, T]
        center, spread = projected.mean(dim=1), 0.5 * projected.std(dim=1)
        for i in range(levels):
            # Only the first level sees the latent itself; later ones see residuals around zero.
            level_center = center if i == 0 else torch.zeros_like(center)
            for key, value in _codebook_tensors(level_center, spread, qcfg.bins, gen).items():
                codebooks[f"quantizer.{name}.vq.layers.{i}._codebook.{key}"] = value
    names = {checkpoint_key(k): k for k in model.state_dict()}
    model.load_state_dict({names[k]: v for k, v in codebooks.items() if k in names}, strict=False)

    codes = torch.randint(0, qcfg.bins, (1, cfg.num_codebooks, 4), generator=gen)
    audio_std = float(model.decode(codes).std())
    last = model.decoder.model[-1].conv
    last.weight.mul_(0.1 / audio_std)
    last.bias.mul_(0.1 / audio_std)

    out = {checkpoint_key(k): v.clone() for k, v in model.state_dict().items()}
    out.update(codebooks)
    return out


def load_mimi(
    path: Path | str, cfg: MimiConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Mimi:
    """Load a reference-layout Mimi safetensors file strictly (extra unused quantizer levels are allowed)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: Mimi checkpoint not found")
    model = Mimi(cfg)
    expected = {checkpoint_key(k): (k, v) for k, v in model.state_dict().items()}
    loaded: dict[str, Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for key, (_, ref) in expected.items():
                if key not in keys:
                    raise ValueError(f"{path}: missing key {key!r} (expected shape {list(ref.shape)})")
                loaded[key] = _checked(path, key, f.get_tensor(key), ref.shape)
            for key in sorted(keys - expected.keys()):
                match = _CODEBOOK_KEY.match(key)
                if match is None or int(match.group(1)) >= cfg.quantizer.n_q - 1:
                    raise ValueError(f"{path}: unexpected key {key!r}")
                ref = expected[f"quantizer.rvq_rest.vq.layers.0._codebook.{match.group(2)}"][1]
                _checked(path, key, f.get_tensor(key), ref.shape)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: cannot read safetensors file ({exc})") from exc
    model.load_state_dict({expected[k][0]: v for k, v in loaded.items()}, strict=True)
    model.to(device=device, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def _checked(path: Path, key: str, tensor: Tensor, shape: torch.Size) -> Tensor:
    if tensor.shape != shape:
        raise ValueError(f"{path}: key {key!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{path}: key {key!r} has dtype {tensor.dtype}, expected a floating-point tensor")
    return tensor


__all__ = ["Mimi", "MimiState", "StreamState", "checkpoint_key", "load_mimi", "random_mimi_state_dict"]
