"""Ephemeral client secrets (`POST /v1/realtime/client_secrets`, app/doors/realtime/client_secrets.py) against live
servers on the tiny model: minted with the openai SDK's own `client.realtime.client_secrets.create`, its answer
validated against the SDK's pydantic type, then presented as the SDK, a browser WebSocket (the subprotocol), an aiortc
call and the page in a real Chromium present it; reused, expired, forged and garbled secrets are refused with HTTP 401
before any upgrade or slot, by every worker of a `--workers 2` server, and no secret reaches the log.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import server_settings
from openai import AsyncOpenAI
from openai.types.realtime import ClientSecretCreateResponse
from process_support import start_tiny, stop, wait_ready
from server_support import next_event, until, wait_in_use
from test_browser import CHROMIUM, browser_factory, chromium_args, mic_wav, wait_until  # noqa: F401 (fixtures)
from webrtc_support import ensure_ice_host_address

from app.doors.realtime.client_secrets import CLIENT_SECRETS, MAX_SECRET_CHARS
from app.doors.webrtc.client import CallRefused, RealtimeCall
from app.doors.webrtc.routes import CALLS
from app.shell.auth import redact_query
from app.shell.server import create_app
from model.loading import load_model

KEY = "sk-test-operator-key"
ROUTE = "/v1/realtime/client_secrets"
PIRATE = "You are a pirate who answers every question about the sea."


def sdk(url: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key, base_url=url + "/v1", max_retries=0)


async def mint(url: str, session: dict[str, Any] | None = None, seconds: int = 120) -> ClientSecretCreateResponse:
    """A secret minted with the openai SDK; its raw JSON must validate against the SDK's own type."""
    async with sdk(url, KEY) as client:
        raw = await client.realtime.client_secrets.with_raw_response.create(
            expires_after={"anchor": "created_at", "seconds": seconds},
            session=session or {"type": "realtime", "instructions": PIRATE})
    body = raw.http_response.json()
    ClientSecretCreateResponse.model_validate(body)
    return raw.parse()


def ws_url(url: str) -> str:
    return url.replace("http:", "ws:") + "/v1/realtime"


async def handshake(http: aiohttp.ClientSession, url: str, secret: str, form: str = "header") -> tuple[int, dict]:
    """A real WebSocket handshake presenting `secret` (as a header, the browser's subprotocol, or ?api_key=) that the
    server refuses: its status and JSON body."""
    headers = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode()}
    target = url + "/v1/realtime"
    if form == "header":
        headers["Authorization"] = f"Bearer {secret}"
    elif form == "subprotocol":
        headers["Sec-WebSocket-Protocol"] = f"realtime, openai-insecure-api-key.{secret}"
    else:
        target += f"?api_key={secret}"
    async with http.get(target, headers=headers) as r:
        assert r.status != 101
        return r.status, await r.json()


def refused_with(answer: tuple[int, dict], code: str) -> None:
    status, body = answer
    assert status == 401, answer
    assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["message"]


async def test_the_sdk_mints_and_the_secret_opens_one_session_with_its_config(start_server):
    srv = await start_server(api_keys=(KEY,))
    bound = {"type": "realtime", "instructions": PIRATE,
             "audio": {"output": {"format": {"type": "audio/pcmu"}}}}
    before = time.time()
    secret = await mint(srv.url, bound, seconds=300)
    assert secret.value.startswith("ek_") and KEY not in secret.value
    assert before + 299 <= secret.expires_at <= time.time() + 301
    assert secret.session.id.startswith("sess_") and secret.session.instructions == PIRATE

    # The SDK's own realtime client, the secret as its api_key (Authorization: Bearer).
    async with sdk(srv.url, secret.value) as client, client.realtime.connect(model="personaplex") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.id == secret.session.id and created.session.instructions == PIRATE
        assert created.session.audio.output.format.type == "audio/pcmu"
        await conn.input_audio_buffer.append(audio=base64.b64encode(bytes(3840)).decode())
        async for event in conn:          # the bound format is what the model's audio comes in: 80 ms of G.711
            if event.type == "response.output_audio.delta":
                assert abs(len(base64.b64decode(event.delta)) - 640) <= 32   # (pcm16: 3840 bytes)
                break
        assert srv.ctx.engine.sessions_in_use() == 1

        # The same secret again, in every form a client presents a key: 401 before the upgrade, no slot taken.
        async with aiohttp.ClientSession() as http:
            for form in ("header", "subprotocol", "query"):
                refused_with(await handshake(http, srv.url, secret.value, form), "client_secret_used")
            async with http.post(srv.url + "/v1/realtime/calls", data="v=0",
                                 headers={"Authorization": f"Bearer {secret.value}"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "client_secret_used"
        assert srv.ctx.engine.sessions_in_use() == 1
    assert srv.ctx.metrics.rejections[("/v1/realtime", "client_secret_used")] == 3


async def test_a_browser_socket_presents_the_secret_as_a_subprotocol(start_server):
    srv = await start_server(api_keys=(KEY,))
    secret = await mint(srv.url)
    protocols = ("realtime", f"openai-insecure-api-key.{secret.value}")
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url(srv.url), protocols=protocols) as ws:
        assert ws.protocol == "realtime"              # the secret is never echoed back
        created = await next_event(ws)
        assert created["type"] == "session.created"
        assert created["session"]["instructions"] == PIRATE and created["session"]["id"] == secret.session.id
        # The bound config is the session's starting point, not a lock: a session.update changes it as usual.
        keeper = "You are a lighthouse keeper."
        await ws.send_json({"type": "session.update", "session": {"instructions": keeper}})
        assert (await until(ws, "session.updated"))["session"]["instructions"] == keeper


async def test_expired_forged_and_garbled_secrets_are_refused_before_the_upgrade(start_server):
    srv = await start_server(api_keys=(KEY,))
    other = await start_server(api_keys=("sk-another-server",))
    secrets = srv.app[CLIENT_SECRETS]
    short = await mint(srv.url, seconds=10)                # OpenAI's shortest lifetime
    kept = await mint(srv.url)
    async with sdk(other.url, "sk-another-server") as client:
        foreign = (await client.realtime.client_secrets.create(session={"type": "realtime"})).value
    body, tag = kept.value.rsplit(".", 1)
    tampered = body[:-4] + ("AAAA" if body[-4:] != "AAAA" else "BBBB") + "." + tag
    async with aiohttp.ClientSession() as http:
        secrets.clock = lambda: time.time() + 11           # the server's clock, 11 s on: the short one has expired
        refused_with(await handshake(http, srv.url, short.value), "client_secret_expired")
        secrets.clock = time.time
        for bad in (foreign, tampered, "ek_garbage", "ek_" + "A" * (MAX_SECRET_CHARS + 10), kept.value + "x"):
            refused_with(await handshake(http, srv.url, bad), "invalid_client_secret")
            refused_with(await handshake(http, srv.url, bad, "subprotocol"), "invalid_client_secret")
        # None of that spent the good secret, and none took a slot.
        assert srv.ctx.engine.sessions_in_use() == 0
        async with http.ws_connect(ws_url(srv.url), headers={"Authorization": f"Bearer {kept.value}"}) as ws:
            assert (await next_event(ws))["session"]["instructions"] == PIRATE

        # Minting: the API key, not a secret; OpenAI's bounds on the lifetime; realtime sessions only.
        fresh = (await mint(srv.url)).value
        for credential in (fresh, "sk-wrong"):
            async with http.post(srv.url + ROUTE, json={}, headers={"Authorization": f"Bearer {credential}"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        bad_requests = [({"expires_after": {"anchor": "created_at", "seconds": 9}}, "expires_after.seconds"),
                        ({"expires_after": {"anchor": "created_at", "seconds": 7201}}, "expires_after.seconds"),
                        ({"expires_after": {"anchor": "now", "seconds": 60}}, "expires_after.anchor"),
                        ({"session": {"type": "transcription"}}, "session.type"),
                        # Checked as a session.update is: here, not when the secret is presented.
                        ({"session": {"instructions": "x" * 20000}}, "session.instructions"),
                        ({"session": {"audio": {"output": {"voice": "no-such-voice"}}}}, "session.audio.output.voice"),
                        # Valid, but too much to travel in one header.
                        ({"session": {"instructions": base64.b64encode(os.urandom(6000)).decode()}}, "session")]
        for request, param in bad_requests:
            async with http.post(srv.url + ROUTE, json=request, headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"]["param"] == param
        async with http.post(srv.url + ROUTE, data="{not json", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with http.post(srv.url + ROUTE, headers={"Authorization": f"Bearer {KEY}"}) as r:
            answer = await r.json()                       # no body: OpenAI's defaults (600 s, the default session)
            assert r.status == 200 and 599 <= answer["expires_at"] - time.time() <= 601
            ClientSecretCreateResponse.model_validate(answer)


async def test_without_api_keys_a_secret_still_binds_its_session_and_opens_one(start_server):
    srv = await start_server()
    async with aiohttp.ClientSession() as http:
        async with http.post(srv.url + ROUTE, json={"session": {"type": "realtime", "instructions": PIRATE}}) as r:
            secret = (await r.json())["value"]
        async with http.ws_connect(ws_url(srv.url), headers={"Authorization": f"Bearer {secret}"}) as ws:
            assert (await next_event(ws))["session"]["instructions"] == PIRATE
        refused_with(await handshake(http, srv.url, secret), "client_secret_used")


async def test_a_webrtc_call_opens_with_a_secret_which_first_reads_the_ice_servers(start_server, speech_24k):
    ensure_ice_host_address()
    srv = await start_server(api_keys=(KEY,), turn_url="turn:turn.example.org:3478", turn_username="u",
                             turn_credential="turn-secret")
    secret = await mint(srv.url)
    auth = {"Authorization": f"Bearer {secret.value}"}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):                                # reading what the call needs does not spend the secret
            async with http.get(srv.url + "/v1/realtime/webrtc-config", headers=auth) as r:
                assert r.status == 200 and (await r.json())["ice_servers"][0]["credential"] == "turn-secret"
            async with http.get(srv.url + "/v1/voices", headers=auth) as r:
                assert r.status == 200
        async with http.get(srv.url + "/v1/models", headers=auth) as r:   # nothing else opens to a secret
            assert r.status == 401
    # The offer's own session part goes over the bound one: the voice from the offer, the persona from the secret.
    voice = srv.ctx.voice_names()[-1]
    call = RealtimeCall(srv.url, speech_24k, session={"audio": {"output": {"voice": voice}}}, api_key=secret.value)
    await call.connect()
    try:
        updated = await call.wait_event("session.updated")
        assert updated["session"]["instructions"] == PIRATE and updated["session"]["voice"] == voice
        assert updated["session"]["id"] == secret.session.id
        await call.wait_event("response.created", timeout_s=15)
        again = RealtimeCall(srv.url, speech_24k, api_key=secret.value)
        with pytest.raises(CallRefused) as refused:
            await again.connect()
        await again.close()
        assert refused.value.status == 401 and refused.value.error()["code"] == "client_secret_used"
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/v1/realtime/webrtc-config",
                                                             headers=auth) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "client_secret_used"
    finally:
        await call.hang_up(delete=False)                  # the secret cannot DELETE; closing the peer ends the call
    async with aiohttp.ClientSession() as http:
        await wait_in_use(http, srv.url, 0, timeout=10.0)
    assert not srv.app[CALLS]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium")
async def test_the_page_opens_its_call_with_a_secret_from_the_token_endpoint_or_a_pasted_one(
        tiny_checkpoint, browser_factory, mic_wav):  # noqa: F811 (the fixtures imported above)
    """The page holds no API key: with `?token_url=` it asks the deployment's backend (here a route beside the
    server on the same origin, which mints with the key) for each call's secret; without, the operator pastes one."""
    app = create_app(server_settings(tiny_checkpoint, api_keys=(KEY,)), model=load_model(str(tiny_checkpoint)))
    minted: list[ClientSecretCreateResponse] = []

    async def token(request: web.Request) -> web.Response:     # the backend: it knows its user, and holds the key
        async with sdk(f"http://127.0.0.1:{request.url.port}", KEY) as client:
            minted.append(await client.realtime.client_secrets.create(
                session={"type": "realtime", "instructions": PIRATE}))
        return web.json_response(minted[-1].model_dump(mode="json", exclude_none=True))

    app.router.add_post("/token", token)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://localhost:{runner.addresses[0][1]}"

    async def the_call() -> Any:
        await wait_until(lambda: page.evaluate("window.personaplex.state === 'connected'"), 20, "the call")
        (call,) = app[CALLS].values()
        return call.session

    try:
        browser = await browser_factory(chromium_args(mic_wav))
        page = await browser.new_page()
        await page.goto(base + "/?token_url=/token")
        await wait_until(lambda: page.evaluate("window.personaplex.keysRequired"), 10, "the page to see keys on")
        assert await page.is_hidden("#secret-field")           # nothing to ask: the backend gives the secret
        await page.click("#start")
        session = await the_call()
        assert session.config.persona == PIRATE and session.session_id == minted[0].session.id
        await page.click("#stop")                              # no DELETE (a secret cannot): the peer's close
        await wait_until(lambda: _none(app[CALLS]), 10, "the call to end")

        page = await browser.new_page()
        await page.goto(base + "/")
        await page.wait_for_selector("#secret-field", state="visible", timeout=10_000)
        await page.fill("#secret", KEY)                        # the page refuses to carry an API key
        await page.click("#start")
        await wait_until(lambda: page.evaluate("window.personaplex.state === 'failed'"), 10, "the refusal")
        assert "never belongs in a page" in await page.inner_text("#message")
        keeper = "You keep the lighthouse."
        await page.fill("#secret", (await mint(base.replace("localhost", "127.0.0.1"),
                                               {"type": "realtime", "instructions": keeper})).value)
        await page.click("#start")
        assert (await the_call()).config.persona == keeper
        assert await page.input_value("#secret") == ""        # spent: the field is cleared
        await page.click("#stop")
        await wait_until(lambda: _none(app[CALLS]), 10, "the call to end")
    finally:
        await runner.cleanup()


async def _none(calls: dict) -> bool:
    return not calls


def test_the_access_log_never_shows_a_secret():
    assert redact_query("/v1/realtime?api_key=ek_abc.DEF-1") == "/v1/realtime?api_key=REDACTED"
    assert redact_query("/v1/x/ek_abc.DEF-1_z?duplex=1") == "/v1/x/ek_REDACTED?duplex=1"
    assert redact_query("/v1/realtime?duplex=1&q=ek_abc.d") == "/v1/realtime?duplex=1&q=ek_REDACTED"
    assert redact_query("/week_plan?x=1") == "/week_plan?x=1"


async def _pinned(url: str) -> dict[int, aiohttp.ClientSession]:
    """One HTTP client per worker process, each on one kept-alive connection (which stays with the worker that
    accepted it), keyed by the worker's pid (/health marks the process that answers)."""
    pinned: dict[int, aiohttp.ClientSession] = {}
    for _ in range(40):
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=60))
        async with http.get(url + "/health") as r:
            this = next(p["pid"] for p in (await r.json())["processes"] if p.get("this"))
        if this in pinned:
            await http.close()
        else:
            pinned[this] = http
        if len(pinned) == 2:
            return pinned
    raise AssertionError(f"40 connections all landed on the workers {list(pinned)}")


async def _worker_of(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/health") as r:
        return next(p["pid"] for p in (await r.json())["processes"] if p.get("this"))


async def test_two_workers_share_secrets_and_the_single_use_record(tiny_checkpoint, tmp_path):
    """A secret minted by one worker opens a session on the other; once used, both workers refuse it; no secret
    reaches the log of any process."""
    proc, url = await start_tiny(tiny_checkpoint, tmp_path, "--workers", "2", "--api-key", KEY)
    seen: list[str] = []
    pinned: dict[int, aiohttp.ClientSession] = {}
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, workers=2)
            pinned = await _pinned(url)
            minter, other = list(pinned)
            auth = {"Authorization": f"Bearer {KEY}"}
            for _ in range(12):                           # until a connection lands on the other worker
                async with pinned[minter].post(url + ROUTE, headers=auth, json={
                        "session": {"type": "realtime", "instructions": PIRATE}}) as r:
                    secret = (await r.json())["value"]
                seen.append(secret)
                assert await _worker_of(pinned[minter], url) == minter
                fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
                ws = await fresh.ws_connect(ws_url(url), headers={"Authorization": f"Bearer {secret}"})
                created = await next_event(ws, timeout=30)
                assert created["session"]["instructions"] == PIRATE
                report = await (await http.get(url + "/health", headers={"Connection": "close"})).json()
                holder = [p["pid"] for p in report["processes"] if p["role"] == "worker" and p["sessions"]]
                if holder == [other]:
                    break
                await ws.close()
                await fresh.close()
                await wait_in_use(http, url, 0, timeout=10.0)
            else:
                raise AssertionError("12 sessions all landed on the minting worker")
            try:
                for client in pinned.values():
                    await client.close()
                pinned = await _pinned(url)               # fresh: an idle kept-alive connection may have gone
                for worker, client in pinned.items():     # spent: both workers know it
                    async with client.get(url + "/v1/realtime", headers={"Authorization": f"Bearer {secret}"}) as r:
                        assert r.status == 401 and (await r.json())["error"]["code"] == "client_secret_used"
                    assert await _worker_of(client, url) == worker
                async with http.get(url + "/v1/ek_not_a_route", headers=auth) as r:
                    assert r.status == 404                 # an `ek_` in a path: the log redacts it too
            finally:
                await ws.close()
                await fresh.close()
    finally:
        for client in pinned.values():
            await client.close()
        out = await stop(proc)
    assert proc.returncode == 0, out
    assert "/v1/ek_REDACTED" in out and "GET /v1/realtime" in out     # the access log is on, and redacted
    assert not [s for s in seen if s in out or s[3:40] in out]
