"""The Realtime dialect's conversation items: the responses the model spoke and the items a client added.

A full-duplex model keeps its context in its own KV, not in a list of items, so this is bookkeeping that lets the OpenAI
item events mean what clients expect: `conversation.item.retrieve` returns the item as the server holds it,
`conversation.item.delete` forgets it, and `conversation.item.truncate` cuts an assistant item's transcript at the audio
the client says was played (nothing is rewound in the model, which heard the caller talk over it anyway). What a
client-added text item does to the model is `app.doors.realtime.dialect`'s business (a prompt prefilled into the
context).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from app.sessions.errors import ProtocolError

FRAME_MS = 80
MAX_ITEMS = 256   # the oldest are forgotten past this: a long call does not grow the bookkeeping without bound


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass
class Response:
    """One response: an assistant message whose audio is the model's frames from its opening to its end."""

    id: str
    item_id: str
    metadata: dict[str, str] | None = None
    frames: int = 0                                   # audio frames sent in it
    pieces: list[tuple[int, str]] = field(default_factory=list)   # (frame within the response, text piece)
    played_ms: int | None = None                      # set by a truncate: the audio the client played

    @classmethod
    def open(cls, metadata: dict[str, str] | None) -> Response:
        rid = new_id("resp")
        return cls(id=rid, item_id=f"item_{rid[5:]}", metadata=metadata)

    @property
    def transcript(self) -> str:
        cut = None if self.played_ms is None else self.played_ms / FRAME_MS
        return "".join(text for frame, text in self.pieces if cut is None or frame < cut)

    def audio_ms(self) -> int:
        return self.frames * FRAME_MS


class ConversationItems:
    """The items of one session, oldest first, at most MAX_ITEMS."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._spoken: dict[str, Response] = {}

    @property
    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def add(self, item: dict[str, Any], response: Response | None = None) -> str | None:
        """Add (or replace) `item` at the end; the id of the item before it."""
        item_id = item["id"]
        self._items.pop(item_id, None)
        previous = self.last_id
        self._items[item_id] = item
        if response is not None:
            self._spoken[item_id] = response
        while len(self._items) > MAX_ITEMS:
            old, _ = self._items.popitem(last=False)
            self._spoken.pop(old, None)
        return previous

    def update(self, item: dict[str, Any]) -> None:
        if item["id"] in self._items:
            self._items[item["id"]] = item

    def get(self, item_id: object, param: str = "item_id") -> dict[str, Any]:
        if not isinstance(item_id, str) or item_id not in self._items:
            raise ProtocolError("item_not_found", f"no conversation item {str(item_id)[:64]!r}", param=param)
        return self._items[item_id]

    def delete(self, item_id: object) -> None:
        self.get(item_id)
        del self._items[item_id]
        self._spoken.pop(item_id, None)

    def truncate(self, item_id: object, audio_end_ms: object) -> Response:
        """Cut an assistant item's transcript at `audio_end_ms` (clamped to the audio it has)."""
        self.get(item_id)
        response = self._spoken.get(item_id)
        if response is None:
            raise ProtocolError("invalid_item", "only an assistant message's audio can be truncated", param="item_id")
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            raise ProtocolError("bad_event", "`audio_end_ms` must be a non-negative integer", param="audio_end_ms")
        response.played_ms = min(audio_end_ms, response.audio_ms())
        return response
