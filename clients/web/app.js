// The captions page: microphone → /v1/stream, or /?watch=NAME → /v1/captions?source=NAME.
//
// Main thread. This file owns what a user sees of a session and wires the parts together: the
// microphone (capture.js) keeps recording through a dropped connection or a daemon restart,
// the Link (link.js) connects again and resumes the daemon's session, and the audio the daemon
// did not get is sent again from the byte it names, so no speech is lost. The transcript
// (caption-view.js, transcript.js) outlives sessions; settings.js owns the display controls.

import { CaptionView } from "./caption-view.js";
import { PcmBuffer, bytesToMs, msToBytes, openMicrophone, prepareAudio, startCapture } from "./capture.js";
import { Link } from "./link.js";
import { initSettings } from "./settings.js";

const $ = (id) => document.getElementById(id);
const query = new URLSearchParams(location.search);
const watchName = query.get("watch");
// A daemon with [auth] token: open the page as /?token=… and the sockets carry it along.
const token = query.get("token");
// Audio captured while no session could take it, sent to a new session: at most this much
// (more would keep its captions that far behind).
const FRESH_RESEND_MS = 50_000;
// The daemon refuses audio sent faster than its `ready` says (`audio_burst_s` ahead of
// `max_audio_speed` times real time, counted anew for a session taken back from its journal):
// a backlog is sent at this share of that, counted from the connection (the page's clock
// starts after the daemon's), so it is paced instead of refused as rate_limited.
const SEND_SHARE = 0.8;
const INFO_NOTICE_MS = 15_000;
// States in which no session runs: Start is offered.
const IDLE_STATES = ["idle", "done", "stopped", "error"];

const ui = {
  state: $("state"),
  notice: $("notice"),
  level: $("level"),
  clock: $("clock"),
  start: $("start"),
  stop: $("stop"),
  txt: $("download-txt"),
  vtt: $("download-vtt"),
  clear: $("clear"),
  title: $("title"),
  prompt: $("prompt"),
};
// A viewer's transcript comes back from the daemon's backlog on a reload; the microphone's
// exists only in this browser, so it is kept in localStorage.
const TRANSCRIPT_KEY = "captiond.transcript";
const view = new CaptionView({
  scroller: $("captions"),
  list: $("transcript"),
  live: $("live"),
  captionBox: $("caption-box"),
  announcer: $("announcer"),
  storageKey: watchName ? null : TRANSCRIPT_KEY,
  // A viewer's source transcribes; the microphone's stream translates with /?task=translate.
  translated: !watchName && query.get("task") === "translate",
});

// The running microphone session or viewer; null when idle.
let current = null;
// The pending hide of an "info" notice.
let noticeTimer = null;

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

const plural = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
const seconds = (ms) => `${(ms / 1000).toFixed(1)} s`;

function setState(state, label) {
  ui.state.dataset.state = state;
  ui.state.textContent = label;
  const idle = IDLE_STATES.includes(state);
  ui.start.disabled = !idle;
  // A session's prompt is fixed when it starts: the daemon takes it from the stream's URL.
  ui.prompt.disabled = !idle;
  ui.stop.disabled = idle || state === "mic" || state === "stopping";
}

// kind: "error" (the session ended), "warn" (it goes on, impaired) or "info" (all is well
// again: it goes away by itself, not to sit on a room screen for the rest of the meeting).
function showNotice(text, kind = "error") {
  ui.notice.textContent = text;
  ui.notice.dataset.kind = kind;
  ui.notice.setAttribute("role", kind === "error" ? "alert" : "status");
  ui.notice.hidden = false;
  clearTimeout(noticeTimer);
  if (kind === "info") noticeTimer = setTimeout(hideNotice, INFO_NOTICE_MS);
}

function hideNotice() {
  ui.notice.hidden = true;
}

function setClock(ms) {
  ui.clock.dataset.ms = String(ms);
  ui.clock.textContent = seconds(ms);
}

function setLevel(dbfs) {
  // -60 dBFS (room noise) … 0 dBFS (full scale) across the meter.
  const fraction = Math.min(1, Math.max(0, (dbfs + 60) / 60));
  ui.level.style.width = `${(fraction * 100).toFixed(1)}%`;
}

function transcriptChanged() {
  ui.txt.disabled = ui.vtt.disabled = ui.clear.disabled = view.transcript.entries.length === 0;
}

// Why the daemon is out of reach for now, for a notice that says the page is on it.
function retryMessage(info, restarting) {
  const when = `reconnecting in ${seconds(info.delayMs)}…`;
  if (restarting) return `Daemon restarting — ${when}`;
  if (info.error) return `${info.error.message} (${info.error.code}, close ${info.code}) — ${when}`;
  if (!info.opened) {
    const where = `Cannot reach the captiond daemon at ${info.url}.`;
    return `${where} Is "captiond serve" running and reachable? Retrying in ${seconds(info.delayMs)}…`;
  }
  return `The connection to the daemon was lost (close ${info.code}) — ${when}`;
}

// What the user reads when the daemon ended or refused the session for good.
function failMessage(info) {
  if (info.refusal) return `The daemon refused the session: ${info.refusal}`;
  const err = info.error;
  if (err?.code === "no_such_source") {
    return `There is no caption source named "${watchName}" on this daemon. (${err.code}: ${err.message})`;
  }
  if (err) {
    const what = info.greeted ? "The daemon ended the session" : "The daemon refused the session";
    return `${what}: ${err.message} (${err.code}, close ${info.code})`;
  }
  return `The connection to the daemon was lost (close ${info.code}).`;
}

// A daemon that is stopping says so, then closes with 1001: it will be back.
const isRestart = (info) => info.error?.code === "shutting_down" || info.code === 1001;

// -- microphone --------------------------------------------------------------------------------
//
// Byte offsets count the audio captured since Start (`pcm`): `base` is where the daemon's
// session began, `sent` how far this connection sent, `freshFrom` where a new session would
// begin (after the audio a dropped one took). `pace` is this connection's send budget.

async function startMicrophone() {
  hideNotice();
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
  const m = { stream, pcm: new PcmBuffer(), base: 0, sent: 0, freshFrom: 0, sessions: 0, token: null, resumeS: 0, pace: null };
  m.link = new Link(() => streamUrl(m), {
    hello: (msg) => micHello(m, msg),
    message: (msg) => micMessage(m, msg),
    down: (info) => micDown(m, info),
  });
  current = m;
  setState("connecting", "connecting");
  try {
    m.capture = await startCapture(stream, (pcm, dbfs) => micAudio(m, pcm, dbfs));
  } catch (err) {
    stream.getTracks().forEach((track) => track.stop());
    if (current !== m) return; // stopped meanwhile: that is what the page says
    current = null;
    setState("error", "no audio");
    showNotice(`Audio capture failed: ${err.message}`);
    return;
  }
  // Stop while the audio graph was starting (a slow audio device): nothing to connect.
  if (current !== m) return releaseMicrophone(m);
  m.link.connect();
}

function streamUrl(m) {
  const params = { sample_rate: "16000", encoding: "pcm_s16le" };
  // /?language=auto (or de, zh-TW, en,de, …) and /?task=translate reach the daemon as they are; the
  // names and terms are the field's (filled from /?prompt=…).
  // /?diarize=true (with max_speakers) labels who said what.
  for (const key of ["language", "task", "diarize", "max_speakers"]) if (query.get(key)) params[key] = query.get(key);
  const prompt = ui.prompt.value.trim();
  if (prompt) params.prompt = prompt;
  if (m.token && Date.now() - m.downAt > m.resumeS * 1000) {
    m.lost = `The connection was away longer than the daemon keeps a session (${m.resumeS} s).`;
    m.token = null;
  }
  if (m.token) {
    params.resume = m.token;
    params.since = String(view.transcript.nextSegment);
  }
  return endpoint("v1/stream", params);
}

function micAudio(m, pcm, dbfs) {
  m.pcm.push(pcm);
  if (!m.pace?.timer) sendAudio(m);
  setClock(Math.round(bytesToMs(m.pcm.end - m.base)));
  setLevel(dbfs);
}

function micHello(m, msg) {
  let from;
  if (msg.type === "resumed") {
    m.ended = msg.ended;
    const wanted = m.base + msg.received_bytes;
    from = Math.max(wanted, m.pcm.start);
    // Audio no longer held is skipped: the daemon's stream goes on without it.
    m.base += from - wanted;
    const lostMs = bytesToMs(from - wanted);
    const after = `Reconnected after ${seconds(msg.gap_ms)}`;
    if (lostMs > 0) showNotice(`${after}; ${seconds(lostMs)} of audio could not be sent again.`, "warn");
    else showNotice(`${after}; nothing was lost.`, "info");
  } else {
    from = Math.max(m.freshFrom, m.pcm.end - msToBytes(FRESH_RESEND_MS), m.pcm.start);
    freshNotice(m, bytesToMs(from - m.freshFrom));
    if (m.sessions > 0) {
      // This session is placed after the one before it and after the audio skipped between
      // them, so that later cues keep the time they were said at.
      view.transcript.noteAudio(bytesToMs(from - m.base));
    }
    m.base = from;
    m.sessions += 1;
    view.transcript.startSession();
  }
  m.token = msg.resume_token ?? null;
  m.resumeS = msg.resume_s ?? 0;
  m.lost = null;
  m.restarting = false;
  if (m.ended) return setState("stopping", "finishing"); // the last finals and `done` follow
  clearTimeout(m.pace?.timer);
  m.pace = {
    since: performance.now(),
    sentBytes: 0,
    burstBytes: SEND_SHARE * msToBytes((msg.audio_burst_s ?? 60) * 1000),
    bytesPerMs: SEND_SHARE * (msg.max_audio_speed ?? 10) * (msToBytes(1000) / 1000),
    timer: null,
  };
  m.sent = from;
  // Stopped during the drop and the daemon never got the `end`: the rest of the audio, then it.
  if (m.stopping) setState("stopping", "finishing");
  else setState("live", "live");
  sendAudio(m);
}

// Sends what this connection has not sent, as fast as `pace` allows (the rest when it does),
// then Stop's `end` if it is due.
function sendAudio(m) {
  const pace = m.pace;
  if (!pace) return; // no session yet
  pace.timer = null;
  for (const pcm of m.pcm.from(m.sent)) {
    const elapsedMs = performance.now() - pace.since;
    const shortBytes = pace.sentBytes + pcm.byteLength - pace.burstBytes - elapsedMs * pace.bytesPerMs;
    if (shortBytes > 0) {
      pace.timer = setTimeout(() => sendAudio(m), shortBytes / pace.bytesPerMs);
      return;
    }
    if (!m.link.send(pcm)) return;
    pace.sentBytes += pcm.byteLength;
    m.sent += pcm.byteLength;
  }
  if (m.endDue) sendEnd(m);
}

// What the user reads as a session starts: why a new one replaced a lost one, and whether
// audio recorded meanwhile was skipped (more than a new session takes at once).
function freshNotice(m, skippedMs) {
  const lost = `${seconds(skippedMs)} of audio recorded while disconnected were not transcribed.`;
  const skipped = skippedMs > 0 ? ` ${lost}` : "";
  if (m.sessions > 0) {
    const why = m.lost ?? "The daemon does not resume sessions ([server] resume_s = 0).";
    showNotice(`${why} A new session started; the transcript so far is kept.${skipped}`, "warn");
  } else if (skipped) {
    showNotice(`Connected.${skipped}`, "warn");
  } else {
    hideNotice(); // "Cannot reach the daemon" while Start waited for it
  }
}

function micMessage(m, msg) {
  if (view.handle(msg) && msg.type === "final") {
    // Stored (localStorage): the daemon need not hold it for a replay any more.
    m.link.send(JSON.stringify({ type: "ack", segment: msg.segment }));
    transcriptChanged();
  } else if (msg.type === "done") {
    view.transcript.noteAudio(msg.audio_ms);
  }
}

function micDown(m, info) {
  view.clearLive();
  clearTimeout(m.pace?.timer);
  m.pace = null; // nothing goes out until the next session's hello
  if (info.greeted) {
    m.downAt = Date.now();
    m.freshFrom = m.sent;
  }
  if (info.action === "retry") {
    m.restarting ||= isRestart(info);
    setState("reconnecting", "reconnecting");
    showNotice(retryMessage(info, m.restarting), "warn");
    return;
  }
  const why = `The daemon could not resume the session (${info.error?.message ?? `close ${info.code}`}).`;
  if (info.action === "fresh" && !m.stopping) {
    m.lost = why;
    m.token = null;
    setState("reconnecting", "reconnecting");
    return;
  }
  m.link.stopRetrying(); // a stopped microphone has nothing for a new session
  releaseMicrophone(m);
  current = null;
  if (info.action === "done") {
    setState("done", `done · ${plural(info.done.segments, "segment")}`);
  } else if (info.action === "fresh") {
    setState("stopped", "stopped");
    showNotice(`${why} The captions of the last moments before Stop are missing.`, "warn");
  } else if (info.action === "stopped") {
    setState("stopped", "stopped");
    const unsentMs = bytesToMs(m.pcm.end - m.sent);
    if (unsentMs > 0) {
      const lost = `the last ${seconds(unsentMs)} of audio were not transcribed`;
      showNotice(`Stopped while disconnected: ${lost}.`, "warn");
    }
  } else {
    setState("error", info.error ? info.error.code : "disconnected");
    showNotice(failMessage(info));
  }
}

// Stop: {"type":"end"}, and the daemon's last finals and `done`, reconnecting for them if
// the connection drops meanwhile. Stop while disconnected (or a second time) gives up.
async function stopMicrophone() {
  const m = current;
  if (m.stopping || !m.link.live) {
    m.link.close();
    return;
  }
  m.stopping = true;
  setState("stopping", "finishing");
  // The worklet's partial last chunk goes out before {"type":"end"}, then the microphone is
  // released at once.
  await m.capture.flush();
  releaseMicrophone(m);
  sendEnd(m);
}

// Stop's {"type":"end"}: due once the microphone is released, sent (once) after all its audio.
function sendEnd(m) {
  m.endDue = true;
  if (!m.ended) m.ended = m.sent === m.pcm.end && m.link.send(JSON.stringify({ type: "end" }));
}

function releaseMicrophone(m) {
  // The tracks too: a Stop while the audio graph is starting finds no capture to stop yet.
  m.stream.getTracks().forEach((track) => track.stop());
  m.capture?.stop();
  m.capture = null;
  setLevel(-Infinity);
}

// -- viewer ------------------------------------------------------------------------------------

// What a `source` state looks like: the pill's state and label, and a notice (null: none).
function sourceView(msg) {
  switch (msg.state) {
    case "capturing":
      return ["watching", "watching", null];
    case "waiting_for_device":
      return [
        "waiting",
        "no microphone",
        `The microphone of "${msg.name}" is not available: ${msg.message}. Captions continue when it is back.`,
      ];
    default:
      return ["paused", `source ${msg.state}`, `The source "${msg.name}" is ${msg.state}: ${msg.message}.`];
  }
}

// The run of the source whose finals the page holds (its `source` messages name it), null
// before the first. Later viewer connections ask for the finals after those (`since`, for that
// `run`), also on a Watch after Stop, so the backlog is not shown twice. A daemon that
// restarted, cleanly or not, runs the source anew, numbering its segments from 0 again: it
// ignores a `since` of another run and sends its whole backlog, a new session on the page.
let watchRun = null;

function startWatching() {
  hideNotice();
  setState("connecting", "connecting");
  const link = new Link(
    () => {
      const params = { source: watchName };
      if (watchRun !== null) {
        params.since = String(view.transcript.nextSegment);
        params.run = watchRun;
      }
      return endpoint("v1/captions", params);
    },
    { hello: watchOpen, message: watchMessage, down: watchDown },
    { greetedOnOpen: true },
  );
  current = { link };
  link.connect();
}

function watchOpen() {
  if (watchRun === null) view.transcript.startSession();
  hideNotice();
  // Neutral until the source says how it is: never "watching" over a missing microphone.
  setState("connected", "connected");
}

function watchMessage(msg) {
  if (msg.type === "source") {
    if (watchRun !== null && msg.run !== watchRun) view.transcript.startSession();
    watchRun = msg.run;
    const [state, label, notice] = sourceView(msg);
    setState(state, label);
    if (notice) showNotice(notice, "warn");
    else hideNotice();
  } else if (view.handle(msg)) {
    transcriptChanged();
    if ("end_ms" in msg) setClock(msg.end_ms);
  }
}

function watchDown(info) {
  view.clearLive();
  if (info.action === "retry") {
    setState("reconnecting", "reconnecting");
    showNotice(retryMessage(info, isRestart(info)), "warn");
    return;
  }
  current = null;
  if (info.action === "stopped") {
    setState("stopped", "stopped");
  } else {
    setState("error", info.error ? info.error.code : "disconnected");
    showNotice(failMessage(info));
  }
}

// -- transcript actions ------------------------------------------------------------------------

function download(text, extension, type) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], { type }));
  const stamp = new Date().toISOString().slice(0, 16).replace(/[-:T]/g, "");
  link.download = `captions-${stamp}.${extension}`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

ui.txt.addEventListener("click", () => download(view.transcript.toText(), "txt", "text/plain;charset=utf-8"));
ui.vtt.addEventListener("click", () => download(view.transcript.toVtt(), "vtt", "text/vtt;charset=utf-8"));
ui.clear.addEventListener("click", () => {
  const count = plural(view.transcript.entries.length, "caption");
  if (!confirm(`Erase the transcript (${count})? Download it first to keep a copy.`)) return;
  // A running session keeps its place on the timeline (its replays are still recognised).
  view.clear({ keepSession: current !== null });
  transcriptChanged();
});

// Another tab of this page stored the transcript (its finals, a Clear): this tab goes on from
// that, so that neither tab's next save overwrites the other's finals.
window.addEventListener("storage", (event) => {
  if (watchName || event.key !== TRANSCRIPT_KEY) return;
  view.reload();
  transcriptChanged();
});

// Back online after a drop: connect now rather than at the end of the backoff.
window.addEventListener("online", () => current?.link.retryNow());

initSettings({
  // The buttons only: <html> carries data-mode too, and every click bubbles up to it.
  modeButtons: document.querySelectorAll("button[data-mode]"),
  size: $("size"),
  theme: $("theme"),
  onMode: () => view.followEnd(),
});
transcriptChanged();

if (watchName) {
  document.body.classList.add("watching");
  ui.title.textContent = `Captions · ${watchName}`;
  document.title = `${watchName} · captiond`;
  ui.start.textContent = "Watch";
  ui.start.addEventListener("click", startWatching);
  ui.stop.addEventListener("click", () => current.link.close());
  startWatching();
} else {
  ui.prompt.value = query.get("prompt") ?? "";
  prepareAudio();
  ui.start.addEventListener("click", startMicrophone);
  ui.stop.addEventListener("click", stopMicrophone);
  setState("idle", "ready to start");
}
