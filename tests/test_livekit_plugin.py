"""LiveKit's PersonaPlex plugin, released and unmodified (``livekit-plugins-nvidia[personaplex]`` 1.8.9),
against a ``duplex serve --model sim`` node with access control on (issue 32, item 2; docs/livekit.md).

The plugin runs in its own virtualenv (``make livekit-deps``: ``.venv-livekit`` from
``requirements-livekit.lock``; ``make test`` installs it), so these tests run ``tests/livekit_driver.py`` with
that Python. The driver feeds the plugin's ``RealtimeSession.push_audio`` with ``rtc.AudioFrame``s of
espeak-ng speech (20 ms, 24 kHz, in real time) and reports what came out of the plugin. The token travels in
``Authorization: Bearer``, set by an aiohttp client middleware on the ``http_session`` the plugin accepts: a
fresh single-use token on each connection, its first and its reconnects.

The node (one process, 5 slots, a waiting room of one, session tokens spent in Redis, the sessions API on
with application keys) holds one voice, ``NATF2`` (espeak-ng speech as a ``.wav``: the sim model has no
NVIDIA presets), so that the plugin's ``voice_prompt=NATF2.pt`` must resolve to it. The node's side is read
through its sessions API: each plugin connection is a session there, with its voice and its text prompt's
digest.

Planted bugs these catch: ``VoiceCatalog.get`` without the ``<NAME>.pt`` -> ``<NAME>`` fallback (every plugin
call refused: no audio); a node that ignored ``text_prompt`` (digests differ); a waiting room that served
no one after a hang-up, or served the caller past the cap at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.frontend.gate.app_tokens import SCOPE_READ, mint_app_token
from runtime.frontend.gate.tokens import SigningKey, mint_token
from runtime.tools.bench_frontend import node
from runtime.tools.loadgen import synthesize_speech
from runtime.tools.local_redis import RedisServer

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).with_name("livekit_driver.py")
LIVEKIT_PYTHON = Path(os.environ.get("DUPLEX_LIVEKIT_PYTHON", ROOT / ".venv-livekit" / "bin" / "python"))
AUDIENCE = "livekit-test"
KEY = SigningKey("lk-session", "a" * 32)
APP_KEY = SigningKey("lk-app", "c" * 32)
CAP = 5
PROMPTS = [
    "You are a helpful assistant at a restaurant; take the caller's booking.",
    "You enjoy having a good conversation.",
]


def session_tokens(count: int) -> list[str]:
    """``count`` single-use session tokens (each ``jti`` admits one connection) for the voice ``NATF2``, the
    name a back end knows (the plugin asks for ``NATF2.pt``)."""
    return [mint_token(KEY, ttl_s=300, personas=["NATF2"], audience=AUDIENCE) for _ in range(count)]


@pytest.fixture(scope="module")
def livekit_python() -> Path:
    if not LIVEKIT_PYTHON.exists():
        pytest.fail(f"{LIVEKIT_PYTHON} is missing: run `make livekit-deps` (make test does)")
    return LIVEKIT_PYTHON


@pytest.fixture(scope="module")
def speech(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("speech") / "speech.npy"
    np.save(path, synthesize_speech("Hello, I would like to book a table for two tonight at eight, please."))
    return path


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    voices = tmp_path_factory.mktemp("voices")
    subprocess.run(
        ["espeak-ng", "-w", str(voices / "NATF2.wav"), "Hello, I am the voice of this persona."], check=True
    )
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    redis.start()
    env = {
        "DUPLEX_AUTH_MODE": "token",
        "DUPLEX_TOKEN_KEYS": json.dumps({KEY.kid: KEY.secret.decode()}),
        "DUPLEX_APP_TOKEN_KEYS": json.dumps({APP_KEY.kid: APP_KEY.secret.decode()}),
        "DUPLEX_TOKEN_AUDIENCE": AUDIENCE,
        "DUPLEX_TOKEN_REPLAY_CHECK": "redis",
        "DUPLEX_REDIS_URL": redis.url,
        "DUPLEX_VOICES_DIR": str(voices),
        "DUPLEX_WAITING_ROOM_SIZE": "1",
        "DUPLEX_WAITING_ROOM_S": "60",
        "PYTHONPATH": str(ROOT),
    }
    try:
        with node(0, CAP, "30", env=env) as serving:
            yield serving
    finally:
        redis.stop()


def drive(python: Path, plan: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Run the driver's ``plan["scenario"]`` with the LiveKit virtualenv's Python; its JSON report."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    run = subprocess.run(
        [str(python), str(DRIVER), str(path)], capture_output=True, text=True, timeout=240, check=False
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    report["log"] = run.stderr
    return report


def digest(text: str) -> str:
    """The sessions API's ``prompt.sha256`` of a text (runtime.frontend.store.events ``prompt_digest``)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ended_sessions(port: int) -> list[dict[str, Any]]:
    """The node's ended sessions, as its sessions API lists them (an application token, ``sessions:read``)."""
    token = mint_app_token(APP_KEY, ttl_s=60, audience=AUDIENCE, scopes=[SCOPE_READ])
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/sessions?state=ended&limit=1000",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        sessions: list[dict[str, Any]] = json.loads(answer.read())["sessions"]
    return sessions


def test_a_call_reaches_the_persona_through_the_token_gate_and_reconnects_on_new_instructions(
    livekit_python: Path, speech: Path, port: int, tmp_path: Path
) -> None:
    before = {s["id"] for s in ended_sessions(port)}
    plan = {
        "scenario": "one_call",
        "url": f"ws://127.0.0.1:{port}",
        "tokens": session_tokens(2),
        "voice": "NATF2",
        "text_prompts": PROMPTS,
        "speech": str(speech),
        "seconds": 4.0,
    }
    report = drive(livekit_python, plan, tmp_path)
    assert report["errors"] == [], report["log"][-3000:]
    # The plugin's own URL (realtime_model.py _build_ws_url), once per connection: the voice as NVIDIA's
    # file name, the text prompt, the seed; the token is not in it (it went as a header).
    first, second = report["requests"]
    assert first.startswith(f"ws://127.0.0.1:{port}/api/chat?voice_prompt=NATF2.pt&text_prompt=You%20are")
    assert "seed=7" in first and "token" not in first
    assert "text_prompt=You%20enjoy" in second
    # Audio came back from the plugin (the sim echoes the caller at half level), a second of it on each
    # connection: the second after update_instructions made the plugin reconnect (session_reconnected).
    (at_reconnect,) = report["samples_at_reconnect"]
    assert at_reconnect >= 24000
    assert report["samples"] - at_reconnect >= 24000
    # The node saw two sessions, each with the voice NATF2.pt and the text prompt of its connection.
    sessions = [s for s in ended_sessions(port) if s["id"] not in before]
    assert len(sessions) == 2, sessions
    sessions.sort(key=lambda s: float(s["started_at"]))
    for session, prompt in zip(sessions, PROMPTS, strict=True):
        assert session["persona"] == "voice=NATF2.pt", session
        # The listing gives this connection's text prompt's digest and length, never its words
        # (conversation.py persona_label carries them; issue 34, item 8).
        assert session["prompt"]["sha256"] == digest(prompt), session
        assert str(session["prompt"]["chars"]) == str(len(prompt)), session
    assert sessions[0]["prompt"] != sessions[1]["prompt"]


def test_a_call_through_the_nodes_nginx_over_wss(
    livekit_python: Path, speech: Path, port: int, tmp_path: Path
) -> None:
    """The local profile's rendered nginx (TLS) in front of the node: the plugin's ``wss://`` URL, its
    ``Authorization`` header through nginx's ``/api/chat`` location, audio back on both connections."""
    from nginx_front import start_nginx

    from infra.node.bundle.nginx import render_nginx
    from infra.node.local.network import free_port_profile

    profile = free_port_profile()
    profile = profile.model_copy(update={"ports": profile.ports.model_copy(update={"runtime": port})})
    process, _, base = start_nginx(profile, tmp_path / "nginx", render_nginx(profile))
    try:
        plan = {
            "scenario": "one_call",
            "url": base.replace("https://", "wss://"),
            "cafile": str(tmp_path / "nginx" / profile.tls.certificate_path),
            "tokens": session_tokens(2),
            "voice": "NATF2",
            "text_prompts": PROMPTS,
            "speech": str(speech),
            "seconds": 3.0,
        }
        for _ in range(100):  # nginx listening
            if process.poll() is not None or socket_open(profile.ports.https):
                break
            time.sleep(0.1)
        assert process.poll() is None, (tmp_path / "nginx" / "logs" / "error.log").read_text()
        report = drive(livekit_python, plan, tmp_path)
    finally:
        process.terminate()
        process.wait(10)
    assert report["errors"] == [], report["log"][-3000:]
    assert report["requests"][0].startswith(f"{plan['url']}/api/chat?voice_prompt=NATF2.pt&")
    (at_reconnect,) = report["samples_at_reconnect"]
    assert at_reconnect >= 24000 and report["samples"] - at_reconnect >= 24000


def socket_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def test_at_the_cap_the_next_call_waits_and_the_one_after_gets_an_error_the_plugin_surfaces(
    livekit_python: Path, speech: Path, port: int, tmp_path: Path
) -> None:
    plan = {
        "scenario": "at_the_cap",
        "url": f"ws://127.0.0.1:{port}",
        "tokens": session_tokens(CAP + 2),
        "voice": "NATF2",
        "text_prompts": PROMPTS,
        "speech": str(speech),
        "cap": CAP,
        "wait_s": 1.0,
        "metrics_url": f"http://127.0.0.1:{port}/metrics",
    }
    report = drive(livekit_python, plan, tmp_path)
    assert report["holders_served"], report
    # The 6th call is in the waiting room: connected, no handshake, so the plugin sends nothing and
    # hears nothing; it is served once a holder hangs up, with no error on its side.
    assert report["waited_in_room"], report
    assert report["waiting_samples_while_full"] == 0, report
    assert report["waiting_served_after_a_hangup"], report["log"][-3000:]
    assert report["waiting_errors"] == []
    # The 7th finds the waiting room full: the node's 0x05 and close code 1013 after the upgrade; the
    # plugin surfaces it as a recoverable APIConnectionError (its "error" event) and would retry.
    refused = report["refused"]
    assert refused["samples"] == 0
    assert refused["errors"][0] == {
        "type": "APIConnectionError",
        "message": "PersonaPlex connection closed unexpectedly",
        "recoverable": True,
    }
    assert "Unknown PersonaPlex message type: 0x05" in report["log"]


def test_a_fixed_token_header_admits_one_connection_and_the_reconnect_is_refused_as_replayed(
    livekit_python: Path, speech: Path, port: int, tmp_path: Path
) -> None:
    """Why the token goes through a middleware that mints per connection (docs/livekit.md): a fixed
    ``Authorization`` header on the plugin's session is spent by its first session, and the node refuses the
    reconnect before the upgrade (403 ``replayed``), which the plugin reports as non-recoverable."""
    plan = {
        "scenario": "fixed_token",
        "url": f"ws://127.0.0.1:{port}",
        "tokens": session_tokens(1),
        "voice": "NATF2",
        "text_prompts": PROMPTS,
        "speech": str(speech),
        "seconds": 3.0,
    }
    report = drive(livekit_python, plan, tmp_path)
    assert report["samples"] >= 24000, report["log"][-3000:]
    (error,) = report["errors"]
    assert error["type"] == "APIConnectionError" and not error["recoverable"], error
    assert "403" in error["message"], error
