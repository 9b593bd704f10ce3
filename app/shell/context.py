"""What every route handler shares: settings, the model's description, the engine, metrics, and the open sockets.

Stored on the aiohttp application under `CONTEXT`. In one process the engine is a `model.engine.Engine` and the model
is loaded at startup; in a worker process the engine is an `EnginePool` (the engine processes' slots, over their
channel) and the model's description comes from the engine process.
Voice names are resolved here, so clients can only name bundled voices or files in the server's voices folder,
never arbitrary paths.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from app.sessions.errors import ProtocolError
from app.shell.auth import AddressLimit
from app.shell.metrics import Metrics
from app.shell.settings import Settings

if TYPE_CHECKING:
    from app.calls.live import CallRegistry
    from model.engine import Engine
    from model.engine.channel import ModelInfo
    from model.engine.pool import EnginePool
    from model.loading import PersonaPlex

VOICE_SUFFIXES = (".pt", ".wav")


class ClosableSocket(Protocol):
    async def shutdown(self) -> None: ...   # tell the client (session.closed), close with 1001


@dataclass
class ServerContext:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    model: PersonaPlex | None = None          # in one process only: the loaded model
    engine: Engine | EnginePool | None = None
    model_note: str = ""                      # why this model was loaded (the tiny fallback says why)
    sockets: set[ClosableSocket] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    addresses: AddressLimit = field(default_factory=AddressLimit)   # open connections per client address
    shutting_down: bool = False
    draining: bool = False                    # SIGTERM: live sessions go on, new ones are refused
    calls: CallRegistry = field(init=False)   # the live calls, their recordings and webhooks (app/calls/live.py)
    _info: ModelInfo | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.running and not self.shutting_down and not self.draining

    @property
    def model_info(self) -> ModelInfo | None:
        """The model's description: the loaded model's (one process) or the engine process's (a worker)."""
        if self.model is not None:
            if self._info is None:
                self._info = self.model.info()
            return self._info
        return getattr(self.engine, "model", None)

    @property
    def model_id(self) -> str:
        info = self.model_info
        if info is None:
            return self.settings.model
        if info.is_tiny:
            return "personaplex-tiny"
        if info.random_weights:
            return "personaplex-7b-random-weights"
        return Path(info.source).name or info.source

    def _extra_voices(self) -> dict[str, Path]:
        folder = self.settings.voices_dir
        if folder is None or not folder.is_dir():
            return {}
        return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in VOICE_SUFFIXES and p.is_file()}

    def voice_names(self) -> list[str]:
        info = self.model_info
        bundled = info.voices if info is not None else []
        return sorted(set(bundled) | set(self._extra_voices()))

    @property
    def default_voice(self) -> str | None:
        info = self.model_info
        return info.default_voice if info is not None else None

    def resolve_voice(self, name: object, *, param: str = "voice") -> str | None:
        """A client's voice name -> what SessionParams.voice takes (a bundled name or a voices-folder path).
        None and "" mean the default voice."""
        if name is None or name == "":
            return self.default_voice
        if not isinstance(name, str):
            raise ProtocolError("invalid_voice", "`voice` must be a string", param=param)
        stem = name
        for suffix in VOICE_SUFFIXES:
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
        if "/" in stem or "\\" in stem or stem.startswith("."):
            raise ProtocolError("invalid_voice", f"voice {name!r}: name a voice, not a path", param=param)
        info = self.model_info
        if info is not None and stem in info.voices:
            return stem
        extra = self._extra_voices()
        if stem in extra:
            return str(extra[stem])
        known = ", ".join(self.voice_names()) or "none"
        raise ProtocolError("invalid_voice", f"unknown voice {name!r}; available: {known}", param=param)


CONTEXT = web.AppKey("personaplex_context", ServerContext)
