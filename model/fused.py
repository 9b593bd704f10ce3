"""Optional kernel fusion: elementwise-heavy helpers run through `torch.compile` on the GPU.

A tick is hundreds of small kernels (norms, rotary embeddings, the sampling hash, softmax merges); Inductor fuses
each helper's chain into one or two kernels, which the engine's CUDA graphs then replay. Helpers are plain eager
functions until `enable()` is called (the engine does so on CUDA), so CPU runs and tests are unaffected.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)
log = logging.getLogger(__name__)

# What Dynamo raises, with fullgraph=True, for a helper it cannot compile as one graph or has recompiled too often
# (a Python int that varies is specialised per value): the helper then runs eagerly, slower but running. Set by
# `enable()`: importing Dynamo takes 1.5 s, which a process that never compiles (the CPU engine, the tests'
# subprocesses) need not pay.
_COMPILE_FAILURES: tuple[type[Exception], ...] = ()

_EAGER: list[Callable] = []
_COMPILED: dict[Callable, Callable] = {}

# Graphs one helper may hold. Dynamo compiles a helper once per shape class it meets (rank, a dimension of 1, a view's
# storage offset of 0, 1 or more, a dtype, a parameter's requires_grad), and the engine meets many: the tiny model's
# CPU warm-up with 1-8 rows and prompts gave apply_rope 8 graphs and add_rms_norm 7, Dynamo's default limit being 8.
# Past it a helper runs eagerly for the rest of the process, and every CUDA graph captured after that holds its
# unfused chain. The H200 engine stayed under it (bench.engine_bench: no helper fell back, tick parts unchanged with
# 64), but bench.roofline's profile at 250 rows, after its Mimi variants in three precisions, showed add_rms_norm as
# a separate add, norm and copies. Each graph is a few small kernels: a generous limit costs only compile time.
RECOMPILE_LIMIT = 64


def fusable(fn: F) -> F:
    """Mark a tensor-in, tensor-out helper (no Python-side effects) as worth compiling."""
    _EAGER.append(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        compiled = _COMPILED.get(fn)
        if compiled is None:
            return fn(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except _COMPILE_FAILURES as exc:  # raised while tracing, before any kernel ran
            log.warning("%s cannot be compiled (%s): it runs eagerly from now on", fn.__qualname__,
                        str(exc).splitlines()[0])
            _COMPILED.pop(fn, None)
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def available() -> bool:
    """Inductor's GPU code needs Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def enable() -> None:
    """Compile every fusable helper (dynamic batch); compilation happens on first use, e.g. in graph warm-up.
    Dynamo's recompile limit is process-wide: it is raised to RECOMPILE_LIMIT, never lowered."""
    global _COMPILE_FAILURES
    import torch._dynamo.exc

    _COMPILE_FAILURES = (torch._dynamo.exc.FailOnRecompileLimitHit, torch._dynamo.exc.Unsupported)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for fn in _EAGER:
        if fn not in _COMPILED:
            _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True)


def recompile() -> None:
    """Compile the enabled helpers again, under Inductor's settings of now (model/launch.py). CUDA graphs captured
    before keep the kernels they hold: Dynamo's reset drops its caches, not Inductor's loaded modules, which own the
    kernels (Triton unloads a kernel's module when its object goes)."""
    if not _COMPILED:
        return
    import torch._dynamo

    torch._dynamo.reset()
    _COMPILED.clear()
    enable()


def disable() -> None:
    """Back to the eager helpers (the compiled ones are process-wide: an engine's start enables them for all)."""
    _COMPILED.clear()


def enabled() -> bool:
    return bool(_COMPILED)


def fallen_back() -> list[str]:
    """The helpers that were compiled and now run eagerly (each logged a warning when it fell back)."""
    return sorted(fn.__qualname__ for fn in _EAGER if _COMPILED and fn not in _COMPILED)
