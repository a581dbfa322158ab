"""Topology ``onprem-node``: the node's secrets (no cloud store) and an existing GPU host brought up over
SSH (``OnPremNode``) running the configured digest-pinned ``runtimeImage``. Stack ``scale5-onprem``;
docs/deploying.md, "Stack scale5-onprem".
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra.program.shared import (
    build_dir,
    capacity_summary,
    enable_apis,
    endpoint,
    mint_command,
    stack_secrets,
    turn_summary,
    warn_without_receiver,
)
from infra.stack_config import StackConfig

__all__ = ["PULLER_ACCOUNT_ID", "PULLER_APIS", "declare"]

PULLER_APIS = ("artifactregistry.googleapis.com", "iam.googleapis.com", "iamcredentials.googleapis.com")
"""APIs of the image puller in the registry's project: the repository's IAM and the account (the
bootstrap's), and the short-lived token the stack mints (``iamcredentials generateAccessToken``)."""

MINT_APIS = ("iamcredentials.googleapis.com",)
"""What the stack itself calls in the registry's project: it mints the puller's token, nothing else."""

PULLER_ACCOUNT_ID = "duplex-puller"
"""The read-only image puller account the bootstrap creates in its project (reader on the build
repository; the deployer may mint its tokens): the on-premises stacks pull with its tokens."""


def declare(config: StackConfig) -> dict[str, Any]:
    """Declare an ``onprem-node`` stack; return its outputs."""
    from infra.components.onprem_node import (
        OnPremNode,
        OnPremNodeArgs,
        RegistryPuller,
        artifact_registry_repository,
    )

    onprem = config.onprem
    assert onprem is not None
    profile = config.node_profile(onprem.runtime_image)
    warn_without_receiver(profile)
    secrets = stack_secrets(config, profile)
    # An Artifact Registry image (the GCE stacks' repository, where CI promotes the digest) is pulled with a
    # token of this deploy; any other registry with what the host has (docs/deploying.md).
    puller = None
    if artifact_registry_repository(onprem.runtime_image) is not None:
        project = onprem.runtime_image.split("/")[1]
        puller = RegistryPuller(
            "image-puller",
            onprem.runtime_image,
            account_id=PULLER_ACCOUNT_ID,
            opts=enable_apis(project, MINT_APIS),
        )
    files = secrets.files
    assert files is not None, "stack_secrets makes the node's secret files unless told node_files=False"
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
            secret_files=files,
            local_bundle_dir=str(build_dir() / config.stack / "bundle"),
            ready_timeout_s=onprem.ready_timeout_s,
            registry=None if puller is None else puller.registry,
            registry_token=None if puller is None else puller.token,
        ),
    )
    port = "" if onprem.port == 22 else f" -p {onprem.port}"
    ssh = f"ssh{port} {onprem.user}@{onprem.host}"
    sudo = "" if onprem.user == "root" else "sudo "
    local = profile.private_address
    return {
        "endpoint": endpoint(config.domain or onprem.host, profile),
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
        "mintToken": mint_command(profile),
        "turn": turn_summary(config, profile),
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
