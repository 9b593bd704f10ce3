"""Loading the model to serve, with the tiny fallback, and building its engine: for the one-process server and the
engine processes. Kept apart from app/shell/server.py so that a worker process, which only talks to an engine
process, never imports torch (its start took ~4 s more on a 2-core machine, and the memory of torch's runtime)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from app.shell.model_choice import RANDOM_MODEL, TINY_MODEL, ModelUnavailable, fallback_reason, resolve_device
from app.shell.settings import Settings
from model.engine import Engine, EngineConfig, KVCacheTooSmall
from model.loading import PersonaPlex, load_model
from model.random_model import random_personaplex
from model.tiny import write_tiny_checkpoint

logger = logging.getLogger(__name__)

_BANNER = "=" * 78


def tiny_folder(settings: Settings) -> Path:
    """The built-in tiny checkpoint, written once into the cache folder."""
    folder = settings.cache_dir / "tiny-checkpoint"
    if not (folder / "config.json").is_file():
        logger.info("writing the built-in tiny checkpoint to %s", folder)
        write_tiny_checkpoint(folder)
    return folder


def load_for(settings: Settings) -> tuple[PersonaPlex, str]:
    """The model to serve and a note on why. A repo id without a GPU, or any load failure, falls back to the built-in
    tiny model, and the log says so loudly; with `strict_model` it raises `ModelUnavailable` instead. `random-7b`
    (the official shape with random weights, for sizing hardware) is loaded only when asked for by name, and says so
    everywhere."""
    device, dtype = resolve_device(settings.device, settings.dtype)
    source = settings.model
    local = Path(source).expanduser().is_dir()
    reason = fallback_reason(source, device)
    if reason and settings.strict_model and source != TINY_MODEL:
        raise ModelUnavailable(f"--strict-model: {reason}")
    if not reason:
        try:
            if source == RANDOM_MODEL:
                note = (f"serving {RANDOM_MODEL}: PersonaPlex-7B's shape with RANDOM WEIGHTS on {device} ({dtype}), "
                        "for sizing hardware; sessions run at the real model's speed but say nothing")
                logger.warning("\n%s\n%s\n%s", _BANNER, note.upper(), _BANNER)
                return random_personaplex(device=device, dtype=dtype), note
            return load_model(source, device=device, dtype=dtype), f"loaded {source} on {device} ({dtype})"
        except Exception as e:
            hint = "" if local or os.environ.get("HF_TOKEN") or source == RANDOM_MODEL else " (HF_TOKEN is not set)"
            reason = f"{source} did not load{hint}: {type(e).__name__}: {e}"
            if settings.strict_model:
                raise ModelUnavailable(f"--strict-model: {reason}") from e
    folder = tiny_folder(settings)
    model = load_model(str(folder), device=device, dtype="float32")
    note = f"serving the built-in TINY test model (random weights, not PersonaPlex-7B): {reason}"
    if source != TINY_MODEL:
        logger.warning("\n%s\n%s\n%s", _BANNER, note.upper(), _BANNER)
    return model, note


def build_engine(settings: Settings, model: PersonaPlex) -> Engine:
    """The engine for `model` as the settings ask (not started)."""
    fp8 = settings.kv_cache == "fp8"
    if fp8 and model.device.type != "cuda":
        logger.warning("--kv-cache fp8 needs a GPU; keeping the KV cache in %s", model.dtype)
    config = EngineConfig(max_sessions=settings.max_sessions, fp8_kv=fp8 and model.device.type == "cuda",
                          kv_cache_gib=settings.kv_cache_gib or None, stalled_after_s=settings.engine_stalled_s,
                          warm_lead_ms=settings.engine_warm_lead_ms, mimi_decoder_bf16=settings.mimi_decoder == "bf16",
                          mimi_fused_decoder=settings.mimi_decoder == "bf16")
    try:
        return Engine(model, config)
    except KVCacheTooSmall as e:
        raise KVCacheTooSmall(f"{e}: --kv-cache-gib sets the KV cache's size") from None
