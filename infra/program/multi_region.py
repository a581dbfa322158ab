"""Topology ``multi-region``: the Google APIs, the runtime image (built, or promoted from CI's build, into
the first region's Artifact Registry repository, then copied with its digest into a repository of each
other region: ``region_registry``, ``infra.components.image.promote``), the session-token keys and
Grafana's password, one VPC, then per region a GKE cluster with its GPU pool, Memorystore and model bucket
(``GkeRegion``) and the runtime's Kubernetes objects on it (``RegionalRuntime`` of
``infra.k8s.region.region_objects``, GMP's managed Alertmanager configured with the stack's alert receivers
among them: ``infra.k8s.alerting``), and one global HTTPS load balancer over every region's pods
(``GlobalEntry``). Stack ``multi-region``; docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra.capacity.power import HOURS_PER_MONTH
from infra.node.bundle.services import public_origin
from infra.node.bundle.webclient import page_headers
from infra.program.dns import a_records, records_summary, turn_address
from infra.program.shared import (
    capacity_summary,
    enable_apis,
    labels,
    mint_command,
    secret,
    stack_secrets,
)
from infra.stack_config import RegionSettings, StackConfig

__all__ = [
    "GKE_APIS",
    "NO_RECEIVER_WARNING",
    "alert_secrets",
    "declare",
    "region_capacity",
    "region_registry",
]

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


NO_RECEIVER_WARNING = (
    "no alert receiver configured (duplexops:alertWebhookUrl, alertEmailTo/From/Smarthost, "
    "alertPagerdutyRoutingKey): the clusters' alerts (ClusterRules on Managed Prometheus) reach nobody; "
    "GMP's managed Alertmanager keeps its no-op configuration"
)
"""What ``up`` warns when the stack configures no alert receiver (``infra.k8s.alerting``)."""


def alert_secrets(config: StackConfig) -> pulumi.Output[dict[str, str]]:
    """The alert receivers' secrets of the stack's configuration, ``{role of OPTIONAL_SECRET_FILES:
    value}`` (only those set), as one secret Output: GMP's managed Alertmanager reads its configuration
    only, so they go into it (``infra.k8s.alerting``), and that text, webhook URL included, stays secret
    even when no secret is set."""
    given = config.secrets
    values = {
        role: value
        for role in ("alert_email_password", "alert_pagerduty_routing_key")
        if (value := secret(getattr(given, role))) is not None
    }
    return pulumi.Output.secret(pulumi.Output.all(**values))


def region_registry(project: str, region: str, repository_id: str) -> str:
    """The Docker registry path of a region's Artifact Registry repository:
    ``<region>-docker.pkg.dev/<project>/<repository>`` (the ``registries`` output: where each region's
    nodes pull the image's digest)."""
    return f"{region}-docker.pkg.dev/{project}/{repository_id}"


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


def declare(config: StackConfig) -> dict[str, Any]:
    """Declare a ``multi-region`` stack; return its outputs."""
    import pulumi_gcp.compute as compute

    from infra.components.global_entry import GlobalEntry, GlobalEntryArgs
    from infra.components.image import RuntimeImage, RuntimeImageArgs, promote
    from infra.k8s import region as k8s_region
    from infra.k8s.page import PAGE_HEALTH_PATH, PAGE_PORT
    from infra.k8s.resume_router import ROUTER_HEALTH_PATH, ROUTER_PORT
    from infra.k8s.workload import drain_seconds

    mr = config.multi_region
    assert mr is not None and config.domain is not None
    prefix, stack_labels, project = config.name_prefix, labels(config), mr.project
    first = mr.regions[0]
    apis = GKE_APIS + (("dns.googleapis.com",) if mr.dns_zone is not None else ())
    after_apis = enable_apis(project, apis if mr.enable_apis else ())
    image_args = RuntimeImageArgs(
        project=project,
        location=first.region,
        repository_id=prefix,
        labels=stack_labels,
        source=config.runtime_image,
    )
    image = RuntimeImage("runtime-image", image_args, opts=after_apis)
    secrets = stack_secrets(config, first.profile, after_apis, node_files=False)
    if not first.profile.alerting.any:
        pulumi.log.warn(NO_RECEIVER_WARNING)
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
    backends = []
    registries: dict[str, str] = {}
    for settings in mr.regions:
        registries[settings.region] = region_registry(project, settings.region, prefix)
        if settings is first:
            repository, region_ref = image.repository, image.image_ref
        else:
            repository = _registry(config, settings, after_apis)
            # The same digest copied into the region's repository; the reference resolves once it is there.
            _, region_ref = promote(
                f"region-{settings.region}-promote",
                image.image_ref,
                f"{registries[settings.region]}/{image_args.image_name}",
                image_args.tag,
                pulumi.ResourceOptions.merge(after_apis, pulumi.ResourceOptions(depends_on=[repository])),
            )
        backend, regions_out[settings.region] = _region(
            config,
            settings,
            repository,
            region_ref,
            secrets,
            network.id,
            after_apis,
            capacities[settings.region],
        )
        backends.append(backend)

    profile = first.profile
    entry = GlobalEntry(
        "global-entry",
        GlobalEntryArgs(
            name_prefix=prefix,
            project=project,
            network=network.id,
            domain=config.domain,
            runtime_port=profile.ports.runtime,
            page_port=PAGE_PORT,
            page_health_path=PAGE_HEALTH_PATH,
            backends=backends,
            max_session_s=profile.limits.max_session_s,
            drain_s=drain_seconds(profile),
            public_source_ranges=mr.public_source_ranges,
            handshakes_per_minute=max(1, round(profile.limits.handshakes_per_second_per_client * 60)),
            page_headers=page_headers(public_origin(profile)),
            labels=stack_labels,
            protect=mr.deletion_protection,
            resume_router_port=ROUTER_PORT,
            resume_router_health_path=ROUTER_HEALTH_PATH,
        ),
        opts=after_apis,
    )
    records: dict[str, Any] = {config.domain: entry.address.address}
    records |= {turn["host"]: turn["address"] for out in regions_out.values() if (turn := out.get("turn"))}
    if mr.dns_zone is not None:
        a_records(project, mr.dns_zone, records, after_apis)
    return {
        "endpoint": f"wss://{config.domain}/api/chat",
        "page": f"https://{config.domain}/",
        "globalIp": entry.address.address,
        "regions": regions_out,
        "grafana": {
            "user": "admin",
            "url": "http://localhost:3000",
            "tunnel": "see regions.<region>.grafana (kubectl port-forward after `kubectl` credentials)",
            "password": k8s_region.grafana_password_command(),
        },
        "tokenKeys": k8s_region.token_keys_command(),
        "mintToken": mint_command(profile),
        "image": image.image_ref,
        "registries": registries,
        "capacity": _capacity_total(config, capacities),
        "dns": records_summary(mr.dns_zone, records),
    }


def _registry(config: StackConfig, settings: RegionSettings, after_apis: pulumi.ResourceOptions) -> Any:
    """A region's own Docker repository in Artifact Registry (same id as the first region's, in its
    region), ``protect``ed with the stack's stateful resources; the program copies the image's digest into
    it (``promote``), and the region's nodes pull from it."""
    import pulumi_gcp.artifactregistry as artifactregistry

    mr = config.multi_region
    assert mr is not None
    return artifactregistry.Repository(
        f"region-{settings.region}-registry",
        project=mr.project,
        location=settings.region,
        repository_id=config.name_prefix,
        format="DOCKER",
        description="duplexops runtime images (the digest the stack built, promoted here; nodes pull it)",
        labels=labels(config),
        opts=pulumi.ResourceOptions.merge(after_apis, pulumi.ResourceOptions(protect=mr.deletion_protection)),
    )


def _region(
    config: StackConfig,
    settings: RegionSettings,
    repository: Any,
    image_ref: Any,
    secrets: Any,
    network: pulumi.Input[str],
    after_apis: pulumi.ResourceOptions,
    capacity: dict[str, Any],
) -> tuple[Any, dict[str, Any]]:
    """One region: its ``GkeRegion``, the Workload Identity bindings, the runtime's Kubernetes objects
    (``RegionalRuntime``, with the TURN gateway of ``infra.k8s.turn``, whose only peers are the region's own
    pods: adding a region changes none of the others); returns the region's backend for the global entry and
    its outputs."""
    from infra.components.gke_region import GkeRegion, GkeRegionArgs, ca_bundle
    from infra.components.global_entry import RegionBackend
    from infra.components.regional_runtime import RegionalRuntime
    from infra.k8s import region as k8s_region
    from infra.k8s.base import RegionWorkload

    mr = config.multi_region
    assert mr is not None
    prefix, project, region_name = config.name_prefix, mr.project, settings.region
    gke = GkeRegion(
        f"region-{region_name}",
        GkeRegionArgs(
            name_prefix=prefix,
            project=project,
            settings=settings,
            network=network,
            admin_source_ranges=mr.admin_source_ranges,
            release_channel=mr.release_channel,
            deletion_protection=mr.deletion_protection,
            maintenance_window=mr.maintenance_window,
            system_machine_type=mr.system_machine_type,
            image_repository=repository.name,
            image_repository_location=region_name,
            labels=labels(config),
            recording_retention_days=mr.recordings.retention_days if mr.recordings.enabled else None,
        ),
        opts=after_apis,
    )
    recordings = gke.recordings_bucket
    bindings = gke.bind_workload_identity(project, k8s_region.workload_identity_bindings())
    address = None  # the region's TURN address (infra.program.dns), reserved where it runs a relay
    if secrets.turn_secret is not None:
        protect = pulumi.ResourceOptions(protect=mr.deletion_protection)
        name = f"region-{region_name}-turn-address"
        address = turn_address(
            name, project, region_name, labels(config), pulumi.ResourceOptions.merge(after_apis, protect)
        )
    workload = RegionWorkload(
        region=region_name,
        zones=tuple(settings.zones),
        cluster_name=gke.cluster_name,
        project=project,
        profile=settings.profile,
        image=image_ref,
        accelerator=settings.accelerator_type,
        min_replicas=settings.min_nodes,
        max_replicas=settings.max_nodes,
        redis_host=gke.redis.host,
        redis_port=gke.redis.port,
        redis_password=pulumi.Output.secret(gke.redis.auth_string),
        redis_ca_certificate=gke.redis.server_ca_certs.apply(ca_bundle),
        token_keys_json=secrets.token_keys,
        app_token_keys_json=secrets.app_token_keys,
        hf_token=secrets.hf_token,
        carrier_secrets=dict(secrets.carrier_secrets),
        weights_bucket=gke.weights_bucket.name,
        runtime_service_account=gke.runtime_service_account.email,
        weights_service_account=gke.weights_service_account.email,
        monitoring_service_account=gke.monitoring_service_account.email,
        grafana_admin_password=secrets.grafana_admin_password,
        alert_secrets=alert_secrets(config),
        neg_name=f"{prefix}-runtime",
        page_neg_name=f"{prefix}-page",
        resume_router_neg_name=f"{prefix}-resume",  # issue 33: resumes reach their pod
        turn_secret=secrets.turn_secret,
        turn_secret_previous=secrets.turn_secret_previous,
        turn_peer_ranges=(settings.pods_cidr,),
        turn_source_ranges=tuple(mr.public_source_ranges),
        recordings_bucket=None if recordings is None else recordings.name,
        turn_address=None if address is None else address.address,  # type: ignore[attr-defined]
        turn_tls_secret=mr.turn_tls_secret,
        waiting_room_s=mr.waiting_room_s,
        waiting_room_size=mr.waiting_room_size,
    )
    runtime = RegionalRuntime(
        f"runtime-{region_name}",
        k8s_region.region_objects(workload),
        provider=gke.provider,
        opts=pulumi.ResourceOptions(depends_on=[gke, *bindings]),
    )
    backend = RegionBackend(
        region=region_name,
        zones=settings.zones,
        neg_name=workload.neg_name,
        page_neg_name=workload.page_neg_name,
        resume_router_neg_name=workload.resume_router_neg_name,
        sessions_per_endpoint=settings.profile.sessions,
        serving=settings.serving,
        ready=[runtime],
    )
    credentials = (
        f"gcloud container clusters get-credentials {gke.cluster_name} --region {region_name} "
        f"--project {project}"
    )
    return backend, {
        "cluster": gke.cluster_name,
        "kubectl": credentials,
        "grafana": k8s_region.grafana_port_forward(workload),
        "weightsBucket": gke.weights_bucket.name,
        **({} if recordings is None else {"recordingsBucket": recordings.name}),
        "image": image_ref,
        "capacity": capacity,
        **({} if address is None else {"turn": _turn_output(workload, address)}),
    }


def _turn_output(workload: Any, address: Any) -> dict[str, Any]:
    """A region's ``turn`` output: its TURN name, reserved address and the URLs its runtime gives callers
    (``turns:`` only with ``turnTlsSecret``)."""
    from infra.k8s.turn import turn_env, turn_host

    urls = next(e["value"] for e in turn_env(workload) if e["name"] == "DUPLEX_TURN_URLS")
    return {
        "host": turn_host(workload),
        "address": address.address,
        "urls": urls.split(","),
        "tls": workload.turn_tls_secret is not None,
    }


def _capacity_total(config: StackConfig, capacities: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``capacity`` output: every region's, the slots of the serving regions summed, the monthly cost of
    the GPU nodes at the autoscaling bounds summed."""
    mr = config.multi_region
    assert mr is not None
    serving = [capacities[r.region] for r in mr.regions if r.serving]
    return {
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
    }
