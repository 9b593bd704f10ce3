"""The step's ring bookkeeping (model/step.py): compiled as the engine runs it, every cell and counter of its eager
path, which the oracle tests hold to the reference."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import compiled_helpers

from model import step
from model.config import LMConfig
from model.lm import RING_SIZE

pytestmark = pytest.mark.filterwarnings(  # Inductor's import (tests/test_fused.py says why)
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script")

CFG = LMConfig()
AGENT_TOKENS = 1 + CFG.num_audio_codebooks  # text and the agent's codes: what a call's depformer half draws
USER_CODES = CFG.num_rows - AGENT_TOKENS


def _state(rows: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    """A ring of tokens and counters as rows meet them: some still inside their delays (offset 0-2), some forced."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.randint(0, 7, (rows,), generator=g)
    return {k: v.to(device) for k, v in {
        "ring": torch.randint(0, CFG.card + 1, (rows, CFG.num_rows, RING_SIZE), generator=g),
        "offset": offset,
        "pos": offset - 1,
        "forced": torch.rand(rows, CFG.num_rows, generator=g) < 0.3,
    }.items()}


def _call(state: dict[str, torch.Tensor], active: torch.Tensor | None, ahead: int, seed: int
          ) -> list[torch.Tensor]:
    """One call's bookkeeping on a copy of `state` with drawn tokens in place of the model's: what it returns and
    the state it leaves."""
    s = {k: v.clone() for k, v in state.items()}
    rows, device = s["offset"].shape[0], s["offset"].device
    g = torch.Generator().manual_seed(seed)
    delays = torch.tensor(CFG.delays, device=device)
    initial = torch.tensor([CFG.initial_text_token] + [CFG.initial_audio_token] * (CFG.num_rows - 1), device=device)
    user_codes = torch.randint(0, CFG.card, (rows, USER_CODES), generator=g).to(device)
    tokens = torch.randint(0, CFG.card, (rows, AGENT_TOKENS), generator=g).to(device)
    step._place_user_codes(s["ring"], s["offset"], user_codes, delays, active, ahead)
    given, forced, inputs = step._column_inputs(s["ring"], s["offset"], s["forced"], delays, initial)
    frame, emitted = step._close_call(s["ring"], s["offset"], s["pos"], s["forced"], tokens, given, delays, active)
    return [given, forced, inputs, frame, emitted, *s.values()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA only"))])
def test_the_steps_compiled_bookkeeping_leaves_every_cell_and_counter_of_its_eager_path(device: str) -> None:
    """User codes in at their delays, the warm-up's initial tokens, forced cells, the column the transformer reads,
    the frame's write and the completed frame, the counters: compiled (one graph or two a helper) against eager, at
    one row and 250, every row active or some idle (an idle row's ring and counters stay as they were), in the
    reference's order and one call ahead, and on a one-row view inside a larger state (the engine's input-clocked
    steps)."""
    cases = []
    for rows, seed in ((1, 0), (250, 1), (5, 2)):
        state = _state(rows, seed, device)
        idle = torch.arange(rows, device=device) % 3 == 1
        for active in (None, ~idle):
            for ahead in (0, 1):
                cases.append((state, active, ahead, seed))
    big = _state(6, 3, device)
    view = {k: v[4:5] for k, v in big.items()}
    cases.append((view, torch.ones(1, dtype=torch.bool, device=device), 1, 4))

    eager = [_call(*case) for case in cases]
    with compiled_helpers():
        compiled = [_call(*case) for case in cases]
    for (state, active, ahead, seed), want, got in zip(cases, eager, compiled, strict=True):
        for k, (a, b) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(a, b), f"rows {len(state['offset'])}, ahead {ahead}, seed {seed}: output {k}"
        if active is not None:  # an idle row is left exactly as it was
            idle = ~active
            ring, offset, pos, forced = want[5:]
            assert torch.equal(ring[idle], state["ring"][idle]) and torch.equal(offset[idle], state["offset"][idle])
            assert torch.equal(pos[idle], state["pos"][idle]) and torch.equal(forced[idle], state["forced"][idle])
            assert not want[4][idle].any()
