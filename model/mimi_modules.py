"""Mimi building blocks: causal (transposed) convolutions, SEANet, the windowed RoPE transformer and the split RVQ.

Every stateful block has a one-shot `forward` and a streaming `step` that reads and updates caller-owned state
tensors in place (fixed shapes, no host sync), so a frame step can be captured in a CUDA graph. Conv-like blocks take
their state buffers from an iterator, in the order `buffer_shapes(length)` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import seanet_kernels
from model.attention import TRITON_INTERPRETED
from model.config import MimiTransformerConfig, QuantizerConfig, SeanetConfig
from model.fused import fusable
from model.rope import apply_rope, rope_rotation, rotate
from model.stream_kernels import overlap_add

NORM_EPS = 1e-5
CODEBOOK_EPS = 1e-5


def _kernel_takes(x: Tensor) -> bool:
    """Whether a fused SEANet step's Triton kernel can take x [B, C, L] (time or channels contiguous) here."""
    return (x.is_cuda or TRITON_INTERPRETED) and 1 in x.stride()[1:]


class _FusableStep(nn.Module):
    """A SEANet layer whose streaming step can run as one Triton kernel (model/seanet_kernels.py): `fuse()` holds
    its weight in the kernel's order (`kernel_weight`, a buffer outside the checkpoint that moves and casts with the
    layer), made once there rather than on every step."""

    kernel_weight: Tensor | None

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kernel_weight", None, persistent=False)

    @property
    def fused(self) -> bool:
        return self.kernel_weight is not None

    def fuse(self, on: bool = True) -> None:
        """Step as one Triton kernel from now on, with the weight as it is now (on), or through the torch path."""
        self.kernel_weight = self._weight_in_kernel_order() if on else None

    def _weight_in_kernel_order(self) -> Tensor:
        raise NotImplementedError


class CausalConv1d(_FusableStep):
    """Conv1d padded on the left only; streaming keeps its whole input window.

    A strided convolution (SEANet's downsampling) steps as one GEMM over its input windows: for the few output
    frames of a streaming step cuDNN's kernels took ~0.25 ms each on the H200, where the GEMM needs microseconds.
    One-shot calls (a voice recording of any length) keep the convolution, which needs no unfolded copy.

    Streaming, the state is the convolution's input window [B, C_in, context + length]: a step writes its input
    (through the ELU before it, if any) after the `context` samples kept from the last step, convolves the window
    where it lies, then moves the window's last `context` samples to its front. A window built anew each step (the
    kept samples and the input concatenated) was one more pass over every streaming convolution's input: at 250
    rows on the H200 the encoder took 4.9 ms with it, 4.4 without.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"unsupported pad_mode {pad_mode!r}")
        if stride > 1 and dilation > 1:
            raise ValueError("a strided convolution cannot be dilated")
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.pad_mode = pad_mode
        self.context = (kernel_size - 1) * dilation + 1 - stride

    def _weight_in_kernel_order(self) -> Tensor:
        return seanet_kernels.taps_first(self.conv.weight)

    def buffer_shapes(self, length: int) -> list[tuple[int, int, int]]:
        """The streaming state for steps of up to `length` input samples: (channels, samples, samples carried from
        one step to the next)."""
        return [(self.conv.in_channels, self.context + length, self.context)] if self.context > 0 else []

    def out_length(self, length: int) -> int:
        return length // self.conv.stride[0]

    def forward(self, x: Tensor) -> Tensor:
        # Inputs are whole frames, so every length is a multiple of the stride and no right padding is needed.
        return self.conv(F.pad(x, (self.context, 0), mode=self.pad_mode))

    def _step_conv(self, x: Tensor, bias: bool = True) -> Tensor:
        stride = self.conv.stride[0]
        if stride == 1:
            return self.conv(x) if bias else F.conv1d(x, self.conv.weight, None, 1, 0, self.conv.dilation)
        w = self.conv.weight  # [C_out, C_in, K]
        c_out, c_in, k = w.shape
        windows = x.unfold(-1, k, stride)  # [B, C_in, L, K]
        b, _, length, _ = windows.shape
        # Rows are (batch, output frame), so the weight is read once for the whole batch.
        y = F.linear(windows.transpose(1, 2).reshape(b * length, c_in * k), w.reshape(c_out, c_in * k), self.conv.bias)
        return y.view(b, length, c_out).transpose(1, 2)

    def step(self, x: Tensor, buffers: Iterator[Tensor], first: Tensor | None = None,
             activation: nn.ELU | None = None, bias: bool = True) -> Tensor:
        """`first` [B] bool marks rows on their first frame; replicate padding uses their first sample there.
        `activation` (the ELU before this convolution) is applied as the input is written into the window.
        `bias=False` leaves the bias for the caller to add (a stride-1 convolution's torch path only)."""
        if self.context == 0:
            return self._step_conv(x if activation is None else activation(x), bias)
        if self.fused and _kernel_takes(x) and x.shape[-1] % self.conv.stride[0] == 0 and x.shape[-1] >= self.context:
            strided = self.conv.stride[0] > 1
            fused_step = seanet_kernels.fused_strided_step if strided else seanet_kernels.fused_thin_step
            alpha = None if activation is None else activation.alpha
            return fused_step(x, next(buffers), self.conv, self.kernel_weight, alpha)
        window = next(buffers)
        kept, length = self.context, x.shape[-1]
        if kept + length > window.shape[-1]:
            raise ValueError(f"a step of {length} samples is longer than the window holds ({window.shape[-1] - kept})")
        new = window[..., kept : kept + length]
        if activation is None:
            new.copy_(x)
        else:  # one pass: the ELU writes straight into the window
            torch.ops.aten.elu.out(x, activation.alpha, out=new)
        if self.pad_mode == "replicate":
            assert first is not None, "replicate padding needs the per-row first-frame mask"
            past = window[..., :kept]
            past.copy_(torch.where(first[:, None, None], new[..., :1].expand_as(past), past))
        y = self._step_conv(window[..., : kept + length], bias)
        newest = window[..., length : length + kept]
        window[..., :kept].copy_(newest if length >= kept else newest.clone())
        return y


class CausalConvTranspose1d(_FusableStep):
    """ConvTranspose1d trimmed on the right; streaming carries the `kernel - stride` overlap tail to the next call.

    The streaming step computes the transposed convolution itself, as one GEMM (or, depthwise, one product) and an
    overlap-add of `kernel / stride` shifted slices (`overlap_add`, one kernel on CUDA): on the GPU cuDNN's kernels
    for these few-frame shapes cost up to a millisecond per call, the GEMM microseconds.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int = 1, bias: bool = True
    ) -> None:
        super().__init__()
        if kernel_size % stride:
            raise ValueError(f"kernel_size {kernel_size} must be a multiple of stride {stride}")
        if groups not in (1, in_channels) or (groups > 1 and out_channels != in_channels):
            raise ValueError("only dense or depthwise transposed convolutions are supported")
        self.convtr = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride, groups=groups, bias=bias)
        self.stride = stride
        self.overlap = kernel_size - stride

    def _weight_in_kernel_order(self) -> Tensor:
        return seanet_kernels.transposed_taps(self.convtr.weight)

    def buffer_shapes(self, length: int) -> list[tuple[int, int, int]]:
        """The overlap tail, whatever the step's length, all of it carried."""
        return [(self.convtr.out_channels, self.overlap, self.overlap)]

    def out_length(self, length: int) -> int:
        return length * self.stride

    def forward(self, x: Tensor) -> Tensor:
        y = self.convtr(x)
        return y[..., : y.shape[-1] - self.overlap]

    def _taps(self, x: Tensor) -> Tensor:
        """Each input frame's contribution to K output samples: x [B, C_in, T] -> [B, C_out, T, K]."""
        w = self.convtr.weight  # [C_in, C_out / groups, K]
        c_in, _, k = w.shape
        b, _, t = x.shape
        if self.convtr.groups == 1:
            return (x.transpose(1, 2).reshape(b * t, c_in) @ w.reshape(c_in, -1)).view(b, t, -1, k).transpose(1, 2)
        return x.unsqueeze(-1) * w.view(1, c_in, 1, k)

    def step(self, x: Tensor, buffers: Iterator[Tensor], activation: nn.ELU | None = None) -> Tensor:
        """`activation` (the ELU before this convolution) is applied to the input first."""
        if self.fused and _kernel_takes(x) and x.shape[-1] * self.stride >= self.overlap:
            alpha = None if activation is None else activation.alpha
            return seanet_kernels.fused_transposed_step(x, next(buffers), self.convtr, self.kernel_weight, alpha)
        return overlap_add(self._taps(x if activation is None else activation(x)), next(buffers), self.convtr.bias,
                           self.stride)


class ResidualBlock(_FusableStep):
    """SEANet residual unit: x + conv1x1(elu(conv_k(elu(x)))), identity skip. Indices 1 and 3 hold the convs.

    Once fused (`Mimi.with_fused_seanet`), a streaming step runs as one Triton kernel where its input allows
    (model/seanet_kernels.py)."""

    def __init__(self, dim: int, hidden: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                CausalConv1d(dim, hidden, kernel_size, dilation=dilation),
                nn.ELU(),
                CausalConv1d(hidden, dim, 1),
            ]
        )

    def _weight_in_kernel_order(self) -> Tensor:  # the first convolution's; the kernel reads the 1x1's as it is
        return seanet_kernels.taps_first(self.block[1].conv.weight)

    def buffer_shapes(self, length: int) -> list[tuple[int, int, int]]:
        return [s for layer in self.block if isinstance(layer, CausalConv1d) for s in layer.buffer_shapes(length)]

    def out_length(self, length: int) -> int:
        return length

    def forward(self, x: Tensor) -> Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return x + y

    def step(self, x: Tensor, buffers: Iterator[Tensor]) -> Tensor:
        elu, conv, elu_hidden, conv_1x1 = self.block
        if self.fused and _kernel_takes(x) and x.shape[-1] >= conv.context:
            window = next(buffers) if conv.context else None
            return seanet_kernels.fused_residual_step(x, window, conv.conv, self.kernel_weight, conv_1x1.conv,
                                                      elu.alpha, elu_hidden.alpha)
        if _adds_bias_apart(x, conv.conv, conv_1x1.conv):
            hidden = bias_elu(conv.step(x, buffers, activation=elu, bias=False), conv.conv.bias, elu_hidden.alpha)
            return bias_residual(conv_1x1.step(hidden, buffers, bias=False), conv_1x1.conv.bias, x)
        y = conv.step(x, buffers, activation=elu)
        return x + conv_1x1.step(y, buffers, activation=elu_hidden)


def _adds_bias_apart(x: Tensor, *convs: nn.Conv1d) -> bool:
    """Whether torch adds these stride-1 convolutions' biases to x's results as a pass of its own (cuDNN's
    convolutions on float32: `aten::_convolution` adds the bias after the product), so the add can join the pass
    after it with every value the same. On the CPU the bias starts the sum (other roundings), and in a half dtype
    a compiled chain would skip the rounding between the two ops: both keep torch's own path."""
    return (x.dtype == torch.float32 and torch.backends.cudnn.is_acceptable(x)
            and all(conv.bias is not None and conv.stride[0] == 1 and conv.groups == 1 for conv in convs))


@fusable
def bias_elu(y: Tensor, bias: Tensor, alpha: float) -> Tensor:
    """elu(y + bias) for y [B, C, L] and bias [C]: a convolution's bias and the ELU after it, one pass."""
    return F.elu(y + bias[:, None], alpha)


@fusable
def bias_residual(y: Tensor, bias: Tensor, x: Tensor) -> Tensor:
    """(y + bias) + x: a residual branch's last bias and the skip, one pass, the values of torch's x + (y + bias).
    The sum takes the layout of its first term, the convolution's (time fastest): after a strided convolution x
    has its channels fastest, and the ELU that writes the sum into the next window would read it across."""
    return (y + bias[:, None]) + x


_Stateful = (CausalConv1d, CausalConvTranspose1d, ResidualBlock)


class _Seanet(nn.Module):
    """A sequence of ELUs and stateful conv blocks held in `model` (the checkpoint's layer indices)."""

    model: nn.ModuleList

    def buffer_shapes(self, length: int) -> list[tuple[int, int, int]]:
        """The streaming state for steps of `length` input samples (see CausalConv1d.buffer_shapes)."""
        shapes = []
        for layer in self.model:
            if isinstance(layer, _Stateful):
                shapes += layer.buffer_shapes(length)
                length = layer.out_length(length)
        return shapes

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.model:
            x = layer(x)
        return x

    def step(self, x: Tensor, buffers: Iterator[Tensor]) -> Tensor:
        activation = None  # an ELU is applied by the convolution after it, as it writes its window
        for layer in self.model:
            if isinstance(layer, nn.ELU):
                activation = layer
            elif isinstance(layer, (CausalConv1d, CausalConvTranspose1d)):
                x, activation = layer.step(x, buffers, activation=activation), None
            else:
                x, activation = layer.step(x if activation is None else activation(x), buffers), None
        return x if activation is None else activation(x)


class SeanetEncoder(_Seanet):
    """Audio [B, channels, N] -> latents [B, dimension, N / prod(ratios)]."""

    def __init__(self, cfg: SeanetConfig) -> None:
        super().__init__()
        mult = 1
        layers: list[nn.Module] = [CausalConv1d(cfg.channels, cfg.n_filters, cfg.kernel_size)]
        for ratio in reversed(cfg.ratios):
            dim = mult * cfg.n_filters
            for j in range(cfg.n_residual_layers):
                layers.append(ResidualBlock(dim, dim // cfg.compress, cfg.residual_kernel_size, cfg.dilation_base**j))
            layers += [nn.ELU(), CausalConv1d(dim, 2 * dim, 2 * ratio, stride=ratio)]
            mult *= 2
        layers += [nn.ELU(), CausalConv1d(mult * cfg.n_filters, cfg.dimension, cfg.last_kernel_size)]
        self.model = nn.ModuleList(layers)


class SeanetDecoder(_Seanet):
    """Latents [B, dimension, T] -> audio [B, channels, T * prod(ratios)]."""

    def __init__(self, cfg: SeanetConfig) -> None:
        super().__init__()
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [CausalConv1d(cfg.dimension, mult * cfg.n_filters, cfg.kernel_size)]
        for ratio in cfg.ratios:
            dim = mult * cfg.n_filters
            layers += [nn.ELU(), CausalConvTranspose1d(dim, dim // 2, 2 * ratio, ratio)]
            for j in range(cfg.n_residual_layers):
                layers.append(
                    ResidualBlock(dim // 2, dim // 2 // cfg.compress, cfg.residual_kernel_size, cfg.dilation_base**j)
                )
            mult //= 2
        layers += [nn.ELU(), CausalConv1d(cfg.n_filters, cfg.channels, cfg.last_kernel_size)]
        self.model = nn.ModuleList(layers)


@dataclass
class KVCache:
    """Ring KV of one transformer for B rows, with per-row positions.

    `key_pos[b, s]` is the absolute position held in slot s (-1: empty); `pos[b]` is the row's next position.
    """

    keys: Tensor  # [layers, B, heads, slots, head_dim]
    values: Tensor  # [layers, B, heads, slots, head_dim]
    key_pos: Tensor  # [B, slots] long
    pos: Tensor  # [B] long

    def rows(self, index: slice) -> KVCache:
        """A view of some rows: writes through it land in this cache."""
        return KVCache(self.keys[:, index], self.values[:, index], self.key_pos[index], self.pos[index])

    def reset_rows(self, rows: Tensor) -> None:
        """Mark every slot of `rows` empty and zero their keys and values."""
        self.keys.masked_fill_(rows[None, :, None, None, None], 0.0)
        self.values.masked_fill_(rows[None, :, None, None, None], 0.0)
        self.key_pos.masked_fill_(rows[:, None], -1)
        self.pos.masked_fill_(rows, 0)


class Attention(nn.Module):
    """Multi-head self-attention with a fused q/k/v projection (rows q, k, v; each split head-major), no biases."""

    def __init__(self, cfg: MimiTransformerConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.d_model // cfg.num_heads
        self.max_period = cfg.max_period
        self.in_proj_weight = nn.Parameter(torch.empty(3 * cfg.d_model, cfg.d_model))
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self, x: Tensor, rope: Tensor, mask: Tensor, cache: tuple[Tensor, Tensor, Tensor] | None
    ) -> Tensor:
        """x [B, T, C]; mask (bool, True = attend) broadcasts to [B, 1, T, keys].

        With `cache` = (keys, values, slots [B, T]) the new keys/values are written into the ring first and the
        queries attend over the whole ring.
        """
        b, t, c = x.shape
        qkv = F.linear(x, self.in_proj_weight).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is None:
            q, k = apply_rope(qkv[:2], rope).unbind(0)  # one rotation for both
            out = F.scaled_dot_product_attention(q, k, qkv[2], attn_mask=mask)
        else:
            keys, values, slots = cache
            out = ring_attention(rotate_into_ring(qkv, rope, keys, values, slots), keys, values, mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, c))


@fusable
def rotate_into_ring(qkv: Tensor, rope: Tensor, keys: Tensor, values: Tensor, slots: Tensor) -> Tensor:
    """The queries rotated; the keys rotated and the values written into the ring at `slots` [B, T]: qkv
    [3, B, H, T, D], keys and values [B, H, S, D]. One pass where the rotation and the two ring writes were three
    launches a layer (the same values: the rotation's arithmetic is `apply_rope`'s, the writes are copies)."""
    q, k = rotate(qkv[:2], rope).unbind(0)
    rows = torch.arange(slots.shape[0], device=slots.device).unsqueeze(1)
    keys[rows, :, slots] = k.transpose(1, 2)  # [B, T, H, D]: the indexed dims first, as advanced indexing puts them
    values[rows, :, slots] = qkv[2].transpose(1, 2)
    return q


@fusable
def ring_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Exact attention of a few queries q [B, H, T, D] over a short ring [B, H, S, D] (streaming steps), the
    softmax in fp32 whatever the dtype.

    Two batched GEMMs around one fused masked softmax; the generic fp32 SDPA kernel with a mask costs ~0.1 ms
    per layer at 64 rows.
    """
    scores = (q @ keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [B, H, T, S]
    return scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype) @ values


class LayerScale(nn.Module):
    """A per-channel scale on a residual branch (applied by `scale_add`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


@fusable
def scale_add(x: Tensor, delta: Tensor, scale: Tensor) -> Tensor:
    return x + scale * delta


@fusable
def scale_add_layer_norm(x: Tensor, delta: Tensor, scale: Tensor, weight: Tensor, bias: Tensor,
                         eps: float) -> tuple[Tensor, Tensor]:
    """(x + scale * delta, its layer norm): a scaled residual add and the next norm, one kernel on the GPU."""
    total = x + scale * delta
    return total, F.layer_norm(total, (total.shape[-1],), weight, bias, eps)


class TransformerLayer(nn.Module):
    """Pre-norm layer: x += ls1 * attn(ln1(x)); x += ls2 * linear2(gelu(linear1(ln2(x))))."""

    def __init__(self, cfg: MimiTransformerConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=NORM_EPS)
        self.linear1 = nn.Linear(cfg.d_model, cfg.dim_feedforward, bias=False)
        self.linear2 = nn.Linear(cfg.dim_feedforward, cfg.d_model, bias=False)
        self.layer_scale_1 = LayerScale(cfg.d_model)
        self.layer_scale_2 = LayerScale(cfg.d_model)

    def forward(
        self, x: Tensor, rope: Tensor, mask: Tensor, cache: tuple[Tensor, Tensor, Tensor] | None
    ) -> Tensor:
        attended = self.self_attn(self.norm1(x), rope, mask, cache)
        x, normed = scale_add_layer_norm(x, attended, self.layer_scale_1.scale, self.norm2.weight, self.norm2.bias,
                                         self.norm2.eps)
        return scale_add(x, self.linear2(F.gelu(self.linear1(normed))), self.layer_scale_2.scale)


class MimiTransformer(nn.Module):
    """Causal transformer over [B, T, C] where a query at position p sees keys p - context + 1 .. p."""

    def __init__(self, cfg: MimiTransformerConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.num_heads:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of num_heads {cfg.num_heads}")
        self.cfg = cfg
        self.head_dim = cfg.d_model // cfg.num_heads
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        positions = torch.arange(t, device=x.device)
        delta = positions[:, None] - positions[None, :]
        mask = (delta >= 0) & (delta < self.cfg.context)
        rope = rope_rotation(positions[None, None], self.head_dim, self.cfg.max_period)
        for layer in self.layers:
            x = layer(x, rope, mask, None)
        return x

    def init_cache(self, batch_size: int, steps: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        """A fresh cache for calls of `steps` positions each.

        The ring holds at least context + steps - 1 slots: the new keys are written before attending, and the
        earliest query of a call still needs the key `context - 1` positions back. The count is rounded up to a
        multiple of 8 (keys past the context are masked): with 251 slots the scores' rows were unaligned and
        cuBLAS fell back to align-1 kernels, ~70 us per GEMM at 64 rows on the H200.
        """
        slots = -(-(self.cfg.context + steps - 1) // 8) * 8
        shape = (len(self.layers), batch_size, self.cfg.num_heads, slots, self.head_dim)
        return KVCache(
            keys=torch.zeros(shape, device=device, dtype=dtype),
            values=torch.zeros(shape, device=device, dtype=dtype),
            key_pos=torch.full((batch_size, slots), -1, device=device, dtype=torch.long),
            pos=torch.zeros(batch_size, device=device, dtype=torch.long),
        )

    def step(self, x: Tensor, cache: KVCache) -> Tensor:
        """x [B, T, C] continues each row's sequence at `cache.pos`; updates the cache in place."""
        positions, slots, mask = advance_ring(cache.pos, cache.key_pos, x.shape[1], self.cfg.context)
        rope = rope_rotation(positions[:, None], self.head_dim, self.cfg.max_period)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, mask, (cache.keys[i], cache.values[i], slots))
        return x


@fusable
def advance_ring(pos: Tensor, key_pos: Tensor, steps: int, context: int) -> tuple[Tensor, Tensor, Tensor]:
    """A step of `steps` positions from each row's `pos` [B]: the positions [B, T], their ring slots [B, T] (marked
    in `key_pos` [B, S]), which keys each may see [B, 1, T, S]; `pos` moves on. Integer work (about a dozen
    launches a step where the engine compiles it)."""
    positions = pos.unsqueeze(1) + torch.arange(steps, device=pos.device)
    slots = positions % key_pos.shape[1]
    key_pos.scatter_(1, slots, positions)
    delta = positions[:, :, None] - key_pos[:, None, :]
    mask = ((key_pos[:, None, :] >= 0) & (delta >= 0) & (delta < context))[:, None]
    pos += steps
    return positions, slots, mask


class Codebook(nn.Module):
    """Euclidean codebook stored as running sums: centroid = embedding_sum / max(cluster_usage, eps), computed once
    as the sums load (a division of the whole codebook at every lookup was 48 kernels of each tick's codec).

    The nearest centroid is `torch.cdist`'s, value for value: with more than 25 centroids (every Mimi has 2,048) cdist
    takes the distances as one product, [-2x, |x|^2, 1] against [c, 1, |c|^2], then clamps at 0 and takes the root.
    The centroids' side of that product is the same every frame, so it is built once here (`augmented`, on the
    device the codebook sits on: a sum's rounding depends on the device), where cdist built it at every lookup: four
    kernels a codebook, 32 of each tick's encode."""

    def __init__(self, bins: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("_initialized", torch.zeros(1))
        self.register_buffer("cluster_usage", torch.ones(bins))
        self.register_buffer("embedding_sum", torch.zeros(bins, dim))
        self.register_buffer("centroids", self._centroids(), persistent=False)
        self.register_buffer("augmented", self._augmented(), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _: module.update_centroids())

    def _centroids(self) -> Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=CODEBOOK_EPS)[:, None]

    def _augmented(self) -> Tensor:
        """[1, bins, dim + 2]: each centroid, a 1 and its squared norm, as cdist builds its second operand."""
        c = self.centroids[None]
        norm = c.pow(2).sum(-1, keepdim=True)
        return torch.cat([c, torch.ones_like(norm), norm], dim=-1)

    def update_centroids(self) -> None:
        """The centroids from the sums as they are now (done as a state dict loads)."""
        self.centroids = self._centroids()
        self.augmented = self._augmented()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Codebook:
        super()._apply(fn, recurse)
        self.augmented = self._augmented()  # the norms summed where the codebook now is, as cdist would sum them
        return self

    def encode(self, x: Tensor, squares: Tensor | None = None) -> Tensor:
        """x [N, D] -> index of the nearest centroid (L2) [N]. `squares`: x squared, where the caller has it."""
        if squares is None:
            squares = x.pow(2)
        norm = squares[None].sum(-1, keepdim=True)  # torch's own sum: the order of cdist's
        return nearest_centroid(cdist_operand(x[None], norm).matmul(self.augmented.mT))


# The quantizer's glue as one pass each where the engine compiles its helpers (every value as torch's ops compute
# it: the products and the norms' sums stay torch's own, these are elementwise or an argmin, which keeps the first
# of equal distances either way).

@fusable
def cdist_operand(x: Tensor, norm: Tensor) -> Tensor:
    """x [1, N, D], its squared norms [1, N, 1] -> [1, N, D + 2]: cdist's first operand, [-2x, |x|^2, 1]."""
    return torch.cat([x.mul(-2), norm, torch.ones_like(norm)], dim=-1)


@fusable
def nearest_centroid(distances: Tensor) -> Tensor:
    """[1, N, bins] squared distances as cdist's product gives them -> the index of the least [N], as cdist's
    clamp and root leave them (the root can make two distances equal: the first is kept, as before)."""
    return distances.clamp_min(0).sqrt()[0].argmin(dim=-1)


@fusable
def subtract_centroid(residual: Tensor, centroids: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """The next level's residual [N, D] and its squares, for its norm."""
    rest = residual - F.embedding(idx, centroids)
    return rest, rest.pow(2)


@fusable
def centroid_sum(codes: Tensor, centroids: list[Tensor]) -> Tensor:
    """codes [B, K, T] -> [B, T, D]: each level's centroid, summed level by level as the residual was taken."""
    total = F.embedding(codes[:, 0], centroids[0])
    for level in range(1, len(centroids)):
        total = total + F.embedding(codes[:, level], centroids[level])
    return total


class ResidualVQ(nn.Module):
    """1x1 input projection, residual quantization over `levels` codebooks, 1x1 output projection."""

    def __init__(self, cfg: QuantizerConfig, levels: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.input_dimension, cfg.dimension, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.dimension, cfg.output_dimension, 1, bias=False)
        self.layers = nn.ModuleList([Codebook(cfg.bins, cfg.dimension) for _ in range(levels)])

    def encode_levels(self, x: Tensor) -> list[Tensor]:
        """x [B, C, T] -> each level's codes [B, T]. The last level's residual is never formed: nothing reads it."""
        residual = self.input_proj(x).transpose(1, 2)
        b, t, d = residual.shape
        residual = residual.reshape(b * t, d)
        squares = None
        codes = []
        for level, codebook in enumerate(self.layers):
            idx = codebook.encode(residual, squares)
            if level + 1 < len(self.layers):
                residual, squares = subtract_centroid(residual, codebook.centroids, idx)
            codes.append(idx.view(b, t))
        return codes

    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, K, T] (K <= levels) -> [B, output_dimension, T]."""
        levels = codes.shape[1]
        quantized = centroid_sum(codes, [codebook.centroids for codebook in self.layers[:levels]])
        return self.output_proj(quantized.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    """One semantic level (`rvq_first`) and `num_codebooks - 1` acoustic levels (`rvq_rest`), both fed the same
    latent; decoding sums the two halves' projected outputs."""

    def __init__(self, cfg: QuantizerConfig, num_codebooks: int) -> None:
        super().__init__()
        self.rvq_first = ResidualVQ(cfg, 1)
        self.rvq_rest = ResidualVQ(cfg, num_codebooks - 1)

    def encode(self, x: Tensor) -> Tensor:
        return torch.stack(self.rvq_first.encode_levels(x) + self.rvq_rest.encode_levels(x), dim=1)

    def decode(self, codes: Tensor) -> Tensor:
        return self.rvq_first.decode(codes[:, :1]) + self.rvq_rest.decode(codes[:, 1:])
