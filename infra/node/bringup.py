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
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from infra.node.local import LocalNode
from infra.node.prometheus_api import prometheus_query
from runtime.tools.loadgen import LoadReport, SessionResult, run_load, run_session, session_url

__all__ = ["NodeCheck", "bring_up_and_check", "scraped_figures"]

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
    extra_caller: SessionResult | None = None
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
            "extra_caller": {
                "refused": self.extra_caller.refused,
                "reason": self.extra_caller.refusal_reason,
                "http_status": self.extra_caller.http_status,
            }
            if self.extra_caller
            else None,
            "prometheus": self.scraped,
            "dead_processes": self.dead_processes,
        }


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
) -> NodeCheck:
    """Drive the (started) ``node``: ``sessions`` (default: its slot count) concurrent sessions through
    nginx over TLS, one extra caller while they run, then Prometheus's figures. Never raises for a node
    failure: what went wrong is in ``NodeCheck.problems``."""
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
        served = len(check.load.served)
        check.scraped = scraped_figures(
            node.prometheus_url, want_sessions=served, scrape_interval_s=node.profile.scrape_interval_s
        )
    except Exception as exc:  # PrometheusQueryError, or anything Prometheus's API surprises us with
        check.problems.append(f"Prometheus: {exc}")
        return check
    if (check.scraped.get("sessions_started") or 0) < len(check.load.served):
        check.problems.append(
            f"Prometheus saw {check.scraped.get('sessions_started')} sessions started, the clients {served}"
        )
    return check
