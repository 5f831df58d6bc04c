// The transcript: every final of every session the page has shown, and its .txt/.vtt exports.
//
// A meeting outlives its sessions (Stop and Start, a daemon restart without a journal): each
// session's stream clock starts again at 0, so each is placed on one page timeline after the
// ones before it, which keeps the VTT cue times increasing. Finals are kept by (session,
// segment): a resumed session's replay repeats finals the page may already hold.
//
// A diarized stream's finals name their speaker (a number from 0, per daemon session). The page
// shows "Speaker 1" for speaker 0 until the reader names them; names are kept with the
// transcript, so a rename survives a reload, and the exports use them.

const STORE_VERSION = 1;

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

// Chinese and Japanese: no space goes between two of their characters (as daemon/captiond/text.py
// lists them; Thai, Lao, Khmer and Burmese part sentences with a space).
const UNSPACED = /[\u2e80-\u2fdf\u3000-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef\u{20000}-\u{3ffff}]/u;

// Two finals as one text: a space between them, as between words and sentences, except where
// both sides are Chinese or Japanese characters (whatever punctuation ends the first):
// "できなかった。" and "次は" read as one text.
export function joinText(first, second) {
  if (!first || !second || /\s$/.test(first) || /^\s/.test(second)) return first + second;
  const last = [...first.replace(/\p{P}+$/u, "")].pop() ?? "";
  return UNSPACED.test(last) && UNSPACED.test([...second][0]) ? first + second : `${first} ${second}`;
}

// Letters of the scripts written right to left.
const RTL_LETTER = /[\p{Script=Arabic}\p{Script=Hebrew}\p{Script=Syriac}\p{Script=Thaana}\p{Script=Nko}\p{Script=Adlam}]/u;

// The direction a caption reads in: that of most of its letters. dir="auto" goes by the first
// letter alone, which lays an Arabic caption that starts with a Latin name out left to right.
export function textDirection(text) {
  let rtl = 0;
  let letters = 0;
  for (const char of text) {
    if (!/\p{L}/u.test(char)) continue;
    letters += 1;
    if (RTL_LETTER.test(char)) rtl += 1;
  }
  if (!letters) return "auto";
  return 2 * rtl > letters ? "rtl" : "ltr";
}

// A speaker's name until the reader gives one.
export function defaultName(speaker) {
  return `Speaker ${speaker + 1}`;
}

export class Transcript {
  // `storageKey`: where the transcript survives a reload (null: kept in memory only).
  constructor(storageKey = null) {
    this.storageKey = storageKey;
    this.entries = []; // {start_ms, end_ms, text, language?} on the page timeline, non-empty only
    this.endMs = 0; // where the timeline's last session ended
    this.names = {}; // speaker number → the name the reader gave
    this.session = null;
    this.load();
  }

  // A new daemon session: its stream time 0 lies at the end of everything before it.
  startSession() {
    this.session = { offsetMs: this.endMs, starts: new Map(), lastSegment: -1, lastStartMs: -1 };
  }

  // The segment a resuming client asks the replay to start from.
  get nextSegment() {
    return this.session ? this.session.lastSegment + 1 : 0;
  }

  // Stores a `final` message; returns its entry, or null for a repeat or an empty final.
  add(msg) {
    const known = this.session?.starts.get(msg.segment);
    if (known === msg.start_ms) return null; // replayed
    // Finals of one stream come in time order, one per segment number: anything else is a
    // stream that started again (a viewer's source after a daemon restart).
    if (!this.session || known !== undefined || msg.start_ms < this.session.lastStartMs) {
      this.startSession();
    }
    const { offsetMs, starts } = this.session;
    starts.set(msg.segment, msg.start_ms);
    this.session.lastSegment = Math.max(this.session.lastSegment, msg.segment);
    this.session.lastStartMs = msg.start_ms;
    this.noteAudio(msg.end_ms);
    // An empty final closes a segment Whisper judged to be non-speech: nothing to keep.
    const text = msg.text.trim();
    if (!text) {
      this.save();
      return null;
    }
    const entry = { start_ms: offsetMs + msg.start_ms, end_ms: offsetMs + msg.end_ms, text };
    if (msg.language) entry.language = msg.language;
    if (Number.isInteger(msg.speaker)) entry.speaker = msg.speaker;
    this.entries.push(entry);
    this.save();
    return entry;
  }

  // The session's stream reached `ms` (a final's end, or `done`): a later session starts here.
  noteAudio(ms) {
    if (!this.session) return;
    this.endMs = Math.max(this.endMs, this.session.offsetMs + ms);
  }

  // Erases every final. `keepSession`: a session is still running, and its later finals and
  // replays keep their place after the ones erased.
  clear({ keepSession = false } = {}) {
    this.entries = [];
    if (!keepSession) {
      this.endMs = 0;
      this.session = null;
    }
    this.save();
  }

  // Who said an entry: the reader's name for its speaker, or "Speaker N"; null when the stream
  // is not diarized.
  nameOf(entry) {
    if (entry.speaker === undefined) return null;
    return this.names[entry.speaker] ?? defaultName(entry.speaker);
  }

  // Names a speaker ("" gives the default back), everywhere and in the exports.
  rename(speaker, name) {
    const trimmed = name.trim();
    if (trimmed && trimmed !== defaultName(speaker)) this.names[speaker] = trimmed;
    else delete this.names[speaker];
    this.save();
  }

  toText() {
    const said = (f) => (this.nameOf(f) === null ? f.text : `${this.nameOf(f)}: ${f.text}`);
    return this.entries.map((f) => `[${formatClock(f.start_ms)}] ${said(f)}\n`).join("");
  }

  toVtt() {
    // Cue text is markup in WebVTT: "&", "<" and ">" must be escaped.
    const escape = (text) => text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
    // A diarized caption is a voice span: <v Dana>…
    const voice = (f) => (this.nameOf(f) === null ? "" : `<v ${escape(this.nameOf(f))}>`);
    const cues = this.entries.map(
      (f, i) =>
        `${i + 1}\n${formatVttTime(f.start_ms)} --> ${formatVttTime(f.end_ms)}\n${voice(f)}${escape(f.text)}\n`,
    );
    return ["WEBVTT\n", ...cues].join("\n");
  }

  load() {
    if (!this.storageKey) return;
    try {
      const stored = JSON.parse(localStorage.getItem(this.storageKey));
      if (stored?.version === STORE_VERSION) {
        this.entries = stored.entries;
        this.endMs = stored.endMs;
        this.names = stored.names ?? {};
      }
    } catch {
      // Unreadable or blocked storage: start empty rather than not at all.
    }
  }

  save() {
    if (!this.storageKey) return;
    try {
      const { entries, endMs, names } = this;
      localStorage.setItem(this.storageKey, JSON.stringify({ version: STORE_VERSION, entries, endMs, names }));
    } catch {
      // Full or blocked storage: the transcript still lives on the page and in downloads.
    }
  }
}
