// Caption rendering for protocol v1 `partial` and `final` messages, in two modes.
//
// Shared by the microphone mode and the viewer mode (/?watch=NAME): both receive the same
// messages. Transcript mode lists every final with its time and shows the newest partial
// below, its stable words apart from the unstable tail that may still change. Caption mode
// (for a room screen) rolls the newest few lines in a box of fixed height: CSS keeps only
// its bottom lines, so this file only has to keep enough recent text in it.

import { Transcript, formatClock, joinText, textDirection } from "./transcript.js";

// An element's language, or the page's where it is not known.
function setLang(element, lang) {
  if (lang) element.lang = lang;
  else element.removeAttribute("lang");
}

// Recent finals kept in the caption box: more than its largest lines-worth of text.
const CAPTION_FINALS = 6;
// Finals kept in the screen-reader region: it only needs to hold the ones being announced.
const ANNOUNCED_FINALS = 3;

export class CaptionView {
  // `translated`: the captions are English translations (?task=translate), whatever language a
  // message says was spoken.
  constructor({ scroller, list, live, captionBox, announcer, storageKey = null, translated = false }) {
    this.translated = translated;
    this.scroller = scroller;
    this.list = list;
    this.live = live;
    this.captionBox = captionBox;
    this.announcer = announcer;
    this.transcript = new Transcript(storageKey);
    this.render();
  }

  // Returns true when the message was a caption message this view shows.
  handle(msg) {
    if (msg.type === "partial") {
      // After its segment's final (a misbehaving peer, or a late replay) a partial is stale.
      if (msg.segment < this.transcript.nextSegment) return true;
      this.liveSegment = msg.segment;
      this.setLive(msg.stable, msg.separator, msg.unstable, this.textLanguage(msg.language));
      return true;
    }
    if (msg.type === "final") {
      if (msg.segment === this.liveSegment) this.clearLive();
      const entry = this.transcript.add(msg);
      if (entry) this.showFinal(entry);
      return true;
    }
    return false;
  }

  // The unfinished words may never get their final (the daemon finalises them on a drop):
  // they are not left on screen as if they were current.
  clearLive() {
    this.liveSegment = null;
    this.setLive("", "", "", null);
  }

  clear({ keepSession }) {
    this.transcript.clear({ keepSession });
    this.render();
  }

  render() {
    this.renderList();
    this.renderCaptions();
    this.clearLive();
    this.followEnd();
  }

  // The stored transcript changed in another tab of this page: shown as it now is, keeping the
  // reader's place and this tab's live line.
  reload() {
    this.transcript.load();
    this.keepScrolled(() => this.renderList());
    this.renderCaptions();
  }

  renderList() {
    this.list.replaceChildren(...this.transcript.entries.map((entry) => this.item(entry)));
  }

  followEnd() {
    this.scroller.scrollTop = this.scroller.scrollHeight;
  }

  showFinal(entry) {
    this.keepScrolled(() => this.list.append(this.item(entry)));
    this.renderCaptions();
    const line = document.createElement("p");
    line.textContent = entry.text;
    line.dir = textDirection(entry.text);
    setLang(line, this.textLanguage(entry.language));
    this.announcer.append(line);
    while (this.announcer.childElementCount > ANNOUNCED_FINALS) this.announcer.firstElementChild.remove();
  }

  // `separator`: what the daemon says goes between the two parts (a space, or none where the text
  // has none: Chinese and Japanese, inside a Thai phrase, "我用" + "Python写").
  setLive(stable, separator, unstable, lang) {
    const tail = stable && unstable ? separator + unstable : unstable;
    this.keepScrolled(() => {
      for (const line of [this.live, this.captionBox.querySelector(".now")]) {
        line.dir = textDirection(stable + tail);
        setLang(line, lang);
        line.querySelector(".stable").textContent = stable;
        line.querySelector(".unstable").textContent = tail;
        line.hidden = !(stable || unstable);
      }
    });
  }

  // The language a caption is written in (null where unknown): the spoken one, or English for a
  // translation.
  textLanguage(spoken) {
    return this.translated ? "en" : (spoken ?? null);
  }

  // Names a speaker (a click on their label in transcript mode): every caption shows it.
  rename(speaker, name) {
    this.transcript.rename(speaker, name);
    this.keepScrolled(() => this.renderList());
    this.renderCaptions();
  }

  renderCaptions() {
    const recent = this.transcript.entries.slice(-CAPTION_FINALS);
    const said = this.captionBox.querySelector(".said");
    // A diarized caption line says who speaks where the speaker changes: "Dana: …".
    const texts = recent.map((entry, i) => {
      const name = this.transcript.nameOf(entry);
      const changed = name !== null && (i === 0 || recent[i - 1].speaker !== entry.speaker);
      return changed ? `${name}: ${entry.text}` : entry.text;
    });
    said.textContent = texts.reduce(joinText, "");
    said.dir = textDirection(said.textContent);
  }

  item(entry) {
    const item = document.createElement("li");
    item.className = "final";
    const time = document.createElement("time");
    time.textContent = formatClock(entry.start_ms);
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = entry.text;
    // Each caption reads in its own direction (Arabic, Hebrew) and is announced and rendered
    // in its own language; the language shows under the time (with ?language=auto it varies).
    text.dir = textDirection(entry.text);
    setLang(text, this.textLanguage(entry.language));
    if (entry.language) time.dataset.lang = entry.language; // the language spoken
    const name = this.transcript.nameOf(entry);
    if (name === null) {
      item.append(time, text);
      return item;
    }
    // A diarized caption: its speaker's label, in one of eight colours by speaker number, and
    // the text share the text column; a click on the label renames the speaker.
    const label = document.createElement("button");
    label.type = "button";
    label.className = "speaker";
    label.dataset.speaker = String(entry.speaker);
    label.dataset.colour = String(entry.speaker % 8);
    label.textContent = name;
    label.title = "Rename this speaker";
    label.addEventListener("click", () => {
      const given = prompt(`Name for ${name}`, name);
      if (given !== null) this.rename(entry.speaker, given);
    });
    const said = document.createElement("span");
    said.append(label, " ", text);
    item.append(time, said);
    return item;
  }

  // Follows new text only when the reader is at the bottom: scrolling up to reread stays put.
  keepScrolled(update) {
    const el = this.scroller;
    const atBottom = el.scrollHeight - el.scrollTop - el.clientHeight < 48;
    update();
    if (atBottom) el.scrollTop = el.scrollHeight;
  }
}
