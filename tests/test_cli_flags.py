"""What a new user meets first: `python -m app` with a wrong flag answers in one line and a non-zero exit, before
anything starts; every flag says what it does."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest
import torch
from process_support import ROOT, cli_env, tiny_cache

from app.shell.settings import Settings, build_parser, parse_settings

NO_GPU = not torch.cuda.is_available()


def refused(*args: str) -> str:
    """`python -m app ARGS`, which must end at once with a non-zero status and one line on stderr: that line."""
    done = subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and not done.stdout, (done.returncode, done.stdout, done.stderr)
    return lines[0]


@pytest.mark.parametrize("name", ["does/not-exist", "nvidia/personaplex-7b-v2", "no such thing"])
def test_a_model_name_that_is_nothing_known_is_one_line(name):
    with pytest.raises(SystemExit, match="not a folder, not a known Hugging Face repo"):
        parse_settings(["--model", name], {})


def test_model_names_that_are_known_pass(tmp_path):
    for name in ("tiny", "random-7b", "nvidia/personaplex-7b-v1", str(tmp_path)):
        assert parse_settings(["--model", name], {}).model == name
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="not a folder"):
        parse_settings(["--model", str(tmp_path / "file")], {})


def test_an_unknown_model_is_refused_by_the_cli():
    assert "not a known Hugging Face repo" in refused("--model", "does/not-exist")


@pytest.mark.skipif(not NO_GPU, reason="the refusal under test is the no-GPU one")
def test_strict_model_without_a_gpu_is_refused_before_anything_starts():
    assert refused("--strict-model") == "--strict-model: no GPU for nvidia/personaplex-7b-v1 (device cpu)"
    assert "no GPU" in refused("--strict-model", "--workers", "2", "--model", "random-7b")


@pytest.mark.parametrize("workers", ["0", "1"])
def test_strict_model_ends_the_server_when_the_load_fails(tmp_path, workers):
    """A folder that is no checkpoint: one process or an engine process, the server ends with the reason instead of
    serving the tiny model (or restarting the engine process in a loop)."""
    done = subprocess.run([sys.executable, "-m", "app", "--model", str(tmp_path), "--strict-model", "--port", "0",
                           "--workers", workers, "--cache-dir", str(tmp_path / "cache")],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr
    assert f"--strict-model: {tmp_path} did not load" in done.stderr
    assert "Traceback" not in done.stderr and "starting it again" not in done.stderr and "TINY" not in done.stderr


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_kv_cache_that_holds_no_context_ends_the_server_in_one_line(tiny_checkpoint, tmp_path, workers):
    """`--kv-cache-gib` below one session's full context (the tiny model's: 0.000238 GiB): the server ends saying
    how much it holds and needs, one process or an engine process, instead of a traceback or a restart loop."""
    done = subprocess.run([sys.executable, "-m", "app", "--model", "tiny", "--port", "0", "--workers", workers,
                           "--kv-cache-gib", "0.0002", "--cache-dir", str(tiny_cache(tiny_checkpoint, tmp_path))],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    named = [line for line in done.stderr.splitlines()
             if "0.0002 GiB holds no full context window (0.000238 GiB)" in line and "--kv-cache-gib" in line]
    assert done.returncode == 1 and named, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "starting it again" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(("flag", "workers"), [("--port", "0"), ("--port", "2"), ("--sip-port", "0"),
                                             ("--sip-port", "2"), ("--agent-port", "2"), ("--audiosocket-port", "0")])
def test_a_port_another_process_holds_ends_the_server_in_one_line_naming_it(tiny_checkpoint, tmp_path, flag,
                                                                            workers):
    """A second server on the same port (the most common mistake): one process or several, the server ends with
    the port named, instead of a traceback, a worker started again and again, or (the agent-check port, bound after
    the processes had started) a supervisor that never exits."""
    kind = socket.SOCK_DGRAM if flag == "--sip-port" else socket.SOCK_STREAM  # the SIP door's UDP side first
    with socket.socket(socket.AF_INET, kind) as held:
        held.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            held.listen()
        port = str(held.getsockname()[1])
        args = {"--port": "0", flag: port}
        done = subprocess.run([sys.executable, "-m", "app", "--model", "tiny", "--host", "127.0.0.1", "--workers",
                               workers, "--cache-dir", str(tiny_cache(tiny_checkpoint, tmp_path / "cache")),
                               *(x for pair in args.items() for x in pair)],
                              cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    named = [line for line in done.stderr.splitlines() if port in line and "in use" in line.lower()]
    assert done.returncode > 0 and named, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "starting it again" not in done.stderr, done.stderr[-3000:]
    assert "leaked" not in done.stderr, done.stderr[-3000:]  # what the failed start had started, stopped


@pytest.mark.parametrize(("flag", "value"), [
    ("--port", "99999"), ("--port", "-5"), ("--max-sessions", "0"), ("--max-sessions", "-1"), ("--workers", "-2"),
    ("--agent-port", "70000"), ("--sip-port", "-1"), ("--audiosocket-port", "65536"), ("--queue-timeout-s", "-1"),
    ("--idle-timeout-s", "0"), ("--first-message-timeout-s", "nan"), ("--max-events-per-s", "inf"),
    ("--max-message-bytes", "0"), ("--max-output-bytes", "-3"), ("--max-connections-per-ip", "-1"),
    ("--ice-connect-timeout-s", "0"), ("--max-realtime-backlog-s", "0"), ("--max-input-backlog-s", "-1"),
    ("--max-output-backlog-s", "0"), ("--shutdown-timeout-s", "-1"), ("--engine-stalled-s", "0"),
    ("--input-lead-ms", "-1"), ("--drain-timeout-s", "-1"), ("--webhook-retry-s", "0"),
    ("--webhook-backoff-max-s", "-1"), ("--engine-warm-lead-ms", "-0.5"), ("--kv-cache-gib", "-1"),
])
def test_every_numeric_flag_out_of_range_is_one_line(flag, value):
    env_name = "PERSONAPLEX_" + flag[2:].replace("-", "_").upper()
    for argv, env in (([flag, value], {}), ([], {env_name: value})):
        with pytest.raises(SystemExit, match=f"^{flag} / {env_name} must be ") as refusal:
            parse_settings(argv, env)
        assert value in str(refusal.value) and "\n" not in str(refusal.value)


def test_numeric_flags_at_their_bounds_pass():
    s = parse_settings(["--port", "0", "--max-sessions", "1", "--workers", "0", "--queue-timeout-s", "0",
                        "--sip-port", "65535", "--max-connections-per-ip", "0"], {})
    assert (s.port, s.max_sessions, s.workers, s.sip_port) == (0, 1, 0, 65535)


def test_a_value_of_the_wrong_kind_is_one_line():
    with pytest.raises(SystemExit, match=r"^--port / PERSONAPLEX_PORT takes an integer, got 'eighty'$"):
        parse_settings([], {"PERSONAPLEX_PORT": "eighty"})
    with pytest.raises(SystemExit, match="--rtp-ports '5000-4000': need 1024 <= FIRST < LAST"):
        parse_settings(["--rtp-ports", "5000-4000"], {})


def test_bad_flags_are_refused_by_the_cli_in_one_line():
    assert refused("--port", "99999") == "--port / PERSONAPLEX_PORT must be from 0 to 65535, got 99999"
    assert refused("--port", "-5") == "--port / PERSONAPLEX_PORT must be from 0 to 65535, got -5"
    assert refused("--max-sessions", "0") == "--max-sessions / PERSONAPLEX_MAX_SESSIONS must be >= 1, got 0"
    assert refused("--port", "eighty").startswith("personaplex-server: argument --port: invalid int value")
    assert refused("--no-such-flag").startswith("personaplex-server: unrecognized arguments: --no-such-flag")


def test_every_flag_says_what_it_does():
    parser = build_parser()
    silent = [a.option_strings[0] for a in parser._actions if not a.help or a.help == argparse.SUPPRESS]
    assert silent == []
    assert "WebRTC" in parser.description and "SIP" in parser.description
    cache_dir = next(a for a in parser._actions if "--cache-dir" in a.option_strings)
    assert f"(default {Settings().cache_dir})" in cache_dir.help
