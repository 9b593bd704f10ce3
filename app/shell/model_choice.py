"""Which model the server serves, and on what: the `--model` name's check at parse time, the device `auto` stands
for, and why a name is served by the built-in tiny model instead (or, with `--strict-model`, refused).

Light on purpose: `python -m app` checks a name before anything starts, and torch is imported only to resolve a device.
"""

from __future__ import annotations

from pathlib import Path

from model.config import DEFAULT_REPO, MOSHI_NAME

TINY_MODEL = "tiny"
RANDOM_MODEL = "random-7b"
KNOWN_REPOS = (DEFAULT_REPO,)


class ModelUnavailable(Exception):
    """`--strict-model`: the model asked for cannot be served here; the message says why, in one line."""


def check_model_name(name: str) -> None:
    """A folder, a known Hugging Face repo id (the official one, or one already in the local Hugging Face cache),
    `tiny` or `random-7b`; anything else ends the start in one line (SystemExit)."""
    if name in (TINY_MODEL, RANDOM_MODEL, *KNOWN_REPOS):
        return
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise SystemExit(f"--model {name}: not a folder")
    if _in_hub_cache(name):
        return
    raise SystemExit(f"--model {name!r}: not a folder, not a known Hugging Face repo ({', '.join(KNOWN_REPOS)} or one "
                     f"already in the local Hugging Face cache), nor {TINY_MODEL!r} or {RANDOM_MODEL!r}")


def _in_hub_cache(name: str) -> bool:
    """The repo's weights are in the local Hugging Face cache (`huggingface-cli download REPO` puts them there)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(name, MOSHI_NAME), str)
    except HFValidationError:   # not even shaped like a repo id
        return False


def resolve_device(device: str, dtype: str = "auto") -> tuple[str, str]:
    """`auto` as the device used: cuda when torch sees one, else cpu; and the dtype: bfloat16 on cuda, else float32."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def fallback_reason(model: str, device: str) -> str:
    """Why `model` on `device` is served by the tiny model without trying a load ("" when a load is tried)."""
    if model == TINY_MODEL:
        return "the tiny model was asked for"
    if not Path(model).expanduser().is_dir() and not device.startswith("cuda"):
        return f"no GPU for {model} (device {device})"
    return ""


def check_strict(model: str, devices: list[str]) -> None:
    """`--strict-model` before anything starts: a model that needs a GPU and has none ends the start in one line."""
    for device in devices:
        reason = fallback_reason(model, resolve_device(device)[0])
        if reason and model != TINY_MODEL:
            raise SystemExit(f"--strict-model: {reason}")
