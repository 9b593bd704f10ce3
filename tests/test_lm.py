"""The LM on the tiny config: streaming equals whole-sequence, batch invariance, resets, prompts, sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.attention import depformer_attention
from model.config import SILENCE_TOKENS, TEXT_PAD, TINY_LM, LMConfig
from model.lm import LM, RING_SIZE, add_rms_norm, count_parameters, rms_norm
from model.prompt_prefill import PromptPrefill
from model.prompts import apply_prompt, finish_prompt, plan_prompt, plan_voice
from model.sampling import RowSampling, SamplingParams, row_sampling
from model.step import StepConstants, frame_step

CPU = torch.device("cpu")


def make_lm(seed: int = 0, cfg: LMConfig = TINY_LM) -> LM:
    torch.manual_seed(seed)
    return LM(cfg, depformer_steps=cfg.num_audio_codebooks).eval()


def sampling(batch: int, greedy: bool = True, seed: int = 0, temp: float = 0.8, top_k: int = 50) -> RowSampling:
    return RowSampling(
        greedy=torch.full((batch,), greedy),
        temperature=torch.full((batch,), temp),
        top_k=torch.full((batch,), top_k),
        seed=torch.full((batch,), seed, dtype=torch.long),
    )


def run_steps(lm: LM, state, user: torch.Tensor, text_s=None, audio_s=None, record_inputs: bool = False):
    """Feed user codes [T, B, 8]; return emitted frames [T, B, 17], emitted flags [T, B] and optional inputs."""
    B = user.shape[1]
    const = StepConstants.make(lm, CPU)
    text_s = text_s or sampling(B)
    audio_s = audio_s or sampling(B)
    cache = lm.depformer_cache(B)
    frames, flags, inputs = [], [], []
    with torch.no_grad():
        for t in range(user.shape[0]):
            if record_inputs:
                col = ((state.offset - 1) % RING_SIZE).view(B, 1, 1).expand(B, 17, 1)
                inputs.append(state.ring.gather(2, col).squeeze(2).clone())
            frame, emitted = frame_step(lm, state, user[t], text_s, audio_s, cache, const)
            frames.append(frame)
            flags.append(emitted)
    out = (torch.stack(frames), torch.stack(flags))
    return (*out, torch.stack(inputs)) if record_inputs else out


def random_user(T: int, B: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_LM.card, (T, B, 8), generator=g)


def test_full_shape_parameter_count_on_meta():
    with torch.device("meta"):
        full = LM(LMConfig())
        agent_only = LM(LMConfig(), depformer_steps=8)
    assert count_parameters(full) == 8_371_408_896
    assert count_parameters(agent_only) < count_parameters(full)
    assert count_parameters(LM(TINY_LM)) == 9_785_344


@pytest.mark.parametrize("T", [10, 40])
def test_streaming_equals_whole_sequence(T: int):
    """Step-by-step temporal + depformer equals one teacher-forced forward, also after the KV ring wraps (T > 16)."""
    lm = make_lm(1)
    state = lm.init_state(2)
    frames, _, inputs = run_steps(lm, state, random_user(T, 2, 7), record_inputs=True)
    with torch.no_grad():
        for row in range(2):
            fresh = lm.init_state(1)
            hidden = lm.prefill(lm.embed_column(inputs[:, row]), fresh, 0)
            logits = lm.text_logits(hidden)
            stream_state = lm.init_state(1)
            stream_logits = []
            for t in range(T):
                h = lm.temporal_step(lm.embed_column(inputs[t, row : row + 1]), stream_state)
                stream_state.pos += 1
                stream_logits.append(lm.text_logits(h))
            torch.testing.assert_close(torch.cat(stream_logits), logits, atol=1e-4, rtol=0)
            # Greedy text sampled at call t is the argmax of the teacher-forced logits; it shows up in the frame
            # emitted one call later (frame o - 1 is emitted at call o).
            sampled_text = frames[1:, row, 0]
            assert torch.equal(sampled_text, logits[:-1].argmax(-1))


def test_depformer_teacher_forced_matches_stream():
    """The agent codes emitted equal an independent teacher-forced depformer pass over the recorded tokens."""
    lm = make_lm(2)
    state = lm.init_state(1)
    T = 12
    frames, _, inputs = run_steps(lm, state, random_user(T, 1, 3), record_inputs=True)
    with torch.no_grad():
        hidden = lm.prefill(lm.embed_column(inputs[:, 0]), lm.init_state(1), 0)
        # At call t (offset o = t + 1) the depformer sampled text(o), agent cb0(o), cb1-7(o - 1): the ring column o.
        for t in range(2, T - 1):
            text = frames[t + 1, 0, 0]
            cb0 = frames[t + 1, 0, 1]
            cb_rest = frames[t, 0, 2:9]
            targets = [cb0, *cb_rest]
            cache = lm.depformer_cache(1)
            prev = lm.depformer_text_emb(text.view(1))
            for k in range(8):
                logits = lm.depformer_step(k, lm.depformer_in[k](hidden[t : t + 1]) + prev, cache)
                assert int(logits.argmax(-1)) == int(targets[k])
                if k < 7:
                    prev = lm.depformer_emb[k](targets[k].view(1))


def test_batch_invariance_and_reset():
    lm = make_lm(3)
    T = 20
    user = random_user(T, 3, 11)
    alone, _ = run_steps(lm, lm.init_state(1), user[:, :1])
    together, _ = run_steps(lm, lm.init_state(3), user)
    assert torch.equal(alone[:, 0], together[:, 0])

    # Reset row 1 mid-stream: from then on it equals a fresh row fed the same inputs, and row 0 is untouched.
    state = lm.init_state(2)
    before, _ = run_steps(lm, state, random_user(9, 2, 5))
    lm.reset_rows(state, torch.tensor([False, True]))
    after, _ = run_steps(lm, state, user[:, :2])
    fresh, _ = run_steps(lm, lm.init_state(1), user[:, 1:2])
    assert torch.equal(after[:, 1], fresh[:, 0])
    cont = lm.init_state(2)
    run_steps(lm, cont, random_user(9, 2, 5))
    lm.reset_rows(cont, torch.tensor([False, False]))
    untouched, _ = run_steps(lm, cont, user[:, :2])
    assert torch.equal(after[:, 0], untouched[:, 0])


def test_emission_and_user_rows():
    lm = make_lm(4)
    user = random_user(8, 1, 2)
    frames, emitted = run_steps(lm, lm.init_state(1), user)
    assert emitted[:, 0].tolist() == [False] + [True] * 7
    # A fresh row has had the reference's dummy call already, so its first call consumes user frame 0; the frame
    # emitted at call t is frame t, whose user rows are the codes fed at call t - 1.
    for t in range(1, 8):
        assert torch.equal(frames[t, 0, 9:17], user[t - 1, 0])


def test_prompt_prefill_equals_frame_by_frame():
    """A persona prompt (longer than the tiny context) as one prefill equals a frame-by-frame prefill."""
    lm = make_lm(5)
    persona = list(range(40, 52))
    plan = plan_prompt(lm, None, persona)
    assert plan.offset == 12 + len(persona)
    a, b = lm.init_state(2), lm.init_state(2)
    apply_prompt(lm, a, 1, plan)
    apply_prompt(lm, b, 1, plan, chunk=1)
    torch.testing.assert_close(a.kv.k, b.kv.k, atol=1e-5, rtol=0)
    assert torch.equal(a.kpos, b.kpos) and torch.equal(a.ring, b.ring) and torch.equal(a.offset, b.offset)
    user = random_user(20, 2, 9)
    fa, _ = run_steps(lm, a, user)
    fb, _ = run_steps(lm, b, user)
    assert torch.equal(fa[:, 1], fb[:, 1])
    # The first frame emitted after the prompt is the last spacer: PAD text and silence codes.
    assert fa[0, 1, :9].tolist() == [TEXT_PAD, *SILENCE_TOKENS]


def test_voice_pt_replays_to_same_state():
    lm = make_lm(6)
    codes = random_user(9, 1, 4)[:, 0]
    persona = [50, 60, 70]
    from_wav = plan_prompt(lm, codes, persona)
    voice = plan_voice(lm, codes)
    assert voice.frames == 9 and voice.to_reference()["embeddings"].shape == (8, 1, 1, TINY_LM.dim)
    from_pt = plan_prompt(lm, voice, persona)
    assert from_pt.offset == from_wav.offset == 9 + 12 + 3
    assert torch.equal(from_pt.ring, from_wav.ring)
    torch.testing.assert_close(from_pt.embeddings, from_wav.embeddings, atol=0, rtol=0)
    a, b = lm.init_state(1), lm.init_state(1)
    apply_prompt(lm, a, 0, from_wav)
    apply_prompt(lm, b, 0, from_pt)
    user = random_user(20, 1, 1)
    assert torch.equal(run_steps(lm, a, user)[0], run_steps(lm, b, user)[0])


def test_sampling_seeded_and_row_independent():
    lm = make_lm(7)
    user = random_user(12, 2, 3)
    s1 = sampling(2, greedy=False, seed=1234)
    a, _ = run_steps(lm, lm.init_state(2), user, s1, s1)
    b, _ = run_steps(lm, lm.init_state(2), user, s1, s1)
    assert torch.equal(a, b)
    other = sampling(2, greedy=False, seed=99)
    c, _ = run_steps(lm, lm.init_state(2), user, other, other)
    assert not torch.equal(a[:, 0, :9], c[:, 0, :9])
    # Row 0's samples do not depend on row 1's seed.
    mixed = sampling(2, greedy=False, seed=1234)
    mixed.seed[1] = 5
    d, _ = run_steps(lm, lm.init_state(2), user, mixed, mixed)
    assert torch.equal(a[:, 0], d[:, 0])
    # top_k = 1 is greedy.
    g, _ = run_steps(lm, lm.init_state(2), user)
    k1 = sampling(2, greedy=False, seed=3, top_k=1)
    e, _ = run_steps(lm, lm.init_state(2), user, k1, k1)
    assert torch.equal(g, e)


def test_a_row_set_in_place_equals_the_row_built_from_its_params():
    """The engine sets a slot's sampling with set_row (fills, no upload); it must give what row_sampling builds."""
    params = SamplingParams(temp_text=0.55, temp_audio=0.9, topk_text=17, topk_audio=140, greedy=False)
    seed = 2**40 + 12345
    text, audio = row_sampling([SamplingParams(greedy=True)] * 3, [0] * 3, torch.device("cpu"))
    text_before, audio_before = row_sampling([SamplingParams(greedy=True)] * 3, [0] * 3, torch.device("cpu"))
    text.set_row(1, params.greedy, params.temp_text, params.topk_text, seed)
    audio.set_row(1, params.greedy, params.temp_audio, params.topk_audio, seed)
    want_text, want_audio = row_sampling([params], [seed], torch.device("cpu"))
    for got, want, before in ((text, want_text, text_before), (audio, want_audio, audio_before)):
        for name in ("greedy", "temperature", "top_k", "seed"):
            assert torch.equal(getattr(got, name)[1:2], getattr(want, name)), name
            assert torch.equal(getattr(got, name)[0::2], getattr(before, name)[0::2])  # the other rows untouched


def test_context_config_is_respected():
    cfg = dataclasses.replace(TINY_LM, context=8)
    lm = make_lm(8, cfg)
    state = lm.init_state(1)
    run_steps(lm, state, random_user(20, 1, 0))
    assert int((state.kpos >= 0).sum()) == 8
    assert int(state.kpos.max()) == int(state.pos[0]) - 1


def test_inactive_rows_are_untouched():
    """With an exec mask, inactive rows keep their state bit for bit and active rows run as usual."""
    lm = make_lm(9)
    state = lm.init_state(3)
    run_steps(lm, state, random_user(5, 3, 1))
    fields = {"k": lambda s: s.kv.k, "v": lambda s: s.kv.v, "kpos": lambda s: s.kpos, "pos": lambda s: s.pos,
              "ring": lambda s: s.ring, "offset": lambda s: s.offset}
    snapshot = {name: get(state).clone() for name, get in fields.items()}
    active = torch.tensor([True, False, True])
    const = StepConstants.make(lm, CPU)
    user = random_user(4, 3, 2)
    reference = lm.init_state(3)
    run_steps(lm, reference, random_user(5, 3, 1))
    with torch.no_grad():
        for t in range(4):
            cache = lm.depformer_cache(3)
            frame, emitted = frame_step(lm, state, user[t], sampling(3), sampling(3), cache, const, active)
            expect, _ = frame_step(lm, reference, user[t], sampling(3), sampling(3), lm.depformer_cache(3), const)
            assert not bool(emitted[1])
            assert torch.equal(frame[active], expect[active])
    for name, before in snapshot.items():
        after = fields[name](state)
        row = (slice(None), 1) if name in ("k", "v") else (1,)
        assert torch.equal(after[row], before[row]), name


def test_fp8_kv_cache_tracks_the_exact_cache():
    """FP8 KV storage (per-vector scales) stays close to full precision, also through prefill and ring wrap."""
    lm = make_lm(10)
    user = random_user(24, 2, 4)
    exact = lm.init_state(2)
    fp8 = lm.init_state(2, fp8_kv=True)
    assert fp8.kv.k.dtype == torch.float8_e4m3fn and fp8.kv.k_scale is not None
    plan = plan_prompt(lm, None, [40, 41, 42])
    apply_prompt(lm, exact, 1, plan)
    apply_prompt(lm, fp8, 1, plan)
    with torch.no_grad():
        for t in range(user.shape[0]):
            x = lm.embed_column(torch.cat([torch.full((2, 1), 3), user[t], user[t]], dim=1))
            a = lm.text_logits(lm.temporal_step(x, exact))
            b = lm.text_logits(lm.temporal_step(x, fp8))
            exact.pos += 1
            fp8.pos += 1
            torch.testing.assert_close(b, a, atol=0.15, rtol=0.05)
    lm.reset_rows(fp8, torch.tensor([True, False]))
    assert int(fp8.kv.k[:, 0].view(torch.uint8).count_nonzero()) == 0


def test_fp8_weights_track_the_exact_products_and_leave_the_model_alone():
    """`LM.with_fp8_weights`: a sibling whose temporal products are e4m3 (half the bytes), whose hidden states stay
    within a few percent of the exact ones, whose prefill equals its own frame-by-frame steps (inputs are quantized
    per row, so a chunk's row rounds as that row alone does), and which shares every other weight; the model
    it came from computes exactly what it did."""
    lm = make_lm(11)
    user = random_user(12, 2, 6)
    columns = [torch.cat([torch.full((2, 1), 3), user[t], user[t]], dim=1) for t in range(user.shape[0])]

    def hidden_states(model: LM) -> list[torch.Tensor]:
        state, out = model.init_state(2), []
        with torch.no_grad():
            for column in columns:
                out.append(model.temporal_step(model.embed_column(column), state))
                state.pos += 1
        return out

    before = hidden_states(lm)
    fp8 = lm.with_fp8_weights()
    assert torch.equal(torch.stack(hidden_states(lm)), torch.stack(before))
    assert type(lm.transformer.layers[0].gating.linear_in) is torch.nn.Linear
    layer = fp8.transformer.layers[0]
    for linear in (layer.self_attn.in_proj_fp8, layer.self_attn.out_proj, layer.gating.linear_in,
                   layer.gating.linear_out):
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.scale.dtype == torch.float32
    assert layer.norm1 is lm.transformer.layers[0].norm1 and fp8.emb is lm.emb and fp8.depformer is lm.depformer
    for exact, approx in zip(before, hidden_states(fp8), strict=True):
        assert float((approx - exact).norm() / exact.norm()) < 0.06

    stepped, prefilled = fp8.init_state(1), fp8.init_state(1)
    x = torch.stack([fp8.embed_column(column[:1])[0] for column in columns])
    with torch.no_grad():
        steps = []
        for t in range(x.shape[0]):
            steps.append(fp8.temporal_step(x[t : t + 1], stepped)[0])
            stepped.pos += 1
        chunk = fp8.prefill(x, prefilled, 0)
    torch.testing.assert_close(chunk, torch.stack(steps), atol=1e-4, rtol=1e-4)


def test_fused_residual_norm_compiles_to_what_eager_computes():
    """The GPU compiles `add_rms_norm` with Inductor (model/fused.py): it must trace whole, for any batch, and equal
    the residual add followed by the norm."""
    compiled = torch.compile(add_rms_norm.__wrapped__, fullgraph=True, dynamic=True)
    alpha = torch.rand(1, 1, 16) + 0.5
    for batch in (3, 5):
        x, delta = torch.randn(batch, 1, 16), torch.randn(batch, 1, 16)
        total, normed = compiled(x, delta, alpha, 1e-8)
        assert torch.equal(total, x + delta)
        torch.testing.assert_close(normed, rms_norm(x + delta, alpha, 1e-8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bound", [None, 3])
@pytest.mark.parametrize("fp8_kv", [False, True])
@pytest.mark.parametrize("T", [5, 40])
def test_reset_row_leaves_the_row_as_fresh_and_the_others_alone(T: int, fp8_kv: bool, bound: int | None):
    """reset_row zeroes only the KV slots the row wrote (all of them once the ring wrapped, T > 16), read from the
    row's position or given as an upper bound (here 3 frames above it): the row is then bit for bit a fresh one,
    every other row untouched."""
    lm = make_lm(7)
    state = lm.init_state(2, fp8_kv=fp8_kv)
    with torch.no_grad():
        run_steps(lm, state, random_user(T, 2, 5))
    before = [t.clone() for t in (*state.kv.tensors(), state.kpos, state.pos, state.ring, state.offset, state.forced)]
    lm.reset_row(state, 1, used=None if bound is None else T + bound)
    fresh = lm.init_state(1, fp8_kv=fp8_kv)
    after = (*state.kv.tensors(), state.kpos, state.pos, state.ring, state.offset, state.forced)
    new = (*fresh.kv.tensors(), fresh.kpos, fresh.pos, fresh.ring, fresh.offset, fresh.forced)
    kv_count = len(state.kv.tensors())
    for i, (was, now, want) in enumerate(zip(before, after, new, strict=True)):
        row, other = ((slice(None), 1), (slice(None), 0)) if i < kv_count else ((1,), (0,))
        assert torch.equal(bits(now[row]), bits(want[other]))
        assert torch.equal(bits(now[other]), bits(was[other]))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor comparable with torch.equal (fp8 compares by its bytes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_depformer_attention_writes_the_cache_and_equals_sdpa():
    """The depformer's attention stores each step's k and v in the caller's cache and attends over the steps so
    far, as SDPA over the same cache does; stale entries of later steps (here NaN) do not leak in."""
    batch, heads, steps, head_dim = 3, 2, 16, 8
    keys = torch.full((batch, heads, steps, head_dim), float("nan"))
    values = torch.full((batch, heads, steps, head_dim), float("nan"))
    positions = torch.arange(steps)
    for step in range(steps):
        qkv = torch.randn(batch, 3 * heads * head_dim)
        out = depformer_attention(qkv, keys, values, positions[step : step + 1], heads)
        q, k, v = qkv.unflatten(-1, (3, heads, -1)).unbind(1)
        assert torch.equal(keys[:, :, step], k) and torch.equal(values[:, :, step], v)
        want = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), keys[:, :, : step + 1],
                                                                values[:, :, : step + 1])
        torch.testing.assert_close(out, want.flatten(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_prompt_prefill_on_the_scratch_row_equals_prefill_on_the_row(fp8_kv: bool):
    """A prompt run on the scratch row in one padded piece (57 frames and 7 of padding), over a fixed window of its
    ring, leaves the state that prefilling the session's row in one exact piece leaves (in fp32 also in pieces
    32 + 16 + 8 + 1; with an fp8 cache, later pieces attend to earlier pieces' quantised keys); the padding's slots
    end empty and zeroed."""
    lm = make_lm(5, dataclasses.replace(TINY_LM, context=64))
    plan = plan_prompt(lm, random_user(34, 1, 2)[:, 0], list(range(40, 52)))
    assert plan.embeddings.shape[0] == 57
    direct = lm.init_state(2, fp8_kv=fp8_kv)
    with torch.no_grad():
        pieces = ((0, 57),) if fp8_kv else ((0, 32), (32, 16), (48, 8), (56, 1))
        for start, frames in pieces:
            lm.prefill(plan.embeddings[start : start + frames], direct, 1)
    finish_prompt(lm, direct, 1, plan)
    scratch = PromptPrefill(lm, torch.device("cpu"), fp8_kv)
    assert scratch.fits(57) and not scratch.fits(65)
    assert PromptPrefill.pieces(57) == [64] and PromptPrefill.pieces(300) == [128, 128, 64]
    scratch.run(plan.embeddings)
    finish_prompt(lm, scratch.state, 0, plan)
    got, want = scratch.state, direct.rows(slice(1, 2))
    assert (got.kpos[0, 57:] == -1).all()
    assert all(not t[:, 0, :, 57:].view(torch.uint8).any() for t in got.kv.tensors())
    for i in range(lm.cfg.num_layers):
        for a, b in zip(got.kv.read_row(i, 0, torch.float32, 57), want.kv.read_row(i, 0, torch.float32, 57)):
            if fp8_kv:  # another piece length rounds differently before quantising: one e4m3 step at most
                assert ((a - b).abs() <= b.abs() * 2.0**-3 + 1e-4).all()
            else:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for a, b in ((got.kpos[:, :57], want.kpos[:, :57]), (got.pos, want.pos), (got.ring, want.ring),
                 (got.offset, want.offset), (got.forced, want.forced)):
        assert torch.equal(a, b)


def test_a_prompt_continued_after_a_prompt_equals_one_longer_prompt():
    """plan_continuation from a row right after its prompt is that prompt made longer (ring, KV, what follows)."""
    from model.prompts import plan_continuation, prompt_frames, simulate_ring
    lm = make_lm(8)
    first, second = list(range(40, 49)), list(range(60, 66))
    a, b = lm.init_state(1), lm.init_state(1)
    apply_prompt(lm, a, 0, plan_prompt(lm, None, first))
    more = plan_continuation(lm, a.ring[0], int(a.offset[0]), second, pending=False)
    lm.prefill(more.embeddings, a, 0)
    finish_prompt(lm, a, 0, more)
    frames = prompt_frames(lm.cfg, None, first) + prompt_frames(lm.cfg, None, second)
    columns, ring, offset = simulate_ring(lm.cfg, lm.initial_column(), torch.zeros(17, RING_SIZE, dtype=torch.long),
                                          0, frames)
    from model.prompts import PromptPlan
    apply_prompt(lm, b, 0, PromptPlan(embeddings=lm.embed_column(columns), ring=ring, offset=offset))
    assert torch.equal(a.ring, b.ring) and torch.equal(a.offset, b.offset) and torch.equal(a.kpos, b.kpos)
    torch.testing.assert_close(a.kv.k, b.kv.k, atol=1e-5, rtol=0)
    user = random_user(12, 1, 3)
    assert torch.equal(run_steps(lm, a, user)[0], run_steps(lm, b, user)[0])


@pytest.mark.parametrize("origin,window", [(0, 5), (7, 5), (7, None)])
def test_prefill_on_a_shrunk_or_slid_ring_equals_frame_by_frame(origin: int, window: int | None):
    """A live row's ring may be smaller than the context (the page pool shrank it) and start at a later frame:
    prefill attends and stores as temporal_step does there."""
    lm = make_lm(9)
    ring = window or lm.cfg.context
    a, b = lm.init_state(1), lm.init_state(1)
    for state in (a, b):
        state.pos.fill_(origin)
        state.origin.fill_(origin)
        state.window.fill_(ring)
    x = torch.randn(3 * ring // 2 + 4, lm.cfg.dim)
    with torch.no_grad():
        whole = lm.prefill(x, a, 0, origin=origin, ring=ring)
        steps = []
        for t in range(x.shape[0]):
            steps.append(lm.temporal_step(x[t:t + 1], b))
            b.pos += 1
    torch.testing.assert_close(whole, torch.cat(steps), atol=1e-5, rtol=1e-5)
    assert torch.equal(a.kpos, b.kpos) and torch.equal(a.pos, b.pos)
    torch.testing.assert_close(a.kv.k, b.kv.k, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter rounds bf16 its own way: bf16 is checked on CUDA"))])
def test_the_column_embedding_kernel_sums_as_torch_does_bit_for_bit(dtype: torch.dtype) -> None:
    """The temporal input's 17 lookups as one Triton kernel (on CUDA as the engine runs it; elsewhere through
    Triton's interpreter): every value of torch's sum, negative ids zeroed (with the sign torch's product leaves),
    at one row, a batch, a prompt's frames and a strided view of the token ring; the table addresses made again
    when the tables move."""
    pytest.importorskip("triton")
    from model.embed_kernel import EmbeddingTables, embed_column_reference, embed_column_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dim, card, text_card = (4096, 2049, 32001) if device == "cuda" else (48, 9, 17)
    torch.manual_seed(6)
    tables = [torch.randn(text_card, dim, dtype=dtype, device=device)]
    tables += [torch.randn(card, dim, dtype=dtype, device=device) for _ in range(16)]
    addresses = EmbeddingTables()
    ring = torch.randint(-2, card, (250, 17, 4), device=device)
    ring[:, 0] = torch.randint(-2, text_card, (250, 4), device=device)
    for tokens in (ring[:1, :, 0], ring[:3, :, 1], ring[:, :, 2], ring[:5, :, 3].unsqueeze(1).expand(5, 2, 17)):
        want = embed_column_reference(tokens, tables)
        got = embed_column_triton(tokens, tables, addresses)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    moved = [t.clone() for t in tables]
    assert torch.equal(embed_column_triton(ring[:2, :, 0], moved, addresses),
                       embed_column_reference(ring[:2, :, 0], tables))
    with pytest.raises(ValueError, match="17 columns"):
        embed_column_triton(ring[:2, :16, 0], tables, addresses)
