"""`python -m app` as a process: flags over environment variables, the loud fallback to the tiny model without a GPU,
and a clean exit on SIGTERM; and `bench/realtime_check.py` passing against a server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from process_support import ROOT, cli_env, free_port

from app.shell.model_load import build_engine
from app.shell.settings import DEFAULT_MODEL, parse_settings
from model.audio import write_wav
from model.loading import load_model


def test_flags_win_over_environment():
    env = {"PERSONAPLEX_PORT": "1111", "PERSONAPLEX_MAX_SESSIONS": "3", "PERSONAPLEX_API_KEYS": "a, b",
           "PERSONAPLEX_ALLOWED_ORIGINS": "https://x.example", "PERSONAPLEX_VOICES_DIR": "~/voices",
           "PERSONAPLEX_STRICT_MODEL": "true", "PERSONAPLEX_LOG_LEVEL": "DEBUG"}
    s = parse_settings(["--port", "9", "--api-key", "c", "--dtype", "bfloat16"], env)
    assert (s.port, s.max_sessions, s.api_keys, s.dtype) == (9, 3, ("c",), "bfloat16")
    assert s.allowed_origins == ("https://x.example",) and s.voices_dir == Path.home() / "voices"
    assert s.strict_model is True and s.log_level == "DEBUG" and s.model == DEFAULT_MODEL
    assert parse_settings([], {"PERSONAPLEX_API_KEYS": "a, b"}).api_keys == ("a", "b")


def test_kv_cache_choice_is_checked_for_flags_and_environment():
    assert parse_settings(["--kv-cache", "fp8"], {}).kv_cache == "fp8"
    assert parse_settings([], {"PERSONAPLEX_KV_CACHE": "fp8"}).kv_cache == "fp8"
    with pytest.raises(SystemExit, match="PERSONAPLEX_KV_CACHE must be one of bf16, fp8"):
        parse_settings([], {"PERSONAPLEX_KV_CACHE": "fp9"})


def test_mimi_decoder_precision_is_a_choice_and_reaches_the_engine(tiny_checkpoint):
    tiny_model = load_model(str(tiny_checkpoint))
    assert parse_settings([], {}).mimi_decoder == "bf16"
    settings = parse_settings(["--mimi-decoder", "float32"], {})
    exact = build_engine(settings, tiny_model).config
    assert (exact.mimi_decoder_bf16, exact.mimi_fused_decoder) == (False, False)  # the reference's torch path
    default = build_engine(parse_settings([], {}), tiny_model).config
    assert (default.mimi_decoder_bf16, default.mimi_fused_decoder) == (True, True)
    with pytest.raises(SystemExit, match="PERSONAPLEX_MIMI_DECODER must be one of bf16, float32"):
        parse_settings([], {"PERSONAPLEX_MIMI_DECODER": "fp16"})


def test_the_engines_warm_up_lead_is_a_setting_and_reaches_the_engine(tiny_checkpoint):
    """--engine-warm-lead-ms (EngineConfig.warm_lead_ms): on by default, 0 turns the warm-up off, the environment
    sets it too."""
    tiny_model = load_model(str(tiny_checkpoint))
    assert build_engine(parse_settings([], {}), tiny_model).config.warm_lead_ms == 0.5
    assert build_engine(parse_settings(["--engine-warm-lead-ms", "0"], {}), tiny_model).config.warm_lead_ms == 0.0
    from_env = parse_settings([], {"PERSONAPLEX_ENGINE_WARM_LEAD_MS": "1.5"})
    assert build_engine(from_env, tiny_model).config.warm_lead_ms == 1.5


async def test_no_gpu_falls_back_to_tiny_loudly_and_exits_on_sigterm(tiny_checkpoint, tmp_path):
    if torch.cuda.is_available():
        return  # the fallback under test is the no-GPU one
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-checkpoint").symlink_to(tiny_checkpoint, target_is_directory=True)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app", "--port", str(port), "--cache-dir", str(cache), "--max-sessions", "1",
        cwd=ROOT, env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        health = None
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        health = await r.json()
                        if health.get("ready"):
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        assert health is not None and health["ready"] and health["tiny"], health
        assert "no GPU" in health["note"] and health["sessions"]["max"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, out.decode()
    assert "SERVING THE BUILT-IN TINY TEST MODEL" in out.decode()


async def _bench(*args: str) -> dict:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.realtime_check", *args, cwd=ROOT, env=cli_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert out, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    report["returncode"] = proc.returncode
    return report


async def test_realtime_check_passes_against_tiny_server(start_server, speech_24k, tmp_path):
    server = await start_server(max_sessions=2)
    wav = tmp_path / "speech.wav"
    write_wav(wav, speech_24k, 24000)
    report = await _bench("--url", server.ws(""), "--wav", str(wav), "--seconds", "2")
    assert report["pass"] and report["returncode"] == 0, report
    assert all(report["checks"].values())
    assert set(report["sessions"]) == {"primary", "secondary", "replacement"}
    for s in report["sessions"].values():
        assert s["ok"] and s["missing_frames"] <= 4 and s["response_ids"] == 1 and s["errors"] == 0


async def test_realtime_check_load_mode(start_server):
    """Load mode opens past the server's limit and counts each session's frames. The frames must all come,
    whenever: a CPU engine that a loaded machine slows below real time left 7 and 11 of 25 frames still to come
    0.5 s after the last append, and 7 after 4 s, so the drain begins once the output covers the input."""
    server = await start_server(max_sessions=2)
    report = await _bench("--url", server.ws(""), "--sessions", "3", "--seconds", "2", "--timeout-s", "60",
                          "--drain-s", "0.5")
    assert report["returncode"] == 0
    assert report["sessions_admitted"] == 2 and report["refused"][0]["code"] == "resource_exhausted"
    for s in report["per_session"]:
        assert s["errors"] == 0 and s["response_ids"] == 1 and s["frames_in"] == 25
        assert s["missing_frames"] <= 4 and s["rtf"] is not None


def test_every_error_code_is_documented():
    from app.sessions.errors import CODES
    doc = (ROOT / "docs" / "protocol.md").read_text()
    table = doc[doc.index("## 4. Error codes"):]
    for code in CODES.values():
        assert f"| `{code.code}` | `{code.type}` |" in table, code.code
