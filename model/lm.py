"""The PersonaPlex language model: temporal transformer, depformer, embeddings, and their streaming state.

Module and parameter names follow the official checkpoint keys, so `load_state_dict` takes the file as it is.
The temporal transformer keeps a ring KV cache of `context` frames per row with per-row positions: rows start,
reset and prefill independently while the step itself is one fixed-shape batched computation (graph friendly).
The depformer runs only the agent's codebook steps (user codebooks are always the real user's, spec/model.md §5.3),
so it may be built with fewer weight sets than the checkpoint holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.attention import KVStore, decode_attention, depformer_attention, longest_first, rope_and_store, use_kernel
from model.config import LMConfig
from model.depformer_kernels import fused_linear
from model.embed_kernel import EmbeddingTables, embed_column
from model.fused import fusable
from model.precision import Fp8Linear, sibling
from model.rope import apply_rope, rope_rotation

# Prefill lengths vary with every persona; cuDNN would build a new plan for each (hundreds of ms), so it is left out.
PREFILL_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 whatever the activation dtype; `alpha` is [1, 1, dim] as in the checkpoint."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.alpha = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.alpha, self.eps)


def _rms_norm(x: Tensor, alpha: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), alpha.view(-1).float(), eps).to(x.dtype)


rms_norm = fusable(_rms_norm)


@fusable
def add_rms_norm(x: Tensor, delta: Tensor, alpha: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, its RMS norm): a residual add and the next norm, one kernel on the GPU instead of two."""
    total = x + delta
    return total, _rms_norm(total, alpha, eps)


@fusable
def silu_gate(projected: Tensor) -> Tensor:
    gate, up = projected.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class DepformerCache:
    """One frame's depformer keys and values per layer, (k, v) [B, heads, steps, head_dim], and the step indices
    [steps] on the same device (steps enter the attention as tensors)."""

    kv: list[tuple[Tensor, Tensor]]
    steps: Tensor


class GatedFFN(nn.Module):
    """SiLU-gated FFN; `linear_in` stacks the gate rows then the up rows."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in: nn.Module = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out: nn.Module = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_out(silu_gate(self.linear_in(x)))


class TemporalAttention(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * cfg.dim, cfg.dim))
        self.out_proj: nn.Module = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.in_proj_fp8: Fp8Linear | None = None  # the product in fp8 (LM.with_fp8_weights), else in_proj_weight's
        nn.init.xavier_uniform_(self.in_proj_weight)

    def project(self, x: Tensor) -> Tensor:
        """x [..., dim] -> q, k and v side by side [..., 3 * dim]."""
        return F.linear(x, self.in_proj_weight) if self.in_proj_fp8 is None else self.in_proj_fp8(x)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, dim] -> q, k, v each [B, H, T, head_dim]."""
        q, k, v = self.project(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
        return q, k, v


class TemporalLayer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = TemporalAttention(cfg)
        self.norm2 = RMSNorm(cfg.dim, cfg.norm_eps)
        self.gating = GatedFFN(cfg.dim, cfg.ffn_hidden)


class Transformer(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.layers = nn.ModuleList(TemporalLayer(cfg) for _ in range(cfg.num_layers))


class DepformerAttention(nn.Module):
    """Per-step attention weights stacked along dim 0, as the checkpoint stores them."""

    def __init__(self, dim: int, num_heads: int, steps: int):
        super().__init__()
        self.num_heads = num_heads
        self.dim = dim
        self.in_proj_weight = nn.Parameter(torch.empty(steps * 3 * dim, dim))
        self.out_proj = nn.Linear(dim, steps * dim, bias=False)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def step_weights(self, step: int) -> tuple[Tensor, Tensor]:
        d = self.dim
        return self.in_proj_weight[step * 3 * d : (step + 1) * 3 * d], self.out_proj.weight[step * d : (step + 1) * d]


class DepformerLayer(nn.Module):
    def __init__(self, cfg: LMConfig, steps: int):
        super().__init__()
        d = cfg.depformer_dim
        self.norm1 = RMSNorm(d, cfg.norm_eps)
        self.self_attn = DepformerAttention(d, cfg.depformer_num_heads, steps)
        self.norm2 = RMSNorm(d, cfg.norm_eps)
        self.gating = nn.ModuleList(GatedFFN(d, cfg.depformer_ffn_hidden) for _ in range(steps))


class Depformer(nn.Module):
    def __init__(self, cfg: LMConfig, steps: int):
        super().__init__()
        self.layers = nn.ModuleList(DepformerLayer(cfg, steps) for _ in range(cfg.depformer_num_layers))


@dataclass
class LMState:
    """Streaming state of B rows. All tensors are fixed-shape and updated in place.

    A row's ring holds `window` slots (the context unless the engine's page pool shrank it) counted from frame
    `origin`: position p sits in slot (p - origin) % window, and the valid keys in slots [0, min(p - origin + 1,
    window)). A fresh row has origin 0 and the full window: the ring of the reference.

    ring/offset reproduce the reference token ring: row k of frame f sits in column (f + delay_k) % ring_size,
    and `offset` is the reference's call counter o. `pos` is the next RoPE position (= o - 1), `kpos` the
    position held by each KV slot (-1 when empty). `forced` stands in for the reference's `provided` mask,
    which in a conversation only matters on the first call after a prompt (the last prompt frame's delayed
    acoustic codes are already in place).
    """

    kv: KVStore  # pages of [heads, page, head_dim] (bf16/fp32, or fp8 with scales) and each row's page table
    kpos: Tensor  # [B, context] long
    pos: Tensor  # [B] long
    origin: Tensor  # [B] long
    window: Tensor  # [B] long
    ring: Tensor  # [B, rows, ring_size] long
    offset: Tensor  # [B] long
    forced: Tensor  # [B, rows] bool: the next call's target cell already holds a prompt token

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    def rows(self, index: slice) -> LMState:
        """A view of some rows: writes through it land in this state."""
        return LMState(self.kv.rows(index), self.kpos[index], self.pos[index], self.origin[index],
                       self.window[index], self.ring[index], self.offset[index], self.forced[index])


RING_SIZE = 4


class LM(nn.Module):
    """Temporal transformer + depformer with checkpoint-compatible names.

    `depformer_steps` is how many depformer weight sets are built: `cfg.dep_q` (16, the checkpoint's shape) by
    default, or the 8 agent steps that inference needs.
    """

    def __init__(self, cfg: LMConfig, depformer_steps: int | None = None):
        super().__init__()
        self.cfg = cfg
        steps = cfg.dep_q if depformer_steps is None else depformer_steps
        if not cfg.num_audio_codebooks <= steps <= cfg.dep_q:
            raise ValueError(f"depformer_steps must be in [{cfg.num_audio_codebooks}, {cfg.dep_q}], got {steps}")
        self.depformer_steps = steps
        self.emb = nn.ModuleList(nn.Embedding(cfg.card + 1, cfg.dim) for _ in range(cfg.n_q))
        self.text_emb = nn.Embedding(cfg.text_card + 1, cfg.dim)
        self.embedding_addresses = EmbeddingTables()  # embed_column's kernel reads the tables through it
        self.transformer = Transformer(cfg)
        self.out_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.text_linear = nn.Linear(cfg.dim, cfg.text_card, bias=False)
        self.depformer_in = nn.ModuleList(nn.Linear(cfg.dim, cfg.depformer_dim, bias=False) for _ in range(steps))
        self.depformer_emb = nn.ModuleList(nn.Embedding(cfg.card + 1, cfg.depformer_dim) for _ in range(steps - 1))
        self.depformer_text_emb = nn.Embedding(cfg.text_card + 1, cfg.depformer_dim)
        self.depformer = Depformer(cfg, steps)
        self.linears = nn.ModuleList(nn.Linear(cfg.depformer_dim, cfg.card, bias=False) for _ in range(steps))

    def with_fp8_weights(self) -> LM:
        """This model with the temporal transformer's products (q/k/v, output, and the FFN's two) in e4m3 with a
        scale per output channel, the inputs quantized per row: half the bytes of the largest weights and the fp8
        tensor-core rate. Everything else is shared with this model, whose own weights stay as they are. Not
        exact: `bench.token_agreement --candidates fp8_weights` measures how far greedy tokens move."""
        other = sibling(self)
        other.transformer = sibling(self.transformer)
        other.transformer.layers = nn.ModuleList()
        for layer in self.transformer.layers:
            fp8 = sibling(layer)
            fp8.self_attn, fp8.gating = sibling(layer.self_attn), sibling(layer.gating)
            fp8.self_attn.in_proj_fp8 = Fp8Linear(layer.self_attn.in_proj_weight)
            fp8.self_attn.out_proj = Fp8Linear.of(layer.self_attn.out_proj)
            fp8.gating.linear_in = Fp8Linear.of(layer.gating.linear_in)
            fp8.gating.linear_out = Fp8Linear.of(layer.gating.linear_out)
            other.transformer.layers.append(fp8)
        return other

    def delays(self, device: torch.device) -> Tensor:
        """Per-row delays [17] on `device` (not a buffer, so meta-device construction needs no re-init)."""
        return torch.tensor(self.cfg.delays, dtype=torch.long, device=device)

    # ----- state -------------------------------------------------------------------------------------------

    def init_state(self, batch_size: int, device: torch.device | str | None = None, fp8_kv: bool = False,
                   slots: int | None = None, pool_pages: int | None = None, page: int | None = None) -> LMState:
        """Fresh state for `batch_size` rows; `fp8_kv` stores the KV cache as e4m3 with per-vector scales.

        `slots` < context makes a short ring (a prompt's scratch row): it holds positions [0, slots) only.
        `pool_pages` pages of `page` frames make the KV a pool the engine maps rows into (model/engine/pages.py);
        without it every row holds its whole ring.
        """
        cfg = self.cfg
        device = device or self.text_linear.weight.device
        dtype = self.text_linear.weight.dtype
        slots = cfg.context if slots is None else slots
        shape = (cfg.num_layers, batch_size, cfg.num_heads, slots, cfg.head_dim)
        state = LMState(
            kv=KVStore.empty(shape, dtype, device, fp8_kv, page, pool_pages),
            kpos=torch.full((batch_size, slots), -1, device=device, dtype=torch.long),
            pos=torch.zeros(batch_size, device=device, dtype=torch.long),
            origin=torch.zeros(batch_size, device=device, dtype=torch.long),
            window=torch.full((batch_size,), slots, device=device, dtype=torch.long),
            ring=torch.zeros(batch_size, cfg.num_rows, RING_SIZE, device=device, dtype=torch.long),
            offset=torch.zeros(batch_size, device=device, dtype=torch.long),
            forced=torch.zeros(batch_size, cfg.num_rows, device=device, dtype=torch.bool),
        )
        self.reset_rows(state, torch.ones(batch_size, dtype=torch.bool, device=device))
        return state

    def initial_column(self, device: torch.device | str | None = None) -> Tensor:
        """The 'initial' token of every row: text 32000, audio 2048."""
        cfg = self.cfg
        col = torch.full((cfg.num_rows,), cfg.initial_audio_token, dtype=torch.long, device=device)
        col[0].fill_(cfg.initial_text_token)  # not `= int`: a host scalar's copy waits for the stream
        return col

    def _reset_all_but_kv(self, state: LMState, rows: Tensor) -> None:
        """Positions, call counters, forced tokens and the token ring of `rows` (bool [B]) as fresh."""
        keep = ~rows
        state.kpos.masked_fill_(rows.unsqueeze(1), -1)
        state.pos.masked_fill_(rows, 0)
        state.origin.masked_fill_(rows, 0)
        state.window.masked_fill_(rows, state.kv.slots)
        state.offset.masked_fill_(rows, 1)
        state.forced.masked_fill_(rows.unsqueeze(1), False)
        initial = self.initial_column(state.ring.device)
        fresh = torch.zeros_like(state.ring[:1])
        fresh[0, :, 0] = initial
        state.ring.copy_(torch.where(keep.view(-1, 1, 1), state.ring, fresh))

    def reset_rows(self, state: LMState, rows: Tensor) -> None:
        """Make `rows` (bool [B]) exactly fresh, as after the reference's dummy first call (o = 1)."""
        self._reset_all_but_kv(state, rows)
        # Zero the KV of reset rows so a recycled slot's memory never leaks into masked arithmetic (0 * nan).
        state.kv.zero_rows(rows)

    def reset_row(self, state: LMState, row: int, used: int | None = None) -> None:
        """reset_rows for one row, zeroing only the KV slots its last occupant wrote: slots fill in order from a
        reset, so those are the first min(pos, context), a few hundred for a short call instead of all 3000.

        `used` (an upper bound on those slots, kept by the caller) spares reading pos from the device, which would
        wait for every step queued before this reset.
        """
        if used is None:
            used = int(state.pos[row])
        used = min(used, self.cfg.context)
        one = state.rows(slice(row, row + 1))
        self._reset_all_but_kv(one, torch.ones(1, dtype=torch.bool, device=one.pos.device))
        state.kv.zero_slots(row, slice(0, used))

    # ----- embeddings --------------------------------------------------------------------------------------

    def embed_column(self, tokens: Tensor) -> Tensor:
        """tokens [..., 17] (text, 8 agent, 8 user) -> summed input embedding [..., dim].

        Audio embeddings are added in codebook order and the text embedding last, as the reference does (the
        order matters for bf16 parity). Negative ids (-1 "zero", -2 "ungenerated") embed to zero. One kernel on
        CUDA (model/embed_kernel.py), the same sum.
        """
        tables = [self.text_emb.weight, *(table.weight for table in self.emb)]
        return embed_column(tokens, tables, self.embedding_addresses)

    # ----- temporal transformer ----------------------------------------------------------------------------

    def temporal_step(self, x: Tensor, state: LMState, active: Tensor | None = None) -> Tensor:
        """One frame for every row: x [B, dim] at each row's `pos` -> post-out_norm hidden [B, dim].

        Writes each row's K/V into its ring slot (pos - origin) % window and advances nothing else (the caller
        owns pos). Rows where `active` (bool [B]) is False keep their cache exactly as it was.
        """
        cfg = self.cfg
        B = x.shape[0]
        frames = state.pos - state.origin
        slot = (frames % state.window).view(B, 1)
        new_kpos = state.pos.view(B, 1)
        if active is not None:
            new_kpos = torch.where(active.view(B, 1), new_kpos, state.kpos.gather(1, slot))
        state.kpos.scatter_(1, slot, new_kpos)
        # Valid keys fill slots [0, n_valid): rows fill the ring in order from their origin, and a wrapped ring is
        # full.
        n_valid = torch.minimum(frames + 1, state.window)
        order = longest_first(n_valid) if use_kernel(x.device) else None
        rotation = rope_rotation(state.pos, cfg.head_dim, cfg.max_period)  # [B, half, 2]
        layers = self.transformer.layers
        h = x.unsqueeze(1)
        normed = layers[0].norm1(h)
        for i, layer in enumerate(layers):
            projected = layer.self_attn.project(normed).view(B, -1)
            q = rope_and_store(state.kv, i, projected, rotation, slot.view(B), active)
            o = decode_attention(q, state.kv, i, n_valid, order)
            h, normed = add_rms_norm(h, layer.self_attn.out_proj(o.flatten(1)).unsqueeze(1), layer.norm2.alpha,
                                     layer.norm2.eps)
            following = self._norm_after(i)
            h, normed = add_rms_norm(h, layer.gating(normed), following.alpha, following.eps)
        return normed.squeeze(1)

    def _norm_after(self, i: int) -> RMSNorm:
        """The norm that follows temporal layer i: the next layer's first, or the output norm."""
        layers = self.transformer.layers
        return layers[i + 1].norm1 if i + 1 < len(layers) else self.out_norm

    def prefill(self, x: Tensor, state: LMState, row: int, window: int | None = None, origin: int = 0,
                ring: int | None = None) -> Tensor:
        """Run T known frames x [T, dim] for one row in one forward -> post-out_norm hidden [T, dim].

        Attends to the row's existing ring plus the chunk itself (causal, sliding window of the ring's size), then
        keeps the chunk's last keys in the ring. Equals T calls of `temporal_step` on that row.
        `window` fixes the ring slots read to [0, window), masked by position, instead of the slots below the
        row's position (read from the device): a fixed shape and no host sync, as CUDA graphs need.
        `origin` and `ring` are the row's ring as `temporal_step` sees it (`state.origin`, `state.window`: a live
        row's ring the page pool shrank or slid); by default a fresh row's, `context` slots from frame 0.
        """
        cfg = self.cfg
        T = x.shape[0]
        C = cfg.context if ring is None else ring
        p0 = state.pos[row]
        qpos = p0 + torch.arange(T, device=x.device)
        # Position p sits in slot (p - origin) % C, so before the ring wraps only the slots below the row's position
        # can hold keys: read and attend to those, not the whole ring (a prompt is a few hundred frames of a
        # 3000-slot ring).
        span = min(int(p0) - origin, C) if window is None else window
        old = state.kpos[row, :span]
        old_ok = (old >= 0).unsqueeze(0) & (old.unsqueeze(0) > qpos.unsqueeze(1) - C)
        rel = torch.arange(T, device=x.device)
        new_ok = (rel.unsqueeze(0) <= rel.unsqueeze(1)) & (rel.unsqueeze(0) > rel.unsqueeze(1) - C)
        mask = torch.cat((old_ok, new_ok), dim=1).view(1, 1, T, span + T)
        rotation = rope_rotation(qpos.view(1, 1, T), cfg.head_dim, cfg.max_period)
        keep = min(T, C)
        slots = ((qpos[T - keep :] - origin) % C).long()
        layers = self.transformer.layers
        h = x.unsqueeze(0)
        normed = layers[0].norm1(h)
        for i, layer in enumerate(layers):
            q, k, v = layer.self_attn.qkv(normed)
            q, k = apply_rope(q, rotation), apply_rope(k, rotation)
            old_k, old_v = state.kv.read_row(i, row, k.dtype, span)
            keys = torch.cat((old_k.unsqueeze(0), k), dim=2)
            values = torch.cat((old_v.unsqueeze(0), v), dim=2)
            with sdpa_kernel(PREFILL_BACKENDS):
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            state.kv.write_span(i, row, slots, k[0, :, T - keep :], v[0, :, T - keep :])
            h, normed = add_rms_norm(h, layer.self_attn.out_proj(o.transpose(1, 2).flatten(2)), layer.norm2.alpha,
                                     layer.norm2.eps)
            following = self._norm_after(i)
            h, normed = add_rms_norm(h, layer.gating(normed), following.alpha, following.eps)
        state.kpos[row, slots] = qpos[T - keep :]
        state.pos[row] += T
        return normed.squeeze(0)

    def text_logits(self, hidden: Tensor) -> Tensor:
        return self.text_linear(hidden).float()

    # ----- depformer ---------------------------------------------------------------------------------------

    def depformer_step(self, step: int, x: Tensor, cache: DepformerCache) -> Tensor:
        """Depformer step `step` for every row: x [B, depformer_dim] -> audio logits [B, card], in the weights'
        dtype (`sample` reads them as float32: the fused draw as it loads them, one cast kernel a draw fewer).

        `cache.kv[layer]` holds (k, v) [B, heads, steps, head_dim] of the earlier steps of this frame; causal over
        steps, no positional encoding.
        """
        layers = self.depformer.layers
        h = x
        normed = layers[0].norm1(h)
        position = cache.steps[step : step + 1]
        for i, (layer, (ck, cv)) in enumerate(zip(layers, cache.kv, strict=True)):
            attn = layer.self_attn
            w_in, w_out = attn.step_weights(step)
            o = depformer_attention(F.linear(normed, w_in), ck, cv, position, attn.num_heads)
            h, normed = add_rms_norm(h, F.linear(o, w_out), layer.norm2.alpha, layer.norm2.eps)
            delta = layer.gating[step](normed)
            if i + 1 < len(layers):
                h, normed = add_rms_norm(h, delta, layers[i + 1].norm1.alpha, layers[i + 1].norm1.eps)
            else:
                h = h + delta
        return self.linears[step](h)

    def depformer_step_fused(self, step: int, hidden: Tensor, previous: Tensor, cache: DepformerCache) -> Tensor:
        """depformer_step of `depformer_in[step](hidden) + previous` through model.depformer_kernels: five launches a
        layer where the torch path takes eight, each residual add and norm in the next product's prologue, the SiLU
        gate in its product's epilogue (EngineConfig.fused_depformer, a lone row; not bit-exact)."""
        _, h = fused_linear(hidden, self.depformer_in[step].weight, add=previous)
        position = cache.steps[step : step + 1]
        delta: Tensor | None = None
        for layer, (ck, cv) in zip(self.depformer.layers, cache.kv, strict=True):
            attn, ffn = layer.self_attn, layer.gating[step]
            w_in, w_out = attn.step_weights(step)
            h, qkv = fused_linear(h, w_in, delta=delta, alpha=layer.norm1.alpha, eps=layer.norm1.eps)
            _, mixed = fused_linear(depformer_attention(qkv, ck, cv, position, attn.num_heads), w_out)
            h, gated = fused_linear(h, ffn.linear_in.weight, delta=mixed, alpha=layer.norm2.alpha, eps=layer.norm2.eps,
                                    gate=True)
            _, delta = fused_linear(gated, ffn.linear_out.weight)
        return fused_linear(h, self.linears[step].weight, delta=delta, out_dtype=torch.float32)[1]

    def depformer_cache(self, batch_size: int) -> DepformerCache:
        cfg = self.cfg
        w = self.linears[0].weight
        heads = cfg.depformer_num_heads
        shape = (batch_size, heads, self.depformer_steps, cfg.depformer_dim // heads)
        kv = [(torch.zeros(shape, device=w.device, dtype=w.dtype), torch.zeros(shape, device=w.device, dtype=w.dtype))
              for _ in range(cfg.depformer_num_layers)]
        return DepformerCache(kv, torch.arange(self.depformer_steps, device=w.device))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
