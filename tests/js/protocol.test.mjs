// The page's session URLs and first message (infra/node/web/protocol.js): no secret in a URL (issue 34,
// item 9: proxies and load balancers log URLs). Run: node --test tests/js/ (tests/test_playout_js.py runs
// every file here under pytest); tests/test_gate_refusals.py checks the node's side.

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  Kind,
  TEXT_PROMPT_HEADER,
  chatUrl,
  encodeMetadata,
  sessionQuery,
  textPromptOf,
} from "../../infra/node/web/protocol.js";

const LOCATION = { protocol: "https:", host: "node.example.com" };
const PERSONA = { voicePrompt: "NATF2.pt", textPrompt: "  You are Ada, the bank's fraud agent.  " };

test("the text prompt never goes in a session URL", () => {
  const url = new URL(chatUrl(LOCATION, PERSONA));
  assert.equal(url.pathname, "/api/chat");
  assert.equal(url.searchParams.get("text_prompt"), null);
  assert.equal(url.searchParams.get("text_prompt_in"), "metadata");
  assert.equal(url.searchParams.get("voice_prompt"), "NATF2.pt");
  assert.ok(!url.href.includes("Ada"));
  assert.ok(!String(sessionQuery(PERSONA)).includes("Ada")); // /api/rtc and /api/admission's query
});

test("without a text prompt no metadata is announced", () => {
  const url = new URL(chatUrl(LOCATION, { voicePrompt: "", textPrompt: "   " }));
  assert.equal(url.searchParams.get("text_prompt_in"), null);
  assert.equal(textPromptOf({ textPrompt: "   " }), "");
});

test("the first message carries the prompt as a 0x04 metadata object, UTF-8", () => {
  const bytes = new Uint8Array(encodeMetadata({ text_prompt: textPromptOf(PERSONA) + " é" }));
  assert.equal(bytes[0], Kind.METADATA);
  assert.deepEqual(JSON.parse(new TextDecoder().decode(bytes.slice(1))), {
    text_prompt: "You are Ada, the bank's fraud agent. é",
  });
  assert.equal(TEXT_PROMPT_HEADER, "Duplex-Text-Prompt");
});
