"""Every event the Realtime dialect can send, driven through a real WebSocket and validated against the openai SDK's
own pydantic types (GA, and beta when the client asks for beta names): session, appends, commit, create, cancel,
clears, item create/retrieve/delete/truncate, errors, heartbeat, close."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import numpy as np
import pytest
from realtime_schema import validate_server_event
from server_support import b64, encode

REALTIME = "/v1/realtime?duplex=1"
FRAME = 1920


class Client:
    """A WebSocket client that validates every event it receives and keeps them."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, beta: bool) -> None:
        self.ws, self.beta = ws, beta
        self.events: list[dict[str, Any]] = []

    async def until(self, kind: str, timeout: float = 20.0) -> dict[str, Any]:
        while True:
            msg = await self.ws.receive(timeout=timeout)
            assert msg.type is aiohttp.WSMsgType.TEXT, (msg.type, msg.data, [e["type"] for e in self.events[-8:]])
            event = json.loads(msg.data)
            validate_server_event(event, beta=self.beta)
            self.events.append(event)
            if event["type"] == kind:
                return event

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_json(event)

    async def audio(self, samples: np.ndarray) -> None:
        for i in range(0, samples.size, FRAME):
            await self.send({"type": "input_audio_buffer.append", "audio": b64(encode(samples[i:i + FRAME], "pcm16",
                                                                                       24000))})


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
async def test_every_server_event_validates(server, speech_24k, beta):
    names = ("response.audio.delta", "conversation.item.created") if beta else \
        ("response.output_audio.delta", "conversation.item.added")
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    speech = np.tile(speech_24k, 3)
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws(REALTIME), headers=headers) as ws:
        c = Client(ws, beta)
        await c.until("session.created")
        # An update as LiveKit sends it by default: an OpenAI voice, semantic VAD, transcription, tools, tracing.
        await c.send({"type": "session.update", "session": {
            "type": "realtime", "instructions": "You help.", "output_modalities": ["audio"],
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                "turn_detection": {"type": "semantic_vad", "eagerness": "auto"},
                                "transcription": {"model": "gpt-4o-mini-transcribe"}},
                      "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin"}},
            "max_output_tokens": "inf", "tool_choice": "auto", "tools": [], "tracing": None,
            "pacing": "input"}})
        updated = await c.until("session.updated")
        assert {i["param"] for i in updated["ignored"]} == {"session.audio.input.transcription",
                                                           "session.audio.output.voice"}
        # A response asked for before any audio starts the conversation and carries the request's metadata.
        await c.send({"type": "response.create", "response": {"metadata": {"client_event_id": "r1"}}})
        await c.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]}})
        added = await c.until(names[1])
        await c.audio(speech[: 8 * FRAME])
        created = await c.until("response.created")
        assert created["response"]["metadata"] == {"client_event_id": "r1"}
        await c.until(names[0])
        await c.send({"type": "input_audio_buffer.commit"})
        await c.until("input_audio_buffer.committed")
        await c.send({"type": "input_audio_buffer.clear"})
        await c.until("input_audio_buffer.cleared")
        # During the conversation a response.create ends the open response and opens another.
        await c.send({"type": "response.create", "response": {"metadata": {"client_event_id": "r2"}}})
        done = await c.until("response.done")
        assert done["response"]["status"] == "completed"
        second = await c.until("response.created")
        assert second["response"]["metadata"] == {"client_event_id": "r2"}
        await c.audio(speech[8 * FRAME: 12 * FRAME])
        await c.until(names[0])
        await c.send({"type": "output_audio_buffer.clear"})
        cancelled = await c.until("response.done")
        assert cancelled["response"]["status"] == "cancelled"
        assert cancelled["response"]["output"][0]["status"] == "incomplete"
        cleared = await c.until("output_audio_buffer.cleared")
        assert cleared["response_id"] == second["response"]["id"]
        item_id = second["response"]["output"][0]["id"] if second["response"]["output"] else \
            cancelled["response"]["output"][0]["id"]
        await c.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                      "audio_end_ms": 40})
        truncated = await c.until("conversation.item.truncated")
        assert truncated["audio_end_ms"] == 40
        await c.send({"type": "conversation.item.retrieve", "item_id": added["item"]["id"]})
        await c.until("conversation.item.retrieved")
        await c.send({"type": "conversation.item.delete", "item_id": added["item"]["id"]})
        await c.until("conversation.item.deleted")
        await c.send({"type": "response.cancel"})              # nothing open: already met, no error
        await c.send({"type": "conversation.item.delete", "item_id": "item_unknown", "event_id": "e1"})
        error = await c.until("error")
        assert error["error"]["code"] == "item_not_found" and error["error"]["event_id"] == "e1"
        await ws.send_str("{not json")
        assert (await c.until("error"))["error"]["code"] == "invalid_json"
        await c.send({"type": "session.heartbeat"})
        await c.until("session.heartbeat_ack")
        await c.send({"type": "session.close"})
        closed = await c.until("session.closed")
        assert closed["reason"] == "client_close"
        kinds = {e["type"] for e in c.events}
        assert not [e for e in c.events if e["type"] == "error" and e["error"]["code"] not in (
            "item_not_found", "invalid_json")], [e for e in c.events if e["type"] == "error"]
        assert "rate_limits.updated" in kinds and "response.content_part.done" in kinds
