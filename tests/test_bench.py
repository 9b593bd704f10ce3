"""The benchmark scripts run end to end (on the tiny checkpoint on the CPU) and print the JSON lines they promise.

The figures come from the H200 (docs/benchmarks.md); these runs only keep the scripts working.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def bench_lines(*args: str, tiny_flag: bool = True) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", *args, *(["--tiny"] if tiny_flag else [])], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_engine_bench_prints_ticks_capacity_and_opens() -> None:
    lines = bench_lines("bench.engine_bench", "--sessions", "2", "--contexts", "0", "200", "--ticks", "5",
                        "--max-sessions", "3", "--open-background", "2", "--opens", "2")
    by_kind: dict[str, list[dict]] = {}
    for line in lines:
        by_kind.setdefault(line["bench"], []).append(line)
    (start,) = by_kind["engine_start"]
    assert start["host_cpu"] and start["host_cpus"] >= 1 and "gpu" in start  # which machine the figures are from
    ticks = by_kind["engine_tick"]
    assert [t["context_frames"] for t in ticks] == [0, 200]
    for tick in ticks:
        assert tick["ticks"] >= 5 and tick["batch"] == 2  # every tick asked for, however slow the engine
        assert all(tick[f"{part}_ms_p50"] > 0 for part in ("encode", "temporal", "depformer", "decode"))
        assert tick["tick_ms_p99"] >= tick["tick_ms_p50"] > 0 and tick["host_deliver_ms_p50"] > 0
    assert {c["context_frames"] for c in by_kind["engine_capacity"]} == {0, 200}
    opens = {o["kind"]: o for o in by_kind["engine_open"]}
    assert set(opens) == {"cold", "cached"}
    assert opens["cached"]["engine_work_ms_p50"] < opens["cold"]["engine_work_ms_p50"]
    assert all(o["opens"] == 2 and 0 < o["open_ms_p50"] <= o["first_frame_ms_p50"] for o in opens.values())
    assert all(o["prompt_copies_in_flight_total"] == 0 for o in opens.values())  # the CPU has no tick in flight
    # Every step kind's figure is a real run's (a first model half that a tick ran first is no 0 ms "lead").
    assert all(ms > 0 for o in opens.values() for ms in o["open_step_ms"].values())


def test_engine_bench_over_the_channel_times_the_hand_off_to_the_workers() -> None:
    """The sessions workers', as the server runs them (here two worker processes, a session each): each tick's
    outputs go out over the engine's channel, and the listeners that encode them show as a host phase of their own;
    with --compare-staging, each load with the engine process's input staging off, then on; and with two
    --warm-lead-ms, each of those with the tick's warm-up off, then on, on the same engine."""
    ticks = [line for line in bench_lines("bench.engine_bench", "--loads", "2x0", "--ticks", "5", "--max-sessions",
                                          "2", "--opens", "0", "--over-channel", "--workers", "2", "--compare-staging",
                                          "--warm-lead-ms", "0", "2")
             if line["bench"] == "engine_tick"]
    assert [(tick["stage_inputs"], tick["warm_lead_ms"]) for tick in ticks] == [
        (False, 0.0), (False, 2.0), (True, 0.0), (True, 2.0)], ticks
    assert [tick["input_frames_staged"] > 0 for tick in ticks] == [False, False, True, True], ticks
    assert [tick["tick_warm_ups"] > 0 for tick in ticks] == [False, True, False, True], ticks
    for tick in ticks:
        assert tick["over_channel"] and tick["workers"] == 2 and tick["ticks"] >= 5 and tick["batch"] == 2, tick
        assert tick["host_hand_off_ms_p99"] >= tick["host_hand_off_ms_p50"] > 0 < tick["host_deliver_ms_p50"], tick
        assert 0 <= tick["host_prepare_inputs_ms_p50"] <= tick["host_prepare_ms_p50"], tick
        assert 0 < tick["frames_dispatch_ms_p50"] <= tick["frames_dispatch_ms_p99"], tick


def test_depformer_step_prints_each_paths_time_and_tokens() -> None:
    """Without CUDA only the torch path runs (the fused paths are CUDA's); its tokens are its own."""
    lines = bench_lines("bench.depformer_step", "--rows", "1", "2", "--rounds", "2", "--replays", "2", "--frames", "2")
    (start,) = [line for line in lines if "path" not in line]
    assert start["pdl_supported"] is False and start["host_cpus"] >= 1
    steps = [line for line in lines if "path" in line]
    assert [(line["rows"], line["path"]) for line in steps] == [(1, "torch"), (2, "torch")]
    assert all(line["ms_p50"] > 0 and line["tokens_equal_to_torch"] == 1.0 for line in steps)


def test_roofline_prints_each_part_and_the_hosts_phases_from_an_engine_bench_line(tmp_path) -> None:
    engine = bench_lines("bench.engine_bench", "--loads", "2x0", "--ticks", "5", "--max-sessions", "2", "--opens", "0")
    engine_json = tmp_path / "engine.jsonl"
    engine_json.write_text("\n".join(json.dumps(line) for line in engine))
    lines = bench_lines("bench.roofline", "--loads", "2x0", "--steps", "2", "--engine-json", str(engine_json))
    parts = {line["part"]: line for line in lines if line["bench"] == "roofline"}
    assert set(parts) == {"encode", "temporal_attention", "temporal_rest", "depformer", "decode", "host"}, parts
    (tick,) = [line for line in engine if line["bench"] == "engine_tick"]
    host = parts["host"]
    assert host["ms"] == tick["host_ms_p50"] and host["deliver_ms"] == tick["host_deliver_ms_p50"], host
    assert host["prepare_inputs_ms"] == tick["host_prepare_inputs_ms_p50"] and "hand_off_ms" not in host, host
    (total,) = [line for line in lines if line["bench"] == "roofline_tick"]
    assert total["host_ms"] == host["ms"] and total["tick_ms"] >= total["device_ms"] > 0, total


def test_channel_cost_prints_each_messages_bytes_and_times() -> None:
    (line,) = bench_lines("bench.channel_cost", "--sessions", "4", "--runs", "3", tiny_flag=False)
    assert line["sessions"] == 4 and line["tick_bytes"] > 4 * 7680 and line["frames_bytes"] > 4 * 7680, line
    assert all(line[k] > 0 for k in ("tick_encode_ms", "tick_encode_joined_ms", "tick_decode_ms", "frames_encode_ms",
                                     "frames_decode_ms")), line


def test_call_mix_prints_steady_state_equal_contexts_and_worst_case() -> None:
    """A pool of 8 pages of 50 frames for 3 calls of up to 250 frames: the steady state's contexts do not fit, so
    windows shrink while the calls open (one engine command fills them), and no call fails. Then the mix's KV as
    equal contexts, and the worst case."""
    lines = bench_lines("bench.call_mix", "--concurrency", "3", "--mean-s", "10", "--cap-s", "40", "--minutes", "0.15",
                        "--max-sessions", "4", "--kv-pages", "8", "--floor-frames", "50", "--worst-case", "2",
                        "--worst-seconds", "0.5", "--equal-seconds", "0.5")
    start, mix, equal, worst = lines
    assert start["pool_pages"] == 8 and start["page_frames"] == 50  # the largest divisor of 250 up to 75
    assert start["host_cpu"] and start["host_cpus"] >= 1 and start["warm_lead_ms"] == 0.5  # the engine's default
    assert mix["ticks"] > 0 and mix["tick_ms_p99"] >= mix["tick_ms_p50"] > 0 and mix["sessions_max"] <= 4
    assert mix["open_shrink_events"] >= 1 and mix["pool_occupancy_max"] == 1.0
    assert 0 < mix["pool_occupancy_mean"] <= mix["pool_occupancy_max"]
    assert mix["arrivals"] >= 1 and mix["refused"] <= mix["arrivals"] and mix["failed"] == 0
    assert len(mix["late_ticks_at_s"]) == mix["late_ticks"] and mix["open_late_ticks"] >= 0
    assert (mix["refused_at_live_min"] is None) == (mix["refused"] == 0)
    assert mix["refused_at_live_min"] is None or mix["refused_at_live_min"] <= 4
    assert worst["live"] == 2 and worst["ticks"] > 0 and worst["context_frames"] == 250 and worst["failed"] == 0
    sessions = max(1, round(mix["sessions_mean"]))
    # Equal calls hold on average the mix's frames a call (its pages less half a page), or what the pool holds for
    # them at the run's end (12 ticks settling, 0.5 s measured: 6.25 frames of 80 ms, half of them by its middle).
    share = mix["pool_occupancy_mean"] * mix["pool_pages"] * mix["page_frames"] / sessions - 25
    fits = 8 // sessions * 50 - 12 - 6.25
    assert equal["bench"] == "call_mix_equal" and equal["live"] == sessions and equal["failed"] == 0
    assert equal["context_frames"] == max(0, round(min(share - 12 - 3.125, fits))) and equal["ticks"] > 0
    assert equal["context_frames_mean"] == round(equal["context_frames"] + 12 + 3.125) and equal["shrink_events"] == 0
    assert equal["mix_vs_equal_p50"] == round(mix["tick_ms_p50"] / equal["tick_ms_p50"], 4)


def test_prefill_bench_prints_chunks_and_whole_prompts() -> None:
    lines = bench_lines("bench.prefill_bench", "--chunks", "16", "--starts", "0", "--prompts", "57", "--repeats", "1")
    chunk = next(line for line in lines if line["bench"] == "prefill")
    prompt = next(line for line in lines if line["bench"] == "prompt_prefill")
    assert chunk["chunk_frames"] == 16 and chunk["wall_ms_p50"] > 0
    assert prompt["prompt_frames"] == 57 and prompt["pieces"] == [64] and prompt["wall_ms_p50"] > 0


def test_gil_contention_bench_prints_ticks_alone_and_beside_a_busy_thread() -> None:
    lines = bench_lines("bench.gil_contention", "--seconds", "0.5", "--intervals-ms", "0.5", tiny_flag=False)
    assert [(line["switch_interval_ms"], line["busy_thread"]) for line in lines] == [(0.5, False), (0.5, True)]
    assert all(line["max_gap_s"] > 0 for line in lines)


def test_sip_latency_bench_prints_the_sip_paths_added_latency() -> None:
    [line] = bench_lines("bench.sip_latency", "--seconds", "2")
    assert line["bench"] == "sip_latency" and line["clients"][0]["packets_per_s"] > 0
    assert line["added_p50_ms"] == round(line["inbound_p50_ms"] + line["outbound_p50_ms"] + line["resampler_ms"], 2)


def test_jitter_phase_bench_prints_the_added_latency_at_each_read_phase() -> None:
    lines = bench_lines("bench.jitter_phase", "--seeds", "1", "--phases-ms", "0", "50", "--seconds", "6",
                        tiny_flag=False)
    phases = [line for line in lines if line["bench"] == "jitter_phase"]
    assert [line["phase_ms"] for line in phases] == [0.0, 50.0]
    assert all(0.0 < line["added_p50_ms"] <= line["added_p95_ms"] and line["link_jitter_p95_ms"] > 0 for line in phases)
    (summary,) = [line for line in lines if line["bench"] == "jitter_phase_summary"]
    assert summary["added_p50_ms_min"] == min(line["added_p50_ms"] for line in phases)


def test_token_agreement_compares_each_candidate_and_a_wider_batch_with_the_reference() -> None:
    """On the CPU every engine computes in float32 whatever its flags, and a row's step does not read the rows beside
    it: every candidate, and the reference's own arithmetic with rows beside, agrees with the reference exactly."""
    lines = bench_lines("bench.token_agreement", "--rows", "2", "--frames", "12", "--candidates", "decoder_bf16",
                        "fused_encoder", "--wider", "3")
    assert [(line["candidate"], line["rows_stepped"]) for line in lines] == [
        ("decoder_bf16", 2), ("fused_encoder", 2), ("batch_of_5", 5)]
    assert [(line["mimi_decoder_bf16"], line["mimi_fused_encoder"]) for line in lines] == [
        (True, False), (False, True), (False, False)]  # the reference's arithmetic with only its own choice on
    for line in lines:
        assert line["frames_compared"] == 2 * 11 and line["agreement"] == 1.0 and line["rows_diverged"] == 0
        assert line["audio_rows_bit_equal"] == 2


def test_draw_step_times_torchs_path_per_batch_size() -> None:
    """Without CUDA only torch's path runs (the fused draw is a CUDA kernel): a line per batch size."""
    start, *lines = bench_lines("bench.draw_step", "--rows", "1", "3", "--calls", "2", "--steps", "2", tiny_flag=False)
    assert start["calls"] == 2 and "host_cpu" in start
    assert [(line["rows"], line["path"]) for line in lines] == [(1, "torch"), (3, "torch")]
    assert all(line["us_per_draw"] > 0 for line in lines)


def test_engine_rows_set_to_sample_draw_reproducibly_and_not_greedily() -> None:
    """`Engine.sample_rows` (bench.token_agreement --sampled): rows seeded by index draw the same tokens in two
    engines, and not the greedy rows' tokens."""
    import numpy as np

    from bench.fullsize import bench_model
    from bench.token_agreement import SpeechLike
    from model.engine import Engine, EngineConfig
    from model.sampling_params import SamplingParams

    model = bench_model(True)
    source = SpeechLike(2, 5.0, seed=1)

    def tokens(sampled: bool) -> np.ndarray:
        engine = Engine(model, EngineConfig(max_sessions=2))
        if sampled:
            engine.sample_rows(2, SamplingParams())
        return np.stack([engine.step_rows(2, source.frame(i))[0].copy() for i in range(12)])

    drawn = tokens(True)
    assert np.array_equal(drawn, tokens(True)) and not np.array_equal(drawn, tokens(False))


def test_forced_history_makes_a_candidates_next_steps_read_the_references_tokens() -> None:
    """Teacher forcing (bench.token_agreement --forced): a candidate that drew other tokens for six frames, forced to
    the reference's history after each, then greedy as the reference is, steps every later frame exactly as the
    reference does (its KV was computed from the reference's tokens); unforced, its own history keeps it apart. The
    forced steps' flips are counted in their own frames."""
    import numpy as np

    from bench.fullsize import bench_model
    from bench.token_agreement import SpeechLike, force_history
    from model.engine import Engine, EngineConfig
    from model.sampling_params import SamplingParams

    model = bench_model(True)
    source = SpeechLike(2, 5.0, seed=1)

    def later_frames(forced: bool) -> tuple[list[bool], int]:
        reference, candidate = (Engine(model, EngineConfig(max_sessions=2)) for _ in range(2))
        candidate.sample_rows(2, SamplingParams())
        equal, flips = [], 0
        for i in range(18):
            if i == 6:
                candidate.sample_rows(2, SamplingParams(greedy=True))
            expected = reference.step_rows(2, source.frame(i))[0].copy()
            tokens = candidate.step_rows(2, source.frame(i))[0]
            if i >= 6:
                equal.append(bool(np.array_equal(expected, tokens)))
            if forced:
                same = force_history(reference, candidate, 2)
                flips += int((~same).sum()) if i < 6 else 0
                assert np.array_equal(candidate.lm_state.ring[:2], reference.lm_state.ring[:2])
        return equal, flips

    forced, flips = later_frames(True)
    assert all(forced) and flips > 0
    unforced, _ = later_frames(False)
    assert not all(unforced)


def test_mimi_step_saves_outputs_and_compares_them_bit_for_bit(tmp_path: Path) -> None:
    """What one tree's codec computed, saved; the same tree agrees with it exactly, and one moved sample shows. A row
    hears the same at every batch size, and its codes and audio there are the same but for rounding."""
    saved, moved = tmp_path / "saved.pt", tmp_path / "moved.pt"
    first = bench_lines("bench.mimi_step", "--rows", "1", "3", "--frames", "2", "--save", str(saved))
    steps, (across,) = first[:2], first[2:]
    assert [line["rows"] for line in steps] == [1, 3] and all("bit_equal" not in line for line in steps)
    assert (across["bench"], across["codec"], across["rows"], across["against_rows"]) == ("mimi_across_batches",
                                                                                          "torch", 1, 3)
    assert across["codes_equal"] == 1.0 and (across["audio_snr_db"] is None or across["audio_snr_db"] > 80)
    same = bench_lines("bench.mimi_step", "--rows", "1", "3", "--frames", "2", "--compare", str(saved))[:2]
    assert all(line["bit_equal"] and line["codes_equal"] == 1.0 for line in same)
    outputs = torch.load(saved)
    outputs[3]["audio"][1, 2, 100] += 1e-3
    torch.save(outputs, moved)
    lines = bench_lines("bench.mimi_step", "--rows", "1", "3", "--frames", "2", "--compare", str(moved))[:2]
    assert [line["bit_equal"] for line in lines] == [True, False]
    assert lines[1]["codes_equal"] == 1.0 and 0 < lines[1]["audio_max_abs_diff"] < 2e-3
    assert lines[0]["audio_snr_db"] is None and lines[1]["audio_snr_db"] > 40


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal under test is the no-GPU one")
def test_engine_bench_without_a_gpu_says_so_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.engine_bench"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and done.stderr.strip().splitlines() == [
        "engine_bench: the full 7B shape needs a CUDA GPU and none is visible; --tiny runs the tiny checkpoint on the "
        "CPU"], done.stderr
