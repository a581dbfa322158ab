"""The third-party container images the node and the GKE regions run, each pinned by digest, and how to pull
the Docker Hub ones through a mirror.

Why: a tag moves (``redis:7.4.6`` is rebuilt when Debian ships a fix), so two nodes deployed a week apart ran
different bytes under one name; and Docker Hub limits anonymous pulls per source address (every node behind
one Cloud NAT address shares one allowance), so a scale-out could stop at ``toomanyrequests``. A digest fixes
the bytes; a mirror removes the limit. The two combine: an Artifact Registry *remote repository* of Docker
Hub (``mode="REMOTE_REPOSITORY"``, ``remote_repository_config.docker_repository.public_repository =
"DOCKER_HUB"`` in pulumi-gcp's ``artifactregistry.Repository``) serves the upstream manifest unchanged, so the
same digest pulls through it (``ThirdPartyImage.reference(mirror=...)``). The nodes' service accounts need
``roles/artifactregistry.reader`` on it.

Where each digest came from: the tag's digest as pinned in public repositories in November 2026 (several
repositories agreeing, where they did; the ``note`` says which), not read from the registries on our machines,
which cannot reach them. Refresh or check one with::

    docker buildx imagetools inspect <image>:<tag> --format '{{json .Manifest.Digest}}'

(``crane digest <image>:<tag>`` gives the same). ``UNPINNED`` names the images whose digest we could not find
yet: pin them before relying on the mirror alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DOCKER_HUB", "NODE_IMAGES", "UNPINNED", "ThirdPartyImage"]

DOCKER_HUB = "docker.io"
"""Docker Hub's registry name: references without a registry host resolve to it."""

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_MIRROR_RE = re.compile(r"^[a-z0-9-]+-docker\.pkg\.dev/[a-z][a-z0-9-]{4,28}[a-z0-9]/[a-z][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class ThirdPartyImage:
    """One image by name, tag and digest.

    Attributes:
        repository: the image as Docker writes it, registry host included when it is not Docker Hub
            (``nginx``, ``prom/prometheus``, ``nvcr.io/nvidia/k8s/dcgm-exporter``).
        tag: the tag the digest was read for (kept for the reader; the digest decides what is pulled).
        digest: ``sha256:<64 hex>``, or None while not pinned (``UNPINNED``).
        note: where the digest came from.

    Raises:
        ValueError: a digest that is not ``sha256:<64 hex>``.
    """

    repository: str
    tag: str
    digest: str | None
    note: str = ""

    def __post_init__(self) -> None:
        if self.digest is not None and not _DIGEST_RE.match(self.digest):
            raise ValueError(f"{self.repository}: digest {self.digest!r}; allowed: sha256:<64 hex digits>")

    @property
    def on_docker_hub(self) -> bool:
        """True when the image is on Docker Hub (no registry host in ``repository``)."""
        first = self.repository.split("/", 1)[0]
        return "/" not in self.repository or not ("." in first or ":" in first or first == "localhost")

    def reference(self, mirror: str | None = None) -> str:
        """``<repository>:<tag>@<digest>`` (``:<tag>`` alone while unpinned); with ``mirror``
        (``<location>-docker.pkg.dev/<project>/<remote repository>``), a Docker Hub image is pulled through
        it (official images under ``library/``); other registries are left as they are.

        Raises:
            ValueError: ``mirror`` is not an Artifact Registry Docker repository path.
        """
        name = self.repository
        if mirror is not None:
            if not _MIRROR_RE.match(mirror):
                raise ValueError(
                    f"mirror {mirror!r}; allowed: <location>-docker.pkg.dev/<project>/<repository>, "
                    "an Artifact Registry remote repository of Docker Hub"
                )
            if self.on_docker_hub:
                name = f"{mirror}/{name if '/' in name else f'library/{name}'}"
        pinned = f"@{self.digest}" if self.digest else ""
        return f"{name}:{self.tag}{pinned}"


_PUBLIC = "pinned in public repositories, November 2026"

NODE_IMAGES: dict[str, ThirdPartyImage] = {
    "nginx": ThirdPartyImage(
        "nginx",
        "1.28.0",
        "sha256:552e7481ca93ffccd046aa658dbbed22caefbc09c66fa7cd247cbb90b8a5c609",
        f"{_PUBLIC} (the tag is rebuilt: other repositories pin older digests of it)",
    ),
    "redis": ThirdPartyImage(
        "redis",
        "7.4.6",
        "sha256:a9cc41d6d01da2aa26c219e4f99ecbeead955a7b656c1c499cce8922311b2514",
        f"{_PUBLIC} (two repositories agree)",
    ),
    "prometheus": ThirdPartyImage(
        "prom/prometheus",
        "v3.5.0",
        "sha256:63805ebb8d2b3920190daf1cb14a60871b16fd38bed42b857a3182bc621f4996",
        f"{_PUBLIC} (many repositories agree)",
    ),
    "grafana": ThirdPartyImage(
        "grafana/grafana",
        "11.6.16",
        "sha256:d67af92050b8d93b393dc741864752a69c9da1ffa39c1bb9af49ad5d9e47d2c3",
        f"{_PUBLIC} (several repositories agree)",
    ),
    "node-exporter": ThirdPartyImage(
        "prom/node-exporter",
        "v1.9.1",
        "sha256:d00a542e409ee618a4edc67da14dd48c5da66726bbd5537ab2af9c1dfc442c8a",
        f"{_PUBLIC} (several repositories agree)",
    ),
    "alertmanager": ThirdPartyImage(
        "prom/alertmanager",
        "v0.28.1",
        "sha256:27c475db5fb156cab31d5c18a4251ac7ed567746a2483ff264516437a39b15ba",
        f"{_PUBLIC} (many repositories agree)",
    ),
    "coturn": ThirdPartyImage(
        "coturn/coturn",
        "4.6.3",
        "sha256:71c3c990283385567f11794ee692e3a47b66fd9b0bb39e42afbe776e331dd888",
        f"{_PUBLIC} (three repositories agree); built with Prometheus support (--prometheus)",
    ),
    "redis-exporter": ThirdPartyImage(
        "oliver006/redis_exporter", "v1.74.0-alpine", None, "no published digest found: pin it"
    ),
    "dcgm-exporter": ThirdPartyImage(
        "nvcr.io/nvidia/k8s/dcgm-exporter",
        "4.4.2-4.7.1-ubuntu22.04",
        None,
        "NVIDIA's registry (no Docker Hub limit); no published digest found: pin it",
    ),
}
"""Every image of the node's Compose file but the runtime's, by the names of
``infra.node.bundle.compose.IMAGES`` (which the GKE regions' Grafana, redis_exporter and page nginx use too,
``infra.k8s``): ``IMAGES`` is ``{name: image.reference() for name, image in NODE_IMAGES.items()}``, so the
node runs each by digest."""

UNPINNED: frozenset[str] = frozenset(name for name, image in NODE_IMAGES.items() if image.digest is None)
"""Images without a digest yet (tests/test_third_party_images.py keeps this list from growing)."""
