"""The fused draw (one Triton kernel per row, model/sampling.py) against the torch ops it replaces: on CUDA as the
engine runs it, and without CUDA through Triton's interpreter (tests/conftest.py sets it), so CI checks it too."""

from __future__ import annotations

import pytest
import torch

from model.sampling import Forced, RowSampling, draw_reference, draw_triton, row_sampling, sample
from model.sampling_params import SamplingParams

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mixed_rows(rows: int, top_ks: list[int], seed: int) -> RowSampling:
    """Sampling settings of `rows` rows cycling through greedy, temperature 0 and sampled rows of each top_k."""
    kinds = [SamplingParams(greedy=True), SamplingParams(greedy=False, temp_audio=0.0)]
    kinds += [SamplingParams(greedy=False, temp_audio=t, topk_audio=k) for k in top_ks for t in (0.8, 1.3)]
    params = [kinds[r % len(kinds)] for r in range(rows)]
    _, audio = row_sampling(params, [seed + r for r in range(rows)], torch.device(DEVICE))
    return audio


@pytest.mark.parametrize("vocab", [2048, 100])
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's max of NaN rows
def test_the_fused_draw_equals_its_torch_oracle_with_ties_everywhere(vocab: int) -> None:
    """Logits rounded to bf16 (as the 7B's products leave them), so equal values sit at the top and at each row's
    top_k boundary; some rows all one value but a few. Every row's token equals the oracle's (candidates by value,
    then index), for greedy, temperature 0 and sampled rows, top_k from 1 to past the vocabulary."""
    rows = 48
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 0.4).bfloat16().float()
    logits[::7] = 0.5
    logits[::7, ::13] = 1.0
    logits = logits.to(DEVICE)
    params = mixed_rows(rows, [1, 2, 7, 25, 250, 2048], seed=11)
    for frame in range(2):
        counter = torch.full((rows,), frame, device=DEVICE, dtype=torch.long)
        got, want = draw_triton(logits, params, counter, 1), draw_reference(logits, params, counter, 1)
        assert torch.equal(got, want), (got != want).nonzero().flatten().tolist()
    # The boundary's equal values are taken lowest index first: a row of equal logits with top_k 3 draws from 0-2.
    flat = torch.zeros(32, vocab, device=DEVICE)
    three = mixed_rows(32, [3], seed=5)
    three.greedy.fill_(False)
    three.temperature.fill_(1.0)
    three.top_k.fill_(3)
    drawn = draw_triton(flat, three, torch.arange(32, device=DEVICE), 1)
    assert set(drawn.tolist()) == {0, 1, 2}
    # Four equal top logits and top_k 2: whichever of the four the noise favours, the draw is among the first two
    # (a draw over the whole row won by the third or fourth must not be taken as one of the top two).
    tied = torch.full((32, vocab), -1000.0, device=DEVICE)
    tied[:, [10, 20, 30, 40]] = 5.0
    three.top_k.fill_(2)
    frames = torch.arange(32, device=DEVICE)
    drawn = draw_triton(tied, three, frames, 1)
    assert set(drawn.tolist()) == {10, 20} and torch.equal(drawn, draw_reference(tied, three, frames, 1))
    # Rows of NaN (greedy and sampled) still draw a token of the vocabulary, as torch's path does.
    broken = draw_triton(torch.full((rows, vocab), float("nan"), device=DEVICE), params, counter, 1)
    assert bool(((broken >= 0) & (broken < vocab)).all())


def test_the_fused_draw_equals_samples_tokens_where_no_values_tie() -> None:
    """float32 logits (no equal values): the fused draw and the engine's torch path take the same token on every
    row, through `sample` as the step calls it."""
    rows = 32
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, 2048, generator=gen) * 2.0).to(DEVICE)
    params = mixed_rows(rows, [5, 250, 2048], seed=99)
    counter = torch.arange(rows, device=DEVICE) * 3
    for stream in (1, 8):
        fused = draw_triton(logits, params, counter, stream)
        assert torch.equal(fused, sample(logits, params, counter, stream, 2048))
        if DEVICE == "cuda":
            assert torch.equal(sample(logits, params, counter, stream, 2048, fused=True), fused)


def test_the_fused_draw_gives_the_forced_rows_their_token_as_the_torch_path_does() -> None:
    """The rows a step forces (a session's delay, a prompt's tokens) take their given token in the draw's own
    kernel, as the torch path's select after its draw gives them: columns of a [rows, 17] block, as the step passes
    them, the other rows drawn as without any."""
    rows = 32
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(rows, 2048, generator=gen) * 2.0).to(DEVICE)
    params = mixed_rows(rows, [5, 250], seed=7)
    counter = torch.arange(rows, device=DEVICE) * 5
    given = torch.randint(0, 2048, (rows, 17), generator=gen).to(DEVICE)
    flags = (torch.rand(rows, 17, generator=gen) < 0.4).to(DEVICE)
    for column in (1, 8):
        forced = Forced(flags[:, column], given[:, column])
        drawn = draw_triton(logits, params, counter, column)
        got = draw_triton(logits, params, counter, column, forced)
        assert torch.equal(got, torch.where(flags[:, column], given[:, column], drawn))
        assert 0 < int(flags[:, column].sum()) < rows and not torch.equal(got, drawn)
        assert torch.equal(got, sample(logits, params, counter, column, 2048, forced=forced))
        assert torch.equal(got, draw_reference(logits, params, counter, column, forced))


def test_bf16_logits_draw_as_their_float32_values() -> None:
    """The depformer hands its logits over in the weights' dtype: the fused draw reads bf16 as it loads them, the
    torch path converts first, and both draw exactly what they draw from the same values in float32."""
    rows = 32
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(rows, 2048, generator=gen) * 2.0).bfloat16().to(DEVICE)
    params = mixed_rows(rows, [5, 250, 2048], seed=3)
    counter = torch.arange(rows, device=DEVICE) * 7
    for stream in (1, 5):
        want = draw_triton(logits.float(), params, counter, stream)
        assert torch.equal(draw_triton(logits, params, counter, stream), want)
        assert torch.equal(draw_reference(logits, params, counter, stream), want)
        assert torch.equal(sample(logits, params, counter, stream, 2048), sample(logits.float(), params, counter,
                                                                                  stream, 2048))
