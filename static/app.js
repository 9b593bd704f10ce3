// The browser client: one WebRTC call to POST /v1/realtime/calls, the mic on an Opus track, the model's voice on
// the remote track, and the Realtime events on the `oai-events` data channel. No build step, no dependencies.
//
// When the server has API keys, the page never holds one: each call is opened with an ephemeral client secret
// (`ek_…`, docs/protocol.md §7), which the page gets from the deployment's token endpoint (`?token_url=/path`, a
// same-origin backend route that mints one with the server's API key and answers the mint's JSON), or which the
// operator pastes (one minted with curl). A secret opens one call; it also reads the voice list and the ICE servers.

const $ = (id) => document.getElementById(id);

const ui = {
  persona: $("persona"), voice: $("voice"), secret: $("secret"), secretField: $("secret-field"), start: $("start"),
  stop: $("stop"),
  state: $("state"), message: $("message"), remote: $("remote"), transcript: $("transcript"),
  micLevel: $("mic-level"), micDb: $("mic-db"), modelLevel: $("model-level"), modelDb: $("model-db"),
  serverInfo: $("server-info"),
};

// Everything a test (or a curious user in the console) may want to read.
const call = {
  pc: null, dc: null, mic: null, location: null, audioCtx: null, timers: [], secret: null, keysRequired: false,
  state: "idle", transcript: "", events: [], serverStats: null, lastStats: null, error: null,
};
window.personaplex = call;

// Only a path on this page's own origin: a link must not send the page's requests elsewhere.
const tokenUrl = (() => {
  const given = new URLSearchParams(location.search).get("token_url");
  if (!given) return null;
  const url = new URL(given, location.origin);
  return url.origin === location.origin ? url.href : null;
})();

function authHeaders(secret) {
  return secret ? { Authorization: `Bearer ${secret}` } : {};
}

function sessionConfig() {
  // Only what the user chose: an empty field leaves the server's default (or the secret's bound session).
  const session = { type: "realtime", stats_interval_s: 1 };   // the call's stats panel reads `session.stats`
  const persona = ui.persona.value.trim();
  if (persona) session.instructions = persona;
  if (ui.voice.value) session.voice = ui.voice.value;
  return session;
}

async function clientSecret() {
  // The credential for one call: a secret from the token endpoint, or the pasted one; none when the server has no
  // keys (the call is then refused with 401, and the message says what to do).
  if (tokenUrl) {
    const res = await fetch(tokenUrl, {
      method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ session: sessionConfig() }),
    });
    if (!res.ok) throw new Error(`The token endpoint did not give a client secret: ${await errorText(res)}`);
    const body = await res.json();
    const value = body.value || body.client_secret?.value;
    if (!value) throw new Error("The token endpoint's answer has no client secret (`value`).");
    return value;
  }
  const pasted = ui.secret.value.trim();
  ui.secret.value = "";                                  // spent by this call either way
  if (pasted && !pasted.startsWith("ek_")) {
    throw new Error("Paste a client secret (ek_…), minted with POST /v1/realtime/client_secrets and the server's " +
      "API key; the API key itself never belongs in a page.");
  }
  return pasted || null;
}

function refusalMessage(status, code, text) {
  if (code === "client_secret_used") return "That client secret was already used (each opens one call): get a new one.";
  if (code === "client_secret_expired") return "That client secret has expired: get a new one.";
  if (status === 401) {
    return tokenUrl ? `The server refused the token endpoint's client secret: ${text}`
      : "The server needs a client secret (ek_…) for each call: paste one above (minted with its API key) and " +
        "press Start again, or open this page with ?token_url= pointing at your backend's token route.";
  }
  return `The server refused the call: ${text}`;
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

async function errorBody(res) {
  try {
    const body = await res.json();
    return { code: body?.error?.code, text: body?.error?.message || JSON.stringify(body) };
  } catch {
    return { code: undefined, text: `${res.status} ${res.statusText}` };
  }
}

async function errorText(res) {
  return (await errorBody(res)).text;
}

function showSecretField() {
  ui.secretField.hidden = !call.keysRequired || Boolean(tokenUrl);
}

async function loadVoices(secret = null) {
  try {
    const res = await fetch("/v1/voices", { headers: authHeaders(secret) });
    if (res.status === 401 && !secret) {              // the server has API keys: a call needs a client secret
      call.keysRequired = true;
      showSecretField();
      ui.voice.replaceChildren(new Option("(the server's default voice)", ""));
      return;
    }
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

async function iceServers(secret) {
  try {
    const res = await fetch("/v1/realtime/webrtc-config", { headers: authHeaders(secret) });
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
    call.secret = await clientSecret();
    const pc = new RTCPeerConnection({ iceServers: await iceServers(call.secret) });
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
    form.set("session", JSON.stringify(sessionConfig()));
    const res = await fetch("/v1/realtime/calls", { method: "POST", body: form, headers: authHeaders(call.secret) });
    if (res.status === 429) {
      throw new Error(`The server is full: every conversation slot is taken. Try again in a moment. (${await errorText(res)})`);
    }
    if (!res.ok) {
      const { code, text } = await errorBody(res);
      throw new Error(refusalMessage(res.status, code, text));
    }
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
  // A call opened with a client secret ends when the peer connection closes (the secret cannot DELETE it).
  if (call.location && !call.secret) {
    fetch(call.location, { method: "DELETE", keepalive: true }).catch(() => {});
  }
  call.location = null;
  call.secret = null;
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

ui.secret.addEventListener("change", () => {
  const pasted = ui.secret.value.trim();
  if (pasted.startsWith("ek_")) loadVoices(pasted);    // reading the voices does not spend it
});
ui.start.addEventListener("click", start);
ui.stop.addEventListener("click", () => hangUp("ended"));
window.addEventListener("pagehide", () => hangUp("ended"));
setState("idle");
loadVoices();
loadServerInfo();
