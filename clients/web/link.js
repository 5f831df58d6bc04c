// A websocket to the daemon that connects again when it drops, with backoff.
//
// A meeting outlives Wi-Fi drops, sleeping laptops and daemon restarts: after a close the
// daemon may be back from (a drop, its shutdown, a transient failure, a failed connect) the
// Link waits 0.5 s, 1 s, 2 s … up to 10 s, with jitter so that a room of screens does not
// reconnect in step, and connects again to the URL its owner gives for that attempt (which
// carries the resume token). What each close means is decided in `closeAction` alone.

// Close codes the daemon may be back from: going away (1001), dropped (1006), an internal
// error (1011), a restart (1012), overloaded (1013).
const RETRY_CODES = new Set([1001, 1006, 1011, 1012, 1013]);
// The daemon's answer to a resume token it cannot honour (`resume_failed`).
const CLOSE_RESUME_FAILED = 4410;
const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 10_000;

// The wait before reconnect attempt `attempt` (0, 1, …): doubling, capped, ±25 % jitter.
export function backoffMs(attempt, random = Math.random) {
  const base = Math.min(MAX_DELAY_MS, FIRST_DELAY_MS * 2 ** attempt);
  return Math.round(base * (0.75 + 0.5 * random()));
}

// What a closed socket leads to: "done", "stopped" (by the user), "fresh" (connect again at
// once without resuming), "retry" (after a backoff) or "failed" (the daemon said no).
export function closeAction({ done, stopped, error, code, opened, refusal }) {
  if (done) return "done";
  if (stopped) return "stopped";
  if (error?.code === "resume_failed" || code === CLOSE_RESUME_FAILED) return "fresh";
  if (refusal) return "failed";
  if (!opened || RETRY_CODES.has(code)) return "retry";
  return "failed";
}

// A handshake the daemon refuses (token, origin) reaches a page only as close 1006; the same
// request over plain HTTP gets the daemon's answer: {status, text}, or null if unreachable.
async function plainAnswer(url) {
  try {
    const resp = await fetch(url.replace(/^ws/, "http"), { cache: "no-store" });
    return { status: resp.status, text: (await resp.text()).trim() };
  } catch {
    return null; // the caller says so
  }
}

// A browser sends no Origin with a same-origin GET, so where the websocket's Origin was
// refused (403), the plain request passes and gets 426: "a websocket endpoint".
const UPGRADE_REFUSED =
  `this page's origin (${location.origin}) may not connect, or a proxy in between does not pass ` +
  "websocket upgrades: the daemon answers plain requests but refused the websocket. " +
  "List the origin in the daemon's [server] allowed_origins.";

export class Link {
  // `url()`: the URL of the next attempt. `on.hello(msg)`: `ready` or `resumed` arrived (with
  // `greetedOnOpen`, for a viewer that gets neither: the socket opened, msg null);
  // `on.message(msg)`: any other message; `on.down(info)`: the socket closed, with `action`
  // (see closeAction) and, for "retry", `delayMs` until the next attempt.
  constructor(url, on, { greetedOnOpen = false } = {}) {
    this.url = url;
    this.on = on;
    this.greetedOnOpen = greetedOnOpen;
    this.attempt = 0;
    this.stopped = false;
    this.greeted = false;
    this.ws = null;
    this.timer = null;
    // The last failed handshake's plain request got 426 (see refusalOf).
    this.upgradeRefused = false;
  }

  // Open and greeted: audio and acks may be sent.
  get live() {
    return this.greeted && this.ws?.readyState === WebSocket.OPEN;
  }

  connect() {
    this.timer = null;
    const url = this.url();
    const ws = new WebSocket(url);
    const info = { url, opened: false, greeted: false, error: null, done: null, code: 0 };
    this.ws = ws;
    this.greeted = false;
    const greet = (msg) => {
      this.greeted = info.greeted = true;
      this.attempt = 0;
      this.on.hello(msg);
    };
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      info.opened = true;
      this.upgradeRefused = false;
      if (this.greetedOnOpen) greet(null);
    };
    ws.onmessage = (event) => {
      const msg = JSON.parse(event.data);
      if (msg.type === "ready" || msg.type === "resumed") {
        greet(msg);
      } else if (msg.type === "error") {
        info.error = msg;
      } else {
        if (msg.type === "done") info.done = msg;
        this.on.message(msg);
      }
    };
    ws.onclose = async (event) => {
      info.code = event.code;
      if (!info.opened && !this.stopped) info.refusal = await this.refusalOf(url);
      if (this.ws !== ws) return;
      this.ws = null;
      info.action = closeAction({ ...info, stopped: this.stopped });
      if (info.action === "retry") {
        info.delayMs = backoffMs(this.attempt++);
        this.timer = setTimeout(() => this.connect(), info.delayMs);
      } else if (info.action === "fresh") {
        this.timer = setTimeout(() => this.connect(), 0);
      }
      this.on.down(info);
    };
  }

  // Why the daemon refused the handshake to `url`; null: it did not (unreachable, or not
  // sure yet). A 426 counts only the second time in a row: the first may come from a daemon
  // that came back between the websocket and the plain request.
  async refusalOf(url) {
    const answer = await plainAnswer(url);
    if (answer?.status === 401 || answer?.status === 403) return `${answer.text} (HTTP ${answer.status})`;
    const again = this.upgradeRefused;
    this.upgradeRefused = answer?.status === 426;
    return this.upgradeRefused && again ? UPGRADE_REFUSED : null;
  }

  send(data) {
    if (!this.live) return false;
    this.ws.send(data);
    return true;
  }

  // The user's Stop: no more attempts; an open socket closes with 1000.
  close() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = null;
    if (this.ws?.readyState === WebSocket.OPEN || this.ws?.readyState === WebSocket.CONNECTING) {
      this.ws.close(1000);
    } else if (this.ws === null) {
      this.on.down({ action: "stopped" });
    }
  }

  // The network is back (the browser's `online` event): no need to wait out the backoff.
  retryNow() {
    if (this.timer === null) return;
    clearTimeout(this.timer);
    this.connect();
  }

  // Stops reconnecting but leaves an open socket to the daemon (a mic's `end` → `done`).
  stopRetrying() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = null;
  }
}
