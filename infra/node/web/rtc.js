// The page's WebRTC transport (docs/protocol.md, "WebRTC (`/api/rtc`)"): the microphone track and a
// DataChannel on one RTCPeerConnection, signalled by one POST of the offer (WHIP-shaped), non-trickle ICE.
//
// connectRtc() resolves to {ok: true, rtc} once ICE connected, or {ok: false, fallback, reason, message}:
// `fallback` true when the page should use the WebSocket instead (the POST was refused for a transport
// reason, or ICE did not connect within CONNECT_LIMIT_MS); false for a refusal the person must be told
// (401/403/429/503: the body is "<reason>: <sentence>", the same reasons as /api/chat).
//
// Resume (docs/protocol.md, "Resume"): the offer asks for resumable=1, so the DataChannel's 0x00 is followed
// by a 0x04 with the session's single-use credential. connectRtc({resume, iceServers}) reconnects a dropped
// call with it: POST /api/rtc with a Duplex-Resume-Credential header (not ?resume=: URLs are logged), a
// fresh offer and no token (the credential is the right), the ICE servers of the first connection (the token is spent: /api/rtc/ice-servers would refuse
// it). Its 201 carries the next credential (Duplex-Resume-Credential): rtc.resume.
//
// A full region (docs/deploying.md, "Resume across regions"): an offer refused 503 node_full with
// Retry-After (every pod the router tried was full) is sent once more after that delay (at most
// RETRY_AFTER_CAP_S), with onWait(ms) telling the page it is waiting for a free slot; the ICE limit is
// moved on by the wait. A second refusal is shown.

import { RESUME_HEADER, TEXT_PROMPT_HEADER, sessionQuery, textPromptOf } from "./protocol.js";

export const CONNECT_LIMIT_MS = 3000; // from the first ICE server request to "connected": then the WebSocket
// Gathering waits for every ICE server; an unreachable one would hold it to the limit and leave ICE no time
// to connect: at this point the offer goes with the candidates gathered so far (none: the WebSocket).
export const GATHER_LIMIT_MS = 2000;
// The longest Retry-After honoured before the one retry of a node_full offer (s): the runtime sends 5
// (runtime/frontend/transports/webrtc/signalling.py RETRY_AFTER_S); a caller waits no longer than this.
export const RETRY_AFTER_CAP_S = 10;
const REFUSAL_STATUSES = new Set([401, 403, 429, 503]); // access, persona, rate and capacity refusals
const RESUME_REFUSALS = new Set([404, 410]); // resume_off, resume_expired (a resume's 403: invalid, replayed)

/** The page's transport figures (window.duplexClient.stats), as each conversation starts. */
export const RTC_STATS = Object.freeze({
  // The transport (rtc.js): "webrtc" or "websocket" once chosen, "" before; why WebRTC was given up, and
  // after how long (ms from the first ICE server request); WebRTC: connect time and getStats() figures.
  transport: "",
  fallbackReason: "",
  rtcAttemptMs: null,
  rtcConnectMs: null, // first ICE server request -> ICE connected (ms)
  rtcPacketsReceived: 0,
  rtcPacketsLost: 0,
  rtcPacketsSent: 0,
  rtcSamplesReceived: 0, // decoded samples played out (the browser's rate, 48 kHz for Opus)
  rtcConcealedSamples: 0, // of which concealed (loss or late packets)
  rtcJitterBufferMs: null, // mean jitter buffer delay per emitted sample (ms)
  rtcRttMs: null, // the selected ICE candidate pair's current round trip (ms)
  rtcCandidateType: "", // the local candidate in use: host, srflx or relay
});

/** The transport the page's address asks for: ?transport=websocket|webrtc, else "auto"; ?relay=1. */
export function transportOptions(search) {
  const query = new URLSearchParams(search);
  const asked = query.get("transport");
  const transport = asked === "websocket" || asked === "webrtc" ? asked : "auto";
  return { transport, relay: ["1", "true"].includes(query.get("relay") ?? "") };
}

function authHeaders(token) {
  return token ? { Authorization: `Bearer ${token}` } : {};
}

/** {reason, message} of a refusal body "<reason>: <sentence>" (reason: snake_case). */
export function parseRefusal(body) {
  const found = /^([a-z_]+): ?(.*)$/s.exec(body.trim());
  return found ? { reason: found[1], message: found[2] } : { reason: "", message: body.trim() };
}

function delay(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * The wait (ms) before the one retry of a refused offer, or null for no retry: only a 503 whose reason
 * is node_full and whose Retry-After is delta-seconds (RFC 9110, 10.2.3; an HTTP-date is not retried),
 * capped at RETRY_AFTER_CAP_S.
 */
export function offerRetryMs(status, reason, retryAfter) {
  if (status !== 503 || reason !== "node_full" || typeof retryAfter !== "string") return null;
  if (!/^\d+$/.test(retryAfter.trim())) return null;
  return Math.min(Number(retryAfter.trim()), RETRY_AFTER_CAP_S) * 1000;
}

/**
 * POST an offer (fetch(url, init)); a 503 node_full with Retry-After is sent once more after the delay
 * (offerRetryMs), onWait(ms) called first. Resolves to {response, body, waitedMs}; fetch's errors reject.
 * sleep(ms): the wait (a test passes its own clock).
 */
export async function postOffer(url, init, { onWait = () => {}, sleep = delay } = {}) {
  let response = await fetch(url, init);
  let body = await response.text();
  const waitMs = offerRetryMs(response.status, parseRefusal(body).reason, response.headers.get("Retry-After"));
  if (waitMs === null) return { response, body, waitedMs: 0 };
  onWait(waitMs);
  await sleep(waitMs);
  response = await fetch(url, init);
  body = await response.text();
  return { response, body, waitedMs: waitMs };
}

/** Resolves when ICE gathering completed, or at `deadline` (performance.now() ms), whichever first. */
function gathered(pc, deadline) {
  if (pc.iceGatheringState === "complete") return Promise.resolve(true);
  return Promise.race([
    new Promise((resolve) =>
      pc.addEventListener("icegatheringstatechange", () => {
        if (pc.iceGatheringState === "complete") resolve(true);
      }),
    ),
    delay(Math.max(0, deadline - performance.now())).then(() => false),
  ]);
}

/** Resolves true when the peer connection is connected, false when it failed or at `deadline`. */
function connected(pc, deadline) {
  const done = () => pc.connectionState === "connected";
  if (done()) return Promise.resolve(true);
  return Promise.race([
    new Promise((resolve) =>
      pc.addEventListener("connectionstatechange", () => {
        if (done()) resolve(true);
        else if (pc.connectionState === "failed" || pc.connectionState === "closed") resolve(false);
      }),
    ),
    delay(Math.max(0, deadline - performance.now())).then(() => false),
  ]);
}

/**
 * Open a WebRTC session. options: {token, persona, stream (getUserMedia's), relay (bool: relay-only ICE),
 * onMessage(ArrayBuffer) for DataChannel messages, onTrack(MediaStream) for the node's audio}.
 * resume: a credential (reconnect a dropped call, no token); iceServers: skip GET /api/rtc/ice-servers.
 * onWait(ms): the offer was refused node_full and is sent again in `ms` (the page says it is waiting).
 * Never rejects. On success `rtc` = {pc, channel, location, token, startedMs, connectMs, iceServers, resume,
 * close()}; `resume` (and a fallback's `resume`): a resume's next credential from its 201, else null.
 */
export async function connectRtc({
  token, persona, stream, relay, onMessage, onTrack, resume, resumeUrl, iceServers, onWait,
}) {
  const startedMs = performance.now();
  let deadline = startedMs + CONNECT_LIMIT_MS;
  let offerUrl = null; // multi-region: the ICE servers' region's offer path (docs/protocol.md, "WebRTC")
  const fallback = (message) => ({ ok: false, fallback: true, reason: "", message, afterMs: performance.now() - startedMs });
  if (!iceServers) {
    const got = await fetchIceServers(token, fallback);
    if (got.refused) return got.refused;
    iceServers = got.iceServers;
    offerUrl = got.offerUrl;
  }
  const pc = new RTCPeerConnection({ iceServers, iceTransportPolicy: relay ? "relay" : "all" });
  const rtc = { pc, channel: null, location: null, token, startedMs, connectMs: null, closed: false, iceServers };
  rtc.close = () => closeRtc(rtc);
  try {
    for (const track of stream.getAudioTracks()) pc.addTrack(track, stream);
    pc.getTransceivers().forEach((t) => (t.direction = "sendrecv"));
    pc.ontrack = (event) => onTrack(event.streams[0] ?? new MediaStream([event.track]));
    rtc.channel = pc.createDataChannel("duplex"); // before the offer, so that it is negotiated in it
    rtc.channel.binaryType = "arraybuffer";
    rtc.channel.onmessage = (event) => onMessage(event.data);
    await pc.setLocalDescription(await pc.createOffer());
    await gathered(pc, startedMs + GATHER_LIMIT_MS);
    const offer = pc.localDescription.sdp;
    // No candidate at all (relay-only and no TURN server answered): ICE cannot connect. Say so before the
    // POST, which would spend the token.
    if (!/^a=candidate:/m.test(offer)) {
      rtc.close();
      return fallback(relay ? "no relay candidate (TURN server unreachable)" : "no ICE candidate");
    }
    let response, body;
    try {
      // A resume: the credential in a header, not the URL (which proxies log); the session's query is its own.
      const query = resume ? "" : `?${sessionQuery(persona)}&resumable=1`;
      const credentials = resume ? { [RESUME_HEADER]: resume } : authHeaders(token);
      // The text prompt in a header, not the URL (issue 34: URLs are logged); percent-encoded UTF-8.
      const prompt = resume ? "" : textPromptOf(persona);
      if (prompt) credentials[TEXT_PROMPT_HEADER] = encodeURIComponent(prompt);
      // Multi-region: a resume goes to its pod's route, an offer to the region of its ICE servers.
      const target = sameOrigin(resume ? resumeUrl : offerUrl) ?? "/api/rtc";
      const init = {
        method: "POST",
        headers: { "Content-Type": "application/sdp", ...credentials },
        body: offer,
        cache: "no-store",
      };
      const posted = await postOffer(`${target}${query}`, init, { onWait });
      ({ response, body } = posted);
      deadline += posted.waitedMs; // the wait for a slot is not ICE's time
    } catch (error) {
      rtc.close();
      return fallback(`POST /api/rtc: ${error}`);
    }
    if (response.status !== 201) {
      rtc.close();
      const refused = parseRefusal(body);
      const refusal = REFUSAL_STATUSES.has(response.status) || (resume && RESUME_REFUSALS.has(response.status));
      if (refusal && refused.reason) return { ok: false, fallback: false, ...refused };
      return fallback(`POST /api/rtc: HTTP ${response.status} ${body.slice(0, 200)}`);
    }
    rtc.location = response.headers.get("Location");
    rtc.resume = response.headers.get(RESUME_HEADER); // a resume's next credential (null on a new call)
    await pc.setRemoteDescription({ type: "answer", sdp: body });
    if (!(await connected(pc, deadline))) {
      // A resume that did not connect is held again by the node, for the next try with rtc.resume: no DELETE.
      if (resume) dropRtc(rtc);
      else rtc.close();
      return { ...fallback(`ICE did not connect within ${CONNECT_LIMIT_MS} ms`), resume: rtc.resume };
    }
    rtc.connectMs = performance.now() - startedMs;
    return { ok: true, rtc };
  } catch (error) {
    rtc.close();
    return fallback(String(error));
  }
}

/** {iceServers} for the token (GET /api/rtc/ice-servers), or {refused: connectRtc's answer} when refused. */
/** The path of `url` when it is on this page's origin (a node's resume_url or offer_url), else null. */
export function sameOrigin(url) {
  if (typeof url !== "string") return null;
  try {
    const parsed = new URL(url, location.href);
    const origin = location.origin.replace(/^http/, parsed.protocol.startsWith("ws") ? "ws" : "http");
    return parsed.origin === origin ? parsed.pathname : null;
  } catch {
    return null;
  }
}

async function fetchIceServers(token, fallback) {
  try {
    const response = await fetch("/api/rtc/ice-servers", { headers: authHeaders(token), cache: "no-store" });
    if (REFUSAL_STATUSES.has(response.status)) {
      return { refused: { ok: false, fallback: false, ...parseRefusal(await response.text()) } };
    }
    if (!response.ok) return { refused: fallback(`ICE servers: HTTP ${response.status}`) };
    const answer = await response.json();
    return { iceServers: answer.iceServers, offerUrl: answer.offer_url ?? null };
  } catch (error) {
    return { refused: fallback(`ICE servers: ${error}`) };
  }
}

/** Close a dropped call's peer connection without DELETE: its slot stays held for a resume. */
export function dropRtc(rtc) {
  rtc.location = null;
  closeRtc(rtc);
}

/** End the session: DELETE its Location (the node frees the slot at once), close the peer connection. */
export function closeRtc(rtc) {
  if (rtc.closed) return;
  rtc.closed = true;
  if (rtc.location) {
    fetch(rtc.location, { method: "DELETE", headers: authHeaders(rtc.token), keepalive: true }).catch(() => {});
  }
  try {
    rtc.channel?.close();
    rtc.pc.close();
  } catch {
    // already closed
  }
}

/**
 * What getStats() says (ms, counts): the inbound audio's jitter buffer delay (mean per emitted sample),
 * concealed and received samples, packets received and lost; packets sent; the selected candidate pair's
 * round trip and local candidate type ("host", "srflx", "relay"). Source: W3C webrtc-stats,
 * RTCInboundRtpStreamStats and RTCIceCandidatePairStats.
 */
export async function readRtcStats(pc) {
  const out = {};
  const report = await pc.getStats();
  let pair = null;
  report.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      out.rtcPacketsReceived = s.packetsReceived ?? 0;
      out.rtcPacketsLost = s.packetsLost ?? 0;
      out.rtcSamplesReceived = s.totalSamplesReceived ?? 0;
      out.rtcConcealedSamples = s.concealedSamples ?? 0;
      if (s.jitterBufferEmittedCount) {
        out.rtcJitterBufferMs = (1000 * s.jitterBufferDelay) / s.jitterBufferEmittedCount;
      }
    } else if (s.type === "outbound-rtp" && s.kind === "audio") {
      out.rtcPacketsSent = s.packetsSent ?? 0;
    } else if (s.type === "transport" && s.selectedCandidatePairId) {
      pair = report.get(s.selectedCandidatePairId);
    }
  });
  if (pair) {
    if (pair.currentRoundTripTime !== undefined) out.rtcRttMs = 1000 * pair.currentRoundTripTime;
    out.rtcCandidateType = report.get(pair.localCandidateId)?.candidateType ?? "";
  }
  return out;
}
