"""The page at `/` in a real headless Chromium (Debian's, driven by Playwright): fake microphone from an espeak-ng wav,
a WebRTC call to the server on the tiny model, the model's audio received and the transcript shown.

Chromium flags (spec/webrtc.md §7): fake device and auto-granted (or auto-denied) permission, the wav as the mic,
autoplay, `--allow-loopback-in-peer-connection` (no candidates on a loopback-only host otherwise), and no mDNS
hiding of host addresses (aiortc cannot resolve `.local` names).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from webrtc_support import ensure_ice_host_address, espeak_wav

from app.doors.webrtc.client import RealtimeCall

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium "
                                                               "(apt-get install chromium)")


def chromium_args(mic_wav: Path, permission: str = "") -> list[str]:
    return [
        "--use-fake-device-for-media-stream",
        f"--use-fake-ui-for-media-stream{permission}",
        f"--use-file-for-fake-audio-capture={mic_wav}",
        "--autoplay-policy=no-user-gesture-required",
        "--allow-loopback-in-peer-connection",
        "--disable-features=WebRtcHideLocalIpsWithMdns",
    ]


@pytest.fixture(scope="module")
def mic_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 kHz mono s16 speech: what Chromium's fake capture reads (and loops)."""
    path, _ = espeak_wav(tmp_path_factory.mktemp("mic"), "Hello! Could you tell me what the weather is like today? "
                         "I am planning a walk in the park this afternoon.", rate=48000, name="mic")
    return path


@pytest.fixture
async def browser_factory():
    from playwright.async_api import async_playwright

    ensure_ice_host_address()
    async with async_playwright() as pw:
        browsers = []

        async def launch(args: list[str]):
            browser = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
            browsers.append(browser)
            return browser

        yield launch
        for browser in browsers:
            await browser.close()


async def inbound_audio(page) -> dict:
    """The page's inbound-rtp audio stats (samples received, audio level, concealment) from pc.getStats()."""
    return await page.evaluate("""async () => {
        const pc = window.personaplex.pc;
        if (!pc) return {};
        let out = {};
        (await pc.getStats()).forEach((r) => {
            if (r.type === "inbound-rtp" && r.kind === "audio") out = {
                samples: r.totalSamplesReceived || 0, level: r.audioLevel || 0, energy: r.totalAudioEnergy || 0,
                concealed: r.concealedSamples || 0, packets: r.packetsReceived || 0, lost: r.packetsLost || 0 };
        });
        return out;
    }""")


async def wait_until(predicate, timeout_s: float, what: str):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def test_the_page_calls_the_model_and_plays_its_voice(server, browser_factory, mic_wav, tmp_path):
    browser = await browser_factory(chromium_args(mic_wav))
    page = await browser.new_page()
    logs: list[str] = []
    page.on("console", lambda m: logs.append(f"{m.type}: {m.text}"))
    await page.goto(f"http://localhost:{server.port}/")
    voices = await wait_until(lambda: page.eval_on_selector_all(
        "#voice option", "os => os.map(o => o.value).filter(Boolean)"), 10, "the voice list")
    assert sorted(voices) == sorted(server.ctx.voice_names())
    await page.fill("#persona", "You enjoy talking about the weather.")
    await page.select_option("#voice", voices[0])
    await page.click("#start")
    await wait_until(lambda: page.evaluate("window.personaplex.state === 'connected'"), 20,
                     f"the call to connect; console: {logs[-5:]}")

    stats = await wait_until(lambda: _heard(page), 20, "model audio in inbound-rtp")
    assert stats["samples"] > 48000 and stats["energy"] > 0
    text = await wait_until(lambda: page.inner_text("#transcript"), 20, "transcript text")
    assert text.strip()
    kinds = await page.evaluate("window.personaplex.events")
    assert "session.created" in kinds and "response.created" in kinds
    tick = await wait_until(lambda: _shown(page, "#stat-tick"), 5, "the server tick")
    assert "p50" in tick
    assert (await wait_until(lambda: _shown(page, "#stat-rtt"), 5, "the round trip")).endswith("ms")
    assert "target" in await page.inner_text("#stat-jb-server")
    mic_level = await page.inner_text("#mic-db")
    assert mic_level not in ("–", "")                               # the meter runs on the fake mic
    await page.screenshot(path=str(tmp_path / "page.png"), full_page=True)

    await page.click("#stop")
    assert await page.evaluate("window.personaplex.state") == "ended"
    await wait_until(lambda: _in_use(server, 0), 10, "the slot to be freed")


async def _shown(page, selector: str) -> str | None:
    text = await page.inner_text(selector)
    return text if text != "–" else None


async def _heard(page) -> dict | None:
    s = await inbound_audio(page)
    return s if s.get("samples", 0) > 48000 and s.get("level", 0) > 0 else None


async def _in_use(server, n: int) -> bool:
    return server.ctx.engine.sessions_in_use() == n


async def test_a_denied_microphone_gets_a_clear_message(server, browser_factory, mic_wav):
    browser = await browser_factory(chromium_args(mic_wav, "=deny"))
    page = await browser.new_page()
    await page.goto(f"http://localhost:{server.port}/")
    await page.click("#start")
    message = await wait_until(lambda: _message(page), 10, "the message")
    assert "Microphone access was denied" in message
    assert await page.evaluate("window.personaplex.state") == "failed"
    assert server.ctx.engine.sessions_in_use() == 0


async def test_a_full_server_gets_a_clear_message(start_server, browser_factory, mic_wav):
    srv = await start_server(max_sessions=1)
    other = RealtimeCall(srv.url, None)
    await other.connect()
    try:
        browser = await browser_factory(chromium_args(mic_wav))
        page = await browser.new_page()
        await page.goto(f"http://localhost:{srv.port}/")
        await page.click("#start")
        message = await wait_until(lambda: _message(page), 15, "the message")
        assert "The server is full" in message
        assert await page.evaluate("window.personaplex.state") == "failed"
    finally:
        await other.hang_up()


async def _message(page) -> str | None:
    if await page.is_hidden("#message"):
        return None
    return await page.inner_text("#message")

