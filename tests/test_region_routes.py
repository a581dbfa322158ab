"""The routes that bring a resume back to its pod and a WebRTC offer to its ICE servers' region on a
multi-region stack (issue 33; ``runtime.region_routes``; docs/deploying.md, "Resume across regions"): the
resume metadata's ``resume_url`` and the ICE-servers answer's ``offer_url``, present only when the node is
told its region, public URL and pod address, absent on single nodes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from runtime.config import RuntimeConfig
from runtime.frontend.session.resume import ResumableSession
from runtime.frontend.transports.webrtc.signalling import serve_ice_servers
from runtime.region_routes import check_public_url, offer_url, pod_label, resume_url


def multi_region(**more: Any) -> RuntimeConfig:
    """A multi-region pod's settings: region, public URL and pod address (the stack sets the three)."""
    return RuntimeConfig(
        region="us-central1", public_url="https://voice.example.com", pod_ip="10.4.0.12", **more
    )


class _Session(ResumableSession):
    """The resume half alone (the sink's output methods are the conversation's)."""

    def on_output(self, *args: object) -> None:
        raise AssertionError("not streaming here")

    def on_prompt_done(self, *args: object) -> None:
        raise AssertionError("not streaming here")


def metadata_of(config: RuntimeConfig, transport: str) -> dict[str, object]:
    """``resume_metadata`` of a live session holding a credential, on a node with ``config``."""
    session: Any = object.__new__(_Session)
    session.front = SimpleNamespace(config=config)
    session.transport = SimpleNamespace(name=transport)
    session.session_id = "s1"
    session.lease = SimpleNamespace(resume_credential="s1.credential", slot=0)
    session.resumed = None
    return session.resume_metadata()


def test_pod_label_is_the_headless_services_dashed_address() -> None:
    assert pod_label("10.4.0.12") == "10-4-0-12"
    for bad in ("fe80::1", "10.4.0", "duplex-runtime-0", "10.4.0.12/24"):
        with pytest.raises(ValueError, match="IPv4"):
            pod_label(bad)


def test_public_url_is_a_scheme_and_host_only() -> None:
    assert check_public_url("https://voice.example.com/") == "https://voice.example.com"
    assert check_public_url("https://voice.example.com:8443") == "https://voice.example.com:8443"
    for bad in ("voice.example.com", "https://voice.example.com/app", "ftp://x", "https://x?a=1"):
        with pytest.raises(ValueError, match="DUPLEX_PUBLIC_URL"):
            check_public_url(bad)


def test_urls_name_region_and_pod() -> None:
    base, region, ip = "https://voice.example.com", "europe-west4", "10.8.1.7"
    assert (
        resume_url(base, region, ip, "websocket")
        == "wss://voice.example.com/r/europe-west4/10-8-1-7/api/chat"
    )
    assert (
        resume_url(base, region, ip, "webrtc") == "https://voice.example.com/r/europe-west4/10-8-1-7/api/rtc"
    )
    assert resume_url("http://127.0.0.1:8080", region, ip, "websocket").startswith("ws://127.0.0.1:8080/r/")
    assert offer_url(base, region) == "https://voice.example.com/r/europe-west4/api/rtc"


def test_config_refuses_bad_values_naming_the_variable() -> None:
    with pytest.raises(ValidationError, match="DUPLEX_POD_IP"):
        RuntimeConfig(pod_ip="::1")
    with pytest.raises(ValidationError, match="region"):
        RuntimeConfig(region="Europe West")
    with pytest.raises(ValidationError, match="DUPLEX_PUBLIC_URL"):
        RuntimeConfig(public_url="https://voice.example.com/api")


def test_resume_metadata_names_the_pod_on_multi_region_only() -> None:
    multi = multi_region()
    ws = metadata_of(multi, "websocket")
    assert ws["resume_url"] == "wss://voice.example.com/r/us-central1/10-4-0-12/api/chat"
    assert ws["resume"] == "s1.credential"
    assert (
        metadata_of(multi, "webrtc")["resume_url"]
        == "https://voice.example.com/r/us-central1/10-4-0-12/api/rtc"
    )
    single = metadata_of(RuntimeConfig(), "websocket")
    assert "resume_url" not in single and single["resume"] == "s1.credential"
    partial = metadata_of(
        RuntimeConfig(region="us-central1", public_url="https://voice.example.com"), "websocket"
    )
    assert "resume_url" not in partial  # without the pod's address there is no route to it


def ice_answer(config: RuntimeConfig) -> dict[str, object]:
    response = asyncio.run(serve_ice_servers(SimpleNamespace(config=config), None, None))  # type: ignore[arg-type]
    body: dict[str, object] = json.loads(response.text or "{}")
    return body


def test_ice_servers_answer_names_the_regional_offer_path() -> None:
    multi = multi_region(turn_urls="stun:turn-us-central1.voice.example.com:3478")
    answer = ice_answer(multi)
    assert answer["offer_url"] == "https://voice.example.com/r/us-central1/api/rtc"
    assert answer["iceServers"] == [{"urls": ["stun:turn-us-central1.voice.example.com:3478"]}]
    assert "offer_url" not in ice_answer(RuntimeConfig())
