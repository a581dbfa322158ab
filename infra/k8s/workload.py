"""The runtime of one region on GKE: its Namespace (Pod Security ``restricted``), ServiceAccount, Secret,
Memorystore CA, Deployment (one pod per GPU node, probes, the drain on preStop), Service (standalone NEG for
the global load balancer) and PodDisruptionBudget. The weights Job is ``prefetch``'s, the autoscaler
``scaling``'s. docs/deploying.md, "Stack multi-region" (draining: docs/operations.md, "Drain").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from infra.k8s.base import (
    APP_NAME,
    APP_TOKEN_KEYS_PATH,
    GCSFUSE_ANNOTATIONS,
    GCSFUSE_CACHE_LIMIT,
    MODELS_MOUNT,
    PART_OF,
    REDIS_CA_CONFIGMAP,
    REDIS_CA_DIR,
    RUNTIME_SERVICE_ACCOUNT,
    RUNTIME_UID,
    SECRET_KEYS,
    SECRET_NAME,
    SECRETS_DIR,
    TOKEN_KEYS_PATH,
    WEIGHTS_JOB,
    WEIGHTS_MARKER,
    RegionWorkload,
    cluster_ip_service,
    container_security,
    gcsfuse_volume,
    object_meta,
    pod_labels,
    pod_security,
    service_account,
    standard_labels,
    weights_dir,
)
from infra.k8s.disruption import rollout_step_s, rollout_strategy
from infra.k8s.pod_routes import resume_routes_env
from infra.k8s.recordings import recordings_env, recordings_volume, recordings_volume_mounts
from infra.k8s.turn import TURN_SECRET_KEY, turn_env
from infra.names import GPU_TAINT_KEY
from infra.node.bundle.carriers import (
    CARRIER_SECRETS,
    SIGNED_URL_SETTINGS,
    carrier_stream_url,
    check_carrier_secrets,
)
from infra.node.bundle.services import runtime_settings
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "GOOGLE_FRONT_END_RANGES",
    "RUNTIME_CPU_REQUEST",
    "RUNTIME_FRONTEND_WORKERS",
    "DRAIN_MARGIN_S",
    "PRESTOP_POLL_S",
    "STARTUP_PROBE_FAILURES",
    "STARTUP_PROBE_PERIOD_S",
    "ZONE_TOPOLOGY_KEY",
    "drain_seconds",
    "namespace",
    "neg_annotation",
    "pod_disruption_budget",
    "prestop_command",
    "redis_ca_configmap",
    "runtime_deployment",
    "runtime_env",
    "runtime_secret",
    "runtime_service",
    "runtime_service_account",
    "startup_budget_s",
    "termination_grace_s",
    "zone_spread",
]

DRAIN_MARGIN_S = 60
"""Seconds of ``terminationGracePeriodSeconds`` beyond the drain grace: after the grace the runtime closes
the remaining sessions and waits up to 5 s for them (``ChatServer.drain``), stops its tick thread and
flushes Redis; the preStop hook notices within its 5 s poll. 60 s is twice the Compose node's margin
(``infra.node.bundle.compose.RUNTIME_STOP_MARGIN_S``, 30 s), for the slower API-driven teardown."""


STARTUP_PROBE_PERIOD_S = 10


STARTUP_PROBE_FAILURES = 180
"""The startup probe: ``/readyz`` every 10 s, 180 failures allowed: 1800 s (30 min) from the runtime
container's start (after the init container has seen the weights) to a loaded, warm model. ``/readyz``,
not ``/healthz``: the runtime answers ``/healthz`` 200 while it loads
(``runtime.frontend.server.loading_status``),
so only readiness says the load finished, and a load stuck past the budget gets the container restarted
(a fresh pod cannot be full or draining, the other reasons for a 503). A 7B load from
the bucket is minutes (15.6 GiB of bf16 weights for personaplex-7b, ``infra.capacity.models``, through
Cloud Storage FUSE's parallel downloads); 30 min is the Compose node's ``start_period`` (1800 s), which
also covers a download."""


PRESTOP_POLL_S = 5
"""How often the preStop hook asks ``/healthz`` whether the drain is over (s)."""


def drain_seconds(profile: NodeProfile) -> int:
    """How long (s) a pod that is told to stop keeps serving its running sessions:
    ``DUPLEX_DRAIN_GRACE_S`` = the longest session, ``profile.limits.max_session_s`` (3600 s by default).
    The load balancer's connection draining should last as long (GCP allows at most 3600 s)."""
    return profile.limits.max_session_s


def termination_grace_s(profile: NodeProfile) -> int:
    """The runtime pod's ``terminationGracePeriodSeconds`` (s): ``drain_seconds(profile)`` +
    ``DRAIN_MARGIN_S`` (60 s): 3660 s for a 1 h longest session."""
    return drain_seconds(profile) + DRAIN_MARGIN_S


def startup_budget_s() -> int:
    """Seconds the startup probe allows from the runtime container's start to a loaded model:
    ``STARTUP_PROBE_PERIOD_S`` x ``STARTUP_PROBE_FAILURES`` = 1800 s (30 min)."""
    return STARTUP_PROBE_PERIOD_S * STARTUP_PROBE_FAILURES


def namespace(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Namespace, with Pod Security Admission at ``restricted`` (enforce, audit and warn): every
    pod of it runs as non-root without privilege escalation, all capabilities dropped, seccomp
    RuntimeDefault (GKE's Cloud Storage FUSE sidecar follows the same standard)."""
    labels = {"app.kubernetes.io/part-of": PART_OF}
    for mode in ("enforce", "audit", "warn"):
        labels[f"pod-security.kubernetes.io/{mode}"] = "restricted"
        labels[f"pod-security.kubernetes.io/{mode}-version"] = "latest"
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": workload.namespace, "labels": labels},
    }


def runtime_service_account(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime pods' ServiceAccount, annotated for Workload Identity with
    ``runtime_service_account`` (``iam.gke.io/gcp-service-account``)."""
    return service_account(
        workload, RUNTIME_SERVICE_ACCOUNT, "runtime", workload.runtime_service_account, app=APP_NAME
    )


def runtime_secret(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Secret (type Opaque), ``stringData``: ``redis-url`` (``DUPLEX_REDIS_URL``),
    ``redis-password`` (redis_exporter), ``token_keys.json`` (mounted as ``TOKEN_KEYS_PATH``) and, when
    given, ``hf-token`` (the weights Job's ``HF_TOKEN``). The only object holding those values."""
    data: dict[str, Any] = {
        SECRET_KEYS["redis_url"]: workload.runtime_redis_url(),
        SECRET_KEYS["redis_password"]: workload.redis_password,
        SECRET_KEYS["token_keys"]: workload.token_keys_json,
    }
    if workload.app_token_keys_json is not None:  # DUPLEX_APP_TOKEN_KEYS_FILE: the sessions API's keys
        data[SECRET_KEYS["app_token_keys"]] = workload.app_token_keys_json
    if workload.hf_token is not None:
        data[SECRET_KEYS["hf_token"]] = workload.hf_token
    if workload.turn_secret is not None:  # DUPLEX_TURN_SECRET (infra.k8s.turn)
        data[TURN_SECRET_KEY] = workload.turn_secret
    for name, value in sorted(workload.carrier_secrets.items()):  # the phone carriers' bridges
        data[carrier_secret_key(name)] = value
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(workload, SECRET_NAME, "runtime", app=APP_NAME),
        "type": "Opaque",
        "stringData": data,
    }


def redis_ca_configmap(workload: RegionWorkload) -> dict[str, Any]:
    """ConfigMap ``redis-ca`` with Memorystore's server CA as ``ca.pem`` (mounted at ``REDIS_CA_DIR`` by the
    runtime and redis_exporter)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_meta(workload, REDIS_CA_CONFIGMAP, "runtime", app=APP_NAME),
        "data": {"ca.pem": workload.redis_ca_certificate},
    }


GOOGLE_FRONT_END_RANGES = ("35.191.0.0/16", "130.211.0.0/22")
"""The source ranges of Google Cloud's load-balancer front ends and health checks
(cloud.google.com/load-balancing/docs/health-check-concepts, "Probe IP ranges and firewall rules"): the only
peers whose ``X-Forwarded-For`` the
runtime believes on GKE (``DUPLEX_TRUSTED_PROXIES``, with ``DUPLEX_FORWARDED_BY=google-lb``)."""

RUNTIME_CPU_REQUEST = 4
"""Cores requested for the runtime container: one for the engine's tick, the rest for its front-end workers
(issue 16: about 40 Opus sessions per worker, since sphn's encoder holds the GIL)."""
RUNTIME_FRONTEND_WORKERS = RUNTIME_CPU_REQUEST - 1
"""``DUPLEX_WORKERS`` of the runtime container (``runtime/multiproc.py``)."""


def runtime_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's environment: ``runtime_settings(profile)`` (``infra.node.bundle.services``)
    adapted to
    Kubernetes: ``DUPLEX_HOST=0.0.0.0``; ``DUPLEX_NODE_ID`` = the pod's name (fieldRef);
    ``DUPLEX_DRAIN_GRACE_S`` = ``drain_seconds(profile)`` (the longest session, so that a drain never cuts
    one); ``DUPLEX_TOKEN_KEYS_FILE`` = ``TOKEN_KEYS_PATH``; ``DUPLEX_WEIGHTS`` = ``weights_dir``;
    ``DUPLEX_WORKERS`` = ``RUNTIME_FRONTEND_WORKERS``; ``DUPLEX_TRUSTED_PROXIES`` = Google's front-end ranges
    and ``DUPLEX_FORWARDED_BY=google-lb`` (the caller's address from the load balancer's own header);
    ``DUPLEX_FULL_BEFORE_UPGRADE=true`` (a full pod's 503 comes before the upgrade: the URL map retries it)
    and the waiting room (``DUPLEX_WAITING_ROOM_S``, ``DUPLEX_WAITING_ROOM_SIZE``, when the workload has one);
    ``DUPLEX_REDIS_URL`` from the Secret; the recording settings (``infra.k8s.recordings``, when the
    region records); then ``HF_HUB_OFFLINE=1`` (the weights are local) and the caches
    (``HF_HOME``, ``XDG_CACHE_HOME``, ``TRITON_CACHE_DIR``) on an emptyDir (the root filesystem is
    read-only)."""
    settings = dict(runtime_settings(workload.profile))
    # TURN: the region's gateway when it has one (turn_env, below), not the single node's own relay.
    for name in (
        "DUPLEX_TURN_URLS",
        "DUPLEX_TURN_TTL_S",
        "DUPLEX_RTC_RELAY_NETS",
        "DUPLEX_RTC_ALLOWED_CANDIDATE_NETS",
        "DUPLEX_APP_TOKEN_KEYS_FILE",  # the node's path; the pods' is APP_TOKEN_KEYS_PATH (below)
    ):
        settings.pop(name, None)
    settings.update(
        {
            "DUPLEX_HOST": "0.0.0.0",
            "DUPLEX_DRAIN_GRACE_S": str(drain_seconds(workload.profile)),
            "DUPLEX_TOKEN_KEYS_FILE": TOKEN_KEYS_PATH,
            **(
                {}
                if workload.app_token_keys_json is None
                else {"DUPLEX_APP_TOKEN_KEYS_FILE": APP_TOKEN_KEYS_PATH}
            ),
            "DUPLEX_WEIGHTS": weights_dir(workload),
            # A CPU request is a quota, not a cpuset: the runtime cannot see it, so the worker count is set.
            "DUPLEX_WORKERS": str(RUNTIME_FRONTEND_WORKERS),
            # Callers reach the pods through Google's front ends (container-native load balancing): believe
            # those peers only, and only the X-Forwarded-For entry they append (issue 34, item 9).
            "DUPLEX_TRUSTED_PROXIES": ",".join(GOOGLE_FRONT_END_RANGES),
            "DUPLEX_FORWARDED_BY": "google-lb",
            # Google's load balancer logs full request URLs to Cloud Logging: no secret in a URL (issue 34,
            # item 9): a token, resume credential or text prompt there is refused, naming where it goes.
            "DUPLEX_URL_SECRETS": "refuse",
            # Issue 33: a pod with no slot and no waiting-room place answers 503 before the upgrade, which
            # the global entry's URL map retries on another pod.
            "DUPLEX_FULL_BEFORE_UPGRADE": "true",
        }
    )
    if workload.waiting_room_s > 0 and workload.waiting_room_size > 0:
        settings["DUPLEX_WAITING_ROOM_S"] = str(workload.waiting_room_s)
        settings["DUPLEX_WAITING_ROOM_SIZE"] = str(workload.waiting_room_size)
    env: list[dict[str, Any]] = []
    for name, value in settings.items():
        if name == "DUPLEX_NODE_ID":
            env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        else:
            env.append({"name": name, "value": value})
    env.append(
        {
            "name": "DUPLEX_REDIS_URL",
            "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": SECRET_KEYS["redis_url"]}},
        }
    )
    env += turn_env(workload)
    env += recordings_env(workload)
    env += carrier_env(workload)
    env += [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HF_HOME", "value": "/var/cache/duplex/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": "/var/cache/duplex"},
        {"name": "TRITON_CACHE_DIR", "value": "/var/cache/duplex/triton"},
    ]
    return resume_routes_env(workload, env)  # issue 33: the resume URL's region and pod


def prestop_command(port: int, pid: int = 1) -> list[str]:
    """The runtime's preStop hook: SIGTERM to the runtime (``pid`` 1: the image's exec-form ``ENTRYPOINT
    ["duplex-runtime"]``), which starts its drain, then wait while ``/healthz`` still answers (polled every
    ``PRESTOP_POLL_S`` s): the runtime stops listening once the drain is over (``ChatServer.drain`` ->
    ``close``: the listener is closed first), then exits 0. The kubelet sends its own SIGTERM after the
    hook; the runtime is exiting by then."""
    check = f"curl -fsS -o /dev/null --max-time 5 http://127.0.0.1:{port}/healthz"
    return ["/bin/sh", "-c", f"kill -TERM {pid}; while {check}; do sleep {PRESTOP_POLL_S}; done"]


ZONE_TOPOLOGY_KEY = "topology.kubernetes.io/zone"
"""The node label of its zone (well-known Kubernetes label)."""


def zone_spread(selector: Mapping[str, str]) -> list[dict[str, Any]]:
    """``topologySpreadConstraints`` of the pods labelled ``selector``: over the zones
    (``ZONE_TOPOLOGY_KEY``), at most one pod more in any zone than in the emptiest (``maxSkew`` 1), as a
    scheduling rule (``DoNotSchedule``), counting only the nodes the pod may run on (its node selector;
    Kubernetes' default ``nodeAffinityPolicy: Honor``).

    The runtime's: with ``min_replicas`` >= the zones (``RegionWorkload``) and a GPU node in every zone
    from the pool's creation (``infra.components.gke_parts.INITIAL_NODES_PER_ZONE``), every zone always
    holds a runtime pod, so GKE's NEG controller makes the zone's NEG (it makes NEGs only where the Service
    has pods: kubernetes/ingress-gce issue 1755) and the global backend service finds it. The cost: a zone
    out of GPUs caps the others at one pod more than it holds; the global load balancer then spills callers
    to the next region."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": ZONE_TOPOLOGY_KEY,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": dict(selector)},
        }
    ]


def runtime_deployment(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's Deployment. No ``replicas`` field: the HorizontalPodAutoscaler owns it (a value here
    would reset the count at every apply).

    - Rolling updates replace one pod at a time, never one beyond the replicas (maxSurge 0, maxUnavailable
      1: ``infra.k8s.disruption.ROLLOUT_STRATEGY``): a rollout at the pool's ``maxNodes`` needs no extra GPU.
    - One GPU per pod (``nvidia.com/gpu: 1``), on the GPU pool (``cloud.google.com/gke-accelerator``),
      tolerating its ``nvidia.com/gpu`` NoSchedule taint, spread over the zones (``zone_spread``).
    - Resources: requests 4 CPU and 20 GiB, memory limit 28 GiB, no CPU limit (CFS throttling would stretch
      the 80 ms tick). Memory: loading personaplex-7b holds its 15.6 GiB bf16 state dict in host memory
      (``runtime.engine.models.load_checkpoint``; ``infra.capacity.models``) plus torch and CUDA (~3 GiB),
      ~19 GiB;
      20 GiB fits the smallest GPU machine types' allocatable memory (n1-standard-8, 30 GB; g2-standard-8,
      32 GB), the limit lets a dtype conversion's second copy burst above it where the node has it.
    - Probes: startup ``/readyz`` for ``startup_budget_s()`` (1800 s: ``STARTUP_PROBE_FAILURES`` says why
      readiness, not ``/healthz``); liveness ``/healthz`` (3 failures 10 s apart); readiness ``/readyz``
      every 5 s, 1 failure: a full or draining pod leaves the NEG at once.
    - Drain: preStop ``prestop_command``; ``terminationGracePeriodSeconds`` = ``termination_grace_s``.
    - An init container waits for the weights Job's marker on the read-only bucket mount (GKE injects the
      Cloud Storage FUSE sidecar as the first init container, so the mount is there).
    - Security: uid/gid 10001, non-root, no privilege escalation, all capabilities dropped, seccomp
      RuntimeDefault, read-only root filesystem with emptyDirs for ``/tmp`` and the caches.
    - Recordings (when the region records: ``workload.recordings_bucket``): the region's recordings bucket,
      read-write, at ``DUPLEX_RECORDING_DIR`` (``infra.k8s.recordings``).
    """
    profile = workload.profile
    port = profile.ports.runtime
    marker = f"{weights_dir(workload)}/{WEIGHTS_MARKER}"
    wait = (
        f'until [ -f "{marker}" ]; do echo "waiting for {marker} (Job {WEIGHTS_JOB})"; sleep 10; done; '
        f'echo "weights ready: {marker}"'
    )
    mounts = [
        {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True},
        {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True},
        {"name": "redis-ca", "mountPath": REDIS_CA_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/var/cache/duplex"},
        *recordings_volume_mounts(workload),
    ]
    runtime = {
        "name": "runtime",
        "image": workload.image,
        "args": ["serve"],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": runtime_env(workload),
        "resources": {
            "requests": {"cpu": str(RUNTIME_CPU_REQUEST), "memory": "20Gi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "28Gi", "nvidia.com/gpu": "1"},
        },
        "startupProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": STARTUP_PROBE_PERIOD_S,
            "failureThreshold": STARTUP_PROBE_FAILURES,
            "timeoutSeconds": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 3,
            "timeoutSeconds": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 1,
            "successThreshold": 1,
            "timeoutSeconds": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(port)}}},
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    wait_for_weights = {
        "name": "wait-for-weights",
        "image": workload.image,
        "command": ["/bin/sh", "-c", wait],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {
            "selector": {"matchLabels": pod_labels(workload)},
            "strategy": rollout_strategy(),
            "revisionHistoryLimit": 5,
            # A step is stuck only after the old pod's drain, a node, the weights wait and the startup budget.
            "progressDeadlineSeconds": rollout_step_s(termination_grace_s(profile), startup_budget_s()),
            "template": {
                "metadata": {
                    "labels": standard_labels(APP_NAME, "runtime"),
                    "annotations": dict(GCSFUSE_ANNOTATIONS),
                },
                "spec": {
                    "serviceAccountName": RUNTIME_SERVICE_ACCOUNT,
                    "enableServiceLinks": False,
                    "nodeSelector": {"cloud.google.com/gke-accelerator": workload.accelerator},
                    "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}],
                    "topologySpreadConstraints": zone_spread(pod_labels(workload)),
                    "terminationGracePeriodSeconds": termination_grace_s(profile),
                    "securityContext": pod_security(RUNTIME_UID),
                    "initContainers": [wait_for_weights],
                    "containers": [runtime],
                    "volumes": [
                        gcsfuse_volume(workload, read_only=True),
                        # Cloud Storage FUSE's file cache (the sidecar uses a volume of this name if present).
                        {"name": "gke-gcsfuse-cache", "emptyDir": {"sizeLimit": GCSFUSE_CACHE_LIMIT}},
                        {
                            "name": "secrets",
                            "secret": {
                                "secretName": SECRET_NAME,
                                "defaultMode": 0o440,
                                "items": [
                                    {"key": SECRET_KEYS[role], "path": SECRET_KEYS[role]}
                                    for role in ("token_keys", "app_token_keys")
                                    if role == "token_keys" or workload.app_token_keys_json is not None
                                ],
                            },
                        },
                        {"name": "redis-ca", "configMap": {"name": REDIS_CA_CONFIGMAP, "defaultMode": 0o444}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}},
                        {"name": "cache", "emptyDir": {"sizeLimit": "4Gi"}},
                        *recordings_volume(workload),
                    ],
                },
            },
        },
    }


def neg_annotation(name: str, port: int, zones: tuple[str, ...]) -> str:
    """The ``cloud.google.com/neg`` annotation of a Service with standalone NEGs named ``name`` for ``port``
    in ``zones``: ``{"exposed_ports": {"<port>": {"name": ...}}, "zones": [...]}``. ``zones`` is the NEG
    controller's pre-provisioning field (kubernetes/ingress-gce PR 3152, merged July 2026): where GKE runs
    it, the NEG of every listed zone exists even before a pod does; older controllers ignore the field and
    make a zone's NEG with its first pod (``zone_spread`` puts one in each)."""
    return json.dumps(
        {"exposed_ports": {str(port): {"name": name}}, "zones": list(zones)}, separators=(",", ":")
    )


def runtime_service(workload: RegionWorkload) -> dict[str, Any]:
    """The runtime's ClusterIP Service, port ``http`` = ``profile.ports.runtime`` (8998), annotated
    ``cloud.google.com/neg`` (``neg_annotation``): GKE's NEG controller creates a standalone zonal NEG of
    that name in every zone of ``workload.zones``, endpoints = ready pod IPs; the stack's global load
    balancer uses them as backends."""
    port = workload.profile.ports.runtime
    neg = neg_annotation(workload.neg_name, port, workload.zones)
    return cluster_ip_service(
        workload, APP_NAME, "runtime", "http", port, annotations={"cloud.google.com/neg": neg}
    )


def pod_disruption_budget(workload: RegionWorkload) -> dict[str, Any]:
    """PodDisruptionBudget (policy/v1): at most one runtime pod evicted at a time (node upgrades, the
    cluster autoscaler). An evicted pod drains like any other (preStop). A pod whose slots are all taken
    stays ready (``/readyz`` means serving; ``/slotz`` has-a-free-slot: docs/deploying.md, "Slot-aware
    admission"), so a full region does not block evictions; a loading or draining pod counts as
    unavailable."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(workload, APP_NAME, "runtime"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels(workload)}},
    }


def carrier_secret_key(name: str) -> str:
    """The runtime Secret's key of a carrier secret: ``twilio_auth_token`` -> ``twilio-auth-token``."""
    return name.replace("_", "-")


def carrier_env(workload: RegionWorkload) -> list[dict[str, Any]]:
    """The runtime container's settings of the phone carriers whose secrets the stack set: each secret from
    the runtime Secret (:func:`carrier_secret_key`), and the stream URL a signing carrier signs
    (``infra.node.bundle.carriers``); the runtime's rules (``runtime/config.py``) hold the pairs.

    Raises:
        ValueError: an unknown carrier secret, or one of Exotel's pair alone.
    """
    env: list[dict[str, Any]] = []
    for name in sorted(check_carrier_secrets(workload.carrier_secrets)):
        carrier, setting = CARRIER_SECRETS[name]
        key = carrier_secret_key(name)
        env.append({"name": setting, "valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": key}}})
        if carrier in SIGNED_URL_SETTINGS:
            url = carrier_stream_url(workload.profile, carrier)
            env.append({"name": SIGNED_URL_SETTINGS[carrier], "value": url})
    return env
