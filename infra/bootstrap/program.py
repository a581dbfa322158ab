"""The bootstrap's resources: the APIs the stacks need, the deployer, preview and image service accounts
with their derived roles, the build repository CI pushes the runtime image to, the on-premises image
puller (``infra.components.onprem_node.RegistryPuller``) with its grants, the Workload Identity
Federation pool and provider for the repository's GitHub OIDC tokens, the bindings that let the workflows
impersonate the accounts; its outputs are the variables and commands CI needs.

Who may act as whom (GitHub's OIDC claims, docs.github.com/actions/reference/security/oidc: a job that
names an environment gets ``sub = repo:OWNER/NAME:environment:E``, any other job
``repo:OWNER/NAME:ref:<ref>`` or, on a pull request, ``repo:OWNER/NAME:pull_request``):

- a job on the deploy branch (``refs/heads/main``) in a deploy environment ``E`` acts as the deployer;
- the image job on the deploy branch, in no environment (``ref:refs/heads/main``), acts as the image
  account, which may push to the build repository and nothing else;
- a job in the preview environment acts as the read-only preview account.

The ``sub`` of an environment's job does not carry the branch, and an environment accepts jobs of any branch
unless its branch policy says otherwise: so the provider's attribute condition (checked before any binding)
admits a token only from the repository and either from the deploy branch pushed or dispatched, or from the
preview environment. A pushed branch whose workflow names ``environment: dev``, or a pull request's job that
does, presents ``repo:OWNER/NAME:environment:dev`` with another ``ref`` and is refused there.
"""

from __future__ import annotations

from typing import Any

import pulumi

from infra.bootstrap.config import BootstrapConfig
from infra.bootstrap.roles import (
    IMAGE_PUSHER_ROLE,
    PROJECT_IAM_ADMIN,
    STACK_GRANTED_PROJECT_ROLES,
    STACK_RESOURCE_TYPES,
    deployer_roles,
    preview_roles,
)
from infra.gcp_apis import STEP_0_APIS, required_apis
from infra.program.gce import GCP_APIS, SPOT_APIS
from infra.program.multi_region import GKE_APIS
from infra.program.onprem import PULLER_ACCOUNT_ID, PULLER_APIS

__all__ = [
    "BOOTSTRAP_APIS",
    "DEPLOY_EVENTS",
    "GITHUB_ISSUER",
    "STACK_APIS",
    "attribute_condition",
    "declare",
    "gh_commands",
    "github_variables",
    "project_iam_condition",
    "subjects",
]

GITHUB_ISSUER = "https://token.actions.githubusercontent.com"
"""GitHub Actions' OIDC issuer."""

DEPLOY_EVENTS: tuple[str, ...] = ("push", "workflow_dispatch")
"""The events whose jobs on the deploy branch may deploy (``pulumi-up.yml``'s triggers): not
``pull_request_target`` or ``workflow_run``, whose jobs also carry the base branch's ref but can be started
by a pull request."""

STACK_APIS: tuple[str, ...] = tuple(
    sorted(
        (
            set(GCP_APIS)
            | set(SPOT_APIS)
            | set(GKE_APIS)
            | set(PULLER_APIS)
            | {api for t in STACK_RESOURCE_TYPES for api in required_apis(t, {})}
        )
        - set(STEP_0_APIS)
    )
)
"""The APIs the stacks enable (``infra.program.gce.GCP_APIS`` and ``SPOT_APIS``, ``multi_region.GKE_APIS``,
``onprem.PULLER_APIS``) and the API of every resource type a stack declares under any documented option
(``roles.STACK_RESOURCE_TYPES``: ``dnsZone`` brings ``gcp:dns/``, so ``dns.googleapis.com``), the
step-0 APIs aside."""

BOOTSTRAP_APIS: tuple[str, ...] = tuple(
    sorted({*STACK_APIS, "iam.googleapis.com", "iamcredentials.googleapis.com", "sts.googleapis.com"})
)
"""What the bootstrap enables: the stacks' APIs (so a stack built with ``enableApis: false`` finds them), and
for Workload Identity Federation IAM (pools, providers), Security Token Service (the token exchange) and IAM
Service Account Credentials (impersonation) (cloud.google.com/iam/docs/workload-identity-federation-with-
deployment-pipelines)."""


def attribute_condition(config: BootstrapConfig) -> str:
    """The provider's CEL condition: tokens of the configured repository only (and of its numeric id when
    configured: a name can be taken again once a repository is deleted or renamed), and of those only a
    job of the deploy branch run by a push or a dispatch (``DEPLOY_EVENTS``), or a job in the preview
    environment. See the module docstring for why the branch is checked here."""
    repo = f'assertion.repository == "{config.github_repository}"'
    if config.github_repository_id:
        repo += f' && assertion.repository_id == "{config.github_repository_id}"'
    events = " || ".join(f'assertion.event_name == "{e}"' for e in DEPLOY_EVENTS)
    deploy = f'assertion.ref == "refs/heads/{config.deploy_branch}" && ({events})'
    preview = f'assertion.sub == "repo:{config.github_repository}:environment:{config.preview_environment}"'
    return f"{repo} && (({deploy}) || {preview})"


def subjects(config: BootstrapConfig) -> dict[str, list[str]]:
    """``{"deployer": [sub, ...], "image": [sub], "preview": [sub]}``: the OIDC subjects allowed to act as
    each account (the provider's condition admits them only from the deploy branch, but the preview's)."""
    repo = config.github_repository
    return {
        "deployer": [f"repo:{repo}:environment:{env}" for env in config.deploy_environments],
        "image": [f"repo:{repo}:ref:refs/heads/{config.deploy_branch}"],
        "preview": [f"repo:{repo}:environment:{config.preview_environment}"],
    }


def project_iam_condition(roles: tuple[str, ...] = STACK_GRANTED_PROJECT_ROLES) -> str:
    """The IAM condition on the deployer's ``projectIamAdmin``: it may add or remove project grants of
    ``roles`` only (the roles the stacks grant), so it cannot make itself or anyone owner.
    ``iam.googleapis.com/modifiedGrantsByRole`` lists the roles a ``setIamPolicy`` call changes
    (cloud.google.com/iam/docs/setting-limits-on-granting-roles)."""
    listed = ", ".join(f"'{r}'" for r in sorted(roles))
    return f"api.getAttribute('iam.googleapis.com/modifiedGrantsByRole', []).hasOnly([{listed}])"


def declare(config: BootstrapConfig) -> dict[str, Any]:
    """Declare the bootstrap of ``config.project``; return its outputs (the CI variables)."""
    import pulumi_gcp.artifactregistry as artifactregistry
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
        "image": serviceaccount.Account(
            "image",
            project=project,
            account_id=config.image_account_id,
            display_name="duplexops image (CI: build and push the runtime image)",
            description="Created by infra/bootstrap: pushes to the build repository, nothing else.",
            opts=after_iam,
        ),
        "puller": serviceaccount.Account(
            "puller",
            project=project,
            account_id=PULLER_ACCOUNT_ID,
            display_name="duplexops image puller (on-premises nodes)",
            description="Created by infra/bootstrap: reads the build repository; its 1-hour tokens are "
            "minted by the deployer at each on-premises deploy.",
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
            condition = None
            if role == PROJECT_IAM_ADMIN:
                condition = projects.IAMMemberConditionArgs(
                    title="only the roles the stacks grant",
                    description="infra/bootstrap/roles.py STACK_GRANTED_PROJECT_ROLES",
                    expression=project_iam_condition(),
                )
            projects.IAMMember(
                f"{who}-{role.removeprefix('roles/').replace('.', '-')}",
                project=project,
                role=role,
                member=accounts[who].member,
                condition=condition,
            )
    build_repository = artifactregistry.Repository(
        "build-repository",
        project=project,
        location=config.build_region,
        repository_id=config.build_repository,
        format="DOCKER",
        description="duplexops: the runtime image CI builds once per push (pulumi-up.yml's image job)",
        opts=pulumi.ResourceOptions(depends_on=[apis["artifactregistry.googleapis.com"]]),
    )
    artifactregistry.RepositoryIamMember(
        "image-pushes",
        project=project,
        location=config.build_region,
        repository=build_repository.repository_id,
        role=IMAGE_PUSHER_ROLE,
        member=accounts["image"].member,
    )
    # The on-premises stacks' puller: its grants are made here, before any stack's first up, not in the
    # up that mints its token and pulls (IAM propagation: infra.components.onprem_node.RegistryPuller).
    artifactregistry.RepositoryIamMember(
        "puller-reads",
        project=project,
        location=config.build_region,
        repository=build_repository.repository_id,
        role="roles/artifactregistry.reader",
        member=accounts["puller"].member,
    )
    serviceaccount.IAMMember(
        "deployer-mints-puller-tokens",
        service_account_id=accounts["puller"].name,
        role="roles/iam.serviceAccountTokenCreator",
        member=accounts["deployer"].member,
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
    deployer, image, preview = (accounts[who].email for who in ("deployer", "image", "preview"))
    emails = pulumi.Output.all(provider.name, deployer, preview, image)
    return {
        "workloadIdentityProvider": provider.name,
        "deployerServiceAccount": deployer,
        "imageServiceAccount": image,
        "previewServiceAccount": preview,
        "pullerServiceAccount": accounts["puller"].email,
        "imageRepository": config.image_repository,
        "deployerRoles": sorted(roles["deployer"]),
        "previewRoles": sorted(roles["preview"]),
        "githubVariables": emails.apply(
            lambda v: github_variables(config, provider=v[0], deployer=v[1], preview=v[2], image=v[3])
        ),
        "ghCommands": emails.apply(
            lambda v: gh_commands(config, provider=v[0], deployer=v[1], preview=v[2], image=v[3])
        ),
    }


def github_variables(
    config: BootstrapConfig, *, provider: str, deployer: str, preview: str, image: str
) -> dict[str, Any]:
    """What the workflows read: the repository's variables (the provider, the image account and the build
    repository, read by the image job, which has no environment), and per environment
    ``GCP_SERVICE_ACCOUNT``: the deployer in each deploy environment, the preview account in the preview
    environment. No repository-level ``GCP_SERVICE_ACCOUNT``: a job outside those environments names no
    account to impersonate."""
    return {
        "repository": {
            "GCP_WORKLOAD_IDENTITY_PROVIDER": provider,
            "GCP_IMAGE_SERVICE_ACCOUNT": image,
            "IMAGE_REPOSITORY": config.image_repository,
        },
        "environments": {
            config.preview_environment: {"GCP_SERVICE_ACCOUNT": preview},
            **{env: {"GCP_SERVICE_ACCOUNT": deployer} for env in config.deploy_environments},
        },
    }


def gh_commands(
    config: BootstrapConfig, *, provider: str, deployer: str, preview: str, image: str
) -> list[str]:
    """The ``gh`` commands that set GitHub up for the bootstrap's results, in order: each environment with
    a branch policy (the deploy environments accept the deploy branch only: a second guard beside the
    provider's condition), the variables of ``github_variables``, and the Pulumi secrets as environment
    secrets (``gh secret set`` reads the value from standard input: no secret is printed here), so that no
    job outside an environment, and no preview, receives the deploy environments' credentials."""
    repo = config.github_repository
    gh = f"gh variable set --repo {repo}"
    variables = github_variables(config, provider=provider, deployer=deployer, preview=preview, image=image)
    commands = []
    for env in config.deploy_environments:
        commands += [
            f"gh api -X PUT repos/{repo}/environments/{env}"
            " -F 'deployment_branch_policy[protected_branches]=false'"
            " -F 'deployment_branch_policy[custom_branch_policies]=true'",
            f"gh api -X POST repos/{repo}/environments/{env}/deployment-branch-policies "
            f"-f name={config.deploy_branch} -f type=branch",
        ]
    commands.append(f"gh api -X PUT repos/{repo}/environments/{config.preview_environment}")
    commands += [f"{gh} {name} --body {value}" for name, value in variables["repository"].items()]
    for env, values in variables["environments"].items():
        commands += [f"{gh} {name} --env {env} --body {value}" for name, value in values.items()]
    for env in (*config.deploy_environments, config.preview_environment):
        commands += [
            f"gh secret set --repo {repo} {name} --env {env}"
            for name in ("PULUMI_ACCESS_TOKEN", "PULUMI_CONFIG_PASSPHRASE")
        ]
    return commands
