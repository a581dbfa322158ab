"""The runtime image's Dockerfile, checked without a Docker engine (none runs on these machines)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "images" / "runtime" / "Dockerfile"


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    parser = DockerfileParser(fileobj=DOCKERFILE.open("rb"))
    assert parser.structure, "Dockerfile did not parse"
    return parser


def _instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_builds_on_a_cuda_base(dockerfile: DockerfileParser) -> None:
    assert dockerfile.baseimage.startswith("nvidia/cuda:")


def test_entrypoint_is_the_installed_console_script(dockerfile: DockerfileParser) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = json.loads(_instructions(dockerfile, "ENTRYPOINT")[-1])
    assert entrypoint[0] in scripts
    module, _, attribute = scripts[entrypoint[0]].partition(":")
    imported = __import__(module, fromlist=[attribute])
    assert hasattr(imported, attribute)
    assert json.loads(_instructions(dockerfile, "CMD")[-1]) == ["serve"]


def test_runs_as_a_non_root_user(dockerfile: DockerfileParser) -> None:
    users = _instructions(dockerfile, "USER")
    assert users and users[-1] not in ("root", "0")


def test_healthcheck_probes_healthz(dockerfile: DockerfileParser) -> None:
    (healthcheck,) = _instructions(dockerfile, "HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert "8998" in healthcheck


def test_model_cache_is_a_volume(dockerfile: DockerfileParser) -> None:
    volumes = " ".join(_instructions(dockerfile, "VOLUME"))
    assert "/models" in volumes
    assert dockerfile.envs.get("HF_HOME", "").startswith("/models")


def test_no_hugging_face_token_is_baked_in(dockerfile: DockerfileParser) -> None:
    baked = " ".join(_instructions(dockerfile, "ENV") + _instructions(dockerfile, "ARG")).upper()
    assert "HF_TOKEN" not in baked
    assert "HUGGING_FACE_HUB_TOKEN" not in baked


def test_copied_sources_exist(dockerfile: DockerfileParser) -> None:
    for value in _instructions(dockerfile, "COPY"):
        *sources, _destination = value.split()
        for source in sources:
            assert (ROOT / source).exists(), source


def test_the_runtime_listens_where_the_image_says(dockerfile: DockerfileParser) -> None:
    from runtime.config import RuntimeConfig

    exposed = _instructions(dockerfile, "EXPOSE")
    assert dockerfile.envs["DUPLEX_PORT"] in exposed
    config = RuntimeConfig(port=int(dockerfile.envs["DUPLEX_PORT"]), host=dockerfile.envs["DUPLEX_HOST"])
    assert config.host == "0.0.0.0"
