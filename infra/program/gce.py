"""Topology ``gce-node``: the Google APIs, the runtime image built and pushed to Artifact Registry
(``RuntimeImage``), the node's secrets in Secret Manager, one GPU VM (``GceGpuNode``). Stacks ``dev`` and
``scale5-gcp``; docs/deploying.md, "Stack dev" and "Stack scale5-gcp".
"""

from __future__ import annotations

from typing import Any

from infra.program.shared import capacity_summary, enable_apis, endpoint, labels, mint_command, stack_secrets
from infra.stack_config import StackConfig

__all__ = ["GCP_APIS", "declare"]

GCP_APIS = (
    "compute.googleapis.com",
    "artifactregistry.googleapis.com",
    "secretmanager.googleapis.com",
    "iam.googleapis.com",
    "iap.googleapis.com",
)
"""Google APIs a GCE node needs (enabled, never disabled on destroy: other stacks may use them)."""


def declare(config: StackConfig) -> dict[str, Any]:
    """Declare a ``gce-node`` stack; return its outputs."""
    from infra.components.gce_node import GceGpuNode, GceGpuNodeArgs
    from infra.components.image import RuntimeImage, RuntimeImageArgs

    gce = config.gce
    assert gce is not None
    prefix, profile, stack_labels = config.name_prefix, config.profile, labels(config)
    after_apis = enable_apis(gce.project, GCP_APIS if gce.enable_apis else ())

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
            secret_ids=secrets.secret_ids,
            secrets=secrets.secrets,
            boot_after=secrets.versions,
            labels=stack_labels,
        ),
        opts=after_apis,
    )
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
