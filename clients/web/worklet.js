// AudioWorklet processor: microphone → 16 kHz mono pcm_s16le chunks for /v1/stream.
//
// Runs on the audio rendering thread. The conversion happens here rather than through
// `new AudioContext({sampleRate: 16000})`: browsers differ in whether (and how well) they
// resample a capture stream into such a context, and without a proper low-pass the energy
// above 8 kHz of a 44.1/48 kHz microphone aliases into the band Whisper listens to.

const OUT_RATE_HZ = 16000;
// 100 ms per websocket frame: few frames, yet partials are never held back by batching.
const CHUNK_SAMPLES = 1600;
// Windowed-sinc low-pass: half-width in zero crossings, and table points per crossing.
const ZERO_CROSSINGS = 16;
const TABLE_STEPS = 512;
// Cut-off as a fraction of the output Nyquist frequency (7.2 kHz): the transition band
// then ends below 8 kHz, so little aliasing survives.
const CUTOFF = 0.9;

// Blackman window on [-1, 1]: about -74 dB side lobes, plenty for 16-bit speech.
function blackman(x) {
  return 0.42 + 0.5 * Math.cos(Math.PI * x) + 0.08 * Math.cos(2 * Math.PI * x);
}

// Band-limited resampler for arbitrary rate ratios (44.1 kHz → 16 kHz has 160 phases):
// every output sample is a windowed-sinc weighted sum of the input around its exact
// fractional position, the kernel read from a table with linear interpolation.
class Resampler {
  constructor(inRateHz, outRateHz) {
    this.step = inRateHz / outRateHz; // input samples per output sample
    // Cut-off in cycles per input sample; below both Nyquist frequencies.
    this.fc = 0.5 * CUTOFF * Math.min(1, outRateHz / inRateHz);
    this.halfWidth = ZERO_CROSSINGS / (2 * this.fc); // in input samples
    this.table = new Float32Array(ZERO_CROSSINGS * TABLE_STEPS + 2);
    for (let i = 0; i <= ZERO_CROSSINGS * TABLE_STEPS; i++) {
      const u = i / TABLE_STEPS; // distance in zero crossings
      const sinc = u === 0 ? 1 : Math.sin(Math.PI * u) / (Math.PI * u);
      this.table[i] = 2 * this.fc * sinc * blackman(u / ZERO_CROSSINGS);
    }
    const history = Math.ceil(this.halfWidth) + 1;
    this.buf = new Float32Array(2 * history + 4096);
    // Start with a half-width of silence so the first output sample has its left side.
    this.len = history;
    this.pos = history; // buffer index (fractional) of the next output sample
  }

  // Appends `input` and writes every output sample now computable into `out`; returns count.
  process(input, out) {
    if (this.len + input.length > this.buf.length) this.compact();
    this.buf.set(input, this.len);
    this.len += input.length;
    const scale = 2 * this.fc * TABLE_STEPS; // input samples → table index
    let n = 0;
    while (this.pos + this.halfWidth < this.len - 1 && n < out.length) {
      const first = Math.ceil(this.pos - this.halfWidth);
      const last = Math.floor(this.pos + this.halfWidth);
      let acc = 0;
      for (let k = first; k <= last; k++) {
        const t = Math.abs(this.pos - k) * scale;
        const i = t | 0;
        const tap = this.table[i] + (t - i) * (this.table[i + 1] - this.table[i]);
        acc += this.buf[k] * tap;
      }
      out[n++] = acc;
      this.pos += this.step;
    }
    return n;
  }

  // Drops input no future output sample reaches; indices shift by whole samples only.
  compact() {
    const drop = Math.max(0, Math.floor(this.pos - this.halfWidth) - 1);
    this.buf.copyWithin(0, drop, this.len);
    this.len -= drop;
    this.pos -= drop;
  }
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    // `sampleRate` is the AudioContext's rate, a global of the worklet scope.
    this.resampler = new Resampler(sampleRate, OUT_RATE_HZ);
    this.mono = new Float32Array(128);
    this.resampled = new Float32Array(256);
    this.startChunk();
    this.stopped = false;
    // The main thread asks for the partial last chunk before it sends {"type":"end"}, and
    // says "stop" when its capture ends.
    this.port.onmessage = (event) => {
      if (event.data === "flush") {
        this.postChunk();
        this.port.postMessage({ type: "flushed" });
      } else if (event.data === "stop") {
        this.stopped = true;
      }
    };
  }

  startChunk() {
    this.chunk = new Int16Array(CHUNK_SAMPLES);
    this.filled = 0;
    this.sumSquares = 0;
  }

  process(inputs) {
    // false: the browser stops calling it and may drop the node. A disconnected node is
    // otherwise processed for as long as the page lives, each Start adding one.
    if (this.stopped) return false;
    const channels = inputs[0];
    if (channels.length === 0) return true; // not connected yet
    const frames = channels[0].length;
    if (this.mono.length < frames) this.mono = new Float32Array(frames);
    // Mix down to mono: a stereo microphone's channels carry the same speech.
    this.mono.fill(0, 0, frames);
    for (const channel of channels) {
      for (let i = 0; i < frames; i++) this.mono[i] += channel[i] / channels.length;
    }
    const count = this.resampler.process(this.mono.subarray(0, frames), this.resampled);
    for (let i = 0; i < count; i++) {
      const x = Math.max(-1, Math.min(1, this.resampled[i]));
      this.chunk[this.filled++] = Math.round(x < 0 ? x * 32768 : x * 32767);
      this.sumSquares += x * x;
      if (this.filled === CHUNK_SAMPLES) this.postChunk();
    }
    return true;
  }

  postChunk() {
    if (this.filled === 0) return;
    const rms = Math.sqrt(this.sumSquares / this.filled);
    const pcm = this.chunk.buffer.slice(0, this.filled * 2);
    // Transferred: ownership moves to the main thread instead of a second copy.
    this.port.postMessage({ type: "audio", pcm, dbfs: 20 * Math.log10(rms + 1e-9) }, [pcm]);
    this.startChunk();
  }
}

registerProcessor("captiond-capture", CaptureProcessor);
