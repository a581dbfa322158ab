"""The bootstrap's resources: the APIs the stacks need, the deployer and preview service accounts with
their derived roles, the Workload Identity Federation pool and provider for the repository's GitHub OIDC
tokens, the bindings that let the workflows impersonate the accounts; its outputs are the variables CI
reads.

Who may act as whom (GitHub's OIDC ``sub`` claim, docs.github.com/actions/reference/openid-connect-reference):
a job in the GitHub environment ``E`` of the repository gets ``repo:OWNER/NAME:environment:E`` and may act
as the deployer when ``E`` is a deploy environment; a pull-request job gets ``repo:OWNER/NAME:pull_request``
and may act as the preview identity only. The provider's attribute condition refuses any other repository's
token before either binding is read.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra.bootstrap.config import BootstrapConfig
from infra.bootstrap.roles import deployer_roles, preview_roles
from infra.program.gce import GCP_APIS, SPOT_APIS
from infra.program.multi_region import GKE_APIS
from infra.program.onprem import PULLER_APIS

__all__ = [
    "BOOTSTRAP_APIS",
    "GITHUB_ISSUER",
    "STACK_APIS",
    "attribute_condition",
    "declare",
    "gh_commands",
    "subjects",
]

GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
"""GitHub Actions' OIDC issuer."""

STACK_APIS: tuple[str, ...] = tuple(sorted(set(GCP_APIS) | set(SPOT_APIS) | set(GKE_APIS) | set(PULLER_APIS)))
"""The APIs the stacks enable (``infra.program.gce.GCP_APIS`` and ``SPOT_APIS``, ``multi_region.GKE_APIS``,
``onprem.PULLER_APIS``)."""

BOOTSTRAP_APIS: tuple[str, ...] = tuple(
    sorted({*STACK_APIS, "iam.googleapis.com", "iamcredentials.googleapis.com", "sts.googleapis.com"})
)
"""What the bootstrap enables: the stacks' APIs (so a stack built with ``enableApis: false`` finds them), and
for Workload Identity Federation IAM (pools, providers), Security Token Service (the token exchange) and IAM
Service Account Credentials (impersonation) (cloud.google.com/iam/docs/workload-identity-federation-with-
deployment-pipelines)."""


def attribute_condition(config: BootstrapConfig) -> str:
    """The provider's CEL condition: tokens of the configured repository only (and of its numeric id when
    configured: a name can be taken again once a repository is deleted or renamed)."""
    condition = f"assertion.repository == {config.github_repository!r}".replace("'", '"')
    if config.github_repository_id:
        condition += f' && assertion.repository_id == "{config.github_repository_id}"'
    return condition


def subjects(config: BootstrapConfig) -> dict[str, list[str]]:
    """``{"deployer": [sub, ...], "preview": [sub]}``: the OIDC subjects allowed to act as each account."""
    repo = config.github_repository
    return {
        "deployer": [f"repo:{repo}:environment:{env}" for env in config.deploy_environments],
        "preview": [f"repo:{repo}:pull_request"],
    }


def declare(config: BootstrapConfig) -> dict[str, Any]:
    """Declare the bootstrap of ``config.project``; return its outputs (the CI variables)."""
    import pulumi_gcp.iam as iam
    import pulumi_gcp.projects as projects
    import pulumi_gcp.serviceaccount as serviceaccount

    project = config.project
    apis = {
        api: projects.Service(
            f"api-{api.split('.')[0]}",
            project=project,
            service=api,
            disable_on_destroy=False,
            disable_dependent_services=False,
        )
        for api in BOOTSTRAP_APIS
    }
    after_iam = pulumi.ResourceOptions(depends_on=[apis["iam.googleapis.com"]])
    accounts = {
        "deployer": serviceaccount.Account(
            "deployer",
            project=project,
            account_id=config.deployer_account_id,
            display_name="duplexops deployer (CI: pulumi up)",
            description="Created by infra/bootstrap: the roles the stacks' resource types need.",
            opts=after_iam,
        ),
        "preview": serviceaccount.Account(
            "preview",
            project=project,
            account_id=config.preview_account_id,
            display_name="duplexops preview (CI: pulumi preview)",
            description="Created by infra/bootstrap: read-only roles over the stacks' resource types.",
            opts=after_iam,
        ),
    }
    roles = {"deployer": deployer_roles(), "preview": preview_roles()}
    for who, granted in roles.items():
        for role in granted:
            projects.IAMMember(
                f"{who}-{role.removeprefix('roles/').replace('.', '-')}",
                project=project,
                role=role,
                member=accounts[who].member,
            )
    pool = iam.WorkloadIdentityPool(
        "github-pool",
        project=project,
        workload_identity_pool_id=config.pool_id,
        display_name="GitHub Actions",
        description=f"GitHub Actions workflows of {config.github_repository}",
        opts=after_iam,
    )
    provider = iam.WorkloadIdentityPoolProvider(
        "github-provider",
        project=project,
        workload_identity_pool_id=pool.workload_identity_pool_id,
        workload_identity_pool_provider_id=config.provider_id,
        display_name="GitHub OIDC",
        attribute_mapping={
            "google.subject": "assertion.sub",
            "attribute.repository": "assertion.repository",
            "attribute.ref": "assertion.ref",
        },
        attribute_condition=attribute_condition(config),
        oidc={"issuer_uri": GITHUB_ISSUER},
        opts=after_iam,
    )
    for who, subs in subjects(config).items():
        for i, sub in enumerate(subs):
            serviceaccount.IAMMember(
                f"{who}-wif-{i}",
                service_account_id=accounts[who].name,
                role="roles/iam.workloadIdentityUser",
                member=pulumi.Output.concat("principal://iam.googleapis.com/", pool.name, "/subject/", sub),
            )
    deployer, preview = accounts["deployer"].email, accounts["preview"].email
    return {
        "workloadIdentityProvider": provider.name,
        "deployerServiceAccount": deployer,
        "previewServiceAccount": preview,
        "deployerRoles": sorted(roles["deployer"]),
        "previewRoles": sorted(roles["preview"]),
        # What to set in GitHub: the repository's variables name the preview identity, each deploy
        # environment's override GCP_SERVICE_ACCOUNT with the deployer (pulumi-up-stack.yml reads them).
        "githubVariables": pulumi.Output.all(provider.name, deployer, preview).apply(
            lambda v: {
                "repository": {"GCP_WORKLOAD_IDENTITY_PROVIDER": v[0], "GCP_SERVICE_ACCOUNT": v[2]},
                "environments": {env: {"GCP_SERVICE_ACCOUNT": v[1]} for env in config.deploy_environments},
            }
        ),
        "ghCommands": pulumi.Output.all(provider.name, deployer, preview).apply(
            lambda v: gh_commands(config, provider=v[0], deployer=v[1], preview=v[2])
        ),
    }


def gh_commands(config: BootstrapConfig, *, provider: str, deployer: str, preview: str) -> list[str]:
    """The ``gh variable set`` commands that give the workflows the bootstrap's results: the provider and the
    preview identity as repository variables, the deployer as each deploy environment's
    ``GCP_SERVICE_ACCOUNT`` (an environment's variable overrides the repository's)."""
    gh = f"gh variable set --repo {config.github_repository}"
    return [
        f"{gh} GCP_WORKLOAD_IDENTITY_PROVIDER --body {provider}",
        f"{gh} GCP_SERVICE_ACCOUNT --body {preview}",
        *(f"{gh} GCP_SERVICE_ACCOUNT --env {env} --body {deployer}" for env in config.deploy_environments),
    ]
