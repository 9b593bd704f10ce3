"""The batched lockstep frame engine (core.py says how it works; DESIGN.md "Processes and scale" why a package).

api.py holds what users exchange with the engine and imports no torch, nor does slots.py (Slot, the session
handle), so a process without the model may import `model.engine` for them; Engine itself (core.py, with torch)
loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model.engine.api import (
    EngineConfig,
    EngineError,
    EngineStats,
    FrameOutput,
    FrameSource,
    InvalidSessionParams,
    KVCacheTooSmall,
    OutputRows,
    ResourceExhausted,
    SamplingParams,
    SessionFailed,
    SessionParams,
    SlotStats,
    TickRecord,
)
from model.engine.slots import Slot

if TYPE_CHECKING:
    from model.engine.core import Engine

__all__ = [
    "Engine", "EngineConfig", "Slot", "SessionParams", "SamplingParams", "FrameOutput", "OutputRows", "FrameSource",
    "EngineError", "ResourceExhausted", "InvalidSessionParams", "SessionFailed", "KVCacheTooSmall", "EngineStats",
    "SlotStats", "TickRecord",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from model.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'model.engine' has no attribute {name!r}")
