"""The bootstrap project's configuration (namespace ``duplexops-bootstrap``), checked before anything is
declared.

| key | meaning (default) |
| --- | --- |
| ``gcp:project`` | the project id (required) |
| ``githubRepository`` | ``owner/name`` of the repository whose workflows deploy (required) |
| ``githubRepositoryId`` | the repository's numeric id (``gh api repos/OWNER/NAME --jq .id``): pins the
  repository itself, not only its name, which a deleted repository frees for anyone (none) |
| ``deployEnvironments`` | GitHub environments whose jobs may act as the deployer (the four stacks) |
| ``deployerAccountId`` / ``previewAccountId`` | service-account ids (``duplex-deployer`` /
  ``duplex-preview``) |
| ``poolId`` / ``providerId`` | Workload Identity pool and provider ids (``github`` / ``github-actions``) |
| ``deployBranch`` | the only branch whose jobs may deploy or push images (``main``) |
| ``previewEnvironment`` | the GitHub environment of the preview jobs, which holds their Pulumi secrets
  (``preview``) |
| ``buildRegion`` / ``buildRepository`` | the Artifact Registry Docker repository CI's image job pushes to
  (``us-central1`` / ``duplexops-build``) |
| ``imageAccountId`` | the service account of CI's image job: it may push to the build repository only
  (``duplex-image``) |
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra.names import PROJECT_ID_RE

__all__ = ["NAMESPACE", "STACKS", "BootstrapConfig", "load_bootstrap_config", "parse_bootstrap_config"]

NAMESPACE = "duplexops-bootstrap"
STACKS = ("dev", "scale5-gcp", "scale5-onprem", "multi-region")
"""The stacks CI deploys, each in the GitHub environment of its name (``pulumi-up-stack.yml``)."""

_ACCOUNT_ID = r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$"
_POOL_ID = r"^[a-z0-9-]{4,32}$"


def _not_google_prefix(value: str) -> str:
    """Pool and provider ids: the ``gcp-`` prefix is Google's (pulumi-gcp 10.2 ``WorkloadIdentityPool``)."""
    if value.startswith("gcp-"):
        raise ValueError("the prefix 'gcp-' is reserved by Google; allowed: 4-32 of [a-z0-9-]")
    return value


_WifId = Annotated[str, Field(pattern=_POOL_ID), AfterValidator(_not_google_prefix)]
_ENVIRONMENT = r"^[A-Za-z0-9_.-]{1,255}$"
_BRANCH = r"^[A-Za-z0-9._/-]{1,200}$"
_REGION = r"^[a-z]+-[a-z]+[0-9]$"
_REPOSITORY = r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$"


class BootstrapConfig(BaseModel):
    """The bootstrap's settings; field aliases are the Pulumi keys (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    project: str = Field(alias="gcp:project", pattern=PROJECT_ID_RE.pattern)
    github_repository: str = Field(
        alias=f"{NAMESPACE}:githubRepository", pattern=r"^[A-Za-z0-9-]{1,39}/[A-Za-z0-9._-]{1,100}$"
    )
    github_repository_id: str | None = Field(
        None, alias=f"{NAMESPACE}:githubRepositoryId", pattern=r"^[0-9]+$"
    )
    deploy_environments: tuple[Annotated[str, Field(pattern=_ENVIRONMENT)], ...] = Field(
        STACKS, alias=f"{NAMESPACE}:deployEnvironments", min_length=1
    )
    deployer_account_id: str = Field(
        "duplex-deployer", alias=f"{NAMESPACE}:deployerAccountId", pattern=_ACCOUNT_ID
    )
    preview_account_id: str = Field(
        "duplex-preview", alias=f"{NAMESPACE}:previewAccountId", pattern=_ACCOUNT_ID
    )
    pool_id: _WifId = Field("github", alias=f"{NAMESPACE}:poolId")
    provider_id: _WifId = Field("github-actions", alias=f"{NAMESPACE}:providerId")
    deploy_branch: str = Field("main", alias=f"{NAMESPACE}:deployBranch", pattern=_BRANCH)
    preview_environment: str = Field("preview", alias=f"{NAMESPACE}:previewEnvironment", pattern=_ENVIRONMENT)
    build_region: str = Field("us-central1", alias=f"{NAMESPACE}:buildRegion", pattern=_REGION)
    build_repository: str = Field(
        "duplexops-build", alias=f"{NAMESPACE}:buildRepository", pattern=_REPOSITORY
    )
    image_account_id: str = Field("duplex-image", alias=f"{NAMESPACE}:imageAccountId", pattern=_ACCOUNT_ID)

    @model_validator(mode="after")
    def _preview_is_no_deploy_environment(self) -> BootstrapConfig:
        """The preview environment runs pull requests' code: it must not be a deploy environment."""
        if self.preview_environment in self.deploy_environments:
            raise ValueError(
                f"previewEnvironment {self.preview_environment!r} is also in deployEnvironments "
                f"{list(self.deploy_environments)}: a pull request's job would act as the deployer; "
                "allowed: any other environment name"
            )
        return self

    @property
    def image_repository(self) -> str:
        """What CI's image job pushes to (``vars.IMAGE_REPOSITORY``):
        ``<region>-docker.pkg.dev/<project>/<repository>/duplex-runtime``."""
        return f"{self.build_region}-docker.pkg.dev/{self.project}/{self.build_repository}/duplex-runtime"


def parse_bootstrap_config(values: Mapping[str, str]) -> BootstrapConfig:
    """The settings from Pulumi's config ``{"<namespace>:<key>": text}`` (lists as JSON).

    Raises:
        ValueError: every problem, one line each, naming the key, the value and what is allowed.
    """
    known = {info.alias for info in BootstrapConfig.model_fields.values()}
    given = {k: v for k, v in values.items() if k in known}
    list_key = f"{NAMESPACE}:deployEnvironments"
    if isinstance(given.get(list_key), str):
        try:
            given[list_key] = json.loads(given[list_key])
        except ValueError:
            raise ValueError(  # noqa: B904 (the JSON error adds nothing)
                f'{list_key}: {given[list_key]!r} is not a JSON list; e.g. ["dev", "multi-region"]'
            )
    try:
        return BootstrapConfig.model_validate(given)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            key = ".".join(str(p) for p in error["loc"])
            shown = "" if error["type"] == "missing" else f" {error.get('input')!r}:"
            lines.append(f"{key}:{shown} {error['msg']}")
        raise ValueError("bootstrap configuration:\n" + "\n".join(lines)) from None


def load_bootstrap_config() -> BootstrapConfig:
    """The current stack's settings from Pulumi (program start).

    Raises:
        ValueError: as ``parse_bootstrap_config``.
    """
    import pulumi

    values: dict[str, str] = {}
    for info in BootstrapConfig.model_fields.values():
        namespace, key = str(info.alias).split(":", 1)
        value = pulumi.Config(namespace).get(key)
        if value is not None:
            values[str(info.alias)] = value
    return parse_bootstrap_config(values)
