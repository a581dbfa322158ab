// Microphone capture, in the audio rendering thread (AudioWorkletGlobalScope, where `sampleRate` is the
// AudioContext's rate in Hz: often 48000 or 44100). Mixes the input to mono, resamples it to 24 kHz,
// converts it to Int16 and posts one 80 ms frame (1920 samples) at a time to the page, which sends it.
//
// Resampling: band-limited interpolation (J. O. Smith's windowed-sinc method). Each 24 kHz output sample
// is a weighted sum of the input samples around its position, the weights a sinc low-pass (cut below
// 12 kHz, the output's Nyquist frequency, so nothing aliases) shaped by a Blackman window, 16 zero
// crossings each side. The kernel is tabulated once and read with linear interpolation.

const TARGET_RATE_HZ = 24000;
const FRAME_SAMPLES = 1920; // 80 ms at 24 kHz
const ZERO_CROSSINGS = 16; // kernel half-width, in zero crossings of the sinc
const TABLE_STEPS = 256; // kernel table entries per zero crossing
const CUTOFF_MARGIN = 0.92; // the low-pass cuts at 92% of the output's Nyquist frequency (11 kHz)

function windowedSincTable() {
  // table[i] = sinc(u) * blackman(u), u = i / TABLE_STEPS zero crossings from the centre.
  const size = ZERO_CROSSINGS * TABLE_STEPS + 2;
  const table = new Float32Array(size);
  for (let i = 0; i < size; i++) {
    const u = i / TABLE_STEPS;
    const sinc = u === 0 ? 1 : Math.sin(Math.PI * u) / (Math.PI * u);
    const x = Math.min(1, u / ZERO_CROSSINGS); // 0 at the centre, 1 at the edge
    const blackman = 0.42 + 0.5 * Math.cos(Math.PI * x) + 0.08 * Math.cos(2 * Math.PI * x);
    table[i] = sinc * blackman;
  }
  return table;
}

class Resampler {
  /** inRate, outRate in Hz. push(block) returns the output samples the block completes. */
  constructor(inRate, outRate) {
    this.step = inRate / outRate; // input samples per output sample (2 for 48 kHz -> 24 kHz)
    this.cutoff = Math.min(1, outRate / inRate) * CUTOFF_MARGIN; // fraction of the input's Nyquist
    this.halfWidth = ZERO_CROSSINGS / this.cutoff; // kernel half-width, in input samples
    this.table = windowedSincTable();
    const pad = Math.ceil(this.halfWidth);
    this.buffer = new Float32Array(4 * pad + 4096); // input history + lookahead
    this.length = pad; // starts with `pad` samples of silence before the first input sample
    this.position = pad; // where the next output sample sits, in buffer samples (fractional)
  }

  kernel(distance /* input samples */) {
    const u = Math.abs(distance) * this.cutoff * TABLE_STEPS;
    const i = Math.floor(u);
    if (i >= this.table.length - 1) return 0;
    const frac = u - i;
    return this.cutoff * (this.table[i] * (1 - frac) + this.table[i + 1] * frac);
  }

  /** Append `block` (input rate) and write the output samples it completes into `out`; returns how many. */
  push(block, out) {
    this.buffer.set(block, this.length);
    this.length += block.length;
    let count = 0;
    // An output sample needs the input up to halfWidth samples after its position.
    while (this.position + this.halfWidth < this.length - 1) {
      const first = Math.ceil(this.position - this.halfWidth);
      const last = Math.floor(this.position + this.halfWidth);
      let sum = 0;
      for (let k = first; k <= last; k++) sum += this.buffer[k] * this.kernel(this.position - k);
      out[count++] = sum;
      this.position += this.step;
    }
    // Forget the input no later output sample needs.
    const keepFrom = Math.max(0, Math.floor(this.position - this.halfWidth) - 1);
    this.buffer.copyWithin(0, keepFrom, this.length);
    this.length -= keepFrom;
    this.position -= keepFrom;
    return count;
  }
}

class Capture24kProcessor extends AudioWorkletProcessor {
  // options.processorOptions.frameSamples: the model's frame as the node reports it (GET /api/personas
  // "frame"); 1920 (80 ms at 24 kHz) when the page could not ask.
  constructor(options) {
    super();
    const frameSamples = options?.processorOptions?.frameSamples;
    this.frameSamples = Number.isInteger(frameSamples) && frameSamples > 0 ? frameSamples : FRAME_SAMPLES;
    // `sampleRate` (Hz) is a global of the worklet scope.
    this.resampler = sampleRate === TARGET_RATE_HZ ? null : new Resampler(sampleRate, TARGET_RATE_HZ);
    this.frame = new Int16Array(this.frameSamples);
    this.filled = 0;
    this.sumSquares = 0; // of the frame being filled, for the level meter
    this.port.postMessage({ type: "ready", inputRateHz: sampleRate, resampled: this.resampler !== null });
  }

  process(inputs) {
    const channels = inputs[0];
    if (!channels || channels.length === 0) return true; // no input connected yet
    const quantum = channels[0].length; // 128 samples per render quantum
    if (!this.mono || this.mono.length !== quantum) {
      this.mono = new Float32Array(quantum);
      // The 24 kHz samples one quantum completes: quantum * 24000 / sampleRate, give or take one.
      this.resampled = new Float32Array(Math.ceil((quantum * TARGET_RATE_HZ) / sampleRate) + 8);
    }
    // Mix to mono.
    this.mono.fill(0);
    for (const channel of channels) {
      for (let i = 0; i < quantum; i++) this.mono[i] += channel[i] / channels.length;
    }
    const count = this.resampler ? this.resampler.push(this.mono, this.resampled) : quantum;
    const samples = this.resampler ? this.resampled : this.mono;
    for (let i = 0; i < count; i++) {
      const clipped = Math.max(-1, Math.min(1, samples[i]));
      this.frame[this.filled++] = Math.round(clipped * 32767);
      this.sumSquares += clipped * clipped;
      if (this.filled === this.frameSamples) {
        const rms = Math.sqrt(this.sumSquares / this.frameSamples);
        this.port.postMessage({ type: "frame", samples: this.frame, rms }, [this.frame.buffer]);
        this.frame = new Int16Array(this.frameSamples);
        this.filled = 0;
        this.sumSquares = 0;
      }
    }
    return true; // keep capturing until the page disconnects the node
  }
}

registerProcessor("capture-24k", Capture24kProcessor);
