"""The prompt cache (a voice + persona prompt's effect on a fresh row, so the next session with the same prompt
copies it instead of prefilling) and the voice cache (loaded voice prompts). Bounded, oldest out first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from model.prompts import persona_text

if TYPE_CHECKING:
    from torch import Tensor

    from model.prompts import VoicePrompt

K = TypeVar("K")
V = TypeVar("V")

VOICE_ENTRIES = 64


@dataclass
class CachedPrompt:
    """A prompt's effect on a fresh row: the KV slots it filled, its positions, ring and counter."""

    kv: list[Tensor]  # each KV tensor's [layers, heads, slots(, head_dim)] for the slots the prompt filled
    kpos: Tensor  # [slots]
    pos: int
    ring: Tensor
    offset: int
    forced: Tensor


class BoundedCache(Generic[K, V]):
    """A map that drops its oldest entries past `capacity`; `touch` makes an entry the newest."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def touch(self, key: K) -> None:
        self._entries.move_to_end(key)

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


class PromptCache:
    """Prompts by (voice, persona), with hit and miss counts, and the voices they were planned from."""

    def __init__(self, entries: int):
        self.prompts: BoundedCache[tuple, CachedPrompt] = BoundedCache(entries)
        self.voices: BoundedCache[str, VoicePrompt | Tensor] = BoundedCache(VOICE_ENTRIES)
        self.hits = self.misses = 0

    @staticmethod
    def key(voice: str | None, persona: str) -> tuple:
        return (voice, persona_text(persona))

    def lookup(self, key: tuple) -> CachedPrompt | None:
        """The cached prompt, counted as a hit (and made the newest) or a miss."""
        cached = self.prompts.get(key)
        if cached is None:
            self.misses += 1
        else:
            self.hits += 1
            self.prompts.touch(key)
        return cached

    def voice(self, name: str, load: Callable[[str], VoicePrompt | Tensor]) -> VoicePrompt | Tensor:
        voice = self.voices.get(name)
        if voice is None:
            voice = load(name)
            self.voices.put(name, voice)
        return voice
