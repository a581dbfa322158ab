"""The third-party images (``infra.images``): pinned by digest, pulled through a Docker Hub mirror when one is
given, and the same images by tag as the node's Compose file (issue 20, item 15: third-party images by tag,
Docker Hub pulled anonymously through one NAT address)."""

from __future__ import annotations

import re

import pytest

from infra.images import NODE_IMAGES, UNPINNED, ThirdPartyImage
from infra.node.bundle.compose import IMAGES
from infra.node.profile.profiles import GRAFANA_VERSION

MIRROR = "us-central1-docker.pkg.dev/my-gcp-project/dockerhub"
PINNED = re.compile(r"^[a-z0-9./_-]+:[A-Za-z0-9_.-]+@sha256:[0-9a-f]{64}$")


def test_the_node_runs_every_image_by_its_digest() -> None:
    """The Compose renderer (and the GKE regions' Grafana and page nginx) take their references from here:
    a pinned image runs by digest, not by a tag that moves (issue 20, item 15; was ``nginx:1.28.0``)."""
    assert set(NODE_IMAGES) == set(IMAGES)
    for name, image in NODE_IMAGES.items():
        assert IMAGES[name] == image.reference(), name
        if name not in UNPINNED:
            assert PINNED.match(IMAGES[name]), IMAGES[name]
    assert NODE_IMAGES["grafana"].tag == GRAFANA_VERSION


def test_images_are_pinned_by_digest_but_the_named_few() -> None:
    """Every image carries a digest except those ``UNPINNED`` names, and that list does not grow: a new image
    comes with its digest."""
    assert frozenset({"redis-exporter", "dcgm-exporter"}) == UNPINNED
    for name, image in NODE_IMAGES.items():
        if name not in UNPINNED:
            assert PINNED.match(image.reference()), image.reference()
            assert image.note, f"{name}: say where the digest came from"


def test_docker_hub_images_go_through_the_mirror_with_the_same_digest() -> None:
    """A remote repository of Docker Hub serves the upstream manifest, so the digest is unchanged; official
    images live under ``library/``; other registries (NVIDIA's) are not rewritten."""
    nginx = NODE_IMAGES["nginx"]
    assert nginx.reference(MIRROR) == f"{MIRROR}/library/nginx:1.28.0@{nginx.digest}"
    prometheus = NODE_IMAGES["prometheus"]
    assert prometheus.reference(MIRROR) == f"{MIRROR}/prom/prometheus:v3.5.0@{prometheus.digest}"
    dcgm = NODE_IMAGES["dcgm-exporter"]
    assert not dcgm.on_docker_hub
    assert dcgm.reference(MIRROR) == dcgm.reference()
    assert {n for n, i in NODE_IMAGES.items() if i.on_docker_hub} == set(NODE_IMAGES) - {"dcgm-exporter"}


@pytest.mark.parametrize("mirror", ["docker.io/library", "us-central1-docker.pkg.dev/p", "gcr.io/x/y"])
def test_a_mirror_must_be_an_artifact_registry_repository(mirror: str) -> None:
    with pytest.raises(ValueError, match="allowed: <location>-docker.pkg.dev/<project>/<repository>"):
        NODE_IMAGES["redis"].reference(mirror)


def test_a_malformed_digest_is_refused() -> None:
    with pytest.raises(ValueError, match="allowed: sha256:<64 hex digits>"):
        ThirdPartyImage("redis", "7.4.6", "sha256:abc")
