"""What the topologies of the program share: capacity figures for the outputs, resource labels, the
stack's secrets (``stack_secrets``), the endpoint and token commands, enabling Google APIs and the build
directory. docs/deploying.md.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pulumi

from infra.capacity import plan
from infra.capacity.power import DEFAULT_USD_PER_KWH, HOURS_PER_MONTH
from infra.components._util import REPO_ROOT
from infra.node.bundle.services import token_audience
from infra.node.profile.profiles import NodeProfile
from infra.node.profile.relay import media_firewall_allows, relay_port_range, turn_urls
from infra.stack_config import StackConfig

if TYPE_CHECKING:
    from infra.components.node_secrets import StackSecrets

__all__ = [
    "BUILD_DIR_ENV",
    "build_dir",
    "capacity_summary",
    "enable_apis",
    "endpoint",
    "labels",
    "mint_command",
    "secret",
    "stack_secrets",
    "turn_summary",
]

BUILD_DIR_ENV = "DUPLEXOPS_BUILD_DIR"
"""Environment variable naming the local build directory (default ``.pulumi-build`` at the repository
root, git-ignored): the on-premises bundle is written there for ``CopyToRemote``."""


def capacity_summary(profile: NodeProfile, *, machine_type: str | None, nodes: int = 1) -> dict[str, Any]:
    """Sessions and cost of ``nodes`` nodes of ``profile`` from the capacity planner: the cloud price of
    ``machine_type`` (on-demand list price x 730 h), or electricity only on-premises (no machine type)."""
    assert profile.gpu is not None
    model = profile.model if profile.model in ("moshi-7b", "personaplex-7b") else None
    summary: dict[str, Any] = {
        "sessions_per_node": profile.sessions,
        "nodes": nodes,
        "total_sessions": profile.sessions * nodes,
        "gpu": profile.gpu,
        "model": profile.model,
        "precision": profile.precision,
    }
    if model is None:
        return {**summary, "basis": f"model {profile.model!r} is not in the capacity planner"}
    capacity = plan(model, profile.gpu, profile.precision, profile.sessions, nodes, machine_type=machine_type)
    power = capacity.power
    summary["planner_max_sessions"] = capacity.verdict.max_sessions
    if machine_type is not None:
        summary.update(
            machine_type=machine_type,
            usd_per_hour_per_node=power.usd_per_hour_node,
            usd_per_month=None if power.cloud_usd_month is None else round(power.cloud_usd_month, 2),
            usd_per_session_month=None
            if power.cloud_usd_month is None
            else round(power.cloud_usd_month / (profile.sessions * nodes), 2),
            price_source=power.price_source,
            price_read_on=power.price_read_on,
            basis=f"on-demand list price x {HOURS_PER_MONTH:.0f} h per month (re-check before quoting)",
        )
    else:
        summary.update(
            electricity_usd_month=round(power.electricity_usd_month, 2),
            node_wall_w=round(power.node_wall_w, 1),
            basis=f"on-premises: electricity only at ${DEFAULT_USD_PER_KWH}/kWh x {HOURS_PER_MONTH:.0f} h "
            "(hardware, space and staff not counted)",
        )
    return summary


def labels(config: StackConfig) -> dict[str, str]:
    stack = re.sub(r"[^a-z0-9_-]+", "-", config.stack.lower())[:63]
    return {"app": "duplexops", "stack": stack, "managed-by": "pulumi"}


def mint_command(profile: NodeProfile) -> str:
    """How an operator mints a session token for this node, from the keys the ``tokenKeys`` output reads
    (saved as ``token_keys.json``); application backends call ``runtime.frontend.gate.tokens.mint_token``
    instead."""
    return (
        "duplex token mint --key-file token_keys.json --kid <kid in the file> "
        f"--audience {token_audience(profile)} --ttl-s 300 --persona any"
    )


def endpoint(host: pulumi.Input[str], profile: NodeProfile) -> pulumi.Output[str]:
    port = "" if profile.ports.https == 443 else f":{profile.ports.https}"
    return pulumi.Output.from_input(host).apply(lambda h: f"wss://{h}{port}/api/chat")


def turn_summary(config: StackConfig, profile: NodeProfile) -> dict[str, Any] | None:
    """The ``turn`` output of a single-node stack: the TURN URLs the runtime gives WebRTC callers, the
    public ports a firewall must open for media, and the relay range (never public: only the runtime on the
    node sends to it). None when the relay is off. Warns when the stack has no ``duplexops:domain``: the
    URLs then name the profile's domain, which callers cannot resolve, and ``turns:`` needs a certificate
    for the name."""
    relay = profile.relay
    if not relay.enabled:
        return None
    if config.domain is None:
        pulumi.log.warn(
            f"no duplexops:domain: the TURN URLs WebRTC callers get name {profile.domain!r}; set "
            "duplexops:domain (an A record to the node's address) for callers that must relay"
        )
    low, high = relay_port_range(relay, profile.sessions)
    return {
        "urls": turn_urls(relay, profile.domain),
        "publicPorts": [
            f"{port}/{a['protocol']}" for a in media_firewall_allows(relay) for port in a["ports"]
        ],
        "relayRange": f"{low}-{high}/udp (private: the runtime on the node is the only peer)",
    }


def secret(value: Any) -> pulumi.Output[str] | None:
    return None if value is None else pulumi.Output.secret(value.get_secret_value())


def enable_apis(project: str, services: tuple[str, ...]) -> pulumi.ResourceOptions:
    """Enable ``services`` in ``project`` (never disabled on destroy: other stacks may use them); options
    that make a resource wait for them."""
    import pulumi_gcp.projects as projects

    apis = [
        projects.Service(
            f"api-{service.split('.')[0]}",
            project=project,
            service=service,
            disable_on_destroy=False,
            disable_dependent_services=False,
        )
        for service in services
    ]
    return pulumi.ResourceOptions(depends_on=apis)


def build_dir() -> Path:
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured).resolve() if configured else REPO_ROOT / ".pulumi-build"


def stack_secrets(
    config: StackConfig, profile: NodeProfile, opts: pulumi.ResourceOptions | None = None, **args: Any
) -> StackSecrets:
    """The stack's secrets (``StackSecrets`` named ``secrets``): the configured Redis password, Grafana
    password, session-token keys, Hugging Face token and TURN secret (secret Outputs; None: generated or
    absent), for ``profile``; ``args``: the rest of ``StackSecretsArgs`` (``secret_manager_project``,
    ``labels``, ``node_files``)."""
    from infra.components.node_secrets import StackSecrets, StackSecretsArgs

    given = config.secrets
    return StackSecrets(
        "secrets",
        StackSecretsArgs(
            name_prefix=config.name_prefix,
            profile=profile,
            redis_password=secret(given.redis_password),
            grafana_admin_password=secret(given.grafana_admin_password),
            token_keys=secret(given.token_keys),
            hf_token=secret(given.hf_token),
            turn_secret=secret(given.turn_secret),
            turn_secret_previous=secret(given.turn_secret_previous),
            carrier_secrets={name: value.get_secret_value() for name, value in given.carrier_secrets.items()},
            alert_secrets={
                role: value
                for role in ("alert_email_password", "alert_pagerduty_routing_key")
                if (value := secret(getattr(given, role))) is not None
            },
            **args,
        ),
        opts=opts,
    )


NODE_NO_RECEIVER_WARNING = (
    "no alert receiver configured (duplexops:alertWebhookUrl, alertEmailTo/From/Smarthost, "
    "alertPagerdutyRoutingKey): the node's Alertmanager has nowhere to send its alerts, so they reach "
    "nobody; and a node that dies cannot report itself (docs/operations.md, 'Where alerts go (single nodes)')"
)
"""What a single node's ``up`` warns when the stack configures no alert receiver (issue 33: docs/deploying.md
promised the warning, and only multi-region gave it)."""


def warn_without_receiver(profile: NodeProfile) -> None:
    """Warn (``pulumi.log.warn``) that alerts reach nobody when ``profile.alerting`` has no receiver."""
    if not profile.alerting.any:
        pulumi.log.warn(NODE_NO_RECEIVER_WARNING)
