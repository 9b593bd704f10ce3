"""The depformer's fused products (model/depformer_kernels.py) against the torch path's own ops: the kernel alone in
every prologue and epilogue it takes, and the tiny LM's depformer and whole frames through it. On CUDA the kernel
runs natively, without CUDA through Triton's interpreter (tests/conftest.py sets it), so CI checks it too."""

from __future__ import annotations

import pytest
import torch

from model import launch
from model.depformer_kernels import FUSED_ROWS_MAX, fused_linear, fused_linear_reference
from model.step import StepConstants, frame_step
from tests.test_lm import make_lm, random_user, sampling

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter does bf16 its own way (tests/test_stream_kernels.py): float32 there, bf16 on CUDA too.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few roundings of the dtype (other sum orders)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(FUSED_ROWS_MAX, 600, 13), (3, 40, 8), (2, 520, 24)])
@pytest.mark.parametrize("case", ["plain", "norm", "delta_norm", "delta_norm_gate", "add", "delta_to_float"])
def test_the_fused_product_computes_the_torch_paths_ops(case: str, rows: int, inputs: int, outputs: int,
                                                        dtype: torch.dtype) -> None:
    """Inputs and outputs that are not whole blocks of the kernel's (512 and 8), so its masks are exercised."""
    gen = torch.Generator().manual_seed(rows * 1000 + inputs)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)

    gate = case.endswith("gate")
    x = rand(rows, inputs)
    weight = rand(2 * outputs if gate else outputs, inputs, scale=inputs ** -0.5)
    kwargs: dict = {}
    if "delta" in case:
        kwargs["delta"] = rand(rows, inputs)
    if "norm" in case:
        kwargs.update(alpha=1.0 + rand(1, 1, inputs, scale=0.1), eps=1e-8)
    if gate:
        kwargs["gate"] = True
    if case == "add":
        kwargs["add"] = rand(rows, outputs)
    if case == "delta_to_float":
        kwargs["out_dtype"] = torch.float32
    stream, y = fused_linear(x, weight, **kwargs)
    want_stream, want_y = fused_linear_reference(x, weight, **kwargs)
    assert y.shape == want_y.shape and y.dtype == want_y.dtype
    close(y, want_y, dtype)
    if "delta" in case:
        assert stream.data_ptr() != x.data_ptr()
        close(stream, want_stream, dtype)
    else:
        assert stream is x


def test_the_fused_depformer_step_computes_the_torch_paths_step() -> None:
    """The tiny LM's depformer, every step, through the fused products and through its torch path: the same logits
    within float32's roundings, and the same keys and values left in the frame's cache."""
    lm = make_lm(5).to(DEVICE)
    rows = 3
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(rows, lm.cfg.dim, generator=gen).to(DEVICE)
    text = torch.randint(0, lm.cfg.text_card, (rows,), generator=gen).to(DEVICE)
    caches = [lm.depformer_cache(rows), lm.depformer_cache(rows)]
    with torch.no_grad():
        previous = [lm.depformer_text_emb(text)] * 2
        for k in range(lm.depformer_steps):
            want = lm.depformer_step(k, lm.depformer_in[k](hidden) + previous[0], caches[0])
            got = lm.depformer_step_fused(k, hidden, previous[1], caches[1])
            close(got, want, torch.float32)
            token = want.argmax(-1)
            if k + 1 < lm.depformer_steps:
                previous = [lm.depformer_emb[k](token)] * 2
    for (k0, v0), (k1, v1) in zip(caches[0].kv, caches[1].kv, strict=True):
        close(k1, k0, torch.float32)
        close(v1, v0, torch.float32)


def test_frames_through_the_fused_depformer_carry_the_torch_paths_tokens() -> None:
    """Whole greedy frames of the tiny LM (temporal, text draw, depformer, ring) with `fused_depformer` on: the same
    tokens as the torch path, frame after frame."""
    lm = make_lm(4).to(DEVICE)
    rows, frames = FUSED_ROWS_MAX, 4
    user = random_user(frames, rows, 9).to(DEVICE)
    plain = StepConstants.make(lm, DEVICE, fused_draw=False)
    fused = StepConstants.make(lm, DEVICE, fused_draw=False, fused_depformer=True)
    greedy = sampling(rows).to(DEVICE)
    out = []
    for const in (plain, fused):
        state, cache = lm.init_state(rows, DEVICE), lm.depformer_cache(rows)
        with torch.no_grad():
            out.append(torch.stack([frame_step(lm, state, user[t], greedy, greedy, cache, const)[0]
                                    for t in range(frames)]))
    assert torch.equal(out[0], out[1])


@pytest.mark.skipif(not launch.supported(DEVICE),
                    reason="programmatic dependent launch: CUDA sm_90 on, a Triton with grid dependency control")
def test_products_launched_as_programmatic_dependents_equal_plain_launches() -> None:
    """A chain of 24 dependent products (each takes the last one's output as its residual delta), eager and graphed,
    over three inputs: launched as programmatic dependents (each waits for the one before only where it reads
    activations) the outputs equal the plain launches' bit for bit; a read before the wait would show as a stale
    value somewhere in the chain."""
    gen = torch.Generator().manual_seed(3)
    dim = 1024
    weights = [(torch.randn((2 if i % 3 == 2 else 1) * dim, dim, generator=gen) * dim ** -0.5).to(DEVICE,
                                                                                                    torch.bfloat16)
               for i in range(24)]  # every third a gated product (gate and up rows)
    alpha = (1.0 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, torch.bfloat16)
    inputs = [torch.randn(1, dim, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3)]
    x = torch.zeros(1, dim, device=DEVICE, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        h, delta = x, None
        for i, w in enumerate(weights):
            h, delta = fused_linear(h, w, delta=delta, alpha=alpha, eps=1e-8, gate=i % 3 == 2)
        return h + delta

    outputs = {}
    for pdl in (False, True):
        launch.enable(pdl)
        with torch.no_grad():
            eager = []
            for value in inputs:
                x.copy_(value)
                eager.append(chain().clone())
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                chain()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out = chain()
            replayed = []
            for value in inputs:
                x.copy_(value)
                graph.replay()
                replayed.append(out.clone())
        outputs[pdl] = eager + replayed
    launch.enable(False)
    for plain, dependent in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(plain, dependent)
    assert not torch.equal(outputs[True][0], outputs[True][1])  # the inputs reached the chain's end
