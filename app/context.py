"""What every route handler shares: settings, the loaded model, the engine, metrics, and the open sockets.

Stored on the aiohttp application under `CONTEXT`; the engine and model are set once startup has loaded them.
Voice names are resolved here, so clients can only name bundled voices or files in the server's voices folder,
never arbitrary paths.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from app.auth import AddressLimit
from app.errors import ProtocolError
from app.metrics import Metrics
from app.settings import Settings

if TYPE_CHECKING:
    from model.engine import Engine
    from model.loading import PersonaPlex

VOICE_SUFFIXES = (".pt", ".wav")


class ClosableSocket(Protocol):
    async def shutdown(self) -> None: ...   # tell the client (session.closed), close with 1001


@dataclass
class ServerContext:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    model: PersonaPlex | None = None
    engine: Engine | None = None
    model_note: str = ""                      # why this model was loaded (the tiny fallback says why)
    sockets: set[ClosableSocket] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    addresses: AddressLimit = field(default_factory=AddressLimit)   # open connections per client address
    shutting_down: bool = False

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.running and not self.shutting_down

    @property
    def model_id(self) -> str:
        if self.model is None:
            return self.settings.model
        return "personaplex-tiny" if self.model.is_tiny else Path(self.model.source).name or self.model.source

    def _extra_voices(self) -> dict[str, Path]:
        folder = self.settings.voices_dir
        if folder is None or not folder.is_dir():
            return {}
        return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in VOICE_SUFFIXES and p.is_file()}

    def voice_names(self) -> list[str]:
        bundled = self.model.voices() if self.model is not None else []
        return sorted(set(bundled) | set(self._extra_voices()))

    @property
    def default_voice(self) -> str | None:
        return self.model.default_voice if self.model is not None else None

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
        if self.model is not None and stem in self.model.voices():
            return stem
        extra = self._extra_voices()
        if stem in extra:
            return str(extra[stem])
        known = ", ".join(self.voice_names()) or "none"
        raise ProtocolError("invalid_voice", f"unknown voice {name!r}; available: {known}", param=param)


CONTEXT = web.AppKey("personaplex_context", ServerContext)
