"""Property-based fuzzing of `POST /v1/realtime/calls` bodies against one server per module (tiny model, loopback):
SDP offers truncated, with lines dropped or garbled, arbitrary text and bytes, under every content type; JSON and
multipart bodies whose `session` is arbitrary JSON, non-finite numbers, deep nesting. Invariant: 201 with an answer
(then hung up) or a 4xx with a registered JSON error, never a 500; no slot leaks; a bystander conversation keeps
being served."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiortc import RTCPeerConnection
from conftest import RunningServer
from fuzz_support import FUZZ, Bystander, json_values, known_objects, start_fuzz_server
from hypothesis import example, given
from hypothesis import strategies as st
from server_support import wait_in_use

from app.sessions.errors import CODES

pytestmark = pytest.mark.asyncio(loop_scope="module")

CALLS = "/v1/realtime/calls"
SESSION_FIELDS = ["type", "instructions", "voice", "audio", "temperature", "seed", "pacing", "output_modalities",
                  "turn_detection", "extra_body", "idle_timeout_s", "input_audio_format"]


async def real_offer() -> str:
    """An offer as a browser makes one: audio sendrecv and the `oai-events` data channel."""
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def sdp_mutations(offer: str) -> st.SearchStrategy[str]:
    lines = offer.split("\r\n")
    return st.one_of(
        st.just(offer),
        st.integers(0, len(offer)).map(lambda i: offer[:i]),
        st.sets(st.integers(0, len(lines) - 1), max_size=6).map(
            lambda drop: "\r\n".join(line for i, line in enumerate(lines) if i not in drop)),
        st.tuples(st.integers(0, len(lines) - 1), st.text(max_size=60)).map(
            lambda r: "\r\n".join(r[1] if i == r[0] else line for i, line in enumerate(lines))),
        st.text(max_size=300).map(lambda t: "v=0\r\n" + t),
        st.text(max_size=300),
    )


def sessions() -> st.SearchStrategy[str]:
    """The `session` part as text: objects with the known fields set to anything, or any JSON, or worse."""
    objects = st.dictionaries(st.sampled_from(SESSION_FIELDS), json_values | known_objects, max_size=4)
    return st.one_of(
        objects.map(json.dumps),
        json_values.map(json.dumps),
        st.sampled_from(["NaN", "Infinity", "1e400"]).map(lambda bad: f'{{"temperature": {bad}}}'),
        st.integers(33, 3000).map(lambda n: '{"audio": ' + "[" * n + "]" * n + "}"),
        st.text(max_size=100),
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fuzz(tiny_checkpoint):
    server = await start_fuzz_server(tiny_checkpoint)
    http = aiohttp.ClientSession()
    bystander = await Bystander.open(http, server)
    yield server, http, bystander, await real_offer()
    await bystander.assert_served()
    await wait_in_use(http, server.url, 1)    # the bystander's: no call kept a slot
    assert server.ctx.metrics.errors["internal_error"] == 0
    await http.close()
    await server.runner.cleanup()


async def post_and_check(server: RunningServer, http: aiohttp.ClientSession, data: Any,
                         content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    async with http.post(server.url + CALLS, data=data, headers=headers) as r:
        body = await r.read()
        if r.status == 201:
            assert body.startswith(b"v=0") and r.headers["Location"].startswith(CALLS)
            async with http.delete(server.url + r.headers["Location"]) as hung_up:
                assert hung_up.status == 204
            return
        assert r.status in (400, 413, 415), (r.status, body[:300])
        if r.status != 413:   # aiohttp's own body-size refusal is plain text
            error = json.loads(body)["error"]
            assert error["code"] in CODES and error["code"] != "internal_error", error


@FUZZ
@given(data=st.data(), content_type=st.sampled_from(["application/sdp", "text/plain", None, "application/sdp; x=y"]))
async def test_fuzz_sdp_bodies(fuzz, data: st.DataObject, content_type: str | None) -> None:
    server, http, bystander, offer = fuzz
    body = data.draw(sdp_mutations(offer))
    await post_and_check(server, http, body.encode("utf-8", "surrogatepass"), content_type)
    await bystander.assert_served()


@FUZZ
@given(data=st.data(), form=st.sampled_from(["json", "multipart"]))
async def test_fuzz_json_and_multipart_bodies(fuzz, data: st.DataObject, form: str) -> None:
    server, http, bystander, offer = fuzz
    sdp = data.draw(sdp_mutations(offer))
    session = data.draw(st.none() | sessions())
    if form == "json":
        body = data.draw(st.sampled_from(["object", "raw"]))
        if body == "object" or session is None:
            text = json.dumps({"sdp": sdp, **({"session": json.loads(session)} if _is_json(session) else {})})
        else:
            text = '{"sdp": ' + json.dumps(sdp) + ', "session": ' + session + "}"
        await post_and_check(server, http, text.encode("utf-8", "surrogatepass"), "application/json")
    else:
        multipart = aiohttp.FormData()
        multipart.add_field("sdp", _utf8(sdp), content_type="application/sdp")
        if session is not None:
            multipart.add_field("session", _utf8(session), content_type="application/json")
        await post_and_check(server, http, multipart, None)
    await bystander.assert_served()


@FUZZ
@given(junk=st.binary(max_size=3000), content_type=st.sampled_from(["application/json", "multipart/form-data",
                                                                     "multipart/form-data; boundary=x",
                                                                     "application/sdp"]))
async def test_fuzz_binary_junk_bodies(fuzz, junk: bytes, content_type: str) -> None:
    server, http, bystander, _ = fuzz
    await post_and_check(server, http, junk, content_type)
    await bystander.assert_served()


@FUZZ
@given(part=st.binary(max_size=600))
@example(part=b"v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\n")  # no header block: its SDP read as headers
@example(part=b'Content-Disposition: form-data; name="sdp"\r\nv=0\r\n')  # no blank line after its headers
async def test_fuzz_multipart_parts(fuzz, part: bytes) -> None:
    """A well-framed multipart body whose one part is anything: its headers and body as they come."""
    server, http, bystander, _ = fuzz
    await post_and_check(server, http, b"--x\r\n" + part + b"\r\n--x--\r\n", "multipart/form-data; boundary=x")
    await bystander.assert_served()


def _is_json(text: str | None) -> bool:
    if text is None:
        return False
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _utf8(text: str) -> str:
    """The text with lone surrogates (which no encoder writes) replaced."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
