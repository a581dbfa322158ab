// The runtime's wire protocol on /api/chat (runtime/frontend/codecs/protocol.py), the admission check
// (GET /api/admission) and the one table of refusal reasons in plain words.
//
// Every WebSocket message is binary; its first byte is the kind. This page uses format=pcm:
// audio payloads are Int16 little-endian samples, 24 kHz mono, both directions.

export const Kind = Object.freeze({
  HANDSHAKE: 0x00, // server -> client, once the session's slot is ready
  AUDIO: 0x01, // both: Int16 LE PCM (format=pcm)
  TEXT: 0x02, // server -> client: one UTF-8 text piece
  CONTROL: 0x03, // client -> server (unused here)
  METADATA: 0x04, // both: one JSON object
  ERROR: 0x05, // server -> client: UTF-8 reason, sent before a refusal or a limit closes the socket
  PING: 0x06, // both: opaque bytes; the server echoes a client's ping (round-trip time)
});

export const SAMPLE_RATE_HZ = 24000; // the model's audio rate, both directions
export const FRAME_SAMPLES = 1920; // one model frame: 80 ms at 24 kHz
export const FRAME_MS = (1000 * FRAME_SAMPLES) / SAMPLE_RATE_HZ; // 80 ms
export const TOKEN_SUBPROTOCOL_PREFIX = "duplex.token."; // runtime/frontend/gate/tokens.py SUBPROTOCOL_PREFIX
// A resume's credential as the WebSocket subprotocol (a page cannot set a header on a WebSocket; the URL is
// logged by proxies): runtime/frontend/gate/query.py RESUME_SUBPROTOCOL_PREFIX.
export const RESUME_SUBPROTOCOL_PREFIX = "duplex.resume.";
// A resume's credential as a request header (POST /api/rtc): runtime/frontend/gate/query.py RESUME_HEADER.
export const RESUME_HEADER = "Duplex-Resume-Credential";

// reason code -> what the person in front of the page is told. Codes: the runtime's refusal reasons
// (runtime/frontend/gate/tokens.py REFUSAL_STATUS, runtime/frontend/server.py ADMISSION_REASONS), nginx's own answers, and
// what can go wrong in the browser.
export const REASONS = Object.freeze({
  missing: "A session token is needed. Paste the token you were given, or open the link that carries one.",
  malformed: "That session token is not valid. Check that you pasted all of it.",
  expired: "Your session token has expired. Ask for a new one.",
  not_yet_valid: "Your session token is not valid yet. Check this device's clock, or wait a moment.",
  lifetime_too_long: "Your session token lives longer than the server allows. Ask for a new one.",
  bad_signature: "That session token is not valid for this node (its signature does not match).",
  unknown_key: "That session token is signed with a key this node no longer accepts. Ask for a new one.",
  wrong_audience: "That session token is for a different node.",
  replayed: "That session token was already used. Each token opens one conversation: ask for a new one.",
  persona_not_allowed: "Your session token does not allow this voice. Pick another voice.",
  wrong_token_kind: "That is an application token (for reading conversations back), not a session token. Ask for a session token.",
  revoked: "That session token has been revoked. Ask for a new one.",
  wrong_key_kind: "That token is signed with a key for another kind of token. Ask for a session token.",
  wrong_tenant: "That session token is for another application than its key allows. Ask for a new one.",
  insufficient_scope: "That token does not allow this. Ask for a token with the right scope.",
  origin_not_allowed:
    "This page's address is not allowed to open conversations on this node (origin refused).",
  replay_check_unavailable: "The node cannot check session tokens right now. Try again in a moment.",
  node_full: "The node is full: every conversation slot is in use. Try again in a little while.",
  draining: "The node is shutting down for maintenance. Try again shortly, or use another node.",
  not_ready: "The node is starting up and not ready yet. Try again in a moment.",
  too_many_attempts: "Too many connection attempts from your address. Wait a few seconds, then try again.",
  rate_limited: "The node is taking too many new conversations right now. Wait a few seconds, then try again.",
  runtime_unavailable: "The node's speech service is down or not answering. Try again later.",
  bad_request: "The node did not accept these persona settings.",
  max_session_length: "The conversation reached its time limit.",
  protocol_error: "The node reported a problem with the audio stream.",
  connection_failed: "Could not connect to the node. Check the network connection, then try again.",
  connection_lost: "The connection to the node was lost.",
  microphone_denied: "Microphone access was refused. Allow the microphone for this page, then try again.",
  microphone_missing: "No microphone was found on this device.",
  unsupported: "This browser lacks what the page needs (AudioWorklet and WebSocket over TLS).",
  unsupported_model: "This node's model speaks at a sample rate this page does not play.",
});

/** Plain words for a reason code; unknown codes get the runtime's own message. */
export function describe(reason, message = "") {
  return REASONS[reason] ?? (message || "Something went wrong.");
}

/** The reason code of a 0x05 error message (the runtime's sentences start with their reason). */
export function reasonOfError(message) {
  if (message.startsWith("node full")) return "node_full";
  if (message.startsWith("node is draining")) return "draining";
  if (message.startsWith("bad request")) return "bad_request";
  if (message.startsWith("session reached max_session_s")) return "max_session_length";
  return "protocol_error"; // "<protocol reason>: <detail>" (runtime/frontend/codecs/protocol.py PROTOCOL_ERROR_REASONS)
}

/** The reason code of a close event that came without a 0x05 message first. */
export function reasonOfClose(code, reason) {
  if (reason === "max_session_length") return "max_session_length";
  if (code === 1001) return "draining"; // the drain's grace ran out
  if (code === 1013) return "node_full";
  if (code === 1008) return "bad_request";
  return "connection_lost";
}

/**
 * The session's query: format=pcm and the voice (left out when empty). Never the text prompt: a URL is
 * logged by proxies and load balancers (issue 34), so the prompt goes as the WebSocket's first message
 * (chatUrl adds text_prompt_in=metadata, openSocket sends it) or in POST /api/rtc's TEXT_PROMPT_HEADER.
 */
export function sessionQuery({ voicePrompt = "" } = {}) {
  const query = new URLSearchParams({ format: "pcm" });
  if (voicePrompt) query.set("voice_prompt", voicePrompt);
  return query;
}

/** The persona's text prompt, trimmed ("" for none). */
export function textPromptOf({ textPrompt = "" } = {}) {
  return textPrompt.trim();
}

/** POST /api/rtc's text prompt header (percent-encoded UTF-8): runtime/frontend/gate/query.py TEXT_PROMPT_HEADER. */
export const TEXT_PROMPT_HEADER = "Duplex-Text-Prompt";

/**
 * wss://<this page's host>/api/chat?<query> (ws:// when the page itself is plain http); with a text prompt,
 * text_prompt_in=metadata: the page sends the prompt as its first message (encodeMetadata).
 */
export function chatUrl(location, persona) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = sessionQuery(persona);
  if (textPromptOf(persona)) query.set("text_prompt_in", "metadata");
  return `${scheme}//${location.host}/api/chat?${query}`;
}

/**
 * Ask the runtime whether /api/chat would admit this session now, and if not why: a browser cannot read
 * the HTTP status of a refused WebSocket upgrade (it sees close code 1006 only). The token travels in the
 * Authorization header and is not spent; the page's origin goes in the query because browsers send no
 * Origin header on a same-origin GET. Resolves to {ok, status, reason, message}; never rejects.
 */
export async function checkAdmission(location, persona, token) {
  const query = sessionQuery(persona);
  query.set("origin", location.origin);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  let response;
  try {
    response = await fetch(`/api/admission?${query}`, { headers, cache: "no-store" });
  } catch (error) {
    return { ok: false, status: 0, reason: "connection_failed", message: String(error) };
  }
  const type = response.headers.get("Content-Type") ?? "";
  if (response.ok && type.startsWith("application/json")) return response.json();
  // nginx answered by itself: 429 (handshake rate), 502/504 (runtime down), 503 (session cap).
  const byStatus = {
    429: "too_many_attempts",
    502: "runtime_unavailable",
    503: "node_full",
    504: "runtime_unavailable",
  };
  const message = (await response.text()).trim();
  const reason = byStatus[response.status] ?? "connection_failed";
  return { ok: false, status: response.status, reason, message };
}

/** A 0x01 audio message: kind byte + Int16 little-endian samples. */
export function encodeAudio(samples /* Int16Array, 24 kHz */) {
  const view = new DataView(new ArrayBuffer(1 + 2 * samples.length));
  view.setUint8(0, Kind.AUDIO);
  for (let i = 0; i < samples.length; i++) view.setInt16(1 + 2 * i, samples[i], true);
  return view.buffer;
}

/** A 0x04 metadata message: kind byte + one JSON object, UTF-8 (e.g. {text_prompt}: the session's first). */
export function encodeMetadata(object) {
  const body = new TextEncoder().encode(JSON.stringify(object));
  const message = new Uint8Array(1 + body.length);
  message[0] = Kind.METADATA;
  message.set(body, 1);
  return message.buffer;
}

/** A 0x06 ping carrying its sequence number (uint32) and send time (float64, ms, performance.now()). */
export function encodePing(sequence, sentAtMs) {
  const view = new DataView(new ArrayBuffer(13));
  view.setUint8(0, Kind.PING);
  view.setUint32(1, sequence, true);
  view.setFloat64(5, sentAtMs, true);
  return view.buffer;
}

const utf8 = new TextDecoder("utf-8");

/**
 * Decode one server message (an ArrayBuffer). Returns {kind, ...}: AUDIO -> samples (Float32Array in
 * [-1, 1), 24 kHz); TEXT -> text; ERROR -> message; PING -> sequence, sentAtMs; METADATA -> data.
 */
export function decodeMessage(buffer) {
  const view = new DataView(buffer);
  if (view.byteLength === 0) return { kind: -1 };
  const kind = view.getUint8(0);
  switch (kind) {
    case Kind.AUDIO: {
      const count = (view.byteLength - 1) >> 1;
      const samples = new Float32Array(count);
      for (let i = 0; i < count; i++) samples[i] = view.getInt16(1 + 2 * i, true) / 32768;
      return { kind, samples };
    }
    case Kind.TEXT:
      return { kind, text: utf8.decode(new Uint8Array(buffer, 1)) };
    case Kind.ERROR:
      return { kind, message: utf8.decode(new Uint8Array(buffer, 1)) };
    case Kind.PING:
      if (view.byteLength < 13) return { kind, sequence: -1, sentAtMs: NaN };
      return { kind, sequence: view.getUint32(1, true), sentAtMs: view.getFloat64(5, true) };
    case Kind.METADATA:
      try {
        return { kind, data: JSON.parse(utf8.decode(new Uint8Array(buffer, 1))) };
      } catch {
        return { kind, data: null };
      }
    default:
      return { kind };
  }
}

/** What a token says about itself (not verified here: the node does that): {expiresAt: Date, personas}. */
export function readToken(token) {
  try {
    const payload = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    const claims = JSON.parse(atob(payload.padEnd(Math.ceil(payload.length / 4) * 4, "=")));
    return { expiresAt: new Date(claims.exp * 1000), personas: claims.personas ?? ["*"] };
  } catch {
    return null;
  }
}
