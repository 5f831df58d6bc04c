// Caption rendering and the transcript, for protocol v1 `partial` and `final` messages.
//
// Shared by the microphone mode and the viewer mode (/?watch=NAME): both receive the same
// messages. Finals are appended once and never revised; the one live line shows the newest
// partial, its stable words apart from the unstable tail that may still change.

// Stream time (integer ms) as m:ss, or h:mm:ss past the hour.
export function formatClock(ms) {
  const s = Math.floor(ms / 1000);
  const mmss = `${String(Math.floor(s / 60) % 60).padStart(2, "0")}:${String(s % 60).padStart(2, "0")}`;
  return s >= 3600 ? `${Math.floor(s / 3600)}:${mmss}` : mmss.replace(/^0/, "");
}

// Stream time as a WebVTT timestamp, hh:mm:ss.ttt.
export function formatVttTime(ms) {
  const pad = (n, width) => String(n).padStart(width, "0");
  const h = Math.floor(ms / 3_600_000);
  const m = Math.floor(ms / 60_000) % 60;
  const s = Math.floor(ms / 1000) % 60;
  return `${pad(h, 2)}:${pad(m, 2)}:${pad(s, 2)}.${pad(ms % 1000, 3)}`;
}

export class CaptionView {
  constructor({ scroller, transcript, live }) {
    this.scroller = scroller;
    this.transcript = transcript;
    this.live = live;
    this.stable = live.querySelector(".stable");
    this.unstable = live.querySelector(".unstable");
    this.clear();
  }

  clear() {
    this.finals = [];
    this.finalSegments = new Set();
    this.liveSegment = null;
    this.transcript.replaceChildren();
    this.setLive("", "");
  }

  // Returns true when the message was a caption message this view shows.
  handle(msg) {
    if (msg.type === "partial") {
      // A partial can arrive after its segment's final only from a misbehaving peer.
      if (this.finalSegments.has(msg.segment)) return true;
      this.liveSegment = msg.segment;
      this.keepScrolled(() => this.setLive(msg.stable, msg.unstable));
      return true;
    }
    if (msg.type === "final") {
      this.finalSegments.add(msg.segment);
      this.keepScrolled(() => {
        if (msg.segment === this.liveSegment) this.setLive("", "");
        // An empty final closes a segment Whisper judged to be non-speech: nothing to show.
        if (msg.text.trim()) this.appendFinal(msg);
      });
      return true;
    }
    return false;
  }

  setLive(stable, unstable) {
    this.stable.textContent = stable;
    // A space between the parts unless the stable text already ends with one.
    this.unstable.textContent = stable && unstable && !/\s$/.test(stable) ? ` ${unstable}` : unstable;
    this.live.hidden = !(stable || unstable);
  }

  appendFinal(msg) {
    const entry = { start_ms: msg.start_ms, end_ms: msg.end_ms, text: msg.text.trim() };
    this.finals.push(entry);
    const item = document.createElement("li");
    item.className = "final";
    const time = document.createElement("time");
    time.textContent = formatClock(entry.start_ms);
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = entry.text;
    item.append(time, text);
    this.transcript.append(item);
  }

  // Follows new text only when the reader is at the bottom: scrolling up to reread stays put.
  keepScrolled(update) {
    const el = this.scroller;
    const atBottom = el.scrollHeight - el.scrollTop - el.clientHeight < 48;
    update();
    if (atBottom) el.scrollTop = el.scrollHeight;
  }

  toText() {
    return this.finals.map((f) => `[${formatClock(f.start_ms)}] ${f.text}\n`).join("");
  }

  toVtt() {
    // Cue text is markup in WebVTT: "&", "<" and ">" must be escaped.
    const escape = (text) => text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
    const cues = this.finals.map(
      (f, i) =>
        `${i + 1}\n${formatVttTime(f.start_ms)} --> ${formatVttTime(f.end_ms)}\n${escape(f.text)}\n`,
    );
    return ["WEBVTT\n", ...cues].join("\n");
  }
}
