"""``GkeRegion``: one region of the multi-region stack on Google Cloud, put together from its parts
(``infra.components.gke_parts``): the network, the service accounts, the cluster, the node pools,
Memorystore and the model bucket, and, when the stack records, the recordings bucket
(``infra.components.recording_bucket``); and a Kubernetes provider built from the cluster's outputs
(``gke-gcloud-auth-plugin`` with Application Default Credentials, the GCP provider's own). The Kubernetes
objects themselves are ``RegionalRuntime``'s. docs/deploying.md, "Stack multi-region".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_gcp.container as container
import pulumi_gcp.redis as redis
import pulumi_gcp.serviceaccount as serviceaccount
import pulumi_gcp.storage as storage
import pulumi_kubernetes as kubernetes

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.components.gke_parts import (
    RegionAccounts,
    RegionCluster,
    RegionModelBucket,
    RegionNetwork,
    RegionNodePools,
    RegionRedis,
)
from infra.components.recording_bucket import RegionRecordingBucket
from infra.stack_config import MaintenanceWindow, RegionSettings

__all__ = [
    "GkeRegion",
    "GkeRegionArgs",
    "REDIS_TLS_PORT",
    "ca_bundle",
    "cluster_name",
    "kubeconfig",
    "workload_identity_member",
]

REDIS_TLS_PORT = 6378
"""Memorystore's port when in-transit encryption is on (6379 without TLS)."""

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


def ca_bundle(server_ca_certs: Sequence[Mapping[str, Any]] | None) -> str:
    """Every CA certificate of a Memorystore instance (its ``server_ca_certs``: ``[{"cert": PEM}, ...]``) as
    one PEM bundle, in the order given. During a CA rotation Memorystore lists the old and the new CA
    (cloud.google.com/memorystore/docs/redis/about-in-transit-encryption, "Certificate authority
    rotation"): a client that trusts only the first breaks when the server switches to the new one.

    Raises:
        ValueError: no certificate, or an entry without a PEM certificate (the runtime could then verify
            nothing).
    """
    pems = []
    for i, entry in enumerate(server_ca_certs or ()):
        pem = str((entry or {}).get("cert") or "").strip()
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ValueError(f"server_ca_certs[{i}] holds no PEM certificate; allowed: {{'cert': '<PEM>'}}")
        pems.append(pem + "\n")
    if not pems:
        raise ValueError("server_ca_certs is empty: Memorystore with TLS always lists at least one CA")
    return "".join(pems)


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
        deletion_protection: refuse ``pulumi destroy`` of the cluster (GKE's flag), and ``protect`` the
            stateful resources (Memorystore, the model bucket) in Pulumi.
        maintenance_window: when GKE may upgrade the cluster and its pools.
        system_machine_type: machine type of the CPU pool.
        image_repository: the region's Artifact Registry repository (its nodes may read it).
        image_repository_location: its location (the region).
        labels: labels of every resource that takes them.
        recording_retention_days: the region gets a recordings bucket with this lifecycle age (days)
            (``infra.components.recording_bucket``); None: no recordings bucket.
    """

    name_prefix: str
    project: str
    settings: RegionSettings
    network: pulumi.Input[str]
    admin_source_ranges: Sequence[str]
    release_channel: str
    deletion_protection: bool
    maintenance_window: MaintenanceWindow
    system_machine_type: str
    image_repository: pulumi.Input[str]
    image_repository_location: str
    labels: Mapping[str, str] = field(default_factory=dict)
    recording_retention_days: int | None = None


class GkeRegion(pulumi.ComponentResource):
    """A regional GKE cluster with a GPU pool, Memorystore, the model bucket and a Kubernetes provider."""

    cluster: container.Cluster
    gpu_pool: container.NodePool
    redis: redis.Instance
    weights_bucket: storage.Bucket
    recordings_bucket: storage.Bucket | None
    provider: kubernetes.Provider
    runtime_service_account: serviceaccount.Account
    weights_service_account: serviceaccount.Account
    monitoring_service_account: serviceaccount.Account
    cluster_name: str

    def __init__(self, name: str, args: GkeRegionArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:GkeRegion", name, None, opts)
        deps = dependencies(opts)
        s, project = args.settings, args.project
        labels = {**args.labels, "region": s.region}
        self.cluster_name = cluster_name(args.name_prefix, s)
        self.resource_name = name
        network = RegionNetwork(
            f"{name}-network",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            resource_name=self.cluster_name,
            network=args.network,
        )
        accounts = RegionAccounts(
            f"{name}-accounts",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            name_prefix=args.name_prefix,
            image_repository=args.image_repository,
            image_repository_location=args.image_repository_location,
        )
        self.runtime_service_account = accounts.runtime
        self.weights_service_account = accounts.weights
        self.monitoring_service_account = accounts.monitoring
        self.cluster = RegionCluster(
            f"{name}-control-plane",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            resource_name=self.cluster_name,
            network=args.network,
            subnet=network.subnet.id,
            admin_source_ranges=args.admin_source_ranges,
            release_channel=args.release_channel,
            deletion_protection=args.deletion_protection,
            maintenance_window=args.maintenance_window,
            node_account=accounts.node.email,
            labels=labels,
        ).cluster
        self.gpu_pool = RegionNodePools(
            f"{name}-pools",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            cluster=self.cluster.id,
            node_account=accounts.node.email,
            system_machine_type=args.system_machine_type,
            labels=labels,
        ).gpu_pool
        self.redis = RegionRedis(
            f"{name}-memorystore",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            resource_name=self.cluster_name,
            network=args.network,
            labels=labels,
            protect=args.deletion_protection,
        ).instance
        self.weights_bucket = RegionModelBucket(
            f"{name}-model-cache",
            self,
            deps,
            prefix=name,
            project=project,
            settings=s,
            reader=accounts.runtime,
            writer=accounts.weights,
            labels=labels,
            protect=args.deletion_protection,
        ).bucket
        self.recordings_bucket = None
        if args.recording_retention_days is not None:
            self.recordings_bucket = RegionRecordingBucket(
                f"{name}-recordings",
                project=project,
                region=s.region,
                writer=accounts.runtime,
                retention_days=args.recording_retention_days,
                labels=labels,
                protect=args.deletion_protection,
                depends_on=deps,
                opts=pulumi.ResourceOptions(parent=self),
            ).bucket

        config = pulumi.Output.all(
            self.cluster.name, self.cluster.endpoint, self.cluster.master_auth.cluster_ca_certificate
        ).apply(lambda v: kubeconfig(str(v[0]), str(v[1]), str(v[2])))
        # Annotated: without the target type mypy solves Output.secret's type variable to Never.
        secret_config: pulumi.Output[str] = pulumi.Output.secret(config)
        self.provider = kubernetes.Provider(
            f"{name}-k8s",
            kubeconfig=secret_config,
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
