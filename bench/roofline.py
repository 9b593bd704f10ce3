"""Roofline of the engine's tick, part by part: what each part must read and compute, what it takes, how close it is.

    python -m bench.roofline --fp8-kv [--loads 1x0 250x0 250x1650 144x3000] [--steps 20] [--top 10]
                             [--engine-json docs/bench/FILE.jsonl] [--(no-)mimi-encoder-bf16] [--(no-)mimi-decoder-bf16]
                             [--mimi-variants] [--tiny]

Full 7B shape with random bf16 weights on the GPU. For each load (sessions x context frames), one JSON line per part
of a tick: Mimi encode, the temporal transformer's attention and the rest of its step (projections, norms, RoPE and
KV writes, embeddings, the text head and sampling), the depformer, Mimi decode, and the host. Each line gives:
- `bytes_gb`: what the part must read from memory at least: its weights, the KV it attends over (the temporal
  cache's filled slots, Mimi's whole rings), its streaming state (read and written back);
- `gflop`: the products' FLOPs (the temporal and depformer weights' 2 per weight per row, attention's 4 * dim per
  key and layer, Mimi's convolutions and products as torch's FLOP counter counts one row's step);
- `ms`: its device time, the p50 of `--steps` graph replays timed by CUDA events (attention and the temporal rest
  split by their kernels' share of the profiled step); the host's from an engine_bench line of the same load,
  with its phases (`prepare_inputs_ms`, `prepare_launch_ms` and its parts `prepare_uploads_ms`,
  `prepare_steps_ms`, `prepare_outputs_ms`, `deliver_ms`, and `hand_off_ms` over the channel);
- `tb_s`, `tflop_s`: bytes and FLOPs over that time; `floor_ms`: the larger of bytes at `--peak-tbs` and FLOPs at
  the part's matrix peak (bf16, or TF32 for a float32 Mimi side); `x_floor`: ms over floor_ms;
- `kernels`: launches per step, and `kernel_ms` their summed device time, profiled on the engine's own graph
  replays (eager steps where it runs without graphs), so `ms - kernel_ms` is what the part spends between kernels.
"roofline_kernels" lines list each part's top kernels; "roofline_tick" sums a load. `--mimi-variants` also times Mimi
alone at each load's batch in float32, decoder bf16 and both bf16, and as the engine runs it by default (decoder
bf16 through the SEANet kernels) ("mimi_variant" lines); the arithmetic flags (`--(no-)mimi-fused-decoder`,
`--fp8-weights`, ...) set the engine's own, as in bench.engine_bench.
`--tiny` runs the tiny checkpoint on the CPU (wall clock, no profile), to try the script.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from bench.engine_bench import load
from bench.fullsize import add_arithmetic_flags, arithmetic_config, bench_model, machine
from model import fused
from model.batch_step import BatchStep, bucket
from model.config import FRAME_SAMPLES
from model.engine import Engine, EngineConfig
from model.engine.stats import PREPARE_LAUNCH_PARTS
from model.lm import LM
from model.mimi import Mimi

ATTENTION_KERNELS = ("_partial_kernel",)  # the temporal decode attention (direct, or split-K with its merge below)
MERGE_KERNEL = "merge_partials"


def param_bytes(modules: Iterable[nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in [*m.parameters(), *m.buffers()])


def matrix_weights(modules: Iterable[nn.Module]) -> int:
    """Weights that multiply each row once per step (2-D parameters), for 2 FLOPs each."""
    return sum(p.numel() for m in modules for p in m.parameters() if p.dim() == 2)


def temporal_costs(lm: LM, rows: int, keys: float, fp8: bool) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) of the temporal step's attention over `keys` filled slots per row (mean), and of its rest."""
    cfg = lm.cfg
    kv_element = 1 if fp8 else lm.text_linear.weight.element_size()
    per_key = 2 * cfg.num_layers * cfg.num_heads * (cfg.head_dim * kv_element + (4 if fp8 else 0))
    attention = (rows * keys * per_key, 4.0 * rows * keys * cfg.dim * cfg.num_layers)
    dense = [lm.transformer, lm.out_norm, lm.text_linear]
    embedded = rows * cfg.num_rows * cfg.dim * lm.text_linear.weight.element_size()  # the rows each token gathers
    rest = (param_bytes(dense) + embedded, 2.0 * rows * matrix_weights([lm.transformer, lm.text_linear]))
    return {"temporal_attention": attention, "temporal_rest": rest}


def depformer_cost(lm: LM, rows: int) -> tuple[float, float]:
    dense = [lm.depformer_in, lm.depformer, lm.linears]
    return param_bytes(dense), 2.0 * rows * matrix_weights(dense)


def mimi_row_flops(mimi: Mimi, device: torch.device) -> dict[str, int]:
    """FLOPs of one row's streaming encode and decode, as torch's FLOP counter counts them (products and
    convolutions), with the fused helpers eager: the counter sees no compiled code's operators."""
    compiled = fused.enabled()
    fused.disable()
    try:
        state = mimi.init_state(1, device)
        with FlopCounterMode(display=False) as encode_flops:
            codes = mimi.encode_frame(torch.zeros(1, FRAME_SAMPLES, device=device), state)
        with FlopCounterMode(display=False) as decode_flops:
            mimi.decode_frame(codes, state)
    finally:
        if compiled:
            fused.enable()
    return {"encode": encode_flops.get_total_flops(), "decode": decode_flops.get_total_flops()}


def mimi_costs(mimi: Mimi, rows: int, row_flops: dict[str, int]) -> dict[str, tuple[float, float]]:
    """(bytes, FLOPs) of one streaming encode and decode of `rows` rows: weights, the transformers' whole rings and
    the convolutions' kept samples read (and the latter written back)."""
    state = mimi.init_state(1, "meta")
    costs = {}
    for name, stream, modules in (
        ("encode", state.encoder, [mimi.encoder, mimi.encoder_transformer, mimi.downsample, mimi.quantizer]),
        ("decode", state.decoder, [mimi.upsample, mimi.decoder_transformer, mimi.decoder, mimi.quantizer]),
    ):
        ring = stream.kv.keys.numel() * stream.kv.keys.element_size() * 2
        kept = 2 * sum(buf.shape[1] * carried * buf.element_size()
                       for buf, carried in zip(stream.convs, stream.carried, strict=True))
        costs[name] = (param_bytes(modules) + rows * (ring + kept), float(rows * row_flops[name]))
    return costs


def p50(values: list[float]) -> float:
    return float(np.percentile(values, 50))


def kernel_profile(fns: dict[str, Callable[[], None]], iterations: int) -> dict[str, dict[str, tuple[float, int]]]:
    """Per part: {kernel name: (device ms per step, launches per step)} from eager runs under the profiler, after
    one run outside it (a new shape's compilation times candidate kernels on the device)."""
    out: dict[str, dict[str, tuple[float, int]]] = {name: {} for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            fn()
    for _ in range(iterations):
        for name, fn in fns.items():
            with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():  # as the engine runs them
                fn()
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_time_total > 0:
                    ms, calls = out[name].get(event.key, (0.0, 0))
                    out[name][event.key] = (ms + event.device_time_total / 1000 / iterations,
                                            calls + event.count)
    return {name: {k: (ms, calls // iterations) for k, (ms, calls) in kernels.items()}
            for name, kernels in out.items()}


def op_profile(fn: Callable[[], None], top: int) -> list[list]:
    """The operators (with input shapes) that take most device time in one eager run of `fn`."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof, \
            torch.no_grad():
        fn()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    return [[e.key, round(e.self_device_time_total / 1000, 3), e.count, str(e.input_shapes)[:120]] for e in ops[:top]]


def is_attention(kernel: str) -> bool:
    return kernel.startswith(ATTENTION_KERNELS) or MERGE_KERNEL in kernel


def part_line(base: dict, part: str, ms: float, cost: tuple[float, float], peak_tbs: float, peak_tflops: float,
              kernels: dict[str, tuple[float, int]] | None) -> dict:
    nbytes, flops = cost
    floor = max(nbytes / (peak_tbs * 1e12), flops / (peak_tflops * 1e12)) * 1000
    line = {**base, "part": part, "ms": round(ms, 3), "bytes_gb": round(nbytes / 1e9, 3),
            "gflop": round(flops / 1e9, 1), "tb_s": round(nbytes / ms / 1e9, 2) if ms > 0 else None,
            "tflop_s": round(flops / ms / 1e9, 1) if ms > 0 else None, "floor_ms": round(floor, 3),
            "x_floor": round(ms / floor, 2) if floor > 0 else None}
    if kernels is not None:
        line["kernels"] = sum(calls for _, calls in kernels.values())
        line["kernel_ms"] = round(sum(ms for ms, _ in kernels.values()), 3)
    return line


HOST_PHASES = ("prepare_inputs", "prepare_launch", *PREPARE_LAUNCH_PARTS, "deliver", "hand_off")


def host_ms(engine_lines: list[dict], sessions: int, context: int) -> tuple[float | None, dict[str, float]]:
    """The engine_bench line's host p50 for the load (its tick less its device parts), and its phases' p50s."""
    for line in engine_lines:
        if line.get("bench") == "engine_tick" and line["sessions"] == sessions and line["context_frames"] == context:
            phases = {f"{phase}_ms": line[f"host_{phase}_ms_p50"] for phase in HOST_PHASES
                      if f"host_{phase}_ms_p50" in line}
            return line["host_ms_p50"], phases
    return None, {}


def measure_load(engine: Engine, sessions: int, context: int, args: argparse.Namespace,
                 engine_lines: list[dict], row_flops: dict[str, int]) -> list[dict]:
    """The load's lines: sessions active rows of the padded batch a tick of them runs, their KV holding `context`
    frames (the padding rows empty and idle, as in a tick)."""
    runner, lm = engine.runner, engine.model.lm
    n = bucket(sessions, engine.max_sessions)
    engine.fill_context(slice(0, engine.max_sessions), 0)  # the last load's pages back to the pool
    engine.fill_context(slice(0, sessions), context)
    for _ in range(3):
        engine.step_rows(sessions)
    before = runner.lm_state.pos[:sessions].float().mean().item()
    runs = []
    for _ in range(args.steps):
        engine.step_rows(sessions)
        runs.append(runner.parts_ms)
    after = runner.lm_state.pos[:sessions].float().mean().item()
    # Filled slots a step attends over, mean over the active rows and steps (a step writes its key, then attends).
    keys = min((before + after + 1) / 2, lm.cfg.context)
    ms = {part: p50([run[part] for run in runs]) for part in BatchStep.PARTS}
    kernels = None
    if runner.device.type == "cuda":
        # The engine's own graphs where it runs them: eager steps of the same code show other kernels (unfused
        # chains where a helper fell back, launches the graphs do not hold).
        step = runner.batch_step(n)
        parts = ([graph.replay for graph in step.graphs] if step.graphs is not None
                 else [step.encode, step.temporal_part, step.depformer_part, step.decode])
        kernels = kernel_profile(dict(zip(BatchStep.PARTS, parts, strict=True)), 3)
    # Every row of the batch runs the dense products and Mimi; only the active rows have keys to read.
    costs = {**temporal_costs(lm, n, keys * sessions / n, engine.config.fp8_kv), "depformer": depformer_cost(lm, n),
             **mimi_costs(runner.mimi, n, row_flops)}
    base = {"bench": "roofline", "sessions": sessions, "context_frames": context, "batch": n,
            "keys_mean": round(keys, 1)}
    mimi_peak = {"encode": runner.mimi.encoder_dtype, "decode": runner.mimi.decoder_dtype}
    lines = []
    split = {}
    if kernels is not None:
        temporal = kernels["temporal"]
        attention = {k: v for k, v in temporal.items() if is_attention(k)}
        split = {"temporal_attention": attention, "temporal_rest": {k: v for k, v in temporal.items()
                                                                     if not is_attention(k)}}
        share = sum(v[0] for v in attention.values()) / max(sum(v[0] for v in temporal.values()), 1e-9)
    else:
        share = 0.0
    for part in ("encode", "temporal_attention", "temporal_rest", "depformer", "decode"):
        if part == "temporal_attention":
            part_ms = ms["temporal"] * share
        elif part == "temporal_rest":
            part_ms = ms["temporal"] * (1 - share)
        else:
            part_ms = ms[part]
        dtype = mimi_peak.get(part, torch.bfloat16)
        peak = args.peak_bf16_tflops if dtype != torch.float32 else args.peak_tf32_tflops
        part_kernels = split.get(part, kernels.get(part) if kernels else None)
        lines.append(part_line(base, part, part_ms, costs[part], args.peak_tbs, peak, part_kernels))
    host, phases = host_ms(engine_lines, sessions, context)
    if host is not None:
        lines.append({**base, "part": "host", "ms": host, "bytes_gb": 0.0, "gflop": 0.0, "floor_ms": 0.0, **phases})
    device_ms = sum(ms.values())
    floor = sum(line["floor_ms"] for line in lines)
    lines.append({"bench": "roofline_tick", **{k: v for k, v in base.items() if k != "bench"},
                  "device_ms": round(device_ms, 3), "host_ms": host,
                  "tick_ms": round(device_ms + (host or 0.0), 3), "floor_ms": round(floor, 3),
                  "bytes_gb": round(sum(line["bytes_gb"] for line in lines), 2),
                  "kernels": sum(line.get("kernels", 0) for line in lines)})
    if kernels is not None and args.top:
        for part, part_kernels in kernels.items():
            top = sorted(part_kernels.items(), key=lambda kv: -kv[1][0])[: args.top]
            lines.append({"bench": "roofline_kernels", "sessions": sessions, "context_frames": context, "part": part,
                          "top": [[name[:80], round(v[0], 3), v[1]] for name, v in top]})
    return lines


def captured(fn: Callable[[], object], pool=None) -> torch.cuda.CUDAGraph:
    """`fn` captured as a CUDA graph (in `pool`), after two warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.no_grad():
        fn()
    return graph


def event_ms(fn: Callable[[], object]) -> float:
    """One call of `fn`, timed on the device by CUDA events: ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def replay_ms(fns: dict[str, Callable[[], object]], steps: int) -> dict[str, float]:
    """Each function captured as a CUDA graph (`captured`) and replayed `steps` times: p50 ms of a replay, by
    name."""
    pool = torch.cuda.graph_pool_handle()
    graphs = {name: captured(fn, pool) for name, fn in fns.items()}
    return {name: p50([event_ms(graph.replay) for _ in range(steps)]) for name, graph in graphs.items()}


def time_mimi(mimi: Mimi, rows: int, device: torch.device, steps: int) -> dict[str, float]:
    """Encode and decode of `rows` rows through Mimi alone, each captured as a CUDA graph: p50 ms of `steps`."""
    state = mimi.init_state(rows, device)
    pcm = 0.1 * torch.randn(rows, FRAME_SAMPLES, device=device)
    codes = torch.zeros(rows, mimi.num_codebooks, dtype=torch.long, device=device)
    times = replay_ms({"encode": lambda: codes.copy_(mimi.encode_frame(pcm, state)),
                       "decode": lambda: mimi.decode_frame(codes, state)}, steps)
    return {f"{name}_ms": round(ms, 3) for name, ms in times.items()}


def mimi_variant(mimi: Mimi, name: str, rows: int, device: torch.device, steps: int, top_kernels: int) -> dict:
    """One precision of Mimi alone at `rows` rows: graphed times and the eager kernels of each direction."""
    line = {"bench": "mimi_variant", "variant": name, "batch": rows, **time_mimi(mimi, rows, device, steps)}
    state = mimi.init_state(rows, device)
    pcm = 0.1 * torch.randn(rows, FRAME_SAMPLES, device=device)
    codes = mimi.encode_frame(pcm, state)
    kernels = kernel_profile({"encode": lambda: mimi.encode_frame(pcm, state),
                              "decode": lambda: mimi.decode_frame(codes, state)}, 2)
    for part, part_kernels in kernels.items():
        line[f"{part}_kernels"] = sum(calls for _, calls in part_kernels.values())
        line[f"{part}_kernel_ms"] = round(sum(ms for ms, _ in part_kernels.values()), 3)
        top = sorted(part_kernels.items(), key=lambda kv: -kv[1][0])[:top_kernels]
        line[f"{part}_top"] = [[k[:80], round(v[0], 3), v[1]] for k, v in top]
    line["encode_ops"] = op_profile(lambda: mimi.encode_frame(pcm, state), top_kernels)
    line["decode_ops"] = op_profile(lambda: mimi.decode_frame(codes, state), top_kernels)
    return line


def mimi_variants(model_mimi: Mimi, rows: int, device: torch.device, steps: int, top_kernels: int) -> list[dict]:
    """Mimi alone in float32, with its decoder in bf16, and all in bf16; and as the engine runs it by default, its
    decoder in bf16 through the SEANet kernels."""
    bf16, fp32 = torch.bfloat16, torch.float32
    lines = []
    for name, encoder, decoder in (("float32", fp32, fp32), ("decoder_bf16", fp32, bf16), ("bf16", bf16, bf16)):
        mimi = model_mimi.with_precision(encoder, decoder)
        lines.append(mimi_variant(mimi, name, rows, device, steps, top_kernels))
        torch.cuda.empty_cache()
    default = model_mimi.with_precision(fp32, bf16).with_fused_seanet(encoder=False)
    lines.append(mimi_variant(default, "decoder_bf16_fused_decoder", rows, device, steps, top_kernels))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loads", type=load, nargs="+", default=[(1, 0), (250, 0), (250, 1650), (144, 3000)])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=10, help="kernels listed per part (0: none)")
    parser.add_argument("--fp8-kv", action="store_true")
    add_arithmetic_flags(parser)
    parser.add_argument("--mimi-variants", action="store_true",
                        help="also time Mimi alone in three precisions, eager and compiled")
    parser.add_argument("--engine-json", help="engine_bench JSON lines whose host p50 to take for each load")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="memory bandwidth, TB/s (H200 datasheet)")
    parser.add_argument("--peak-bf16-tflops", type=float, default=790.0, help="bf16 products (measured on the H200)")
    parser.add_argument("--peak-tf32-tflops", type=float, default=395.0, help="TF32 products (half of bf16)")
    parser.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU")
    args = parser.parse_args()
    engine_lines = []
    if args.engine_json:
        with open(args.engine_json) as f:
            engine_lines = [json.loads(line) for line in f if line.startswith("{")]
    model = bench_model(args.tiny)
    cuda = model.device.type == "cuda"
    if cuda:
        # As the engine's start captures (runner.warm_up): cuDNN's heuristics choose its algorithms.
        torch.backends.cudnn.benchmark = False
    batches = sorted({bucket(s, max(s for s, _ in args.loads)) for s, _ in args.loads})
    if args.mimi_variants and cuda:  # before the engine takes the device's memory for its KV pool
        torch.backends.cuda.matmul.allow_tf32 = True  # as the engine sets it (runner.py)
        fused.enable()
        for rows in batches:
            for line in mimi_variants(model.mimi, rows, model.device, args.steps, args.top):
                print(json.dumps(line), flush=True)
    arithmetic = arithmetic_config(args)
    engine = Engine(model, EngineConfig(max_sessions=max(s for s, _ in args.loads), fp8_kv=args.fp8_kv, **arithmetic))
    print(json.dumps({"bench": "roofline_start", "fp8_kv": args.fp8_kv, **arithmetic, **machine(),
                      "peak_tbs": args.peak_tbs, "peak_bf16_tflops": args.peak_bf16_tflops,
                      "peak_tf32_tflops": args.peak_tf32_tflops}),
          flush=True)
    row_flops = mimi_row_flops(engine.runner.mimi, engine.device)
    for sessions, context in args.loads:
        for line in measure_load(engine, sessions, context, args, engine_lines, row_flops):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
