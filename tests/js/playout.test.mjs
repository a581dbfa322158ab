// The adaptive playout buffer's logic (infra/node/web/playout.js) on a driven clock: synthetic arrival
// patterns of 80 ms frames, no browser, no wall clock. Run: node --test tests/js/ (tests/test_playout_js.py
// runs it under pytest).

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  CAP_MS,
  FLOOR_MS,
  JitterHistogram,
  MAX_STRETCH_MS,
  Playout,
  START_MARGIN_MS,
  START_MS,
  UNDERRUN_STEP_MAX_MS,
  stretch,
} from "../../infra/node/web/playout.js";

const FRAME_MS = 80;

/** A seeded uniform generator in [0, 1) (mulberry32), so that every run sees the same arrivals. */
function random(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Arrival times (ms) of frames sent every 80 ms from `t0`, each delayed by delayMs(i), delivered in order
 *  (one TCP stream: a frame never overtakes the one before it). */
function arrivals(count, delayMs, t0 = 1000) {
  const times = [];
  for (let i = 0; i < count; i++) {
    const t = t0 + i * FRAME_MS + delayMs(i);
    times.push(Math.max(t, times.length ? times[times.length - 1] : -Infinity));
  }
  return times;
}

/** Play `times` through `playout` as player.js does; per frame: its lead (ms, null when dropped), whether
 *  it underran, and the target after it. Also checks the schedule: frames never overlap. */
function play(playout, times) {
  const frames = [];
  for (const now of times) {
    const decision = playout.arrive(now, FRAME_MS);
    if (decision.action === "drop") {
      frames.push({ lead: null, underrun: false, target: playout.targetMs });
      continue;
    }
    const previousEnd = playout.nextStartMs;
    if (previousEnd !== null && !decision.underrun) assert.equal(decision.startMs, previousEnd);
    assert.ok(decision.startMs >= now, "a frame never starts before it arrives");
    assert.ok(Math.abs(decision.stretchMs) <= MAX_STRETCH_MS);
    playout.scheduled(now, decision.startMs, FRAME_MS - decision.stretchMs, decision.stretchMs);
    frames.push({ lead: decision.startMs - now, underrun: decision.underrun, target: playout.targetMs });
  }
  return frames;
}

const count = (frames, key) => frames.filter((f) => f[key]).length;
const leads = (frames) => frames.filter((f) => f.lead !== null).map((f) => f.lead);
const max = (values) => Math.max(...values);

test("clean path: starts at half a frame, settles at the floor, never underruns", () => {
  const playout = new Playout();
  const frames = play(playout, arrivals(750, () => 0)); // 60 s
  assert.equal(frames[0].lead, START_MS);
  assert.equal(count(frames, "underrun"), 0);
  assert.equal(playout.dropped, 0);
  assert.ok(max(leads(frames)) <= FRAME_MS, "one frame of lead or less, from the start");
  for (const f of frames.slice(10)) assert.ok(Math.abs(f.lead - FLOOR_MS) <= 5, `lead ${f.lead}`);
  assert.equal(playout.targetMs, FLOOR_MS);
  assert.ok(playout.leadMeanMs <= FLOOR_MS + 5);
});

test("a few ms of jitter: no underrun, the lead stays under the 60 ms goal", () => {
  const rand = random(1);
  const playout = new Playout();
  const frames = play(playout, arrivals(750, () => 8 * rand()));
  assert.equal(count(frames, "underrun"), 0);
  assert.ok(max(leads(frames)) <= 60, `max lead ${max(leads(frames))}`);
  assert.ok(playout.targetMs <= FLOOR_MS + 10);
});

test("injected jitter: bounded underruns, the buffer grows, then shrinks back when the path calms", () => {
  const rand = random(2);
  const playout = new Playout();
  const clean = 125; // 10 s of each phase
  const jitterMax = 150; // random 0-150 ms on every frame
  const delay = (i) => (i >= clean && i < 2 * clean ? jitterMax * rand() : 0);
  const frames = play(playout, arrivals(3 * clean + 375, delay));
  const [before, during, after] = [frames.slice(0, clean), frames.slice(clean, 2 * clean), frames.slice(2 * clean)];
  assert.equal(count(before, "underrun"), 0);
  const underruns = count(during, "underrun");
  // Without adapting, a fixed 20 ms lead underruns on most frames of this phase; the buffer learns it:
  // a handful of gaps, most of them at its start.
  assert.ok(underruns >= 1 && underruns <= 8, `underruns ${underruns}`);
  assert.ok(count(during.slice(40), "underrun") <= 2, "it stopped underrunning once it had grown");
  const grown = max(during.map((f) => f.target));
  assert.ok(grown >= 100 && grown <= CAP_MS, `target grew to ${grown}`);
  assert.ok(max(leads(during)) > 100);
  // Calm again: no gap while it shrinks, and it is back at the floor.
  assert.equal(count(after, "underrun"), 0);
  assert.equal(after.at(-1).target, FLOOR_MS);
  assert.ok(Math.abs(after.at(-1).lead - FLOOR_MS) <= 5, `lead ${after.at(-1).lead}`);
  // ...through time compression, not drops (gradually: MAX_STRETCH_MS a frame at most).
  assert.ok(playout.shortenedMs > 0);
  const firstAtFloor = after.findIndex((f) => f.target === FLOOR_MS);
  assert.ok(firstAtFloor > 0, "the estimate forgets jitter gradually, not at once");
});

test("a stall then a burst: one gap, frames dropped rather than delay kept, back to the target", () => {
  const playout = new Playout();
  // Frames 100..106 held 600 ms, then delivered at once with those queued behind them.
  const delay = (i) => (i >= 100 && i < 107 ? 600 - (i - 100) * FRAME_MS : 0);
  const frames = play(playout, arrivals(400, delay));
  assert.equal(count(frames, "underrun"), 1);
  assert.ok(playout.dropped >= 1, "a burst deeper than target + 160 ms is cut");
  for (const f of frames) if (f.lead !== null) assert.ok(f.lead <= playout.targetMaxMs + 160 + FRAME_MS);
  assert.ok(Math.abs(frames.at(-1).lead - playout.targetMs) <= 5 + MAX_STRETCH_MS);
});

test("clock drift (sender 0.2 % fast) and a step in path delay: no runaway, no repeated gaps", () => {
  const playout = new Playout();
  const frames = play(
    playout,
    arrivals(1500, (i) => -0.0016 * FRAME_MS * i + (i >= 700 ? 100 : 0)),
  );
  assert.ok(count(frames, "underrun") <= 1, "the step may cost one gap");
  const tail = frames.slice(-200);
  assert.equal(count(tail, "underrun"), 0);
  assert.ok(max(leads(tail)) <= 60, `lead ${max(leads(tail))}`);
});

test("a sender that falls behind for 2 s: gaps it cannot avoid, no seconds of delay left after it", () => {
  const playout = new Playout();
  // Frames 100..124 come 135 ms apart (a node overloaded for 2 s: its stream falls 1.4 s behind).
  let t = 1000;
  const times = [];
  for (let i = 0; i < 600; i++) times.push((t += i >= 100 && i < 125 ? 135 : FRAME_MS));
  const frames = play(playout, times);
  assert.ok(count(frames, "underrun") >= 1 && count(frames, "underrun") <= 25);
  // Each gap raises the target by UNDERRUN_STEP_MAX_MS at most, not by the time lost.
  assert.ok(playout.targetMaxMs <= 20 + 25 * 40 && playout.targetMaxMs < CAP_MS, `${playout.targetMaxMs}`);
  assert.ok(max(leads(frames.slice(100, 150))) <= playout.targetMaxMs + MAX_STRETCH_MS);
  // 38 s after it (the last 10 s): back under the goal, no gap. (Each gap is remembered for about 12 s.)
  assert.deepEqual(playout.recent.underruns, 0);
  assert.ok(playout.recent.leadMaxMs <= 60, `${playout.recent.leadMaxMs}`);
});

test("the recent counters cover the last 125 frames", () => {
  const playout = new Playout();
  play(playout, arrivals(100, () => 0));
  assert.equal(playout.recent.frames, 100);
  assert.equal(playout.recent.leadMaxMs, START_MS);
  play(playout, arrivals(125, () => 0, 1000 + 100 * FRAME_MS));
  assert.equal(playout.recent.frames, 125);
  assert.ok(playout.recent.leadMaxMs <= FLOOR_MS + 5 && playout.recent.underruns === 0);
});

test("the lead a frame gets covers 99 % of late frames: underruns are rare under steady jitter", () => {
  const rand = random(3);
  const playout = new Playout();
  const frames = play(playout, arrivals(3000, () => 40 * rand() ** 2)); // 4 minutes
  const late = count(frames.slice(250), "underrun");
  assert.ok(late <= 0.01 * 2750, `underruns ${late}`);
  // At most one underrun's step above what the jitter itself calls for.
  assert.ok(playout.targetMs <= 40 + START_MARGIN_MS + UNDERRUN_STEP_MAX_MS + 2, `${playout.targetMs}`);
});

test("arrive() refuses what is not a frame", () => {
  const playout = new Playout();
  assert.throws(() => playout.arrive(0, 0), RangeError);
  assert.throws(() => playout.arrive(Number.NaN, 80), RangeError);
  assert.throws(() => playout.arrive(0, 80, Infinity), RangeError);
  assert.equal(playout.frames, 0);
});

test("the jitter histogram: a quantile of what it saw, forgetting the old", () => {
  const h = new JitterHistogram({ bucketMs: 2, capMs: 400, forget: 0.98 });
  assert.equal(h.quantile(0.99), 0);
  for (let i = 0; i < 100; i++) h.add(i % 10 === 0 ? 50 : 4);
  assert.equal(h.quantile(0.5), 4);
  assert.equal(h.quantile(0.99), 50);
  for (let i = 0; i < 300; i++) h.add(4);
  assert.equal(h.quantile(0.99), 4);
  h.add(10_000); // clamped to the cap
  assert.equal(h.quantile(1), 400);
});

// --- stretch() ---------------------------------------------------------------------------------------------

function sine(frequencyHz, samples, rateHz = 24000) {
  const out = new Float32Array(samples);
  for (let i = 0; i < samples; i++) out[i] = 0.5 * Math.sin((2 * Math.PI * frequencyHz * i) / rateHz);
  return out;
}

function crossings(samples) {
  let n = 0;
  for (let i = 1; i < samples.length; i++) if (samples[i - 1] < 0 !== samples[i] < 0) n += 1;
  return n;
}

test("stretch() shortens and lengthens by the samples asked, keeping a tone's pitch and level", () => {
  const tone = sine(200, 1920);
  for (const k of [240, -240, 120, -37]) {
    const out = stretch(tone, k);
    assert.equal(out.length, 1920 - k);
    // The same pitch: zero crossings per sample unchanged (200 Hz: 1/60 per sample).
    const rate = crossings(out) / out.length;
    assert.ok(Math.abs(rate - 1 / 60) < 0.002, `k ${k}: ${rate}`);
    // No click at the splice: no step larger than the tone's own steepest.
    let steepest = 0;
    for (let i = 1; i < out.length; i++) steepest = Math.max(steepest, Math.abs(out[i] - out[i - 1]));
    assert.ok(steepest <= 0.5 * 2 * Math.PI * (200 / 24000) * 1.05, `k ${k}: step ${steepest}`);
    assert.ok(Math.max(...out.map(Math.abs)) <= 0.5 + 1e-6);
  }
  assert.equal(stretch(tone, 0), tone);
  const short = new Float32Array(100);
  assert.equal(stretch(short, 50), short, "too short to splice: unchanged");
  assert.ok(stretch(new Float32Array(1920), 240).every((v) => v === 0), "silence stays silent");
});
