// The page: persona and token, the talk button, one conversation at a time, the live readout.
//
// A conversation: check admission (GET /api/admission: why a refusal, in words, before any socket), open
// the microphone, capture it at 24 kHz in an AudioWorklet (audio-worklet.js), open wss://.../api/chat with
// the token as the WebSocket subprotocol, wait for the handshake, then stream 80 ms Int16 frames up while
// playing the frames that come down (player.js) and showing the text pieces. A connection lost without a
// close frame (a Wi-Fi blip, a new network) is resumed with the session's single-use credential while the
// node holds its slot (docs/protocol.md, "Resume"), and the page says so.
//
// WebRTC first (rtc.js): the microphone track and a DataChannel on one RTCPeerConnection, the node's audio
// played by an <audio> element, the DataChannel's messages read by the same handler as the WebSocket's.
// The page falls back to the WebSocket (with the same token) when the POST is refused for a transport
// reason or ICE does not connect within 3 s. ?transport=websocket|webrtc forces one; ?relay=1 relays only.
// A WebRTC call whose path is lost (ICE failed, or disconnected past RTC_LOST_GRACE_MS, or the DataChannel
// gone without a 0x05 from the node) is resumed the same way: a fresh offer with the credential (rtc.js).

import {
  FRAME_MS,
  FRAME_SAMPLES,
  Kind,
  RESUME_SUBPROTOCOL_PREFIX,
  SAMPLE_RATE_HZ,
  TOKEN_SUBPROTOCOL_PREFIX,
  chatUrl,
  checkAdmission,
  decodeMessage,
  describe,
  encodeAudio,
  encodeMetadata,
  encodePing,
  readToken,
  reasonOfClose,
  reasonOfError,
  textPromptOf,
} from "./protocol.js";
import { Player } from "./player.js";
import { RTC_STATS, closeRtc, connectRtc, dropRtc, readRtcStats, sameOrigin, transportOptions } from "./rtc.js";

const PING_INTERVAL_MS = 1000; // one round-trip probe per second
const READOUT_INTERVAL_MS = 250; // how often the numbers on the page are refreshed
const LEVEL_GAIN = 4; // speech RMS around 0.05..0.2 fills a visible part of the meter
const RESUME_TRIES = 5; // reconnections tried after a drop: at once, then 0.5, 1, 2, 4 s apart (7.5 s in all:
const RESUME_DELAY_MS = 500; // within the 10 s the node holds the slot by default)
const RTC_LOST_GRACE_MS = 2000; // WebRTC "disconnected" this long (ICE consent unanswered): the path is lost

// Personas: role prompts in PersonaPlex's style. The voices come from the node (GET /api/personas).
const PERSONAS = [
  {
    label: "Friendly assistant",
    prompt: "You are a wise and friendly assistant. Answer clearly and kindly.",
  },
  {
    label: "Restaurant host",
    prompt:
      "You work for a small restaurant and take table reservations: ask for the day, time and party size.",
  },
  {
    label: "Customer support",
    prompt: "You are a customer support agent for an online shop. Help with orders, deliveries and returns.",
  },
  { label: "Casual chat", prompt: "You enjoy having a good conversation about anything." },
  { label: "None (no role prompt)", prompt: "" },
];

const ui = Object.fromEntries(
  ["token", "token-info", "voice", "persona", "prompt", "settings", "talk", "status", "problem", "transcript",
    "level", "stat-transport", "stat-rtt", "stat-received", "stat-lost", "stat-underruns", "stat-buffer", "stat-sent",
  ].map((id) => [id, document.getElementById(id)]),
);

// What the page measures. Shown on the page, and readable as window.duplexClient.stats (tests, debugging).
const stats = {
  state: "idle", // idle | connecting | live
  reason: "", // the last refusal's reason code (protocol.js REASONS), "" when none
  framesSent: 0, // 80 ms frames sent up
  framesReceived: 0, // 80 ms frames received
  framesLost: 0, // gaps in the received stream: g ms between two frames counts round(g / 80) - 1 frames
  framesScheduled: 0, // frames handed to the AudioContext
  underruns: 0, // times playback ran dry mid-conversation (an audible gap)
  dropped: 0, // frames dropped by the player to keep the latency bounded
  bufferedMs: 0, // audio queued ahead of the playhead (ms)
  // The adaptive playout buffer (player.js report, playout.js): the lead a frame finds when it arrives (how
  // long its first sample waits to be played), last / mean / max over the session, its target (from the
  // measured jitter) now and at most, the last frame's jitter, audio removed or added by time stretching.
  playoutLeadMs: 0,
  playoutLeadMeanMs: 0,
  playoutLeadMaxMs: 0,
  playoutTargetMs: 0,
  playoutTargetMaxMs: 0,
  playoutJitterMs: 0,
  playoutShortenedMs: 0,
  playoutLengthenedMs: 0,
  playoutRecentFrames: 0, // the last 125 frames (10 s): how many, their largest lead, their underruns
  playoutRecentLeadMaxMs: 0,
  playoutRecentUnderruns: 0,
  rttMs: null, // last ping round trip (ms): page -> nginx -> runtime -> page
  transcriptChars: 0,
  inputRateHz: null, // the AudioContext's rate the worklet resamples from
  resampled: null, // whether it had to (false when the context already ran at 24 kHz)
  contextTimeS: 0, // AudioContext.currentTime (s)
  scheduledUntilS: 0, // context time (s) up to which audio is scheduled
  resumes: 0, // times the conversation was resumed after a lost connection
  ...RTC_STATS, // the transport and the WebRTC figures (rtc.js)
};
window.duplexClient = { stats };

let session = null; // the conversation in progress, if any

function setState(state) {
  stats.state = state;
  document.body.dataset.state = state;
  ui.talk.textContent = state === "idle" ? "Start talking" : "Stop talking";
  ui.settings.disabled = state !== "idle";
}

function setStatus(text) {
  ui.status.textContent = text;
}

function showProblem(reason, message) {
  stats.reason = reason;
  ui.problem.dataset.reason = reason;
  let words = describe(reason, message);
  if (reason === "bad_request" && message) words += ` (${message})`;
  ui.problem.textContent = words;
}

function clearProblem() {
  stats.reason = "";
  delete ui.problem.dataset.reason;
  ui.problem.textContent = "";
}

function readPlayer(s) {
  const player = s.player;
  stats.framesScheduled = player.framesScheduled;
  stats.underruns = player.underruns;
  stats.dropped = player.dropped;
  stats.bufferedMs = player.bufferedMs;
  Object.assign(stats, player.report);
  stats.contextTimeS = s.context.currentTime;
  stats.scheduledUntilS = player.nextStartS;
}

function refreshReadout() {
  if (session?.player) readPlayer(session);
  if (session?.rtc && !session.rtc.closed) {
    readRtcStats(session.rtc.pc).then((figures) => Object.assign(stats, figures)).catch(() => {});
  }
  ui["stat-transport"].textContent = describeTransport();
  ui["stat-rtt"].textContent = stats.rttMs === null ? "–" : `${Math.round(stats.rttMs)} ms`;
  ui["stat-received"].textContent =
    stats.transport === "webrtc" ? `${stats.rtcPacketsReceived} packets` : String(stats.framesReceived);
  ui["stat-lost"].textContent = String(stats.framesLost + stats.dropped);
  ui["stat-underruns"].textContent = String(stats.underruns);
  ui["stat-buffer"].textContent = describeBuffer();
  ui["stat-sent"].textContent =
    stats.transport === "webrtc" ? `${stats.rtcPacketsSent} packets` : String(stats.framesSent);
}

/** The transport in words, with why WebRTC was given up when it was. */
function describeTransport() {
  if (stats.transport === "webrtc") {
    return stats.rtcCandidateType === "relay" ? "WebRTC (through the relay)" : "WebRTC";
  }
  if (stats.transport === "websocket") return stats.fallbackReason ? "WebSocket (WebRTC failed)" : "WebSocket";
  return "–";
}

/** The playout buffer in words: now (live), or the session's report once it ended. */
function describeBuffer() {
  const ms = (value) => `${Math.round(value)} ms`;
  if (stats.state === "live") return `${ms(stats.playoutLeadMs)} (target ${ms(stats.playoutTargetMs)})`;
  if (stats.framesScheduled === 0) return "–";
  return `mean ${ms(stats.playoutLeadMeanMs)}, max ${ms(stats.playoutLeadMaxMs)}`;
}

// --- one conversation ----------------------------------------------------------------------------------

async function start() {
  clearProblem();
  if (!window.AudioWorkletNode || !window.WebSocket || !navigator.mediaDevices?.getUserMedia) {
    showProblem("unsupported", "");
    return;
  }
  const token = ui.token.value.trim();
  if (token && !/^[A-Za-z0-9_.-]+$/.test(token)) {
    // Not a JWT (base64url parts and dots): it could not even travel in a header or subprotocol.
    showProblem("malformed", "");
    return;
  }
  const persona = { voicePrompt: ui.voice.value, textPrompt: ui.prompt.value };
  let context;
  try {
    // Created inside the click: browsers let audio start only after a user gesture.
    context = new AudioContext({ latencyHint: "interactive" });
  } catch (error) {
    showProblem("unsupported", String(error));
    return;
  }
  const s = { context, token, persona, handshake: false, opened: false, ended: false, error: null, pings: 0 };
  session = s;
  Object.assign(stats, {
    framesSent: 0, framesReceived: 0, framesLost: 0, rttMs: null, transcriptChars: 0, resumes: 0,
  });
  Object.assign(stats, { framesScheduled: 0, underruns: 0, dropped: 0 });
  Object.assign(stats, RTC_STATS);
  ui.transcript.textContent = "";
  setState("connecting");
  try {
    setStatus("Checking with the node…");
    if (nodeFrame.sample_rate_hz !== SAMPLE_RATE_HZ) {
      return end(s, "unsupported_model", `the node's model frame (${nodeFrame.sample_rate_hz} Hz) is not the ` +
        `${SAMPLE_RATE_HZ} Hz this page captures and plays`);
    }
    const admission = await checkAdmission(location, persona, token);
    if (s.ended) return;
    if (!admission.ok) return end(s, admission.reason, admission.message);

    setStatus("Waiting for the microphone…");
    try {
      s.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (error) {
      const reason = error.name === "NotFoundError" ? "microphone_missing" : "microphone_denied";
      return end(s, reason, String(error));
    }
    if (s.ended) return release(s);

    await context.audioWorklet.addModule(new URL("audio-worklet.js", import.meta.url));
    await context.resume();
    if (s.ended) return release(s);
    s.player = new Player(context);
    s.capture = new AudioWorkletNode(context, "capture-24k", {
      numberOfInputs: 1, numberOfOutputs: 0, processorOptions: { frameSamples: nodeFrame.samples },
    });
    s.capture.port.onmessage = (event) => onCapture(s, event.data);
    s.source = context.createMediaStreamSource(s.stream);
    s.source.connect(s.capture);

    const options = transportOptions(location.search);
    if (options.transport !== "websocket" && window.RTCPeerConnection) {
      setStatus(options.relay ? "Connecting over WebRTC (relay only)…" : "Connecting over WebRTC…");
      const result = await connectRtc({
        token, persona, stream: s.stream, relay: options.relay,
        onMessage: (data) => onMessage(s, data),
        onTrack: (remote) => playRemote(s, remote),
        onWait: (ms) => setStatus(`The region is full: waiting for a free slot (trying again in ${Math.round(ms / 1000)} s)…`),
      });
      if (s.ended) return result.rtc && closeRtc(result.rtc);
      if (result.ok) return useRtc(s, result.rtc);
      if (!result.fallback) return end(s, result.reason || "connection_failed", result.message);
      stats.fallbackReason = result.message;
      stats.rtcAttemptMs = result.afterMs;
      if (options.transport === "webrtc") return end(s, "connection_failed", result.message);
    }
    stats.transport = "websocket";
    setStatus(stats.fallbackReason ? "WebRTC did not connect: connecting over the WebSocket…" : "Connecting…");
    const protocols = token ? [TOKEN_SUBPROTOCOL_PREFIX + token] : [];
    openSocket(s, `${chatUrl(location, persona)}&resumable=1`, protocols);
  } catch (error) {
    end(s, "unsupported", String(error));
  }
}

/** WebRTC connected: the DataChannel brings the handshake; the peer connection's end ends the session. */
function useRtc(s, rtc) {
  s.rtc = rtc;
  if (rtc.resume) s.resume = rtc.resume; // a resume's next credential (its 0x04 brings it too)
  stats.transport = "webrtc";
  stats.rtcConnectMs = rtc.connectMs;
  setStatus(s.resuming ? "Reconnected: resuming the conversation…" : "Connected over WebRTC. The node is getting the persona ready…");
  const lost = () => {
    if (s.ended || s.rtc !== rtc || rtc.closed) return; // closed: dropped for a resume, or ended here
    if (s.error) return end(s, s.error.reason, s.error.message);
    // Gone without a word from the node (its ends send a 0x05 first): resume with the credential.
    if (s.resume && s.handshake) return resumeRtc(s);
    end(s, s.handshake ? "connection_lost" : "connection_failed", "");
  };
  let grace = null;
  rtc.pc.addEventListener("connectionstatechange", () => {
    const state = rtc.pc.connectionState;
    clearTimeout(grace);
    if (state === "failed" || state === "closed") lost();
    else if (state === "disconnected") grace = setTimeout(lost, RTC_LOST_GRACE_MS);
  });
  rtc.channel.addEventListener("close", lost);
}

/** A WebRTC call lost without a word from the node: a fresh offer with the credential, the tries as resume's. */
function resumeRtc(s) {
  clearInterval(s.pingTimer);
  s.handshake = false;
  if (s.rtc) dropRtc(s.rtc); // no DELETE: the node holds the slot for the resume
  s.resuming = (s.resuming ?? 0) + 1;
  if (s.resuming > RESUME_TRIES) return end(s, "connection_lost", "");
  setState("connecting");
  setStatus(`Connection lost: reconnecting over WebRTC (try ${s.resuming} of ${RESUME_TRIES})…`);
  const delay = s.resuming === 1 ? 0 : RESUME_DELAY_MS * 2 ** (s.resuming - 2);
  setTimeout(async () => {
    if (s.ended) return;
    const result = await connectRtc({
      token: s.token, stream: s.stream, relay: transportOptions(location.search).relay, resume: s.resume, resumeUrl: s.resumeUrl,
      iceServers: s.rtc?.iceServers, onMessage: (data) => onMessage(s, data), onTrack: (remote) => playRemote(s, remote),
    });
    if (s.ended) return result.rtc && closeRtc(result.rtc);
    if (result.resume) s.resume = result.resume; // answered but not connected: the node holds it again
    if (result.ok) return useRtc(s, result.rtc);
    if (!result.fallback) return end(s, result.reason || "connection_lost", result.message);
    resumeRtc(s);
  }, delay);
}

/** The node's audio over WebRTC: played by an <audio> element (the browser's own jitter buffer). */
function playRemote(s, remote) {
  if (s.ended) return;
  if (s.audio) s.audio.srcObject = null; // a resumed call's new track replaces the dropped one's
  s.audio = new Audio();
  s.audio.srcObject = remote;
  s.audio.play().catch(() => {}); // the click was the user gesture
}

/** Send one message on whichever transport is in use (dropped when it is not open). */
function send(s, buffer) {
  if (s.rtc) {
    if (s.rtc.channel.readyState === "open") s.rtc.channel.send(buffer);
  } else if (s.ws?.readyState === WebSocket.OPEN) {
    s.ws.send(buffer);
  }
}

function openSocket(s, url, protocols) {
  s.opened = false;
  s.ws = new WebSocket(url, protocols);
  s.ws.binaryType = "arraybuffer";
  s.ws.onopen = () => {
    s.opened = true;
    // The text prompt as the first message (text_prompt_in=metadata: never in the URL, which is logged).
    const prompt = s.resuming ? "" : textPromptOf(s.persona);
    if (prompt) s.ws.send(encodeMetadata({ text_prompt: prompt }));
    if (s.resuming) setStatus("Reconnected: resuming the conversation…");
    else setStatus("Connected. The node is getting the persona ready…");
  };
  s.ws.onmessage = (event) => onMessage(s, event.data);
  s.ws.onclose = (event) => onClose(s, event);
}

/** The connection was lost without a close frame: reconnect with the session's credential (no token). */
function resume(s) {
  clearInterval(s.pingTimer);
  s.handshake = false;
  s.resuming = (s.resuming ?? 0) + 1;
  if (s.resuming > RESUME_TRIES) return end(s, "connection_lost", "");
  setState("connecting");
  setStatus(`Connection lost: reconnecting (try ${s.resuming} of ${RESUME_TRIES})…`);
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  // The credential as a subprotocol, which the node selects: not in the URL, which proxies log (issue 34).
  const path = sameOrigin(s.resumeUrl) ?? "/api/chat"; // multi-region: the pod's route (resume_url)
  const url = `${scheme}//${location.host}${path}?format=pcm`;
  const delay = s.resuming === 1 ? 0 : RESUME_DELAY_MS * 2 ** (s.resuming - 2);
  setTimeout(() => s.ended || openSocket(s, url, [RESUME_SUBPROTOCOL_PREFIX + s.resume]), delay);
}

function onCapture(s, data) {
  if (data.type === "ready") {
    stats.inputRateHz = data.inputRateHz;
    stats.resampled = data.resampled;
    return;
  }
  ui.level.value = Math.min(1, data.rms * LEVEL_GAIN);
  // Audio sent before the handshake would be dropped by the node: start with the conversation.
  // Over WebRTC the microphone track carries the audio (the worklet only drives the level meter).
  if (s.handshake && !s.ended && !s.rtc && s.ws?.readyState === WebSocket.OPEN) {
    s.ws.send(encodeAudio(data.samples));
    stats.framesSent += 1;
  }
}

function onMessage(s, data) {
  if (s.ended || !(data instanceof ArrayBuffer)) return;
  const message = decodeMessage(data);
  switch (message.kind) {
    case Kind.HANDSHAKE:
      s.handshake = true;
      setState("live");
      if (s.resuming) {
        stats.resumes += 1;
        setStatus("Live again: the connection dropped and the conversation was resumed. Speak now.");
      } else {
        setStatus("Live: speak now. Press “Stop talking” to end the conversation.");
      }
      s.resuming = 0;
      s.pingTimer = setInterval(() => send(s, encodePing(++s.pings, performance.now())), PING_INTERVAL_MS);
      break;
    case Kind.AUDIO: {
      const now = performance.now();
      // Frames are 80 ms apart: a longer gap stands for frames that did not come (as duplex loadgen counts).
      if (s.lastAudioMs !== undefined) {
        stats.framesLost += Math.max(0, Math.round((now - s.lastAudioMs) / FRAME_MS) - 1);
      }
      s.lastAudioMs = now;
      stats.framesReceived += 1;
      s.player.push(message.samples, now);
      readPlayer(s);
      break;
    }
    case Kind.TEXT:
      ui.transcript.append(message.text);
      ui.transcript.scrollTop = ui.transcript.scrollHeight;
      stats.transcriptChars += message.text.length;
      break;
    case Kind.ERROR: // the runtime says why before it closes (node full, draining, time limit...)
      s.error = { reason: reasonOfError(message.message), message: message.message };
      showProblem(s.error.reason, s.error.message);
      break;
    case Kind.PING:
      if (Number.isFinite(message.sentAtMs)) stats.rttMs = performance.now() - message.sentAtMs;
      break;
    case Kind.METADATA: // the session's resume credential (single-use: each resume brings the next)
      if (typeof message.data?.resume === "string") s.resume = message.data.resume;
      // Multi-region: the route that reaches the pod holding the slot (docs/protocol.md, "Resume").
      if (typeof message.data?.resume_url === "string") s.resumeUrl = message.data.resume_url;
      break;
    default:
      break;
  }
}

async function onClose(s, event) {
  if (s.ended) return;
  if (s.error) return end(s, s.error.reason, s.error.message);
  // No close frame (1006) after the conversation began, or a reconnection that failed: resume it.
  if (s.resume && event.code === 1006 && (s.handshake || s.resuming)) return resume(s);
  if (!s.opened) {
    // The upgrade was refused: the browser shows 1006 and hides the HTTP status. Ask the node why.
    setStatus("The node refused the connection; asking why…");
    const admission = await checkAdmission(location, s.persona, s.token);
    if (!admission.ok) return end(s, admission.reason, admission.message);
    return end(s, "connection_failed", "refused, though the node would admit a session now: try again");
  }
  if (event.code === 1000 && event.reason !== "max_session_length") return end(s, null);
  end(s, reasonOfClose(event.code, event.reason), event.reason);
}

/** Free what the conversation holds (idempotent: also frees what an await delivered after the end). */
function release(s) {
  clearInterval(s.pingTimer);
  if (s.ws && s.ws.readyState <= WebSocket.OPEN) s.ws.close(1000, "client ended");
  if (s.rtc) closeRtc(s.rtc);
  if (s.audio) {
    s.audio.pause();
    s.audio.srcObject = null;
  }
  s.stream?.getTracks().forEach((track) => track.stop());
  s.source?.disconnect();
  if (s.capture) {
    s.capture.port.onmessage = null;
    s.capture.disconnect();
  }
  s.player?.stop();
  if (s.context.state !== "closed") s.context.close();
}

/** End the conversation; `reason` (a protocol.js REASONS code) when it did not end by choice. */
function end(s, reason, message = "") {
  if (s.ended) return;
  s.ended = true;
  refreshReadout();
  release(s);
  if (session === s) session = null;
  setState("idle");
  refreshReadout(); // the session's report: the playout buffer's mean and max lead
  if (reason) {
    showProblem(reason, message);
    setStatus("Not connected.");
  } else {
    setStatus("Conversation ended.");
  }
}

// --- set-up ----------------------------------------------------------------------------------------------

function takeTokenFromFragment() {
  // #token=... never reaches the server (fragments are not sent); drop it from the address bar and history.
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  if (token) {
    ui.token.value = token;
    history.replaceState(null, "", location.pathname + location.search);
  }
}

function describeToken() {
  const claims = readToken(ui.token.value.trim());
  if (!claims) {
    ui["token-info"].textContent = "";
    return;
  }
  const voices = claims.personas.includes("*") ? "any" : claims.personas.join(", ");
  ui["token-info"].textContent = `Valid until ${claims.expiresAt.toLocaleTimeString()}; voices: ${voices}.`;
}

// The model's frame as the node reports it (GET /api/personas "frame"), Mimi's until the node has said.
let nodeFrame = { sample_rate_hz: SAMPLE_RATE_HZ, samples: FRAME_SAMPLES };

async function loadVoices() {
  try {
    const response = await fetch("/api/personas", { cache: "no-cache" });
    if (!response.ok) return;
    const { voices, frame } = await response.json();
    for (const name of voices) ui.voice.append(new Option(name, name));
    if (frame && Number.isInteger(frame.samples)) nodeFrame = frame; // the model's frame, from the engine

  } catch {
    // The model's own voice stays available.
  }
}

function init() {
  for (const [index, persona] of PERSONAS.entries()) {
    ui.persona.append(new Option(persona.label, String(index)));
  }
  ui.prompt.value = PERSONAS[0].prompt;
  ui.persona.addEventListener("change", () => {
    ui.prompt.value = PERSONAS[Number(ui.persona.value)].prompt;
  });
  takeTokenFromFragment();
  describeToken();
  ui.token.addEventListener("input", describeToken);
  document.getElementById("setup").addEventListener("submit", (event) => event.preventDefault());
  // A native <button>: Space and Enter press it, focus is visible (style.css :focus-visible).
  ui.talk.addEventListener("click", () => {
    if (session) {
      session.userEnded = true;
      end(session, null);
    } else {
      start();
    }
  });
  setInterval(refreshReadout, READOUT_INTERVAL_MS);
  loadVoices();
}

init();
