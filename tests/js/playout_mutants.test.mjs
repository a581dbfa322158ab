// The playout buffer's arithmetic (infra/node/web/playout.js) pinned on small hand-worked cases: each
// decision's numbers, the counters, the options, stretch()'s choice of splice. Written to kill StrykerJS's
// survivors (make mutation-js; docs/mutation.md, "Browser client (StrykerJS)"); playout.test.mjs holds the
// behaviour under arrival patterns. Run: node --test tests/js/ (tests/test_playout_js.py runs it under pytest).

import assert from "node:assert/strict";
import { test } from "node:test";

import { CAP_MS, FLOOR_MS, JitterHistogram, Playout, RECENT_FRAMES, stretch } from "../../infra/node/web/playout.js";

const FRAME_MS = 80;

/** `count` frames on time every 80 ms from `t0`, scheduled as player.js does; the next frame's time. With
 *  the defaults each frame finds FLOOR_MS (40 ms) queued. */
function onTime(playout, count, t0 = 1000) {
  let now = t0;
  for (let i = 0; i < count; i++, now += FRAME_MS) {
    const decision = playout.arrive(now, FRAME_MS);
    playout.scheduled(now, decision.startMs, FRAME_MS - decision.stretchMs, decision.stretchMs);
  }
  return now;
}

test("a frame 100 ms late underruns: it starts target ms from now, the target up by the 40 ms cap", () => {
  const playout = new Playout();
  const due = onTime(playout, 50);
  assert.equal(playout.targetMs, FLOOR_MS);
  // It finds -60 ms queued: it needed 110 ms of lead (40 more), the target covers 40 + 40 - 10 = 70 ms of
  // jitter (+ the 10 ms start margin). Its own lateness is not a jitter sample (the underrun counts instead).
  const decision = playout.arrive(due + 100, FRAME_MS);
  assert.deepEqual(decision, { action: "play", startMs: due + 100 + 80, stretchMs: 0, underrun: true });
  assert.equal(playout.targetMs, 80);
  assert.equal(playout.underruns, 1);
  playout.scheduled(due + 100, decision.startMs, FRAME_MS);
  assert.deepEqual(playout.recent, { frames: 51, leadMaxMs: 80, underruns: 1 });
});

test("an underrun's step: what the frame lacked, at least 20 ms, at most 40 ms", () => {
  // 55 ms late: -15 ms queued, 25 ms more lead needed; covered 40 + 25 - 10 = 55 -> bucket edge 56, + 10.
  let playout = new Playout();
  let due = onTime(playout, 50);
  assert.equal(playout.arrive(due + 55, FRAME_MS).underrun, true);
  assert.equal(playout.targetMs, 66);
  // 35 ms late: 5 ms queued (under the 10 ms margin): 5 ms lacking, raised to the 20 ms minimum.
  playout = new Playout();
  due = onTime(playout, 50);
  assert.equal(playout.arrive(due + 35, FRAME_MS).underrun, true);
  assert.equal(playout.targetMs, 60);
});

test("a frame finding exactly the 10 ms margin plays on time, its jitter not taken as lead", () => {
  const playout = new Playout();
  const due = onTime(playout, 50);
  const decision = playout.arrive(due + 30, FRAME_MS);
  // 10 ms queued + 30 ms jitter = the 40 ms a frame on time finds: on target, nothing to stretch.
  assert.deepEqual(decision, { action: "play", startMs: due + 40, stretchMs: 0, underrun: false });
  assert.equal(playout.jitterMs, 30);
  assert.equal(playout.underruns, 0);
});

test("after a gap from a step in path delay, the next frames are measured on the new timeline", () => {
  const playout = new Playout();
  const due = onTime(playout, 50);
  // Every frame from here on 100 ms later: the first underruns, the next ones are on time again.
  const late = playout.arrive(due + 100, FRAME_MS);
  playout.scheduled(due + 100, late.startMs, FRAME_MS);
  const target = playout.targetMs;
  for (let i = 1; i <= 8; i++) {
    const decision = playout.arrive(due + 100 + i * FRAME_MS, FRAME_MS);
    assert.equal(playout.jitterMs, 0, `frame ${i} after the gap`);
    playout.scheduled(due + 100 + i * FRAME_MS, decision.startMs, FRAME_MS - decision.stretchMs, decision.stretchMs);
  }
  assert.ok(playout.targetMs <= target);
});

test("the jitter window: a frame exactly 500 ms old still counts, a slow drift is no jitter", () => {
  const playout = new Playout();
  playout.arrive(0, 100);
  playout.scheduled(0, 40, 100);
  playout.arrive(500, 100); // 400 ms later than the sender's timeline, against the frame of 0 ms
  assert.equal(playout.jitterMs, 400);
  // A sender 0.2 % slow for 60 s: 0.16 ms more delay per frame, 120 ms in all, never more than the
  // window's worth of jitter.
  const drift = new Playout();
  let worst = 0;
  for (let i = 0; i < 750; i++) {
    const now = 1000 + i * FRAME_MS * 1.002;
    const decision = drift.arrive(now, FRAME_MS);
    if (decision.action === "play") drift.scheduled(now, decision.startMs, FRAME_MS - decision.stretchMs, decision.stretchMs);
    worst = Math.max(worst, drift.jitterMs);
  }
  assert.ok(worst < 2, `jitter ${worst}`);
  assert.equal(drift.targetMs, FLOOR_MS);
});

test("the first frame is no jitter sample (a histogram of one quantile shows it)", () => {
  // The median of quickly forgotten samples, no floor: with the first frame's 0 ms counted it would be 0.
  const playout = new Playout({ quantile: 0.3, forget: 0.5, floorMs: 0 });
  const first = playout.arrive(0, FRAME_MS);
  playout.scheduled(0, first.startMs, FRAME_MS);
  playout.arrive(110, FRAME_MS); // 30 ms late, 10 ms queued
  assert.equal(playout.jitterMs, 30);
  assert.equal(playout.targetMs, 40); // 30 + the 10 ms start margin
});

test("a frame finding exactly the 10 ms margin is a jitter sample, not an underrun", () => {
  const playout = new Playout({ quantile: 0.3, forget: 0.5, floorMs: 0 });
  playout.arrive(0, FRAME_MS);
  playout.scheduled(0, 40, 120); // the next frame is due to start at 160
  const decision = playout.arrive(150, FRAME_MS); // 70 ms late on the sender's timeline, 10 ms queued
  assert.equal(decision.underrun, false);
  assert.equal(playout.jitterMs, 70);
  assert.equal(playout.targetMs, 80); // its 70 ms counted (+ the 10 ms start margin)
});

test("the drop limit: a frame finding target + 160 ms plays, one more ms is dropped", () => {
  const playout = new Playout();
  playout.arrive(0, FRAME_MS);
  playout.scheduled(0, 40, 240); // 200 ms queued at 80 ms
  const decision = playout.arrive(80, FRAME_MS);
  assert.equal(decision.action, "play");
  assert.equal(decision.startMs, 280);
  const more = new Playout();
  more.arrive(0, FRAME_MS);
  more.scheduled(0, 40, 241);
  assert.deepEqual(more.arrive(80, FRAME_MS), { action: "drop" });
  assert.equal(more.dropped, 1);
});

test("stretching: nothing within 5 ms of the target, then the error, at most 10 ms and a quarter frame", () => {
  const stretchFor = (queuedMs, durationMs) => {
    const playout = new Playout();
    playout.arrive(0, FRAME_MS);
    playout.scheduled(0, 40, 40 + queuedMs); // the next frame, at 80 ms, finds queuedMs
    return playout.arrive(80, durationMs).stretchMs;
  };
  assert.equal(stretchFor(45, FRAME_MS), 0);
  assert.equal(stretchFor(44, FRAME_MS), 0);
  assert.equal(stretchFor(46, FRAME_MS), 6);
  assert.equal(stretchFor(70, FRAME_MS), 10);
  assert.equal(stretchFor(20, FRAME_MS), -10);
  assert.equal(stretchFor(70, 20), 5); // a 20 ms frame is cut by 5 ms at most
});

test("the counters: audio shortened and lengthened, mean and largest lead, recent underruns", () => {
  const playout = new Playout();
  assert.equal(playout.leadMeanMs, 0);
  playout.arrive(0, FRAME_MS);
  playout.scheduled(0, 40, 80, 0);
  playout.arrive(80, FRAME_MS);
  playout.scheduled(80, 120, 77, 3);
  playout.arrive(160, FRAME_MS);
  playout.scheduled(160, 197, 84, -4);
  assert.equal(playout.shortenedMs, 3);
  assert.equal(playout.lengthenedMs, 4);
  assert.equal(playout.leadMaxMs, 40);
  assert.equal(playout.leadMeanMs, (40 + 40 + 37) / 3);
  assert.deepEqual(playout.recent, { frames: 3, leadMaxMs: 40, underruns: 0 });
  assert.equal(RECENT_FRAMES, 125);
});

test("queuedMs(): the audio ahead of now, 0 when none; reset() forgets the schedule", () => {
  const playout = new Playout();
  assert.equal(playout.queuedMs(0), 0);
  playout.arrive(0, FRAME_MS);
  playout.scheduled(0, 40, 80);
  assert.equal(playout.queuedMs(100), 20);
  assert.equal(playout.queuedMs(500), 0);
  playout.reset();
  assert.equal(playout.queuedMs(100), 0);
  assert.equal(playout.framesScheduled, 1);
  // The next frame starts a new schedule; with nothing queued it is a gap, the step the largest.
  const decision = playout.arrive(5, FRAME_MS);
  assert.deepEqual(decision, { action: "play", startMs: 85, stretchMs: 0, underrun: true });
  assert.equal(playout.targetMs, 80);
});

test("the options: floor, cap, start, forget and the histogram's size", () => {
  assert.equal(new Playout({ startMs: 10 }).targetMs, FLOOR_MS);
  assert.equal(new Playout({ startMs: 100 }).targetMs, 100);
  assert.equal(new Playout({ startMs: 1000 }).targetMs, CAP_MS);
  const playout = new Playout({ capMs: 100, forget: 0.9 });
  assert.equal(playout.histogram.weights.length, 51); // 2 ms buckets up to 100 ms
  assert.equal(playout.histogram.forget, 0.9);
  assert.equal(new Playout().histogram.forget, 0.98);
});

test("arrive() names what it refused", () => {
  assert.throws(() => new Playout().arrive(0, -80), {
    name: "RangeError",
    message: "a frame needs finite times and a positive duration, got 0, 0, -80",
  });
});

test("the histogram's quantile: the first edge with q of the weight at or below it; the cap at most", () => {
  const h = new JitterHistogram({ bucketMs: 2, capMs: 400, forget: 1 });
  h.add(0, 1);
  h.add(10, 1);
  assert.equal(h.quantile(0.5), 0); // exactly half the weight at 0 ms
  assert.equal(h.quantile(0.51), 10);
  assert.equal(h.quantile(2), 400); // more than all the weight: the top edge
});

// --- stretch() ---------------------------------------------------------------------------------------------

/** A seeded uniform generator in [0, 1) (mulberry32). */
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

/** Loud noise, except that s[q + i] = s[q + k + i] for i in [0, length) at each q of `repeats` (quiet
 *  noise there): the frame repeats itself, after k samples, at those points only. */
function repeating(n, k, repeats, length = 240, seed = 7) {
  const rand = random(seed);
  const s = new Float32Array(n);
  for (let i = 0; i < n; i++) s[i] = 0.8 * (2 * rand() - 1);
  for (const q of repeats) {
    for (let i = 0; i < length; i++) s[Math.min(q, q + k) + i] = 0.05 * (2 * rand() - 1);
    for (let i = 0; i < length; i++) {
      if (k > 0) s[q + k + i] = s[q + i];
      else s[q + i] = s[q + k + i];
    }
  }
  return s;
}

/** The frame spliced at q with identical segments across the fade: s[0, q + fade) + s[q + k + fade, n). */
function splicedAt(s, k, q, fade = 240) {
  return Float32Array.from([...s.subarray(0, q + fade), ...s.subarray(q + k + fade)]);
}

test("stretch() splices where the frame repeats itself, shortening or lengthening", () => {
  for (const [k, q] of [
    [100, 400], // candidates every 8 samples from 0
    [-100, 500], // lengthening: candidates every 8 samples from 100
    [240, 1440], // the last candidate: n - fade - k
  ]) {
    const s = repeating(1920, k, [q]);
    assert.deepEqual(stretch(s, k), splicedAt(s, k, q), `k ${k}, q ${q}`);
  }
});

test("stretch() compares the fade's samples only, and takes the first of equal splices", () => {
  // Both repeat over the 240 samples of the fade; the second over one sample more (which is not compared).
  const s = repeating(1920, 100, [400], 240, 11);
  const rand = random(12);
  for (let i = 0; i < 241; i++) s[900 + i] = 0.05 * (2 * rand() - 1);
  for (let i = 0; i < 241; i++) s[1000 + i] = s[900 + i];
  assert.deepEqual(stretch(s, 100), splicedAt(s, 100, 400));
});

test("stretch() splices into silence as soon as one side of the fade is silent", () => {
  const rand = random(5);
  const s = new Float32Array(1920);
  for (let i = 0; i < 960; i++) s[i] = 0.8 * (2 * rand() - 1);
  const out = stretch(s, 240);
  // The first candidate whose later segment is silent: 720 (the noise fades out over 720..960).
  assert.deepEqual(out.subarray(0, 720), s.subarray(0, 720));
  for (let i = 0; i < 240; i++) assert.ok(Math.abs(out[720 + i] - (1 - (i + 0.5) / 240) * s[720 + i]) < 1e-6, `${i}`);
  assert.ok(out.subarray(960).every((v) => v === 0));
});

test("stretch(): a frame of exactly |k| + fade samples has one splice, its cross-fade weights (i + 0.5) / fade", () => {
  const out = stretch(Float32Array.from([1, 1, 1, 1, 0, 0]), 2, 4);
  assert.deepEqual([...out], [1, 1, 0.375, 0.125]);
  const longer = stretch(Float32Array.from([1, 1, 1, 1, 0, 0]), -2, 4);
  assert.equal(longer.length, 8);
});
