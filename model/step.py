"""One conversation frame for a batch of rows: user codes in, one complete token frame out.

This is the reference's `LMGen.step` (spec/model.md §5.2) with a per-row call counter, written as fixed-shape
tensor ops so the engine can capture it in a CUDA graph: write the user's codes into the token ring, apply the
warm-up, run the temporal transformer on the previous column, sample text, run the agent's depformer steps,
and gather the frame that became complete.

Call o writes user frame o into columns o and o + 1, but its transformer reads column o - 1 and its outputs never
read those cells (§5.3: a user frame first reaches the transformer on the next call). So the model half of call
o + 1 needs nothing beyond user frame o: the engine runs it as soon as frame o is encoded and emits frame o one
call (80 ms) sooner than the reference, with the same tokens. `write_user_codes(ahead=1)` is that order's write.

The ring's bookkeeping around the model (the user's cells, the warm-up's given tokens, the column the transformer
reads, the frame's write, the completed frame, the counters) is integer work: about thirty small launches a call as
torch ops. It is written here as three fusable helpers, one per place in the call, which the engine compiles into a
kernel or two each (model/fused.py); integer arithmetic fused is the same arithmetic, so the tokens do not move
(tests/test_step.py). The call's cells are written once, at its end: the temporal half reads only the column before
its target, so the target's given tokens need not be in the ring until the frame's tokens join them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.depformer_kernels import FUSED_ROWS_MAX
from model.fused import fusable
from model.lm import LM, DepformerCache, LMState
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


def _cells(ring: Tensor, columns: Tensor) -> Tensor:
    """ring [B, R, S], columns [B, R] or [B, 1] -> bool [B, R, S]: the cell of each row's column."""
    slots = torch.arange(ring.shape[2], device=ring.device)
    return slots.view(1, 1, -1) == columns.unsqueeze(2)


def _at_columns(ring: Tensor, columns: Tensor) -> Tensor:
    """ring [B, R, S], columns [B, R] -> ring[b, r, columns[b, r]] as [B, R]."""
    return ring.gather(2, columns.unsqueeze(2)).squeeze(2)


@fusable
def _place_user_codes(ring: Tensor, offset: Tensor, user_codes: Tensor, delays: Tensor, active: Tensor | None,
                      ahead: int) -> None:
    """The user rows' cells of call `offset - ahead` (each at its delay) take user_codes [B, U], active rows only."""
    B, R, S = ring.shape
    first_user_row = R - user_codes.shape[1]
    cells = _cells(ring, ((offset - ahead).unsqueeze(1) + delays).remainder(S))
    cells &= (torch.arange(R, device=ring.device) >= first_user_row).view(1, R, 1)
    if active is not None:
        cells &= active.view(B, 1, 1)
    codes = torch.nn.functional.pad(user_codes, (first_user_row, 0))  # [B, R], the user's codes in their rows
    ring.copy_(torch.where(cells, codes.unsqueeze(2), ring))


@fusable
def _column_inputs(ring: Tensor, offset: Tensor, was_forced: Tensor, delays: Tensor, initial: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """The call's given tokens (its target column's, or the initial token inside a row's delay), which of them are
    forced, and the column the transformer reads (the one before the target): each [B, R]."""
    B, R, S = ring.shape
    warm = offset.unsqueeze(1) <= delays.unsqueeze(0)
    given = torch.where(warm, initial, _at_columns(ring, (offset % S).view(B, 1).expand(B, R)))
    inputs = _at_columns(ring, ((offset - 1) % S).view(B, 1).expand(B, R))
    return given, warm | was_forced, inputs


@fusable
def _close_call(ring: Tensor, offset: Tensor, pos: Tensor, forced: Tensor, tokens: Tensor, given: Tensor,
                delays: Tensor, active: Tensor | None) -> tuple[Tensor, Tensor]:
    """The call's target column (its tokens [B, T], then the given user tokens) into the ring, the frame that
    became complete [B, R], whether a row emitted it [B], and the counters, for active rows only. The frame is
    read from the written column on every row (an inactive row's is not emitted, and its ring stays as it was)."""
    B, R, S = ring.shape
    column = torch.cat([tokens, given[:, tokens.shape[1]:]], dim=1)
    written = torch.where(_cells(ring, (offset % S).view(B, 1)), column.unsqueeze(2), ring)
    frame = _at_columns(written, (offset.unsqueeze(1) - 1 + delays.unsqueeze(0)) % S)
    emitted = offset >= 2
    if active is None:
        ring.copy_(written)
        forced.zero_()
        offset += 1
        pos += 1
        return frame, emitted
    ring.copy_(torch.where(active.view(B, 1, 1), written, ring))
    forced.copy_(forced & ~active.unsqueeze(1))
    stepped = active.long()
    offset += stepped
    pos += stepped
    return frame, emitted & active


@dataclass
class TemporalResult:
    """What the temporal half of a call hands the depformer half."""

    hidden: Tensor  # [B, dim] post-out_norm
    text: Tensor  # [B] text token (sampled or forced)
    given: Tensor  # [B, R] tokens already in the target column (forced values where `forced`), or initial ones
    forced: Tensor  # [B, R] bool


def write_user_codes(state: LMState, user_codes: Tensor, const: StepConstants, active: Tensor | None = None,
                     ahead: int = 0) -> None:
    """User codes [B, 8] of the frame owned by call `offset - ahead` into its ring columns (active rows only).

    `ahead` is how many model halves the rows have already run past that call: 0 in the reference order, 1 when
    the engine runs the model half one call ahead (module docstring).
    """
    _place_user_codes(state.ring, state.offset, user_codes, const.delays, active, ahead)


def temporal_half(
    lm: LM,
    state: LMState,
    text_sampling: RowSampling,
    const: StepConstants,
    active: Tensor | None = None,
) -> TemporalResult:
    """Warm-up, the temporal transformer on the previous column, the text token."""
    given, forced, inputs = _column_inputs(state.ring, state.offset, state.forced, const.delays, const.initial)
    hidden = lm.temporal_step(lm.embed_column(inputs), state, active)
    text = sample(lm.text_logits(hidden), text_sampling, state.offset, 0, const.max_top_k_text,
                  forced=Forced(forced[:, 0], given[:, 0]))
    return TemporalResult(hidden, text, given, forced)


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
    o = state.offset
    B = o.shape[0]
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
    # Stacked here, not in the compiled helper: Inductor copies a concatenation of more than eight inputs one
    # kernel each, where torch's stack is one.
    return _close_call(state.ring, o, state.pos, state.forced, torch.stack(tokens, dim=1), given, const.delays,
                       active)


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
    write_user_codes(state, user_codes, const, active)
    temporal = temporal_half(lm, state, text_sampling, const, active)
    return depformer_half(lm, state, temporal, audio_sampling, dep_cache, const, active)
