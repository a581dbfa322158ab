"""Bring a node up on this machine as real processes: redis-server, redis_exporter, node-exporter, coturn
(the TURN relay for WebRTC media), the runtime (``duplex serve``), Alertmanager, Prometheus and nginx, all
on loopback, from the ``local`` profile's bundle.

``LocalNode`` renders the bundle into a node directory, writes fresh secrets and a self-signed certificate,
starts each process in its own process group with its log in ``logs/<name>.log``, waits until each one
answers its readiness probe, and stops them all (reverse order, SIGTERM then SIGKILL) on ``stop()``.
A process that exits early is reported with its exit code and the tail of its log rather than waited on.
Free ports, this host's addresses and the relay's STUN probe: ``infra.node.local.network`` (re-exported).

Node directory::

    nginx/ redis/ prometheus/ grafana/    the rendered bundle (infra.node.bundle.render)
    alertmanager/                         Alertmanager's configuration (infra.node.monitoring.alertmanager),
    data/ web/                            the browser client nginx serves at / (infra.node.bundle.webclient)
    secrets/                              0700: Redis password, runtime env, token signing keys,
                                          coturn's turnserver.conf (infra.node.bundle.services)
    tls/node.crt, tls/node.key            self-signed certificate (infra.node.bundle.tls)
    logs/                                 one log per process, nginx's access and error logs
    run/                                  nginx's pid and temp files
    redis/data/, prometheus/data/         data
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infra.node.bundle import redis_acl
from infra.node.bundle.carriers import carrier_settings
from infra.node.bundle.coturn import coturn_args
from infra.node.bundle.nginx import NGINX_CONF
from infra.node.bundle.redis_conf import REDIS_CONF
from infra.node.bundle.render import render_bundle, write_bundle, write_secrets
from infra.node.bundle.services import (
    SECRET_FILES,
    NodeSecrets,
    endpoint,
    runtime_settings,
    token_audience,
)
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.livekit_row import VOICES_DIR, write_livekit_voice
from infra.node.local.network import (
    free_port_profile,
    host_ipv4_addresses,
    port_in_use,
    stun_binding_ok,
    udp_ports_free,
)
from infra.node.local.prometheus_api import PrometheusQueryError, prometheus_query
from infra.node.monitoring.alertmanager import ALERTMANAGER_CONFIG, alertmanager_args
from infra.node.monitoring.prometheus import prometheus_args, prometheus_config
from infra.node.profile.profiles import NodeProfile, get_profile
from infra.node.profile.relay import relay_port_range
from runtime.frontend.gate.tokens import mint_token

__all__ = [
    "REQUIRED_BINARIES",
    "LocalNode",
    "MissingBinaryError",
    "NodeStartError",
    "free_port_profile",
    "host_ipv4_addresses",
    "missing_binaries",
    "stun_binding_ok",
    "nginx_global_directives",
]

log = logging.getLogger(__name__)

REQUIRED_BINARIES: dict[str, str] = {
    "nginx": "nginx-light",
    "redis-server": "redis-server",
    "prometheus": "prometheus",
    "prometheus-node-exporter": "prometheus-node-exporter",
    "prometheus-redis-exporter": "prometheus-redis-exporter",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "turnserver": "coturn",
}
"""Executable -> the Debian/Ubuntu package that provides it."""


class MissingBinaryError(RuntimeError):
    """A system binary the local node needs is not installed; the message names the package."""


class NodeStartError(RuntimeError):
    """A process of the node could not start or did not become ready; the message says which and why."""


def missing_binaries() -> dict[str, str]:
    """``{binary: package}`` for each required binary that is not on PATH (empty when all are there)."""
    return {binary: package for binary, package in REQUIRED_BINARIES.items() if shutil.which(binary) is None}


def nginx_global_directives(node_dir: Path) -> str:
    """nginx's ``-g`` directives for a node run from ``node_dir``: in the foreground and, when started as
    root, with workers running as the node directory's owner (nginx's default worker user, ``nobody``,
    cannot read the browser client's files under a 0700 directory such as a temporary one). Without root,
    workers run as the invoking user and no ``user`` directive is given."""
    directives = "daemon off;"
    if os.geteuid() == 0:
        owner = Path(node_dir).stat()
        user, group = pwd.getpwuid(owner.st_uid).pw_name, grp.getgrgid(owner.st_gid).gr_name
        directives += f" user {user} {group};"
    return directives


@dataclass
class ManagedProcess:
    """One process of the node: its command, how to probe it, and its handle once started."""

    name: str
    argv: list[str]
    probe: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    stop_timeout_s: float = 10.0
    popen: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def start(self, cwd: Path, log_dir: Path) -> None:
        self.log_path = log_dir / f"{self.name}.log"
        with open(self.log_path, "ab") as log_file:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=cwd,
                env={**os.environ, **self.env},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: Ctrl-C in the terminal reaches only us
            )

    @property
    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return None if self.popen is None else self.popen.poll()

    def log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``stop_timeout_s``; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: SIGKILL", self.name, self.stop_timeout_s)
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode


def _http_ok(url: str, *, context: ssl.SSLContext | None = None, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:  # noqa: S310
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LocalNode:
    """The node of ``profile`` (a ``processes`` profile, e.g. ``local``) running in ``node_dir``.

    Use as a context manager, or call ``start()`` and ``stop()``. ``start`` raises
    ``MissingBinaryError`` (names the Debian package to install) or ``NodeStartError`` (a port in use, a
    process that exited or never became ready: the message has its log tail); it stops whatever it had
    started before raising.
    """

    def __init__(
        self,
        node_dir: Path,
        profile: NodeProfile | None = None,
        *,
        node_secrets: NodeSecrets | None = None,
        runtime_args: list[str] | None = None,
    ) -> None:
        self.profile = profile or get_profile("local")
        if self.profile.deployment != "processes":
            raise ValueError(
                f"profile {self.profile.name!r} has deployment {self.profile.deployment!r}; a local node "
                "needs deployment 'processes' (use the 'local' profile)"
            )
        relay = self.profile.relay
        if relay.enabled and not relay.peer_networks:
            # The relay reaches the runtime's ICE host candidates: this host's own addresses.
            peers = relay.model_copy(update={"peer_networks": host_ipv4_addresses()})
            self.profile = self.profile.model_copy(update={"relay": peers})
        self.node_dir = node_dir.resolve()
        self.secrets = node_secrets or NodeSecrets.generate()
        self.runtime_args = runtime_args or []
        self.processes: list[ManagedProcess] = []
        self.certificate_path = self.node_dir / self.profile.tls.certificate_path

    # -- addresses -------------------------------------------------------------------------------------
    @property
    def https_url(self) -> str:
        """``https://localhost:<https port>`` (the certificate is for ``localhost`` and 127.0.0.1)."""
        return f"https://{self.profile.domain}:{self.profile.ports.https}"

    @property
    def wss_url(self) -> str:
        """``wss://localhost:<https port>``: the base URL clients stream to (through nginx)."""
        return f"wss://{self.profile.domain}:{self.profile.ports.https}"

    @property
    def prometheus_url(self) -> str:
        return f"http://{endpoint(self.profile, 'prometheus')}"

    @property
    def alertmanager_url(self) -> str:
        """The node's Alertmanager (private side): its UI and API v2 (``/api/v2/alerts``)."""
        return f"http://{endpoint(self.profile, 'alertmanager')}"

    @property
    def runtime_url(self) -> str:
        """The runtime itself, behind nginx (private side)."""
        return f"http://{endpoint(self.profile, 'runtime')}"

    def ssl_context(self) -> ssl.SSLContext:
        """An SSL context that trusts this node's self-signed certificate."""
        return ssl.create_default_context(cafile=str(self.certificate_path))

    def mint_token(
        self, *, ttl_s: float = 300.0, personas: tuple[str, ...] = ("*",), max_session_s: float | None = None
    ) -> str:
        """A fresh session token for this node (its first signing key, its audience): what the
        application backend of a real node does once per conversation. Single-use."""
        key = self.secrets.signing_keys()[0]
        return mint_token(
            key,
            ttl_s=ttl_s,
            personas=personas,
            max_session_s=max_session_s,
            audience=token_audience(self.profile),
        )

    # -- lifecycle -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Render the bundle, write secrets and the certificate, create the runtime directories."""
        missing = missing_binaries()
        if missing:
            packages = " ".join(sorted(set(missing.values())))
            raise MissingBinaryError(
                f"missing {', '.join(sorted(missing))}: install with `apt-get install {packages}`"
            )
        p = self.profile
        busy = [
            f"{name} {port}"
            for name, port in p.ports.model_dump().items()
            if name not in ("grafana", "dcgm_exporter") and port_in_use(p.public_address, port)
        ]
        if p.relay.enabled:
            low, high = relay_port_range(p.relay, p.sessions)
            if not udp_ports_free(p.relay.port, 1):
                busy.append(f"relay.port {p.relay.port}/udp")
            if not udp_ports_free(low, high - low + 1):
                busy.append(f"relay range {low}-{high}/udp")
            if port_in_use(p.public_address, p.relay.tls_port):
                busy.append(f"relay.tls_port {p.relay.tls_port}")
        if busy:
            raise NodeStartError(
                f"ports in use on this machine: {', '.join(busy)}; stop what holds them, or pass --free-ports"
            )
        for sub in (
            "logs",
            "run",
            "redis/data",
            "prometheus/data",
            "alertmanager/data",
            "tls",
            "acme/webroot",
        ):
            (self.node_dir / sub).mkdir(parents=True, exist_ok=True)
        write_bundle(render_bundle(p), self.node_dir)
        write_secrets(p, self.secrets, self.node_dir)
        write_self_signed_certificate(
            self.certificate_path,
            self.node_dir / p.tls.private_key_path,
            domain=p.domain,
            ip_addresses=(p.public_address,),
        )
        write_livekit_voice(self.node_dir / VOICES_DIR)  # the voice LiveKit's plugin asks for

    def _build_processes(self) -> list[ManagedProcess]:
        p = self.profile
        tls = self.ssl_context()
        admin_password = self.secrets.redis_password
        redis_endpoint = endpoint(p, "redis")
        redis_host, redis_port = redis_endpoint.rsplit(":", 1)
        redis_url = redis_acl.redis_url(admin_password, "runtime", redis_host, redis_port)

        def redis_ready() -> bool:
            import redis

            try:
                return bool(redis.Redis.from_url(redis_url, socket_timeout=1).ping())
            except redis.RedisError:
                return False

        runtime_secrets = carrier_settings(p, self.secrets.carrier_secrets)  # as secrets/runtime.env has them
        processes = [ManagedProcess("redis", ["redis-server", REDIS_CONF], redis_ready)]
        if p.relay.enabled:
            runtime_secrets["DUPLEX_TURN_SECRET"] = self.secrets.turn_secret or ""
            processes.append(
                ManagedProcess(
                    "coturn",
                    ["turnserver", *coturn_args(SECRET_FILES["turnserver_conf"], "run/turnserver.pid")],
                    lambda: stun_binding_ok(p.public_address, p.relay.port),
                )
            )
        return processes + [
            ManagedProcess(
                "redis-exporter",
                [
                    "prometheus-redis-exporter",
                    f"--redis.addr=redis://{redis_endpoint}",
                    f"--web.listen-address={endpoint(p, 'redis-exporter')}",
                ],
                lambda: _http_ok(f"http://{endpoint(p, 'redis-exporter')}/metrics"),
                env={
                    "REDIS_USER": "exporter",
                    "REDIS_PASSWORD": redis_acl.role_password(admin_password, "exporter"),
                },
            ),
            ManagedProcess(
                "node-exporter",
                ["prometheus-node-exporter", f"--web.listen-address={endpoint(p, 'node-exporter')}"],
                lambda: _http_ok(f"http://{endpoint(p, 'node-exporter')}/metrics"),
            ),
            ManagedProcess(
                "runtime",
                [sys.executable, "-m", "runtime.tools.cli", "serve", *self.runtime_args],
                lambda: _http_ok(f"{self.runtime_url}/readyz"),
                env={
                    **runtime_settings(p),
                    "DUPLEX_REDIS_URL": redis_url,
                    "DUPLEX_VOICES_DIR": str(self.node_dir / VOICES_DIR),
                    **runtime_secrets,
                },
                stop_timeout_s=p.limits.drain_grace_s + 10.0,
            ),
            ManagedProcess(
                "alertmanager",
                [
                    "prometheus-alertmanager",
                    *alertmanager_args(ALERTMANAGER_CONFIG, "alertmanager/data", endpoint(p, "alertmanager")),
                ],
                lambda: _http_ok(f"{self.alertmanager_url}/-/ready"),
            ),
            ManagedProcess(
                "prometheus",
                [
                    "prometheus",
                    *prometheus_args(
                        p, "prometheus/prometheus.yml", "prometheus/data", endpoint(p, "prometheus")
                    ),
                ],
                self._prometheus_scraped_every_target,
            ),
            ManagedProcess(
                "nginx",
                [
                    "nginx",
                    "-p",
                    f"{self.node_dir}/",
                    "-c",
                    NGINX_CONF,
                    "-e",
                    "logs/error.log",
                    "-g",
                    nginx_global_directives(self.node_dir),
                ],
                lambda: _http_ok(f"{self.https_url}/readyz", context=tls),
            ),
        ]

    def _prometheus_scraped_every_target(self) -> bool:
        """Prometheus is ready and its last scrape of every target of the node succeeded (so that a run
        that starts now is seen from its beginning)."""
        if not _http_ok(f"{self.prometheus_url}/-/ready"):
            return False
        jobs = len(prometheus_config(self.profile)["scrape_configs"])  # one target per job
        try:
            targets_up = prometheus_query(self.prometheus_url, "count(up == 1)", timeout_s=1.0)
        except PrometheusQueryError:
            return False
        return targets_up is not None and targets_up >= jobs

    def start(self, *, timeout_s: float = 120.0, progress: Callable[[str], None] | None = None) -> None:
        """Prepare the node directory, then start every process in order and wait for each probe.

        Raises:
            MissingBinaryError, NodeStartError: see the class docstring.
        """
        say = progress or (lambda message: log.info("%s", message))
        self.prepare()
        deadline = time.monotonic() + timeout_s
        try:
            for process in self._build_processes():
                say(f"starting {process.name}")
                process.start(self.node_dir, self.node_dir / "logs")
                self.processes.append(process)
                while not process.probe():
                    if process.exit_code is not None:
                        raise NodeStartError(
                            f"{process.name} exited with code {process.exit_code} while starting; "
                            f"its log ({process.log_path}):\n{process.log_tail()}"
                        )
                    if time.monotonic() > deadline:
                        raise NodeStartError(
                            f"{process.name} not ready after {timeout_s:.0f} s; "
                            f"its log ({process.log_path}):\n{process.log_tail()}"
                        )
                    time.sleep(0.2)
                say(f"{process.name} ready")
        except BaseException:
            self.stop()
            raise

    def dead_processes(self) -> dict[str, int]:
        """``{name: exit code}`` of the node's processes that have exited (empty while all run)."""
        return {p.name: code for p in self.processes if (code := p.exit_code) is not None}

    def process(self, name: str) -> ManagedProcess:
        """The managed process called ``name``. Raises KeyError (listing the names) if there is none."""
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r}; running: {', '.join(p.name for p in self.processes)}")

    def stop(self) -> dict[str, int | None]:
        """Stop every process, last started first; returns ``{name: exit code}``. Idempotent."""
        codes = {}
        for process in reversed(self.processes):
            codes[process.name] = process.stop()
        self.processes = []
        return codes

    def __enter__(self) -> LocalNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
