"""The pod's ``controller.kubernetes.io/pod-deletion-cost``, kept at its live sessions, so that a scale-in
removes the idlest runtime pod (issue 33, "Calls survive deploys and scale-in").

When the HorizontalPodAutoscaler lowers the Deployment's replicas, the ReplicaSet controller picks which
pods to delete: unscheduled before scheduled, pending before running, not ready before ready, then the
lower ``controller.kubernetes.io/pod-deletion-cost`` first (an int32, default 0), then the newer pod
(kubernetes.io/docs/reference/labels-annotations-taints/#pod-deletion-cost; KEP-2255 "ReplicaSet Pod
Deletion Cost", beta and on by default since 1.22, GA in 1.24; the order is ``ActivePodsWithRanks`` in
kubernetes/pkg/controller/controller_utils.go). Without it the controller removes the newest pod whatever
its calls; the deleted pod drains (its preStop hook), so its calls would go on, but holding a GPU for up
to the grace period while an idle pod was there to go.

Who writes it: the runtime itself (:class:`DeletionCostReporter`), with a merge-patch of its own pod's
annotation through the API server, ``PATCH /api/v1/namespaces/<ns>/pods/<name>`` with
``application/merge-patch+json``, authenticated by a projected service-account token (RBAC: ``patch`` on
``pods`` of its namespace only: ``infra.k8s.disruption``). The value is the sessions holding a slot
(WebSocket, WebRTC and those held paused for a resume). Kubernetes asks users not to update the annotation
often (each write is an API call and a pod update event), so a write happens only when the count moved by
``threshold`` or more since the last written value, or crossed zero (an idle pod must read 0 at once),
and at most once every ``min_interval_s``. A refusal (403), an error or a timeout is logged and counted
(``duplex_deletion_cost_writes_total{outcome}``) and retried at the next interval: it never touches a call.

Gated by ``DUPLEX_POD_DELETION_COST`` (off by default: a single node has no API server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from runtime.metrics import RuntimeMetrics

__all__ = [
    "ANNOTATION",
    "OUTCOMES",
    "SERVICE_ACCOUNT_TOKEN",
    "DeletionCostReporter",
    "DeletionCostTask",
    "PodRef",
    "deletion_cost",
    "file_token",
    "in_cluster_api_url",
    "in_cluster_reporter",
    "sessions_on",
    "start_deletion_cost",
]

log = logging.getLogger("duplex.deletion_cost")

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
"""The annotation the ReplicaSet controller reads (kubernetes.io/docs/reference/labels-annotations-taints)."""

INT32_MAX = 2**31 - 1
"""The annotation's value is an int32 (KEP-2255): [-2147483648, 2147483647]."""

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where the kubelet mounts a pod's projected service-account volume (``token``, ``ca.crt``, ``namespace``)
unless ``automountServiceAccountToken`` is false; the runtime pod keeps it (its ServiceAccount is the
``patch`` Role's subject: ``infra.k8s.disruption``)."""
SERVICE_ACCOUNT_TOKEN = f"{SERVICE_ACCOUNT_DIR}/token"
"""The bound, audience-scoped token the kubelet rotates before it expires (about an hour)."""
SERVICE_ACCOUNT_CA = f"{SERVICE_ACCOUNT_DIR}/ca.crt"
"""The cluster's CA, which signs the API server's certificate."""

OUTCOMES = ("written", "refused", "failed")
"""``outcome`` label values: the API server took it (2xx), refused it (4xx: RBAC, a missing pod), or the
write failed (5xx, a timeout, no connection, no token)."""


@dataclass(frozen=True)
class PodRef:
    """The pod this process runs in (the downward API: ``metadata.namespace``, ``metadata.name``)."""

    namespace: str
    name: str

    def path(self) -> str:
        """``/api/v1/namespaces/<namespace>/pods/<name>``."""
        return f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"


def deletion_cost(live_sessions: int) -> int:
    """The annotation's value for ``live_sessions`` (sessions holding a slot, >= 0): the count itself,
    capped at int32. A pod with fewer calls costs less to delete: the ReplicaSet controller removes it first.

    Raises:
        ValueError: a negative count.
    """
    if live_sessions < 0:
        raise ValueError(f"live_sessions must be >= 0, got {live_sessions}")
    return min(live_sessions, INT32_MAX)


def sessions_on(status: Any) -> int:
    """The sessions a pod would lose if deleted now, from its slot backend's status
    (``runtime.engine.api.BackendStatus``: ``slots``, ``free_slots``, ``waiting``): the slots in use (live
    WebSocket and WebRTC sessions, and sessions held paused for a resume) + the callers in its waiting room.
    0 before the slots are open (``loaded`` False)."""
    if not getattr(status, "loaded", True):
        return 0
    return max(0, int(status.slots) - int(status.free_slots)) + max(0, int(status.waiting))


def in_cluster_api_url(environ: dict[str, str]) -> str:
    """The API server's URL inside a pod, from the kubelet's ``KUBERNETES_SERVICE_HOST`` and
    ``KUBERNETES_SERVICE_PORT`` (set in every pod, ``enableServiceLinks`` or not).

    Raises:
        ValueError: either variable missing (not in a Kubernetes pod).
    """
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ValueError(
            "DUPLEX_POD_DELETION_COST needs KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT (set by the "
            "kubelet in a pod); outside Kubernetes leave it off"
        )
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class DeletionCostReporter:
    """Keeps the pod's deletion-cost annotation at its live sessions (see the module docstring).

    Args:
        pod: the pod to annotate.
        api_url: the API server (``in_cluster_api_url``), e.g. ``https://10.0.0.1:443``.
        http: the client session to send with (injected: its TLS context trusts the cluster's CA).
        token: returns the bearer token; read at every write (the kubelet rotates a projected token file).
        clock: monotonic seconds (injected in tests).
        min_interval_s: the least time between two writes (s); also the retry delay after a failure.
        threshold: the least change of the session count that is written (a crossing of zero always is).
        timeout_s: one write's limit (s).
        on_outcome: called with one of ``OUTCOMES`` after each write (the metric).

    Raises:
        ValueError: ``min_interval_s`` < 0, ``threshold`` < 1 or ``timeout_s`` <= 0.
    """

    def __init__(
        self,
        pod: PodRef,
        api_url: str,
        http: aiohttp.ClientSession,
        token: Callable[[], str],
        *,
        clock: Callable[[], float] = time.monotonic,
        min_interval_s: float = 10.0,
        threshold: int = 1,
        timeout_s: float = 5.0,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        if min_interval_s < 0 or threshold < 1 or timeout_s <= 0:
            raise ValueError(
                f"min_interval_s must be >= 0 s, threshold >= 1, timeout_s > 0 s; got {min_interval_s}, "
                f"{threshold}, {timeout_s}"
            )
        self.pod, self.api_url, self.http, self.token = pod, api_url.rstrip("/"), http, token
        self.clock, self.min_interval_s, self.threshold = clock, min_interval_s, threshold
        self.timeout_s, self.on_outcome = timeout_s, on_outcome
        self.written: int | None = None
        """The value the API server last accepted (None: none yet)."""
        self._last_attempt: float | None = None

    def due(self, live_sessions: int) -> bool:
        """Whether ``live_sessions`` should be written now: it differs from the written value by at least
        ``threshold`` (or crosses zero, or nothing was written yet), and ``min_interval_s`` passed since the
        last attempt."""
        cost = deletion_cost(live_sessions)
        if self.written is None:
            changed = True
        else:
            crossed_zero = (cost == 0) != (self.written == 0)
            changed = crossed_zero or abs(cost - self.written) >= self.threshold
        if not changed:
            return False
        return self._last_attempt is None or self.clock() - self._last_attempt >= self.min_interval_s

    async def report(self, live_sessions: int) -> str | None:
        """Write ``live_sessions`` when :meth:`due`; returns the outcome (one of ``OUTCOMES``) or None when
        nothing was sent. Never raises for the API server's answer or a network failure."""
        if not self.due(live_sessions):
            return None
        cost = deletion_cost(live_sessions)
        self._last_attempt = self.clock()
        outcome = await self._patch(cost)
        if outcome == "written":
            self.written = cost
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome

    async def _patch(self, cost: int) -> str:
        body = json.dumps({"metadata": {"annotations": {ANNOTATION: str(cost)}}})
        url = f"{self.api_url}{self.pod.path()}"
        try:
            headers = {
                "Authorization": f"Bearer {self.token()}",
                "Content-Type": "application/merge-patch+json",
                "Accept": "application/json",
            }
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self.http.patch(url, data=body, headers=headers, timeout=timeout) as response:
                if 200 <= response.status < 300:
                    return "written"
                detail = (await response.text())[:200]
                outcome = "refused" if 400 <= response.status < 500 else "failed"
                log.warning(
                    "pod-deletion-cost %d of %s/%s: the API server answered %d (%s); calls are unaffected",
                    cost,
                    self.pod.namespace,
                    self.pod.name,
                    response.status,
                    detail,
                )
                return outcome
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning(
                "pod-deletion-cost %d of %s/%s: %s: %s; calls are unaffected, retried in %.0f s",
                cost,
                self.pod.namespace,
                self.pod.name,
                type(exc).__name__,
                exc,
                self.min_interval_s,
            )
            return "failed"

    async def run(self, live_sessions: Callable[[], int], period_s: float = 1.0) -> None:
        """Check ``live_sessions()`` every ``period_s`` s and :meth:`report` it, until cancelled."""
        while True:
            try:
                await self.report(live_sessions())
            except ValueError:
                log.exception("pod-deletion-cost: bad session count")
            await asyncio.sleep(period_s)


def file_token(path: str | Path = SERVICE_ACCOUNT_TOKEN) -> Callable[[], str]:
    """A token source reading ``path`` at each call (the kubelet rewrites a projected token before it
    expires). Raises ``OSError`` at the write when the file is missing: counted as ``failed``."""

    def read() -> str:
        return Path(path).read_text(encoding="utf-8").strip()

    return read


def in_cluster_reporter(
    pod: PodRef,
    environ: dict[str, str],
    *,
    min_interval_s: float,
    on_outcome: Callable[[str], None] | None = None,
    ca_file: str = SERVICE_ACCOUNT_CA,
    token_file: str = SERVICE_ACCOUNT_TOKEN,
) -> tuple[DeletionCostReporter, aiohttp.ClientSession]:
    """A reporter for the pod this process runs in, with its own client session (TLS verified against
    ``ca_file``); the caller closes the session. Call it inside a running event loop.

    Raises:
        ValueError: not in a Kubernetes pod (``in_cluster_api_url``).
        OSError: ``ca_file`` cannot be read.
    """
    import ssl

    api_url = in_cluster_api_url(environ)
    context = ssl.create_default_context(cafile=ca_file)
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))
    reporter = DeletionCostReporter(
        pod, api_url, http, file_token(token_file), min_interval_s=min_interval_s, on_outcome=on_outcome
    )
    return reporter, http


class DeletionCostTask:
    """The running reporter of :func:`start_deletion_cost`: :meth:`close` cancels it and closes its client."""

    def __init__(
        self, reporter: DeletionCostReporter, http: aiohttp.ClientSession, task: asyncio.Task
    ) -> None:
        self.reporter, self._http, self._task = reporter, http, task

    async def close(self) -> None:
        """Cancel the loop and close the client session. Idempotent."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if not self._http.closed:
            await self._http.close()


def start_deletion_cost(
    config: Any, metrics: RuntimeMetrics, live_sessions: Callable[[], int], environ: dict[str, str]
) -> DeletionCostTask | None:
    """The reporter ``config`` asks for (``pod_deletion_cost``, ``pod_name``, ``pod_namespace``,
    ``pod_credentials_dir``, ``deletion_cost_interval_s`` of ``runtime.config.RuntimeConfig``), started on
    the running loop, reading ``live_sessions()`` (sessions holding a slot) every second; None when off.
    One per pod: the process that owns the slots (the engine, or the single process of ``--workers 0``)
    starts it. On but unable to start (not in a Kubernetes pod, the cluster's CA unreadable): logged,
    counted ``failed``, None: the node serves anyway.
    """
    if not config.pod_deletion_cost:
        return None
    pod = PodRef(namespace=config.pod_namespace, name=config.pod_name)

    def count(outcome: str) -> None:
        metrics.deletion_cost_writes.labels(outcome=outcome).inc()

    folder = Path(config.pod_credentials_dir)
    try:
        reporter, http = in_cluster_reporter(
            pod,
            environ,
            min_interval_s=config.deletion_cost_interval_s,
            on_outcome=count,
            ca_file=str(folder / "ca.crt"),
            token_file=str(folder / "token"),
        )
    except (ValueError, OSError) as exc:  # the node serves anyway: scale-in falls back to Kubernetes' order
        log.error("pod-deletion-cost off: %s", exc)
        count("failed")
        return None
    task = asyncio.create_task(reporter.run(live_sessions), name="pod-deletion-cost")
    log.info("pod-deletion-cost: keeping %s/%s's annotation at its live sessions", pod.namespace, pod.name)
    return DeletionCostTask(reporter, http, task)
