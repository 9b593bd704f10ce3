"""Mimi's Triton kernels against the torch ops they replace: on CUDA as the engine runs them, and on a machine
without CUDA through Triton's interpreter (tests/conftest.py sets it), so CI checks them too."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from model.config import FRAME_SAMPLES, TINY_MIMI, MimiConfig
from model.mimi import Mimi
from model.mimi_modules import CausalConv1d, CausalConvTranspose1d, ResidualBlock
from model.random_model import random_mimi
from model.seanet_kernels import (
    fused_residual_step,
    fused_strided_step,
    fused_thin_step,
    fused_transposed_step,
    taps_first,
    transposed_taps,
)
from model.stream_kernels import (
    StreamBuffers,
    overlap_add_reference,
    overlap_add_triton,
    reset_idle_reference,
    reset_idle_triton,
)

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ROWS = 64 if CUDA else 2  # the interpreter runs each program in numpy
# Triton's interpreter does bf16 its own way (its conversions from fp32 truncate, its bf16 products are wrong):
# bf16 is checked on CUDA.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 is checked on CUDA"))
# A fused step's largest difference from the torch path's, of the output's largest magnitude: both paths' products
# take TF32 or bf16 inputs on CUDA, in other orders; the interpreter's are fp32.
TOLERANCE = {torch.float32: 5e-3 if CUDA else 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(("channels", "frames", "kernel", "stride", "depthwise"),
                         [(512, 2, 4, 2, True), (512, 2, 16, 8, False), (64, 240, 8, 4, False)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_overlap_add_kernel_equals_reference(channels, frames, kernel, stride, depthwise, dtype) -> None:
    """Shapes of Mimi's streaming transposed convolutions (the dense taps strided as the GEMM leaves them), float32
    and bf16 (summed in float32): output and kept tail equal the torch ops' bit for bit, with and without a bias.
    Interpreted, 16 channels: each program is one row's channel, and the interpreter's take ~10 ms each."""
    channels = channels if CUDA else 16
    taps = torch.randn(ROWS, channels, frames, kernel, device=DEVICE, dtype=dtype) if depthwise else torch.randn(
        ROWS, frames, channels, kernel, device=DEVICE, dtype=dtype).transpose(1, 2)
    for bias in (torch.randn(channels, device=DEVICE, dtype=dtype), None):
        tail = torch.randn(ROWS, channels, kernel - stride, device=DEVICE, dtype=dtype)
        tails = [tail.clone(), tail.clone()]
        got = overlap_add_triton(taps, tails[0], bias, stride)
        want = overlap_add_reference(taps, tails[1], bias, stride)
        assert torch.equal(got, want) and torch.equal(tails[0], tails[1])


@pytest.mark.parametrize("channels", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@torch.no_grad()
def test_a_fused_residual_step_computes_the_units_steps(channels, dtype) -> None:
    """Steps of several lengths (the last tile partial; one as short as the kept context) and layouts through the
    fused unit and the torch path, each with its own state: the same outputs within the products' precision (fp32
    in the interpreter, TF32 or bf16 inputs on CUDA) and the same kept context after every step."""
    torch.manual_seed(channels)
    unit = ResidualBlock(channels, channels // 2, 3, 1).to(DEVICE, dtype)
    conv, conv_1x1 = unit.block[1], unit.block[3]
    shapes = unit.buffer_shapes(200)
    assert [kept for _, _, kept in shapes] == [2]
    windows = [torch.zeros(ROWS, c, n, device=DEVICE, dtype=dtype) for c, n, _ in shapes]
    fused_window = windows[0].clone()
    taps = taps_first(conv.conv.weight)
    tolerance = TOLERANCE[dtype]
    for length, channels_inner in ((130, False), (64, True), (2, False), (200, True)):
        # Time contiguous, or channels (as the encoder's strided convolution leaves its product).
        x = 2 * torch.randn(ROWS, channels, length, device=DEVICE, dtype=dtype)
        x = x.transpose(1, 2).contiguous().transpose(1, 2) if channels_inner else x
        want = unit.step(x, iter(windows)).float()
        got = fused_residual_step(x, fused_window, conv.conv, taps, conv_1x1.conv, 1.0, 1.0).float()
        assert (got - want).abs().max() <= tolerance * want.abs().max(), length
        torch.testing.assert_close(fused_window[..., :2], windows[0][..., :2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("channels_in", "channels_out", "kernel", "stride"),
                         [(64, 128, 8, 4), (128, 256, 10, 5), (1, 64, 7, 1), (64, 1, 3, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@torch.no_grad()
def test_a_fused_convolution_step_computes_the_convolutions_steps(channels_in, channels_out, kernel, stride,
                                                                   dtype) -> None:
    """The encoder's first two downsampling convolutions, its first and the decoder's last (from and to audio),
    steps of several lengths (one as short as the kept context), both layouts, with the ELU before them and
    without, fused and through the torch path with their own state: the same outputs within the products'
    precision and the same kept context after every step."""
    torch.manual_seed(kernel)
    conv = CausalConv1d(channels_in, channels_out, kernel, stride=stride).to(DEVICE, dtype)
    fused_step = fused_strided_step if stride > 1 else fused_thin_step
    context = kernel - stride
    (shape,) = conv.buffer_shapes(40 * stride)
    window = torch.zeros(ROWS, *shape[:2], device=DEVICE, dtype=dtype)
    fused_window = window.clone()
    taps = taps_first(conv.conv.weight)
    shortest = -(-context // stride)  # frames
    for frames, channels_inner, elu in ((40, False, True), (7, True, True), (shortest, False, False), (33, True, True)):
        x = 2 * torch.randn(ROWS, channels_in, frames * stride, device=DEVICE, dtype=dtype)
        x = x.transpose(1, 2).contiguous().transpose(1, 2) if channels_inner else x
        activation = torch.nn.ELU() if elu else None
        want = conv.step(x, iter([window]), activation=activation).float()
        got = fused_step(x, fused_window, conv.conv, taps, None if activation is None else activation.alpha)
        assert got.is_contiguous() and got.shape == want.shape
        assert (got.float() - want).abs().max() <= TOLERANCE[dtype] * want.abs().max(), frames
        torch.testing.assert_close(fused_window[..., :context], window[..., :context], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("channels", "kernel", "stride"), [(128, 8, 4), (256, 10, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@torch.no_grad()
def test_a_fused_transposed_step_computes_the_convolutions_steps(channels, kernel, stride, dtype) -> None:
    """The decoder's last two upsampling convolutions (with the ELU before them, and one without), steps of several
    lengths (one as short as the overlap allows) and both layouts, fused and through the torch path (taps and
    overlap-add) with their own tails: the same outputs and tails within the product's precision."""
    torch.manual_seed(kernel)
    convtr = CausalConvTranspose1d(channels, channels // 2, kernel, stride).to(DEVICE, dtype)
    elu = torch.nn.ELU()
    (shape,) = convtr.buffer_shapes(40)
    tail = torch.zeros(ROWS, *shape[:2], device=DEVICE, dtype=dtype)
    fused_tail = tail.clone()
    taps = transposed_taps(convtr.convtr.weight)
    tolerance = TOLERANCE[dtype]
    for frames, channels_inner, activation in ((40, False, elu), (3, True, elu), (1, False, None), (33, True, elu)):
        x = 2 * torch.randn(ROWS, channels, frames, device=DEVICE, dtype=dtype)
        x = x.transpose(1, 2).contiguous().transpose(1, 2) if channels_inner else x
        want = convtr.step(x, iter([tail]), activation=activation).float()
        alpha = None if activation is None else activation.alpha
        got = fused_transposed_step(x, fused_tail, convtr.convtr, taps, alpha)
        assert got.is_contiguous() and got.shape == want.shape
        assert (got.float() - want).abs().max() <= tolerance * want.abs().max(), frames
        assert (fused_tail.float() - tail.float()).abs().max() <= tolerance * want.abs().max(), frames


def test_only_the_steps_the_kernels_take_are_fused() -> None:
    """Full-size Mimi: the residual units of the encoder's first two stages (64 and 128 channels) and the decoder's
    last two, the encoder's first two downsampling convolutions and the decoder's last two upsampling ones, the
    convolutions from and to audio; the wider ones keep the torch path, as does every part that a choice leaves
    out or a side left out (encoder or decoder); the codec itself is left as it was."""
    mimi = random_mimi(MimiConfig(), "cpu")

    def fused(codec, name: str) -> list[tuple[str, int, bool]]:
        def width(layer) -> int:
            conv = layer.block[1] if isinstance(layer, ResidualBlock) else layer
            return (conv.convtr if isinstance(conv, CausalConvTranspose1d) else conv.conv).in_channels

        return [(type(layer).__name__, width(layer), layer.fused) for layer in getattr(codec, name).model
                if isinstance(layer, (ResidualBlock, CausalConv1d, CausalConvTranspose1d))]

    both = mimi.with_fused_seanet()
    assert fused(both, "encoder") == [
        ("CausalConv1d", 1, True), ("ResidualBlock", 64, True), ("CausalConv1d", 64, True),
        ("ResidualBlock", 128, True), ("CausalConv1d", 128, True), ("ResidualBlock", 256, False),
        ("CausalConv1d", 256, False), ("ResidualBlock", 512, False), ("CausalConv1d", 512, False),
        ("CausalConv1d", 1024, False)]
    assert [(kind, width) for kind, width, on in fused(both, "decoder") if on] == [
        ("CausalConvTranspose1d", 256), ("ResidualBlock", 128), ("CausalConvTranspose1d", 128), ("ResidualBlock", 64),
        ("CausalConv1d", 64)]

    def choice(layer) -> str:  # which of with_fused_seanet's choices a layer falls under
        if isinstance(layer, ResidualBlock):
            return "residual"
        return "strided" if isinstance(layer, CausalConvTranspose1d) or layer.conv.stride[0] > 1 else "ends"

    for chosen in ("residual", "strided", "ends"):
        one = mimi.with_fused_seanet(**{part: part == chosen for part in ("residual", "strided", "ends")})
        for part in ("encoder", "decoder"):
            layers = [layer for layer in getattr(both, part).model
                      if isinstance(layer, (ResidualBlock, CausalConv1d, CausalConvTranspose1d))]
            assert [on for _, _, on in fused(one, part)] == [
                layer.fused and choice(layer) == chosen for layer in layers]
    for side in ("encoder", "decoder"):  # one side only: the other as it was
        one = mimi.with_fused_seanet(**{other: other == side for other in ("encoder", "decoder")})
        for part in ("encoder", "decoder"):
            assert fused(one, part) == (fused(both, part) if part == side else fused(mimi, part))
    assert not any(on for part in ("encoder", "decoder") for _, _, on in fused(mimi, part))


@torch.no_grad()
def test_a_fused_layer_steps_with_its_weight_put_in_the_kernels_order_once() -> None:
    """Fusing copies each fused layer's weight into its kernel's order once, not on every step (each step made a
    fresh copy before: ~5-10 small copy kernels a tick): a buffer kept out of the checkpoint (a fused codec's state
    dict is the codec's), that casts with the layer, and that the fused step reads: zeroed, the step gives the
    bias alone, where the torch path still gives the convolution."""
    mimi = random_mimi(MimiConfig(), "cpu")
    fused = mimi.with_fused_seanet()
    assert fused.state_dict().keys() == mimi.state_dict().keys()
    transposed = [layer for layer in fused.decoder.model if isinstance(layer, CausalConvTranspose1d) and layer.fused]
    assert transposed
    for layer in transposed:
        assert layer.kernel_weight.is_contiguous()
        assert torch.equal(layer.kernel_weight, layer.convtr.weight.permute(1, 2, 0))
    half = copy.deepcopy(fused.decoder).to(torch.bfloat16)
    assert {layer.kernel_weight.dtype for layer in half.model if getattr(layer, "fused", False)} == {torch.bfloat16}

    conv = CausalConv1d(1, 64, 7).to(DEVICE)  # the encoder's first convolution: from audio, fused as `ends` fits
    conv.fuse()
    assert torch.equal(conv.kernel_weight, conv.conv.weight.permute(2, 0, 1))
    (shape,) = conv.buffer_shapes(FRAME_SAMPLES // 8)
    x = torch.randn(ROWS, 1, FRAME_SAMPLES // 8, device=DEVICE)
    window = torch.zeros(ROWS, *shape[:2], device=DEVICE)
    steps = conv.step(x, iter([window.clone()]))
    conv.kernel_weight.zero_()
    bias_alone = conv.step(x, iter([window.clone()]))
    assert torch.equal(bias_alone, conv.conv.bias.view(1, -1, 1).expand_as(bias_alone))
    conv.fuse(False)
    torch_path = conv.step(x, iter([window.clone()]))
    assert (torch_path - steps).abs().max() <= TOLERANCE[torch.float32] * steps.abs().max()


@torch.no_grad()
def test_a_codec_with_fused_seanet_steps_streams_as_the_torch_path_does() -> None:
    """Full size, as the engine's precisions run it on CUDA (encoder float32 with TF32, decoder bf16; float32 both
    in the interpreter): frames at a few rows encode to nearly the same codes through every fused step, and the same
    codes decode to audio within 30 dB of the torch path's."""
    rows, frames = (8, 6) if CUDA else (1, 2)  # the interpreter takes ~7 s a frame
    mimi = random_mimi(MimiConfig(), DEVICE).with_precision(torch.float32, torch.bfloat16 if CUDA else torch.float32)
    fused = mimi.with_fused_seanet()
    generator = torch.Generator(DEVICE).manual_seed(0)
    pcm = 0.1 * torch.randn(frames, rows, FRAME_SAMPLES, device=DEVICE, generator=generator)
    states = mimi.init_state(rows, DEVICE), fused.init_state(rows, DEVICE)
    codes = [torch.stack([m.encode_frame(frame, s) for frame in pcm]) for m, s in zip((mimi, fused), states)]
    assert (codes[0] == codes[1]).float().mean() > 0.9
    states = mimi.init_state(rows, DEVICE), fused.init_state(rows, DEVICE)
    audio = [torch.stack([m.decode_frame(c, s) for c in codes[0]]) for m, s in zip((mimi, fused), states)]
    noise = (audio[1] - audio[0]).square().sum()
    assert 10 * math.log10(float(audio[0].square().sum() / noise)) > 30


@torch.no_grad()
def test_a_row_reset_mid_stream_steps_through_the_kernels_as_through_the_torch_path(monkeypatch) -> None:
    """The engine resets a row's codec state at every session start (`Mimi.reset_rows`) while the other rows stream
    on, and the kernels read and keep the same carried samples as the torch path: the tiny codec, every kernel it
    takes on (in float32, without TF32 on CUDA so that codes compare exactly), with a row reset between frames,
    gives the torch path's codes and audio."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    rows = 2
    mimi = random_mimi(TINY_MIMI, DEVICE)
    fused = mimi.with_fused_seanet()
    assert any(getattr(layer, "fused", False) for layer in fused.decoder.model)
    generator = torch.Generator(DEVICE).manual_seed(1)
    pcm = 0.1 * torch.randn(4, rows, FRAME_SAMPLES, device=DEVICE, generator=generator)
    states = mimi.init_state(rows, DEVICE), fused.init_state(rows, DEVICE)
    for index, frame in enumerate(pcm):
        if index == 2:
            for codec, state in zip((mimi, fused), states):
                codec.reset_rows(state, torch.tensor([False, True], device=DEVICE))
        codes = [codec.encode_frame(frame, state) for codec, state in zip((mimi, fused), states)]
        assert torch.equal(codes[0], codes[1]), index
        audio = [codec.decode_frame(codes[0], state) for codec, state in zip((mimi, fused), states)]
        assert (audio[1] - audio[0]).abs().max() <= TOLERANCE[torch.float32] * audio[0].abs().max(), index


def _decoder_layout() -> tuple[list[tuple[int, int]], list[int], int]:
    """The full codec's decoder state: each buffer's (channels, length), its carried samples, the ring's slots."""
    with torch.device("meta"):
        state = Mimi(MimiConfig()).init_state(1, "meta").decoder
    return [(t.shape[1], t.shape[2]) for t in state.convs], state.carried, state.kv.key_pos.shape[1]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_idle_rows_reset_kernel_leaves_the_torch_paths_state(dtype) -> None:
    """The decode's reset of the rows that emitted nothing, every tick (model/batch_step.py): one kernel over the
    full codec's decoder buffers leaves every carried sample, slot position and row position of the torch path's
    masked fills, with and without an active mask, and on a one-row view inside a larger state (the engine's
    input-clocked steps); the samples past the carried ones and the rows that emitted stay as they were."""
    shapes, carried, slots = _decoder_layout()
    generator = torch.Generator().manual_seed(3)
    rows = 5

    def state() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        convs = [torch.randn(rows, c, n, generator=generator).to(DEVICE, dtype) for c, n in shapes]
        key_pos = torch.randint(0, 100, (rows, slots), generator=generator).to(DEVICE)
        return convs, key_pos, torch.randint(1, 100, (rows,), generator=generator).to(DEVICE)

    emitted = torch.tensor([True, False, False, True, False], device=DEVICE)
    some = torch.tensor([True, True, False, True, True], device=DEVICE)
    one = torch.ones(1, dtype=torch.bool, device=DEVICE)
    cases = [(slice(0, rows), emitted, None), (slice(0, rows), emitted, some), (slice(2, 3), emitted[2:3], one)]
    for index, done, active in cases:
        convs, key_pos, pos = state()
        want = [t.clone() for t in (*convs, key_pos, pos)]
        view = [t[index] for t in want]
        reset_idle_reference(view[:-2], carried, view[-2], view[-1], done, active)
        view = [t[index] for t in (*convs, key_pos, pos)]
        reset_idle_triton(view[:-2], carried, view[-2], view[-1], done, active, StreamBuffers())
        for k, (got, expected) in enumerate(zip((*convs, key_pos, pos), want, strict=True)):
            assert torch.equal(got, expected), f"rows {index}, active {active is not None}: tensor {k}"
        assert not torch.equal(want[0], convs[0].new_zeros(convs[0].shape))  # something was left to compare
