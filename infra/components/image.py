"""``RuntimeImage``: the runtime's container image, built from ``images/runtime/Dockerfile`` (context: the
repository root) and pushed into an Artifact Registry repository of its own.

Docker pushes with the access token of the credentials Pulumi's GCP provider runs with (``gcloud auth
application-default login`` locally, workload identity in CI): no key file. The build needs a Docker
daemon with BuildKit where ``pulumi up`` runs; previews do not build (``build_on_preview=False``), so a
preview shows the digest as unknown only when the build context changed.

Outputs: ``ref`` (docker-build's ``<tag>@<digest>``), ``digest`` (``sha256:...``) and ``image_ref``
(``<repository>/<image>@<digest>``: what every node runs, immutable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_docker_build as docker_build
import pulumi_gcp.artifactregistry as artifactregistry
import pulumi_gcp.organizations as organizations

from infra.components._util import COMPONENT_PACKAGE, REPO_ROOT, child_options, dependencies

__all__ = ["REPO_ROOT", "RuntimeImage", "RuntimeImageArgs", "build_path"]

DOCKERFILE = "images/runtime/Dockerfile"


def build_path(path: Path) -> str:
    """``path`` relative to the program's working directory (the engine runs the program and the
    providers in the same one), so that the stack's state does not depend on where the repository is
    checked out: a changed build context path would rebuild the image."""
    return os.path.relpath(path, Path.cwd())


@dataclass(frozen=True)
class RuntimeImageArgs:
    """Where the image goes and how it is built.

    Attributes:
        project: the GCP project of the repository.
        location: the repository's region (``us-central1``): the registry is ``<location>-docker.pkg.dev``.
        repository_id: the Artifact Registry repository id.
        image_name: the image's name inside the repository.
        tag: a moving tag pushed with every build (nodes run the digest, never the tag).
        platform: the target platform.
        labels: labels of the repository.
    """

    project: str
    location: str
    repository_id: str
    image_name: str = "duplex-runtime"
    tag: str = "latest"
    platform: str = "linux/amd64"
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def registry(self) -> str:
        """The registry host."""
        return f"{self.location}-docker.pkg.dev"

    @property
    def repository_path(self) -> str:
        """``<registry>/<project>/<repository>/<image>`` (no tag, no digest)."""
        return f"{self.registry}/{self.project}/{self.repository_id}/{self.image_name}"


class RuntimeImage(pulumi.ComponentResource):
    """An Artifact Registry repository (Docker format) and the runtime image built and pushed into it."""

    repository: artifactregistry.Repository
    image: docker_build.Image
    ref: pulumi.Output[str]
    digest: pulumi.Output[str]
    image_ref: pulumi.Output[str]

    def __init__(self, name: str, args: RuntimeImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:RuntimeImage", name, None, opts)
        deps = dependencies(opts)
        self.repository = artifactregistry.Repository(
            f"{name}-repository",
            project=args.project,
            location=args.location,
            repository_id=args.repository_id,
            format="DOCKER",
            description="duplexops runtime images (pushed by Pulumi; nodes pull them by digest)",
            labels=dict(args.labels),
            opts=child_options(self, deps),
        )
        token = organizations.get_client_config_output(
            opts=pulumi.InvokeOutputOptions(parent=self)
        ).access_token
        self.image = docker_build.Image(
            f"{name}-image",
            push=True,
            context={"location": build_path(REPO_ROOT)},
            dockerfile={"location": build_path(REPO_ROOT / DOCKERFILE)},
            platforms=[docker_build.Platform(args.platform)],
            tags=[f"{args.repository_path}:{args.tag}"],
            registries=[
                {
                    "address": args.registry,
                    "username": "oauth2accesstoken",
                    "password": pulumi.Output.secret(token),
                }
            ],
            build_on_preview=False,
            labels={"org.opencontainers.image.title": "duplexops-runtime"},
            opts=child_options(self, [*deps, self.repository]),
        )
        self.ref = self.image.ref
        self.digest = self.image.digest
        self.image_ref = self.digest.apply(lambda digest: f"{args.repository_path}@{digest}")
        self.register_outputs(
            {
                "repository": self.repository.id,
                "ref": self.ref,
                "digest": self.digest,
                "image_ref": self.image_ref,
            }
        )
