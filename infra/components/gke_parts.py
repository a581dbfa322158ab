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
from infra.names import GPU_TAINT, SYSTEM_POOL
from infra.stack_config import MaintenanceWindow, RegionSettings

__all__ = [
    "DATAPATH_PROVIDER",
    "GPU_NODE_PROJECT_ROLES",
    "GPU_POOL_MIN_PROVISION_NODES",
    "INITIAL_NODES_PER_ZONE",
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

DATAPATH_PROVIDER = "ADVANCED_DATAPATH"
"""The clusters' datapath: GKE Dataplane V2 (Cilium, eBPF), which enforces Kubernetes NetworkPolicy
(pulumi-gcp ``container.Cluster`` ``datapath_provider``: ``LEGACY_DATAPATH`` by default, ``ADVANCED_DATAPATH``
for Dataplane V2). Set at creation only: changing it replaces the cluster."""

INITIAL_NODES_PER_ZONE = 1
"""``initial_node_count`` of both node pools: nodes per zone of ``node_locations`` when the pool is created.
A pool with autoscaling and no initial count starts empty (terraform-provider-google issues 8270, 11594),
and the cluster's default pool is removed, so without it the cluster has no node: nothing schedules, the
autoscaler never sees the GPU pods' nodes, GKE makes no NEG. One per zone also puts a GPU node in every
zone from the start (the runtime spreads over the zones). The provider replaces a pool when its initial
count changes (ForceNew): it is a constant, and ignored after creation (``ignore_changes``); the autoscaler
owns the count from then on."""


def node_config_base(
    node_account: pulumi.Input[str], labels: Mapping[str, str]
) -> container.ClusterNodeConfigArgsDict:
    """What every node of the region runs with, the cluster's transient default pool included: the
    region's node service account (never the Compute Engine default one, which has Editor on the project),
    the cloud-platform scope (IAM decides), the GKE metadata server (Workload Identity), Shielded VM with
    Secure Boot, ``labels`` as resource labels."""
    return {
        "service_account": node_account,
        "oauth_scopes": list(SCOPES),
        "workload_metadata_config": {"mode": "GKE_METADATA"},
        "shielded_instance_config": {"enable_secure_boot": True, "enable_integrity_monitoring": True},
        "resource_labels": dict(labels),
    }


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
    Cloud Storage FUSE CSI driver (the model cache), a weekly maintenance window (``maintenance_window``:
    GKE upgrades the control plane and the pools only then), the default pool removed. That default pool
    exists for the minutes of the cluster's creation and runs as the region's node service account
    (``node_config_base``), not the Compute Engine default one; its config is ignored afterwards.

    GKE Dataplane V2 (``datapath_provider`` ``DATAPATH_PROVIDER``): the cluster enforces Kubernetes
    NetworkPolicy, which fences the TURN relay's pods to the runtime pods (``infra.k8s.turn``); GKE enforces
    NetworkPolicy only with Dataplane V2 or the legacy Calico add-on; Dataplane V2 needs a VPC-native
    cluster (``ip_allocation_policy``, set). GKE enables Dataplane V2 only when it creates a cluster, never
    on an existing one (cloud.google.com/kubernetes-engine/docs/how-to/dataplane-v2): a cluster created
    before this setting is replaced on the next ``pulumi up`` (docs/deploying.md, "Stack multi-region")."""

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
        maintenance_window: MaintenanceWindow,
        node_account: pulumi.Input[str],
        labels: Mapping[str, str],
    ):
        super().__init__("RegionCluster", name, region, deps)
        window = maintenance_window.recurring_window()
        recurring_window: container.ClusterMaintenancePolicyRecurringWindowArgsDict = {
            "start_time": window["start_time"],
            "end_time": window["end_time"],
            "recurrence": window["recurrence"],
        }
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
            maintenance_policy={"recurring_window": recurring_window},
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
            datapath_provider=DATAPATH_PROVIDER,
            monitoring_config={
                "enable_components": ["SYSTEM_COMPONENTS", "DCGM"],
                "managed_prometheus": {"enabled": True},
            },
            logging_config={"enable_components": ["SYSTEM_COMPONENTS", "WORKLOADS"]},
            addons_config={
                "gcs_fuse_csi_driver_config": {"enabled": True},
                "http_load_balancing": {"disabled": False},
            },
            # The cluster-level node_config only shapes the default pool, created with the cluster and
            # removed at once (remove_default_node_pool): it runs as the node account. Ignored afterwards
            # (pulumi-gcp 10.2 Cluster.node_config docstring: it manages the default pool, not the others).
            node_config=node_config_base(node_account, labels),
            resource_labels=labels,
            opts=self.child(ignore_changes=["nodeConfig"]),
        )
        self.register_outputs({"cluster": self.cluster.name})


GPU_POOL_MIN_PROVISION_NODES = 1
"""``best_effort_provisioning.min_provision_nodes`` of the GPU pool: its creation succeeds once this many
nodes run, and GKE brings up the rest of ``initial_node_count`` per zone as stock returns (GKE API
``BestEffortProvisioning``: "cluster/node pool creations will ignore non-fatal errors like stockout ... and
eventually bring up all target number of nodes"; pulumi-gcp 10.2 ``NodePool.best_effort_provisioning``).
Without it, one listed zone out of GPUs (``ZONE_RESOURCE_POOL_EXHAUSTED``) failed the pool's creation and
the first ``up`` with it. Creation-only (changing it recreates the pool): ignored after creation, so
turning it on does not replace an existing pool."""


class RegionNodePools(_Part):
    """The CPU pool for system pods (Grafana, the query frontend, the metrics adapter, redis_exporter), and
    the GPU pool: one GPU per node (one runtime pod per node), GKE-managed driver installation, the
    ``GPU_TAINT`` (only pods that tolerate it land there), autoscaling ``min_nodes``-``max_nodes`` in total
    over the zones (location policy ANY: GPUs are scarce, take any zone that has one), image streaming.

    Both start with ``INITIAL_NODES_PER_ZONE`` node in each zone; the GPU pool's creation is best-effort
    (``GPU_POOL_MIN_PROVISION_NODES``): a zone out of GPUs at the first ``up`` does not fail it, GKE adds
    that zone's node when stock returns. The system pool also runs coturn
    (``infra.k8s.turn``): its CPU VMs live-migrate through host maintenance, it never scales or upgrades
    with the GPU pool, and the cluster autoscaler leaves a node holding a coturn pod alone (the pods are
    ``safe-to-evict: false``). Upgrades: the system pool surges (one extra node, ``max_unavailable`` 0: the
    coturn pod it evicts drains its allocations first, within the PodDisruptionBudget); the GPU pool
    upgrades one node at a time in place (``max_surge`` 0,
    ``max_unavailable`` 1): a surge node would be one more GPU (an A100 80 GB) in the zone, which quota or
    stock may not have, and a blue-green upgrade a whole second pool of them. The node's pod drains first
    (eviction honours the PodDisruptionBudget's ``maxUnavailable`` 1; the preStop hook waits for its
    sessions); the region serves one pod short meanwhile, inside the cluster's maintenance window."""

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
        common_node_config = node_config_base(node_account, labels)
        gpu_taint: container.NodePoolNodeConfigTaintArgsDict = {
            "key": GPU_TAINT["key"],
            "value": GPU_TAINT["value"],
            "effect": GPU_TAINT["effect"],
        }
        system_node_config: container.NodePoolNodeConfigArgsDict = {
            **common_node_config,
            "machine_type": system_machine_type,
            "disk_size_gb": 100,
            "disk_type": "pd-balanced",
            "labels": {"duplex/role": "system"},
        }
        container.NodePool(
            f"{prefix}-system-pool",
            name=SYSTEM_POOL,
            project=project,
            cluster=cluster,
            location=s.region,
            node_locations=list(s.zones),
            initial_node_count=INITIAL_NODES_PER_ZONE,
            autoscaling={"min_node_count": 1, "max_node_count": 3, "location_policy": "BALANCED"},
            management={"auto_repair": True, "auto_upgrade": True},
            upgrade_settings={"strategy": "SURGE", "max_surge": 1, "max_unavailable": 0},
            node_config=system_node_config,
            opts=self.child(ignore_changes=["initialNodeCount"]),
        )
        self.gpu_pool = container.NodePool(
            f"{prefix}-gpu-pool",
            name="gpu",
            project=project,
            cluster=cluster,
            location=s.region,
            node_locations=list(s.zones),
            initial_node_count=INITIAL_NODES_PER_ZONE,
            autoscaling={
                "total_min_node_count": s.min_nodes,
                "total_max_node_count": s.max_nodes,
                "location_policy": "ANY",
            },
            management={"auto_repair": True, "auto_upgrade": True},
            # No surge node: it would need one more GPU in the zone (see the class docstring).
            upgrade_settings={"strategy": "SURGE", "max_surge": 0, "max_unavailable": 1},
            # A zone out of GPUs at creation does not fail the pool (GPU_POOL_MIN_PROVISION_NODES).
            best_effort_provisioning={
                "enabled": True,
                "min_provision_nodes": GPU_POOL_MIN_PROVISION_NODES,
            },
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
                "taints": [gpu_taint],
                "labels": {"duplex/role": "runtime"},
                "disk_size_gb": 200,
                "disk_type": "pd-balanced",
                # Image streaming: the multi-GB runtime image starts before it is fully pulled.
                "gcfs_config": {"enabled": True},
            },
            # Both are read at creation only, and changing either would recreate the pool.
            opts=self.child(ignore_changes=["initialNodeCount", "bestEffortProvisioning"]),
        )
        self.register_outputs({"gpu_pool": self.gpu_pool.name})


class RegionRedis(_Part):
    """Memorystore for Redis (STANDARD_HA: a replica in another zone) with AUTH and in-transit encryption
    (``SERVER_AUTHENTICATION``: TLS on port 6378, verified against the instance's CAs), ``protect``ed when
    the stack protects its stateful resources (``pulumi destroy`` and a replacement then stop)."""

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
        protect: bool,
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
            redis_configs={"maxmemory-policy": "noeviction"},
            labels=labels,
            opts=self.child(protect=protect),
        )
        self.register_outputs({"host": self.instance.host})


class RegionModelBucket(_Part):
    """The model cache: a Cloud Storage bucket of the region (uniform access, public access prevented) that
    the weights-prefetch Job fills once (``writer``: read-write) and the runtime pods mount read-only
    (``reader``); ``protect``ed with the stack's stateful resources (a lost bucket is a 16 GB download)."""

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
        protect: bool,
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
            opts=self.child(protect=protect),
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
