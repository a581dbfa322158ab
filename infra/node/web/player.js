// Gap-free playback of the node's 24 kHz audio frames through an AudioContext, behind an adaptive playout
// buffer (playout.js decides; this file applies its decisions to the AudioContext).
//
// Each 80 ms frame becomes an AudioBuffer (24 kHz; the browser resamples it to the context's rate) played
// by an AudioBufferSourceNode scheduled to start exactly where the previous frame ends, so consecutive
// frames join without a gap. The first frame (and the first after an underrun) starts the playout target
// after it arrives: that lead is the buffer, how late a frame may come without being heard as a gap. The
// target follows the measured jitter (low on a clean path, up after underruns, down again when the path
// calms); frames are shortened or lengthened by a few ms to bring the lead to it (playout.js stretch()).

import { SAMPLE_RATE_HZ } from "./protocol.js";
import { Playout, stretch } from "./playout.js";

export class Player {
  /** context: the page's AudioContext; output: where the audio goes (default the speakers); options:
   *  playout.js Playout's (floorMs, capMs, startMs, quantile, forget), for tests and tuning. */
  constructor(context, output = context.destination, options = {}) {
    this.context = context;
    this.output = output;
    this.playout = new Playout(options);
    this.sources = new Set();
  }

  /** Audio queued ahead of the playhead (ms). */
  get bufferedMs() {
    return this.playout.queuedMs(this.context.currentTime * 1000);
  }

  /** Context time (s) at which the next frame starts; 0 before the first. */
  get nextStartS() {
    return (this.playout.nextStartMs ?? 0) / 1000;
  }

  get framesScheduled() {
    return this.playout.framesScheduled;
  }

  get underruns() {
    return this.playout.underruns;
  }

  get dropped() {
    return this.playout.dropped;
  }

  /** What the page shows and reports about the buffer (ms and counts; playout.js Playout's counters). */
  get report() {
    const p = this.playout;
    const recent = p.recent; // the last 125 frames (10 s)
    return {
      playoutRecentFrames: recent.frames,
      playoutRecentLeadMaxMs: recent.leadMaxMs,
      playoutRecentUnderruns: recent.underruns,
      playoutTargetMs: p.targetMs,
      playoutTargetMaxMs: p.targetMaxMs,
      playoutLeadMs: p.leadMs,
      playoutLeadMeanMs: p.leadMeanMs,
      playoutLeadMaxMs: p.leadMaxMs,
      playoutJitterMs: p.jitterMs,
      playoutShortenedMs: p.shortenedMs,
      playoutLengthenedMs: p.lengthenedMs,
    };
  }

  /** Schedule one frame of Float32 samples at 24 kHz, received at performance.now() = arrivalMs. */
  push(samples, arrivalMs = undefined) {
    if (samples.length === 0) return;
    const nowMs = this.context.currentTime * 1000;
    const durationMs = (1000 * samples.length) / SAMPLE_RATE_HZ;
    const decision = this.playout.arrive(nowMs, durationMs, arrivalMs ?? nowMs);
    if (decision.action === "drop") return;
    const stretchSamples = Math.round((decision.stretchMs * SAMPLE_RATE_HZ) / 1000);
    const played = stretch(samples, stretchSamples);
    const buffer = this.context.createBuffer(1, played.length, SAMPLE_RATE_HZ);
    buffer.copyToChannel(played, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.output);
    source.onended = () => {
      source.disconnect();
      this.sources.delete(source);
    };
    source.start(decision.startMs / 1000);
    this.sources.add(source);
    const actualStretchMs = ((samples.length - played.length) * 1000) / SAMPLE_RATE_HZ;
    this.playout.scheduled(nowMs, decision.startMs, buffer.duration * 1000, actualStretchMs);
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
    this.playout.reset();
  }
}
