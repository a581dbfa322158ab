"""``RuntimeImage``: the runtime's container image in an Artifact Registry repository of its own: either the
digest CI built once copied in unchanged (``promote``, with ``crane copy``), or, without one, built from
``images/runtime/Dockerfile`` and pushed here (pulumi-docker-build, registry cache, ``SOURCE_DATE_EPOCH``).
It rebuilds only when the Dockerfile or the allowlisted build context changes, so a change outside
``runtime/`` gives no new digest; nodes run the immutable ``image_ref``.

When it rebuilds, cache and reproducibility, credentials: docs/packaging.md, "The image"; built once,
promoted everywhere: docs/deploying.md, "CI deploy pipeline"."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pulumi
import pulumi_command.local as local
import pulumi_docker_build as docker_build
import pulumi_gcp.artifactregistry as artifactregistry
import pulumi_gcp.organizations as organizations

from infra.components._util import COMPONENT_PACKAGE, REPO_ROOT, child_options, dependencies

__all__ = [
    "PROMOTE_SCRIPT",
    "REPO_ROOT",
    "RuntimeImage",
    "RuntimeImageArgs",
    "build_path",
    "digest_of",
    "promote",
]

DOCKERFILE = "images/runtime/Dockerfile"

SOURCE_DATE_EPOCH = 0
"""The image's timestamp (seconds since 1970): the Dockerfile frontend takes the ``SOURCE_DATE_EPOCH`` build
arg for the image config's and history's ``created`` since BuildKit 0.11 (moby/buildkit docs/build-repro.md;
Docker's guide uses 0 too: docs.docker.com/build/ci/github-actions/reproducible-builds/). Fixed, not the last
commit's time: any commit (a README edit) would then change the digest."""


PROMOTE_SCRIPT = """set -eu
gcloud auth configure-docker "${SOURCE%%/*},${TARGET%%/*}" --quiet
crane copy "$SOURCE" "$TARGET"
"""
"""The promotion (``promote``): Docker credentials for both registries through gcloud's credential helper,
then ``crane copy SOURCE TARGET``, which copies the manifest and the layers the target lacks and keeps the
digest. ``SOURCE`` is digest-pinned, ``TARGET`` a tag in the stack's repository."""

_DIGEST_RE = re.compile(r"@(sha256:[0-9a-f]{64})$")


def digest_of(reference: str) -> str:
    """The ``sha256:<64 hex>`` digest a digest-pinned reference (``<repository>[:tag]@sha256:...``) names.

    Raises:
        ValueError: ``reference`` is not pinned by a sha256 digest (a tag alone can move).
    """
    match = _DIGEST_RE.search(reference)
    if match is None:
        raise ValueError(
            f"image {reference!r} is not digest-pinned; allowed: <repository>@sha256:<64 hex digits>"
        )
    return match[1]


def promote(
    name: str,
    source: pulumi.Input[str],
    target_repository: pulumi.Input[str],
    tag: str,
    opts: pulumi.ResourceOptions,
) -> tuple[local.Command, pulumi.Output[str]]:
    """Copy the digest-pinned ``source`` into ``target_repository`` (``<registry>/<project>/<repo>/<image>``)
    under ``tag``, keeping its digest (``PROMOTE_SCRIPT``); runs again only when ``source`` or the target
    changes. Returns the command and the image reference nodes run, ``<target_repository>@<digest>``, which
    resolves once the copy is done (so nothing pulls it earlier). ``source`` may be an Output, e.g. another
    repository's ``image_ref``, to copy one image into a repository per region.

    Raises:
        ValueError: ``source`` is not digest-pinned (at once for a plain string, when it resolves for an
            Output).
    """
    if isinstance(source, str):
        digest_of(source)  # refuse a tag before anything is declared
    pinned = pulumi.Output.from_input(source)
    target = pulumi.Output.from_input(target_repository)
    copy = local.Command(
        name,
        create=PROMOTE_SCRIPT,
        environment={"SOURCE": pinned, "TARGET": target.apply(lambda repository: f"{repository}:{tag}")},
        triggers=[pinned, target],
        opts=opts,
    )
    image_ref = pulumi.Output.all(copy.id, target, pinned.apply(digest_of)).apply(
        lambda parts: f"{parts[1]}@{parts[2]}"
    )
    return copy, image_ref


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
        cache_tag: the tag of the registry build cache, beside the image.
        platform: the target platform.
        labels: labels of the repository.
        source: a digest-pinned image CI built (``duplexops:runtimeImage``): copied into the repository
            (``promote``) instead of a build; None: build ``images/runtime/Dockerfile`` here.
    """

    project: str
    location: str
    repository_id: str
    image_name: str = "duplex-runtime"
    tag: str = "latest"
    cache_tag: str = "buildcache"
    platform: str = "linux/amd64"
    labels: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None

    @property
    def registry(self) -> str:
        """The registry host."""
        return f"{self.location}-docker.pkg.dev"

    @property
    def repository_path(self) -> str:
        """``<registry>/<project>/<repository>/<image>`` (no tag, no digest)."""
        return f"{self.registry}/{self.project}/{self.repository_id}/{self.image_name}"

    @property
    def cache_ref(self) -> str:
        """``<repository_path>:<cache_tag>``: the registry build cache."""
        return f"{self.repository_path}:{self.cache_tag}"


class RuntimeImage(pulumi.ComponentResource):
    """An Artifact Registry repository (Docker format) and the runtime image in it: the CI-built image copied
    in (``args.source``: ``promotion`` is the copy, ``image`` None) or one built and pushed here (``image``,
    ``promotion`` None).

    Outputs: ``ref`` (``<tag>@<digest>``), ``digest`` (``sha256:...``) and ``image_ref``
    (``<repository>/<image>@<digest>``: what every node runs, immutable)."""

    repository: artifactregistry.Repository
    image: docker_build.Image | None
    promotion: local.Command | None
    ref: pulumi.Output[str]
    digest: pulumi.Output[str]
    image_ref: pulumi.Output[str]
    repository_path: str
    """``<registry>/<project>/<repository>/<image>``: known before the image is built (a preview knows it)."""

    def __init__(self, name: str, args: RuntimeImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:RuntimeImage", name, None, opts)
        deps = dependencies(opts)
        self.repository_path = args.repository_path
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
        self.image = None
        self.promotion = None
        if args.source is not None:
            self.promotion, self.image_ref = promote(
                f"{name}-promote",
                args.source,
                args.repository_path,
                args.tag,
                child_options(self, [*deps, self.repository]),
            )
            digest = digest_of(args.source)
            self.digest = self.image_ref.apply(lambda _: digest)
            self.ref = self.image_ref.apply(lambda _: f"{args.repository_path}:{args.tag}@{digest}")
        else:
            self.image = self._build(name, args, deps)
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

    def _build(self, name: str, args: RuntimeImageArgs, deps: list[pulumi.Resource]) -> docker_build.Image:
        """Build ``images/runtime/Dockerfile`` and push it to the repository (no CI-built source)."""
        token = organizations.get_client_config_output(
            opts=pulumi.InvokeOutputOptions(parent=self)
        ).access_token
        return docker_build.Image(
            f"{name}-image",
            push=True,
            context={"location": build_path(REPO_ROOT)},
            dockerfile={"location": build_path(REPO_ROOT / DOCKERFILE)},
            platforms=[docker_build.Platform(args.platform)],
            tags=[f"{args.repository_path}:{args.tag}"],
            build_args={"SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)},
            cache_from=[
                docker_build.CacheFromArgs(registry=docker_build.CacheFromRegistryArgs(ref=args.cache_ref))
            ],
            # mode=max: every layer, not only the final image's. An OCI image manifest (not a manifest
            # list): the form registries accept most widely (the provider's docstring of image_manifest).
            # A failed cache export never fails the deploy: the cache only saves time.
            cache_to=[
                docker_build.CacheToArgs(
                    registry=docker_build.CacheToRegistryArgs(
                        ref=args.cache_ref,
                        mode=docker_build.CacheMode.MAX,
                        image_manifest=True,
                        oci_media_types=True,
                        ignore_error=True,
                    )
                )
            ],
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
