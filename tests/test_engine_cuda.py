"""The engine's CUDA-only paths on the tiny checkpoint: graphs replay what eager runs compute. Skipped without a GPU.

Run on the device machine: `python3 -m pytest -q --noconftest tests/test_engine_cuda.py`.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from test_engine import Collector, QueueSource, speechlike

from model.engine import Engine, EngineConfig, SamplingParams, SessionParams
from model.loading import load_model
from model.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, context=64)
    return load_model(str(folder), device="cuda", dtype="float32")


async def session_tokens(model, config: EngineConfig, frames: int) -> list[np.ndarray]:
    engine = Engine(model, config)
    engine.start()
    try:
        slot, sink = engine.reserve(), Collector()
        await slot.start(SessionParams(voice="NATF2", persona="Hello there.", sampling=SamplingParams(greedy=True)),
                         QueueSource(speechlike(frames + 2, 1)), sink.on_output, sink.on_error)
        outputs = await sink.wait_for(frames)
        assert all(np.isfinite(o.audio).all() for o in outputs)
        return [o.tokens for o in outputs]
    finally:
        engine.stop()


# Plain functions driving asyncio themselves: the GPU image has no pytest-asyncio.
def test_graphs_replay_the_eager_step(cuda_model):
    eager = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=3, cuda_graphs=False,
                                                                fuse_kernels=False), 10))
    graphed = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=3, cuda_graphs=True,
                                                                  fuse_kernels=False), 10))
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed))


def test_fused_and_fp8_engines_run(cuda_model):
    fused = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=2, fuse_kernels=True), 8))
    fp8 = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=2, fp8_kv=True), 8))
    assert len(fused) == len(fp8) == 8
