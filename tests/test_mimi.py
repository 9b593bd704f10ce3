"""Mimi codec: streaming equals one-shot, one-shot equals `transformers.MimiModel`, per-row state, checkpoint I/O."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from model_fixtures import compiled_helpers
from safetensors.torch import save_file
from torch import Tensor

from model import fused
from model.config import FRAME_SAMPLES, TINY_MIMI, MimiConfig, MimiTransformerConfig, QuantizerConfig, SeanetConfig
from model.mimi import Mimi, MimiState, checkpoint_key, load_mimi, random_mimi_state_dict
from model.mimi_modules import (
    CausalConv1d,
    CausalConvTranspose1d,
    Codebook,
    ResidualBlock,
    SplitResidualVQ,
    advance_ring,
    bias_elu,
    bias_residual,
    rotate_into_ring,
    scale_add,
    scale_add_layer_norm,
)
from model.rope import apply_rope, rope_rotation

CFG = TINY_MIMI
K = CFG.num_codebooks
# The tiny transformers see 16 steps at 25 Hz, i.e. 8 frames: 14 frames run well past the window.
LONG = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Tensor]]:
    sd = random_mimi_state_dict(CFG, seed=0)
    path = tmp_path_factory.mktemp("mimi") / "tiny_mimi.safetensors"
    save_file(sd, str(path))
    return path, sd


@pytest.fixture(scope="module")
def mimi(ckpt: tuple[Path, dict[str, Tensor]]) -> Mimi:
    return load_mimi(ckpt[0], CFG)


def audio(batch: int, frames: int, seed: int) -> Tensor:
    """Noise plus a per-row chirp, so rows and frames all differ."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(frames * FRAME_SAMPLES) / CFG.sample_rate
    f0 = 100 + 400 * torch.rand(batch, 1, generator=gen)
    tone = 0.3 * torch.sin(2 * math.pi * f0 * t * (1 + t))
    return tone + 0.05 * torch.randn(batch, t.numel(), generator=gen)


def random_codes(batch: int, frames: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.quantizer.bins, (batch, K, frames), generator=gen)


def stream_encode(mimi: Mimi, state: MimiState, pcm: Tensor) -> Tensor:
    frames = pcm.split(FRAME_SAMPLES, dim=1)
    return torch.stack([mimi.encode_frame(f, state) for f in frames], dim=-1)


def stream_decode(mimi: Mimi, state: MimiState, codes: Tensor) -> Tensor:
    return torch.cat([mimi.decode_frame(codes[:, :, i], state) for i in range(codes.shape[-1])], dim=-1)


@pytest.mark.parametrize("frames", [8, LONG])
def test_streaming_equals_one_shot(mimi: Mimi, frames: int) -> None:
    pcm = audio(2, frames, seed=1)
    codes = mimi.encode(pcm)
    assert codes.shape == (2, K, frames) and codes.dtype == torch.long
    assert torch.equal(stream_encode(mimi, mimi.init_state(2, "cpu"), pcm), codes)

    out = mimi.decode(codes)
    assert out.shape == (2, frames * FRAME_SAMPLES)
    streamed = stream_decode(mimi, mimi.init_state(2, "cpu"), codes)
    torch.testing.assert_close(streamed, out, rtol=0, atol=1e-5)


# ---- transformers.MimiModel as an oracle ----

_HF_LAYER_NAMES = {
    "self_attn.out_proj.weight": "self_attn.o_proj.weight",
    "linear1.weight": "mlp.fc1.weight",
    "linear2.weight": "mlp.fc2.weight",
    "norm1.weight": "input_layernorm.weight",
    "norm1.bias": "input_layernorm.bias",
    "norm2.weight": "post_attention_layernorm.weight",
    "norm2.bias": "post_attention_layernorm.bias",
    "layer_scale_1.scale": "self_attn_layer_scale.scale",
    "layer_scale_2.scale": "mlp_layer_scale.scale",
}


def _rotate_half_rows(w: Tensor, heads: int) -> Tensor:
    """Reorder each head's q/k rows from interleaved pairs (2i, 2i+1) to halves (i, i + D/2)."""
    out_dim, in_dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(sd: dict[str, Tensor], heads: int) -> dict[str, Tensor]:
    """Reference (moshi) keys -> recent transformers `MimiModel` keys (spec 4.3; hf_mimi adapts them to older ones)."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        if m := re.fullmatch(r"(encoder|decoder)_transformer\.transformer\.layers\.(\d+)\.(.+)", key):
            half, layer, rest = m.groups()
            prefix = f"{half}.{half}_transformer.layers.{layer}."
            if rest == "self_attn.in_proj_weight":
                q, k, v = value.chunk(3)
                out[prefix + "self_attn.q_proj.weight"] = _rotate_half_rows(q, heads)
                out[prefix + "self_attn.k_proj.weight"] = _rotate_half_rows(k, heads)
                out[prefix + "self_attn.v_proj.weight"] = v
            else:
                out[prefix + _HF_LAYER_NAMES[rest]] = value
        elif m := re.fullmatch(r"(encoder|decoder)\.model\.(.+)", key):
            half, rest = m.groups()
            rest = rest.replace("conv.conv.", "conv.").replace("convtr.convtr.", "conv.")
            out[f"{half}.{half}_seanet.layers.{rest}"] = value
        elif key == "downsample.conv.conv.conv.weight":
            out["encoder.downsample.conv.weight"] = value
        elif key == "upsample.convtr.convtr.convtr.weight":
            out["decoder.upsample.conv.weight"] = value
        else:
            hf = key.replace("rvq_first.", "semantic_residual_vector_quantizer.")
            hf = hf.replace("rvq_rest.", "acoustic_residual_vector_quantizer.").replace(".vq.layers.", ".layers.")
            hf = hf.replace("._codebook.", ".codebook.").replace("_initialized", "initialized")
            out[hf.replace("embedding_sum", "embed_sum")] = value
    return out


def hf_mimi(cfg: MimiConfig, sd: dict[str, Tensor]):
    transformers = pytest.importorskip("transformers")
    s, q, t = cfg.seanet, cfg.quantizer, cfg.transformer
    hf_cfg = transformers.MimiConfig(
        sampling_rate=cfg.sample_rate,
        audio_channels=s.channels,
        hidden_size=s.dimension,
        num_filters=s.n_filters,
        num_residual_layers=s.n_residual_layers,
        upsampling_ratios=list(s.ratios),
        kernel_size=s.kernel_size,
        last_kernel_size=s.last_kernel_size,
        residual_kernel_size=s.residual_kernel_size,
        dilation_growth_rate=s.dilation_base,
        compress=s.compress,
        pad_mode=s.pad_mode,
        codebook_size=q.bins,
        codebook_dim=q.dimension,
        vector_quantization_hidden_dimension=q.dimension,
        num_quantizers=q.n_q,
        num_semantic_quantizers=1,
        upsample_groups=s.dimension,
        num_hidden_layers=t.num_layers,
        intermediate_size=t.dim_feedforward,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_heads,
        sliding_window=t.context,
        layer_scale_initial_scale=t.layer_scale,
        rope_parameters={"rope_type": "default", "rope_theta": t.max_period},
        norm_eps=1e-5,
        use_cache=False,
    )
    assert hf_cfg.frame_rate == cfg.frame_rate
    model = transformers.MimiModel(hf_cfg).eval()
    hf = to_hf(sd, t.num_heads)
    if "encoder.layers.0.conv.weight" in model.state_dict():  # earlier releases (5.17) kept these at the top
        hf = {_OLDER_HF_PREFIX.sub(lambda m: _OLDER_HF_NAMES[m.group(0)], key): value for key, value in hf.items()}
    model.load_state_dict(hf, strict=True)
    return model


# The 5.x layout's prefixes that earlier transformers releases named without the enclosing encoder/decoder.
_OLDER_HF_NAMES = {
    "encoder.encoder_seanet.": "encoder.", "encoder.encoder_transformer.": "encoder_transformer.",
    "encoder.downsample.": "downsample.", "decoder.decoder_seanet.": "decoder.",
    "decoder.decoder_transformer.": "decoder_transformer.", "decoder.upsample.": "upsample.",
}
_OLDER_HF_PREFIX = re.compile("^(" + "|".join(re.escape(k) for k in _OLDER_HF_NAMES) + ")")


def test_one_shot_matches_transformers(mimi: Mimi, ckpt: tuple[Path, dict[str, Tensor]]) -> None:
    """Our one-shot encode/decode against `transformers.MimiModel` on the same weights, past the attention window.

    By design HF applies RoPE by rotate-half (hence the q/k row permutation in `to_hf`) and computes its
    frequencies as base ** (-2i / D) rather than exp(-2i / D * log base); the last bits differ, so the codes must
    match exactly but the audio only to a tolerance. HF has no streaming decode, so only one-shot is compared.
    """
    hf = hf_mimi(CFG, ckpt[1])
    pcm = audio(2, LONG, seed=2)
    with torch.no_grad():
        hf_codes = hf.encode(pcm[:, None], num_quantizers=K).audio_codes
        codes = mimi.encode(pcm)
        assert torch.equal(codes, hf_codes)
        hf_out = hf.decode(codes).audio_values[:, 0]
    out = mimi.decode(codes)
    assert out.abs().max() > 0.05
    torch.testing.assert_close(out, hf_out, rtol=0, atol=1e-5)


# ---- per-row state ----


def test_reset_rows_gives_fresh_rows_and_leaves_others(mimi: Mimi) -> None:
    b, before, after = 3, 5, 4
    pcm_a, pcm_b = audio(b, before, seed=3), audio(b, after, seed=4)
    codes_a, codes_b = random_codes(b, before, seed=5), random_codes(b, after, seed=6)
    rows = torch.tensor([False, True, False])

    state = mimi.init_state(b, "cpu")
    stream_encode(mimi, state, pcm_a)
    stream_decode(mimi, state, codes_a)
    mimi.reset_rows(state, rows)
    enc = stream_encode(mimi, state, pcm_b)
    dec = stream_decode(mimi, state, codes_b)

    fresh = mimi.init_state(b, "cpu")
    assert torch.equal(enc[1], stream_encode(mimi, fresh, pcm_b)[1])
    assert torch.equal(dec[1], stream_decode(mimi, fresh, codes_b)[1])

    kept = mimi.init_state(b, "cpu")
    stream_encode(mimi, kept, pcm_a)
    stream_decode(mimi, kept, codes_a)
    cont_enc, cont_dec = stream_encode(mimi, kept, pcm_b), stream_decode(mimi, kept, codes_b)
    assert torch.equal(enc[[0, 2]], cont_enc[[0, 2]])
    assert torch.equal(dec[[0, 2]], cont_dec[[0, 2]])
    # The reset row's new stream really depends on the reset: without it the outputs differ.
    assert not torch.equal(dec[1], cont_dec[1])


def test_rows_are_independent(mimi: Mimi) -> None:
    pcm = audio(3, 6, seed=7)
    other = pcm.clone()
    other[[0, 2]] = audio(2, 6, seed=8)
    codes = random_codes(3, 6, seed=9)
    other_codes = codes.clone()
    other_codes[[0, 2]] = random_codes(2, 6, seed=10)

    enc = stream_encode(mimi, mimi.init_state(3, "cpu"), pcm)
    enc_other = stream_encode(mimi, mimi.init_state(3, "cpu"), other)
    assert torch.equal(enc[1], enc_other[1])
    assert not torch.equal(enc[0], enc_other[0])
    dec = stream_decode(mimi, mimi.init_state(3, "cpu"), codes)
    dec_other = stream_decode(mimi, mimi.init_state(3, "cpu"), other_codes)
    assert torch.equal(dec[1], dec_other[1])


def test_bad_streaming_inputs_are_rejected(mimi: Mimi) -> None:
    state = mimi.init_state(2, "cpu")
    with pytest.raises(ValueError, match=r"pcm must be \[2, 1920\]"):
        mimi.encode_frame(torch.zeros(2, 960), state)
    with pytest.raises(ValueError, match="codes must be long"):
        mimi.decode_frame(torch.zeros(2, K - 1, dtype=torch.long), state)
    with pytest.raises(ValueError, match="bool mask"):
        mimi.reset_rows(state, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"pcm must be \[B, T \* 1920\]"):
        mimi.encode(torch.zeros(1, 1000))
    bins = CFG.quantizer.bins
    with pytest.raises(ValueError, match=rf"codes must lie in \[0, {bins}\)"):
        mimi.decode(torch.full((1, K, 2), bins))


# ---- codes carry information ----


def test_different_audio_gives_different_codes(mimi: Mimi) -> None:
    t = torch.arange(LONG * FRAME_SAMPLES) / CFG.sample_rate
    pcm = torch.stack(
        [
            torch.zeros_like(t),
            0.5 * torch.sin(2 * math.pi * 440 * t),
            0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(11)),
        ]
    )
    codes = mimi.encode(pcm)
    for i in range(3):
        for j in range(i):
            assert (codes[i] != codes[j]).float().mean() > 0.5
    # Every level uses many centroids over noise and sine frames (random codebooks, not a degenerate one).
    for level in range(K):
        assert codes[1:, level].unique().numel() >= 6
    out = mimi.decode(codes)
    assert torch.isfinite(out).all()
    assert 0.01 < float(out.std()) < 1.0


# ---- checkpoint layout and loading ----


def test_checkpoint_layout_matches_reference() -> None:
    """Full-size layout (meta tensors, no memory): 318 tensors, 96.15M values, with the reference key names."""
    full = MimiConfig()
    with torch.device("meta"):
        model = Mimi(full)
    sd = {checkpoint_key(k): v for k, v in model.state_dict().items()}
    extra_levels = full.quantizer.n_q - full.num_codebooks
    per_level = full.quantizer.bins * full.quantizer.dimension + full.quantizer.bins + 1
    assert len(sd) + 3 * extra_levels == 318
    assert sum(v.numel() for v in sd.values()) + extra_levels * per_level == 96_151_393
    shapes = {
        "encoder.model.0.conv.conv.weight": [64, 1, 7],
        "encoder.model.1.block.1.conv.conv.weight": [32, 64, 3],
        "encoder.model.14.conv.conv.weight": [512, 1024, 3],
        "decoder.model.2.convtr.convtr.weight": [1024, 512, 16],
        "decoder.model.12.block.3.conv.conv.bias": [64],
        "encoder_transformer.transformer.layers.7.self_attn.in_proj_weight": [1536, 512],
        "decoder_transformer.transformer.layers.0.layer_scale_2.scale": [512],
        "decoder_transformer.transformer.layers.0.norm1.bias": [512],
        "downsample.conv.conv.conv.weight": [512, 512, 4],
        "upsample.convtr.convtr.convtr.weight": [512, 1, 4],
        "quantizer.rvq_first.input_proj.weight": [256, 512, 1],
        "quantizer.rvq_rest.output_proj.weight": [512, 256, 1],
        "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum": [2048, 256],
        "quantizer.rvq_rest.vq.layers.6._codebook.cluster_usage": [2048],
    }
    assert {k: list(sd[k].shape) for k in shapes} == shapes


def test_random_checkpoint_round_trip(tmp_path: Path) -> None:
    cfg = dataclasses.replace(CFG, quantizer=dataclasses.replace(CFG.quantizer, n_q=12))
    sd = random_mimi_state_dict(cfg, seed=3)
    assert "quantizer.rvq_rest.vq.layers.10._codebook.embedding_sum" in sd  # all n_q levels, 4 unused
    assert torch.equal(sd["quantizer.rvq_rest.vq.layers.0._codebook._initialized"], torch.ones(1))
    assert (sd["quantizer.rvq_rest.vq.layers.0._codebook.cluster_usage"] > 0).all()
    assert random_mimi_state_dict(cfg, seed=3).keys() == sd.keys()
    assert torch.equal(
        random_mimi_state_dict(cfg, seed=3)["encoder.model.0.conv.conv.weight"], sd["encoder.model.0.conv.conv.weight"]
    )
    path = tmp_path / "mimi.safetensors"
    save_file(sd, str(path))
    model = load_mimi(path, cfg)
    loaded = {checkpoint_key(k): v for k, v in model.state_dict().items()}
    assert loaded.keys() <= sd.keys()
    for key, value in loaded.items():
        assert torch.equal(value, sd[key]), key
    assert not model.training
    assert model.encode(audio(1, 2, seed=12)).shape == (1, K, 2)
    # Each codebook's centroids, computed once as its sums loaded, are the sums over the usage (floored at eps).
    codebook = model.quantizer.rvq_rest.layers[3]
    usage = sd["quantizer.rvq_rest.vq.layers.3._codebook.cluster_usage"]
    want = sd["quantizer.rvq_rest.vq.layers.3._codebook.embedding_sum"] / usage.clamp(min=1e-5)[:, None]
    assert torch.equal(codebook.centroids, want) and "centroids" not in "".join(model.state_dict())
    codebook.load_state_dict({**codebook.state_dict(), "cluster_usage": 2 * usage})
    assert torch.equal(codebook.centroids, codebook.embedding_sum / (2 * usage).clamp(min=1e-5)[:, None])


def test_small_structure_has_reference_key_count() -> None:
    cfg = MimiConfig(
        seanet=SeanetConfig(dimension=16, n_filters=4),
        quantizer=QuantizerConfig(dimension=8, n_q=32, bins=16, input_dimension=16, output_dimension=16),
        transformer=MimiTransformerConfig(d_model=16, num_heads=2, num_layers=8, dim_feedforward=32, context=8),
    )
    assert len(random_mimi_state_dict(cfg, seed=0)) == 318


def _write(path: Path, sd: dict[str, Tensor]) -> Path:
    save_file(sd, str(path))
    return path


def test_load_errors(tmp_path: Path, ckpt: tuple[Path, dict[str, Tensor]]) -> None:
    sd = ckpt[1]
    key = "decoder_transformer.transformer.layers.1.linear1.weight"

    missing = _write(tmp_path / "missing.safetensors", {k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match="missing key") as err:
        load_mimi(missing, CFG)
    assert "missing.safetensors" in str(err.value) and key in str(err.value) and "[64, 32]" in str(err.value)

    shaped = _write(tmp_path / "shape.safetensors", {**sd, key: torch.zeros(64, 31)})
    with pytest.raises(ValueError, match=r"has shape \[64, 31\], expected \[64, 32\]") as err:
        load_mimi(shaped, CFG)
    assert "shape.safetensors" in str(err.value) and key in str(err.value)

    ints = _write(tmp_path / "ints.safetensors", {**sd, key: torch.zeros(64, 32, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"dtype torch.int32, expected a floating-point tensor") as err:
        load_mimi(ints, CFG)
    assert "ints.safetensors" in str(err.value) and key in str(err.value)

    extra = "quantizer.rvq_first.vq.layers.1._codebook.embedding_sum"
    unexpected = _write(tmp_path / "extra.safetensors", {**sd, extra: sd[extra.replace(".1.", ".0.")].clone()})
    with pytest.raises(ValueError, match=f"unexpected key '{re.escape(extra)}'"):
        load_mimi(unexpected, CFG)

    with pytest.raises(ValueError, match="Mimi checkpoint not found") as err:
        load_mimi(tmp_path / "nope.safetensors", CFG)
    assert "nope.safetensors" in str(err.value)

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        load_mimi(garbage, CFG)


@pytest.mark.parametrize("groups", [1, 6])
def test_transposed_conv_step_equals_conv_transpose(groups: int) -> None:
    """The streaming step's GEMM (dense) or product (depthwise) plus overlap-add is nn.ConvTranspose1d, chunk by
    chunk, with the bias counted once."""
    torch.manual_seed(0)
    layer = CausalConvTranspose1d(6, 6 if groups > 1 else 4, kernel_size=8, stride=4, groups=groups)
    x = torch.randn(3, 6, 7)
    want = layer(x)
    channels, samples, _ = layer.buffer_shapes(4)[0]
    tail = torch.zeros(3, channels, samples)
    chunks = [layer.step(part, iter([tail])) for part in x.split([1, 2, 4], dim=-1)]
    torch.testing.assert_close(torch.cat(chunks, dim=-1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad_mode", ["constant", "replicate"])
def test_strided_conv_gemm_equals_conv1d(pad_mode: str) -> None:
    """A strided convolution's streaming GEMM over input windows, chunk by chunk, is nn.Conv1d on the left-padded
    input in one shot (replicate padding repeats each row's first sample)."""
    torch.manual_seed(1)
    layer = CausalConv1d(6, 5, kernel_size=8, stride=4, pad_mode=pad_mode)
    x = torch.randn(3, 6, 40)
    want = layer.conv(torch.nn.functional.pad(x, (layer.context, 0), mode=pad_mode))
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    channels, samples, _ = layer.buffer_shapes(24)[0]
    buf = torch.zeros(3, channels, samples)
    first = torch.ones(3, dtype=torch.bool)
    chunks = []
    for part in x.split([4, 12, 24], dim=-1):
        chunks.append(layer.step(part, iter([buf]), first))
        first = torch.zeros(3, dtype=torch.bool)
    torch.testing.assert_close(torch.cat(chunks, dim=-1), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="dilated"):
        CausalConv1d(6, 5, kernel_size=3, stride=2, dilation=2)


def test_conv_window_streams_steps_of_any_length_up_to_its_own_through_the_elu_before_it() -> None:
    """A streaming convolution's state is its whole input window: steps shorter than its kept context (the kept
    samples overlap the new ones), as long as the window, and the ELU before it written into the window all give
    nn.Conv1d on the left-padded ELU'd input in one shot; a step longer than the window is refused."""
    torch.manual_seed(2)
    layer = CausalConv1d(4, 3, kernel_size=3, dilation=3)  # context 6
    elu = torch.nn.ELU()
    x = torch.randn(2, 4, 19)
    want = layer(elu(x))
    channels, samples, carried = layer.buffer_shapes(8)[0]
    assert (channels, samples, carried) == (4, 14, 6)
    window = torch.zeros(2, channels, samples)
    chunks = [layer.step(part, iter([window]), activation=elu) for part in x.split([1, 2, 8, 8], dim=-1)]
    torch.testing.assert_close(torch.cat(chunks, dim=-1), want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="longer than the window holds"):
        layer.step(torch.randn(2, 4, 9), iter([window]))


def test_transposed_conv_rejects_shapes_it_cannot_stream() -> None:
    with pytest.raises(ValueError, match="multiple of stride"):
        CausalConvTranspose1d(4, 4, kernel_size=6, stride=4)
    with pytest.raises(ValueError, match="dense or depthwise"):
        CausalConvTranspose1d(4, 4, kernel_size=8, stride=4, groups=2)


def test_fused_residual_helpers_compile_to_what_eager_computes() -> None:
    """The GPU compiles the transformer's residual helpers with Inductor: they trace whole, for any batch and
    length, and equal the eager arithmetic."""
    add_norm = torch.compile(scale_add_layer_norm.__wrapped__, fullgraph=True, dynamic=True)
    add = torch.compile(scale_add.__wrapped__, fullgraph=True, dynamic=True)
    scale, weight, bias = torch.rand(16), torch.rand(16) + 0.5, torch.randn(16)
    for shape in ((3, 1, 16), (2, 5, 16)):
        x, delta = torch.randn(shape), torch.randn(shape)
        total, normed = add_norm(x, delta, scale, weight, bias, 1e-5)
        torch.testing.assert_close(total, x + scale * delta, rtol=1e-6, atol=1e-6)
        want = torch.nn.functional.layer_norm(x + scale * delta, (16,), weight, bias, 1e-5)
        torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(add(x, delta, scale), x + scale * delta, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_codebooks_nearest_centroid_is_cdists_value_for_value(device: str, compiled: bool) -> None:
    """The codebook keeps cdist's product form with the centroids' side built once: the same distances bit for bit,
    so the same codes, ties included, at any rows; built again where the codebook moves (a sum rounds by device).
    Compiled (as the engine runs it on CUDA) its glue is two passes, with the same codes."""
    torch.manual_seed(4)
    codebook = Codebook(2048, 256)
    codebook.embedding_sum.normal_()
    codebook.cluster_usage.uniform_(0.5, 3.0)
    codebook.update_centroids()
    codebook.to(device)
    twins = codebook.centroids[:4].repeat(2, 1)  # rows at a centroid: distance 0 there, clamped, the first index kept
    near = codebook.centroids[100:300] + 1e-4 * torch.randn(200, 256, device=device)
    if compiled:
        fused.enable()
    try:
        for x in [torch.randn(rows, 256, device=device) for rows in (1, 3, 250)] + [twins, near]:
            want = torch.cdist(x[None], codebook.centroids[None], p=2)[0].argmin(dim=-1)
            assert torch.equal(codebook.encode(x), want)
            assert torch.equal(codebook.encode(x, x.pow(2)), want)
        assert not fused.fallen_back()
    finally:
        fused.disable()
    norm = codebook.centroids.pow(2).sum(-1)
    assert torch.equal(codebook.augmented[0, :, -1], norm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_the_quantizers_compiled_glue_gives_every_code_and_latent_of_its_eager_path(device: str) -> None:
    """The split quantizer with its glue compiled (the residual's next level with its squares, the levels' centroid
    sum): the same codes and the same decoded latent, bit for bit, at one row and 250, one frame and several; and
    its eager path is the levels' own residual quantization (each level's code is the nearest to what the levels
    before it left)."""
    torch.manual_seed(5)
    cfg = QuantizerConfig(dimension=32, input_dimension=24, output_dimension=24, bins=64)
    quantizer = SplitResidualVQ(cfg, num_codebooks=5)
    for codebook in [*quantizer.rvq_first.layers, *quantizer.rvq_rest.layers]:
        codebook.embedding_sum.normal_()
        codebook.update_centroids()
    quantizer.to(device)
    with torch.no_grad():
        for rows, frames in ((1, 1), (250, 1), (3, 4)):
            x = torch.randn(rows, 24, frames, device=device)
            codes = quantizer.encode(x)
            latent = quantizer.decode(codes)
            residual = quantizer.rvq_rest.input_proj(x).transpose(1, 2).reshape(rows * frames, 32)
            for level, codebook in enumerate(quantizer.rvq_rest.layers):
                want = torch.cdist(residual[None], codebook.centroids[None])[0].argmin(dim=-1)
                assert torch.equal(codes[:, 1 + level].reshape(-1), want)
                residual = residual - codebook.centroids[want]
            fused.enable()
            try:
                assert torch.equal(quantizer.encode(x), codes)
                assert torch.equal(quantizer.decode(codes), latent)
                assert torch.equal(quantizer.decode(codes[:, :3]), quantizer.rvq_first.decode(codes[:, :1])
                                   + quantizer.rvq_rest.decode(codes[:, 1:3]))
                assert not fused.fallen_back()
            finally:
                fused.disable()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_the_transformers_rotation_and_ring_writes_as_one_pass_leave_what_the_three_left(device: str) -> None:
    """A streaming layer's rotation of q and k and its ring writes of k and v, compiled as one helper, give the
    rotated queries and leave the rings (a layer's view of the cache, and a row view inside it) exactly as the
    compiled rotation and torch's two scatters did: float32 (the encoder) and bf16 (the decoder), one row and 250,
    one step and three, ring slots wrapping."""
    g = torch.Generator().manual_seed(3)
    heads, slots, dim = 8, 256, 64
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, steps in ((1, 1), (250, 1), (3, 3)):
            qkv = torch.randn(3, rows, heads, steps, dim, generator=g).to(device, dtype)
            positions = torch.randint(0, 3 * slots, (rows, 1), generator=g).to(device) + torch.arange(steps,
                                                                                                      device=device)
            rope = rope_rotation(positions[:, None], dim, 10_000.0)
            cache = torch.randn(2, 2, rows + 1, heads, slots, dim, generator=g).to(device, dtype)  # [k|v, layer, ...]
            cases.append((qkv, rope, cache, positions % slots))

    def before(qkv, rope, keys, values, at):
        q, k = apply_rope(qkv[:2], rope).unbind(0)
        index = at[:, None, :, None].expand(*k.shape)
        keys.scatter_(2, index, k)
        values.scatter_(2, index, qkv[2])
        return q

    with compiled_helpers():
        for qkv, rope, cache, at in cases:
            rows = qkv.shape[1]
            for view in (slice(0, rows), slice(1, rows + 1)):  # the layer's rows, and rows inside a larger cache
                want, got = cache.clone(), cache.clone()
                q_want = before(qkv, rope, want[0, 1, view], want[1, 1, view], at)
                q_got = rotate_into_ring(qkv, rope, got[0, 1, view], got[1, 1, view], at)
                assert torch.equal(q_got, q_want) and torch.equal(got, want), (qkv.dtype, rows, view)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_the_transformers_ring_bookkeeping_compiled_leaves_every_position_slot_and_mask_of_its_eager_path(
        device: str) -> None:
    """A streaming step's positions, ring slots, key mask and the counters it moves, compiled as the engine runs
    it, against eager: fresh rows (empty slots) and rows long past the ring's wrap, one row and 250, one step and
    three, and a row view inside a larger cache."""
    g = torch.Generator().manual_seed(4)
    slots, context = 256, 250
    cases = []
    for rows, steps in ((1, 1), (250, 1), (5, 3)):
        pos = torch.randint(0, 4 * slots, (rows + 2,), generator=g)
        pos[::3] = torch.randint(0, 3, pos[::3].shape, generator=g)  # rows near their start: most slots empty
        key_pos = pos[:, None] - 1 - torch.arange(slots)              # each row's past positions, newest first
        key_pos = torch.where(key_pos >= 0, key_pos, -1).roll(1, dims=1)
        cases.append((pos.to(device), key_pos.to(device), steps, rows))

    def run(pos, key_pos, steps, rows):
        pos, key_pos = pos.clone(), key_pos.clone()
        return [*advance_ring(pos[1:rows + 1], key_pos[1:rows + 1], steps, context), pos, key_pos]

    want = [run(*case) for case in cases]
    with compiled_helpers():
        got = [run(*case) for case in cases]
    for case, a, b in zip(cases, want, got, strict=True):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), (case[3], case[2], k)
        pos, steps, rows = case[0], case[2], case[3]
        assert torch.equal(a[3][1:rows + 1], pos[1:rows + 1] + steps)  # the rows moved on, those outside stayed
        assert torch.equal(a[3][0], pos[0]) and torch.equal(a[4][0], case[1][0])


def test_the_residual_units_bias_helpers_compile_whole_for_any_rows_and_layout() -> None:
    """The SEANet residual unit's bias helpers (used on cuDNN) trace whole for any rows and for an input with its
    channels fastest (a strided convolution's GEMM gives one), and compute the eager arithmetic."""
    elu_after_bias = torch.compile(bias_elu.__wrapped__, fullgraph=True, dynamic=True)
    skip_after_bias = torch.compile(bias_residual.__wrapped__, fullgraph=True, dynamic=True)
    bias = torch.randn(6)
    for y, x in ((torch.randn(1, 6, 8), torch.randn(1, 6, 8)), (torch.randn(3, 6, 5), torch.randn(3, 5, 6).mT)):
        torch.testing.assert_close(elu_after_bias(y, bias, 1.0), torch.nn.functional.elu(y + bias[:, None]),
                                   rtol=1e-6, atol=1e-6)
        total = skip_after_bias(y, bias, x)
        torch.testing.assert_close(total, x + (y + bias[:, None]), rtol=0, atol=0)
        assert total.is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN only")
@pytest.mark.parametrize("channels_fastest", [False, True])
def test_a_residual_unit_on_cudnn_adds_its_biases_in_the_passes_after_bit_for_bit(channels_fastest: bool) -> None:
    """On cuDNN in float32 a residual unit's step adds each convolution's bias in the pass after it (the hidden
    ELU, the skip), eager and compiled: every value and its window as torch's own modules compute them, at the
    encoder's first unit's 250-row shape (and its input as a strided convolution's GEMM leaves it)."""
    torch.manual_seed(3)
    unit = ResidualBlock(64, 32, kernel_size=3, dilation=1).cuda()
    x = torch.randn(250, 1920, 64, device="cuda").mT if channels_fastest else torch.randn(250, 64, 1920, device="cuda")
    kept = torch.randn(250, 64, 2, device="cuda")
    conv, conv_1x1 = unit.block[1].conv, unit.block[3].conv
    with torch.no_grad():
        window_want = torch.cat([kept, torch.nn.functional.elu(x)], dim=-1)
        want = x + conv_1x1(torch.nn.functional.elu(conv(window_want)))
        for compiled in (False, True):
            window = torch.cat([kept, torch.zeros_like(x)], dim=-1)
            if compiled:
                fused.enable()
            try:
                got = unit.step(x, iter([window]))
            finally:
                fused.disable()
            assert torch.equal(got, want), f"compiled={compiled}: {(got - want).abs().max().item()}"
            assert got.is_contiguous()
            assert torch.equal(window[..., :2], window_want[..., -2:])


def test_a_side_in_bf16_streams_near_float32_and_leaves_the_codec_as_it_was(mimi: Mimi) -> None:
    """`with_precision`: the sides asked for in bf16, weights and streaming state, the quantizer in float32, the
    codec it came from untouched; the bf16 decoder's audio ~40 dB from float32's on the same codes, and the bf16
    encoder's codes mostly the same (each level's nearest centroid sits near others: bf16 moves some)."""
    assert mimi.with_precision(torch.float32, torch.float32) is mimi
    half = mimi.with_precision(torch.bfloat16, torch.bfloat16)
    assert (half.encoder_dtype, half.decoder_dtype, mimi.encoder_dtype, mimi.decoder_dtype) == (
        torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    assert all(t.dtype == torch.float32 for t in [*half.quantizer.parameters(), *half.quantizer.buffers()])
    state = half.init_state(2, "cpu")
    for stream in (state.encoder, state.decoder):
        assert all(t.dtype == torch.bfloat16 for t in [*stream.convs, stream.kv.keys, stream.kv.values])
    pcm = audio(2, LONG, seed=5)
    codes = stream_encode(mimi, mimi.init_state(2, "cpu"), pcm)
    assert (stream_encode(half, state, pcm) == codes).float().mean() > 0.6
    want = stream_decode(mimi, mimi.init_state(2, "cpu"), codes)
    got = stream_decode(half, half.init_state(2, "cpu"), codes)
    assert got.dtype == torch.float32
    assert 10 * math.log10(float(want.square().sum() / (got - want).square().sum())) > 30
