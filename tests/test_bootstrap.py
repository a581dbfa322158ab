"""The bootstrap project (``infra/bootstrap``), under Pulumi's mocks: the APIs, the deployer's and the
preview identity's roles derived from the stacks' resource types (a new type without a role fails here),
Workload Identity Federation pinned to the repository, the CI variables, and its own first ``up`` in a
fresh project (``tests/fresh_project.py``), and who may act as whom: every CI job's OIDC token against the
provider's condition and the bindings (issue 33: the image job, a branch or pull request naming a deploy
environment, the deployer's conditioned projectIamAdmin, previews without objectViewer). Issue 20, item 6
and the bootstrap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fresh_project import accounts_for, ci_identity_problems, first_up_problems, oidc_claims
from pulumi_harness import StackRun, run_program, run_stack

from infra.bootstrap.config import NAMESPACE, parse_bootstrap_config
from infra.bootstrap.roles import (
    STACK_GRANTED_PROJECT_ROLES,
    STACK_RESOURCE_TYPES,
    deployer_roles,
    preview_roles,
    uncovered_types,
)

NS = NAMESPACE + ":"
CONFIG = {"gcp:project": "my-gcp-project", NS + "githubRepository": "acme/duplexops"}


def _bootstrap(**extra: str) -> StackRun:
    def main() -> dict[str, Any]:
        from infra.bootstrap.__main__ import main as program

        return program()

    return run_program(main, project="duplexops-bootstrap", stack="bootstrap", config={**CONFIG, **extra})


@pytest.fixture(scope="module")
def bootstrap() -> StackRun:
    return _bootstrap(**{NS + "githubRepositoryId": "123456"})


# Documented options (docs/stack-configuration.md's key table) that change WHICH resources a stack declares,
# each with the stacks and values that turn it on; the bootstrap grants roles and enables APIs for the
# types of the committed stack files and of every variant here (issue 33: dnsZone's gcp:dns/ had none).
OPTION_VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "dnsZone": [
        ("dev", {"duplexops:domain": "duplex-dev.example.com", "duplexops:dnsZone": "example-zone"}),
        ("multi-region", {"duplexops:dnsZone": "example-zone"}),
    ],
    "recordings": [("multi-region", {"duplexops:recordings": {"enabled": True, "retentionDays": 30}})],
    "turnTlsSecret": [("multi-region", {"duplexops:turnTlsSecret": "turn-tls"})],
    "provisioningModel": [("scale5-gcp", {"duplexops:provisioningModel": "spot"})],
    "enableApis": [("dev", {"duplexops:enableApis": "false"})],
    "domain": [("scale5-gcp", {"duplexops:domain": "duplex.example.com"})],
    "acmeEmail": [
        ("scale5-gcp", {"duplexops:domain": "duplex.example.com", "duplexops:acmeEmail": "ops@example.com"})
    ],
    "deletionProtection": [("multi-region", {"duplexops:deletionProtection": "false"})],
}

# Documented keys that set values of resources every stack declares anyway (names, sizes, secrets, CIDRs,
# receivers, ...): no resource type of their own. A new documented key fails the test below until it is
# put here or given a variant above.
VALUES_ONLY = {
    "topology", "profile", "maxSessions", "gpu", "acmeDirectory", "alertWebhookUrl", "alertEmailTo",
    "alertEmailFrom", "alertEmailSmarthost", "alertEmailUsername", "alertEmailPassword",
    "alertPagerdutyRoutingKey", "namePrefix", "redisPassword", "grafanaAdminPassword", "tokenSigningKeys",
    "hfToken", "twilioAuthToken", "plivoAuthToken", "telnyxStreamToken", "exotelApiKey",
    "exotelApiToken", "turnSecret", "turnSecretPrevious", "gcp:project", "gcp:region",
    "gcp:zone", "machineType",
    "bootDiskSizeGb", "bootDiskType", "dataDiskSizeGb", "drainGraceSeconds", "maxSessionsPerClient",
    "publicSourceRanges", "waitingRoomS", "waitingRoomSize",
    "subnetCidr", "onpremHost", "onpremUser", "onpremPort", "onpremSshPrivateKey", "onpremHostKey",
    "installDir", "runtimeImage", "readyTimeoutSeconds", "regions", "adminSourceRanges", "releaseChannel",
    "systemMachineType", "maintenanceWindow",
}  # fmt: skip


def documented_keys() -> set[str]:
    """The keys of docs/stack-configuration.md's table (first column; ``a``, ``b`` rows give both)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "stack-configuration.md").read_text()
    keys: set[str] = set()
    for line in text.splitlines():
        if line.startswith("| `"):
            keys.update(k.strip().strip("`") for k in line.split("|")[1].split(","))
    return keys


@pytest.fixture(scope="module")
def declared_types() -> dict[str, set[str]]:
    """``{"committed" | "<option> on <stack>": types}``: what the stacks declare."""
    runs = {
        "committed": {
            r.type
            for stack in ("dev", "scale5-gcp", "scale5-onprem", "multi-region")
            for r in run_stack(stack).resources
        }
    }
    for option, variants in OPTION_VARIANTS.items():
        for stack, overrides in variants:
            runs[f"{option} on {stack}"] = {r.type for r in run_stack(stack, overrides=overrides).resources}
    return runs


def test_every_documented_option_is_classified() -> None:
    """Roles are derived from every documented option, not only the committed stack files: each key of the
    docs' table either has a variant the stacks run with or is known to add no resource type."""
    keys = documented_keys()
    assert {"dnsZone", "recordings", "hfToken"} <= keys  # the table parses
    assert keys - set(OPTION_VARIANTS) - VALUES_ONLY == set(), "classify these keys here"
    assert set(OPTION_VARIANTS) & VALUES_ONLY == set()


def test_every_type_the_stacks_declare_has_its_roles(declared_types: dict[str, set[str]]) -> None:
    """A stack that declares a resource type no role rule covers fails here, and so does a stale
    STACK_RESOURCE_TYPES (the bootstrap grants the roles of that list): the message names what to change.
    The committed stack files and every documented option count (dnsZone: gcp:dns/recordSet)."""
    declared = sorted(set().union(*declared_types.values()))
    assert uncovered_types(declared) == [], "add these types to ROLE_RULES in infra/bootstrap/roles.py"
    assert tuple(declared) == STACK_RESOURCE_TYPES, (
        "STACK_RESOURCE_TYPES in infra/bootstrap/roles.py is not what the stacks declare; set it to:\n"
        + "\n".join(f"    {t!r}," for t in declared)
    )
    assert "gcp:dns/recordSet:RecordSet" in declared_types["dnsZone on dev"]
    assert "gcp:dns/recordSet:RecordSet" not in declared_types["committed"]


def test_dns_zone_gets_its_role_and_api() -> None:
    """Issue 33: with dnsZone set, the deployer may write record sets and the bootstrap enables Cloud DNS
    (403 on a first up before)."""
    from infra.bootstrap.program import BOOTSTRAP_APIS

    assert deployer_roles()["roles/dns.admin"] == ["gcp:dns/recordSet:RecordSet"]
    assert "roles/dns.reader" in preview_roles()
    assert "dns.googleapis.com" in BOOTSTRAP_APIS


def test_stack_granted_project_roles_is_what_the_stacks_grant() -> None:
    """The deployer's projectIamAdmin is limited to STACK_GRANTED_PROJECT_ROLES: the list must be every role
    a stack grants on the project, or that stack's up is refused."""
    granted = sorted(
        {
            str(b.plain["role"])
            for stack, overrides in [
                *((s, {}) for s in ("dev", "scale5-gcp", "scale5-onprem", "multi-region")),
                *(v for variants in OPTION_VARIANTS.values() for v in variants),
            ]
            for b in run_stack(stack, overrides=overrides).of_type("gcp:projects/iAMMember:IAMMember")
        }
    )
    assert tuple(granted) == STACK_GRANTED_PROJECT_ROLES, granted


def test_a_type_without_a_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no role rule for resource type\(s\) gcp:bigquery/dataset:Dataset"):
        deployer_roles([*STACK_RESOURCE_TYPES, "gcp:bigquery/dataset:Dataset"])
    assert uncovered_types(["gcp:compute/network:Network", "gcp:bigquery/table:Table"]) == [
        "gcp:bigquery/table:Table"
    ]


def test_deployer_roles_are_derived_from_the_types() -> None:
    """Exactly the roles the declared types need: acting as the VM's and pools' service accounts
    (iam.serviceAccountUser: the usual first failure), no basic role (owner/editor)."""
    roles = deployer_roles()
    assert set(roles) == {
        "roles/artifactregistry.admin",
        "roles/artifactregistry.writer",
        "roles/cloudscheduler.admin",  # the Spot node's restart job (single-node stacks)
        "roles/compute.admin",
        "roles/container.admin",
        "roles/dns.admin",  # dnsZone's record sets (a documented option, not in the committed files)
        "roles/monitoring.editor",  # the GCE nodes' uptime checks and alert policies (issue 33)
        "roles/iam.serviceAccountAdmin",
        "roles/iam.serviceAccountUser",
        "roles/redis.admin",
        "roles/resourcemanager.projectIamAdmin",
        "roles/secretmanager.admin",
        "roles/serviceusage.serviceUsageAdmin",
        "roles/storage.admin",
    }
    assert roles["roles/iam.serviceAccountUser"] == [
        "gcp:cloudscheduler/job:Job",
        "gcp:compute/instance:Instance",
        "gcp:container/cluster:Cluster",
        "gcp:container/nodePool:NodePool",
    ]
    # A GCE-only project needs neither GKE nor Memorystore.
    gce_only = deployer_roles(
        [t for t in STACK_RESOURCE_TYPES if not t.startswith(("kubernetes:", "gcp:container/", "gcp:redis/"))]
    )
    assert "roles/container.admin" not in gce_only and "roles/redis.admin" not in gce_only
    preview = preview_roles()
    assert all(r.endswith(("viewer", "Viewer", "reader", "Reviewer")) for r in preview), preview


REPO = "acme/duplexops"
DEPLOYER = "duplex-deployer@my-gcp-project.iam.gserviceaccount.com"
IMAGE = "duplex-image@my-gcp-project.iam.gserviceaccount.com"
PREVIEW = "duplex-preview@my-gcp-project.iam.gserviceaccount.com"
PULLER = "duplex-puller@my-gcp-project.iam.gserviceaccount.com"
DEPLOY_ENVIRONMENTS = ("dev", "scale5-gcp", "scale5-onprem", "multi-region")


def test_bootstrap_declares_accounts_roles_and_federation(bootstrap: StackRun) -> None:
    accounts = {a.plain["accountId"]: a for a in bootstrap.of_type("gcp:serviceaccount/account:Account")}
    assert set(accounts) == {"duplex-deployer", "duplex-image", "duplex-preview", "duplex-puller"}
    bindings: dict[str, set[str]] = {}
    for b in bootstrap.of_type("gcp:projects/iAMMember:IAMMember"):
        bindings.setdefault(b.plain["member"], set()).add(b.plain["role"])
    # The image account holds no project role: only writer on the build repository.
    assert bindings == {
        f"serviceAccount:{DEPLOYER}": set(deployer_roles()),
        f"serviceAccount:{PREVIEW}": set(preview_roles()),
    }
    services = {s.plain["service"] for s in bootstrap.of_type("gcp:projects/service:Service")}
    assert {
        "container.googleapis.com",
        "containerfilesystem.googleapis.com",
        "iap.googleapis.com",
        "dns.googleapis.com",
    } <= services
    assert {"sts.googleapis.com", "iamcredentials.googleapis.com"} <= services
    assert not services & {"cloudresourcemanager.googleapis.com", "serviceusage.googleapis.com"}  # step 0
    provider = bootstrap.one("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider").plain
    assert provider["oidc"] == {"issuerUri": "https://token.actions.githubusercontent.com"}
    assert provider["attributeCondition"].startswith(
        'assertion.repository == "acme/duplexops" && assertion.repository_id == "123456" && ('
    )
    assert provider["attributeMapping"]["google.subject"] == "assertion.sub"
    pool = (
        "principal://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/github"
    )
    impersonation = {
        (b.plain["serviceAccountId"].rsplit("/", 1)[-1], b.plain["member"])
        for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if b.plain["role"] == "roles/iam.workloadIdentityUser"
    }
    assert {b.plain["role"] for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")} == {
        "roles/iam.workloadIdentityUser",
        "roles/iam.serviceAccountTokenCreator",  # the deployer on the puller only (below)
    }
    assert impersonation == {
        *((DEPLOYER, f"{pool}/subject/repo:{REPO}:environment:{env}") for env in DEPLOY_ENVIRONMENTS),
        (IMAGE, f"{pool}/subject/repo:{REPO}:ref:refs/heads/main"),
        (PREVIEW, f"{pool}/subject/repo:{REPO}:environment:preview"),
    }


def test_the_image_account_may_push_to_the_build_repository_only(bootstrap: StackRun) -> None:
    """Issue 33: the image job's account is bound to a role that can push images, on the build repository
    the bootstrap creates (the repository vars.IMAGE_REPOSITORY names), and nothing else."""
    [repository] = bootstrap.of_type("gcp:artifactregistry/repository:Repository")
    assert (repository.plain["repositoryId"], repository.plain["location"], repository.plain["format"]) == (
        "duplexops-build",
        "us-central1",
        "DOCKER",
    )
    grants = {
        (g.plain["role"], g.plain["member"], g.plain["repository"])
        for g in bootstrap.of_type("gcp:artifactregistry/repositoryIamMember:RepositoryIamMember")
    }
    assert grants == {
        ("roles/artifactregistry.writer", f"serviceAccount:{IMAGE}", "duplexops-build"),
        ("roles/artifactregistry.reader", f"serviceAccount:{PULLER}", "duplexops-build"),
    }
    assert bootstrap.outputs["imageRepository"] == (
        "us-central1-docker.pkg.dev/my-gcp-project/duplexops-build/duplex-runtime"
    )


def test_the_puller_grants_exist_before_any_stack_up(bootstrap: StackRun) -> None:
    """Issue 33: scale5-onprem granted token-creator on its puller and minted a token in the same update,
    racing IAM propagation (up to 7 min). The bootstrap now holds the puller account (the id the stack mints
    for), its read grant on the build repository, and the deployer's token-creator grant on it only."""
    from infra.program.onprem import PULLER_ACCOUNT_ID

    assert f"{PULLER_ACCOUNT_ID}@my-gcp-project.iam.gserviceaccount.com" == PULLER
    [mint] = [
        b
        for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")
        if b.plain["role"] == "roles/iam.serviceAccountTokenCreator"
    ]
    assert mint.plain["serviceAccountId"].rsplit("/", 1)[-1] == PULLER
    assert mint.plain["member"] == f"serviceAccount:{DEPLOYER}"
    assert bootstrap.outputs["pullerServiceAccount"] == PULLER
    # No project-wide token-creator: the deployer mints tokens of the puller and of no other account.
    assert "roles/iam.serviceAccountTokenCreator" not in deployer_roles()


def test_every_ci_job_may_act_as_the_account_it_names(bootstrap: StackRun) -> None:
    """Issue 33: the fresh-project model of who calls what. Each job of pulumi-up.yml (a push to main) and
    pulumi-preview.yml (a pull request) presents the OIDC subject GitHub gives it; with the variables the
    bootstrap sets, the account it impersonates must accept that subject. Before: the image job (no
    environment: sub repo:R:ref:refs/heads/main) was bound to nothing, so every push failed there."""
    assert ci_identity_problems(bootstrap, REPO, "123456") == []


@pytest.mark.parametrize(
    ("event", "ref", "environment", "expected"),
    [
        ("push", "refs/heads/main", "dev", {DEPLOYER}),
        ("push", "refs/heads/main", None, {IMAGE}),
        ("workflow_dispatch", "refs/heads/main", "multi-region", {DEPLOYER}),
        ("pull_request", "refs/pull/7/merge", "preview", {PREVIEW}),
        # The holes: a pushed branch, or a pull request's job, naming a deploy environment.
        ("push", "refs/heads/evil", "dev", set()),
        ("pull_request", "refs/pull/7/merge", "dev", set()),
        ("workflow_dispatch", "refs/heads/evil", "scale5-gcp", set()),
        ("push", "refs/tags/v1", "dev", set()),
        # pull_request_target carries the base branch's ref but is started by a pull request.
        ("pull_request_target", "refs/heads/main", "dev", set()),
        ("push", "refs/heads/evil", None, set()),
        ("pull_request", "refs/pull/7/merge", None, set()),
    ],
)
def test_only_main_deploys(
    bootstrap: StackRun, event: str, ref: str, environment: str | None, expected: set[str]
) -> None:
    """Issue 33: deploy subjects are conditioned on refs/heads/main. An environment's sub carries no branch
    and an environment accepts any branch unless its policy says otherwise, so the provider's condition
    checks the ref and the event."""
    claims = oidc_claims(REPO, "123456", event=event, ref=ref, environment=environment)
    assert accounts_for(bootstrap, claims) == expected
    other_repo = {**claims, "repository_id": "999"}
    assert accounts_for(bootstrap, other_repo) == set()


def test_project_iam_admin_is_conditioned_on_the_roles_the_stacks_grant(bootstrap: StackRun) -> None:
    """Issue 33: unconditional projectIamAdmin lets the deployer make itself owner. The binding carries an IAM
    condition that lets it change grants of the stacks' roles only."""
    [admin] = [
        b
        for b in bootstrap.of_type("gcp:projects/iAMMember:IAMMember")
        if b.plain["role"] == "roles/resourcemanager.projectIamAdmin"
    ]
    listed = ", ".join(f"'{r}'" for r in STACK_GRANTED_PROJECT_ROLES)
    assert admin.plain["condition"]["expression"] == (
        f"api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', []).hasOnly([{listed}])"
    )
    assert (
        "roles/owner" not in STACK_GRANTED_PROJECT_ROLES and "roles/editor" not in STACK_GRANTED_PROJECT_ROLES
    )
    assert not any(
        r.startswith("roles/resourcemanager.") or r.startswith("roles/iam.")
        for r in STACK_GRANTED_PROJECT_ROLES
    )
    others = [b for b in bootstrap.of_type("gcp:projects/iAMMember:IAMMember") if b is not admin]
    assert all(not b.plain.get("condition") for b in others)


def test_preview_cannot_read_objects() -> None:
    """Issue 33: the recording buckets hold consented call recordings; the preview account gets bucket
    metadata (storage.bucketViewer), not project-wide storage.objectViewer."""
    roles = preview_roles()
    assert "roles/storage.bucketViewer" in roles
    assert "roles/storage.objectViewer" not in roles


def test_bootstrap_exports_what_ci_reads(bootstrap: StackRun) -> None:
    provider = "projects/123456789012/locations/global/workloadIdentityPools/github/providers/github-actions"
    out = bootstrap.outputs
    assert out["workloadIdentityProvider"] == provider
    assert out["githubVariables"]["repository"] == {
        "GCP_WORKLOAD_IDENTITY_PROVIDER": provider,
        "GCP_IMAGE_SERVICE_ACCOUNT": IMAGE,
        "IMAGE_REPOSITORY": "us-central1-docker.pkg.dev/my-gcp-project/duplexops-build/duplex-runtime",
    }
    assert out["githubVariables"]["environments"]["multi-region"] == {"GCP_SERVICE_ACCOUNT": DEPLOYER}
    assert out["githubVariables"]["environments"]["preview"] == {"GCP_SERVICE_ACCOUNT": PREVIEW}
    commands = out["ghCommands"]
    assert f"gh variable set --repo {REPO} GCP_SERVICE_ACCOUNT --env dev --body {DEPLOYER}" in commands
    # Each deploy environment admits main only (a second guard beside the provider's condition).
    assert (
        f"gh api -X POST repos/{REPO}/environments/dev/deployment-branch-policies -f name=main -f type=branch"
    ) in commands
    # Pulumi's credentials are environment secrets, never repository secrets.
    secrets = [c for c in commands if c.startswith("gh secret set")]
    assert secrets and all(" --env " in c for c in secrets)
    assert f"gh secret set --repo {REPO} PULUMI_CONFIG_PASSPHRASE --env preview" in secrets


def test_bootstrap_passes_the_fresh_project(bootstrap: StackRun) -> None:
    """The bootstrap's own first up, after step 0 only: every API it uses is enabled first by itself."""
    assert first_up_problems(bootstrap) == {name: [] for name in first_up_problems(bootstrap)}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"gcp:project": "my-gcp-project"}, "duplexops-bootstrap:githubRepository: Field required"),
        (
            {**CONFIG, NS + "githubRepository": "not a repo"},
            "duplexops-bootstrap:githubRepository: 'not a repo':",
        ),
        ({**CONFIG, NS + "deployEnvironments": "dev"}, "is not a JSON list"),
        ({**CONFIG, NS + "poolId": "gcp-pool"}, "duplexops-bootstrap:poolId: 'gcp-pool':"),
    ],
)
def test_bootstrap_config_errors_name_the_key(values: dict[str, str], expected: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_bootstrap_config(values)
    assert expected in str(caught.value)


def test_bootstrap_config_environments() -> None:
    config = parse_bootstrap_config({**CONFIG, NS + "deployEnvironments": '["prod"]'})
    assert config.deploy_environments == ("prod",)
    with pytest.raises(ValueError, match="previewEnvironment 'prod' is also in deployEnvironments"):
        parse_bootstrap_config(
            {**CONFIG, NS + "deployEnvironments": '["prod"]', NS + "previewEnvironment": "prod"}
        )


def test_preview_identity_cannot_write_to_the_clusters() -> None:
    """Issue 20 item 6: previews do not dry-run against the clusters. The preview identity holds no
    Kubernetes write permission (a pull request's code runs with it, so write roles would let any branch
    change production past the deploy environments' reviewers); the API server refuses the server-side
    dry-run with 403 and pulumi-kubernetes previews that object client-side.
    Why: docs/deploying.md, "Step 0 and the bootstrap project"."""
    roles = preview_roles()
    assert "roles/container.viewer" in roles
    assert "kubernetes:apps/v1:Deployment" in roles["roles/container.viewer"]
    assert not {"roles/container.admin", "roles/container.developer"} & set(roles)


DNS_ZONE = {"duplexops:domain": "duplex-dev.example.com", "duplexops:dnsZone": "example-zone"}


@pytest.mark.parametrize(
    ("stack", "options"),
    [
        ("dev", {}),
        ("scale5-gcp", {}),
        ("multi-region", {}),
        # Issue 33: with dnsZone, Cloud DNS too (the bootstrap enabled only the committed files' APIs).
        ("dev", DNS_ZONE),
        ("multi-region", {"duplexops:dnsZone": "example-zone"}),
    ],
)
def test_after_the_bootstrap_a_stack_needs_no_api_of_its_own(stack: str, options: dict[str, str]) -> None:
    """The bootstrap enables every API the stacks use, under every documented option: a stack built with
    enableApis false passes the fresh project's API check once step 0 and the bootstrap are done (and fails
    it before)."""
    from fresh_project import apis_enabled_before_use

    from infra.bootstrap.program import BOOTSTRAP_APIS
    from infra.gcp_apis import STEP_0_APIS

    run = run_stack(stack, overrides={**options, "duplexops:enableApis": "false"})
    assert run.of_type("gcp:projects/service:Service") == []
    assert apis_enabled_before_use(run, enabled=(*STEP_0_APIS, *BOOTSTRAP_APIS)) == []
    assert apis_enabled_before_use(run)  # a fresh project without the bootstrap


def test_the_bootstrap_is_a_pulumi_project_of_its_own() -> None:
    """``cd infra/bootstrap && pulumi up`` finds its program and the repository's virtualenv."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    project = yaml.safe_load((root / "infra" / "bootstrap" / "Pulumi.yaml").read_text())
    assert project["name"] == "duplexops-bootstrap" and project["runtime"]["name"] == "python"
    assert (root / "infra" / "bootstrap" / project["main"]).is_file()
    venv = (root / "infra" / "bootstrap" / project["runtime"]["options"]["virtualenv"]).resolve()
    main_project = yaml.safe_load((root / "Pulumi.yaml").read_text())
    assert venv == (root / main_project["runtime"]["options"]["virtualenv"]).resolve()


def test_a_first_up_with_dns_zone_passes_the_fresh_project() -> None:
    """With enableApis (the default) the stack enables Cloud DNS itself before its record sets."""
    run = run_stack("dev", overrides=DNS_ZONE)
    assert run.of_type("gcp:dns/recordSet:RecordSet")
    assert first_up_problems(run) == {name: [] for name in first_up_problems(run)}
