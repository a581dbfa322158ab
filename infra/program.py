"""The Pulumi program: ``run(config)`` declares the stack's topology and returns its outputs.

Topologies (``duplexops:topology``):

- ``gce-node``: the Google APIs it needs, the runtime image built and pushed to Artifact Registry
  (``RuntimeImage``), the node's secrets in Secret Manager (``StackSecrets``), one GPU VM
  (``GceGpuNode``). Stacks ``dev`` (T4 on n1-standard-8, ``t4-int8``) and ``scale5-gcp`` (A100 80 GB on
  a2-ultragpu-1g, ``a100-80gb``, 5 sessions).
- ``onprem-node``: the node's secrets (``StackSecrets``, no cloud store) and an existing GPU host brought
  up over SSH (``OnPremNode``) running the configured digest-pinned ``runtimeImage``. Stack
  ``scale5-onprem``.

Outputs (never a secret value: passwords are named by where to read them):

- ``endpoint``: ``wss://<domain or IP>/api/chat``;
- ``grafana`` / ``prometheus``: the SSH tunnel command (IAP on GCE) and the local URL;
- ``ssh``: how to open a shell on the node;
- ``capacity``: sessions per node and the monthly cost from the capacity planner;
- ``image``: the digest-pinned image the node runs.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pulumi

from infra.capacity import plan
from infra.capacity.power import DEFAULT_USD_PER_KWH, HOURS_PER_MONTH
from infra.components._util import REPO_ROOT
from infra.node.profile import NodeProfile
from infra.node.services import token_audience
from infra.stack_config import StackConfig

__all__ = ["BUILD_DIR_ENV", "GCP_APIS", "capacity_summary", "run"]

GCP_APIS = (
    "compute.googleapis.com",
    "artifactregistry.googleapis.com",
    "secretmanager.googleapis.com",
    "iam.googleapis.com",
    "iap.googleapis.com",
)
"""Google APIs a GCE node needs (enabled, never disabled on destroy: other stacks may use them)."""

BUILD_DIR_ENV = "DUPLEXOPS_BUILD_DIR"
"""Environment variable naming the local build directory (default ``.pulumi-build`` at the repository
root, git-ignored): the on-premises bundle is written there for ``CopyToRemote``."""


def run(config: StackConfig) -> dict[str, Any]:
    """Declare the stack's resources; return its outputs (``{name: value or Output}``)."""
    if config.topology == "gce-node":
        return _gce_node(config)
    if config.topology == "onprem-node":
        return _onprem_node(config)
    raise AssertionError(f"topology {config.topology!r} passed validation but has no program")


# --- capacity --------------------------------------------------------------------------------------------


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


# --- helpers ---------------------------------------------------------------------------------------------


def _labels(config: StackConfig) -> dict[str, str]:
    stack = re.sub(r"[^a-z0-9_-]+", "-", config.stack.lower())[:63]
    return {"app": "duplexops", "stack": stack, "managed-by": "pulumi"}


def _mint_command(profile: NodeProfile) -> str:
    """How an operator mints a session token for this node, from the keys the ``tokenKeys`` output reads
    (saved as ``token_keys.json``); application backends call ``runtime.tokens.mint_token`` instead."""
    return (
        "duplex token mint --key-file token_keys.json --kid <kid in the file> "
        f"--audience {token_audience(profile)} --ttl-s 300 --persona any"
    )


def _endpoint(host: pulumi.Input[str], profile: NodeProfile) -> pulumi.Output[str]:
    port = "" if profile.ports.https == 443 else f":{profile.ports.https}"
    return pulumi.Output.from_input(host).apply(lambda h: f"wss://{h}{port}/api/chat")


def _secret(value: Any) -> pulumi.Output[str] | None:
    return None if value is None else pulumi.Output.secret(value.get_secret_value())


def _build_dir() -> Path:
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured).resolve() if configured else REPO_ROOT / ".pulumi-build"


# --- gce-node --------------------------------------------------------------------------------------------


def _gce_node(config: StackConfig) -> dict[str, Any]:
    import pulumi_gcp.projects as projects

    from infra.components.gce_node import GceGpuNode, GceGpuNodeArgs
    from infra.components.image import RuntimeImage, RuntimeImageArgs
    from infra.components.node_secrets import StackSecrets, StackSecretsArgs

    gce = config.gce
    assert gce is not None
    prefix, profile, labels = config.name_prefix, config.profile, _labels(config)
    apis: list[pulumi.Resource] = []
    if gce.enable_apis:
        for service in GCP_APIS:
            apis.append(
                projects.Service(
                    f"api-{service.split('.')[0]}",
                    project=gce.project,
                    service=service,
                    disable_on_destroy=False,
                    disable_dependent_services=False,
                )
            )
    after_apis = pulumi.ResourceOptions(depends_on=apis)

    image = RuntimeImage(
        "runtime-image",
        RuntimeImageArgs(project=gce.project, location=gce.region, repository_id=prefix, labels=labels),
        opts=after_apis,
    )
    secrets = StackSecrets(
        "secrets",
        StackSecretsArgs(
            name_prefix=prefix,
            profile=profile,
            redis_password=_secret(config.secrets.redis_password),
            grafana_admin_password=_secret(config.secrets.grafana_admin_password),
            token_keys=_secret(config.secrets.token_keys),
            hf_token=_secret(config.secrets.hf_token),
            secret_manager_project=gce.project,
            labels=labels,
        ),
        opts=after_apis,
    )
    node = GceGpuNode(
        "node",
        GceGpuNodeArgs(
            name_prefix=prefix,
            project=gce.project,
            region=gce.region,
            zone=gce.zone,
            machine_type=gce.machine_type,
            accelerator_type=gce.accelerator_type,
            accelerator_count=gce.accelerator_count,
            boot_disk_gb=gce.boot_disk_gb,
            boot_disk_type=gce.boot_disk_type,
            public_source_ranges=gce.public_source_ranges,
            subnet_cidr=gce.subnet_cidr,
            profile=profile,
            image_ref=image.image_ref,
            image_repository=image.repository,
            secret_ids=secrets.secret_ids,
            secrets=secrets.secrets,
            boot_after=secrets.versions,
            labels=labels,
        ),
        opts=after_apis,
    )
    local = profile.private_address
    password_id = secrets.secret_ids["grafana_admin_password"]
    read_password = f"gcloud secrets versions access latest --secret={password_id} --project={gce.project}"
    return {
        "endpoint": _endpoint(config.domain or node.external_ip, profile),
        "externalIp": node.external_ip,
        "grafana": {
            "url": "http://localhost:3000",
            "tunnel": node.tunnel_command(3000, f"{local}:{profile.ports.grafana}"),
            "user": "admin",
            "password": read_password,
        },
        "prometheus": {
            "url": "http://localhost:9090",
            "tunnel": node.tunnel_command(9090, f"{local}:{profile.ports.prometheus}"),
        },
        # The application backend mints session tokens with these keys (never an output themselves).
        "tokenKeys": "gcloud secrets versions access latest "
        f"--secret={secrets.secret_ids['token_keys']} --project={gce.project}",
        "mintToken": _mint_command(profile),
        "ssh": node.ssh_command(),
        "capacity": capacity_summary(profile, machine_type=gce.machine_type),
        "image": image.image_ref,
        "node": {
            "topology": config.topology,
            "profile": profile.name,
            "instance": node.instance_name,
            "zone": gce.zone,
            "machineType": gce.machine_type,
            "serviceAccount": node.service_account.email,
            "secretIds": dict(secrets.secret_ids),
        },
    }


# --- onprem-node -----------------------------------------------------------------------------------------


def _onprem_node(config: StackConfig) -> dict[str, Any]:
    from infra.components.node_secrets import StackSecrets, StackSecretsArgs
    from infra.components.onprem_node import OnPremNode, OnPremNodeArgs

    onprem = config.onprem
    assert onprem is not None
    profile = config.node_profile(onprem.runtime_image)
    secrets = StackSecrets(
        "secrets",
        StackSecretsArgs(
            name_prefix=config.name_prefix,
            profile=profile,
            redis_password=_secret(config.secrets.redis_password),
            grafana_admin_password=_secret(config.secrets.grafana_admin_password),
            token_keys=_secret(config.secrets.token_keys),
            hf_token=_secret(config.secrets.hf_token),
        ),
    )
    node = OnPremNode(
        "node",
        OnPremNodeArgs(
            host=onprem.host,
            port=onprem.port,
            user=onprem.user,
            private_key=pulumi.Output.secret(onprem.ssh_private_key.get_secret_value()),
            host_key=onprem.host_key,
            install_dir=onprem.install_dir,
            profile=profile,
            secret_files=secrets.files,
            local_bundle_dir=str(_build_dir() / config.stack / "bundle"),
            ready_timeout_s=onprem.ready_timeout_s,
        ),
    )
    port = "" if onprem.port == 22 else f" -p {onprem.port}"
    ssh = f"ssh{port} {onprem.user}@{onprem.host}"
    sudo = "" if onprem.user == "root" else "sudo "
    local = profile.private_address
    return {
        "endpoint": _endpoint(config.domain or onprem.host, profile),
        "grafana": {
            "url": "http://localhost:3000",
            "tunnel": f"ssh{port} -N -L 3000:{local}:{profile.ports.grafana} {onprem.user}@{onprem.host}",
            "user": "admin",
            "password": f"{ssh} {sudo}cat {onprem.install_dir}/secrets/grafana_admin_password",
        },
        "prometheus": {
            "url": "http://localhost:9090",
            "tunnel": f"ssh{port} -N -L 9090:{local}:{profile.ports.prometheus} {onprem.user}@{onprem.host}",
        },
        "tokenKeys": f"{ssh} {sudo}cat {onprem.install_dir}/secrets/token_keys.json",
        "mintToken": _mint_command(profile),
        "ssh": ssh,
        "capacity": capacity_summary(profile, machine_type=None),
        "image": onprem.runtime_image,
        "node": {
            "topology": config.topology,
            "profile": profile.name,
            "host": onprem.host,
            "installDir": onprem.install_dir,
            "bundleSha256": node.bundle_sha256,
        },
    }
