// The adaptive playout buffer's logic, with no browser in it: what to do with each 80 ms frame that
// arrives (when to start it, whether to shorten or lengthen it first), decided from arrival times on a
// clock the caller passes in (ms). player.js applies the decisions to an AudioContext; tests drive this
// module with a synthetic clock and arrival patterns (tests/js/playout.test.mjs, run by node).
//
// The model is WebRTC's NetEq (modules/audio_coding/neteq: delay_manager.cc, decision_logic.cc,
// time_stretch.cc), cut down to one reliable, in-order stream of 80 ms frames:
// - Jitter. Frame i should arrive at t0 + (audio before it), the sender's own timeline; its relative delay
//   is how much later it came. Its jitter is that delay minus the smallest relative delay of the frames of
//   the last 500 ms (NetEq: delay relative to the fastest packet of a 2 s window; with 80 ms frames a 2 s
//   window counts a step in path delay, such as the lost time of a stall, as jitter 25 times over), so a
//   slow clock drift or a shift of the whole path does not count. The estimate is a high quantile (99 %)
//   of a histogram of jitter samples in 2 ms buckets that forgets old samples exponentially (as NetEq's).
// - Target. The lead a frame needs on arrival (audio still queued ahead of the playhead) so that frames as
//   late as the estimate still start in time: the quantile plus a start margin, clamped to a floor and a
//   cap. An underrun (a frame came after the queue ran dry: an audible gap) counts the lead that frame
//   needed with a heavy weight, so the target covers it at once and for about 12 s (by 20 ms more at least:
//   in a browser the gap may come from the audio clock itself, a render thread that stalled and caught
//   up; by 40 ms more at most: a sender that stalled for seconds, say a node that fell behind, must not
//   leave seconds of delay), then forgets it like any other sample. The gap also restarts the jitter
//   window: the frames after it are measured against the new timeline, not against the lost time.
// - Level. The lead at each arrival, `lead`, moves with that frame's jitter; lead + jitter is the lead a
//   frame on time would have found, and changes only when the player stretches audio. When it stands
//   above the target the frame is shortened (time-compressed: NetEq's accelerate); below it, lengthened
//   (NetEq's preemptive expand); by at most MAX_STRETCH_MS a frame, so the correction is gradual and
//   speech keeps its pitch (stretch() splices the frame where it repeats itself best).
// - Underrun. A frame that finds less than START_MARGIN_MS queued starts `target` ms from now (a gap
//   now, a full buffer after). A frame that finds more than target + EXCESS_MAX_MS queued (a burst after a
//   stall) is dropped: the conversation's delay stays bounded.

export const FLOOR_MS = 40; // the smallest target lead: 30 ms of lateness hidden (a browser's own hiccups)
export const START_MS = 40; // the target before any jitter is known: half a frame
export const CAP_MS = 400; // the largest target lead
export const START_MARGIN_MS = 10; // a frame started closer than this to the playhead may start late
export const QUANTILE = 0.99; // of the jitter histogram: the target covers 99 % of the frames
export const FORGET = 0.98; // per frame: one late frame holds the target for 34 frames (2.7 s)
export const UNDERRUN_WEIGHT = 0.2; // an underrun holds the target for 148 frames (12 s)
export const WINDOW_MS = 500; // jitter is measured against the fastest frame of this window
export const BUCKET_MS = 2; // histogram bucket width
export const HYSTERESIS_MS = 5; // lead error left alone (no stretching for a few ms)
export const MAX_STRETCH_MS = 10; // the most audio one frame is shortened or lengthened by
export const EXCESS_MAX_MS = 160; // a frame finding target + this queued is dropped
export const UNDERRUN_STEP_MIN_MS = 20; // an underrun raises the target by this much at least...
export const UNDERRUN_STEP_MAX_MS = 40; // ...and by this much at most
export const RECENT_FRAMES = 125; // the "recent" counters cover the last 10 s of 80 ms frames

/** A decaying histogram of jitter samples (ms), read as a quantile. */
export class JitterHistogram {
  constructor({ bucketMs = BUCKET_MS, capMs = CAP_MS, forget = FORGET } = {}) {
    this.bucketMs = bucketMs;
    this.forget = forget;
    this.weights = new Float64Array(Math.ceil(capMs / bucketMs) + 1);
    this.total = 0;
  }

  /** Add one sample (ms, >= 0; clamped to the cap) with weight `weight`, after forgetting. */
  add(jitterMs, weight = 1 - this.forget) {
    for (let i = 0; i < this.weights.length; i++) this.weights[i] *= this.forget;
    this.total *= this.forget;
    const index = Math.min(this.weights.length - 1, Math.max(0, Math.ceil(jitterMs / this.bucketMs)));
    this.weights[index] += weight;
    this.total += weight;
  }

  /** The smallest bucket edge (ms) below which at least `q` (0..1) of the weight lies; 0 when empty. */
  quantile(q) {
    if (this.total <= 0) return 0;
    let below = 0;
    for (let i = 0; i < this.weights.length; i++) {
      below += this.weights[i];
      if (below >= q * this.total) return i * this.bucketMs;
    }
    return (this.weights.length - 1) * this.bucketMs;
  }
}

/**
 * The playout decisions for one conversation. Times are ms on one clock (the player's: the AudioContext's
 * currentTime x 1000); durations are ms of audio. arrive() is called once per frame, in order.
 */
export class Playout {
  constructor(options = {}) {
    this.floorMs = options.floorMs ?? FLOOR_MS;
    this.capMs = options.capMs ?? CAP_MS;
    this.quantile = options.quantile ?? QUANTILE;
    this.histogram = new JitterHistogram({ capMs: this.capMs, forget: options.forget ?? FORGET });
    this.targetMs = Math.min(this.capMs, Math.max(this.floorMs, options.startMs ?? START_MS));
    this.nextStartMs = null; // where the next frame starts on the clock; null: nothing scheduled yet
    this.senderMs = 0; // audio the sender has sent before the next frame (its timeline)
    this.firstArrivalMs = null;
    this.window = []; // [arrivalMs, relativeDelayMs] of the last WINDOW_MS
    // Counters (the page shows them; tests read them).
    this.frames = 0; // frames arrived
    this.framesScheduled = 0;
    this.underruns = 0; // frames that came after the queue ran dry mid-conversation (audible gaps)
    this.dropped = 0; // frames dropped for arriving with target + EXCESS_MAX_MS queued
    this.shortenedMs = 0; // audio removed by time compression
    this.lengthenedMs = 0; // audio added by time expansion
    this.jitterMs = 0; // the last frame's jitter
    this.leadMs = 0; // the last scheduled frame's lead: how long its first sample waits to be played
    this.leadSumMs = 0; // over the scheduled frames, for the mean
    this.leadMaxMs = 0;
    this.targetMaxMs = this.targetMs;
    this.recentLeads = []; // [leadMs, underrun] of the last RECENT_FRAMES scheduled frames
    this.pendingUnderrun = false; // whether the frame of the last arrive() underran
  }

  /** Largest lead (ms) and underruns among the last RECENT_FRAMES scheduled frames (fewer at the start). */
  get recent() {
    let leadMaxMs = 0;
    let underruns = 0;
    for (const [lead, underrun] of this.recentLeads) {
      leadMaxMs = Math.max(leadMaxMs, lead);
      if (underrun) underruns += 1;
    }
    return { frames: this.recentLeads.length, leadMaxMs, underruns };
  }

  /** Mean lead of the scheduled frames (ms): the delay the buffer adds, frame by frame. */
  get leadMeanMs() {
    return this.framesScheduled === 0 ? 0 : this.leadSumMs / this.framesScheduled;
  }

  /** Audio queued ahead of `nowMs` (ms), 0 when none. */
  queuedMs(nowMs) {
    return this.nextStartMs === null ? 0 : Math.max(0, this.nextStartMs - nowMs);
  }

  /**
   * One frame of `durationMs` arrived at `nowMs` (the playout clock). `arrivalMs`: the same moment on a
   * finer clock for the jitter (the page's performance.now(); the AudioContext's clock moves in steps of
   * its render buffer), by default nowMs. Returns what to do with the frame:
   *   {action: "play", startMs, stretchMs, underrun}: shorten the frame by stretchMs (negative: lengthen
   *     it by -stretchMs), then call scheduled(nowMs, startMs, the duration it now has, the ms it was
   *     actually shortened by);
   *   {action: "drop"}: discard it (too much queued).
   * Throws RangeError for a duration that is not a positive number.
   */
  arrive(nowMs, durationMs, arrivalMs = nowMs) {
    if (!(durationMs > 0) || !Number.isFinite(nowMs) || !Number.isFinite(arrivalMs)) {
      throw new RangeError(
        `a frame needs finite times and a positive duration, got ${nowMs}, ${arrivalMs}, ${durationMs}`,
      );
    }
    const jitter = this.measure(arrivalMs);
    this.senderMs += durationMs;
    this.frames += 1;
    const queued = this.nextStartMs === null ? -Infinity : this.nextStartMs - nowMs;
    const underran = queued < START_MARGIN_MS && this.framesScheduled > 0;
    if (this.frames > 1 && !underran) {
      // The first frame has nothing to be late against; an underrun counts below instead.
      this.histogram.add(jitter);
      this.updateTarget();
    }
    if (queued < START_MARGIN_MS) {
      const underrun = this.framesScheduled > 0;
      if (underrun) {
        this.underruns += 1;
        // The lead this frame needed: START_MARGIN_MS more than it found, on top of what it found.
        const needed = this.targetMs + START_MARGIN_MS - queued;
        const step = Math.min(Math.max(needed - this.targetMs, UNDERRUN_STEP_MIN_MS), UNDERRUN_STEP_MAX_MS);
        const covered = this.targetMs + step - START_MARGIN_MS;
        this.histogram.add(covered, UNDERRUN_WEIGHT);
        this.updateTarget();
        this.window = this.window.slice(-1); // this frame starts the new timeline
      }
      this.pendingUnderrun = underrun;
      return { action: "play", startMs: nowMs + this.targetMs, stretchMs: 0, underrun };
    }
    if (queued > this.targetMs + EXCESS_MAX_MS) {
      this.dropped += 1;
      return { action: "drop" };
    }
    // The lead a frame on time would have found, against the target.
    const error = queued + jitter - this.targetMs;
    let stretchMs = 0;
    if (Math.abs(error) > HYSTERESIS_MS) {
      stretchMs = Math.sign(error) * Math.min(Math.abs(error), MAX_STRETCH_MS, durationMs / 4);
    }
    this.pendingUnderrun = false;
    return { action: "play", startMs: this.nextStartMs, stretchMs, underrun: false };
  }

  /** The frame of the last arrive() was scheduled at `startMs` for `durationMs` of audio; at `nowMs`. */
  scheduled(nowMs, startMs, durationMs, stretchMs = 0) {
    this.nextStartMs = startMs + durationMs;
    this.framesScheduled += 1;
    if (stretchMs > 0) this.shortenedMs += stretchMs;
    if (stretchMs < 0) this.lengthenedMs -= stretchMs;
    this.leadMs = Math.max(0, startMs - nowMs);
    this.leadSumMs += this.leadMs;
    this.leadMaxMs = Math.max(this.leadMaxMs, this.leadMs);
    this.recentLeads.push([this.leadMs, this.pendingUnderrun]);
    if (this.recentLeads.length > RECENT_FRAMES) this.recentLeads.shift();
  }

  /** Forget the schedule (the player stopped); counters and the jitter estimate stay. */
  reset() {
    this.nextStartMs = null;
  }

  // Jitter of a frame arriving now (ms), against the fastest frame of the window.
  measure(nowMs) {
    if (this.firstArrivalMs === null) this.firstArrivalMs = nowMs;
    const relative = nowMs - this.firstArrivalMs - this.senderMs;
    this.window.push([nowMs, relative]);
    while (this.window[0][0] < nowMs - WINDOW_MS) this.window.shift();
    let fastest = relative;
    for (const [, delay] of this.window) fastest = Math.min(fastest, delay);
    const jitter = relative - fastest;
    this.jitterMs = jitter;
    return jitter;
  }

  updateTarget() {
    const wanted = this.histogram.quantile(this.quantile) + START_MARGIN_MS;
    this.targetMs = Math.min(this.capMs, Math.max(this.floorMs, wanted));
    this.targetMaxMs = Math.max(this.targetMaxMs, this.targetMs);
  }
}

/**
 * Shorten (stretchSamples > 0) or lengthen (< 0) a frame of Float32 samples by |stretchSamples|, keeping
 * its pitch: one splice where the frame best repeats itself, 10 ms of cross-fade across it (an overlap-add
 * splice, as NetEq's accelerate and preemptive expand do, on one frame). Returns a new Float32Array of
 * samples.length - stretchSamples samples; the input unchanged when the frame is too short to splice.
 * fadeSamples: cross-fade length (240 = 10 ms at 24 kHz).
 */
export function stretch(samples, stretchSamples, fadeSamples = 240) {
  const n = samples.length;
  const k = Math.round(stretchSamples);
  if (k === 0 || Math.abs(k) + fadeSamples > n) return samples;
  // Splice at q: out = s[0, q) + fade(s[q, q + X) -> s[q + k, q + k + X)) + s[q + k + X, n).
  const first = Math.max(0, -k);
  const last = n - fadeSamples - Math.max(0, k);
  let bestQ = first;
  let bestScore = -Infinity;
  const step = 8; // candidate splice points every 8 samples (1/3 ms)
  for (let q = first; q <= last; q += step) {
    let dot = 0;
    let energyA = 0;
    let energyB = 0;
    for (let i = 0; i < fadeSamples; i += 2) {
      const a = samples[q + i];
      const b = samples[q + k + i];
      dot += a * b;
      energyA += a * a;
      energyB += b * b;
    }
    // Normalised correlation; silence (no energy) splices anywhere without a sound.
    const energy = Math.sqrt(energyA * energyB);
    const score = energy < 1e-9 ? 1 : dot / energy;
    if (score > bestScore) {
      bestScore = score;
      bestQ = q;
    }
  }
  const out = new Float32Array(n - k);
  out.set(samples.subarray(0, bestQ), 0);
  for (let i = 0; i < fadeSamples; i++) {
    const w = (i + 0.5) / fadeSamples; // weight of the second segment, rising
    out[bestQ + i] = (1 - w) * samples[bestQ + i] + w * samples[bestQ + k + i];
  }
  out.set(samples.subarray(bestQ + k + fadeSamples), bestQ + fadeSamples);
  return out;
}
