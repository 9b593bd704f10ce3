"""What a new user meets first: `python -m app` with a wrong flag answers in one line and a non-zero exit, before
anything starts; every flag says what it does."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from process_support import ROOT, cli_env

from app.settings import parse_settings

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
