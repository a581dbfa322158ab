"""The IAM roles of the deployer and of the preview identity, derived from the resource types the stacks
declare.

``ROLE_RULES`` maps a resource-type prefix (a Pulumi type token's start, e.g. ``gcp:compute/``) to the
project-level roles the deployer needs to create, update and delete resources of that type, and those the
preview identity needs to read them. Every matching rule counts (a VM is ``gcp:compute/`` and runs as a
service account). ``deployer_roles(types)`` and ``preview_roles(types)`` refuse a type that no rule
covers, so a stack that starts declaring a new resource type fails its test until the table says which
role it needs (``tests/test_bootstrap.py`` runs every stack and checks ``STACK_RESOURCE_TYPES``).

Roles and their permissions: cloud.google.com/iam/docs/understanding-roles (predefined roles reference).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "IMAGE_PUSHER_ROLE",
    "PROJECT_IAM_ADMIN",
    "ROLE_RULES",
    "STACK_GRANTED_PROJECT_ROLES",
    "STACK_RESOURCE_TYPES",
    "RoleRule",
    "deployer_roles",
    "preview_roles",
    "uncovered_types",
]


@dataclass(frozen=True)
class RoleRule:
    """Roles for the resource types starting with ``prefix``: ``deploy`` (create/update/delete) and
    ``preview`` (read), and why (the permission behind them)."""

    prefix: str
    deploy: tuple[str, ...]
    preview: tuple[str, ...]
    why: str


_ACT_AS = "roles/iam.serviceAccountUser"

PROJECT_IAM_ADMIN = "roles/resourcemanager.projectIamAdmin"
"""Sets the project's IAM policy: the bootstrap grants it to the deployer only under an IAM condition that
limits the grants it may add or remove to ``STACK_GRANTED_PROJECT_ROLES``
(``program.project_iam_condition``)."""

IMAGE_PUSHER_ROLE = "roles/artifactregistry.writer"
"""The one role of CI's image job, on the build repository only: push images and tags (no delete, no
repository administration: cloud.google.com/artifact-registry/docs/access-control#roles)."""

ROLE_RULES: tuple[RoleRule, ...] = (
    # What runs in the Pulumi process or over SSH: no Google API.
    RoleRule("pulumi:", (), (), "the stack and the providers: no Google API"),
    RoleRule("duplexops:", (), (), "this project's components: no Google API of their own"),
    RoleRule("random:", (), (), "generated values, local"),
    RoleRule("command:", (), (), "commands over SSH on an on-premises host, crane copies between registries"),
    # Google Cloud, one rule per provider module.
    RoleRule(
        "gcp:projects/service:Service",
        ("roles/serviceusage.serviceUsageAdmin",),
        ("roles/serviceusage.serviceUsageViewer",),
        "services.enable",
    ),
    RoleRule(
        "gcp:projects/iAMMember:",
        ("roles/resourcemanager.projectIamAdmin",),
        ("roles/iam.securityReviewer",),
        "projects.getIamPolicy/setIamPolicy",
    ),
    RoleRule("gcp:compute/", ("roles/compute.admin",), ("roles/compute.viewer",), "compute.*"),
    RoleRule(
        "gcp:compute/instance:Instance",
        (_ACT_AS,),
        (),
        "a VM runs as a service account: iam.serviceAccounts.actAs on it",
    ),
    RoleRule("gcp:container/", ("roles/container.admin",), ("roles/container.viewer",), "container.*"),
    RoleRule(
        "gcp:container/cluster:Cluster",
        (_ACT_AS,),
        (),
        "the cluster's transient default pool runs as the Compute Engine default service account: actAs",
    ),
    RoleRule(
        "gcp:container/nodePool:NodePool",
        (_ACT_AS,),
        (),
        "a pool's nodes run as a service account: actAs on it",
    ),
    RoleRule(
        "gcp:cloudscheduler/",
        ("roles/cloudscheduler.admin", _ACT_AS),
        ("roles/cloudscheduler.viewer",),
        "the Spot node's restart job; it calls the API as a service account: actAs on it",
    ),
    RoleRule("gcp:redis/", ("roles/redis.admin",), ("roles/redis.viewer",), "redis.instances.*"),
    RoleRule(
        "gcp:artifactregistry/",
        ("roles/artifactregistry.admin",),
        ("roles/artifactregistry.reader",),
        "repositories and their IAM policies",
    ),
    RoleRule(
        "gcp:secretmanager/",
        ("roles/secretmanager.admin",),
        ("roles/secretmanager.viewer",),
        "secrets, versions (adding a version writes the payload) and their IAM policies",
    ),
    RoleRule(
        "gcp:serviceaccount/",
        ("roles/iam.serviceAccountAdmin",),
        ("roles/iam.serviceAccountViewer",),
        "service accounts and their IAM policies (Workload Identity bindings)",
    ),
    RoleRule(
        "gcp:storage/",
        ("roles/storage.admin",),
        ("roles/storage.bucketViewer",),
        "buckets and bucket IAM policies; the preview reads bucket metadata only, never objects (the "
        "recording buckets hold consented call recordings: storage.objectViewer would let a pull "
        "request's code read them)",
    ),
    RoleRule(
        "gcp:dns/",
        ("roles/dns.admin",),
        ("roles/dns.reader",),
        "record sets in the managed zone named by dnsZone (dns.changes.create, dns.resourceRecordSets.*)",
    ),
    RoleRule(
        "gcp:monitoring/",
        ("roles/monitoring.editor",),
        ("roles/monitoring.viewer",),
        "alert policies, notification channels",
    ),
    # The runtime image pushed to Artifact Registry.
    RoleRule(
        "docker-build:",
        ("roles/artifactregistry.writer",),
        ("roles/artifactregistry.reader",),
        "docker push; the registry build cache",
    ),
    # Kubernetes objects on GKE: GKE's IAM roles grant the Kubernetes API too; the objects include
    # ClusterRoles and bindings, which only container.admin (or RBAC escalate/bind) may create.
    RoleRule(
        "kubernetes:",
        ("roles/container.admin",),
        ("roles/container.viewer",),
        "Kubernetes objects, cluster-scoped RBAC included",
    ),
)
"""Resource-type prefix -> roles. ``roles/iam.serviceAccountUser`` is granted on the project: the deployer
must act as the accounts its VMs and pools run as, which the same ``up`` creates (a binding made in the
stack would race IAM's propagation), and as the Compute Engine default account (GKE's transient default
pool); it gives no power the deployer lacks, since ``roles/iam.serviceAccountAdmin`` already lets it set
any account's IAM policy."""

STACK_RESOURCE_TYPES: tuple[str, ...] = (
    "command:local:Command",
    "command:remote:Command",
    "command:remote:CopyToRemote",
    "docker-build:index:Image",
    "duplexops:components:GceGpuNode",
    "duplexops:components:GkeRegion",
    "duplexops:components:GlobalEntry",
    "duplexops:components:NodeUptimeCheck",
    "duplexops:components:OnPremNode",
    "duplexops:components:RegionAccounts",
    "duplexops:components:RegionCluster",
    "duplexops:components:RegionModelBucket",
    "duplexops:components:RegionNetwork",
    "duplexops:components:RegionNodePools",
    "duplexops:components:RegionRecordingBucket",
    "duplexops:components:RegionRedis",
    "duplexops:components:RegionalRuntime",
    "duplexops:components:RegistryPuller",
    "duplexops:components:RuntimeImage",
    "duplexops:components:StackSecrets",
    "gcp:artifactregistry/repository:Repository",
    "gcp:artifactregistry/repositoryIamMember:RepositoryIamMember",
    "gcp:cloudscheduler/job:Job",
    "gcp:compute/address:Address",
    "gcp:compute/backendService:BackendService",
    "gcp:compute/disk:Disk",
    "gcp:compute/firewall:Firewall",
    "gcp:compute/globalAddress:GlobalAddress",
    "gcp:compute/globalForwardingRule:GlobalForwardingRule",
    "gcp:compute/healthCheck:HealthCheck",
    "gcp:compute/instance:Instance",
    "gcp:compute/instanceIAMMember:InstanceIAMMember",
    "gcp:compute/managedSslCertificate:ManagedSslCertificate",
    "gcp:compute/network:Network",
    "gcp:compute/router:Router",
    "gcp:compute/routerNat:RouterNat",
    "gcp:compute/sSLPolicy:SSLPolicy",
    "gcp:compute/securityPolicy:SecurityPolicy",
    "gcp:compute/subnetwork:Subnetwork",
    "gcp:compute/targetHttpProxy:TargetHttpProxy",
    "gcp:compute/targetHttpsProxy:TargetHttpsProxy",
    "gcp:compute/uRLMap:URLMap",
    "gcp:container/cluster:Cluster",
    "gcp:container/nodePool:NodePool",
    "gcp:dns/recordSet:RecordSet",
    "gcp:monitoring/alertPolicy:AlertPolicy",
    "gcp:monitoring/uptimeCheckConfig:UptimeCheckConfig",
    "gcp:projects/iAMMember:IAMMember",
    "gcp:projects/service:Service",
    "gcp:redis/instance:Instance",
    "gcp:secretmanager/secret:Secret",
    "gcp:secretmanager/secretIamMember:SecretIamMember",
    "gcp:secretmanager/secretVersion:SecretVersion",
    "gcp:serviceaccount/account:Account",
    "gcp:serviceaccount/iAMMember:IAMMember",
    "gcp:storage/bucket:Bucket",
    "gcp:storage/bucketIAMMember:BucketIAMMember",
    "kubernetes:apiregistration.k8s.io/v1:APIService",
    "kubernetes:apps/v1:Deployment",
    "kubernetes:autoscaling/v2:HorizontalPodAutoscaler",
    "kubernetes:batch/v1:Job",
    "kubernetes:core/v1:ConfigMap",
    "kubernetes:core/v1:Namespace",
    "kubernetes:core/v1:Secret",
    "kubernetes:core/v1:Service",
    "kubernetes:core/v1:ServiceAccount",
    "kubernetes:monitoring.googleapis.com/v1:ClusterRules",
    "kubernetes:monitoring.googleapis.com/v1:PodMonitoring",
    "kubernetes:networking.k8s.io/v1:NetworkPolicy",
    "kubernetes:policy/v1:PodDisruptionBudget",
    "kubernetes:rbac.authorization.k8s.io/v1:ClusterRole",
    "kubernetes:rbac.authorization.k8s.io/v1:ClusterRoleBinding",
    "kubernetes:rbac.authorization.k8s.io/v1:Role",
    "kubernetes:rbac.authorization.k8s.io/v1:RoleBinding",
    "pulumi:providers:kubernetes",
    "random:index/randomPassword:RandomPassword",
)
"""Every resource type the four stacks declare, under their committed files and under every documented
option that adds resources (``dnsZone``: ``gcp:dns/``; ``recordings``; ...: ``OPTION_VARIANTS`` in
``tests/test_bootstrap.py``, which runs them all under the mocks and fails, printing the new list, when this
differs): the bootstrap grants the roles these need and enables their APIs, no more."""


STACK_GRANTED_PROJECT_ROLES: tuple[str, ...] = (
    "roles/autoscaling.metricsWriter",
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
)
"""Every role the stacks grant on the project (``gcp:projects/iAMMember:IAMMember``), under their committed
files and every documented option (``tests/test_bootstrap.py`` runs them and fails, printing the new
list, when this differs): the only roles the deployer's ``projectIamAdmin`` may grant or revoke."""


def uncovered_types(types: Iterable[str]) -> list[str]:
    """The types in ``types`` that no rule of ``ROLE_RULES`` covers, sorted."""
    return sorted({t for t in types if not any(t.startswith(r.prefix) for r in ROLE_RULES)})


def _roles(types: Iterable[str], which: str) -> dict[str, list[str]]:
    types = sorted(set(types))
    if missing := uncovered_types(types):
        raise ValueError(
            f"no role rule for resource type(s) {', '.join(missing)}: add the roles that create and read "
            "them to ROLE_RULES in infra/bootstrap/roles.py (prefix, deploy roles, preview roles, why)"
        )
    needed: dict[str, list[str]] = {}
    for t in types:
        for rule in ROLE_RULES:
            if t.startswith(rule.prefix):
                for role in getattr(rule, which):
                    needed.setdefault(role, []).append(t)
    return dict(sorted(needed.items()))


def deployer_roles(types: Iterable[str] = STACK_RESOURCE_TYPES) -> dict[str, list[str]]:
    """``{role: [resource types that need it]}`` the deployer needs on the project to create, update and
    delete resources of ``types``.

    Raises:
        ValueError: a type that no rule covers (names it and where to add it).
    """
    return _roles(types, "deploy")


def preview_roles(types: Iterable[str] = STACK_RESOURCE_TYPES) -> dict[str, list[str]]:
    """``{role: [resource types]}`` the preview identity needs to read resources of ``types`` (read-only
    roles: a preview changes nothing). Secret payloads stay unreadable, so a refresh of a Secret Manager
    version or a Kubernetes Secret is refused (docs/deploying.md, "Step 0 and the bootstrap project").

    Raises:
        ValueError: a type that no rule covers.
    """
    return _roles(types, "preview")
