"""How the engine's Triton kernels launch: as programmatic dependents of the kernel before them (PDL, sm_90 on).

A tick of one session is ~1,900 kernels of a few microseconds each (docs/benchmarks.md), so the gaps between them
(a launch's scheduling, its programs' ramp-up) are a large part of it. A kernel launched as a programmatic dependent
has its programs start while the kernel before it still runs; they wait for it (`griddepcontrol.wait`) before they
touch memory a kernel writes: the same arithmetic in the same order, so the same tokens. Inductor does the same for the
compiled helpers (model/fused.py) with a setting of its own, which `enable` sets too. Off unless
`EngineConfig.pdl_launches`.

A kernel takes part with a `PDL: tl.constexpr` argument, `allow_next(PDL)` and `wait_for_previous(PDL)` before its
first access to memory another kernel writes, and `**arguments(device)` at its launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from model import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
try:  # grid dependency control: Triton 3.3 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

_enabled = False


def enable(on: bool) -> None:
    """Launch the engine's kernels as programmatic dependents from now on (or not), Inductor's among them: its
    helpers compile again, and CUDA graphs captured before keep the kernels they hold."""
    global _enabled
    if on == _enabled:
        return
    _enabled = on
    import torch._inductor.config as inductor

    if hasattr(inductor.triton, "enable_pdl"):  # torch 2.9 on
        inductor.triton.enable_pdl = on
        fused.recompile()


@functools.cache  # asked at every launch; the device's capability is a query
def supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents (CUDA sm_90 on, Triton's grid dependency
    control)."""
    return (gdc_wait is not None and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (9, 0))


class DeviceInts:
    """Host integers a kernel reads from the device (tables' or buffers' addresses and layouts) as an int64 array:
    uploaded on first use, which comes before the engine captures a graph that holds the array, and again only when
    the integers change (a buffer moved, another view asked for)."""

    def __init__(self) -> None:
        self._values: tuple = ()
        self._array: torch.Tensor | None = None

    def array(self, values: tuple, device: torch.device, check: Callable[[], None] | None = None) -> torch.Tensor:
        """The array of `values` (a tuple of ints, or of equal tuples of ints: its rows); `check` runs before an
        upload and raises for what the kernel cannot read."""
        if values != self._values or self._array is None:
            if check is not None:
                check()
            self._array = torch.tensor(values, dtype=torch.int64, device=device)
            self._values = values
        return self._array


def arguments(device: torch.device) -> dict[str, bool]:
    """A kernel's launch arguments for it on `device` now: its `PDL` constexpr, and Triton's launch attribute only
    where it is a dependent (`enable`d and `supported`): a plain launch passes what it did before PDL existed."""
    return {"PDL": True, "launch_pdl": True} if _enabled and supported(device) else {"PDL": False}


if triton is not None:

    @triton.jit
    def allow_next(PDL: tl.constexpr):
        """Let the next kernel's programs start (they wait for this one before touching memory)."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Wait until the kernel before has finished and its writes are visible."""
        if PDL:
            gdc_wait()
