"""The bootstrap project (``infra/bootstrap``), under Pulumi's mocks: the APIs, the deployer's and the
preview identity's roles derived from the stacks' resource types (a new type without a role fails here),
Workload Identity Federation pinned to the repository, the CI variables, and its own first ``up`` in a
fresh project (``tests/fresh_project.py``). Issue 20, item 6 and the bootstrap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fresh_project import first_up_problems
from pulumi_harness import StackRun, run_program, run_stack

from infra.bootstrap.config import NAMESPACE, parse_bootstrap_config
from infra.bootstrap.roles import STACK_RESOURCE_TYPES, deployer_roles, preview_roles, uncovered_types

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


def test_every_type_the_stacks_declare_has_its_roles() -> None:
    """A stack that declares a resource type no role rule covers fails here, and so does a stale
    STACK_RESOURCE_TYPES (the bootstrap grants the roles of that list): the message names what to change."""
    declared = sorted(
        {
            r.type
            for stack in ("dev", "scale5-gcp", "scale5-onprem", "multi-region")
            for r in run_stack(stack).resources
        }
    )
    assert uncovered_types(declared) == [], "add these types to ROLE_RULES in infra/bootstrap/roles.py"
    assert tuple(declared) == STACK_RESOURCE_TYPES, (
        "STACK_RESOURCE_TYPES in infra/bootstrap/roles.py is not what the stacks declare; set it to:\n"
        + "\n".join(f"    {t!r}," for t in declared)
    )


def test_a_type_without_a_role_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no role rule for resource type\(s\) gcp:bigquery/dataset:Dataset"):
        deployer_roles([*STACK_RESOURCE_TYPES, "gcp:bigquery/dataset:Dataset"])
    assert uncovered_types(["gcp:compute/network:Network", "gcp:dns/managedZone:ManagedZone"]) == [
        "gcp:dns/managedZone:ManagedZone"
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


def test_bootstrap_declares_accounts_roles_and_federation(bootstrap: StackRun) -> None:
    accounts = {a.plain["accountId"]: a for a in bootstrap.of_type("gcp:serviceaccount/account:Account")}
    assert set(accounts) == {"duplex-deployer", "duplex-preview"}
    bindings: dict[str, set[str]] = {}
    for b in bootstrap.of_type("gcp:projects/iAMMember:IAMMember"):
        bindings.setdefault(b.plain["member"], set()).add(b.plain["role"])
    deployer = "serviceAccount:duplex-deployer@my-gcp-project.iam.gserviceaccount.com"
    preview = "serviceAccount:duplex-preview@my-gcp-project.iam.gserviceaccount.com"
    assert bindings == {deployer: set(deployer_roles()), preview: set(preview_roles())}
    services = {s.plain["service"] for s in bootstrap.of_type("gcp:projects/service:Service")}
    assert {
        "container.googleapis.com",
        "containerfilesystem.googleapis.com",
        "iap.googleapis.com",
    } <= services
    assert {"sts.googleapis.com", "iamcredentials.googleapis.com"} <= services
    assert not services & {"cloudresourcemanager.googleapis.com", "serviceusage.googleapis.com"}  # step 0
    provider = bootstrap.one("gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider").plain
    assert provider["oidc"] == {"issuerUri": "https://token.actions.githubusercontent.com"}
    assert provider["attributeCondition"] == (
        'assertion.repository == "acme/duplexops" && assertion.repository_id == "123456"'
    )
    assert provider["attributeMapping"]["google.subject"] == "assertion.sub"
    pool = (
        "principal://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/github"
    )
    impersonation = {
        (b.plain["serviceAccountId"].rsplit("/", 1)[-1], b.plain["member"])
        for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")
    }
    assert all(
        b.plain["role"] == "roles/iam.workloadIdentityUser"
        for b in bootstrap.of_type("gcp:serviceaccount/iAMMember:IAMMember")
    )
    assert impersonation == {
        *(
            (
                deployer.removeprefix("serviceAccount:"),
                f"{pool}/subject/repo:acme/duplexops:environment:{env}",
            )
            for env in ("dev", "scale5-gcp", "scale5-onprem", "multi-region")
        ),
        (preview.removeprefix("serviceAccount:"), f"{pool}/subject/repo:acme/duplexops:pull_request"),
    }


def test_bootstrap_exports_what_ci_reads(bootstrap: StackRun) -> None:
    provider = "projects/123456789012/locations/global/workloadIdentityPools/github/providers/github-actions"
    out = bootstrap.outputs
    assert out["workloadIdentityProvider"] == provider
    assert out["githubVariables"]["repository"] == {
        "GCP_WORKLOAD_IDENTITY_PROVIDER": provider,
        "GCP_SERVICE_ACCOUNT": "duplex-preview@my-gcp-project.iam.gserviceaccount.com",
    }
    assert out["githubVariables"]["environments"]["multi-region"] == {
        "GCP_SERVICE_ACCOUNT": "duplex-deployer@my-gcp-project.iam.gserviceaccount.com"
    }
    assert (
        "gh variable set --repo acme/duplexops GCP_SERVICE_ACCOUNT --env dev "
        "--body duplex-deployer@my-gcp-project.iam.gserviceaccount.com"
    ) in out["ghCommands"]


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


@pytest.mark.parametrize("stack", ["dev", "scale5-gcp", "multi-region"])
def test_after_the_bootstrap_a_stack_needs_no_api_of_its_own(stack: str) -> None:
    """The bootstrap enables every API the stacks use: a stack built with enableApis false passes the
    fresh project's API check once step 0 and the bootstrap are done (and fails it before)."""
    from fresh_project import apis_enabled_before_use

    from infra.bootstrap.program import BOOTSTRAP_APIS
    from infra.gcp_apis import STEP_0_APIS

    run = run_stack(stack, overrides={"duplexops:enableApis": "false"})
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
