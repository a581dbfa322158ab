"""The runtime keeps its pod's ``controller.kubernetes.io/pod-deletion-cost`` at its live sessions
(``runtime.fleet.deletion_cost``, issue 33), tested against a fake Kubernetes API server (aiohttp): the
merge-patch it sends, when it writes (threshold, zero crossings, the least interval on an injected clock),
and that a refusing or hanging API server is logged and counted and never raises."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from runtime.config import RuntimeConfig
from runtime.fleet.deletion_cost import (
    ANNOTATION,
    DeletionCostReporter,
    PodRef,
    deletion_cost,
    in_cluster_api_url,
    sessions_on,
    start_deletion_cost,
)
from runtime.metrics import RuntimeMetrics

POD = PodRef(namespace="duplex", name="duplex-runtime-7d9f-abcde")


@dataclass
class FakeApiServer:
    """Answers ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` as the API server does for a merge-patch:
    ``status`` (200, or 403 as RBAC refuses), or never (``hang``: a timeout)."""

    status: int = 200
    hang: bool = False
    patches: list[tuple[str, str, str, dict]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)

    async def patch(self, request: web.Request) -> web.Response:
        if self.hang:
            await asyncio.sleep(3600)
        body = json.loads(await request.text())
        self.patches.append(
            (request.path, request.headers["Content-Type"], request.headers["Authorization"], body)
        )
        if self.status != 200:
            return web.json_response({"kind": "Status", "reason": "Forbidden"}, status=self.status)
        self.annotations.update(body["metadata"]["annotations"])
        return web.json_response({"metadata": {"annotations": self.annotations}})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def api() -> AsyncIterator[tuple[FakeApiServer, str]]:
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_route("PATCH", "/api/v1/namespaces/{ns}/pods/{name}", fake.patch)
    server = TestServer(app)
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _reporter(url: str, http: aiohttp.ClientSession, clock: Clock, **kw: object) -> DeletionCostReporter:
    outcomes: list[str] = []
    reporter = DeletionCostReporter(
        POD,
        url,
        http,
        lambda: "tok-1",
        clock=clock,
        on_outcome=outcomes.append,
        **kw,  # type: ignore[arg-type]
    )
    reporter.outcomes = outcomes  # type: ignore[attr-defined]
    return reporter


async def test_it_merge_patches_its_own_pods_annotation(api, http) -> None:  # type: ignore[no-untyped-def]
    fake, url = api
    reporter = _reporter(url, http, Clock())
    assert await reporter.report(3) == "written"
    [(path, content_type, authorization, body)] = fake.patches
    assert path == "/api/v1/namespaces/duplex/pods/duplex-runtime-7d9f-abcde"
    assert content_type == "application/merge-patch+json"
    assert authorization == "Bearer tok-1"
    assert body == {"metadata": {"annotations": {ANNOTATION: "3"}}}
    assert fake.annotations == {"controller.kubernetes.io/pod-deletion-cost": "3"}
    assert reporter.written == 3


async def test_it_writes_only_on_a_change_and_at_most_every_interval(api, http) -> None:  # type: ignore[no-untyped-def]
    fake, url = api
    clock = Clock()
    reporter = _reporter(url, http, clock, min_interval_s=10.0, threshold=2)
    assert await reporter.report(4) == "written"
    clock.now += 30
    assert await reporter.report(5) is None  # moved by 1 < threshold 2
    assert await reporter.report(6) == "written"
    clock.now += 3
    assert await reporter.report(0) is None  # a zero crossing, but within the interval
    clock.now += 7
    assert await reporter.report(0) == "written"  # idle now: written at once, whatever the threshold
    clock.now += 10
    assert await reporter.report(1) == "written"  # no longer idle: a crossing of zero too
    assert [p[3]["metadata"]["annotations"][ANNOTATION] for p in fake.patches] == ["4", "6", "0", "1"]


async def test_a_refusing_api_server_is_counted_and_retried_never_raised(api, http, caplog) -> None:  # type: ignore[no-untyped-def]
    fake, url = api
    fake.status = 403
    clock = Clock()
    reporter = _reporter(url, http, clock, min_interval_s=10.0)
    assert await reporter.report(2) == "refused"
    assert reporter.written is None
    assert "answered 403" in caplog.text and "calls are unaffected" in caplog.text
    assert await reporter.report(2) is None  # retried after the interval, not at once
    fake.status = 200
    clock.now += 10
    assert await reporter.report(2) == "written"
    assert reporter.outcomes == ["refused", "written"]  # type: ignore[attr-defined]


async def test_a_hanging_api_server_times_out_as_failed(api, http, caplog) -> None:  # type: ignore[no-untyped-def]
    fake, url = api
    fake.hang = True
    reporter = _reporter(url, http, Clock(), timeout_s=0.2)
    assert await reporter.report(1) == "failed"
    assert "TimeoutError" in caplog.text


async def test_an_unreachable_api_server_or_a_missing_token_is_failed(http) -> None:  # type: ignore[no-untyped-def]
    reporter = _reporter("http://127.0.0.1:9", http, Clock(), timeout_s=2)
    assert await reporter.report(1) == "failed"

    def no_token() -> str:
        raise FileNotFoundError("/var/run/secrets/kubernetes.io/serviceaccount/token")

    reporter = DeletionCostReporter(POD, "http://127.0.0.1:9", http, no_token, clock=Clock())
    assert await reporter.report(1) == "failed"


def test_the_value_is_the_sessions_a_deletion_would_lose() -> None:
    assert deletion_cost(0) == 0 and deletion_cost(5) == 5 and deletion_cost(2**40) == 2**31 - 1
    with pytest.raises(ValueError, match="live_sessions must be >= 0"):
        deletion_cost(-1)
    status = SimpleNamespace(loaded=True, slots=5, free_slots=2, waiting=1)
    assert sessions_on(status) == 4  # 3 slots in use (live or held for a resume) + 1 waiting caller
    assert sessions_on(SimpleNamespace(loaded=False, slots=5, free_slots=0, waiting=0)) == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="threshold >= 1"):
        DeletionCostReporter(POD, "http://x", None, lambda: "", threshold=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_api_url({})
    assert in_cluster_api_url({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}) == (
        "https://10.0.0.1:443"
    )
    assert in_cluster_api_url({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}) == (
        "https://[fd00::1]:443"
    )
    with pytest.raises(ValueError, match="DUPLEX_POD_NAME and DUPLEX_POD_NAMESPACE"):
        RuntimeConfig(pod_deletion_cost=True, pod_name="p")


async def test_off_by_default_starts_nothing() -> None:
    config = RuntimeConfig()
    assert config.pod_deletion_cost is False
    assert start_deletion_cost(config, RuntimeMetrics(), lambda: 0, {}) is None


async def test_on_outside_a_pod_it_logs_counts_and_serves_anyway(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    config = RuntimeConfig(
        pod_deletion_cost=True,
        pod_name=POD.name,
        pod_namespace=POD.namespace,
        pod_credentials_dir=str(tmp_path),
    )
    metrics = RuntimeMetrics()
    assert start_deletion_cost(config, metrics, lambda: 0, {}) is None  # no KUBERNETES_SERVICE_HOST
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert start_deletion_cost(config, metrics, lambda: 0, env) is None  # no ca.crt in the folder
    assert metrics.deletion_cost_writes.labels(outcome="failed")._value.get() == 2
    assert "KUBERNETES_SERVICE_HOST" in caplog.text and "pod-deletion-cost off" in caplog.text


async def test_on_it_reports_the_live_sessions_and_counts_outcomes(api, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``start_deletion_cost`` as the engine starts it, pointed at the fake API server over plain HTTP
    (the in-cluster client's TLS context is replaced: the fake has no certificate)."""
    fake, url = api
    import runtime.fleet.deletion_cost as module

    token = tmp_path / "token"
    token.write_text("projected-token\n")

    def reporter(pod, environ, *, min_interval_s, on_outcome, ca_file, token_file):  # type: ignore[no-untyped-def]
        session = aiohttp.ClientSession()
        made = DeletionCostReporter(
            pod, url, session, module.file_token(token), min_interval_s=min_interval_s, on_outcome=on_outcome
        )
        return made, session

    monkeypatch.setattr(module, "in_cluster_reporter", reporter)
    config = RuntimeConfig(pod_deletion_cost=True, pod_name=POD.name, pod_namespace=POD.namespace)
    metrics = RuntimeMetrics()
    task = start_deletion_cost(config, metrics, lambda: 2, {})
    assert task is not None
    for _ in range(200):
        if fake.patches:
            break
        await asyncio.sleep(0.01)
    await task.close()
    assert fake.annotations == {ANNOTATION: "2"}
    assert fake.patches[0][2] == "Bearer projected-token"
    assert metrics.deletion_cost_writes.labels(outcome="written")._value.get() == 1
