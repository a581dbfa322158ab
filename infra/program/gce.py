"""Topology ``gce-node``: the Google APIs, the runtime image built and pushed to Artifact Registry
(``RuntimeImage``), the node's secrets in Secret Manager, one GPU VM (``GceGpuNode``). Stacks ``dev`` and
``scale5-gcp``; docs/deploying.md, "Stack dev" and "Stack scale5-gcp".
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra.node.bundle.cloud_init import GUEST_ATTRIBUTE_TLS_SHA256
from infra.program.dns import a_records, records_summary
from infra.program.shared import (
    capacity_summary,
    enable_apis,
    endpoint,
    labels,
    mint_command,
    stack_secrets,
    turn_summary,
    warn_without_receiver,
)
from infra.stack_config import StackConfig

__all__ = ["GCP_APIS", "declare"]

GCP_APIS = (
    "compute.googleapis.com",
    "artifactregistry.googleapis.com",
    "secretmanager.googleapis.com",
    "iam.googleapis.com",
    "iap.googleapis.com",
    "monitoring.googleapis.com",
)
"""Google APIs a GCE node needs (enabled, never disabled on destroy: other stacks may use them)."""

SPOT_APIS = ("cloudscheduler.googleapis.com",)
"""More APIs a Spot node needs: Cloud Scheduler starts it again after a preemption."""


def declare(config: StackConfig) -> dict[str, Any]:
    """Declare a ``gce-node`` stack; return its outputs."""
    from infra.components.gce_node import GceGpuNode, GceGpuNodeArgs
    from infra.components.image import RuntimeImage, RuntimeImageArgs
    from infra.components.node_uptime import NodeUptimeCheck, NodeUptimeCheckArgs

    gce = config.gce
    assert gce is not None
    prefix, profile, stack_labels = config.name_prefix, config.profile, labels(config)
    apis = GCP_APIS + (SPOT_APIS if gce.provisioning_model == "spot" else ())
    apis += ("dns.googleapis.com",) if gce.dns_zone is not None else ()
    after_apis = enable_apis(gce.project, apis if gce.enable_apis else ())
    warn_without_receiver(profile)
    if gce.provisioning_model == "flex-start":
        pulumi.log.warn(
            "flex-start: GCE deletes the VM after 7 days (its data disk stays); Pulumi notices only on a "
            "refresh: deploy with `pulumi up --refresh` so that the next up creates it again"
        )

    image = RuntimeImage(
        "runtime-image",
        RuntimeImageArgs(
            project=gce.project,
            location=gce.region,
            repository_id=prefix,
            labels=stack_labels,
            source=config.runtime_image,
        ),
        opts=after_apis,
    )
    secrets = stack_secrets(
        config, profile, after_apis, secret_manager_project=gce.project, labels=stack_labels
    )
    node = GceGpuNode(
        "node",
        GceGpuNodeArgs(
            name_prefix=prefix,
            gce=gce,
            profile=profile,
            image_ref=image.image_ref,
            image_repository=image.repository,
            image_repository_path=image.repository_path,
            secret_ids=secrets.secret_ids,
            secrets=secrets.secrets,
            boot_after=secrets.versions,
            labels=stack_labels,
        ),
        opts=after_apis,
    )
    # Seen from outside: the node's own Prometheus cannot report its death (docs/deploying.md).
    uptime = NodeUptimeCheck(
        "node-uptime",
        NodeUptimeCheckArgs(
            name_prefix=prefix,
            project=gce.project,
            host=config.domain if config.domain is not None else node.external_ip,
            profile=profile,
        ),
        opts=after_apis,
    )
    # Certificates (docs/deploying.md, "Certificates on a single node"): say so when the node cannot have
    # a real one, and how to read the self-signed one's fingerprint (published by the VM at each start).
    fingerprint = (
        f"gcloud compute instances get-guest-attributes {node.instance_name} --project {gce.project} "
        f"--zone {gce.zone} --query-path={GUEST_ATTRIBUTE_TLS_SHA256} --format='value(value)'"
    )
    if profile.tls.mode != "acme":
        pulumi.log.warn(
            "no duplexops:domain and duplexops:acmeEmail: the node serves a self-signed certificate, which "
            f"browsers refuse for wss://; read its SHA-256 fingerprint with: {fingerprint}"
        )
    # The node's one public name (nginx and coturn share it): its A record, made here with a zone.
    records: dict[str, Any] = {} if config.domain is None else {config.domain: node.external_ip}
    if gce.dns_zone is not None:
        a_records(gce.project, gce.dns_zone, records, after_apis)
    local = profile.private_address
    password_id = secrets.secret_ids["grafana_admin_password"]
    read_password = f"gcloud secrets versions access latest --secret={password_id} --project={gce.project}"
    return {
        "endpoint": endpoint(config.domain or node.external_ip, profile),
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
        "mintToken": mint_command(profile),
        "turn": turn_summary(config, profile),
        "dns": records_summary(gce.dns_zone, records),
        "ssh": node.ssh_command(),
        "uptimeCheck": uptime.check.uptime_check_id,
        "capacity": capacity_summary(profile, machine_type=gce.machine_type),
        "image": image.image_ref,
        "certificate": (
            f"ACME ({profile.tls.acme_directory}) for {profile.domain}, renewed on the VM"
            if profile.tls.mode == "acme"
            else f"self-signed; its SHA-256 fingerprint: {fingerprint}"
        ),
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
