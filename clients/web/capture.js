// The microphone: permission, the AudioWorklet graph (worklet.js), and the recent audio kept
// so that what a dropped connection did not deliver can be sent again.

const BYTES_PER_S = 16000 * 2; // 16 kHz pcm_s16le, what the worklet produces
// Audio kept for resending: a drop or daemon restart shorter than this loses no speech.
const KEEP_S = 120;

export const bytesToMs = (bytes) => (bytes / BYTES_PER_S) * 1000;
export const msToBytes = (ms) => 2 * Math.round((ms / 1000) * (BYTES_PER_S / 2));

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

export async function openMicrophone() {
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

// The audio graph's context and its worklet module, loaded with the page: a Start after the
// daemon went away (the page's own server) still finds the module. One per page.
const WORKLET_URL = new URL("worklet.js", import.meta.url);
let prepared = null;

export function prepareAudio() {
  const context = new AudioContext({ latencyHint: "interactive" });
  prepared = { context, loaded: context.audioWorklet.addModule(WORKLET_URL) };
  prepared.loaded.catch(() => {}); // a failure is Start's to show (workletLoaded), not an uncaught error
}

// Resolves once the worklet module is loaded. One the page could not load (the daemon went
// away as the page loaded, or a network fault) is loaded again: the daemon may be back. The
// URL is a new one each time, as the worklet keeps a failed fetch's answer for its URL. A
// fetch that fails again (an AbortError) says which daemon the page cannot reach.
let reloads = 0;

export async function workletLoaded() {
  try {
    return await prepared.loaded;
  } catch {
    const again = new URL(`?reload=${++reloads}`, WORKLET_URL);
    prepared.loaded = prepared.context.audioWorklet.addModule(again);
  }
  try {
    return await prepared.loaded;
  } catch (err) {
    if (err.name !== "AbortError") throw err;
    throw new Error(
      `Cannot reach the captiond daemon at ${WORKLET_URL.origin} for the audio worklet (${err.message}). ` +
        `Is "captiond serve" running and reachable?`,
    );
  }
}

// Capture from `stream` until `stop()`: `onAudio(pcm, dbfs)` gets each 100 ms chunk of 16 kHz
// pcm_s16le (an ArrayBuffer). `flush()` resolves once the partial last chunk is out.
export async function startCapture(stream, onAudio) {
  await workletLoaded();
  const { context } = prepared;
  const source = context.createMediaStreamSource(stream);
  const node = new AudioWorkletNode(context, "captiond-capture", { numberOfOutputs: 1, outputChannelCount: [1] });
  let flushed = null;
  node.port.onmessage = (event) => {
    const msg = event.data;
    if (msg.type === "audio") onAudio(msg.pcm, msg.dbfs);
    else if (msg.type === "flushed") flushed?.();
  };
  source.connect(node);
  // The node outputs silence; connected so the graph is pulled and process() runs.
  node.connect(context.destination);
  await context.resume();
  return {
    flush: () =>
      new Promise((resolve) => {
        flushed = resolve;
        node.port.postMessage("flush");
      }),
    stop: () => {
      node.port.onmessage = null;
      node.port.postMessage("stop");
      source.disconnect();
      node.disconnect();
      stream.getTracks().forEach((track) => track.stop());
      // Kept for the next Start, idle meanwhile.
      context.suspend();
    },
  };
}

// The newest KEEP_S of captured audio, addressed by byte offset since capture began.
export class PcmBuffer {
  constructor(keepBytes = KEEP_S * BYTES_PER_S) {
    this.keepBytes = keepBytes;
    this.chunks = []; // {at: byte offset, pcm: ArrayBuffer}, oldest first
    this.start = 0; // offset of the oldest byte held
    this.end = 0; // offset after the newest byte: every byte captured so far
  }

  push(pcm) {
    this.chunks.push({ at: this.end, pcm });
    this.end += pcm.byteLength;
    while (this.end - this.chunks[0].at - this.chunks[0].pcm.byteLength >= this.keepBytes) {
      this.chunks.shift();
    }
    this.start = this.chunks[0].at;
  }

  // The audio from offset `from` (not before `start`) to `end`, in the captured chunks.
  *from(from) {
    for (const { at, pcm } of this.chunks) {
      if (at + pcm.byteLength <= from) continue;
      yield at >= from ? pcm : pcm.slice(from - at);
    }
  }
}
