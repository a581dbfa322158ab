"""Node profiles: one typed description of a single-GPU (or CPU) node, from which every file of the node
bundle is rendered (``infra.node.bundle.render``).

A node is the unit every stack deploys: nginx (TLS, WebSocket proxy, session cap) in front of the batched
runtime, Redis for session state and transcripts, Prometheus scraping the runtime, the host (node-exporter),
Redis (redis_exporter) and, on GPU hosts, NVIDIA's dcgm-exporter, and Grafana.

Built-in profiles (``PROFILES``): ``local`` (this machine: CPU, tiny preset, loopback, self-signed TLS),
``l40s`` and ``a100-80gb`` (on-premises or cloud GPU hosts, Scale-5: 5 sessions), ``t4-int8`` (the dev VM:
T4 with INT8 weights, as many sessions as the capacity planner allows). A profile is validated when it is
built: a bad field raises ``pydantic.ValidationError`` naming the field, the value and what is allowed; a
session count beyond what the capacity planner says fits raises the same, with the planner's reasons.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from infra.capacity import InfeasibleConfiguration, max_sessions, require_feasible
from infra.capacity.gpus import GPUS
from infra.capacity.plan import first_audio_check
from infra.node.profile.relay import RelaySettings
from infra.node.profile.sections import (
    LETSENCRYPT_DIRECTORY,
    AlertReceivers,
    NodeLimits,
    NodePorts,
    Retention,
    StrictModel,
    TlsSettings,
)
from runtime.engine.model_presets import check_preset_name

__all__ = [
    "Deployment",
    "GRAFANA_VERSION",
    "NodeLimits",
    "NodePorts",
    "NodeProfile",
    "PROFILES",
    "LETSENCRYPT_DIRECTORY",
    "AlertReceivers",
    "Precision",
    "Retention",
    "TlsSettings",
    "get_profile",
]

Deployment = Literal["compose", "processes"]
"""How the node's services run: ``compose`` (containers on one bridge network, GPU hosts and VMs) or
``processes`` (host processes on loopback: the local node, ``infra.node.local.node``)."""

Precision = Literal["fp32", "bf16", "fp16", "int8"]
"""Weight precision of the LM. ``int8`` needs a CUDA GPU here (bitsandbytes; the runtime's
``DUPLEX_QUANTIZE=int8``), ``fp32`` is the CPU default."""

GRAFANA_VERSION = "11.6.16"
"""The Grafana release the dashboards and the Compose file target (grafana-foundation-sdk is pinned to it)."""

_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,38}[a-z0-9]$")
_DOMAIN_RE = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


class NodeProfile(StrictModel):
    """One node, typed. Every renderer of ``infra.node`` reads only this (plus secrets given apart).

    Attributes:
        name: profile name, ``[a-z][a-z0-9-]*`` (used in labels and file names).
        gpu: a capacity-planner GPU key (``infra.capacity.gpus.GPUS``) or None for a CPU node.
        model, precision: the runtime's model preset and weight precision.
        max_sessions: batch slots B = the node's concurrent sessions (nginx caps connections at this).
            None takes the capacity planner's ``max_sessions`` for (model, gpu, precision).
        domain: the public DNS name the certificate is for.
        public_address: where nginx listens (``0.0.0.0`` on a host, ``127.0.0.1`` locally).
        private_address: where Redis, the runtime, Prometheus, Grafana and the exporters listen (loopback or
            the private network; never a public address).
        deployment: ``compose`` or ``processes`` (see ``Deployment``).
        runtime_image: the container image the Compose file runs (GPU hosts; stacks pin a digest).
        model_cache_dir: host directory for downloaded weights (mounted at /models).
        data_dir: host directory for Redis, Prometheus and Grafana data.
        scrape_interval_s: Prometheus's scrape and rule-evaluation interval (s); Grafana's minimum step.
        tls: where nginx's certificate comes from (``TlsSettings``: self-signed, files, or ACME).
        alerting: where the node's Alertmanager sends alerts (``AlertReceivers``).
        stagger_groups: the runtime's ``DUPLEX_STAGGER_GROUPS`` (1 off, 2 on), planned with it.
        frontend_workers: the runtime's front-end processes (``runtime/multiproc.py``; about 40 Opus
            sessions per worker, issue 16).
        relay: the TURN relay (coturn) WebRTC media goes through (``infra.node.profile.relay``).
    """

    name: str
    gpu: str | None = None
    model: str = "tiny"
    precision: Precision = "fp32"
    max_sessions: int | None = Field(None, ge=1, le=256)
    domain: str = "localhost"
    public_address: str = "0.0.0.0"
    private_address: str = "127.0.0.1"
    deployment: Deployment = "compose"
    runtime_image: str = "duplexops/runtime:latest"
    model_cache_dir: str = "/var/lib/duplex/models"
    data_dir: str = "/var/lib/duplex"
    scrape_interval_s: int = Field(5, ge=1, le=60, description="Prometheus scrape/evaluation interval (s)")
    stagger_groups: int = Field(
        1,
        ge=1,
        le=2,
        description="The runtime's staggered sub-batch groups (DUPLEX_STAGGER_GROUPS): 2 halves the phase "
        "wait at the cost of a whole-batch step every 40 ms; the capacity planner must say the node keeps "
        "its margin (docs/capacity.md)",
    )
    frontend_workers: int = Field(
        -1,
        ge=-1,
        le=64,
        description="The runtime's front-end worker processes beside its engine process (DUPLEX_WORKERS): "
        "-1 from the host's cores (one per core, 1..8), 0 one process",
    )
    ports: NodePorts = NodePorts()
    tls: TlsSettings = TlsSettings()
    limits: NodeLimits = NodeLimits()
    retention: Retention = Retention()
    alerting: AlertReceivers = AlertReceivers()
    relay: RelaySettings = RelaySettings()

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not _NAME_RE.match(value):
            raise ValueError(f"name {value!r} must match {_NAME_RE.pattern} (lower case, digits, '-')")
        return value

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None and value not in GPUS:
            raise ValueError(
                f"unknown gpu {value!r}; allowed: {', '.join(sorted(GPUS))} or null for a CPU node"
            )
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        return check_preset_name(value)

    @field_validator("domain")
    @classmethod
    def _valid_domain(cls, value: str) -> str:
        if not _DOMAIN_RE.match(value):
            raise ValueError(f"domain {value!r} is not a DNS name (lower case labels separated by dots)")
        return value

    @field_validator("public_address", "private_address")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (e.g. 127.0.0.1, 10.0.0.5, 0.0.0.0)") from None
        return value

    @field_validator("model_cache_dir", "data_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not Path(value).is_absolute():
            raise ValueError(f"{value!r} must be an absolute path on the node")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> NodeProfile:
        if self.tls.mode == "acme" and ("." not in self.domain or self.domain.endswith("localhost")):
            raise ValueError(
                f"tls.mode 'acme' needs a public DNS name as domain, not {self.domain!r}: an ACME CA "
                "validates the name over the internet (HTTP-01 on port 80)"
            )
        taken = {port: name for name, port in self.ports.model_dump().items()}
        if self.relay.enabled and self.relay.tls_port in taken:
            raise ValueError(
                f"relay.tls_port {self.relay.tls_port} is also ports.{taken[self.relay.tls_port]}; "
                "each needs its own"
            )
        address = ipaddress.ip_address(self.private_address)
        if not (address.is_loopback or address.is_private):
            raise ValueError(
                f"private_address {self.private_address} is neither loopback nor private: Redis, Prometheus "
                "and Grafana must never listen on a public address"
            )
        if self.gpu is None:
            if self.precision not in ("fp32", "bf16"):
                raise ValueError(
                    f"precision {self.precision!r} needs a GPU; a CPU node (gpu: null) runs fp32 or bf16"
                )
            if self.max_sessions is None:
                raise ValueError(
                    "max_sessions is required on a CPU node (the capacity planner models GPUs only)"
                )
            return self
        capacity_model = self.model if self.model in ("moshi-7b", "personaplex-7b") else None
        if capacity_model is None:
            if self.max_sessions is None:
                raise ValueError(
                    f"max_sessions is required for model {self.model!r} (not in the capacity planner)"
                )
            return self
        stagger = {"stagger_groups": self.stagger_groups}
        sessions = self.max_sessions
        if sessions is None:
            sessions = max_sessions(capacity_model, self.gpu, self.precision, **stagger)
            if sessions < 1:
                raise ValueError(
                    f"{capacity_model} at {self.precision} does not fit one session on the {self.gpu} "
                    "(duplex capacity plan for the reasons)"
                )
            object.__setattr__(self, "max_sessions", sessions)
        try:
            require_feasible(capacity_model, self.gpu, self.precision, sessions=sessions, **stagger)
        except InfeasibleConfiguration as exc:
            fits = max_sessions(capacity_model, self.gpu, self.precision, **stagger)
            raise ValueError(
                f"max_sessions={self.max_sessions} does not fit {capacity_model} at {self.precision} on a "
                f"{self.gpu} (the capacity planner allows at most {fits}): {exc}"
            ) from None
        check = first_audio_check(
            capacity_model, self.gpu, self.precision, sessions, self.stagger_groups,
            self.limits.first_audio_p99_target_ms,
        )  # fmt: skip
        if check.refused:
            raise ValueError(check.message)
        return self

    @property
    def first_audio_warnings(self) -> list[str]:
        """Why the capacity planner expects ``limits.first_audio_p99_target_ms`` to be missed (its estimate of
        the runtime's first-audio p99 is above it), or nothing: empty on a CPU node or a model the planner
        does not know. ``duplex node profiles`` and ``render`` print these."""
        model = self.model if self.model in ("moshi-7b", "personaplex-7b") else None
        if self.gpu is None or model is None:
            return []
        check = first_audio_check(
            model, self.gpu, self.precision, self.sessions, self.stagger_groups,
            self.limits.first_audio_p99_target_ms,
        )  # fmt: skip
        return [check.message] if check.warned else []

    @property
    def sessions(self) -> int:
        """The node's slot count (``max_sessions`` after the planner filled it in)."""
        assert self.max_sessions is not None  # set by validation
        return self.max_sessions

    @property
    def device(self) -> str:
        """The runtime's torch device: ``cuda`` on a GPU node, else ``cpu``."""
        return "cpu" if self.gpu is None else "cuda"

    @property
    def runtime_dtype(self) -> str | None:
        """``DUPLEX_DTYPE`` for this precision (None where the runtime picks: int8 quantises fp16 compute)."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "float16"}[self.precision]

    @property
    def runtime_quantize(self) -> str:
        """``DUPLEX_QUANTIZE`` for this precision: ``int8`` builds the LM through moshi's INT8 path (linear
        layers int8, the rest fp16: what the capacity planner counts for ``int8``), else ``none``."""
        return "int8" if self.precision == "int8" else "none"


_BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "local": {
        "name": "local",
        "gpu": None,
        "model": "tiny",
        "precision": "fp32",
        "max_sessions": 5,
        "domain": "localhost",
        "public_address": "127.0.0.1",
        "private_address": "127.0.0.1",
        "deployment": "processes",
        "scrape_interval_s": 1,  # a demo run lasts seconds: scrape often enough to see it
        # Relative to the node directory (nginx runs with -p <node dir>).
        "tls": {"certificate_path": "tls/node.crt", "private_key_path": "tls/node.key"},
        # Unprivileged ports: the local node runs as the invoking user.
        "ports": {"https": 8443, "http": 8080, "redis": 6390},
        "limits": {"max_sessions_per_client": 10, "max_session_s": 600, "drain_grace_s": 5},
        "retention": {"prometheus_days": 1, "redis_max_memory_mb": 64, "transcript_ttl_hours": 1},
        "model_cache_dir": "/var/tmp/duplex-local/models",
        "data_dir": "/var/tmp/duplex-local",
    },
    "l40s": {
        "name": "l40s",
        "gpu": "l40s",
        "model": "personaplex-7b",
        "precision": "int8",
        "max_sessions": 5,
        "domain": "duplex.example.com",
    },
    "a100-80gb": {
        "name": "a100-80gb",
        "gpu": "a100-80gb-sxm",
        "model": "personaplex-7b",
        "precision": "bf16",
        "max_sessions": 5,
        "domain": "duplex.example.com",
    },
    "t4-int8": {
        "name": "t4-int8",
        "gpu": "t4",
        "model": "personaplex-7b",
        "precision": "int8",
        "max_sessions": None,  # the capacity planner's figure
        "domain": "duplex-dev.example.com",
        "limits": {"first_audio_p99_target_ms": 250.0},
    },
}

PROFILES: dict[str, NodeProfile] = {name: NodeProfile(**fields) for name, fields in _BUILTIN_PROFILES.items()}
"""The built-in profiles, validated at import. Derive variants with ``get_profile(name, **overrides)``."""


def get_profile(profile_name: str, /, **overrides: Any) -> NodeProfile:
    """A built-in profile with ``overrides`` applied (a nested override such as ``ports={...}`` replaces
    the whole nested section), validated again: ``max_sessions`` left unset is re-derived by the planner.

    Raises:
        KeyError: no profile of that name (the message lists the allowed names).
        pydantic.ValidationError: an override is invalid (names the field and what is allowed).
    """
    if profile_name not in _BUILTIN_PROFILES:
        raise KeyError(f"unknown node profile {profile_name!r}; allowed: {', '.join(_BUILTIN_PROFILES)}")
    return NodeProfile(**{**_BUILTIN_PROFILES[profile_name], **overrides})
