"""One conversation frame for a batch of rows: user codes in, one complete token frame out.

This is the reference's `LMGen.step` (spec/model.md §5.2) with a per-row call counter, written as fixed-shape
tensor ops so the engine can capture it in a CUDA graph: write the user's codes into the token ring, apply the
warm-up, run the temporal transformer on the previous column, sample text, run the agent's depformer steps,
and gather the frame that became complete.

Call o writes user frame o into columns o and o + 1, but its transformer reads column o - 1 and its outputs never
read those cells (§5.3: a user frame first reaches the transformer on the next call). So the model half of call
o + 1 needs nothing beyond user frame o: the engine runs it as soon as frame o is encoded and emits frame o one
call (80 ms) sooner than the reference, with the same tokens. `write_user_codes(ahead=1)` is that order's write.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.depformer_kernels import FUSED_ROWS_MAX
from model.lm import LM, RING_SIZE, DepformerCache, LMState
from model.sampling import Forced, RowSampling, sample
from model.sampling_params import MAX_TOP_K_AUDIO, MAX_TOP_K_TEXT


@dataclass
class StepConstants:
    """Device tensors the step needs, made once outside any graph capture."""

    delays: Tensor  # [17] long
    initial: Tensor  # [17] long
    max_top_k_text: int
    max_top_k_audio: int
    fused_draw: bool = True  # the audio draws as one kernel each on CUDA (EngineConfig.fused_draw)
    fused_depformer: bool = False  # a lone row's depformer products fused (EngineConfig.fused_depformer)

    @classmethod
    def make(
        cls, lm: LM, device: torch.device, max_top_k_text: int = MAX_TOP_K_TEXT, max_top_k_audio: int = MAX_TOP_K_AUDIO,
        fused_draw: bool = True, fused_depformer: bool = False,
    ) -> StepConstants:
        return cls(
            delays=lm.delays(device),
            initial=lm.initial_column(device),
            max_top_k_text=max_top_k_text,
            max_top_k_audio=max_top_k_audio,
            fused_draw=fused_draw,
            fused_depformer=fused_depformer,
        )


def _gather_columns(ring: Tensor, cols: Tensor) -> Tensor:
    """ring [B, R, 4], cols [B, R] -> ring[b, r, cols[b, r]] as [B, R]."""
    return ring.gather(2, cols.unsqueeze(2)).squeeze(2)


@dataclass
class TemporalResult:
    """What the temporal half of a call hands the depformer half."""

    hidden: Tensor  # [B, dim] post-out_norm
    text: Tensor  # [B] text token (sampled or forced)
    given: Tensor  # [B, R] tokens already in the target column (forced values where `forced`)
    forced: Tensor  # [B, R] bool
    ring_before: Tensor | None  # ring at the start of the call, when an exec mask is in use


def write_user_codes(lm: LM, state: LMState, user_codes: Tensor, const: StepConstants, active: Tensor | None = None,
                     ahead: int = 0) -> None:
    """User codes [B, 8] of the frame owned by call `offset - ahead` into its ring columns (active rows only).

    `ahead` is how many model halves the rows have already run past that call: 0 in the reference order, 1 when
    the engine runs the model half one call ahead (module docstring).
    """
    ring = state.ring
    user_rows = slice(1 + lm.cfg.num_audio_codebooks, ring.shape[1])
    cols = ((state.offset - ahead).unsqueeze(1) + const.delays[user_rows]).remainder(RING_SIZE).unsqueeze(2)
    codes = user_codes.unsqueeze(2)
    if active is not None:
        codes = torch.where(active.view(-1, 1, 1), codes, ring[:, user_rows].gather(2, cols))
    ring[:, user_rows].scatter_(2, cols, codes)


def temporal_half(
    lm: LM,
    state: LMState,
    text_sampling: RowSampling,
    const: StepConstants,
    active: Tensor | None = None,
) -> TemporalResult:
    """Warm-up, the temporal transformer on the previous column, the text token."""
    ring, o = state.ring, state.offset
    B, R, _ = ring.shape
    ring_before = ring.clone() if active is not None else None
    delays = const.delays

    warm = o.unsqueeze(1) <= delays.unsqueeze(0)  # [B, R]: rows still inside their delay get the initial token
    target = (o % RING_SIZE).view(B, 1, 1).expand(B, R, 1)
    given = torch.where(warm, const.initial, ring.gather(2, target).squeeze(2))
    ring.scatter_(2, target, given.unsqueeze(2))
    forced = warm | state.forced

    inputs = ring.gather(2, ((o - 1) % RING_SIZE).view(B, 1, 1).expand(B, R, 1)).squeeze(2)
    hidden = lm.temporal_step(lm.embed_column(inputs), state, active)
    text = sample(lm.text_logits(hidden), text_sampling, o, 0, const.max_top_k_text,
                  forced=Forced(forced[:, 0], given[:, 0]))
    return TemporalResult(hidden, text, given, forced, ring_before)


def depformer_half(
    lm: LM,
    state: LMState,
    temporal: TemporalResult,
    audio_sampling: RowSampling,
    dep_cache: DepformerCache,
    const: StepConstants,
    active: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The agent's depformer steps, the ring write, the completed frame, and the counters."""
    ring, o = state.ring, state.offset
    B, R, _ = ring.shape
    K = lm.cfg.num_audio_codebooks
    hidden, forced, given = temporal.hidden, temporal.forced, temporal.given
    tokens = [temporal.text]
    previous = lm.depformer_text_emb(temporal.text)
    fused = const.fused_depformer and B <= FUSED_ROWS_MAX
    for k in range(K):
        if fused:
            logits = lm.depformer_step_fused(k, hidden, previous, dep_cache)
        else:
            logits = lm.depformer_step(k, lm.depformer_in[k](hidden) + previous, dep_cache)
        token = sample(logits, audio_sampling, o, 1 + k, const.max_top_k_audio, const.fused_draw,
                       Forced(forced[:, 1 + k], given[:, 1 + k]))
        tokens.append(token)
        if k + 1 < K:
            previous = lm.depformer_emb[k](token)
    target = (o % RING_SIZE).view(B, 1, 1).expand(B, 1 + K, 1)
    ring[:, : 1 + K].scatter_(2, target, torch.stack(tokens, dim=1).unsqueeze(2))

    frame = _gather_columns(ring, (o.unsqueeze(1) - 1 + const.delays.unsqueeze(0)) % RING_SIZE)
    emitted = o >= 2
    if active is None:
        state.forced.zero_()
        state.offset += 1
        state.pos += 1
        return frame, emitted
    ring.copy_(torch.where(active.view(B, 1, 1), ring, temporal.ring_before))
    state.forced.masked_fill_(active.unsqueeze(1), False)
    state.offset += active.long()
    state.pos += active.long()
    return frame, emitted & active


def frame_step(
    lm: LM,
    state: LMState,
    user_codes: Tensor,
    text_sampling: RowSampling,
    audio_sampling: RowSampling,
    dep_cache: DepformerCache,
    const: StepConstants,
    active: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advance every row by one call; rows where `active` (bool [B]) is False are left exactly unchanged.

    user_codes [B, 8] are the user's Mimi codes for this call's frame. Returns (frame [B, 17], emitted [B] bool):
    the complete token frame o - 1 (text, 8 agent, 8 user codes) and whether the row emitted one (o >= 2).
    """
    write_user_codes(lm, state, user_codes, const, active)
    temporal = temporal_half(lm, state, text_sampling, const, active)
    return depformer_half(lm, state, temporal, audio_sampling, dep_cache, const, active)
