"""The engine's CUDA-only paths on the tiny checkpoint: graphs replay what eager runs compute. Skipped without a GPU.

Run on the device machine: `python3 -m pytest -q --noconftest tests/test_engine_cuda.py`.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from test_engine import GREEDY, Collector, QueueSource, speechlike

from model import fused, launch
from model.engine import Engine, EngineConfig, SamplingParams, SessionParams
from model.loading import load_model
from model.precision import Fp8Linear
from model.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


@pytest.fixture(scope="module", autouse=True)
def eager_helpers_after():
    """Engines here compile the fusable helpers process-wide; the CUDA tests of other modules compare eager ones."""
    yield
    fused.disable()


@pytest.fixture(scope="module")
def cuda_model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, context=64)
    return load_model(str(folder), device="cuda", dtype="float32")


def session_params(pacing: str = "realtime") -> SessionParams:
    return SessionParams(voice="NATF2", persona="Hello there.", sampling=SamplingParams(greedy=True), pacing=pacing)


async def session_tokens(model, config: EngineConfig, frames: int, row: int = 0,
                         pacing: str = "realtime", shuffle_pages: bool = False) -> list[np.ndarray]:
    """The tokens of one greedy session in slot `row` (the slots before it held, idle); with `shuffle_pages` its KV
    pages come from the pool in no order."""
    engine = Engine(model, config)
    if shuffle_pages:
        random.Random(7).shuffle(engine.runner.pages.free)
    engine.start()
    try:
        slots = [engine.reserve() for _ in range(row + 1)]
        slot, sink = slots[-1], Collector()
        assert slot.index == row
        await slot.start(session_params(pacing), QueueSource(speechlike(frames + 2, 1)), sink.on_output,
                         sink.on_error)
        outputs = await sink.wait_for(frames)
        assert all(np.isfinite(o.audio).all() for o in outputs)
        return [o.tokens for o in outputs]
    finally:
        engine.stop()


def graphed_and_eager(model, frames: int, row: int = 0, pacing: str = "realtime"):
    """One session's tokens from an eager engine and a graphed one, both on PyTorch's own convolutions.

    With cuDNN, the capture's choice of algorithm need not be the eager run's: when the capture timed them (as it
    did until the engine took cuDNN's heuristics), Mimi's encoder rounded differently and a deep residual codebook
    of the user's codes could flip after a few frames (seen on the H200). The native convolutions are one
    algorithm, so graphs must replay eager exactly.
    """
    config = {"max_sessions": 3, "fuse_kernels": False}
    with torch.backends.cudnn.flags(enabled=False):
        eager = asyncio.run(session_tokens(model, EngineConfig(cuda_graphs=False, **config), frames, row, pacing))
        graphed = asyncio.run(session_tokens(model, EngineConfig(cuda_graphs=True, **config), frames, row, pacing))
    return eager, graphed


# Plain functions driving asyncio themselves: the GPU image has no pytest-asyncio.
def test_graphs_replay_the_eager_step(cuda_model):
    eager, graphed = graphed_and_eager(cuda_model, 10)
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True))


def fused_layers(seanet) -> list[str]:
    return [type(layer).__name__ for layer in seanet.model if getattr(layer, "fused", False)]


def test_the_default_cuda_engine_decodes_in_bf16_through_the_kernels_and_encodes_in_float32(cuda_model):
    engine = Engine(cuda_model, EngineConfig(max_sessions=1))
    assert (engine.runner.mimi.encoder_dtype, engine.runner.mimi.decoder_dtype) == (torch.float32, torch.bfloat16)
    # Of the tiny decoder the kernels take an upsampling convolution, two residual units and the one to audio.
    assert fused_layers(engine.runner.mimi.encoder) == []
    assert fused_layers(engine.runner.mimi.decoder) == ["CausalConvTranspose1d", "ResidualBlock", "ResidualBlock",
                                                        "CausalConv1d"]
    exact = Engine(cuda_model, EngineConfig(max_sessions=1, mimi_decoder_bf16=False))
    assert exact.runner.mimi.decoder_dtype == torch.float32


def test_fused_and_fp8_engines_run(cuda_model):
    fused = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=2, fuse_kernels=True), 8))
    fp8 = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=2, fp8_kv=True), 8))
    weights = asyncio.run(session_tokens(cuda_model, EngineConfig(max_sessions=2, fp8_kv=True, fp8_weights=True), 8))
    assert len(fused) == len(fp8) == len(weights) == 8


def test_fp8_linear_tracks_the_exact_product_at_every_batch_size():
    """torch._scaled_mm with a scale per row of the input and per output channel, for the batch sizes the engine
    steps (one row, odd buckets) and the 7B's shapes; within e4m3's rounding of the bf16 product."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((4096, 4096), (2 * 11264, 4096), (4096, 11264)):
        weight = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
        linear = Fp8Linear(weight)
        for rows in (1, 7, 250):
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            exact = (x.float() @ weight.float().t())
            error = (linear(x).float() - exact).norm() / exact.norm()
            assert linear(x).dtype == torch.bfloat16 and float(error) < 0.05


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_an_engine_on_the_second_gpu_runs_its_fused_kernels_there(tmp_path):
    """Triton launches on the thread's current device: an engine on cuda:1 (one per GPU, --gpus all) failed its
    first fused kernel while cuda:0 was current. It now gives the tokens the same engine gives on cuda:0."""
    folder = write_tiny_checkpoint(tmp_path, seed=3, context=64)
    config = EngineConfig(max_sessions=2, fp8_kv=True)
    tokens = [asyncio.run(session_tokens(load_model(str(folder), device=device, dtype="float32"), config, 8))
              for device in ("cuda:0", "cuda:1")]
    assert all(np.array_equal(a, b) for a, b in zip(*tokens, strict=True))


@pytest.mark.parametrize("row,pacing", [(1, "realtime"), (2, "input")])
def test_graphed_row_steps_replay_the_eager_ones(cuda_model, row, pacing):
    """A session's first model half, and every frame of an input-clocked session, replay one row's graphs."""
    eager, graphed = graphed_and_eager(cuda_model, 10, row, pacing)
    assert all(np.array_equal(a, b) for a, b in zip(eager, graphed, strict=True))


async def tokens_after_an_in_flight_copy(model, config: EngineConfig, frames: int) -> list[np.ndarray]:
    """The tokens of session_tokens' session in slot 1, opened (from the prompt cache) until its prompt's copy
    happened while a tick was in flight, beside a live session in slot 0."""
    engine = Engine(model, config)
    engine.start()
    try:
        await engine.reserve().start(SessionParams(voice="NATM1", sampling=GREEDY), QueueSource(speechlike(3000, 4)),
                                     Collector().on_output, Collector().on_error)
        pause = random.Random(5)
        for _ in range(200):  # the first open caches the prompt; each later one copies it, in a gap or in flight
            copied = engine.stats().prompt_copies_in_flight
            slot, sink = engine.reserve(), Collector()
            assert slot.index == 1
            await slot.start(session_params(), QueueSource(speechlike(frames + 2, 1)), sink.on_output, sink.on_error)
            if engine.stats().prompt_copies_in_flight > copied:
                return [o.tokens for o in await sink.wait_for(frames)]
            slot.close()
            await asyncio.sleep(pause.uniform(0.0, config.tick_ms / 1000.0))
        raise AssertionError("no cached prompt was copied while a tick was in flight")
    finally:
        engine.stop()


def test_a_prompt_copied_while_a_tick_is_in_flight_starts_the_same_session(cuda_model):
    """A cached prompt's copy served during a tick queues behind the tick's writes to the (inactive) row and its
    outputs: the session is the one an open between ticks starts."""
    config = {"max_sessions": 3, "fuse_kernels": False}
    with torch.backends.cudnn.flags(enabled=False):
        between = asyncio.run(session_tokens(cuda_model, EngineConfig(**config), 10, row=1))
        # Short ticks: most opens then land in one or wait for one. The tiny model's tick (~2.5 ms on the H200) is
        # shorter than its copy (~2 ms of host work, times 1.5): let the copy hold up the tick's delivery.
        in_flight = asyncio.run(tokens_after_an_in_flight_copy(
            cuda_model, EngineConfig(tick_ms=10.0, in_flight_copy_share=4.0, **config), 10))
    assert all(np.array_equal(a, b) for a, b in zip(between, in_flight, strict=True))


@pytest.mark.parametrize("fp8_kv", [False, True])
def test_a_session_reads_its_pages_in_any_order_across_the_ring_wrap(cuda_model, fp8_kv):
    """The kernels read and write through the page table: pages handed out in order or shuffled give the same
    tokens, over more frames than the ring holds (64)."""
    config = {"max_sessions": 3, "fuse_kernels": False, "fp8_kv": fp8_kv, "kv_page_frames": 16}
    with torch.backends.cudnn.flags(enabled=False):
        ordered = asyncio.run(session_tokens(cuda_model, EngineConfig(**config), 90))
        shuffled = asyncio.run(session_tokens(cuda_model, EngineConfig(**config), 90, shuffle_pages=True))
    assert all(np.array_equal(a, b) for a, b in zip(ordered, shuffled, strict=True))


async def shrink_and_grow(model) -> tuple[list, list]:
    engine = Engine(model, EngineConfig(max_sessions=2, kv_pages=3, kv_page_frames=32, kv_reserve_s=0.08,
                                        kv_floor_frames=32))
    engine.start()
    try:
        long, long_sink, long_source = engine.reserve(), Collector(), QueueSource(speechlike(80, 4))
        await long.start(session_params("input"), long_source, long_sink.on_output, long_sink.on_error)
        await long_sink.wait_for(80)
        newcomer, sink = engine.reserve(), Collector()
        await newcomer.start(session_params("input"), QueueSource(speechlike(70, 5)), sink.on_output, sink.on_error)
        await sink.wait_for(70)
        shrunk = long.stats()
        newcomer.close()
        for frame in speechlike(60, 6):
            long_source.push(frame)
        await long_sink.wait_for(140)
        return [shrunk, long.stats(), engine.stats()], long_sink.outputs + sink.outputs
    finally:
        engine.stop()


def test_a_window_shrinks_and_grows_back_under_graphs(cuda_model):
    (shrunk, grown, stats), outputs = asyncio.run(shrink_and_grow(cuda_model))
    assert shrunk.window_shrinks == 1 and shrunk.window_frames == 32
    assert grown.window_frames == 64 and stats.kv_window_grows == 1
    assert all(np.isfinite(o.audio).all() for o in outputs)


def stepped_frames(model, rows: int, pcm: np.ndarray, **config) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and audio of `rows` sampled rows (server defaults, row r seeded r) stepped through pcm [frames, rows,
    1920] by an engine of `config`."""
    engine = Engine(model, EngineConfig(max_sessions=rows, **config))
    engine.sample_rows(rows, SamplingParams())
    steps = [engine.step_rows(rows, frame) for frame in pcm]
    return np.stack([s[0].copy() for s in steps]), np.stack([s[1].copy() for s in steps])


def test_the_fused_draw_in_the_graphs_draws_the_torch_paths_tokens(cuda_model):
    """EngineConfig.fused_draw: the audio draws as one Triton kernel each, captured in the step's graphs. The tiny
    model's float32 logits do not tie, so sampled rows (server defaults, row r seeded r) draw exactly the tokens of
    the torch path's draws, frame after frame."""
    rows, frames = 4, 20
    pcm = np.stack([speechlike(frames, seed) for seed in range(rows)], axis=1)  # [frames, rows, 1920]
    fused_tokens = stepped_frames(cuda_model, rows, pcm, fused_draw=True)[0]
    assert np.array_equal(fused_tokens, stepped_frames(cuda_model, rows, pcm, fused_draw=False)[0])


@pytest.mark.skipif(not launch.supported(torch.device("cuda")), reason="programmatic dependent launch: sm_90 on")
def test_kernels_launched_as_programmatic_dependents_step_the_same_frames(cuda_model):
    """EngineConfig.pdl_launches: every Triton kernel of the step (attention, KV writes, the draws, the decoder's
    SEANet kernels, the depformer's fused products at one row, Inductor's helpers) launched as a programmatic
    dependent, in the graphs: the same tokens and the same audio, bit for bit, as plain launches, frame after
    frame; four rows, and a lone row with the fused depformer."""
    frames = 20
    for rows, fused_depformer in ((4, False), (1, True)):
        pcm = np.stack([speechlike(frames, seed) for seed in range(rows)], axis=1)
        plain = stepped_frames(cuda_model, rows, pcm, fused_depformer=fused_depformer)
        dependent = stepped_frames(cuda_model, rows, pcm, fused_depformer=fused_depformer, pdl_launches=True)
        assert np.array_equal(plain[0], dependent[0]) and np.array_equal(plain[1], dependent[1])
    launch.enable(False)  # plain launches again for the tests after this one
