"""The main job on the machine at hand: bring the ``local`` node up, put real load through it, read the
node's own figures back from Prometheus, and stop it.

``bring_up_and_check`` starts a ``LocalNode``, drives ``profile.max_sessions`` concurrent sessions of
speech through nginx over ``wss://`` (the load generator, ``runtime.tools.loadgen``), each with a fresh
session
token minted from the node's signing key (access control is on, as on every node), knocks once more while
they all run, with a valid token too (that caller must be refused: nginx's session cap answers 503 with
its reason), then asks
Prometheus's HTTP API what it scraped from the runtime (peak active sessions, tick p99, first-audio p99,
refusals, and the first-audio budget term by term: phase wait p50/p99, ticks to first audio, tick compute
p99, egress p99, ingress p99, the total p50/p99). The load generator reads the runtime's ``/metrics``
before and after the run too, so its report carries the same split for exactly the run's sessions, with the
means that add up (docs/benchmarks.md, "First-audio latency budget"). A process of the node that died during
the run is reported, not waited on.

Then the same number of sessions over WebRTC (``runtime.tools.loadgen_rtc``, aiortc clients in two
processes): signalling through nginx (``POST /api/rtc``, ``DELETE`` of its ``Location``), media through the
node's coturn, relay-only (each client asks ``GET /api/rtc/ice-servers`` for its TURN credentials first),
when the profile's relay is on. :func:`transport_rows` sets both runs side by side (first audio p50/p99,
frames lost, ICE connect time), as ``duplex node up`` prints them.

Then (``phone``) the same number of phone calls through each carrier's bridge, as the carrier's side of its
media stream (``runtime.tools.loadgen_phone``): Twilio, Plivo, Telnyx and Exotel, through nginx's
``/api/carriers/<carrier>``, authenticated with the node's (stand-in) carrier secrets (signed for Twilio and
Plivo), espeak-ng speech at 8 kHz, a session token per call where the carrier carries one (Exotel admits on
its credential); one row per carrier beside the other two.

Then (``livekit``) the same number of sessions through LiveKit's PersonaPlex plugin, released and unmodified
(``infra.node.local.livekit_row``: ``runtime/tools/livekit_agent.py`` run with ``.venv-livekit``'s Python, the
plugin's ``RealtimeSession.push_audio`` of speech, through nginx over ``wss://``, a fresh session token per
connection in ``Authorization: Bearer``): a fourth row. A missing virtualenv or a failing plugin is a failed
row naming it, and the node check fails (``make demo`` builds the virtualenv first).

Between the two runs, the resume step (``infra.node.local.resume_check``): one WebSocket session with
``resumable=1`` through nginx, its TCP connection cut without a close frame mid-conversation, reconnected
with its credential: audio again in the same slot under the same session id (read back through the
sessions API), or the check fails.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infra.node.bundle.carriers import CARRIER_PATHS, carrier_credentials, carrier_stream_url
from infra.node.bundle.services import token_audience
from infra.node.local.livekit_row import LiveKitReport, run_livekit_load
from infra.node.local.node import LocalNode
from infra.node.local.prometheus_api import prometheus_query
from infra.node.local.resume_check import ResumeCheck, check_resume
from runtime.frontend.gate.app_tokens import mint_app_token
from runtime.tools.loadgen import LoadReport, SessionResult, run_load, run_session, session_url
from runtime.tools.loadgen_phone import run_phone_load
from runtime.tools.loadgen_rtc import RtcLoadReport, run_rtc_load

__all__ = ["NodeCheck", "bring_up_and_check", "scraped_figures", "transport_rows"]

RTC_PROCESSES = 2
"""Load generator processes the WebRTC sessions share (aiortc's media stack is pure Python: one process
would measure itself)."""

QUIET_TIMEOUT_S = 30.0
"""How long the WebRTC run waits for the WebSocket run's sessions to leave their slots (s)."""

EXTRA_CALLER_DELAY_S = 1.5
"""When the extra caller knocks (s after the load starts): every session is connected by then."""


def _quantile(q: float, histogram: str, scale: float = 1000.0) -> str:
    """PromQL: quantile ``q`` of the runtime's ``histogram`` over the last 5 minutes, times ``scale``."""
    series = f'increase({histogram}_bucket{{job="runtime"}}[5m])'
    return f"{scale:g} * histogram_quantile({q}, sum by (le) ({series}))"


def _mean(histogram: str, scale: float = 1000.0) -> str:
    """PromQL: the mean of the runtime's ``histogram`` over the last 5 minutes, times ``scale``."""
    rate = 'sum(increase({}_{}{{job="runtime"}}[5m]))'
    return f"{scale:g} * {rate.format(histogram, 'sum')} / {rate.format(histogram, 'count')}"


FIRST_AUDIO_QUERIES = {
    "first_audio_phase_wait_p50_ms": _quantile(0.5, "duplex_first_audio_phase_wait_seconds"),
    "first_audio_phase_wait_p99_ms": _quantile(0.99, "duplex_first_audio_phase_wait_seconds"),
    "first_audio_ticks_mean": _mean("duplex_first_audio_ticks", 1.0),
    "first_audio_ticks_p99": f"round({_quantile(0.99, 'duplex_first_audio_ticks', 1.0)})",
    "first_audio_tick_compute_p99_ms": _quantile(0.99, "duplex_first_audio_tick_compute_seconds"),
    "first_audio_egress_p99_ms": _quantile(0.99, "duplex_first_audio_egress_seconds"),
    "first_audio_ingress_p99_ms": _quantile(0.99, "duplex_first_audio_ingress_seconds"),
}
"""The first-audio budget's terms as Prometheus scraped them (the total: ``first_audio_p50_ms``,
``first_audio_p99_ms``). The tick count's buckets sit at k + 0.5, so its p99, rounded, is a count."""

SCRAPED_QUERIES = {
    "peak_active_sessions": 'max_over_time(duplex_active_sessions{job="runtime"}[5m])',
    "slots": 'duplex_slots_total{job="runtime"}',
    "sessions_started": 'duplex_sessions_started_total{job="runtime"}',
    "webrtc_sessions_started": (
        'sum(duplex_transport_sessions_started_total{job="runtime",transport="webrtc"})'
    ),
    "tick_p99_ms": _quantile(0.99, "duplex_tick_duration_seconds"),
    "first_audio_p50_ms": _quantile(0.5, "duplex_first_audio_latency_seconds"),
    "first_audio_p99_ms": _quantile(0.99, "duplex_first_audio_latency_seconds"),
    **FIRST_AUDIO_QUERIES,
    "ticks_over_budget": 'sum(duplex_ticks_over_budget_total{job="runtime"})',
    "admissions_refused_by_runtime": 'sum(duplex_admissions_refused_total{job="runtime"})',
    "targets_up": "sum(up)",
    "targets": "count(up)",
}
"""What ``scraped_figures`` reads back: name -> PromQL."""


def scraped_figures(
    prometheus_url: str, *, want_sessions: int, scrape_interval_s: float, timeout_s: float = 30.0
) -> dict[str, float | None]:
    """The runtime's figures as Prometheus scraped them (``SCRAPED_QUERIES``), after waiting until it has
    scraped ``want_sessions`` started sessions and then two more scrapes (so that every ``increase`` window
    holds the end of the run), or until ``timeout_s`` passed: the figures are then returned as they stand
    and the caller compares."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = prometheus_query(prometheus_url, SCRAPED_QUERIES["sessions_started"])
        if started is not None and started >= want_sessions:
            time.sleep(2 * scrape_interval_s)
            break
        time.sleep(scrape_interval_s)
    return {name: prometheus_query(prometheus_url, q) for name, q in SCRAPED_QUERIES.items()}


@dataclass
class NodeCheck:
    """The outcome of one bring-up: the load report, the extra caller, Prometheus's figures, and what
    went wrong (``problems`` empty means the node works)."""

    load: LoadReport | None = None
    rtc_load: RtcLoadReport | None = None
    rtc_relay: bool = False
    phone_loads: dict[str, LoadReport] = field(default_factory=dict)
    """The phone calls by carrier (``twilio``, ``plivo``, ``telnyx``, ``exotel``), in the order placed."""
    livekit_load: LiveKitReport | None = None
    extra_caller: SessionResult | None = None
    resume: ResumeCheck | None = None
    scraped: dict[str, float | None] = field(default_factory=dict)
    dead_processes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "problems": self.problems,
            "summary": self.load.summary() if self.load else None,
            "first_audio_budget": self.load.budget if self.load else None,
            "sessions": self.load.session_rows() if self.load else [],
            "transports": transport_rows(self),
            "webrtc": {
                "relay_only": self.rtc_relay,
                "summary": self.rtc_load.summary(),
                "sessions": self.rtc_load.session_rows(),
            }
            if self.rtc_load
            else None,
            "phone": {
                carrier: {"summary": report.summary(), "sessions": report.session_rows()}
                for carrier, report in self.phone_loads.items()
            },
            "livekit": {
                "summary": self.livekit_load.summary(),
                "failure": self.livekit_load.failure,
                "sessions": [vars(s) for s in self.livekit_load.sessions],
            }
            if self.livekit_load
            else None,
            "extra_caller": {
                "refused": self.extra_caller.refused,
                "reason": self.extra_caller.refusal_reason,
                "http_status": self.extra_caller.http_status,
            }
            if self.extra_caller
            else None,
            "resume": {**self.resume.as_row(), "problems": self.resume.problems} if self.resume else None,
            "prometheus": self.scraped,
            "dead_processes": self.dead_processes,
        }


def transport_rows(check: NodeCheck) -> list[dict[str, object]]:
    """One row per transport the check ran (``websocket``, ``webrtc``, ``twilio``, then ``livekit``):
    sessions served of those launched, first audio p50/p99 (ms, the client's: first frame sent -> first
    audio back; a phone call's: its ``start`` message -> the first agent frame; the LiveKit plugin's: first
    ``push_audio`` -> first audio frame it delivered), frames lost (None for LiveKit: the plugin hides the
    node's frame sequence), and for WebRTC the POST -> connected (ICE and DTLS) p50/p99 (ms), concealed 20 ms
    packets and whether the media was relay-only. ``audio_s``: seconds of audio the LiveKit plugin
    delivered (None for the others); ``failure``: why the LiveKit run gave no result (None otherwise)."""
    rows: list[dict[str, object]] = []
    runs = (("websocket", check.load), ("webrtc", check.rtc_load), *check.phone_loads.items())
    for transport, report in runs:
        if report is None:
            continue
        total = report.summary()
        row: dict[str, object] = {
            "transport": transport,
            "sessions": len(report.sessions),
            "served": len(report.served),
            "first_audio_ms_p50": total["first_audio_ms_p50"],
            "first_audio_ms_p99": total["first_audio_ms_p99"],
            "frames_lost": total["frames_lost"],
            "ice_connect_ms_p50": total.get("ice_connect_ms_p50"),
            "ice_connect_ms_p99": total.get("ice_connect_ms_p99"),
            "concealed_packets": total.get("concealed_packets"),
            "relay_only": check.rtc_relay if transport == "webrtc" else None,
            "audio_s": None,
            "failure": None,
        }
        rows.append(row)
    if check.livekit_load is not None:
        total = check.livekit_load.summary()
        rows.append(
            {
                "transport": "livekit",
                "sessions": total["sessions"],
                "served": total["served"],
                "first_audio_ms_p50": total["first_audio_ms_p50"],
                "first_audio_ms_p99": total["first_audio_ms_p99"],
                "frames_lost": None,
                "ice_connect_ms_p50": None,
                "ice_connect_ms_p99": None,
                "concealed_packets": None,
                "relay_only": None,
                "audio_s": total["audio_s"],
                "failure": check.livekit_load.failure,
            }
        )
    return rows


def _active_sessions(runtime_url: str) -> float | None:
    """The runtime's ``duplex_active_sessions`` from its ``/metrics``; None when it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{runtime_url}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("duplex_active_sessions"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _wait_until_quiet(runtime_url: str, timeout_s: float) -> None:
    """Until the runtime holds no session (the WebSocket run's slots freed), or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _active_sessions(runtime_url) not in (0.0, None):
        time.sleep(0.2)


def runtime_health_problem(runtime_url: str, *, timeout_s: float = 5.0) -> str | None:
    """None when ``GET <runtime_url>/healthz`` answers 200, else the problem in words: the status and
    body (``500 engine unreachable`` when the runtime's engine process died, ``runtime/frontend/worker.py``),
    or
    that nothing answered."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{runtime_url}/healthz", timeout=timeout_s) as response:
            return None if response.status == 200 else f"runtime /healthz answered {response.status}"
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", errors="replace").strip()[:200]
        return f"runtime /healthz answered {exc.code}: {body}"
    except OSError as exc:
        return f"runtime /healthz did not answer: {exc}"


def _check_load(check: NodeCheck, sessions: int) -> None:
    assert check.load is not None
    for i, r in enumerate(check.load.sessions):
        if r.failure:  # not served, cut before its last frame, or closed with a code other than 1000
            check.problems.append(f"session {i} {r.failure}")
        elif r.audio_messages == 0:
            check.problems.append(f"session {i} got no audio")
        elif not r.text.strip():
            check.problems.append(f"session {i} got no text")
    if check.rtc_load is not None:
        for i, r in enumerate(check.rtc_load.sessions):
            if r.failure:
                check.problems.append(f"WebRTC session {i} {r.failure}")
            elif r.audio_messages == 0:
                check.problems.append(f"WebRTC session {i} got no audio")
    for carrier, report in check.phone_loads.items():
        for i, r in enumerate(report.sessions):
            if r.failure:
                check.problems.append(f"{carrier} call {i} {r.failure}")
            elif r.audio_messages == 0:
                check.problems.append(f"{carrier} call {i} got no audio")
    if check.livekit_load is not None:
        check.problems.extend(check.livekit_load.problems())
    extra = check.extra_caller
    if extra is not None and not extra.refused:
        check.problems.append(f"caller {sessions + 1} was served although the node has {sessions} slots")


def bring_up_and_check(
    node: LocalNode,
    speech: Sequence[np.ndarray],
    *,
    sessions: int | None = None,
    on_frame: Callable[[], None] | None = None,
    progress: Callable[[str], None] | None = None,
    max_duration_s: float = 120.0,
    webrtc: bool = True,
    resume: bool = True,
    phone: bool = True,
    livekit: bool = True,
    livekit_python: Path | None = None,
) -> NodeCheck:
    """Drive the (started) ``node``: ``sessions`` (default: its slot count) concurrent sessions through
    nginx over TLS, one extra caller while they run, then (``resume``) one session dropped and resumed
    (``infra.node.local.resume_check``), then (``webrtc``) as many WebRTC sessions, relay-only
    through the node's coturn when its relay is on, then (``phone``) as many Twilio calls, then
    (``livekit``) as many sessions through LiveKit's plugin run by ``livekit_python`` (default
    ``infra.node.local.livekit_row.default_livekit_python``), then Prometheus's figures. Never raises for a
    node failure: what went wrong is in ``NodeCheck.problems``."""
    say = progress or (lambda message: None)
    sessions = sessions or node.profile.sessions
    url = session_url(node.wss_url)
    context = node.ssl_context()
    check = NodeCheck()

    async def drive() -> tuple[LoadReport, SessionResult]:
        load = asyncio.create_task(
            run_load(
                url,
                speech,
                sessions=sessions,
                ssl_context=context,
                on_frame=on_frame,
                max_duration_s=max_duration_s,
                token=node.mint_token,
                metrics_url=f"{node.runtime_url}/metrics",
            )
        )
        await asyncio.sleep(EXTRA_CALLER_DELAY_S)
        extra = await run_session(
            url, speech[0][: 1920 * 5], ssl_context=context, tail_s=0.1, token=node.mint_token()
        )
        return await load, extra

    say(f"streaming {sessions} sessions through {node.wss_url}")
    check.load, check.extra_caller = asyncio.run(drive())
    if resume and not node.dead_processes():
        say(f"dropping one resumable session's TCP connection through {node.wss_url} and resuming it")
        _wait_until_quiet(node.runtime_url, QUIET_TIMEOUT_S)
        app_token = mint_app_token(
            node.secrets.app_signing_keys()[0], ttl_s=300, audience=token_audience(node.profile)
        )
        check.resume = asyncio.run(
            check_resume(
                node.wss_url,
                node.https_url,
                np.concatenate(list(speech)),
                token=node.mint_token(),
                app_token=app_token,
                ssl_context=context,
            )
        )
        check.problems.extend(check.resume.problems)
    if webrtc and not node.dead_processes():
        check.rtc_relay = node.profile.relay.enabled
        route = "relay-only through its TURN relay" if check.rtc_relay else "direct"
        say(f"streaming {sessions} WebRTC sessions through {node.https_url}/api/rtc ({route})")
        _wait_until_quiet(node.runtime_url, QUIET_TIMEOUT_S)
        check.rtc_load = asyncio.run(
            run_rtc_load(
                node.https_url,
                speech,
                sessions=sessions,
                processes=RTC_PROCESSES,
                token=node.mint_token,
                cafile=str(node.certificate_path),
                max_duration_s=max_duration_s,
                relay=check.rtc_relay,
            )
        )
    for carrier, secret in carrier_credentials(node.secrets.carrier_secrets).items() if phone else ():
        if node.dead_processes():
            break
        say(f"calling {sessions} times through {node.wss_url}{CARRIER_PATHS[carrier]} ({carrier}'s side)")
        _wait_until_quiet(node.runtime_url, QUIET_TIMEOUT_S)
        check.phone_loads[carrier] = asyncio.run(
            run_phone_load(
                carrier,
                node.wss_url,
                speech,
                sessions=sessions,
                secret=secret,
                stream_url=carrier_stream_url(node.profile, carrier),
                token=None if carrier == "exotel" else node.mint_token,
                max_duration_s=max_duration_s,
                ssl_context=context,
            )
        )
    if livekit and not node.dead_processes():
        say(f"{sessions} sessions through LiveKit's PersonaPlex plugin, {node.wss_url}/api/chat")
        _wait_until_quiet(node.runtime_url, QUIET_TIMEOUT_S)
        check.livekit_load = run_livekit_load(
            node.wss_url,
            speech,
            sessions=sessions,
            token=node.mint_token,
            cafile=str(node.certificate_path),
            python=livekit_python,
        )
    _check_load(check, sessions)
    health = runtime_health_problem(node.runtime_url)
    if health is not None:
        check.problems.append(health)
    check.dead_processes = node.dead_processes()
    for name, code in check.dead_processes.items():
        check.problems.append(
            f"{name} exited with code {code} during the run; log: {node.process(name).log_path}"
        )
    if "prometheus" in check.dead_processes:
        return check
    say("reading the node's figures back from Prometheus")
    try:
        served = len(check.load.served) + sum(
            len(report.served)
            for report in (check.rtc_load, *check.phone_loads.values())
            if report is not None
        )
        # each plugin session is one session on the node
        served += len(check.livekit_load.served) if check.livekit_load is not None else 0
        check.scraped = scraped_figures(
            node.prometheus_url, want_sessions=served, scrape_interval_s=node.profile.scrape_interval_s
        )
    except Exception as exc:  # PrometheusQueryError, or anything Prometheus's API surprises us with
        check.problems.append(f"Prometheus: {exc}")
        return check
    if (check.scraped.get("sessions_started") or 0) < served:
        check.problems.append(
            f"Prometheus saw {check.scraped.get('sessions_started')} sessions started, the clients {served}"
        )
    return check
