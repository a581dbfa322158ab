"""``GkeRegion``: one region of the multi-region stack, on Google Cloud.

What it declares (every child parented to the component):

- the region's subnet in the stack's VPC (nodes' primary range, secondary ranges ``pods`` and
  ``services``: VPC-native, so the load balancer's NEG endpoints are pod IPs), a Cloud Router and Cloud
  NAT (private nodes reach Hugging Face and registries outbound only);
- a regional GKE cluster (control plane in three zones): private nodes, a public control-plane endpoint
  reachable only from ``admin_source_ranges``, Workload Identity, the configured release channel, Gateway
  API (standard channel), Google Managed Prometheus with GKE's managed DCGM exporter (GPU metrics), the
  Cloud Storage FUSE CSI driver (the model cache), the default pool removed;
- a CPU pool for system pods (Grafana, the query frontend, the metrics adapter, redis_exporter), at least
  one node in every GPU zone (so the NEG controller creates the load balancer's NEG in each of them);
- the GPU pool: one GPU per node (one runtime pod per node), GKE-managed driver installation, the
  ``nvidia.com/gpu=present:NoSchedule`` taint (only pods that tolerate it land there), autoscaling
  ``min_nodes``-``max_nodes`` in total over the zones (location policy ANY: GPUs are scarce, take any zone
  that has one), surge upgrades of one node at a time that never take a node away before its replacement
  is up (``max_unavailable`` 0, within the PodDisruptionBudget's ``maxUnavailable`` 1), image streaming;
- Memorystore for Redis (STANDARD_HA: a replica in another zone) with AUTH and in-transit encryption
  (``SERVER_AUTHENTICATION``: TLS on port 6378, verified against the instance's CA);
- the model cache: a Cloud Storage bucket of the region (uniform access, public access prevented) that
  the weights-prefetch Job fills once and the runtime pods mount read-only;
- service accounts with the least they need: the nodes' (logs, metrics, image pull from the stack's
  repository), the runtime's (read the model bucket; Workload Identity for its Kubernetes service
  account), the weights writer's (write the bucket), the monitoring one's (read metrics for the query
  frontend and the custom metrics adapter);
- a Kubernetes provider built from the cluster's outputs (``gke-gcloud-auth-plugin`` with Application
  Default Credentials, the GCP provider's own).

The Kubernetes objects themselves are ``RegionalRuntime``'s (``infra.components.regional_runtime``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_gcp.artifactregistry as artifactregistry
import pulumi_gcp.compute as compute
import pulumi_gcp.container as container
import pulumi_gcp.projects as projects
import pulumi_gcp.redis as redis
import pulumi_gcp.serviceaccount as serviceaccount
import pulumi_gcp.storage as storage
import pulumi_kubernetes as kubernetes

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.stack_config import RegionSettings

__all__ = [
    "GPU_TAINT",
    "GPU_NODE_PROJECT_ROLES",
    "GkeRegion",
    "GkeRegionArgs",
    "REDIS_TLS_PORT",
    "cluster_name",
    "kubeconfig",
    "workload_identity_member",
]

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}
"""The GPU pool's taint (GKE's spelling of ``NoSchedule``): the runtime's pods tolerate it."""

GPU_NODE_PROJECT_ROLES = (
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/autoscaling.metricsWriter",
)
"""Project roles of the nodes' service account: GKE's documented minimum for a node service account
(cloud.google.com/kubernetes-engine/docs/how-to/hardening-your-cluster, "least privilege")."""

REDIS_TLS_PORT = 6378
"""Memorystore's port when in-transit encryption is on (6379 without TLS)."""

SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)

KUBECONFIG_ADC_FLAG = "--use_application_default_credentials"
"""The ``gke-gcloud-auth-plugin`` flag that makes it use Application Default Credentials (see
:func:`kubeconfig`)."""

CLUSTER_NAME_LIMIT = 40
"""GKE cluster and Memorystore instance names: at most 40 characters."""


def cluster_name(name_prefix: str, settings: RegionSettings) -> str:
    """``<prefix>-<region>``, or ``<prefix>-r<networkIndex>`` where that is over 40 characters (never a
    truncation: two long regions would collide)."""
    full = f"{name_prefix}-{settings.region}"
    return full if len(full) <= CLUSTER_NAME_LIMIT else f"{name_prefix}-r{settings.network_index}"


def workload_identity_member(project: str, namespace: str, ksa: str) -> str:
    """The IAM member a Kubernetes service account acts as under Workload Identity."""
    return f"serviceAccount:{project}.svc.id.goog[{namespace}/{ksa}]"


def kubeconfig(name: str, endpoint: str, ca_certificate: str) -> str:
    """A kubeconfig (JSON) for cluster ``name`` at ``endpoint`` (IP) with base64 CA ``ca_certificate``,
    authenticating with ``gke-gcloud-auth-plugin --use_application_default_credentials``: Application
    Default Credentials, the ones Pulumi's GCP provider runs with (``gcloud auth application-default
    login`` on a workstation, workload identity federation in CI). Without the flag the plugin shells out
    to the gcloud CLI's own login (``gcloud auth login``), which a machine with only ADC does not have,
    and every Kubernetes resource fails (cloud.google.com/kubernetes-engine/docs/how-to/
    cluster-access-for-kubectl, "gke-gcloud-auth-plugin")."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": name,
                    "cluster": {
                        "server": f"https://{endpoint}",
                        "certificate-authority-data": ca_certificate,
                    },
                }
            ],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
            "users": [
                {
                    "name": name,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "gke-gcloud-auth-plugin",
                            "args": [KUBECONFIG_ADC_FLAG],
                            "provideClusterInfo": True,
                            "installHint": "gcloud components install gke-gcloud-auth-plugin",
                        }
                    },
                }
            ],
        }
    )


@dataclass(frozen=True)
class GkeRegionArgs:
    """What one region is made of.

    Attributes:
        name_prefix: prefix of resource names (``duplex-multi-region``).
        project: the GCP project.
        settings: the region's validated settings (zones, GPU, bounds, address ranges).
        network: the stack's VPC (self link or id).
        admin_source_ranges: IPv4 CIDRs allowed to reach the control plane.
        release_channel: RAPID, REGULAR or STABLE.
        deletion_protection: refuse ``pulumi destroy`` of the cluster.
        system_machine_type: machine type of the CPU pool.
        image_repository: the Artifact Registry repository the runtime image is in (nodes may read it).
        image_repository_location: its region.
        labels: labels of every resource that takes them.
    """

    name_prefix: str
    project: str
    settings: RegionSettings
    network: pulumi.Input[str]
    admin_source_ranges: Sequence[str]
    release_channel: str
    deletion_protection: bool
    system_machine_type: str
    image_repository: pulumi.Input[str]
    image_repository_location: str
    labels: Mapping[str, str] = field(default_factory=dict)


class GkeRegion(pulumi.ComponentResource):
    """A regional GKE cluster with a GPU pool, Memorystore, the model bucket and a Kubernetes provider."""

    cluster: container.Cluster
    gpu_pool: container.NodePool
    redis: redis.Instance
    weights_bucket: storage.Bucket
    provider: kubernetes.Provider
    runtime_service_account: serviceaccount.Account
    weights_service_account: serviceaccount.Account
    monitoring_service_account: serviceaccount.Account
    cluster_name: str

    def __init__(self, name: str, args: GkeRegionArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:GkeRegion", name, None, opts)
        deps = dependencies(opts)
        s = args.settings
        region, project = s.region, args.project
        labels = {**args.labels, "region": region}
        self.cluster_name = cluster_name(args.name_prefix, s)
        self.resource_name = name

        def child(**kwargs: object) -> pulumi.ResourceOptions:
            return child_options(self, deps, **kwargs)

        # --- network ------------------------------------------------------------------------------------
        subnet = compute.Subnetwork(
            f"{name}-subnet",
            name=self.cluster_name,
            project=project,
            region=region,
            network=args.network,
            ip_cidr_range=s.subnet_cidr,
            secondary_ip_ranges=[
                {"range_name": "pods", "ip_cidr_range": s.pods_cidr},
                {"range_name": "services", "ip_cidr_range": s.services_cidr},
            ],
            private_ip_google_access=True,
            opts=child(),
        )
        router = compute.Router(
            f"{name}-router",
            name=self.cluster_name,
            project=project,
            region=region,
            network=args.network,
            opts=child(),
        )
        compute.RouterNat(
            f"{name}-nat",
            name=self.cluster_name,
            project=project,
            region=region,
            router=router.name,
            nat_ip_allocate_option="AUTO_ONLY",
            source_subnetwork_ip_ranges_to_nat="ALL_SUBNETWORKS_ALL_IP_RANGES",
            log_config={"enable": True, "filter": "ERRORS_ONLY"},
            opts=child(),
        )

        # --- service accounts ---------------------------------------------------------------------------
        suffix = f"{s.network_index}"
        node_sa = self._account(name, "node", f"{args.name_prefix}-node-{suffix}", project, region, deps)
        for role in GPU_NODE_PROJECT_ROLES:
            projects.IAMMember(
                f"{name}-node-{role.split('/')[-1]}",
                project=project,
                role=role,
                member=node_sa.member,
                opts=child(),
            )
        artifactregistry.RepositoryIamMember(
            f"{name}-node-image-reader",
            project=project,
            location=args.image_repository_location,
            repository=args.image_repository,
            role="roles/artifactregistry.reader",
            member=node_sa.member,
            opts=child(),
        )
        self.runtime_service_account = self._account(
            name, "runtime", f"{args.name_prefix}-rt-{suffix}", project, region, deps
        )
        self.weights_service_account = self._account(
            name, "weights", f"{args.name_prefix}-wt-{suffix}", project, region, deps
        )
        self.monitoring_service_account = self._account(
            name, "monitoring", f"{args.name_prefix}-mon-{suffix}", project, region, deps
        )
        projects.IAMMember(
            f"{name}-monitoring-viewer",
            project=project,
            role="roles/monitoring.viewer",
            member=self.monitoring_service_account.member,
            opts=child(),
        )

        # --- the cluster --------------------------------------------------------------------------------
        self.cluster = container.Cluster(
            f"{name}-cluster",
            name=self.cluster_name,
            project=project,
            location=region,
            network=args.network,
            subnetwork=subnet.id,
            remove_default_node_pool=True,
            initial_node_count=1,
            deletion_protection=args.deletion_protection,
            release_channel={"channel": args.release_channel},
            workload_identity_config={"workload_pool": f"{project}.svc.id.goog"},
            private_cluster_config={
                "enable_private_nodes": True,
                "enable_private_endpoint": False,
                "master_ipv4_cidr_block": s.master_cidr,
                "master_global_access_config": {"enabled": False},
            },
            master_authorized_networks_config={
                "cidr_blocks": [
                    {"cidr_block": cidr, "display_name": f"admin-{i}"}
                    for i, cidr in enumerate(args.admin_source_ranges)
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
            # is removed at once (remove_default_node_pool) and the pools below carry their own config.
            resource_labels=labels,
            opts=child(),
        )

        common_node_config = {
            "service_account": node_sa.email,
            "oauth_scopes": list(SCOPES),
            "workload_metadata_config": {"mode": "GKE_METADATA"},
            "shielded_instance_config": {"enable_secure_boot": True, "enable_integrity_monitoring": True},
            "resource_labels": labels,
        }
        container.NodePool(
            f"{name}-system-pool",
            name="system",
            project=project,
            cluster=self.cluster.id,
            location=region,
            node_locations=list(s.zones),
            autoscaling={"min_node_count": 1, "max_node_count": 3, "location_policy": "BALANCED"},
            management={"auto_repair": True, "auto_upgrade": True},
            upgrade_settings={"strategy": "SURGE", "max_surge": 1, "max_unavailable": 0},
            node_config={
                **common_node_config,
                "machine_type": args.system_machine_type,
                "disk_size_gb": 100,
                "disk_type": "pd-balanced",
                "labels": {"duplex/role": "system"},
            },
            opts=child(),
        )
        self.gpu_pool = container.NodePool(
            f"{name}-gpu-pool",
            name="gpu",
            project=project,
            cluster=self.cluster.id,
            location=region,
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
            opts=child(),
        )

        # --- Memorystore ------------------------------------------------------------------------------
        self.redis = redis.Instance(
            f"{name}-redis",
            name=self.cluster_name,
            project=project,
            region=region,
            tier="STANDARD_HA",
            memory_size_gb=s.redis_memory_gb,
            redis_version="REDIS_7_2",
            authorized_network=args.network,
            connect_mode="DIRECT_PEERING",
            auth_enabled=True,
            transit_encryption_mode="SERVER_AUTHENTICATION",
            redis_configs={"maxmemory-policy": "volatile-ttl"},
            labels=labels,
            opts=child(),
        )

        # --- the model cache --------------------------------------------------------------------------
        self.weights_bucket = storage.Bucket(
            f"{name}-models",
            project=project,
            location=region.upper(),
            uniform_bucket_level_access=True,
            public_access_prevention="enforced",
            force_destroy=False,
            labels=labels,
            opts=child(),
        )
        for account, role in (
            (self.runtime_service_account, "roles/storage.objectViewer"),
            (self.weights_service_account, "roles/storage.objectUser"),
        ):
            storage.BucketIAMMember(
                f"{name}-models-{role.split('.')[-1].lower()}",
                bucket=self.weights_bucket.name,
                role=role,
                member=account.member,
                opts=child(),
            )

        # --- Kubernetes access ------------------------------------------------------------------------
        config = pulumi.Output.all(
            self.cluster.name, self.cluster.endpoint, self.cluster.master_auth.cluster_ca_certificate
        ).apply(lambda v: kubeconfig(str(v[0]), str(v[1]), str(v[2])))
        self.provider = kubernetes.Provider(
            f"{name}-k8s",
            kubeconfig=pulumi.Output.secret(config),
            enable_server_side_apply=True,
            delete_unreachable=False,
            opts=child_options(self, [self.cluster, self.gpu_pool, *deps]),
        )
        self.register_outputs(
            {
                "cluster": self.cluster.name,
                "redis_host": self.redis.host,
                "weights_bucket": self.weights_bucket.name,
            }
        )

    def bind_workload_identity(
        self, project: str, bindings: Sequence[tuple[str, str, str]]
    ) -> list[serviceaccount.IAMMember]:
        """Let Kubernetes service accounts act as this region's Google service accounts under Workload
        Identity: ``[(role, namespace, ksa name)]``, role ``runtime``, ``weights`` or ``monitoring``.

        Raises:
            ValueError: an unknown role (names the allowed ones)."""
        accounts = {
            "runtime": self.runtime_service_account,
            "weights": self.weights_service_account,
            "monitoring": self.monitoring_service_account,
        }
        members = []
        for role, namespace, ksa in bindings:
            if role not in accounts:
                raise ValueError(f"workload identity role {role!r}; allowed: {', '.join(accounts)}")
            members.append(
                serviceaccount.IAMMember(
                    f"{self.resource_name}-wi-{namespace}-{ksa}",
                    service_account_id=accounts[role].name,
                    role="roles/iam.workloadIdentityUser",
                    member=workload_identity_member(project, namespace, ksa),
                    # The identity pool exists once the first cluster of the project does.
                    opts=pulumi.ResourceOptions(parent=self, depends_on=[self.cluster]),
                )
            )
        return members

    def _account(
        self, name: str, role: str, account_id: str, project: str, region: str, deps: list[pulumi.Resource]
    ) -> serviceaccount.Account:
        return serviceaccount.Account(
            f"{name}-{role}-sa",
            account_id=account_id,
            project=project,
            display_name=f"duplexops {role} ({region})",
            opts=child_options(self, deps),
        )
