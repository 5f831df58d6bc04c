// The captions page: microphone → /v1/stream, or /?watch=NAME → /v1/captions?source=NAME.
//
// Main thread. The AudioWorklet (worklet.js) does capture and 16 kHz conversion; this file
// owns the websocket, the page state and the messages a user sees when something fails.

import { CaptionView } from "./caption-view.js";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const watchName = query.get("watch");
// A daemon with [auth] token: open the page as /?token=… and the sockets carry it along.
const token = query.get("token");

const ui = {
  state: $("state"),
  notice: $("notice"),
  level: $("level"),
  clock: $("clock"),
  start: $("start"),
  stop: $("stop"),
  txt: $("download-txt"),
  vtt: $("download-vtt"),
  title: $("title"),
};
const view = new CaptionView({ scroller: $("captions"), transcript: $("transcript"), live: $("live") });

// The one running session: its socket, audio graph and counters; null when idle.
let session = null;

// A websocket URL on the page's own host, relative to the page so a reverse proxy may mount
// the daemon under a prefix; wss: when the page came over https:.
function endpoint(path, params) {
  const url = new URL(path, location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  url.search = "";
  for (const [key, value] of Object.entries(params)) url.searchParams.set(key, value);
  if (token) url.searchParams.set("token", token);
  return url.href;
}

function setState(state, label) {
  ui.state.dataset.state = state;
  ui.state.textContent = label;
  const busy = !["idle", "done", "error"].includes(state);
  ui.start.disabled = busy;
  ui.stop.disabled = !["live", "watching"].includes(state);
}

function showNotice(text) {
  ui.notice.textContent = text;
  ui.notice.hidden = false;
}

function setClock(ms) {
  ui.clock.dataset.ms = String(ms);
  ui.clock.textContent = `${(ms / 1000).toFixed(1)} s`;
}

function setLevel(dbfs) {
  // -60 dBFS (room noise) … 0 dBFS (full scale) across the meter.
  const fraction = Math.min(1, Math.max(0, (dbfs + 60) / 60));
  ui.level.style.width = `${(fraction * 100).toFixed(1)}%`;
}

function micMessage(err) {
  switch (err.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "Microphone access was denied. Allow the microphone for this site (the icon in the address bar) and press Start again.";
    case "NotFoundError":
    case "OverconstrainedError":
      return "No microphone was found. Connect one and press Start again.";
    case "NotReadableError":
      return "The microphone could not be opened: another application may be using it.";
    default:
      return `The microphone could not be opened: ${err.name}: ${err.message}`;
  }
}

// What the user reads when a socket closes other than after `done`.
function closeMessage(s, event) {
  if (s.failure) return s.failure;
  if (s.refusal) return `The daemon refused the session: ${s.refusal}`;
  const err = s.error;
  if (err && err.code === "no_such_source") {
    return `There is no caption source named "${watchName}" on this daemon. (${err.code}: ${err.message})`;
  }
  if (err) {
    const what = s.ready ? "The daemon ended the session" : "The daemon refused the session";
    return `${what}: ${err.message} (${err.code}, close ${event.code})`;
  }
  if (!s.opened) {
    return `Cannot reach the captiond daemon at ${s.url}. Is "captiond serve" running and reachable?`;
  }
  if (event.code === 1001) return "The daemon is shutting down (close 1001).";
  return `The connection to the daemon was lost (close ${event.code}).`;
}

// A handshake the daemon refuses (token, origin) reaches a page only as close 1006; the same
// request over plain HTTP gets the daemon's answer.
async function refusalOf(url) {
  try {
    const resp = await fetch(url.replace(/^ws/, "http"), { cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      return `${(await resp.text()).trim()} (HTTP ${resp.status})`;
    }
  } catch (err) {
    // Unreachable: closeMessage says so.
  }
  return null;
}

function openSocket(url, onReady) {
  const s = { url, ws: new WebSocket(url), opened: false, ready: false, done: null, error: null };
  s.ws.binaryType = "arraybuffer";
  s.ws.onopen = () => {
    s.opened = true;
  };
  s.ws.onmessage = (event) => {
    const msg = JSON.parse(event.data);
    if (msg.type === "ready") {
      s.ready = true;
      onReady(s);
    } else if (msg.type === "error") {
      s.error = msg;
    } else if (msg.type === "done") {
      s.done = msg;
    } else if (view.handle(msg)) {
      ui.txt.disabled = ui.vtt.disabled = view.finals.length === 0;
      if (watchName && "end_ms" in msg) setClock(msg.end_ms);
    }
  };
  s.ws.onclose = async (event) => {
    if (!s.opened) s.refusal = await refusalOf(url);
    if (session === s) finish(s, event);
  };
  return s;
}

function finish(s, event) {
  session = null;
  releaseAudio(s);
  setLevel(-Infinity);
  if (s.done) {
    setState("done", `done · ${s.done.segments} segments`);
  } else if (s.stopping && watchName) {
    setState("idle", "stopped");
  } else {
    setState("error", s.error ? s.error.code : "disconnected");
    showNotice(closeMessage(s, event));
  }
}

async function openMicrophone() {
  if (!window.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
    throw new Error(
      "Browsers allow the microphone only on https:// pages or on http://localhost. " +
        "Serve this page over HTTPS (captiond serve --tls-cert … --tls-key …) or open it on the daemon's machine.",
    );
  }
  try {
    // Raw audio: the browser's voice processing is tuned for calls, not recognition.
    return await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: false, noiseSuppression: false, autoGainControl: false, channelCount: 1 },
    });
  } catch (err) {
    throw new Error(micMessage(err));
  }
}

async function startAudio(s, stream) {
  const context = new AudioContext({ latencyHint: "interactive" });
  await context.audioWorklet.addModule(new URL("worklet.js", import.meta.url));
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "captiond-capture", { numberOfOutputs: 1, outputChannelCount: [1] });
  s.sentMs = 0;
  node.port.onmessage = (event) => {
    const msg = event.data;
    if (msg.type === "audio" && s.ws.readyState === WebSocket.OPEN) {
      s.ws.send(msg.pcm);
      s.sentMs += (msg.pcm.byteLength / 2 / 16000) * 1000;
      setClock(Math.round(s.sentMs));
      setLevel(msg.dbfs);
    } else if (msg.type === "flushed") {
      s.flushed?.();
    }
  };
  source.connect(node);
  // The node outputs silence; connected so the graph is pulled and process() runs.
  node.connect(context.destination);
  await context.resume();
  s.audio = { context, stream, node };
}

function releaseAudio(s) {
  s.stream?.getTracks().forEach((track) => track.stop());
  if (s.audio) {
    s.audio.node.port.onmessage = null;
    s.audio.context.close();
    s.audio = null;
  }
}

async function startMicrophone() {
  view.clear();
  ui.notice.hidden = true;
  setClock(0);
  setState("mic", "asking for the microphone");
  let stream;
  try {
    stream = await openMicrophone();
  } catch (err) {
    setState("error", "no microphone");
    showNotice(err.message);
    return;
  }
  setState("connecting", "connecting");
  session = openSocket(endpoint("v1/stream", { sample_rate: "16000", encoding: "pcm_s16le" }), (s) =>
    startAudio(s, stream).then(
      () => setState("live", "live"),
      (err) => {
        s.failure = `Audio capture failed: ${err.message}`;
        s.ws.close(1000);
      },
    ),
  );
  session.stream = stream;
}

async function stopMicrophone() {
  const s = session;
  s.stopping = true;
  setState("stopping", "finishing");
  // The worklet's partial last chunk goes out before {"type":"end"}, then the microphone is
  // released at once; the daemon's last finals and `done` arrive on the socket afterwards.
  if (s.audio) {
    await new Promise((resolve) => {
      s.flushed = resolve;
      s.audio.node.port.postMessage("flush");
    });
  }
  releaseAudio(s);
  setLevel(-Infinity);
  if (s.ws.readyState === WebSocket.OPEN) s.ws.send(JSON.stringify({ type: "end" }));
}

function startWatching() {
  view.clear();
  ui.notice.hidden = true;
  setState("connecting", "connecting");
  session = openSocket(endpoint("v1/captions", { source: watchName }), () => {});
  // Viewers send nothing; the socket being open is all "watching" means.
  session.ws.addEventListener("open", () => setState("watching", "watching"));
}

function stopWatching() {
  session.stopping = true;
  session.ws.close(1000);
}

function download(text, extension, type) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], { type }));
  const stamp = new Date().toISOString().slice(0, 16).replace(/[-:T]/g, "");
  link.download = `captions-${stamp}.${extension}`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

ui.txt.addEventListener("click", () => download(view.toText(), "txt", "text/plain;charset=utf-8"));
ui.vtt.addEventListener("click", () => download(view.toVtt(), "vtt", "text/vtt;charset=utf-8"));

if (watchName) {
  document.body.classList.add("watching");
  ui.title.textContent = `Captions · ${watchName}`;
  document.title = `${watchName} · captiond`;
  ui.start.textContent = "Watch";
  ui.start.addEventListener("click", startWatching);
  ui.stop.addEventListener("click", stopWatching);
  startWatching();
} else {
  ui.start.addEventListener("click", startMicrophone);
  ui.stop.addEventListener("click", stopMicrophone);
  setState("idle", "ready to start");
}
