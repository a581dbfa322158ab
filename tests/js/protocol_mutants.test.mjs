// The wire protocol's framing, the refusal words and the admission check (infra/node/web/protocol.js),
// byte for byte: written to kill StrykerJS's survivors (make mutation-js;
// docs/mutation.md, "Browser client (StrykerJS)").
// Run: node --test tests/js/ (tests/test_playout_js.py runs every file here under pytest).

import assert from "node:assert/strict";
import { afterEach, test } from "node:test";

import {
  FRAME_MS,
  FRAME_SAMPLES,
  Kind,
  REASONS,
  RESUME_HEADER,
  RESUME_SUBPROTOCOL_PREFIX,
  SAMPLE_RATE_HZ,
  TOKEN_SUBPROTOCOL_PREFIX,
  chatUrl,
  checkAdmission,
  decodeMessage,
  describe,
  encodeAudio,
  encodePing,
  reasonOfClose,
  reasonOfError,
  readToken,
  sessionQuery,
  textPromptOf,
} from "../../infra/node/web/protocol.js";

const bytes = (buffer) => [...new Uint8Array(buffer)];
const message = (kind, ...body) => new Uint8Array([kind, ...body]).buffer;
const utf8 = (text) => [...new TextEncoder().encode(text)];

test("the frame, the rate and the names the node reads are the runtime's", () => {
  assert.equal(SAMPLE_RATE_HZ, 24000);
  assert.equal(FRAME_SAMPLES, 1920);
  assert.equal(FRAME_MS, 80);
  // runtime/frontend/gate/tokens.py SUBPROTOCOL_PREFIX, runtime/frontend/gate/query.py RESUME_*.
  assert.equal(TOKEN_SUBPROTOCOL_PREFIX, "duplex.token.");
  assert.equal(RESUME_SUBPROTOCOL_PREFIX, "duplex.resume.");
  assert.equal(RESUME_HEADER, "Duplex-Resume-Credential");
});

test("every reason code has its own sentence", () => {
  assert.deepEqual(Object.keys(REASONS).sort(), [
    "bad_request", "bad_signature", "connection_failed", "connection_lost", "draining", "expired",
    "insufficient_scope", "lifetime_too_long", "malformed", "max_session_length", "microphone_denied",
    "microphone_missing", "missing", "node_full", "not_ready", "not_yet_valid", "origin_not_allowed",
    "persona_not_allowed", "protocol_error", "rate_limited", "replay_check_unavailable", "replayed",
    "revoked", "runtime_unavailable", "too_many_attempts", "unknown_key", "unsupported", "unsupported_model",
    "wrong_audience",
    "wrong_key_kind", "wrong_tenant", "wrong_token_kind",
  ]);
  const sentences = Object.values(REASONS);
  for (const sentence of sentences) assert.match(sentence, /^[A-Z].{20,}[.)]$/, sentence);
  assert.equal(new Set(sentences).size, sentences.length, "no two reasons read the same");
  assert.ok(Object.isFrozen(REASONS));
});

test("describe(): the reason's words, else the runtime's message, else a generic line", () => {
  assert.equal(describe("node_full"), REASONS.node_full);
  assert.equal(describe("node_full", "node full: 8 of 8 slots"), REASONS.node_full);
  assert.equal(describe("brand_new_reason", "the runtime's own words"), "the runtime's own words");
  assert.equal(describe("brand_new_reason"), "Something went wrong.");
  assert.equal(describe("brand_new_reason", ""), "Something went wrong.");
});

test("reasonOfError(): a 0x05 message's reason from how it starts", () => {
  assert.equal(reasonOfError("node full: every slot is in use"), "node_full");
  assert.equal(reasonOfError("node is draining: come back later"), "draining");
  assert.equal(reasonOfError("bad request: voice_prompt unknown"), "bad_request");
  assert.equal(reasonOfError("session reached max_session_s (600 s)"), "max_session_length");
  assert.equal(reasonOfError("frame_too_large: 70000 bytes"), "protocol_error");
  // Only the start counts: a detail that ends with a reason's words is a protocol error.
  assert.equal(reasonOfError("unexpected kind: not node full"), "protocol_error");
  assert.equal(reasonOfError("x: node is draining"), "protocol_error");
  assert.equal(reasonOfError("x: bad request"), "protocol_error");
  assert.equal(reasonOfError("x: session reached max_session_s"), "protocol_error");
});

test("reasonOfClose(): a close without a 0x05 message", () => {
  assert.equal(reasonOfClose(1000, "max_session_length"), "max_session_length");
  assert.equal(reasonOfClose(1001, ""), "draining");
  assert.equal(reasonOfClose(1013, ""), "node_full");
  assert.equal(reasonOfClose(1008, ""), "bad_request");
  assert.equal(reasonOfClose(1000, ""), "connection_lost");
  assert.equal(reasonOfClose(1006, "other"), "connection_lost");
});

test("the session query: format=pcm, the voice only when there is one", () => {
  assert.equal(String(sessionQuery()), "format=pcm");
  assert.equal(String(sessionQuery({})), "format=pcm");
  assert.equal(String(sessionQuery({ voicePrompt: "" })), "format=pcm");
  assert.equal(String(sessionQuery({ voicePrompt: "NATM1.pt" })), "format=pcm&voice_prompt=NATM1.pt");
  assert.equal(textPromptOf(), "");
  assert.equal(textPromptOf({}), "");
});

test("chatUrl(): wss:// from an https page, ws:// from a plain http one", () => {
  const persona = { voicePrompt: "NATM1.pt", textPrompt: "" };
  assert.equal(
    chatUrl({ protocol: "https:", host: "node.example.com" }, persona),
    "wss://node.example.com/api/chat?format=pcm&voice_prompt=NATM1.pt",
  );
  assert.equal(
    chatUrl({ protocol: "http:", host: "localhost:8080" }, persona),
    "ws://localhost:8080/api/chat?format=pcm&voice_prompt=NATM1.pt",
  );
});

// --- checkAdmission(): fetch replaced by a recording stand-in --------------------------------------------

const realFetch = globalThis.fetch;
afterEach(() => {
  globalThis.fetch = realFetch;
});

/** A fetch that records its calls and answers `status` with `body` and `contentType` (null: no header). */
function fakeFetch(status, body, contentType) {
  const calls = [];
  globalThis.fetch = async (url, init) => {
    calls.push({ url, init });
    return {
      ok: status >= 200 && status < 300,
      status,
      headers: { get: (name) => (name === "Content-Type" ? contentType : null) },
      json: async () => JSON.parse(body),
      text: async () => body,
    };
  };
  return calls;
}

const PAGE = { origin: "https://node.example.com" };

test("checkAdmission(): the query, the bearer token, no cache; the runtime's JSON answer as it is", async () => {
  const answer = { ok: false, status: 403, reason: "expired", message: "token expired" };
  const calls = fakeFetch(200, JSON.stringify(answer), "application/json; charset=utf-8");
  assert.deepEqual(await checkAdmission(PAGE, { voicePrompt: "NATM1.pt" }, "tok.en"), answer);
  assert.equal(calls.length, 1);
  assert.equal(
    calls[0].url,
    "/api/admission?format=pcm&voice_prompt=NATM1.pt&origin=https%3A%2F%2Fnode.example.com",
  );
  assert.deepEqual(calls[0].init, { headers: { Authorization: "Bearer tok.en" }, cache: "no-store" });
});

test("checkAdmission(): no token, no Authorization header", async () => {
  const calls = fakeFetch(200, '{"ok": true}', "application/json");
  assert.deepEqual(await checkAdmission(PAGE, {}, ""), { ok: true });
  assert.deepEqual(calls[0].init.headers, {});
});

test("checkAdmission(): nginx's own answers by status, its text trimmed", async () => {
  const cases = [
    [429, "too_many_attempts"],
    [502, "runtime_unavailable"],
    [503, "node_full"],
    [504, "runtime_unavailable"],
    [500, "connection_failed"],
    [404, "connection_failed"],
  ];
  for (const [status, reason] of cases) {
    fakeFetch(status, "  <html>busy</html>\n", "text/html");
    assert.deepEqual(await checkAdmission(PAGE, {}, "t"), { ok: false, status, reason, message: "<html>busy</html>" });
  }
  // A refusal in JSON that is not a 2xx is still read by its status; a 2xx that is not JSON (a proxy's page)
  // or has no Content-Type is no answer from the runtime.
  fakeFetch(503, '{"ok": false}', "application/json");
  assert.deepEqual(await checkAdmission(PAGE, {}, "t"), { ok: false, status: 503, reason: "node_full", message: '{"ok": false}' });
  fakeFetch(200, "<html>portal</html>", "text/html; note=application/json");
  assert.deepEqual(await checkAdmission(PAGE, {}, "t"), {
    ok: false,
    status: 200,
    reason: "connection_failed",
    message: "<html>portal</html>",
  });
  fakeFetch(200, "plain", null);
  assert.deepEqual(await checkAdmission(PAGE, {}, "t"), { ok: false, status: 200, reason: "connection_failed", message: "plain" });
});

test("checkAdmission(): a fetch that fails resolves to connection_failed, never rejects", async () => {
  globalThis.fetch = async () => {
    throw new TypeError("Failed to fetch");
  };
  assert.deepEqual(await checkAdmission(PAGE, {}, "t"), {
    ok: false,
    status: 0,
    reason: "connection_failed",
    message: "TypeError: Failed to fetch",
  });
});

// --- framing -----------------------------------------------------------------------------------------------

test("encodeAudio(): kind 0x01 then Int16 little-endian samples", () => {
  const samples = new Int16Array([1, -2, 32767, -32768, 0x1234]);
  assert.deepEqual(bytes(encodeAudio(samples)), [0x01, 1, 0, 0xfe, 0xff, 0xff, 0x7f, 0x00, 0x80, 0x34, 0x12]);
  assert.deepEqual(bytes(encodeAudio(new Int16Array(0))), [0x01]);
});

test("encodePing(): kind 0x06, uint32 sequence and float64 send time, little-endian", () => {
  const buffer = encodePing(0x01020304, 1.5);
  assert.equal(buffer.byteLength, 13);
  // 1.5 as a float64: 0x3FF8000000000000.
  assert.deepEqual(bytes(buffer), [0x06, 4, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f]);
});

test("decodeMessage(): each kind, byte for byte", () => {
  assert.deepEqual(decodeMessage(new ArrayBuffer(0)), { kind: -1 });
  // Audio: Int16 LE to Float32 in [-1, 1); an odd trailing byte ignored.
  const audio = decodeMessage(message(0x01, 0x00, 0x40, 0x00, 0x80, 0xff, 0x7f, 0x01, 0x00, 0x99));
  assert.equal(audio.kind, Kind.AUDIO);
  assert.deepEqual([...audio.samples], [0.5, -1, 32767 / 32768, 1 / 32768]);
  assert.deepEqual(decodeMessage(message(0x02, ...utf8("héllo"))), { kind: Kind.TEXT, text: "héllo" });
  assert.deepEqual(decodeMessage(message(0x05, ...utf8("node full"))), { kind: Kind.ERROR, message: "node full" });
  assert.deepEqual(decodeMessage(message(0x04, ...utf8('{"a": [1]}'))), { kind: Kind.METADATA, data: { a: [1] } });
  assert.deepEqual(decodeMessage(message(0x04, ...utf8("{not json"))), { kind: Kind.METADATA, data: null });
  assert.deepEqual(decodeMessage(message(0x00)), { kind: Kind.HANDSHAKE });
  assert.deepEqual(decodeMessage(message(0x03, 1)), { kind: Kind.CONTROL });
  assert.deepEqual(decodeMessage(message(0x07, 1, 2)), { kind: 7 });
});

test("decodeMessage(): a ping of exactly 13 bytes is read, a shorter one is not", () => {
  assert.deepEqual(decodeMessage(encodePing(0xfffffffe, 1234.25)), { kind: Kind.PING, sequence: 0xfffffffe, sentAtMs: 1234.25 });
  assert.deepEqual(decodeMessage(encodePing(7, 0.5).slice(0, 12)), { kind: Kind.PING, sequence: -1, sentAtMs: Number.NaN });
});

// --- readToken() -------------------------------------------------------------------------------------------

/** base64url without padding, as a JWT carries it. */
const base64url = (text) => Buffer.from(text).toString("base64url");

/** A payload whose base64url form holds "-" and "_" and needs padding (so that every step of the decoding
 *  shows), found by trying fillers in order (deterministic). */
function awkwardPayload(claims) {
  for (let i = 0; i < 10_000; i++) {
    const text = JSON.stringify({ ...claims, pad: "?>~".repeat(i % 7) + "ÿ".repeat(i % 5) + String(i) });
    const encoded = base64url(text);
    if (encoded.includes("-") && encoded.includes("_") && encoded.length % 4 !== 0) return encoded;
  }
  throw new Error("no awkward payload found");
}

test("readToken(): the expiry (s -> Date) and personas of a base64url payload", () => {
  const token = `h.${awkwardPayload({ exp: 1_800_000_000, personas: ["NATM1.pt"] })}.s`;
  assert.deepEqual(readToken(token), { expiresAt: new Date(1_800_000_000_000), personas: ["NATM1.pt"] });
  const open = `h.${awkwardPayload({ exp: 1_700_000_000 })}.s`;
  assert.deepEqual(readToken(open), { expiresAt: new Date(1_700_000_000_000), personas: ["*"] });
  assert.deepEqual(readToken(`h.${base64url('{"exp": 1, "personas": []}')}.s`).personas, []);
});

test("readToken(): not a token -> null", () => {
  assert.equal(readToken("no-dots"), null);
  assert.equal(readToken(`h.${base64url("not json")}.s`), null);
  assert.equal(readToken(undefined), null);
});
