"""The runtime image's Dockerfile, checked without a Docker engine (none runs on these machines)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
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


def _copied_sources(parser: DockerfileParser) -> list[str]:
    return [source for value in _instructions(parser, "COPY") for source in value.split()[:-1]]


def test_the_image_carries_the_runtime_and_not_the_deployment_tools(dockerfile: DockerfileParser) -> None:
    """A change under infra/ (stacks, node renderers, manifests) must not change the image digest: a new
    digest replaces a GCE node and rolls every GKE pod."""
    copied = _copied_sources(dockerfile)
    assert "runtime" in copied
    assert not any(source == "infra" or source.startswith("infra/") for source in copied), copied


_WITHOUT_INFRA = """
import importlib.abc, sys
class NoInfra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "infra" or name.startswith("infra."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoInfra())
from typer.testing import CliRunner
from runtime.cli import app
result = CliRunner().invoke(app, ["--help"])
assert result.exit_code == 0, result.output
print(result.output)
"""


def test_duplex_serves_without_the_deployment_tools() -> None:
    """In the image (no infra package) ``duplex-runtime`` loads, with ``serve`` and without ``node`` or
    ``capacity``."""
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_INFRA], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    commands = {
        line.split()[1]
        for line in result.stdout.splitlines()
        if line.startswith("│ ") and len(line.split()) > 1
    }
    assert "serve" in commands and "token" in commands
    assert not commands & {"node", "capacity"}, commands


def test_the_image_build_context_makes_a_wheel(dockerfile: DockerfileParser, tmp_path: Path) -> None:
    """What the Dockerfile copies is enough for ``pip install .[runtime]``: build the wheel from exactly
    those files (no build isolation: offline) and check it holds the runtime and nothing of infra."""
    for source in _copied_sources(dockerfile):
        target = tmp_path / "context" / source
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / source, target)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            ".",
            "-w",
            str(tmp_path),
        ],
        cwd=tmp_path / "context",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    [wheel] = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "runtime/server.py" in names
    assert not [n for n in names if n.startswith("infra/")]
