"""One region's TURN gateway (docs/deploying.md, "WebRTC media per stack"): coturn as a Deployment on the
system (CPU) pool, its configuration in a Secret, a PodDisruptionBudget, and a ``LoadBalancer`` Service that
GKE turns into a regional external passthrough Network Load Balancer (UDP; the caller's address kept), since
the global HTTPS load balancer carries no UDP.

Off the GPU pool (issue 33): as a DaemonSet on the GPU pool, every GPU node leaving (scale-down, an upgrade,
a repair, host maintenance: GPU VMs cannot live-migrate) killed every call relayed through it, whichever
runtime pod served the call, with no drain (node drains skip DaemonSet pods). Now coturn runs on the system
pool (``infra.names.SYSTEM_POOL``: CPU VMs live-migrate, the pool neither scales nor upgrades with the GPU
pool, surge upgrades add a node before one goes), ``turn_replicas`` pods spread over the zones, and every
removal drains: a surge upgrade or ``kubectl drain`` evicts through the PodDisruptionBudget (one at a time),
the cluster autoscaler leaves their nodes alone (``safe-to-evict: false``), and the preStop hook
(``turn_drain_command``) puts coturn in drain mode (SIGUSR1: coturn/coturn PR 1529, "Add new Drain
feature", merged June 2024; in the 4.6.3 source the image in ``infra.images`` is built from:
``mainrelay.c`` ``drain_handler``, ``netengine.c`` ``enable_drain_mode``; read, not run here:
existing allocations go on, new ones are refused with 403, coturn exits once its allocation count is
0) and waits for it to exit, up to ``terminationGracePeriodSeconds`` = the longest session +
``TURN_DRAIN_MARGIN_S``. Each coturn holds the relay ports and quota of the whole
region (``max_replicas`` x slots): a zone's coturn may carry every caller of the region.

No ``hostNetwork``: the cluster is VPC-native, so a pod's address is routable in the VPC and serves as the
relayed address (no ``external-ip``), exactly as coturn's container address does in a Compose node; the
pods stay under the namespace's Pod Security ``restricted`` level, which forbids host networking. Peers, two
fences: coturn's own
``allowed-peer-ip`` admits the region's pod range only (``RegionWorkload.turn_peer_ranges``, which GKE's
cluster firewall rule already lets reach the pods; coturn names ranges, not pods), and the NetworkPolicy
``coturn-egress`` lets the coturn pods send to the runtime pods only, over UDP (kube-dns, Prometheus, the
metrics adapter and every other pod of the range refused; enforced by GKE Dataplane V2,
``infra.components.gke_parts.RegionCluster``). A caller whose offer spilled to another region cannot relay
there and falls back to the WebSocket protocol.

TURN over TLS (5349/tcp) when the workload names a ``kubernetes.io/tls`` Secret for ``turn-<region>.<domain>``
(``turn_tls_secret``; the global entry's certificate is Google-managed and never leaves its load balancer):
mounted into the pods, served by coturn, a second ``LoadBalancer`` Service (TCP) on the same reserved
address, and a ``tls-reload`` sidecar that sends coturn SIGUSR2 when the mounted certificate changes (a
renewal: the kubelet updates a Secret volume in place; coturn 4.6 reloads its certificate on SIGUSR2 with
its allocations kept, as on a node: ``infra.node.bundle.compose``). Rendered only when the workload has a TURN
secret.
"""

from __future__ import annotations

from typing import Any

from infra.k8s.base import (
    SECRET_NAME,
    RegionWorkload,
    container_security,
    lift,
    object_meta,
    pod_labels,
    pod_security,
    selector_labels,
)
from infra.names import SYSTEM_POOL
from infra.node.bundle.compose import IMAGES
from infra.node.bundle.coturn import CONTAINER_CONFIG_PATH, coturn_args, render_turnserver_conf
from infra.node.profile.relay import turn_urls

__all__ = [
    "TURN_DRAIN_MARGIN_S",
    "TLS_MOUNT",
    "TLS_RELOAD_INTERVAL_S",
    "TURN_CONFIG_SECRET",
    "TURN_EGRESS_POLICY",
    "TURN_NAME",
    "TURN_SECRET_KEY",
    "TURN_TLS_NAME",
    "tls_reload_script",
    "turn_egress_policy",
    "turn_env",
    "turn_drain_command",
    "turn_grace_s",
    "turn_host",
    "turn_objects",
    "turn_replicas",
]

TURN_NAME = "coturn"
"""The Deployment's, Service's, PodDisruptionBudget's and PodMonitoring's name (and the pods'
``app.kubernetes.io/name``)."""
TURN_DRAIN_MARGIN_S = 60
"""Seconds of the coturn pods' grace beyond the longest session: the preStop hook polls every 5 s and
coturn's last allocations time out within their refresh (as ``infra.k8s.workload.DRAIN_MARGIN_S``)."""
_DRAIN_POLL_S = 5
TURN_CONFIG_SECRET = "coturn-config"
"""The Secret holding ``turnserver.conf`` (it carries the TURN secret)."""
TURN_EGRESS_POLICY = "coturn-egress"
"""The NetworkPolicy that limits the coturn pods' egress to the runtime pods (``turn_egress_policy``)."""
TURN_SECRET_KEY = "turn-secret"
"""The key of the runtime's Secret (``SECRET_NAME``) holding ``DUPLEX_TURN_SECRET``."""
TURN_TLS_NAME = "coturn-tls"
"""The TURN-over-TLS Service's name (a second Service: GKE's mixed-protocol Services need clusters created
at 1.34.1-gke.2190000 or later; two Services sharing one reserved address work on every version)."""
TLS_MOUNT = "/etc/coturn/tls"
"""Where the coturn pods mount the TLS Secret (``tls.crt``, ``tls.key``)."""
TLS_RELOAD_INTERVAL_S = 60
"""How often the ``tls-reload`` sidecar compares the mounted certificate (s). The kubelet itself refreshes
a Secret volume about once a minute (its sync period plus cache TTL), so a renewal reaches coturn within
about two minutes, long before the old certificate expires (cert-manager renews 30 days ahead)."""
_PID_FILE = "/tmp/turnserver.pid"
_COTURN_UID = 65534  # nobody: binds unprivileged ports only


def tls_reload_script(certificate: str, pid_file: str, interval_s: int = TLS_RELOAD_INTERVAL_S) -> str:
    """The ``tls-reload`` sidecar's POSIX sh script: every ``interval_s`` s, when the checksum of
    ``certificate`` changed, send SIGUSR2 to the process in ``pid_file`` (coturn reloads its certificate and
    key; allocations are kept). Needs ``cksum``, ``cat``, ``sleep``: coreutils of the coturn image itself.

    Raises:
        ValueError: ``interval_s`` < 1, or a path with characters the script does not quote.
    """
    if interval_s < 1:
        raise ValueError(f"interval_s must be >= 1 s, got {interval_s}")
    for path in (certificate, pid_file):
        if not path.startswith("/") or not set(path) <= set("abcdefghijklmnopqrstuvwxyz0123456789/._-"):
            raise ValueError(f"{path!r}: an absolute path of lower case letters, digits, '/', '.', '_', '-'")
    return (
        f"last=$(cksum < {certificate})\n"
        f"while sleep {interval_s}; do\n"
        f"  now=$(cksum < {certificate}) || continue\n"
        '  [ "$now" = "$last" ] && continue\n'
        f'  if kill -USR2 "$(cat {pid_file})"; then\n'
        '    last=$now; echo "certificate changed: coturn reloaded"\n'
        "  fi\n"
        "done\n"
    )


def turn_host(workload: RegionWorkload) -> str:
    """The region's TURN name, ``turn-<region>.<domain>``: an A record at the region's TURN Service
    address (the stack prints it)."""
    return f"turn-{workload.region}.{workload.profile.domain}"


def turn_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's TURN environment: ``DUPLEX_TURN_URLS`` naming the region's TURN over UDP
    (and ``turns:`` over TLS with ``turn_tls_secret``), ``DUPLEX_TURN_TTL_S``, ``DUPLEX_TURN_SECRET`` from
    the runtime's Secret, ``DUPLEX_RTC_RELAY_NETS`` (the pod ranges coturn relays from). Empty without a TURN
    secret."""
    if workload.turn_secret is None:
        return []
    relay = workload.profile.relay
    urls = turn_urls(relay, turn_host(workload))
    if workload.turn_tls_secret is None:
        urls = urls[:1]
    # coturn's pods relay from the pod range: a caller's relay candidates there are the region's own relay
    # (runtime/frontend/transports/webrtc/candidates.py drops non-global candidates otherwise).
    relay_nets = [{"name": "DUPLEX_RTC_RELAY_NETS", "value": ",".join(workload.turn_peer_ranges)}]
    return [
        {"name": "DUPLEX_TURN_URLS", "value": ",".join(urls)},
        {"name": "DUPLEX_TURN_TTL_S", "value": str(relay.credential_ttl_s)},
        *(relay_nets if workload.turn_peer_ranges else []),
        {
            "name": "DUPLEX_TURN_SECRET",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": TURN_SECRET_KEY}},
        },
    ]


def turn_egress_policy(workload: RegionWorkload) -> dict[str, Any]:
    """NetworkPolicy ``coturn-egress`` (networking.k8s.io/v1): the coturn pods
    (``selector_labels(TURN_NAME)``) may send to the runtime pods of their namespace (``pod_labels``) over
    UDP, and to nothing else: no other pod, no address outside the cluster (the metadata server
    169.254.169.254 included), no DNS.

    Why each choice:

    - UDP on every port: the relay sends to the runtime's ICE sockets, which aioice binds to ephemeral
      ports (no port range to name; the kernel's ``ip_local_port_range``, 32768-60999 by default). The
      rule names the protocol without a ``port`` (Kubernetes: every port of it) rather than ``port`` 1024 +
      ``endPort`` 65535: a range would add little (it leaves out 1-1023 only), and Cilium, on which
      Dataplane V2 is built, went long without ``endPort`` (cilium/cilium#28704: such a policy put its
      pods in default deny), which would cut the relay off altogether.
    - No DNS: the rendered ``turnserver.conf`` names no host (peers are addresses, coturn reads no
      database or Redis), so coturn resolves nothing.
    - Egress only (``policyTypes: [Egress]``): callers reach coturn through the load balancer and GMP
      scrapes its exporter; replies to those flows are allowed by connection tracking whatever the egress
      rules say.

    The first fence stays coturn's ``allowed-peer-ip`` (the pod ranges, ``turn_peer_ranges``): this
    policy is the second, per pod, and holds only where the cluster enforces NetworkPolicy (GKE Dataplane
    V2, ``infra.components.gke_parts.DATAPATH_PROVIDER``); elsewhere the API server keeps it and nothing
    applies it.
    """
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(workload, TURN_EGRESS_POLICY, "turn", app=TURN_NAME),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(TURN_NAME)},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [{"podSelector": {"matchLabels": pod_labels(workload)}}],
                    "ports": [{"protocol": "UDP"}],
                }
            ],
        },
    }


def turn_replicas(workload: RegionWorkload) -> int:
    """coturn pods of a region: one per zone of the GPU pool, at least 2 (one drains while another relays).
    Each carries the whole region's relay ports and quota (see the module docstring)."""
    return max(2, len(workload.zones))


def turn_grace_s(workload: RegionWorkload) -> int:
    """The coturn pods' ``terminationGracePeriodSeconds`` (s): the longest session
    (``profile.limits.max_session_s``) + ``TURN_DRAIN_MARGIN_S``: a relayed call started just before the
    drain runs to its end."""
    return workload.profile.limits.max_session_s + TURN_DRAIN_MARGIN_S


def turn_drain_command(pid_file: str, poll_s: int = _DRAIN_POLL_S) -> list[str]:
    """The coturn container's preStop hook: SIGUSR1 to the process in ``pid_file`` (coturn's drain mode: new
    allocations refused with 403, running ones go on; coturn exits once none is left), then wait, polling
    every ``poll_s`` s, until that process is gone. The kubelet's SIGTERM comes after the hook, or at the
    grace period's end. Needs ``cat``, ``kill``, ``sleep`` of the coturn image.

    Raises:
        ValueError: ``poll_s`` < 1, or a path with characters the script does not quote.
    """
    if poll_s < 1:
        raise ValueError(f"poll_s must be >= 1 s, got {poll_s}")
    if not pid_file.startswith("/") or not set(pid_file) <= set("abcdefghijklmnopqrstuvwxyz0123456789/._-"):
        raise ValueError(f"{pid_file!r}: an absolute path of lower case letters, digits, '/', '.', '_', '-'")
    script = (
        f'pid=$(cat {pid_file}) || exit 0; kill -USR1 "$pid" || exit 0; '
        f'echo "coturn draining: new allocations refused, waiting for the running ones"; '
        f'while kill -0 "$pid" 2>/dev/null; do sleep {poll_s}; done'
    )
    return ["/bin/sh", "-c", script]


def _conf(workload: RegionWorkload, secret: str, previous: str | None = None) -> str:
    # One coturn may relay every session of the region (a zone's coturn drains, the NLB hashes callers
    # unevenly): its relay range and quota are sized for max_replicas x slots.
    profile = workload.profile.model_copy(update={"max_sessions": workload.max_replicas * workload.slots})
    relay = profile.relay.model_copy(update={"peer_networks": tuple(workload.turn_peer_ranges)})
    tls = profile.tls.model_copy(
        update={"certificate_path": f"{TLS_MOUNT}/tls.crt", "private_key_path": f"{TLS_MOUNT}/tls.key"}
    )
    profile = profile.model_copy(update={"relay": relay, "tls": tls})
    return render_turnserver_conf(
        profile,
        secret,
        tls=workload.turn_tls_secret is not None,
        previous_secrets=(previous,) if previous else (),
    )


def turn_objects(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The region's TURN gateway: Secret ``coturn-config``, Deployment ``coturn`` (``turn_replicas`` pods on
    the system pool, spread over the zones, drained on removal), PodDisruptionBudget ``coturn``
    (``maxUnavailable`` 1), Service ``coturn``
    (LoadBalancer, UDP ``relay.port``, ``externalTrafficPolicy: Local``), with ``turn_tls_secret`` Service
    ``coturn-tls`` (LoadBalancer, TCP ``relay.tls_port``) on the same ``turn_address``, PodMonitoring
    ``coturn`` (its exporter), NetworkPolicy ``coturn-egress`` (``turn_egress_policy``). Empty when
    ``workload.turn_secret`` is None.

    Raises:
        ValueError: a TURN secret without ``turn_peer_ranges`` (the relay would reach nothing).
    """
    if workload.turn_secret is None:
        return []
    if not workload.turn_peer_ranges:
        raise ValueError("RegionWorkload.turn_peer_ranges: the pod ranges coturn may relay to are needed")
    relay = workload.profile.relay
    tls = workload.turn_tls_secret is not None
    labels = selector_labels(TURN_NAME)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(workload, TURN_CONFIG_SECRET, "turn", app=TURN_NAME),
        "type": "Opaque",
        "stringData": {
            "turnserver.conf": lift(lambda s: _conf(workload, s), workload.turn_secret)
            if workload.turn_secret_previous is None
            else lift(lambda s, p: _conf(workload, s, p), workload.turn_secret, workload.turn_secret_previous)
        },
    }
    mounts = [
        {"name": "config", "mountPath": "/etc/coturn", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "state", "mountPath": "/var/lib/coturn"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "secret": {"secretName": TURN_CONFIG_SECRET, "defaultMode": 0o440}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "state", "emptyDir": {}},
    ]
    ports = [
        {"name": "turn-udp", "containerPort": relay.port, "protocol": "UDP"},
        {"name": "metrics", "containerPort": relay.metrics_port, "protocol": "TCP"},
    ]
    if tls:
        ports.insert(1, {"name": "turn-tls", "containerPort": relay.tls_port, "protocol": "TCP"})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        # Not a subPath mount: the kubelet updates a whole Secret volume in place on renewal.
        volumes.append(
            {"name": "tls", "secret": {"secretName": workload.turn_tls_secret, "defaultMode": 0o440}}
        )
    container = {
        "name": TURN_NAME,
        "image": IMAGES["coturn"],
        "command": ["turnserver"],
        "args": coturn_args(CONTAINER_CONFIG_PATH, _PID_FILE),
        "ports": ports,
        # coturn's exporter answers "/" as its health check (README.turnserver, --prometheus).
        "readinessProbe": {"httpGet": {"path": "/", "port": "metrics"}, "periodSeconds": 10},
        "livenessProbe": {
            "httpGet": {"path": "/", "port": "metrics"},
            "periodSeconds": 15,
            "failureThreshold": 3,
        },
        "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    containers = [container]
    if tls:
        containers.append(
            {
                "name": "tls-reload",
                "image": IMAGES["coturn"],
                "command": ["sh", "-c", tls_reload_script(f"{TLS_MOUNT}/tls.crt", _PID_FILE)],
                "resources": {"requests": {"cpu": "5m", "memory": "8Mi"}, "limits": {"memory": "32Mi"}},
                "securityContext": container_security(),
                "volumeMounts": [
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True},
                ],
            }
        )
    container["lifecycle"] = {"preStop": {"exec": {"command": turn_drain_command(_PID_FILE)}}}
    pod_spec: dict[str, Any] = {
        # Off the GPU pool (issue 33): on the CPU pool that neither scales nor upgrades with it.
        "nodeSelector": {"cloud.google.com/gke-nodepool": SYSTEM_POOL},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": labels},
            }
        ],
        "terminationGracePeriodSeconds": turn_grace_s(workload),
        "automountServiceAccountToken": False,
        "securityContext": pod_security(_COTURN_UID),
        "containers": containers,
        "volumes": volumes,
    }
    if tls:  # the sidecar signals coturn: same user, one process namespace (no capability needed)
        pod_spec["shareProcessNamespace"] = True
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, TURN_NAME, "turn"),
        "spec": {
            "replicas": turn_replicas(workload),
            "selector": {"matchLabels": labels},
            # A CPU pod is cheap: the new coturn runs before the old one drains.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {**labels, "app.kubernetes.io/component": "turn"},
                    # The cluster autoscaler never removes a node for its own scale-down while it holds one.
                    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
                },
                "spec": pod_spec,
            },
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(workload, TURN_NAME, "turn"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }
    services = [_service(workload, TURN_NAME, "turn-udp", relay.port, "UDP")]
    if tls:
        services.append(_service(workload, TURN_TLS_NAME, "turn-tls", relay.tls_port, "TCP"))
    monitoring = {
        "apiVersion": "monitoring.googleapis.com/v1",
        "kind": "PodMonitoring",
        "metadata": object_meta(workload, TURN_NAME, "monitoring"),
        "spec": {
            "selector": {"matchLabels": labels},
            "endpoints": [
                {"port": "metrics", "path": "/metrics", "interval": f"{workload.profile.scrape_interval_s}s"}
            ],
        },
    }
    return [secret, turn_egress_policy(workload), deployment, budget, *services, monitoring]


def _service(workload: RegionWorkload, name: str, port_name: str, port: int, protocol: str) -> dict[str, Any]:
    """A ``LoadBalancer`` Service of the coturn pods: a regional external passthrough Network Load Balancer
    (backend-service based) for one protocol, on ``turn_address`` when reserved, admitting
    ``turn_source_ranges`` only."""
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(workload, name, "turn", annotations={"cloud.google.com/l4-rbs": "enabled"}),
        "spec": {
            "type": "LoadBalancer",
            "externalTrafficPolicy": "Local",
            "selector": selector_labels(TURN_NAME),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": protocol}],
        },
    }
    if workload.turn_address is not None:  # the reserved address, shared by both Services
        service["spec"]["loadBalancerIP"] = workload.turn_address
    if workload.turn_source_ranges:  # GKE opens the node firewall to these only
        service["spec"]["loadBalancerSourceRanges"] = list(workload.turn_source_ranges)
    return service
