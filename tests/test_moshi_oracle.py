"""Greedy tokens equal the reference implementation's on the same weights (spec/model.md §12).

The oracle is Kyutai's `moshi` package from PyPI, pinned and used only here, installed without its pins:

    python3 -m pip install --no-deps moshi==0.2.13 einops==0.8.2

Upstream `moshi` counts the user streams as `n_q - dep_q`, so it is built with dep_q = 8 and given the first 8
depformer sets of our 16-set tiny checkpoint; the last 8 sets only predict user codes that the real user's codes
overwrite, so text and agent tokens are the same. Upstream reads the current ring column where the PersonaPlex
fork reads the previous one; our fresh row has already made the fork's dummy first call. Together: feed upstream
one dummy user frame first, and its call i then sees exactly what our call i sees (same input column, same
logits) and emits the same frame i.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import keep_depformer_sets, make_tiny
from safetensors.torch import load_file

from model.config import MOSHI_NAME, LMConfig
from model.lm import LM, RING_SIZE
from model.loading import load_model
from model.sampling import RowSampling
from model.step import StepConstants, frame_step

MOSHI_VERSION = "0.2.13"
INSTALL = f"python3 -m pip install --no-deps moshi=={MOSHI_VERSION} einops==0.8.2"
CALLS = 24  # well inside the tiny checkpoint's context (250), so the two ring-KV conventions agree

# moshi's modules use torch.jit.script_method, which torch now deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(scope="module")
def moshi_lm():
    try:
        import moshi
        from moshi.models.lm import LMGen, LMModel
    except ImportError as exc:
        pytest.skip(f"moshi=={MOSHI_VERSION} is not importable ({exc}); install it with: {INSTALL}")
    if moshi.__version__ != MOSHI_VERSION:
        pytest.skip(f"the oracle is pinned to moshi=={MOSHI_VERSION}, found {moshi.__version__}; run: {INSTALL}")
    return LMModel, LMGen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PERSONAPLEX_CACHE", str(tmp_path_factory.mktemp("cache")))
        folder = make_tiny(tmp_path_factory, "oracle", seed=5)
        model = load_model(str(folder))
    return folder, model


def reference_kwargs(cfg: LMConfig) -> dict:
    """The reference loader's 7B LM keywords with our (tiny) sizes and dep_q = 8."""
    return dict(
        dim=cfg.dim, num_heads=cfg.num_heads, num_layers=cfg.num_layers, hidden_scale=cfg.hidden_scale,
        context=cfg.context, max_period=cfg.max_period, text_card=cfg.text_card, card=cfg.card, n_q=cfg.n_q,
        dep_q=cfg.num_audio_codebooks, delays=list(cfg.delays), existing_text_padding_id=cfg.existing_text_padding_id,
        causal=True, layer_scale=None, gating="silu", norm="rms_norm_f32", positional_embedding="rope",
        depformer_dim=cfg.depformer_dim, depformer_dim_feedforward=cfg.depformer_dim_feedforward,
        depformer_num_heads=cfg.depformer_num_heads, depformer_num_layers=cfg.depformer_num_layers,
        depformer_layer_scale=None, depformer_multi_linear=True, depformer_context=cfg.num_audio_codebooks,
        depformer_max_period=cfg.max_period, depformer_gating="silu", depformer_pos_emb="none",
        depformer_weights_per_step=True,
    )


def greedy(batch: int) -> RowSampling:
    return RowSampling(
        greedy=torch.ones(batch, dtype=torch.bool),
        temperature=torch.zeros(batch),
        top_k=torch.ones(batch, dtype=torch.long),
        seed=torch.zeros(batch, dtype=torch.long),
    )


@torch.no_grad()
def run_ours(lm: LM, user: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """user [T, B, 8] -> per call the emitted frames [B, 17] (None before the first), and the text logits
    [T, B, text_card] of each call from one teacher-forced forward over the input columns it used."""
    T, B, _ = user.shape
    state = lm.init_state(B)
    const = StepConstants.make(lm, torch.device("cpu"))
    cache = lm.depformer_cache(B)
    frames: list[torch.Tensor | None] = []
    inputs = []
    for t in range(T):
        column = ((state.offset - 1) % RING_SIZE).view(B, 1, 1).expand(B, lm.cfg.num_rows, 1)
        inputs.append(state.ring.gather(2, column).squeeze(2).clone())
        frame, emitted = frame_step(lm, state, user[t], greedy(B), greedy(B), cache, const)
        assert bool(emitted.all()) or not bool(emitted.any())
        frames.append(frame.clone() if bool(emitted.all()) else None)
    columns = torch.stack(inputs, dim=1)  # [B, T, 17]
    logits = torch.stack([lm.text_logits(lm.prefill(lm.embed_column(columns[b]), lm.init_state(1), 0))
                          for b in range(B)], dim=1)
    return frames, logits


@torch.no_grad()
def run_reference(LMGen, model, user: torch.Tensor) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """user [T, B, 8] through upstream LMGen greedy -> per call its output [B, 9] or None, text logits [T, B, V]."""
    T, B, _ = user.shape
    logits: list[torch.Tensor] = []
    gen = LMGen(model, use_sampling=False, on_text_logits_hook=lambda x: logits.append(x[:, 0, 0].float().clone()))
    outs: list[torch.Tensor | None] = []
    with gen.streaming(B):
        for t in range(T):
            out = gen.step(user[t].unsqueeze(-1))
            outs.append(None if out is None else out[:, :, 0].clone())
    return outs, torch.stack(logits)


def test_greedy_tokens_equal_reference(moshi_lm, tiny):
    LMModel, LMGen = moshi_lm
    folder, model = tiny
    cfg = model.config
    state = keep_depformer_sets(load_file(str(folder / MOSHI_NAME)), cfg, cfg.num_audio_codebooks)
    reference = LMModel(**reference_kwargs(cfg))
    reference.load_state_dict(state, strict=True)  # its load hook splits the fused per-step projections
    reference.eval()

    B = 2
    g = torch.Generator().manual_seed(17)
    user = torch.randint(0, cfg.card, (CALLS, B, cfg.num_audio_codebooks), generator=g)
    dummy = torch.randint(0, cfg.card, (1, B, cfg.num_audio_codebooks), generator=g)
    ours, our_logits = run_ours(model.lm, user)
    theirs, their_logits = run_reference(LMGen, reference, torch.cat([dummy, user[:-1]]))

    # Same transformer inputs call for call: the text logits agree to float noise.
    torch.testing.assert_close(our_logits, their_logits, atol=1e-4, rtol=0)
    assert ours[0] is None and theirs[0] is None
    for call in range(1, CALLS):
        assert ours[call] is not None and theirs[call] is not None
        # Text and the 8 agent codebooks of frame `call`; upstream does not emit the user rows.
        assert torch.equal(ours[call][:, : 1 + cfg.num_audio_codebooks], theirs[call]), f"call {call}"
    # The streams are not degenerate: the agent produced varied text and codes.
    emitted = torch.stack([f for f in ours if f is not None])
    assert emitted[:, :, 0].unique().numel() > 3 and emitted[:, :, 1].unique().numel() > 3


def test_greedy_draw_takes_the_first_of_tied_maxima_as_the_references_does(moshi_lm):
    """Greedy is the reference's `sample_token(logits)`, torch.argmax: the first maximal index. The 7B's logits come
    out of bf16 products, so equal maxima are common (here a few % of rows); torch.topk orders ties its own way."""
    from moshi.utils.sampling import sample_token

    from model.sampling import row_sampling, sample
    from model.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(7)
    rows = 512
    logits = (torch.randn(rows, 2048, generator=gen) * 0.5).bfloat16().float()
    logits[0, :5] = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]) + logits[0].max()
    tied = int(((logits == logits.amax(1, keepdim=True)).sum(1) > 1).sum())
    assert tied >= 5
    _, greedy = row_sampling([SamplingParams(greedy=True)] * rows, [0] * rows, torch.device("cpu"))
    ours = sample(logits, greedy, torch.zeros(rows, dtype=torch.long), 1, 250)
    assert torch.equal(ours, sample_token(logits, use_sampling=False))
    # A sampled row at temperature 0 is greedy too, as in the reference.
    cold = SamplingParams(greedy=False, temp_audio=0.0)
    _, zero = row_sampling([cold] * rows, [1] * rows, torch.device("cpu"))
    assert torch.equal(sample(logits, zero, torch.zeros(rows, dtype=torch.long), 1, 250), ours)
