"""The voice-agent frameworks as their users write them, against the real server (`python -m app` on the tiny model,
with an API key; once with the default workers and once with `--workers 2`), changed only in base URL, model and
API key (docs/frameworks.md):

- the openai SDK's `client.realtime.connect` (and `client.beta.realtime.connect`, the beta dialect);
- pipecat's `OpenAIRealtimeLLMService` in its documented pattern (LLMContext and its aggregator pair, `LLMRunFrame`
  queued as the client connects), with an `InterruptionFrame` as a local VAD sends it, and with
  `turn_detection=False` and the user's started/stopped speaking frames;
- LiveKit Agents' `openai.realtime.RealtimeModel()` with its default options, its session driven directly:
  `generate_reply()` before the audio and during it, `update_instructions()`, `truncate()`, `interrupt()`;
- the OpenAI Agents SDK for Python: a `RealtimeAgent` with a tool and a handoff in a `RealtimeRunner`'s session, its
  defaults, with `send_message()`, `update_agent()` and `interrupt()` mid-call;
- the OpenAI Agents SDK for JavaScript: a `RealtimeAgent` in a `RealtimeSession` over WebRTC in the real headless
  Chromium, against `POST /v1/realtime/calls` with an ephemeral key from `POST /v1/realtime/client_secrets`.

Each gets CALL_S seconds of speech at the real pace. The WebSocket frameworks talk through tests/ws_tap.py, so every
server event is checked as the framework received it; the browser page records its data channel's events. The
verdict (tests/framework_support.py) is issue 26's "works", and a failure lists every check that failed.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from framework_support import (
    API_KEY,
    CALL_S,
    MODEL,
    PERSONA,
    RATE,
    Cues,
    Verdict,
    agents_bundle,
    appended_seconds,
    call_pcm,
    eventually,
    framework_server,
    is_type,
    paced,
)
from process_support import EngineClock
from test_browser import CHROMIUM, chromium_args
from webrtc_support import ensure_ice_host_address, espeak_wav
from ws_tap import Connection, WsTap, json_event

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

PAGE = Path(__file__).with_name("framework_agents_page.html")


@pytest_asyncio.fixture(loop_scope="module", scope="module", params=[None, 2], ids=["workers-default", "workers-2"])
async def server(request, tiny_checkpoint, tmp_path_factory):
    async with framework_server(tiny_checkpoint, tmp_path_factory.mktemp("frameworks"), request.param) as srv:
        yield srv


@pytest_asyncio.fixture(loop_scope="module")
async def tap(server):
    tap = WsTap(server.url)
    await tap.start()
    yield tap
    await tap.stop()


@pytest.fixture
def caller(speech_24k) -> bytes:
    return call_pcm(speech_24k)


def one_connection(tap: WsTap, verdict: Verdict) -> Connection:
    """The call's WebSocket; a second one means the framework reconnected, which is a failure in itself."""
    assert tap.connections, "the framework never connected"
    verdict.check(len(tap.connections) == 1, "one connection for the whole call",
                  f"{len(tap.connections)} connections (the framework reconnected); "
                  f"the first closed by the {tap.connections[0].closed_by} with {tap.connections[0].close_code}")
    return tap.connections[0]


def ws_checks(verdict: Verdict, conn: Connection, start: float, heard: list[tuple[float, float]]) -> list:
    """The checks every WebSocket framework gets; the call's timeline for the framework's own checks."""
    timeline = conn.timeline(start)
    verdict.audio_in(appended_seconds(timeline), CALL_S)
    verdict.audio_out(heard, CALL_S, timeline)
    verdict.no_errors(timeline)
    verdict.schema(timeline, beta=conn.beta)
    verdict.answered(timeline, "session.update", is_type("session.updated"), "session.updated")
    return timeline


# ---- the openai SDK ---------------------------------------------------------------------------------------------

SDK_SESSION = {
    # As OpenAI's Realtime guide writes a voice session.
    "GA": {"type": "realtime", "model": MODEL, "instructions": PERSONA, "output_modalities": ["audio"],
           "audio": {"input": {"format": {"type": "audio/pcm", "rate": RATE}, "turn_detection": {"type": "server_vad"}},
                     "output": {"format": {"type": "audio/pcm", "rate": RATE}, "voice": "marin"}}},
    "beta": {"modalities": ["audio", "text"], "instructions": PERSONA, "voice": "alloy", "input_audio_format": "pcm16",
             "output_audio_format": "pcm16", "turn_detection": {"type": "server_vad"}},
}


@pytest.mark.parametrize("dialect", ["GA", "beta"])
async def test_openai_sdk(server, tap: WsTap, caller: bytes, dialect: str) -> None:
    from openai import AsyncOpenAI

    verdict = Verdict(f"openai SDK {version('openai')} ({dialect})")
    # The beta resource always dials wss:// unless the WebSocket base URL is given.
    client = AsyncOpenAI(api_key=API_KEY, base_url=tap.base + "/v1",
                         websocket_base_url=tap.base.replace("http", "ws", 1) + "/v1")
    realtime = client.beta.realtime if dialect == "beta" else client.realtime
    heard: list[tuple[float, float]] = []
    start = time.monotonic()
    async with realtime.connect(model=MODEL) as conn:
        await conn.session.update(session=SDK_SESSION[dialect])

        async def listen() -> None:
            async for event in conn:
                if event.type in ("response.output_audio.delta", "response.audio.delta"):
                    heard.append((time.monotonic() - start, len(base64.b64decode(event.delta)) / (2 * RATE)))

        listener = asyncio.ensure_future(listen())
        start = time.monotonic()
        clock = await EngineClock.start(server.url)
        async for _, chunk in paced(caller, 0.04):
            await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
        verdict.engine_behind_s = await clock.behind_s()
        await asyncio.sleep(0.3)
        verdict.loop_alive(not listener.done(), f"`async for event in connection` ended: {_ended(listener)}")
    listener.cancel()
    ws_checks(verdict, one_connection(tap, verdict), start, heard)
    verdict.assert_works()


def _ended(task: asyncio.Future) -> str:
    if not task.done():
        return "still running"
    if task.cancelled():
        return "cancelled"
    return repr(task.exception()) if task.exception() else "the connection closed"


# ---- pipecat ------------------------------------------------------------------------------------------------------

@dataclass
class PipecatCall:
    start: float = 0.0
    heard: list[tuple[float, float]] = field(default_factory=list)
    receive_alive: bool = False
    receive_ended_at: float | None = None
    logged_errors: list[str] = field(default_factory=list)
    engine_behind_s: float = 0.0


async def pipecat_call(server, tap: WsTap, caller: bytes, properties: Any, cues: list) -> PipecatCall:
    """pipecat's documented speech-to-speech bot (its examples/realtime/realtime-openai.py): the service, an
    LLMContext with its aggregator pair, and `LLMRunFrame` queued as the client connects. The test stands where the
    transport would: it queues the caller's audio as `InputAudioRawFrame`s and notes the bot's audio where
    `transport.output()` would play it."""
    from loguru import logger
    from pipecat.frames.frames import InputAudioRawFrame, LLMRunFrame, TTSAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    call = PipecatCall(start=time.monotonic())

    class Speaker(FrameProcessor):
        async def process_frame(self, frame, direction) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                call.heard.append((time.monotonic() - call.start, frame.num_frames / frame.sample_rate))
            await self.push_frame(frame, direction)

    sink = logger.add(lambda m: call.logged_errors.append(str(m).strip()[:500]), level="ERROR")
    llm = OpenAIRealtimeLLMService(
        api_key=API_KEY, base_url=tap.base.replace("http", "ws", 1) + "/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model=MODEL, system_instruction=PERSONA,
                                                   session_properties=properties))
    # As pipecat's example writes it: a kick-off message in the context, the persona in system_instruction.
    context = LLMContext([{"role": "developer", "content": "Say hello!"}])
    user_aggregator, assistant_aggregator = LLMContextAggregatorPair(context)
    worker = PipelineWorker(Pipeline([user_aggregator, llm, Speaker(), assistant_aggregator]),
                            params=PipelineParams())
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.ensure_future(runner.run())
    try:
        await worker.queue_frames([LLMRunFrame()])          # on_client_connected
        # The caller's audio comes after: the bot's first response.create is sent before any audio.
        await eventually(lambda: tap.connections and any(
            e.get("type") == "response.create" for e in tap.connections[0].client_events()), 15,
            "pipecat's response.create")
        call.start = time.monotonic()
        todo = Cues([(at, lambda frames=frames: worker.queue_frames([f() for f in frames])) for at, frames in cues])
        clock = await EngineClock.start(server.url)
        async for offset, chunk in paced(caller, 0.02):
            await todo.run_due(offset)
            await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
            if call.receive_ended_at is None and (llm._receive_task is None or llm._receive_task.done()):
                call.receive_ended_at = offset
        call.engine_behind_s = await clock.behind_s()
        await asyncio.sleep(0.3)
        call.receive_alive = llm._receive_task is not None and not llm._receive_task.done()
    finally:
        await worker.cancel()
        await asyncio.wait_for(running, 15)
        logger.remove(sink)
    return call


def pipecat_verdict(tap: WsTap, call: PipecatCall, flow: str) -> tuple[Verdict, list]:
    verdict = Verdict(f"pipecat {version('pipecat-ai')} ({flow})", engine_behind_s=call.engine_behind_s)
    timeline = ws_checks(verdict, one_connection(tap, verdict), call.start, call.heard)
    verdict.loop_alive(call.receive_alive, f"OpenAIRealtimeLLMService's receive task ended at "
                       f"{call.receive_ended_at} s of the call")
    verdict.check(not call.logged_errors, "pipecat logged no error", " | ".join(call.logged_errors[:4]))
    verdict.answered(timeline, "conversation.item.create", is_type("conversation.item.added"),
                     "conversation.item.added")
    verdict.answered(timeline, "response.create", is_type("response.created"), "response.created")
    return verdict, timeline


async def test_pipecat_llm_run_frame_on_connect(server, tap: WsTap, caller: bytes) -> None:
    from pipecat.services.openai.realtime.events import SessionProperties

    call = await pipecat_call(server, tap, caller, SessionProperties(), [])
    verdict, _ = pipecat_verdict(tap, call, "LLMRunFrame on connect")
    verdict.assert_works()


async def test_pipecat_interruption_frame(server, tap: WsTap, caller: bytes) -> None:
    from pipecat.frames.frames import InterruptionFrame
    from pipecat.services.openai.realtime.events import SessionProperties

    call = await pipecat_call(server, tap, caller, SessionProperties(), [(CALL_S / 2, [InterruptionFrame])])
    verdict, timeline = pipecat_verdict(tap, call, "an InterruptionFrame mid-call")
    verdict.answered(timeline, "conversation.item.truncate", is_type("conversation.item.truncated"),
                     "conversation.item.truncated")
    verdict.assert_works()


async def test_pipecat_local_turns(server, tap: WsTap, caller: bytes) -> None:
    from pipecat.frames.frames import InterruptionFrame, UserStartedSpeakingFrame, UserStoppedSpeakingFrame
    from pipecat.services.openai.realtime.events import AudioConfiguration, AudioInput, SessionProperties

    properties = SessionProperties(audio=AudioConfiguration(input=AudioInput(turn_detection=False)))
    cues = [(0.4 * CALL_S, [UserStartedSpeakingFrame, InterruptionFrame]), (0.6 * CALL_S, [UserStoppedSpeakingFrame])]
    call = await pipecat_call(server, tap, caller, properties, cues)
    verdict, timeline = pipecat_verdict(tap, call, "turn_detection=False, the user's speaking frames")
    verdict.answered(timeline, "input_audio_buffer.clear", is_type("input_audio_buffer.cleared"),
                     "input_audio_buffer.cleared")
    verdict.answered(timeline, "response.cancel", is_type("response.done", response__status="cancelled"),
                     "response.done (cancelled)")
    verdict.answered(timeline, "conversation.item.truncate", is_type("conversation.item.truncated"),
                     "conversation.item.truncated")
    verdict.answered(timeline, "input_audio_buffer.commit", is_type("input_audio_buffer.committed"),
                     "input_audio_buffer.committed")
    verdict.assert_works()


# ---- LiveKit Agents -----------------------------------------------------------------------------------------------

async def test_livekit_realtime_model(server, tap: WsTap, caller: bytes) -> None:
    """`openai.realtime.RealtimeModel()` with its default options; its RealtimeSession driven as an AgentSession
    drives it (audio frames in, generations out), without a LiveKit room."""
    from livekit import rtc
    from livekit.plugins import openai

    verdict = Verdict(f"LiveKit Agents {version('livekit-agents')} + livekit-plugins-openai "
                      f"{version('livekit-plugins-openai')} (RealtimeModel defaults)")
    model = openai.realtime.RealtimeModel(api_key=API_KEY, base_url=tap.base + "/v1", model=MODEL)
    session = model.session()
    start = time.monotonic()
    heard: list[tuple[float, float]] = []
    by_message: dict[str, float] = {}
    emitted: list[str] = []
    playing: list[asyncio.Future] = []
    session.on("error", lambda e: emitted.append(f"{e.error}: {getattr(e.error, 'body', '')}"[:300]))

    async def play(generation) -> None:
        async for message in generation.message_stream:
            by_message.setdefault(message.message_id, 0.0)
            async for frame in message.audio_stream:
                seconds = frame.samples_per_channel / frame.sample_rate
                heard.append((time.monotonic() - start, seconds))
                by_message[message.message_id] += seconds

    session.on("generation_created", lambda g: playing.append(asyncio.ensure_future(play(g))))

    async def reply(name: str) -> None:
        try:
            generation = await asyncio.wait_for(session.generate_reply(), 5)
            verdict.check(generation.user_initiated, name, "the generation is not marked user_initiated")
        except Exception as e:
            verdict.step(name, e)

    def truncate() -> None:
        message_id = list(by_message)[-1] if by_message else "none yet"
        session.truncate(message_id=message_id, modalities=["audio"],
                         audio_end_ms=int(1000 * by_message.get(message_id, 0.0)))

    new_persona = "You answer the phone for a flower shop."
    replies: list[asyncio.Future] = []
    try:
        await reply("generate_reply() before any audio")
        start = time.monotonic()
        todo = Cues([(0.3 * CALL_S, lambda: replies.append(asyncio.ensure_future(
                        reply("generate_reply() during the call")))),
                     (0.4 * CALL_S, lambda: session.update_instructions(new_persona)),
                     (0.5 * CALL_S, truncate),
                     (0.6 * CALL_S, session.interrupt)])
        clock = await EngineClock.start(server.url)
        async for offset, chunk in paced(caller, 0.02):
            await todo.run_due(offset)
            session.push_audio(rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                                              samples_per_channel=len(chunk) // 2))
        verdict.engine_behind_s = await clock.behind_s()
        await asyncio.gather(*replies)
        await asyncio.sleep(0.3)
        verdict.loop_alive(not session._main_atask.done(), f"RealtimeSession's main task ended: "
                           f"{_ended(session._main_atask)}")
    finally:
        await session.aclose()
        await model.aclose()
        for task in playing:
            task.cancel()
    timeline = ws_checks(verdict, one_connection(tap, verdict), start, heard)
    verdict.check(not emitted, "the session emitted no error", " | ".join(emitted[:4]))
    verdict.answered(timeline, "response.create", is_type("response.created"), "response.created")
    verdict.check(any(from_server and t > 0.4 * CALL_S and e.get("type") == "session.updated"
                      and e["session"].get("instructions") == new_persona for t, from_server, e in timeline),
                  "update_instructions() mid-call → session.updated with the new instructions",
                  "no session.updated carries them")
    verdict.answered(timeline, "conversation.item.truncate", is_type("conversation.item.truncated"),
                     "conversation.item.truncated")
    verdict.answered(timeline, "response.cancel", is_type("response.done", response__status="cancelled"),
                     "response.done (cancelled)")
    verdict.assert_works()


# ---- the OpenAI Agents SDK for Python --------------------------------------------------------------------------

async def test_agents_sdk_python_realtime_runner(server, tap: WsTap, caller: bytes) -> None:
    """A `RealtimeAgent` with a function tool and a handoff, as the SDK's quickstart writes one, run by a
    `RealtimeRunner` with its default settings over the WebSocket; mid-call the user's text (`send_message`), the
    handoff's agent (`update_agent`, new instructions) and an `interrupt()`."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner, realtime_handoff

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    billing = RealtimeAgent(name="Billing", instructions="You answer billing questions for a flower shop.")
    agent = RealtimeAgent(name="Assistant", instructions=PERSONA, tools=[get_weather],
                          handoffs=[realtime_handoff(billing)])
    verdict = Verdict(f"OpenAI Agents SDK for Python {version('openai-agents')} (RealtimeRunner defaults)")
    runner = RealtimeRunner(starting_agent=agent, config={"model_settings": {"model_name": MODEL}})
    session = await runner.run(model_config={"url": tap.base.replace("http", "ws", 1) + "/v1/realtime",
                                             "api_key": API_KEY})
    heard: list[tuple[float, float]] = []
    emitted: list[str] = []
    start = time.monotonic()

    async def listen() -> None:
        async for event in session:
            if event.type == "audio":
                heard.append((time.monotonic() - start, len(event.audio.data) / (2 * RATE)))
            elif event.type == "error":
                emitted.append(str(event.error)[:300])
            elif event.type == "raw_model_event" and event.data.type in ("error", "exception"):
                emitted.append(repr(event.data)[:300])

    async with session:
        listener = asyncio.ensure_future(listen())
        start = time.monotonic()
        todo = Cues([(0.3 * CALL_S, lambda: session.send_message("What is the weather like in Paris?")),
                     (0.45 * CALL_S, lambda: session.update_agent(billing)),
                     (0.6 * CALL_S, session.interrupt)])
        clock = await EngineClock.start(server.url)
        async for offset, chunk in paced(caller, 0.02):
            await todo.run_due(offset)
            await session.send_audio(chunk)
        verdict.engine_behind_s = await clock.behind_s()
        await asyncio.sleep(0.3)
        verdict.loop_alive(not listener.done(), f"`async for event in session` ended: {_ended(listener)}")
    listener.cancel()
    timeline = ws_checks(verdict, one_connection(tap, verdict), start, heard)
    verdict.check(not emitted, "the session emitted no error", " | ".join(emitted[:4]))
    verdict.answered(timeline, "conversation.item.create", is_type("conversation.item.added"),
                     "conversation.item.added")
    verdict.answered(timeline, "response.create", is_type("response.created"), "response.created")
    verdict.check(any(from_server and t > 0.45 * CALL_S and e.get("type") == "session.updated"
                      and e["session"].get("instructions") == billing.instructions for t, from_server, e in timeline),
                  "update_agent() mid-call → session.updated with the new agent's instructions",
                  "no session.updated carries them")
    verdict.answered(timeline, "conversation.item.truncate", is_type("conversation.item.truncated"),
                     "conversation.item.truncated")
    verdict.answered(timeline, "response.cancel", is_type("response.done", response__status="cancelled"),
                     "response.done (cancelled)")
    verdict.assert_works()


# ---- the OpenAI Agents SDK for JavaScript, in Chromium ---------------------------------------------------------

@pytest.fixture(scope="module")
def bundle() -> Path:
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    return agents_bundle()


async def test_agents_sdk_js_webrtc(server, bundle: Path, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright

    ensure_ice_host_address()
    mic, _ = espeak_wav(tmp_path, "Hello! Could you tell me what the weather is like today? I am planning a walk "
                        "in the park this afternoon.", rate=48000, name="mic")
    verdict = Verdict("OpenAI Agents SDK for JavaScript (@openai/agents-realtime, WebRTC in Chromium)")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as http:
        # The app's own backend mints the browser's ephemeral key, as the SDK requires in a browser.
        async with http.post(server.url + "/v1/realtime/client_secrets", headers=auth, json={
                "session": {"type": "realtime", "model": MODEL, "instructions": PERSONA}}) as r:
            body = await r.text()
            assert r.status == 200, f"POST /v1/realtime/client_secrets: HTTP {r.status} {body[:300]}"
            secret = (await r.json())["value"]
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=chromium_args(mic))
            try:
                page = await browser.new_page()
                console: list[str] = []
                page.on("console", lambda m: console.append(m.text))

                async def serve(route) -> None:
                    js = route.request.url.endswith(".js")
                    await route.fulfill(path=str(bundle if js else PAGE),
                                        content_type="text/javascript" if js else "text/html")

                # The page is served at the server's origin, as the server's own page is.
                await page.route(server.url + "/__agents/**", serve)
                await page.goto(server.url + "/__agents/page.html")
                t0 = await page.evaluate("performance.now()")
                try:
                    await asyncio.wait_for(page.evaluate("cfg => startAgent(cfg)", {
                        "apiKey": secret, "url": server.url + "/v1/realtime/calls", "model": MODEL,
                        "instructions": PERSONA}), 30)
                except Exception as e:
                    verdict.step("session.connect()", e)
                    verdict.assert_works()
                connected_s = (await page.evaluate("performance.now()") - t0) / 1000
                timed_out = [m for m in console if "Timed out waiting for session.updated" in m]
                verdict.check(not timed_out, "session.connect() resolves at the session.updated ack",
                              f"the SDK gave up waiting for it and went on after {connected_s:.1f} s")
                t0 = await page.evaluate("performance.now()")
                start = time.monotonic()
                stats = [(0.0, await page.evaluate("audioStats()"))]
                todo = Cues([(CALL_S / 2, lambda: page.evaluate("window.session.interrupt()"))])
                clock = await EngineClock.start(server.url)
                while (offset := time.monotonic() - start) < CALL_S:
                    await asyncio.sleep(0.5)
                    await todo.run_due(offset)
                    stats.append((time.monotonic() - start, await page.evaluate("audioStats()")))
                verdict.engine_behind_s = await clock.behind_s()
                rec = await page.evaluate("window.rec")
                last = stats[-1][1]
                async with http.get(f"{server.url}/v1/realtime/calls/{last['callId']}", headers=auth) as r:
                    call = await r.json() if r.status == 200 else {"status": r.status}
                await page.evaluate("window.session.close()")
            finally:
                await browser.close()

    # Heard: an interval whose mean level is above -40 dBFS (Chromium's totalAudioEnergy sums level² × seconds).
    heard = [(t, (b["received"] - a["received"]) / 48000) for (ta, a), (t, b) in zip(stats, stats[1:])
             if b["energy"] - a["energy"] >= 0.01 ** 2 * (t - ta)]
    sent = [(t, (b["sent"] - a["sent"]) * 0.02) for (_, a), (t, b) in zip(stats, stats[1:])]
    verdict.audio_out(heard, CALL_S)
    verdict.audio_in(sent, CALL_S)
    frames_in = ((call.get("conversation") or {}).get("frames_in") or 0)
    verdict.check(frames_in * 0.08 >= verdict.least_audio_s(CALL_S), "the server took the microphone's audio",
                  f"{frames_in * 0.08:.1f} s of it{verdict.behind()}; the call's stats: {str(call)[:200]}")
    verdict.loop_alive(last["status"] == "connected" and last["channel"] == "open",
                       f"the transport is {last['status']}, its data channel {last['channel']}")
    verdict.check(not rec["errors"], "the session emitted no error", " | ".join(rec["errors"][:4]))
    timeline = sorted([((e["at"] - t0) / 1000, True, e["event"]) for e in rec["events"]]
                      + [((s["at"] - t0) / 1000, False, ev) for s in rec["sent"] if (ev := json_event(s["text"]))],
                      key=lambda x: x[0])
    verdict.no_errors(timeline)
    verdict.schema(timeline)
    verdict.answered(timeline, "session.update", is_type("session.updated"), "session.updated")
    verdict.answered(timeline, "response.cancel", is_type("response.done", response__status="cancelled"),
                     "response.done (cancelled)")
    verdict.answered(timeline, "output_audio_buffer.clear", is_type("output_audio_buffer.cleared"),
                     "output_audio_buffer.cleared")
    verdict.assert_works()
