"""The Pulumi program: ``run(config)`` declares the stack's topology and returns its outputs.

Topologies (``duplexops:topology``):

- ``gce-node``: the Google APIs it needs, the runtime image built and pushed to Artifact Registry
  (``RuntimeImage``), the node's secrets in Secret Manager (``StackSecrets``), one GPU VM
  (``GceGpuNode``). Stacks ``dev`` (T4 on n1-standard-8, ``t4-int8``) and ``scale5-gcp`` (A100 80 GB on
  a2-ultragpu-1g, ``a100-80gb``, 5 sessions).
- ``onprem-node``: the node's secrets (``StackSecrets``, no cloud store) and an existing GPU host brought
  up over SSH (``OnPremNode``) running the configured digest-pinned ``runtimeImage``. Stack
  ``scale5-onprem``.
- ``multi-region``: the Google APIs, the runtime image (in the first region's Artifact Registry), the
  session-token keys and Grafana's password (``StackSecrets`` without node files), one VPC, then per region
  a GKE cluster with its GPU pool, Memorystore and model bucket (``GkeRegion``) and the runtime's
  Kubernetes objects on it (``RegionalRuntime`` of ``infra.k8s.region_objects``), and one global HTTPS
  load balancer over every region's pods (``GlobalEntry``). Stack ``multi-region``.

Outputs (never a secret value: passwords are named by where to read them):

- ``endpoint``: ``wss://<domain or IP>/api/chat``;
- ``grafana`` / ``prometheus``: the SSH tunnel command (IAP on GCE) and the local URL;
- ``ssh``: how to open a shell on the node;
- ``capacity``: sessions per node and the monthly cost from the capacity planner;
- ``image``: the digest-pinned image the node runs.

The multi-region stack exports ``endpoint`` (the global ``wss://`` endpoint), ``page`` (the browser
client), ``globalIp`` (for the
domain's A record), ``regions`` (per region: cluster, ``kubectl`` credentials command, slots, Grafana
port-forward), ``grafana``, ``capacity`` (slots per region and cost per month at the configured bounds),
``tokenKeys``, ``mintToken`` and ``image``.
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
from infra.node.services import public_origin, token_audience
from infra.node.webclient import WEB_DIR, page_headers, render_web
from infra.stack_config import RegionSettings, StackConfig

__all__ = ["BUILD_DIR_ENV", "GCP_APIS", "GKE_APIS", "capacity_summary", "region_capacity", "run"]

GKE_APIS = (
    "compute.googleapis.com",
    "container.googleapis.com",
    "redis.googleapis.com",
    "artifactregistry.googleapis.com",
    "iam.googleapis.com",
    "monitoring.googleapis.com",
    "logging.googleapis.com",
    "storage.googleapis.com",
    # Image streaming (the GPU pool's gcfs_config) needs the Container File System API.
    "containerfilesystem.googleapis.com",
)
"""Google APIs the multi-region stack needs (enabled, never disabled on destroy). Which resource needs
which API is ``infra.gcp_apis.required_apis``; the policy pack's ``apis-enabled-for-features`` checks
this list against the declared resources."""

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
    if config.topology == "multi-region":
        return _multi_region(config)
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


def _enable_apis(project: str, services: tuple[str, ...]) -> pulumi.ResourceOptions:
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


def _build_dir() -> Path:
    configured = os.environ.get(BUILD_DIR_ENV)
    return Path(configured).resolve() if configured else REPO_ROOT / ".pulumi-build"


# --- gce-node --------------------------------------------------------------------------------------------


def _gce_node(config: StackConfig) -> dict[str, Any]:

    from infra.components.gce_node import GceGpuNode, GceGpuNodeArgs
    from infra.components.image import RuntimeImage, RuntimeImageArgs
    from infra.components.node_secrets import StackSecrets, StackSecretsArgs

    gce = config.gce
    assert gce is not None
    prefix, profile, labels = config.name_prefix, config.profile, _labels(config)
    after_apis = _enable_apis(gce.project, GCP_APIS if gce.enable_apis else ())

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
            gce=gce,
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


# --- multi-region ----------------------------------------------------------------------------------------


def region_capacity(region: RegionSettings) -> dict[str, Any]:
    """Slots and on-demand cost of one region at its autoscaling bounds: one runtime pod per GPU node,
    ``profile.sessions`` slots per pod (the capacity planner's figure), the catalog's hourly price of the
    GPU machine type x 730 h per month (system pool, Memorystore, load balancer and egress not counted)."""
    sessions = region.profile.sessions
    summary: dict[str, Any] = {
        "gpu": region.profile.gpu,
        "machineType": region.machine_type,
        "slotsPerPod": sessions,
        "nodes": {"min": region.min_nodes, "max": region.max_nodes},
        "slots": {"min": sessions * region.min_nodes, "max": sessions * region.max_nodes},
        "serving": region.serving,
    }
    planned = capacity_summary(
        region.profile, machine_type=region.machine_type, nodes=max(1, region.max_nodes)
    )
    summary["plannerMaxSessionsPerPod"] = planned.get("planner_max_sessions")
    if region.usd_per_hour is not None:
        month = region.usd_per_hour * HOURS_PER_MONTH
        summary["usdPerMonth"] = {
            "min": round(month * region.min_nodes, 2),
            "max": round(month * region.max_nodes, 2),
        }
        summary["usdPerNodeHour"] = region.usd_per_hour
        summary["priceSource"] = region.price_source
    return summary


def _multi_region(config: StackConfig) -> dict[str, Any]:
    import pulumi_gcp.compute as compute

    from infra.components.gke_region import GkeRegion, GkeRegionArgs
    from infra.components.global_entry import GlobalEntry, GlobalEntryArgs, RegionBackend
    from infra.components.image import RuntimeImage, RuntimeImageArgs
    from infra.components.node_secrets import StackSecrets, StackSecretsArgs
    from infra.components.regional_runtime import RegionalRuntime
    from infra.k8s import workload as k8s

    mr = config.multi_region
    assert mr is not None and config.domain is not None
    prefix, labels, project = config.name_prefix, _labels(config), mr.project
    first = mr.regions[0]
    after_apis = _enable_apis(project, GKE_APIS if mr.enable_apis else ())
    image = RuntimeImage(
        "runtime-image",
        RuntimeImageArgs(project=project, location=first.region, repository_id=prefix, labels=labels),
        opts=after_apis,
    )
    secrets = StackSecrets(
        "secrets",
        StackSecretsArgs(
            name_prefix=prefix,
            profile=first.profile,
            grafana_admin_password=_secret(config.secrets.grafana_admin_password),
            token_keys=_secret(config.secrets.token_keys),
            hf_token=_secret(config.secrets.hf_token),
            node_files=False,
        ),
        opts=after_apis,
    )
    network = compute.Network(
        "network",
        name=prefix,
        project=project,
        auto_create_subnetworks=False,
        routing_mode="GLOBAL",
        description="duplexops multi-region: every region's GKE subnet",
        opts=after_apis,
    )

    # One capacity plan per region, shown per region and summed for the stack.
    capacities = {r.region: region_capacity(r) for r in mr.regions}
    regions_out: dict[str, Any] = {}
    backends: list[RegionBackend] = []
    for settings in mr.regions:
        region_name = settings.region
        gke = GkeRegion(
            f"region-{region_name}",
            GkeRegionArgs(
                name_prefix=prefix,
                project=project,
                settings=settings,
                network=network.id,
                admin_source_ranges=mr.admin_source_ranges,
                release_channel=mr.release_channel,
                deletion_protection=mr.deletion_protection,
                system_machine_type=mr.system_machine_type,
                image_repository=image.repository.name,
                image_repository_location=first.region,
                labels=labels,
            ),
            opts=after_apis,
        )
        bindings = gke.bind_workload_identity(project, k8s.WORKLOAD_IDENTITY_BINDINGS)
        workload = k8s.RegionWorkload(
            region=region_name,
            cluster_name=gke.cluster_name,
            project=project,
            profile=settings.profile,
            image=image.image_ref,
            accelerator=settings.accelerator_type,
            min_replicas=settings.min_nodes,
            max_replicas=settings.max_nodes,
            redis_host=gke.redis.host,
            redis_port=gke.redis.port,
            redis_password=pulumi.Output.secret(gke.redis.auth_string),
            redis_ca_certificate=gke.redis.server_ca_certs.apply(
                lambda certs: certs[0]["cert"] if certs else ""
            ),
            token_keys_json=secrets.token_keys,
            hf_token=secrets.hf_token,
            weights_bucket=gke.weights_bucket.name,
            runtime_service_account=gke.runtime_service_account.email,
            weights_service_account=gke.weights_service_account.email,
            monitoring_service_account=gke.monitoring_service_account.email,
            grafana_admin_password=secrets.grafana_admin_password,
            neg_name=f"{prefix}-runtime",
        )
        runtime = RegionalRuntime(
            f"runtime-{region_name}",
            k8s.region_objects(workload),
            provider=gke.provider,
            opts=pulumi.ResourceOptions(depends_on=[gke, *bindings]),
        )
        backends.append(
            RegionBackend(
                region=region_name,
                zones=settings.zones,
                neg_name=workload.neg_name,
                sessions_per_endpoint=settings.profile.sessions,
                serving=settings.serving,
                ready=[runtime],
            )
        )
        credentials = (
            f"gcloud container clusters get-credentials {gke.cluster_name} --region {region_name} "
            f"--project {project}"
        )
        regions_out[region_name] = {
            "cluster": gke.cluster_name,
            "kubectl": credentials,
            "grafana": k8s.grafana_port_forward(workload),
            "weightsBucket": gke.weights_bucket.name,
            "capacity": capacities[region_name],
        }

    profile = first.profile
    entry = GlobalEntry(
        "global-entry",
        GlobalEntryArgs(
            name_prefix=prefix,
            project=project,
            network=network.id,
            domain=config.domain,
            runtime_port=profile.ports.runtime,
            backends=backends,
            max_session_s=profile.limits.max_session_s,
            drain_s=k8s.drain_seconds(profile),
            public_source_ranges=mr.public_source_ranges,
            handshakes_per_minute=max(1, round(profile.limits.handshakes_per_second_per_client * 60)),
            page_files={path.removeprefix(f"{WEB_DIR}/"): content for path, content in render_web().items()},
            page_headers=page_headers(public_origin(profile)),
            page_location=first.region.upper(),
            labels=labels,
        ),
        opts=after_apis,
    )
    serving = [capacities[r.region] for r in mr.regions if r.serving]
    return {
        "endpoint": f"wss://{config.domain}/api/chat",
        "page": f"https://{config.domain}/",
        "globalIp": entry.address.address,
        "regions": regions_out,
        "grafana": {
            "user": "admin",
            "url": "http://localhost:3000",
            "tunnel": "see regions.<region>.grafana (kubectl port-forward after `kubectl` credentials)",
            "password": k8s.grafana_password_command(),
        },
        "tokenKeys": k8s.token_keys_command(),
        "mintToken": _mint_command(profile),
        "image": image.image_ref,
        "capacity": {
            "regions": capacities,
            "totalSlots": {
                "min": sum(c["slots"]["min"] for c in serving),
                "max": sum(c["slots"]["max"] for c in serving),
            },
            "usdPerMonth": {
                "min": round(sum(c.get("usdPerMonth", {}).get("min", 0.0) for c in capacities.values()), 2),
                "max": round(sum(c.get("usdPerMonth", {}).get("max", 0.0) for c in capacities.values()), 2),
            },
            "basis": f"GPU nodes only: on-demand list price x {HOURS_PER_MONTH:.0f} h per month; the system "
            "pool, Memorystore, the load balancer and egress are not counted (re-check before quoting)",
        },
    }
