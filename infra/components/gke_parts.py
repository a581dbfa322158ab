"""The parts ``GkeRegion`` is made of, one small component each: the region's network (``RegionNetwork``),
its service accounts (``RegionAccounts``), the cluster (``RegionCluster``), the node pools
(``RegionNodePools``), Memorystore (``RegionRedis``) and the model bucket (``RegionModelBucket``).

Their resources were declared straight under ``GkeRegion`` before these parts existed: each carries an
alias to that parent (``moved_from``), so an existing stack keeps every cloud resource (same URN as
before, no replacement). docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pulumi
import pulumi_gcp.artifactregistry as artifactregistry
import pulumi_gcp.compute as compute
import pulumi_gcp.container as container
import pulumi_gcp.projects as projects
import pulumi_gcp.redis as redis
import pulumi_gcp.serviceaccount as serviceaccount
import pulumi_gcp.storage as storage

from infra.components._util import COMPONENT_PACKAGE, child_options
from infra.names import GPU_TAINT
from infra.stack_config import RegionSettings

__all__ = [
    "GPU_NODE_PROJECT_ROLES",
    "SCOPES",
    "RegionAccounts",
    "RegionCluster",
    "RegionModelBucket",
    "RegionNetwork",
    "RegionNodePools",
    "RegionRedis",
    "moved_from",
]

GPU_NODE_PROJECT_ROLES = (
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/autoscaling.metricsWriter",
)
"""Project roles of the nodes' service account: GKE's documented minimum for a node service account
(cloud.google.com/kubernetes-engine/docs/how-to/hardening-your-cluster, "least privilege")."""

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)


def moved_from(region: pulumi.Resource) -> list[pulumi.Alias]:
    """Aliases of a resource that was declared with ``region`` as its parent, under the same name and type:
    Pulumi then finds its state under the old URN and neither creates nor deletes it."""
    return [pulumi.Alias(parent=region)]


class _Part(pulumi.ComponentResource):
    """A part of ``region`` (a ``GkeRegion``): parented to it; its children alias their old URNs."""

    def __init__(self, kind: str, name: str, region: pulumi.Resource, deps: Sequence[pulumi.Resource]):
        super().__init__(f"{COMPONENT_PACKAGE}:{kind}", name, None, pulumi.ResourceOptions(parent=region))
        self._region = region
        self._deps = list(deps)

    def child(self, **kwargs: Any) -> pulumi.ResourceOptions:
        """Options of a child: parented here, waiting for the region's dependencies, aliased to its URN
        under the region."""
        return child_options(self, self._deps, aliases=moved_from(self._region), **kwargs)


class RegionNetwork(_Part):
    """The region's subnet in the stack's VPC (nodes' primary range; secondary ranges ``pods`` and
    ``services``: VPC-native, so the load balancer's NEG endpoints are pod IPs), a Cloud Router and Cloud
    NAT (private nodes reach Hugging Face and registries outbound only)."""

    subnet: compute.Subnetwork

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        resource_name: str,
        project: str,
        settings: RegionSettings,
        network: pulumi.Input[str],
    ):
        super().__init__("RegionNetwork", name, region, deps)
        s = settings
        self.subnet = compute.Subnetwork(
            f"{prefix}-subnet",
            name=resource_name,
            project=project,
            region=s.region,
            network=network,
            ip_cidr_range=s.subnet_cidr,
            secondary_ip_ranges=[
                {"range_name": "pods", "ip_cidr_range": s.pods_cidr},
                {"range_name": "services", "ip_cidr_range": s.services_cidr},
            ],
            private_ip_google_access=True,
            opts=self.child(),
        )
        router = compute.Router(
            f"{prefix}-router",
            name=resource_name,
            project=project,
            region=s.region,
            network=network,
            opts=self.child(),
        )
        compute.RouterNat(
            f"{prefix}-nat",
            name=resource_name,
            project=project,
            region=s.region,
            router=router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
            log_config={"enable": True, "filter": "ERRORS_ONLY"},
            opts=self.child(),
        )
        self.register_outputs({"subnet": self.subnet.id})


class RegionAccounts(_Part):
    """Service accounts with the least they need: the nodes' (logs, metrics, image pull from the stack's
    repository), the runtime's and the weights writer's (the model bucket grants them access), the
    monitoring one's (read metrics for the query frontend and the custom metrics adapter)."""

    node: serviceaccount.Account
    runtime: serviceaccount.Account
    weights: serviceaccount.Account
    monitoring: serviceaccount.Account

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        name_prefix: str,
        project: str,
        settings: RegionSettings,
        image_repository: pulumi.Input[str],
        image_repository_location: str,
    ):
        super().__init__("RegionAccounts", name, region, deps)
        suffix = f"{settings.network_index}"

        def account(role: str, account_id: str) -> serviceaccount.Account:
            return serviceaccount.Account(
                f"{prefix}-{role}-sa",
                account_id=account_id,
                project=project,
                display_name=f"duplexops {role} ({settings.region})",
                opts=self.child(),
            )

        self.node = account("node", f"{name_prefix}-node-{suffix}")
        for role in GPU_NODE_PROJECT_ROLES:
            projects.IAMMember(
                f"{prefix}-node-{role.split('/')[-1]}",
                project=project,
                role=role,
                member=self.node.member,
                opts=self.child(),
            )
        artifactregistry.RepositoryIamMember(
            f"{prefix}-node-image-reader",
            project=project,
            location=image_repository_location,
            repository=image_repository,
            role="roles/artifactregistry.reader",
            member=self.node.member,
            opts=self.child(),
        )
        self.runtime = account("runtime", f"{name_prefix}-rt-{suffix}")
        self.weights = account("weights", f"{name_prefix}-wt-{suffix}")
        self.monitoring = account("monitoring", f"{name_prefix}-mon-{suffix}")
        projects.IAMMember(
            f"{prefix}-monitoring-viewer",
            project=project,
            role="roles/monitoring.viewer",
            member=self.monitoring.member,
            opts=self.child(),
        )
        self.register_outputs({"node": self.node.email})


class RegionCluster(_Part):
    """A regional GKE cluster (control plane in three zones): private nodes, a public control-plane endpoint
    reachable only from ``admin_source_ranges``, Workload Identity, the configured release channel, Gateway
    API (standard channel), Google Managed Prometheus with GKE's managed DCGM exporter (GPU metrics), the
    Cloud Storage FUSE CSI driver (the model cache), the default pool removed."""

    cluster: container.Cluster

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        resource_name: str,
        project: str,
        settings: RegionSettings,
        network: pulumi.Input[str],
        subnet: pulumi.Input[str],
        admin_source_ranges: Sequence[str],
        release_channel: str,
        deletion_protection: bool,
        labels: Mapping[str, str],
    ):
        super().__init__("RegionCluster", name, region, deps)
        self.cluster = container.Cluster(
            f"{prefix}-cluster",
            name=resource_name,
            project=project,
            location=settings.region,
            network=network,
            subnetwork=subnet,
            remove_default_node_pool=True,
            initial_node_count=1,
            deletion_protection=deletion_protection,
            release_channel={"channel": release_channel},
            workload_identity_config={"workload_pool": f"{project}.svc.id.goog"},
            private_cluster_config={
                "enable_private_nodes": True,
                "enable_private_endpoint": False,
                "master_ipv4_cidr_block": settings.master_cidr,
                "master_global_access_config": {"enabled": False},
            },
            master_authorized_networks_config={
                "cidr_blocks": [
                    {"cidr_block": cidr, "display_name": f"admin-{i}"}
                    for i, cidr in enumerate(admin_source_ranges)
                ],
            },
            ip_allocation_policy={
                "cluster_secondary_range_name": "pods",
                "services_secondary_range_name": "services",
            },
            gateway_api_config={"channel": "CHANNEL_STANDARD"},
            monitoring_config={
                "enable_components": ["SYSTEM_COMPONENTS", "DCGM"],
                "managed_prometheus": {"enabled": True},
            },
            logging_config={"enable_components": ["SYSTEM_COMPONENTS", "WORKLOADS"]},
            addons_config={
                "gcs_fuse_csi_driver_config": {"enabled": True},
                "http_load_balancing": {"disabled": False},
            },
            # No cluster-level node_config: it manages the default pool, which the provider says not to use
            # beside separate node pools (pulumi-gcp 10.2 Cluster.node_config docstring); the default pool
            # is removed at once (remove_default_node_pool) and the pools carry their own config.
            resource_labels=labels,
            opts=self.child(),
        )
        self.register_outputs({"cluster": self.cluster.name})


class RegionNodePools(_Part):
    """The CPU pool for system pods (Grafana, the query frontend, the metrics adapter, redis_exporter), at
    least one node in every GPU zone (so the NEG controller creates the load balancer's NEG in each), and
    the GPU pool: one GPU per node (one runtime pod per node), GKE-managed driver installation, the
    ``GPU_TAINT`` (only pods that tolerate it land there), autoscaling ``min_nodes``-``max_nodes`` in total
    over the zones (location policy ANY: GPUs are scarce, take any zone that has one), surge upgrades of
    one node at a time that never take a node away before its replacement is up (``max_unavailable`` 0,
    within the PodDisruptionBudget's ``maxUnavailable`` 1), image streaming."""

    gpu_pool: container.NodePool

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        project: str,
        settings: RegionSettings,
        cluster: pulumi.Input[str],
        node_account: pulumi.Input[str],
        system_machine_type: str,
        labels: Mapping[str, str],
    ):
        super().__init__("RegionNodePools", name, region, deps)
        s = settings
        common_node_config = {
            "service_account": node_account,
            "oauth_scopes": list(SCOPES),
            "workload_metadata_config": {"mode": "GKE_METADATA"},
            "shielded_instance_config": {"enable_secure_boot": True, "enable_integrity_monitoring": True},
            "resource_labels": labels,
        }
        container.NodePool(
            f"{prefix}-system-pool",
            name="system",
            project=project,
            cluster=cluster,
            location=s.region,
            node_locations=list(s.zones),
            autoscaling={"min_node_count": 1, "max_node_count": 3, "location_policy": "BALANCED"},
            management={"auto_repair": True, "auto_upgrade": True},
            upgrade_settings={"strategy": "SURGE", "max_surge": 1, "max_unavailable": 0},
            node_config={
                **common_node_config,
                "machine_type": system_machine_type,
                "disk_size_gb": 100,
                "disk_type": "pd-balanced",
                "labels": {"duplex/role": "system"},
            },
            opts=self.child(),
        )
        self.gpu_pool = container.NodePool(
            f"{prefix}-gpu-pool",
            name="gpu",
            project=project,
            cluster=cluster,
            location=s.region,
            node_locations=list(s.zones),
            autoscaling={
                "total_min_node_count": s.min_nodes,
                "total_max_node_count": s.max_nodes,
                "location_policy": "ANY",
            },
            management={"auto_repair": True, "auto_upgrade": True},
            upgrade_settings={"strategy": "SURGE", "max_surge": 1, "max_unavailable": 0},
            node_config={
                **common_node_config,
                "machine_type": s.machine_type,
                "guest_accelerators": [
                    {
                        "type": s.accelerator_type,
                        "count": s.accelerator_count,
                        "gpu_driver_installation_config": {"gpu_driver_version": "LATEST"},
                    }
                ],
                "taints": [GPU_TAINT],
                "labels": {"duplex/role": "runtime"},
                "disk_size_gb": 200,
                "disk_type": "pd-balanced",
                # Image streaming: the multi-GB runtime image starts before it is fully pulled.
                "gcfs_config": {"enabled": True},
            },
            opts=self.child(),
        )
        self.register_outputs({"gpu_pool": self.gpu_pool.name})


class RegionRedis(_Part):
    """Memorystore for Redis (STANDARD_HA: a replica in another zone) with AUTH and in-transit encryption
    (``SERVER_AUTHENTICATION``: TLS on port 6378, verified against the instance's CA)."""

    instance: redis.Instance

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        resource_name: str,
        project: str,
        settings: RegionSettings,
        network: pulumi.Input[str],
        labels: Mapping[str, str],
    ):
        super().__init__("RegionRedis", name, region, deps)
        self.instance = redis.Instance(
            f"{prefix}-redis",
            name=resource_name,
            project=project,
            region=settings.region,
            tier="STANDARD_HA",
            memory_size_gb=settings.redis_memory_gb,
            redis_version="REDIS_7_2",
            authorized_network=network,
            connect_mode="DIRECT_PEERING",
            auth_enabled=True,
            transit_encryption_mode="SERVER_AUTHENTICATION",
            redis_configs={"maxmemory-policy": "volatile-ttl"},
            labels=labels,
            opts=self.child(),
        )
        self.register_outputs({"host": self.instance.host})


class RegionModelBucket(_Part):
    """The model cache: a Cloud Storage bucket of the region (uniform access, public access prevented) that
    the weights-prefetch Job fills once (``writer``: read-write) and the runtime pods mount read-only
    (``reader``)."""

    bucket: storage.Bucket

    def __init__(
        self,
        name: str,
        region: pulumi.Resource,
        deps: Sequence[pulumi.Resource],
        *,
        prefix: str,
        project: str,
        settings: RegionSettings,
        reader: serviceaccount.Account,
        writer: serviceaccount.Account,
        labels: Mapping[str, str],
    ):
        super().__init__("RegionModelBucket", name, region, deps)
        self.bucket = storage.Bucket(
            f"{prefix}-models",
            project=project,
            location=settings.region.upper(),
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            force_destroy=False,
            labels=labels,
            opts=self.child(),
        )
        for account, role in ((reader, "roles/storage.objectViewer"), (writer, "roles/storage.objectUser")):
            storage.BucketIAMMember(
                f"{prefix}-models-{role.split('.')[-1].lower()}",
                bucket=self.bucket.name,
                role=role,
                member=account.member,
                opts=self.child(),
            )
        self.register_outputs({"bucket": self.bucket.name})
