"""Fusable helpers: compiled where enabled, and eager again for one that Dynamo cannot keep compiled."""

from __future__ import annotations

import pytest
import torch

from model import fused

# Inductor's first import loads torch.utils.mkldnn, whose classes use torch's own deprecated `torch.jit.script_method`
# (14 warnings, none from our code): not ours to fix; any other deprecation still shows.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.script_method` is deprecated:DeprecationWarning:torch\.jit\._script")


@fused.fusable
def _cleared_row(x: torch.Tensor, row: int) -> torch.Tensor:
    out = x * 2.0
    out[:, row] = 0.0  # an index put specialises on the int: one graph per value
    return out


def _cleared_row_reference(x: torch.Tensor, row: int) -> torch.Tensor:
    out = x * 2.0
    out[:, row] = 0.0
    return out


def test_a_helper_past_its_recompile_limit_runs_eagerly_with_the_same_results(caplog):
    """An int argument that varies is specialised per value; past Dynamo's limit the compiled helper raises (the
    engine did not start on the GPU when this happened to the depformer's step index). It now falls back."""
    x = torch.arange(12.0).view(2, 6)
    torch._dynamo.reset()
    fused.enable()
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            results = [_cleared_row(x, row) for row in range(6)]
        assert _cleared_row.__wrapped__ not in fused._COMPILED
    finally:
        fused.disable()
    for row, got in enumerate(results):
        assert torch.equal(got, _cleared_row_reference(x, row))
    assert "runs eagerly from now on" in caplog.text


@fused.fusable
def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def test_a_helper_stays_compiled_through_more_shape_classes_than_dynamos_default_limit():
    """Dynamo compiles a helper once per rank (and per dimension of 1, view offset, ...): the engine's warm-up on
    the tiny model gave apply_rope 8 graphs, Dynamo's default limit. Past it a helper ran eagerly for the rest of
    the process, and every CUDA graph captured after that would hold its unfused kernels."""
    torch._dynamo.reset()
    fused.enable()
    try:
        shapes = [(3,) * rank for rank in range(1, 11)]  # 10 ranks, 10 graphs
        results = [_scaled(torch.ones(shape)) for shape in shapes]
        assert _scaled.__wrapped__ in fused._COMPILED
        assert fused.fallen_back() == []
    finally:
        fused.disable()
    assert all(torch.equal(got, torch.full(shape, 3.0)) for got, shape in zip(results, shapes, strict=True))
