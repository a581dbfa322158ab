// The WebRTC client's answer to a full region (infra/node/web/rtc.js, issue 33): an offer refused 503
// node_full with Retry-After is sent once more after that delay (capped), the page told it is waiting.
// fetch is a stub and the wait an injected clock: no network, no timers. Run: node --test tests/js/
// (tests/test_playout_js.py runs every file here under pytest).

import assert from "node:assert/strict";
import { afterEach, test } from "node:test";

import { RETRY_AFTER_CAP_S, offerRetryMs, postOffer } from "../../infra/node/web/rtc.js";

const FULL = "node_full: node full: all 2 slots in use (max_sessions=2); try again later\n";
const realFetch = globalThis.fetch;

/** A fetch stub answering `answers` in turn ({status, body, headers}); records each call's url and init. */
function stubFetch(answers) {
  const calls = [];
  globalThis.fetch = async (url, init) => {
    calls.push({ url, init });
    const next = answers[calls.length - 1];
    assert.ok(next, `fetch called ${calls.length} times, ${answers.length} answers prepared`);
    return new Response(next.body, { status: next.status, headers: next.headers ?? {} });
  };
  return calls;
}

function clock() {
  const waits = [];
  return { waits, sleep: async (ms) => void waits.push(ms) };
}

afterEach(() => {
  globalThis.fetch = realFetch;
});

const INIT = { method: "POST", headers: { "Content-Type": "application/sdp" }, body: "v=0\r\n" };

test("a node_full offer is sent again after Retry-After, once, and the page is told it waits", async () => {
  const calls = stubFetch([
    { status: 503, body: FULL, headers: { "Retry-After": "5" } },
    { status: 201, body: "v=0 answer", headers: { Location: "/api/rtc/s1/k" } },
  ]);
  const { waits, sleep } = clock();
  const told = [];
  const posted = await postOffer("/r/us-central1/api/rtc?x=1", INIT, { onWait: (ms) => told.push(ms), sleep });
  assert.equal(posted.response.status, 201);
  assert.equal(posted.body, "v=0 answer");
  assert.equal(posted.waitedMs, 5000);
  assert.deepEqual(told, [5000]);
  assert.deepEqual(waits, [5000]);
  assert.equal(calls.length, 2);
  for (const call of calls) {
    assert.equal(call.url, "/r/us-central1/api/rtc?x=1"); // the same offer, to the same place
    assert.equal(call.init.body, INIT.body);
  }
});

test("a second node_full is the answer: one retry only", async () => {
  const calls = stubFetch([
    { status: 503, body: FULL, headers: { "Retry-After": "5" } },
    { status: 503, body: FULL, headers: { "Retry-After": "5" } },
  ]);
  const { waits, sleep } = clock();
  const posted = await postOffer("/api/rtc", INIT, { sleep });
  assert.equal(posted.response.status, 503);
  assert.equal(posted.body, FULL);
  assert.equal(calls.length, 2);
  assert.deepEqual(waits, [5000]);
});

test("other answers are not retried", async () => {
  for (const answer of [
    { status: 201, body: "v=0", headers: { "Retry-After": "5" } },
    { status: 503, body: "draining: the node is draining\n", headers: { "Retry-After": "5" } },
    { status: 429, body: "rate_limited: slow down\n", headers: { "Retry-After": "5" } },
    { status: 503, body: FULL }, // no Retry-After
  ]) {
    const calls = stubFetch([answer]);
    const { waits, sleep } = clock();
    const told = [];
    const posted = await postOffer("/api/rtc", INIT, { onWait: (ms) => told.push(ms), sleep });
    assert.equal(posted.response.status, answer.status);
    assert.equal(posted.waitedMs, 0);
    assert.equal(calls.length, 1, answer.body);
    assert.deepEqual(waits, []);
    assert.deepEqual(told, []);
  }
});

test("Retry-After: delta-seconds only, capped", () => {
  assert.equal(RETRY_AFTER_CAP_S, 10);
  assert.equal(offerRetryMs(503, "node_full", "5"), 5000);
  assert.equal(offerRetryMs(503, "node_full", " 3 "), 3000);
  assert.equal(offerRetryMs(503, "node_full", "0"), 0);
  assert.equal(offerRetryMs(503, "node_full", "10"), 10000);
  assert.equal(offerRetryMs(503, "node_full", "120"), 10000); // the cap
  assert.equal(offerRetryMs(503, "node_full", "Wed, 21 Oct 2015 07:28:00 GMT"), null);
  assert.equal(offerRetryMs(503, "node_full", "-1"), null);
  assert.equal(offerRetryMs(503, "node_full", "1.5"), null);
  assert.equal(offerRetryMs(503, "node_full", ""), null);
  assert.equal(offerRetryMs(503, "node_full", null), null);
  assert.equal(offerRetryMs(503, "wait_timeout", "5"), null);
  assert.equal(offerRetryMs(502, "node_full", "5"), null);
});
