"""Session prompts: voice, silence, `<system> persona <system>`, silence (spec/model.md §6), as one prefill.

Every cell of every prompt frame is known in advance, so the token ring's evolution is simulated on the host
and the temporal transformer sees the whole prompt in one chunked forward. A voice is either Mimi codes (from a
`.wav`) or the reference's `.pt` form: the summed input embeddings of the voice calls plus the ring after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.config import SILENCE_TOKENS, SINE_TOKENS, TEXT_PAD, LMConfig
from model.lm import LM, RING_SIZE, LMState

SPACER_FRAMES = 6  # int(0.5 s * 12.5 Hz)


@dataclass
class VoicePrompt:
    """A voice in replayable form: `embeddings` [N - 1, dim] for calls 1..N-1, `ring` [17, 4] after them."""

    embeddings: Tensor
    ring: Tensor

    @property
    def frames(self) -> int:
        return self.embeddings.shape[0] + 1

    def to_reference(self) -> dict[str, Tensor]:
        """The bundled `.pt` layout: embeddings [N-1, 1, 1, dim], cache [1, 17, 4]."""
        dim = self.embeddings.shape[-1]
        return {"embeddings": self.embeddings.view(-1, 1, 1, dim), "cache": self.ring.view(1, *self.ring.shape)}

    @classmethod
    def from_reference(cls, data: dict[str, Tensor], dim: int, where: str) -> VoicePrompt:
        if not isinstance(data, dict) or "embeddings" not in data or "cache" not in data:
            raise ValueError(f"{where}: a voice .pt must hold 'embeddings' and 'cache'")
        emb, cache = data["embeddings"], data["cache"]
        if emb.dim() != 4 or emb.shape[1:] != (1, 1, dim):
            raise ValueError(f"{where}: 'embeddings' has shape {tuple(emb.shape)}, expected [N-1, 1, 1, {dim}]")
        if tuple(cache.shape) != (1, 17, RING_SIZE):
            raise ValueError(f"{where}: 'cache' has shape {tuple(cache.shape)}, expected [1, 17, {RING_SIZE}]")
        return cls(embeddings=emb.reshape(-1, dim), ring=cache.reshape(17, RING_SIZE).long())


@dataclass
class PromptPlan:
    """What a prompt does to one row: the temporal inputs to prefill, then the ring and call counter after it."""

    embeddings: Tensor  # [T, dim]
    ring: Tensor  # [17, 4] long
    offset: int


def persona_text(persona: str) -> str:
    """The text prompt as the reference builds it: '' for no persona, else stripped and wrapped in `<system>` tags
    (unless already wrapped). A whitespace-only persona is a persona: it becomes '<system>  <system>'."""
    if not persona:
        return ""
    text = persona.strip()
    if text.startswith("<system>") and text.endswith("<system>"):
        return text
    return f"<system> {text} <system>"


def persona_tokens(tokenizer, persona: str) -> list[int]:
    text = persona_text(persona)
    return list(tokenizer.encode(text)) if text else []


def forced_frame(cfg: LMConfig, text: int, agent: tuple[int, ...] | list[int]) -> list[int]:
    return [text, *agent, *SINE_TOKENS[: cfg.num_audio_codebooks]]


def prompt_frames(cfg: LMConfig, voice_codes: Tensor | None, persona: list[int]) -> list[list[int]]:
    """Frames of a prompt after the voice: voice codes [N, 8] (if a `.wav` voice), spacer, persona, spacer."""
    silence = SILENCE_TOKENS[: cfg.num_audio_codebooks]
    frames: list[list[int]] = []
    if voice_codes is not None:
        frames += [forced_frame(cfg, TEXT_PAD, row) for row in voice_codes.tolist()]
    frames += [forced_frame(cfg, TEXT_PAD, silence) for _ in range(SPACER_FRAMES)]
    frames += [forced_frame(cfg, tok, silence) for tok in persona]
    frames += [forced_frame(cfg, TEXT_PAD, silence) for _ in range(SPACER_FRAMES)]
    return frames


def simulate_ring(cfg: LMConfig, initial: Tensor, ring: Tensor, offset: int, frames: list[list[int]]):
    """Run the reference's forced calls on a host copy of one row's ring.

    With offset 0 the first frame is the dummy call (dropped, spec §5.3). Returns the input column of every
    call that reaches the transformer [n, 17], the final ring and the final call counter.
    """
    cells = ring.cpu().numpy().copy()  # numpy: a prompt is hundreds of calls of 17 scalar writes each
    start = initial.cpu().numpy()
    delays = np.asarray(cfg.delays)
    rows = np.arange(len(delays))
    inputs: list[np.ndarray] = []
    for frame in frames:
        cells[rows, (offset + delays) % RING_SIZE] = frame
        if offset == 0:
            cells[:, 0] = start
            offset = 1
            continue
        warm = offset <= delays
        cells[rows[warm], offset % RING_SIZE] = start[warm]
        inputs.append(cells[:, (offset - 1) % RING_SIZE].copy())
        offset += 1
    columns = np.stack(inputs) if inputs else np.zeros((0, len(delays)), dtype=np.int64)
    return torch.from_numpy(columns), torch.from_numpy(cells), offset


@torch.no_grad()
def plan_prompt(lm: LM, voice: VoicePrompt | Tensor | None, persona: list[int]) -> PromptPlan:
    """Plan a session prompt for a fresh row. `voice` is a VoicePrompt, Mimi codes [N, 8] from a wav, or None."""
    cfg = lm.cfg
    device = lm.text_linear.weight.device
    initial = lm.initial_column()
    if isinstance(voice, VoicePrompt):
        ring, offset = voice.ring.clone(), voice.frames
        head = [voice.embeddings.to(device=device, dtype=lm.text_linear.weight.dtype)]
        frames = prompt_frames(cfg, None, persona)
    else:  # no voice and no persona still play both spacers, as the reference does
        ring, offset, head = torch.zeros(cfg.num_rows, RING_SIZE, dtype=torch.long), 0, []
        frames = prompt_frames(cfg, voice, persona)
    columns, ring, offset = simulate_ring(cfg, initial, ring, offset, frames)
    embeddings = torch.cat([*head, lm.embed_column(columns.to(device))])
    return PromptPlan(embeddings=embeddings, ring=ring, offset=offset)


@torch.no_grad()
def plan_continuation(lm: LM, ring: Tensor, offset: int, persona: list[int], pending: bool) -> PromptPlan:
    """Plan a prompt (spacer, `<system>` text, spacer) for a row in the middle of a conversation: its ring [17, 4]
    and call counter as they are, prefilled after the context it has (a persona changed mid-call).

    `pending`: the row ran the model half of call `offset - 1` ahead of that call's user frame (the engine's order,
    model/step.py), so that frame is incomplete: its user codes are written as the prompt's frames carry them (the
    sine codes) and its agent codes still to be sampled as silence, as if caller and model were silent for it.
    Without `pending` (right after a prompt) the row's last frame is complete and the prompt simply goes on.
    """
    cfg = lm.cfg
    cells = ring.clone().cpu()
    if pending:
        frame = forced_frame(cfg, TEXT_PAD, SILENCE_TOKENS[: cfg.num_audio_codebooks])
        for r, delay in enumerate(cfg.delays):
            if delay > 0 or r > cfg.num_audio_codebooks:  # the cells call offset - 1 has not written
                cells[r, (offset - 1 + delay) % RING_SIZE] = frame[r]
    columns, cells, offset = simulate_ring(cfg, lm.initial_column(), cells, offset,
                                           prompt_frames(cfg, None, persona))
    embeddings = lm.embed_column(columns.to(lm.text_linear.weight.device))
    return PromptPlan(embeddings=embeddings, ring=cells, offset=offset)


def plan_voice(lm: LM, voice_codes: Tensor) -> VoicePrompt:
    """Turn a wav voice's Mimi codes [N, 8] into the replayable `.pt` form (what the reference saves)."""
    frames = [forced_frame(lm.cfg, TEXT_PAD, row) for row in voice_codes.tolist()]
    zero = torch.zeros(lm.cfg.num_rows, RING_SIZE, dtype=torch.long)
    columns, ring, _ = simulate_ring(lm.cfg, lm.initial_column(), zero, 0, frames)
    with torch.no_grad():
        embeddings = lm.embed_column(columns.to(lm.text_linear.weight.device))
    return VoicePrompt(embeddings=embeddings.cpu(), ring=ring)


@torch.no_grad()
def apply_prompt(lm: LM, state: LMState, row: int, plan: PromptPlan, chunk: int | None = None) -> None:
    """Reset `row` and run the plan: prefill in chunks of `chunk` frames (None: one forward), set ring and counter."""
    lm.reset_row(state, row)
    total = plan.embeddings.shape[0]
    step = total if chunk is None else chunk
    for start in range(0, total, max(step, 1)):
        lm.prefill(plan.embeddings[start : start + step], state, row)
    finish_prompt(lm, state, row, plan)


def finish_prompt(lm: LM, state: LMState, row: int, plan: PromptPlan) -> None:
    """After the plan's prefill: set the row's ring, call counter and forced tokens."""
    device = state.ring.device
    state.ring[row] = plan.ring.to(device)
    state.offset[row] = plan.offset
    # The last prompt frame's delayed codes sit in the next call's target column, as the reference's
    # `provided` mask keeps them: the first conversation call must not resample them.
    state.forced[row] = lm.delays(device) > 0
