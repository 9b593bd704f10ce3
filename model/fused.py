"""Optional kernel fusion: elementwise-heavy helpers run through `torch.compile` on the GPU.

A tick is hundreds of small kernels (norms, rotary embeddings, the sampling hash, softmax merges); Inductor fuses
each helper's chain into one or two kernels, which the engine's CUDA graphs then replay. Helpers are plain eager
functions until `enable()` is called (the engine does so on CUDA), so CPU runs and tests are unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_EAGER: list[Callable] = []
_COMPILED: dict[Callable, Callable] = {}


def fusable(fn: F) -> F:
    """Mark a tensor-in, tensor-out helper (no Python-side effects) as worth compiling."""
    _EAGER.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _COMPILED.get(fn, fn)(*args, **kwargs)

    return call  # type: ignore[return-value]


def available() -> bool:
    """Inductor's GPU code needs Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enable() -> None:
    """Compile every fusable helper (dynamic batch); compilation happens on first use, e.g. in graph warm-up."""
    for fn in _EAGER:
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)


def disable() -> None:
    """Back to the eager helpers (the compiled ones are process-wide: an engine's start enables them for all)."""
    _COMPILED.clear()


def enabled() -> bool:
    return bool(_COMPILED)
