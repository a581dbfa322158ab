// StrykerJS over the browser client's jitter/playout logic and Kyutai wire-protocol framing (issue 31;
// docs/mutation.md, "Browser client (StrykerJS)"). Run from the repository root: `make mutation-js`
// (Stryker's paths below are relative to its working directory, the root, not to this file).

/** @type {import('@stryker-mutator/api/core').PartialStrykerOptions} */
export default {
  // player.js, rtc.js and app.js need a DOM (AudioContext, RTCPeerConnection): out of scope.
  mutate: ['infra/node/web/playout.js', 'infra/node/web/protocol.js'],
  // Stryker copies the working directory into a sandbox per run; copy only what the tests read
  // (gitignore syntax: everything at the root ignored, then the two folders let back in).
  ignorePatterns: ['/*', '!/infra', '/infra/*', '!/infra/node', '/infra/node/*', '!/infra/node/web', '!/tests', '/tests/*', '!/tests/js'],
  // The command runner runs the whole node:test suite per mutant (about 0.5 s here); it has no per-test
  // coverage, so coverageAnalysis must be "off".
  testRunner: 'command',
  commandRunner: { command: 'node --test tests/js/' },
  coverageAnalysis: 'off',
  // One mutant at a time: the development machine has 2 cores shared with other work.
  concurrency: 1,
  reporters: ['clear-text', 'json', 'progress'],
  clearTextReporter: { allowColor: false },
  // Under /artifacts/ (ignored by git).
  jsonReporter: { fileName: 'artifacts/stryker/mutation.json' },
  tempDirName: 'artifacts/stryker/tmp',
  // The goal of docs/mutation.md: at least 90 % killed per file. A report, not a gate: no "break".
  thresholds: { high: 90, low: 80, break: null },
};
