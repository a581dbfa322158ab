// Gap-free playback of the node's 24 kHz audio frames through an AudioContext, with a small jitter buffer.
//
// Each 80 ms frame becomes an AudioBuffer (24 kHz; the browser resamples it to the context's rate) played
// by an AudioBufferSourceNode scheduled to start exactly where the previous frame ends, so consecutive
// frames join without a gap. The first frame (and the first after an underrun) starts `targetMs` after it
// arrives: that lead is the jitter buffer, how late a frame may come without being heard as a gap.

import { SAMPLE_RATE_HZ } from "./protocol.js";

export const JITTER_START_MS = 120; // initial lead: 1.5 frames of 80 ms
export const JITTER_STEP_MS = 40; // added to the lead after each underrun...
export const JITTER_MAX_MS = 400; // ...up to this
// A burst after a stall (frames held up, then delivered at once) would leave that much extra delay in the
// conversation for good: a frame arriving with more than the lead plus this queued is dropped instead.
export const EXCESS_MAX_MS = 160; // two frames

export class Player {
  /** context: the page's AudioContext; output: where the audio goes (default the speakers). */
  constructor(context, output = context.destination) {
    this.context = context;
    this.output = output;
    this.targetMs = JITTER_START_MS;
    this.nextStartS = 0; // context time (s) at which the next frame starts; 0: not started
    this.framesScheduled = 0;
    this.underruns = 0; // times the buffer ran dry mid-conversation (an audible gap)
    this.dropped = 0; // frames dropped for arriving with too much queued (EXCESS_MAX_MS)
    this.sources = new Set();
  }

  /** Audio queued ahead of the playhead (ms). */
  get bufferedMs() {
    return Math.max(0, this.nextStartS - this.context.currentTime) * 1000;
  }

  /** Schedule one frame of Float32 samples at 24 kHz. */
  push(samples) {
    if (samples.length === 0) return;
    const now = this.context.currentTime;
    const marginS = 0.01; // a start closer than 10 ms to the playhead may already be late
    if (this.nextStartS < now + marginS) {
      if (this.framesScheduled > 0) {
        this.underruns += 1;
        this.targetMs = Math.min(JITTER_MAX_MS, this.targetMs + JITTER_STEP_MS);
      }
      this.nextStartS = now + this.targetMs / 1000; // (re)fill the jitter buffer
    } else if (this.nextStartS - now > (this.targetMs + EXCESS_MAX_MS) / 1000) {
      this.dropped += 1; // keep the conversation's delay bounded: lead + 160 ms at most
      return;
    }
    const buffer = this.context.createBuffer(1, samples.length, SAMPLE_RATE_HZ);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.output);
    source.onended = () => {
      source.disconnect();
      this.sources.delete(source);
    };
    source.start(this.nextStartS);
    this.sources.add(source);
    this.nextStartS += buffer.duration; // 0.08 s: the next frame starts where this one ends
    this.framesScheduled += 1;
  }

  /** Stop everything scheduled. */
  stop() {
    for (const source of this.sources) {
      try {
        source.stop();
      } catch {
        // not started yet or already ended
      }
      source.disconnect();
    }
    this.sources.clear();
    this.nextStartS = 0;
  }
}
