"""A model of a brand-new GCP project, which every stack's first ``pulumi up`` must pass.

Mocks accept any request; a new project does not. ``FRESH_PROJECT_CHECKS`` are the rules a first ``up``
meets there, each a named check over what a program declared under the mocks (``pulumi_harness.StackRun``,
with every resource's dependencies, parent and provider recorded): it returns one message per violation,
naming the resource and the rule. ``first_up_problems(run)`` runs them all.

What the model holds (each check's docstring cites the GCP rule):

- only the step-0 APIs are enabled (``infra.gcp_apis.STEP_0_APIS``); every other API a resource needs is
  enabled by a ``projects.Service`` of the stack that the engine creates before the resource;
- the secure-by-default organization policies are on (organizations created since 3 May 2024): no
  ``allUsers``/``allAuthenticatedUsers`` member, uniform bucket-level access and public access prevention,
  no service-account keys;
- a GKE node pool starts with ``initialNodeCount`` (or ``nodeCount``) nodes per zone and none otherwise;
- GKE's NEG controller creates a standalone NEG only in a zone with endpoints unless the Service's NEG
  annotation pre-provisions the zone;
- who calls what: each CI job's OIDC token (its ``sub``, ``ref`` and event, as GitHub forms them) meets the
  bootstrap's provider condition and the workload-identity bindings of the account the job impersonates
  (``ci_identity_problems``), and a token of another branch or of a pull request's job may act as no
  deploying account (``accounts_for``);
- GPU quota: every GPU quota is 0, ``GPUS_ALL_REGIONS`` included, until the operator requests what
  ``duplex preflight`` says (``infra.preflight``); the GPUs the program declares (each instance's, each
  node pool at its maximum plus its upgrade surge) must fit in what preflight asked for
  (``gpu_quota_after_preflight``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulumi_harness import RecordedResource, StackRun

from infra.capacity.gcp import ACCELERATOR_TYPES, MACHINE_TYPES
from infra.gcp_apis import SERVICE_TYPE, STEP_0_APIS, required_apis, step_0_command
from infra.preflight import ALL_REGIONS, PROJECT_METRIC, GpuNeed, gpu_needs, quota_metrics
from infra.stack_config import parse_stack_config

__all__ = [
    "FRESH_PROJECT_CHECKS",
    "Check",
    "CiJob",
    "accounts_for",
    "apis_enabled_before_use",
    "cel_admits",
    "ci_identity_problems",
    "ci_jobs",
    "oidc_claims",
    "buckets_uniform_and_private",
    "first_up_problems",
    "global_backends_list_existing_negs",
    "declared_gpus",
    "gpu_quota_after_preflight",
    "gpu_quota_problems",
    "preflight_requests",
    "no_public_members",
    "no_service_account_keys",
    "node_pools_start_with_nodes",
]

BUCKET = "gcp:storage/bucket:Bucket"
SA_KEY = "gcp:serviceaccount/key:Key"
CLUSTER = "gcp:container/cluster:Cluster"
NODE_POOL = "gcp:container/nodePool:NodePool"
BACKEND_SERVICE = "gcp:compute/backendService:BackendService"
NEG = "gcp:compute/networkEndpointGroup:NetworkEndpointGroup"
K8S_SERVICE = "kubernetes:core/v1:Service"
NEG_ANNOTATION = "cloud.google.com/neg"
PUBLIC_MEMBERS = ("allUsers", "allAuthenticatedUsers")


@dataclass(frozen=True)
class Check:
    """One rule of the fresh project: its name and the function that lists its violations in a run."""

    name: str
    check: Callable[[StackRun], list[str]]


# --- APIs ----------------------------------------------------------------------------------------------


def apis_enabled_before_use(run: StackRun, enabled: Iterable[str] = STEP_0_APIS) -> list[str]:
    """Every API a resource needs (``infra.gcp_apis.required_apis``) is enabled before the resource is
    created: either one of ``enabled`` (a new project: the step-0 APIs only) or by a
    ``gcp:projects/service:Service`` of the stack that the engine creates first (the resource depends on
    it directly, or through its parent, provider or inputs). A step-0 API declared as a Service is a
    violation too: the call that enables it needs it.

    GCP rule: a request to a disabled API fails with 403 ``SERVICE_DISABLED``
    (cloud.google.com/service-usage/docs/enable-disable); a new project has only the APIs its creator
    enabled, and Service Usage and Cloud Resource Manager must be enabled outside any program
    (terraform-provider-google #6101, #11435)."""
    enabled = frozenset(enabled)
    services: dict[str, list[str]] = {}
    problems = []
    for r in run.of_type(SERVICE_TYPE):
        api = str(r.plain.get("service"))
        services.setdefault(api, []).append(r.urn)
        if api in STEP_0_APIS:
            problems.append(
                f"{r.type} {r.name} enables {api}, a step-0 API no program can enable (the call needs it): "
                f"remove it and run `{step_0_command()}` once (step 0)."
            )
    for r in run.resources:
        if not r.custom:
            continue
        apis = required_apis(r.type, r.plain)
        missing = sorted(api for api in apis if api not in enabled)
        if not missing:
            continue
        before = run.ordered_after(r)
        for api in missing:
            if not services.get(api):
                problems.append(
                    f"{r.type} {r.name} needs {api} ({apis[api]}), which a fresh project does not have and "
                    "the stack does not enable: add it to the APIs the program enables."
                )
            elif not before & set(services[api]):
                problems.append(
                    f"{r.type} {r.name} needs {api} ({apis[api]}) but is not ordered after the Service that "
                    "enables it: pass the APIs' ResourceOptions (depends_on) to it or to its parent."
                )
    return problems


# --- secure-by-default organization policies -----------------------------------------------------------


def _public_members(value: Any, path: str = "") -> list[str]:
    """Paths inside ``value`` holding ``allUsers`` or ``allAuthenticatedUsers`` (as a member, or inside an
    IAM policy document)."""
    found = []
    if isinstance(value, Mapping):
        for key, item in value.items():
            found += _public_members(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _public_members(item, f"{path}[{i}]")
    elif isinstance(value, str) and (
        value in PUBLIC_MEMBERS or (path.endswith("policyData") and any(m in value for m in PUBLIC_MEMBERS))
    ):
        found.append(path)
    return found


def no_public_members(run: StackRun) -> list[str]:
    """No IAM member, binding or policy of the stack grants ``allUsers`` or ``allAuthenticatedUsers``.

    GCP rule: organizations created on or after 3 May 2024 enforce the secure-by-default policies, among
    them domain-restricted sharing (``constraints/iam.allowedPolicyMemberDomains``: only the organization's
    own principals) and public access prevention on Cloud Storage
    (cloud.google.com/resource-manager/docs/secure-by-default-organizations); such a grant fails there."""
    return [
        f"{r.type} {r.name} grants {path} = public principal: refused by domain-restricted sharing and "
        "public access prevention (secure-by-default organizations); serve public content another way."
        for r in run.resources
        if r.custom and r.type.startswith("gcp:")
        for path in _public_members(r.plain)
    ]


def buckets_uniform_and_private(run: StackRun) -> list[str]:
    """Every Cloud Storage bucket sets ``uniformBucketLevelAccess: true`` and ``publicAccessPrevention:
    enforced``.

    GCP rule: secure-by-default organizations enforce ``constraints/storage.uniformBucketLevelAccess`` (a
    bucket created without it is refused) and ``constraints/storage.publicAccessPrevention``
    (cloud.google.com/resource-manager/docs/secure-by-default-organizations); setting both on the bucket
    makes it behave the same in a project outside such an organization."""
    problems = []
    for r in run.of_type(BUCKET):
        if r.plain.get("uniformBucketLevelAccess") is not True:
            problems.append(
                f"{BUCKET} {r.name}: uniformBucketLevelAccess is not true (storage.uniformBucketLevelAccess "
                "refuses the bucket)."
            )
        if r.plain.get("publicAccessPrevention") != "enforced":
            problems.append(
                f"{BUCKET} {r.name}: publicAccessPrevention is {r.plain.get('publicAccessPrevention')!r}, "
                "not 'enforced' (storage.publicAccessPrevention)."
            )
    return problems


def no_service_account_keys(run: StackRun) -> list[str]:
    """The stack creates no service-account key (workload identity and attached service accounts instead).

    GCP rule: secure-by-default organizations enforce ``constraints/iam.disableServiceAccountKeyCreation``
    (cloud.google.com/resource-manager/docs/secure-by-default-organizations)."""
    return [
        f"{SA_KEY} {r.name}: service-account key creation is disabled (iam.disableServiceAccountKeyCreation)."
        for r in run.of_type(SA_KEY)
    ]


# --- GKE -----------------------------------------------------------------------------------------------


def _int(value: Any) -> int:
    """A count from the inputs (the wire gives numbers as floats); 0 when absent or not a number."""
    try:
        return int(float(value)) if value is not None and not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        return 0


def _pool_start(pool: Mapping[str, Any]) -> int:
    """Nodes per zone a new pool starts with: ``initialNodeCount`` or ``nodeCount``, else none."""
    return max(_int(pool.get("initialNodeCount")), _int(pool.get("nodeCount")))


def _zones(resource: Mapping[str, Any]) -> int:
    """How many zones a cluster or pool spans: its ``nodeLocations``, else 1 for a zonal location and 3 for a
    regional one (GKE's default for a regional cluster)."""
    locations = resource.get("nodeLocations")
    if isinstance(locations, list) and locations:
        return len(locations)
    location = str(resource.get("location", ""))
    return 1 if location.count("-") >= 2 else 3


def node_pools_start_with_nodes(run: StackRun) -> list[str]:
    """Each node pool starts with at least its autoscaling minimum, and each cluster with at least one node.

    A pool without ``initialNodeCount`` (or ``nodeCount``) is created empty and its autoscaling minimum is
    not applied at creation (terraform-provider-google #8270, #11594); a cluster whose default pool is
    removed (``removeDefaultNodePool``) has only its separate pools' nodes. Minima: ``minNodeCount`` per
    zone or ``totalMinNodeCount`` over the pool's zones (cloud.google.com/kubernetes-engine/docs/concepts/
    cluster-autoscaler)."""
    problems = []
    pools = run.of_type(NODE_POOL)
    for cluster in run.of_type(CLUSTER):
        c = cluster.plain
        nodes = (
            0
            if c.get("removeDefaultNodePool") is True
            else max(1, _int(c.get("initialNodeCount"))) * _zones(c)
        )
        for pool in pools:
            if cluster.urn not in pool.dependencies:
                continue
            p = pool.plain
            start = _pool_start(p) * _zones({**p, "location": p.get("location", c.get("location"))})
            nodes += start
            autoscaling = p.get("autoscaling") or {}
            per_zone, total = (
                _int(autoscaling.get("minNodeCount")),
                _int(autoscaling.get("totalMinNodeCount")),
            )
            minimum = max(per_zone * _zones({**p, "location": p.get("location", c.get("location"))}), total)
            if start < minimum:
                problems.append(
                    f"{NODE_POOL} {pool.name} starts with {start} node(s), below its autoscaling minimum "
                    f"{minimum}: without initialNodeCount a pool is created empty; set initialNodeCount."
                )
        if nodes == 0:
            problems.append(
                f"{CLUSTER} {cluster.name} has no node at creation (default pool removed, no pool with an "
                "initial node count): nothing can be scheduled."
            )
    return problems


def _neg_annotation(service: RecordedResource) -> dict[str, Any]:
    annotations = (service.plain.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(NEG_ANNOTATION)
    try:
        value = json.loads(text) if isinstance(text, str) else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _cluster_of(run: StackRun, resource: RecordedResource) -> RecordedResource | None:
    """The GKE cluster a Kubernetes object is applied to: the cluster its provider is built from."""
    clusters = {c.urn: c for c in run.of_type(CLUSTER)}
    if not resource.provider:
        return None
    provider = run.by_urn().get(resource.provider.rsplit("::", 1)[0])
    if provider is None:
        return None
    found = [clusters[urn] for urn in run.ordered_after(provider) if urn in clusters]
    return found[0] if len(found) == 1 else None


def _pool_zones(run: StackRun, cluster: RecordedResource) -> set[str]:
    """Zones of every node pool of ``cluster`` (its ``nodeLocations``)."""
    return {
        str(zone)
        for pool in run.of_type(NODE_POOL)
        if cluster.urn in pool.dependencies
        for zone in pool.plain.get("nodeLocations") or []
    }


def _awaited_pods(run: StackRun, service: RecordedResource, before: set[str]) -> bool:
    """Whether a Deployment that ``service`` selects, on the same cluster, with at least one replica, is
    created (pulumi-kubernetes waits for its rollout unless ``pulumi.com/skipAwait``) before ``before``'s
    owner."""
    selector = (service.plain.get("spec") or {}).get("selector") or {}
    for deployment in run.of_type("kubernetes:apps/v1:Deployment"):
        d = deployment.plain
        labels = (((d.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
        annotations = (d.get("metadata") or {}).get("annotations") or {}
        if (
            deployment.urn in before
            and deployment.provider == service.provider
            and selector
            and selector.items() <= labels.items()
            and _int((d.get("spec") or {}).get("replicas", 1)) >= 1
            and annotations.get("pulumi.com/skipAwait") != "true"
        ):
            return True
    return False


def _region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def _neg_zones(run: StackRun, backend_service: RecordedResource) -> dict[str, set[str]]:
    """``{NEG name: zones}`` where a NEG exists before ``backend_service`` is created: NEGs the stack
    declares; for a Kubernetes Service created first, the zones its NEG annotation pre-provisions
    (``"zones": ["*"]``: every zone of its cluster's region; zones outside it are ignored by the
    controller), and the one zone of its cluster's nodes when a Deployment it selects is rolled out
    first."""
    before = run.ordered_after(backend_service)
    exists: dict[str, set[str]] = {}
    for neg in run.of_type(NEG):
        if neg.urn in before:
            exists.setdefault(str(neg.plain.get("name")), set()).add(str(neg.plain.get("zone")))
    for service in run.of_type(K8S_SERVICE):
        annotation = _neg_annotation(service)
        cluster = _cluster_of(run, service)
        if service.urn not in before or cluster is None:
            continue
        region = str(cluster.plain.get("location"))
        names = [
            str(p["name"]) for p in (annotation.get("exposed_ports") or {}).values() if (p or {}).get("name")
        ]
        zones = {
            f"{region}-*" if z == "*" else z
            for z in annotation.get("zones") or []
            if z == "*" or _region_of(z) == region
        }
        pool_zones = _pool_zones(run, cluster)
        if len(pool_zones) == 1 and _awaited_pods(run, service, before):
            zones |= pool_zones  # every pod is in the one zone of the cluster's nodes, and one is running
        for name in names:
            exists.setdefault(name, set()).update(zones)
    return exists


def global_backends_list_existing_negs(run: StackRun) -> list[str]:
    """Every zonal NEG a global backend service lists exists when the backend service is created.

    GCP rule: GKE's NEG controller creates a standalone NEG (``cloud.google.com/neg`` annotation with
    ``exposed_ports``) only in zones where the Service has endpoints, unless the annotation's ``zones`` field
    pre-provisions it (kubernetes/ingress-gce PR 3152); a backend service that names a NEG in another zone
    gets a 404 (GoogleCloudPlatform/gke-autoneg-controller #50). With fewer pods than zones, some listed
    zone has none; the model counts a zone as having endpoints only when a rolled-out Deployment's pods
    can be nowhere else (the cluster's nodes are all in that zone). Spreading pods over zones does not
    count: a zone without a node of the pool is no topology domain, so a spread constraint still lets every
    pod land in one zone."""
    problems = []
    for backend_service in run.of_type(BACKEND_SERVICE):
        exists = _neg_zones(run, backend_service)
        for backend in backend_service.plain.get("backends") or []:
            group = str(backend.get("group", ""))
            parts = group.split("/")
            if "zones" not in parts or "networkEndpointGroups" not in parts:
                continue
            zone, name = parts[parts.index("zones") + 1], parts[parts.index("networkEndpointGroups") + 1]
            zones = exists.get(name, set())
            if zone in zones or f"{_region_of(zone)}-*" in zones:
                continue
            problems.append(
                f"{BACKEND_SERVICE} {backend_service.name} lists NEG {name} in {zone}, which nothing creates "
                "before it: GKE's NEG controller makes a NEG only in zones with endpoints (404 otherwise); "
                'pre-provision it ("zones" in the cloud.google.com/neg annotation) or declare the NEG.'
            )
    return problems


# --- GPU quota ----------------------------------------------------------------------------------------

INSTANCE = "gcp:compute/instance:Instance"
_GPU_OF_ACCELERATOR = {accelerator: gpu for gpu, accelerator in ACCELERATOR_TYPES.items()}


def declared_gpus(run: StackRun) -> list[GpuNeed]:
    """The GPUs ``run`` declares, per (region, metric), counted from the resources themselves: each
    ``Instance``'s ``guestAccelerators`` (or its machine type's own GPUs) under its ``scheduling``
    (``SPOT``/``preemptible``: the preemptible metric), each node pool at ``totalMaxNodeCount`` (or
    ``maxNodeCount`` per zone) plus ``upgradeSettings.maxSurge`` per zone, times its nodes' GPUs; then the
    ``GPUS_ALL_REGIONS`` total. What GCE and GKE would take at the stack's ceiling, whatever the stack's
    configuration claims."""
    rows: dict[tuple[str, str], GpuNeed] = {}

    def add(region: str, gpu: str, count: int, spot: bool, name: str) -> None:
        metric, fallback = quota_metrics(gpu, "spot" if spot else "standard")
        old = rows.get((region, metric))
        total = count + (old.count if old else 0)
        rows[(region, metric)] = GpuNeed(region, metric, total, name, fallback)

    def per_node(config: Mapping[str, Any]) -> tuple[str | None, int]:
        accelerators = [a for a in config.get("guestAccelerators") or [] if isinstance(a, Mapping)]
        if accelerators:
            gpu = _GPU_OF_ACCELERATOR.get(str(accelerators[0].get("type", "")).rsplit("/", 1)[-1])
            return gpu, sum(_int(a.get("count")) for a in accelerators)
        machine = MACHINE_TYPES.get(str(config.get("machineType")))  # not listed: a type without GPUs
        return (machine.gpu, machine.gpu_count[0]) if machine and machine.gpu else (None, 0)

    for vm in run.of_type(INSTANCE):
        gpu, count = per_node(vm.plain)
        scheduling = vm.plain.get("scheduling") or {}
        spot = scheduling.get("provisioningModel") in ("SPOT", "FLEX_START") or scheduling.get("preemptible")
        if gpu and count:
            add(_region_of(str(vm.plain.get("zone"))), gpu, count, bool(spot), vm.name)
    for pool in run.of_type(NODE_POOL):
        p = pool.plain
        node = p.get("nodeConfig") or {}
        gpu, count = per_node(node)
        if not gpu or not count:
            continue
        zones = _zones(p)
        autoscaling = p.get("autoscaling") or {}
        nodes = max(_int(autoscaling.get("totalMaxNodeCount")), _int(autoscaling.get("maxNodeCount")) * zones)
        nodes = (
            max(nodes, _pool_start(p) * zones)
            + _int((p.get("upgradeSettings") or {}).get("maxSurge")) * zones
        )
        add(str(p.get("location")), gpu, nodes * count, bool(node.get("spot")), pool.name)
    needs = list(rows.values())
    if needs:
        needs.append(GpuNeed(ALL_REGIONS, PROJECT_METRIC, sum(n.count for n in needs), "all"))
    return needs


def preflight_requests(run: StackRun) -> dict[tuple[str, str], int]:
    """What ``duplex preflight`` tells the operator of a fresh project (every GPU quota 0, no usage) to
    request for ``run``'s stack: ``{(region or ALL_REGIONS, metric): limit}``, computed by
    ``infra.preflight.gpu_needs`` from the stack's configuration."""
    config = parse_stack_config(run.config, stack=run.stack)
    return {(n.region, n.metric): n.count for n in gpu_needs(config)}


def gpu_quota_problems(run: StackRun, granted: Mapping[tuple[str, str], int]) -> list[str]:
    """The GPUs ``run`` declares (``declared_gpus``) that the ``granted`` quotas (``{(region, metric):
    limit}``; every other GPU quota 0, as in a new project) do not hold. A Spot GPU fits its preemptible
    metric or, failing that, the on-demand one (cloud.google.com/compute/docs/instances/create-use-spot).

    GCP rule: creating a GPU VM or node beyond a regional GPU quota or ``GPUS_ALL_REGIONS`` fails with
    ``QUOTA_EXCEEDED``; a new project has ``GPUS_ALL_REGIONS`` = 0 (cloud.google.com/compute/resource-usage,
    "GPU quota"); a GKE pool that cannot grow to its maximum leaves callers without slots at peak."""
    problems = []
    for need in declared_gpus(run):
        room = max(
            granted.get((need.region, need.metric), 0), granted.get((need.region, need.fallback or ""), 0)
        )
        if need.count > room:
            problems.append(
                f"{need.region}: {need.metric} {need.count} declared ({need.why}), the quota holds {room}: "
                "`duplex preflight` must ask for what the program declares (infra/preflight/needs.py)"
            )
    return problems


def gpu_quota_after_preflight(run: StackRun) -> list[str]:
    """A fresh project's GPU quotas after the operator requested what ``duplex preflight`` said
    (``preflight_requests``): the stack's declared GPUs must fit (``gpu_quota_problems``). A program that is
    not a ``duplexops`` stack (the bootstrap: no ``duplexops:topology``) declares no GPU and needs none."""
    if "duplexops:topology" not in run.config:
        return [
            f"{need.region}: {need.metric} {need.count} declared outside a stack"
            for need in declared_gpus(run)
        ]
    return gpu_quota_problems(run, preflight_requests(run))


FRESH_PROJECT_CHECKS: tuple[Check, ...] = (
    Check("apis-enabled-before-use", apis_enabled_before_use),
    Check("no-public-members", no_public_members),
    Check("buckets-uniform-and-private", buckets_uniform_and_private),
    Check("no-service-account-keys", no_service_account_keys),
    Check("node-pools-start-with-nodes", node_pools_start_with_nodes),
    Check("global-backends-list-existing-negs", global_backends_list_existing_negs),
    Check("gpu-quota-after-preflight", gpu_quota_after_preflight),
)
"""The rules of a fresh project, in the order a first ``up`` would meet them."""


def first_up_problems(run: StackRun) -> dict[str, list[str]]:
    """``{check name: violations}`` of ``run`` under every check of ``FRESH_PROJECT_CHECKS`` (empty lists
    included)."""
    return {c.name: c.check(run) for c in FRESH_PROJECT_CHECKS}


# --- who calls what: CI's OIDC subjects and the bootstrap's bindings -------------------------------------

WORKFLOWS_DIR = Path(__file__).resolve().parents[1] / ".github" / "workflows"
AUTH_ACTION = "google-github-actions/auth"


@dataclass(frozen=True)
class CiJob:
    """A CI job that exchanges GitHub's OIDC token for Google credentials, as a real run would present it.

    ``claims``: the token's claims the bootstrap reads (``sub``, ``ref``, ``event_name``, ``repository``,
    ``repository_id``; docs.github.com/actions/reference/security/oidc: ``sub`` is
    ``repo:R:environment:E`` for a job in an environment, ``repo:R:pull_request`` for a pull request's job,
    else ``repo:R:ref:<ref>``); ``account_variable``: the ``vars.*`` its auth step names as
    ``service_account``; ``environment``: its GitHub environment (None: none)."""

    workflow: str
    job: str
    environment: str | None
    account_variable: str
    claims: dict[str, str]


def oidc_claims(
    repository: str, repository_id: str, *, event: str, ref: str, environment: str | None
) -> dict[str, str]:
    """The claims a job's token carries (the subset the bootstrap's provider and bindings read)."""
    if environment is not None:
        sub = f"repo:{repository}:environment:{environment}"
    elif event == "pull_request":
        sub = f"repo:{repository}:pull_request"
    else:
        sub = f"repo:{repository}:ref:{ref}"
    return {
        "sub": sub,
        "ref": ref,
        "event_name": event,
        "repository": repository,
        "repository_id": repository_id,
    }


def _load_workflow(name: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load((WORKFLOWS_DIR / name).read_text())
    if True in data:  # YAML 1.1 reads the key `on` as True
        data["on"] = data.pop(True)
    return data


def _var_name(expression: str) -> str:
    match = re.fullmatch(r"\$\{\{ vars\.([A-Z_]+) \}\}", expression.strip())
    assert match, f"service_account must be ${{{{ vars.NAME }}}}, got {expression!r}"
    return match[1]


def _auth_variable(job: Mapping[str, Any]) -> str | None:
    steps = [s for s in job.get("steps", []) if str(s.get("uses", "")).split("@")[0] == AUTH_ACTION]
    return _var_name(steps[0]["with"]["service_account"]) if steps else None


def ci_jobs(repository: str, repository_id: str, *, branch: str = "main", pr: int = 7) -> list[CiJob]:
    """Every job of ``pulumi-up.yml`` (a push to ``branch``, with the reusable ``pulumi-up-stack.yml``'s job
    per stack) and ``pulumi-preview.yml`` (pull request ``pr``) that authenticates to Google Cloud."""
    jobs = []
    up_ref = f"refs/heads/{branch}"
    stack_job = _load_workflow("pulumi-up-stack.yml")["jobs"]["up"]
    for name, job in _load_workflow("pulumi-up.yml")["jobs"].items():
        if str(job.get("uses", "")).endswith("/pulumi-up-stack.yml"):
            env_expr = str(stack_job.get("environment", ""))
            environment = env_expr.replace("${{ inputs.stack }}", job["with"]["stack"]) or None
            variable = _auth_variable(stack_job)
        else:
            environment = job.get("environment")
            variable = _auth_variable(job)
        if variable is not None:
            claims = oidc_claims(repository, repository_id, event="push", ref=up_ref, environment=environment)
            jobs.append(CiJob("pulumi-up.yml", name, environment, variable, claims))
    for name, job in _load_workflow("pulumi-preview.yml")["jobs"].items():
        variable = _auth_variable(job)
        if variable is not None:
            environment = job.get("environment")
            ref = f"refs/pull/{pr}/merge"
            claims = oidc_claims(
                repository, repository_id, event="pull_request", ref=ref, environment=environment
            )
            jobs.append(CiJob("pulumi-preview.yml", name, environment, variable, claims))
    return jobs


_CEL_TOKEN = re.compile(r'\s*(&&|\|\||\(|\)|==|"[^"]*"|assertion\.[a-z_]+)')


def cel_admits(condition: str, claims: Mapping[str, str]) -> bool:
    """Evaluate a provider attribute condition over ``claims``: the CEL subset the bootstrap writes
    (``assertion.<claim> == "<text>"``, ``&&``, ``||``, parentheses; ``&&`` binds tighter, as in CEL).

    Raises:
        ValueError: anything outside that subset (so a new form is modelled, not misread)."""
    tokens: list[str] = []
    position = 0
    while position < len(condition.rstrip()):
        match = _CEL_TOKEN.match(condition, position)
        if match is None:
            raise ValueError(f"CEL outside the modelled subset at {condition[position:]!r}")
        tokens.append(match[1])
        position = match.end()

    def take(expected: str | None = None) -> str:
        token = tokens.pop(0)
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r} in {condition!r}")
        return token

    def primary() -> bool:
        if tokens[0] == "(":
            take("(")
            value = disjunction()
            take(")")
            return value
        claim = take().removeprefix("assertion.")
        take("==")
        return claims.get(claim) == take().strip('"')

    def conjunction() -> bool:
        value = primary()
        while tokens and tokens[0] == "&&":
            take("&&")
            value = primary() and value
        return value

    def disjunction() -> bool:
        value = conjunction()
        while tokens and tokens[0] == "||":
            take("||")
            value = conjunction() or value
        return value

    result = disjunction()
    if tokens:
        raise ValueError(f"trailing {tokens} in {condition!r}")
    return result


def accounts_for(bootstrap: StackRun, claims: Mapping[str, str]) -> set[str]:
    """The service accounts (e-mail) a token with ``claims`` may act as: none when the provider's attribute
    condition refuses it, else those with a ``roles/iam.workloadIdentityUser`` binding of its ``sub``.

    GCP rule: the condition is evaluated at the token exchange, before any binding; ``principal://.../
    subject/S`` matches ``google.subject`` (mapped from ``assertion.sub``) exactly
    (cloud.google.com/iam/docs/workload-identity-federation#conditions, #impersonation)."""
    provider = bootstrap.one("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider").plain
    if not cel_admits(str(provider.get("attributeCondition", "true")), claims):
        return set()
    assert provider["attributeMapping"]["google.subject"] == "assertion.sub"
    return {
        str(b.plain["serviceAccountId"]).rsplit("/", 1)[-1]
        for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if b.plain["role"] == "roles/iam.workloadIdentityUser"
        and str(b.plain["member"]).endswith(f"/subject/{claims['sub']}")
    }


def ci_identity_problems(bootstrap: StackRun, repository: str, repository_id: str) -> list[str]:
    """Each CI job that authenticates may act as the account its ``service_account`` variable names, with
    the variables the bootstrap tells GitHub to set (``githubVariables``: an environment's variable
    overrides the repository's). One message per job that would fail its token exchange or impersonation
    (403 ``iam.serviceAccounts.getAccessToken``), or that names no account at all."""
    variables = bootstrap.outputs["githubVariables"]
    problems = []
    for job in ci_jobs(repository, repository_id):
        scope = {**variables["repository"], **variables["environments"].get(job.environment or "", {})}
        account = scope.get(job.account_variable)
        where = f"{job.workflow} job {job.job} (sub {job.claims['sub']}, ref {job.claims['ref']})"
        if not account:
            problems.append(f"{where}: vars.{job.account_variable} is not set by the bootstrap there")
            continue
        allowed = accounts_for(bootstrap, job.claims)
        if account not in allowed:
            problems.append(
                f"{where} impersonates {account}, but its token may act as {sorted(allowed) or 'nothing'}"
            )
    return problems
