"""``SimPods``: P real ``duplex serve --model sim`` processes on loopback, each standing for one runtime pod
of a region (one GPU each), for the fleet models of the tests (``tests/test_fleet_operations.py``).

Each pod is a single-process node (``--workers 0``, or an engine and ``workers`` front ends) with
``slots`` slots, this checkout first on the path (``PYTHONPATH``), no access control, the sim model's 5 ms
step; ``DUPLEX_POD_NAME`` and ``DUPLEX_POD_NAMESPACE`` set as the downward API sets them.
``SimPod.terminate`` is what the runtime's preStop hook does (SIGTERM: the runtime drains);
``SimPod.sessions`` reads the sessions the pod reports (``duplex_active_sessions`` on ``/metrics``), which
is what it writes as its ``controller.kubernetes.io/pod-deletion-cost`` (``runtime.fleet.deletion_cost``).

pytest puts ``tests/`` on ``sys.path``::

    from sim_pods import SimPods
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import aiohttp

from runtime.tools.local_redis import free_loopback_port

__all__ = ["NAMESPACE", "START_TIMEOUT_S", "SimPod", "SimPods"]

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "duplex"
"""The pods' namespace (``DUPLEX_POD_NAMESPACE``)."""
START_TIMEOUT_S = 180.0
"""How long a pod may take to turn ready (s): an interpreter importing torch on a busy 2-core machine."""
_ACTIVE = re.compile(r"^duplex_active_sessions(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def start_serve(port: int, env: dict[str, str], log: Path, *, workers: int = 0) -> subprocess.Popen[bytes]:
    """``duplex serve`` on loopback ``port`` as its own process group (killed whole), with ``env`` (the
    whole environment) and ``--workers workers``, its output into ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runtime.tools.cli",
                "serve",
                "--port",
                str(port),
                "--workers",
                str(workers),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


class SimPod:
    """One ``duplex serve`` process: ``name`` (``pod-<n>``, in creation order), ``port``, ``created`` (its
    creation index: the ReplicaSet controller deletes newer pods first among equals)."""

    def __init__(
        self, name: str, created: int, port: int, process: subprocess.Popen[bytes], log: Path
    ) -> None:
        self.name, self.created, self.port, self.process, self.log = name, created, port, process, log
        self.terminating = False
        self.started = False
        """Answered ``/readyz`` 200 once (an endpoint of the Service from then on)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def chat_url(self) -> str:
        """The WebSocket URL of a PCM call on this pod."""
        return f"ws://127.0.0.1:{self.port}/api/chat?format=pcm"

    async def sessions(self, http: aiohttp.ClientSession) -> int:
        """The sessions the pod reports holding a slot (``duplex_active_sessions``).

        Raises:
            AssertionError: the metric is missing.
        """
        async with http.get(f"{self.url}/metrics") as response:
            text = await response.text()
        match = _ACTIVE.search(text)
        assert match is not None, f"{self.name}: no duplex_active_sessions in /metrics"
        return int(float(match.group(1)))

    async def ready(self, http: aiohttp.ClientSession) -> bool:
        """``/readyz`` answers 200."""
        try:
            async with http.get(f"{self.url}/readyz") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    def terminate(self) -> None:
        """SIGTERM, as the preStop hook sends it: the runtime refuses new sessions and drains."""
        self.terminating = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)

    async def wait_exit(self, timeout_s: float) -> int:
        """The exit status once the process is gone (the GPU is free)."""
        return await asyncio.to_thread(self.process.wait, timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


class SimPods:
    """An async context manager holding the pods it started (``pods``); every one is killed on exit.

    Args:
        folder: where the pods' logs go.
        slots: slots per pod (``DUPLEX_MAX_SESSIONS``).
        drain_grace_s: ``DUPLEX_DRAIN_GRACE_S``: how long a terminated pod's sessions may go on (the pod's
            grace, the longest call on GKE).
        workers: ``--workers``: 0, the model in the serving process; N, an engine process and N front-end
            workers (the GKE pods run 3).
        env: more ``DUPLEX_*`` settings.
    """

    def __init__(
        self, folder: Path, *, slots: int, drain_grace_s: float, workers: int = 0, **env: str
    ) -> None:
        self.folder, self.slots, self.workers = folder, slots, workers
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "DUPLEX_MODEL": "sim",
            "DUPLEX_SIM_STEP_MS": "5",
            "DUPLEX_AUTH_MODE": "off",
            "DUPLEX_MAX_SESSIONS": str(slots),
            "DUPLEX_DRAIN_GRACE_S": str(drain_grace_s),
            **env,
        }
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.pods: list[SimPod] = []
        self._created = itertools.count()
        self.http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SimPods:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for pod in self.pods:
            pod.kill()
        if self.http is not None:
            await self.http.close()

    def serving(self) -> list[SimPod]:
        """Pods started and not terminating (the Service's ready endpoints), oldest first."""
        return [p for p in self.pods if p.started and not p.terminating and p.process.poll() is None]

    async def start(self, count: int = 1) -> list[SimPod]:
        """Start ``count`` pods at once and wait until each answers ``/readyz`` 200.

        Raises:
            AssertionError: a pod exited or was not ready within ``START_TIMEOUT_S`` (its log attached).
        """
        started = []
        for _ in range(count):
            index = next(self._created)
            port = free_loopback_port()
            log = self.folder / f"pod-{index}.log"
            name = f"pod-{index}"
            # The downward API's fields (metadata.name, metadata.namespace).
            env = {**self.env, "DUPLEX_POD_NAME": name, "DUPLEX_POD_NAMESPACE": NAMESPACE}
            process = start_serve(port, env, log, workers=self.workers)
            pod = SimPod(name, index, port, process, log)
            self.pods.append(pod)
            started.append(pod)
        assert self.http is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        for pod in started:
            while not await pod.ready(self.http):
                tail = pod.log.read_text(errors="replace")[-2000:]
                assert pod.process.poll() is None, f"{pod.name} exited: {tail}"
                assert time.monotonic() < deadline, f"{pod.name} not ready: {tail}"
                await asyncio.sleep(0.2)
            pod.started = True
        return started
