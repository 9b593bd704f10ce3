// The browser client: one WebRTC call to POST /v1/realtime/calls, the mic on an Opus track, the model's voice on
// the remote track, and the Realtime events on the `oai-events` data channel. No build step, no dependencies.

const $ = (id) => document.getElementById(id);

const ui = {
  persona: $("persona"), voice: $("voice"), apikey: $("apikey"), start: $("start"), stop: $("stop"),
  state: $("state"), message: $("message"), remote: $("remote"), transcript: $("transcript"),
  micLevel: $("mic-level"), micDb: $("mic-db"), modelLevel: $("model-level"), modelDb: $("model-db"),
  serverInfo: $("server-info"),
};

// Everything a test (or a curious user in the console) may want to read.
const call = {
  pc: null, dc: null, mic: null, location: null, audioCtx: null, timers: [],
  state: "idle", transcript: "", events: [], serverStats: null, lastStats: null, error: null,
};
window.personaplex = call;

function authHeaders() {
  const key = ui.apikey.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setState(state) {
  call.state = state;
  ui.state.textContent = state;
  ui.state.dataset.state = state;
  const busy = state !== "idle" && state !== "ended" && state !== "failed";
  ui.start.disabled = busy;
  ui.stop.disabled = !busy;
  ui.persona.disabled = busy;
  ui.voice.disabled = busy;
}

function showMessage(text, kind = "error") {
  ui.message.hidden = !text;
  ui.message.textContent = text || "";
  ui.message.dataset.kind = kind;
  if (kind === "error" && text) call.error = text;
}

async function errorText(res) {
  try {
    const body = await res.json();
    return body?.error?.message || JSON.stringify(body);
  } catch {
    return `${res.status} ${res.statusText}`;
  }
}

async function loadVoices() {
  try {
    const res = await fetch("/v1/voices", { headers: authHeaders() });
    if (!res.ok) throw new Error(await errorText(res));
    const body = await res.json();
    const list = Array.isArray(body) ? body : body.data || body.voices || [];
    const names = list.map((v) => (typeof v === "string" ? v : v.id || v.name)).filter(Boolean);
    const preferred = body.default || list.find((v) => v && v.default)?.id;
    ui.voice.replaceChildren(new Option("(no voice prompt)", ""));
    for (const name of names) ui.voice.add(new Option(name, name, false, name === preferred));
    if (!names.length) ui.voice.options[0].textContent = "(the server has no voices)";
  } catch (err) {
    ui.voice.replaceChildren(new Option("(voices unavailable)", ""));
    showMessage(`Could not load the voice list: ${err.message}`, "warning");
  }
}

async function loadServerInfo() {
  try {
    const res = await fetch("/health");
    if (!res.ok) return;
    const h = await res.json();
    const used = h.sessions_in_use ?? h.sessions?.in_use;
    const max = h.max_sessions ?? (h.sessions ? h.sessions.in_use + h.sessions.free : undefined);
    const model = h.tiny ? "the built-in tiny test model (random weights: expect noise, not speech)"
      : h.random_weights ? `${h.model} (PersonaPlex-7B's shape with random weights, for sizing hardware: expect noise)`
      : h.model;
    ui.serverInfo.textContent = used !== undefined && max !== undefined
      ? `Server: ${used} of ${max} conversations in use` + (model ? ` · model: ${model}` : "") : "";
  } catch { /* the footer is informative only */ }
}

async function iceServers() {
  try {
    const res = await fetch("/v1/realtime/webrtc-config", { headers: authHeaders() });
    if (res.ok) return (await res.json()).ice_servers || [];
  } catch { /* none: host candidates only */ }
  return [];
}

function micErrorMessage(err) {
  switch (err.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was denied. Allow the microphone for this site (the icon in the address bar) and press Start again.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Plug one in (or pick one in the system settings) and press Start again.";
    case "NotReadableError":
      return "The microphone is in use by another application or could not be opened.";
    default:
      return `The microphone could not be opened: ${err.message}`;
  }
}

function meter(stream, fill, label) {
  const ctx = call.audioCtx;
  const source = ctx.createMediaStreamSource(stream);
  const analyser = ctx.createAnalyser();
  analyser.fftSize = 1024;
  source.connect(analyser);
  const data = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    analyser.getFloatTimeDomainData(data);
    let sum = 0;
    for (const x of data) sum += x * x;
    const db = 10 * Math.log10(sum / data.length + 1e-12);
    fill.style.width = `${Math.max(0, Math.min(100, (db + 60) * (100 / 60)))}%`;
    label.textContent = db < -90 ? "silent" : `${db.toFixed(0)} dBFS`;
  }, 100);
  call.timers.push(timer);
}

function waitForIceGathering(pc, timeoutMs) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => { pc.removeEventListener("icegatheringstatechange", check); resolve(); };
    const check = () => { if (pc.iceGatheringState === "complete") done(); };
    pc.addEventListener("icegatheringstatechange", check);
    setTimeout(done, timeoutMs);
  });
}

function onServerEvent(event) {
  call.events.push(event.type);
  switch (event.type) {
    case "response.output_audio_transcript.delta":
    case "response.audio_transcript.delta":
      call.transcript += event.delta;
      ui.transcript.textContent = call.transcript;
      ui.transcript.scrollTop = ui.transcript.scrollHeight;
      break;
    case "session.stats":
      call.serverStats = event;
      break;
    case "error":
      showMessage(`Server: ${event.error?.message || "error"} (${event.error?.code || "?"})`);
      break;
    case "session.closed":
      showMessage(`The server closed the conversation (${event.reason || "closed"}).`, "info");
      break;
    default:
      break;
  }
}

function fmt(value, unit, digits = 0) {
  return value === undefined || value === null || Number.isNaN(value) ? "–" : `${value.toFixed(digits)} ${unit}`;
}

function pct(lost, received) {
  const total = (lost || 0) + (received || 0);
  return total ? `${((100 * (lost || 0)) / total).toFixed(1)} % (${lost || 0} of ${total})` : "–";
}

async function pollStats() {
  if (!call.pc) return;
  const report = await call.pc.getStats();
  const s = { rtt: undefined, inbound: null, remoteInbound: null };
  report.forEach((r) => {
    if (r.type === "candidate-pair" && r.state === "succeeded" && (r.nominated || r.selected)) s.rtt = r.currentRoundTripTime;
    if (r.type === "inbound-rtp" && r.kind === "audio") s.inbound = r;
    if (r.type === "remote-inbound-rtp" && r.kind === "audio") s.remoteInbound = r;
  });
  call.lastStats = s;
  const inb = s.inbound;
  $("stat-rtt").textContent = fmt(s.rtt !== undefined ? s.rtt * 1000 : undefined, "ms");
  if (inb) {
    $("stat-loss-in").textContent = pct(inb.packetsLost, inb.packetsReceived);
    const jb = inb.jitterBufferEmittedCount ? (1000 * inb.jitterBufferDelay) / inb.jitterBufferEmittedCount : undefined;
    $("stat-jb-client").textContent = `${fmt(jb, "ms")}, jitter ${fmt((inb.jitter || 0) * 1000, "ms", 1)}`;
    const seconds = (inb.totalSamplesReceived || 0) / 48000;
    $("stat-received").textContent = `${seconds.toFixed(1)} s, concealed ${fmt(
      (100 * (inb.concealedSamples || 0)) / Math.max(1, inb.totalSamplesReceived || 0), "%", 1)}`;
  }
  const srv = call.serverStats;
  if (srv) {
    const jb = srv.input || {};
    $("stat-loss-out").textContent = pct(srv.rtp?.packets_lost, srv.rtp?.packets_received);
    $("stat-jb-server").textContent = `${fmt(jb.depth_ms, "ms")} (target ${fmt(jb.target_ms, "ms")}, underruns ${jb.underruns ?? "–"})`;
    const out = srv.output || {};
    $("stat-playout").textContent = `${fmt(out.depth_ms, "ms")} (underruns ${out.underruns ?? "–"})`;
    const lat = srv.latency_ms || {};
    const inMs = lat.input_added?.p50, outMs = lat.output_added?.p50;
    $("stat-latency").textContent = inMs === undefined || inMs === null || outMs === undefined || outMs === null
      ? "–" : `${fmt(inMs, "ms")} in + ${fmt(outMs, "ms")} out`;
    const eng = srv.engine || {};
    $("stat-tick").textContent = `${fmt(eng.tick_ms_p50, "ms", 1)} p50, ${fmt(eng.tick_ms_p99, "ms", 1)} p99`;
  } else if (s.remoteInbound) {
    $("stat-loss-out").textContent = fmt((s.remoteInbound.fractionLost || 0) * 100, "%", 1);
  }
}

async function start() {
  showMessage("");
  call.error = null;
  call.transcript = "";
  call.events = [];
  call.serverStats = null;
  ui.transcript.textContent = "";
  if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
    showMessage("This page needs a secure origin for the microphone: open it over https, or on http://localhost.");
    return;
  }
  setState("requesting microphone");
  try {
    call.mic = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (err) {
    setState("failed");
    showMessage(micErrorMessage(err));
    return;
  }
  call.audioCtx = new AudioContext();
  meter(call.mic, ui.micLevel, ui.micDb);

  setState("connecting");
  try {
    const pc = new RTCPeerConnection({ iceServers: await iceServers() });
    call.pc = pc;
    for (const track of call.mic.getAudioTracks()) pc.addTrack(track, call.mic);
    pc.ontrack = (e) => {
      const stream = e.streams[0] || new MediaStream([e.track]);
      ui.remote.srcObject = stream;
      ui.remote.play().catch(() => showMessage("Press Start again to allow audio playback.", "warning"));
      meter(stream, ui.modelLevel, ui.modelDb);
    };
    pc.onconnectionstatechange = () => {
      if (pc !== call.pc) return;
      if (pc.connectionState === "connected") setState("connected");
      if (pc.connectionState === "failed") {
        showMessage("The connection failed (no network path to the server). A TURN server may be needed.");
        hangUp("failed");
      }
      if (pc.connectionState === "disconnected") setState("reconnecting");
    };
    const dc = pc.createDataChannel("oai-events");
    call.dc = dc;
    dc.onmessage = (e) => {
      try { onServerEvent(JSON.parse(e.data)); } catch { /* not JSON: ignore */ }
    };

    await pc.setLocalDescription(await pc.createOffer());
    await waitForIceGathering(pc, 3000);

    const form = new FormData();
    form.set("sdp", pc.localDescription.sdp);
    const session = { type: "realtime", instructions: ui.persona.value.trim() };
    if (ui.voice.value) session.voice = ui.voice.value;
    form.set("session", JSON.stringify(session));
    const res = await fetch("/v1/realtime/calls", { method: "POST", body: form, headers: authHeaders() });
    if (res.status === 429) {
      throw new Error(`The server is full: every conversation slot is taken. Try again in a moment. (${await errorText(res)})`);
    }
    if (res.status === 401) throw new Error("The server needs an API key: enter it above and press Start again.");
    if (!res.ok) throw new Error(`The server refused the call: ${await errorText(res)}`);
    call.location = res.headers.get("Location");
    await pc.setRemoteDescription({ type: "answer", sdp: await res.text() });
    call.timers.push(setInterval(() => pollStats().catch(() => {}), 1000));
    loadServerInfo();
  } catch (err) {
    showMessage(err.message);
    hangUp("failed");
  }
}

function hangUp(finalState = "ended") {
  if (call.location) {
    fetch(call.location, { method: "DELETE", headers: authHeaders(), keepalive: true }).catch(() => {});
    call.location = null;
  }
  for (const t of call.timers) clearInterval(t);
  call.timers = [];
  if (call.pc) call.pc.close();
  call.pc = null;
  call.dc = null;
  if (call.mic) for (const t of call.mic.getTracks()) t.stop();
  call.mic = null;
  if (call.audioCtx) call.audioCtx.close();
  call.audioCtx = null;
  ui.remote.srcObject = null;
  for (const [fill, label] of [[ui.micLevel, ui.micDb], [ui.modelLevel, ui.modelDb]]) {
    fill.style.width = "0%";
    label.textContent = "–";
  }
  setState(finalState);
  loadServerInfo();
}

ui.apikey.value = localStorage.getItem("personaplex.apikey") || "";
ui.apikey.addEventListener("change", () => {
  localStorage.setItem("personaplex.apikey", ui.apikey.value.trim());
  loadVoices();
});
ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", () => hangUp("ended"));
window.addEventListener("pagehide", () => hangUp("ended"));
setState("idle");
loadVoices();
loadServerInfo();
