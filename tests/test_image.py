"""The runtime image's Dockerfile and its build context, checked without a Docker engine (none runs on these
machines).

The build context: pulumi-docker-build 0.0.22 rebuilds the image when its context hash changes, and a new
digest replaces the GCE VM and rolls every GKE pod. :func:`provider_context_hash` is a Python port of the
provider's ``hashBuildContext`` (provider/internal/context.go at v0.0.22): the Dockerfile's content, then for
each file of the context not excluded by ``.dockerignore``, in the order Go's walk visits them, its content,
its slash-separated relative path and its mode string (Go's ``FileMode.String``, which ``stat.filemode``
matches for regular files). The exclusion rules are docker-py's port of moby's pattern matcher (the
provider uses moby's, through BuildKit's fsutil). Not compared bit for bit with the Go provider (no provider
binary here): what is checked is which changes reach the hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from docker.utils.build import PatternMatcher
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


_PINNED = re.compile(r"^(?P<image>[a-z0-9./_-]+):(?P<tag>[A-Za-z0-9_.-]+)@sha256:[0-9a-f]{64}$")
"""A FROM reference pinned by digest, its tag kept for the reader (``python:3.11-slim@sha256:...``)."""


def test_every_base_is_pinned_by_digest_and_says_how_to_refresh_it(dockerfile: DockerfileParser) -> None:
    """Issue 20, item 15: ``FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04`` was a tag, which the publisher
    moves: two builds of one commit could differ. Every FROM names a digest, and the Dockerfile says where
    it came from and the command that refreshes it."""
    froms = _instructions(dockerfile, "FROM")
    assert froms
    for value in froms:
        reference = value.split()[0]
        assert _PINNED.match(reference), f"FROM {reference} is not pinned by a sha256 digest"
    text = DOCKERFILE.read_text()
    assert "docker buildx imagetools inspect" in text
    assert "0" * 64 not in text, "a placeholder digest"


def test_cuda_comes_once_from_torchs_wheels(dockerfile: DockerfileParser) -> None:
    """Issue 20, item 15: the image carried CUDA twice (the CUDA base image's runtime and torch's NVIDIA
    wheels, over 15 GB). The base is a slim Python image without CUDA; torch comes from PyTorch's CUDA index
    (its wheels bring the CUDA runtime libraries bitsandbytes' INT8 kernels load too), checked at build time;
    no CUDA package is installed with apt."""
    base = dockerfile.baseimage.split("@")[0]
    assert not base.startswith(("nvidia/cuda", "nvcr.io/nvidia")), base
    assert base.startswith("python:3.11-slim"), base  # the Python of CI and of the CPU wheels here
    assert re.search(r"download\.pytorch\.org/whl/cu1[0-9]{2}$", dockerfile.args["TORCH_INDEX_URL"])
    runs = " ".join(_instructions(dockerfile, "RUN"))
    assert "assert torch.version.cuda" in runs
    apt = " ".join(r for r in _instructions(dockerfile, "RUN") if "apt-get install" in r)
    assert not re.search(r"\b(cuda|libcudnn|libcublas|nvidia)", apt), apt
    # The slim base does not set what the CUDA images set for the NVIDIA Container Toolkit.
    assert dockerfile.envs["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in dockerfile.envs["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert "int8" in next(r for r in _instructions(dockerfile, "RUN") if ".[runtime," in r)


def _final_stage(parser: DockerfileParser) -> list[dict]:
    """The instructions after the last FROM: what the image that runs is made of."""
    structure = parser.structure
    last_from = max(n for n, i in enumerate(structure) if i["instruction"] == "FROM")
    return structure[last_from + 1 :]


def test_the_final_stage_can_build_moshis_compiled_kernels(dockerfile: DockerfileParser) -> None:
    """Issue 30, item 5: moshi 0.2.13 ``torch.compile``s ``_rms_norm``, ``apply_rope`` and the gating kernel
    on first use, and on CUDA Triton builds its launcher with a host C compiler at run time: the slim base
    has none ("Failed to find C compiler" at the first warm-up tick). The final stage installs gcc and
    libc6-dev (gcc's Recommends, skipped by --no-install-recommends: crt1.o and libc's headers), or turns
    torch.compile off with NO_TORCH_COMPILE; the Dockerfile says which and why."""
    stage = _final_stage(dockerfile)
    installed: set[str] = set()
    for instruction in stage:
        if instruction["instruction"] != "RUN":
            continue
        for command in re.split(r"&&|;", instruction["value"]):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                installed.update(w for w in words[2:] if not w.startswith("-"))
    no_compile = [
        i["value"]
        for i in stage
        if i["instruction"] == "ENV" and re.search(r"\bNO_TORCH_COMPILE=1\b", i["value"])
    ]
    compiler = {"gcc", "libc6-dev"} <= installed
    assert compiler or no_compile, f"the final stage installs {sorted(installed)}: no C compiler for Triton"
    text = DOCKERFILE.read_text()
    assert "Failed to find C compiler" in text and "NO_TORCH_COMPILE" in text  # the choice, stated


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


def _copies(parser: DockerfileParser) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of each COPY (no flags are used in this Dockerfile)."""
    copies = []
    for value in _instructions(parser, "COPY"):
        *sources, destination = value.split()
        assert not any(part.startswith("--") for part in sources), value
        copies.append((sources, destination))
    return copies


def _copied_sources(parser: DockerfileParser) -> list[str]:
    return [source for sources, _ in _copies(parser) for source in sources]


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
from runtime.tools.cli import app
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
    workdir = tmp_path / "context"  # the image's WORKDIR
    for sources, destination in _copies(dockerfile):
        for source in sources:
            target = workdir / destination
            if destination.endswith("/") or len(sources) > 1:
                target = target / Path(source).name
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
    assert "runtime/frontend/server.py" in names
    assert not [n for n in names if n.startswith("infra/")]


# --------------------------------------------------------------------------------------------------------
# The build context (.dockerignore) and its hash
# --------------------------------------------------------------------------------------------------------


def dockerignore_patterns(root: Path) -> list[str]:
    """``root/.dockerignore`` as moby's ``ignorefile.ReadAll`` reads it: one pattern a line, blank lines and
    ``#`` comments skipped, surrounding spaces trimmed."""
    lines = (line.strip() for line in (root / ".dockerignore").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _go_walk_order(path: str) -> list[str]:
    return path.split("/")  # Go's walk visits a directory's entries by name: paths compare part by part


def context_files(root: Path) -> list[str]:
    """The files of the build context rooted at ``root`` (relative, ``/``-separated), in walk order: every
    file the ``.dockerignore`` does not exclude."""
    matcher = PatternMatcher(dockerignore_patterns(root))
    # docker-py re-includes .dockerignore (the classic CLI sends it); BuildKit's fsutil, which the
    # provider uses, does not: drop that last pattern.
    assert matcher.patterns[-1].cleaned_pattern == ".dockerignore" and matcher.patterns[-1].exclusion
    matcher.patterns.pop()
    files = [p.replace(os.sep, "/") for p in matcher.walk(str(root)) if (root / p).is_file()]
    return sorted(files, key=_go_walk_order)


def provider_context_hash(root: Path, dockerfile: Path) -> str:
    """pulumi-docker-build's context hash (``hashBuildContext``; module docstring)."""
    digest = hashlib.sha256()
    digest.update(dockerfile.read_bytes())
    for relative in context_files(root):
        path = root / relative
        digest.update(path.read_bytes())
        digest.update(relative.encode())
        digest.update(stat.filemode(path.stat().st_mode).encode())
    return digest.hexdigest()


def _source_files(sources: list[str]) -> set[str]:
    """The files under the COPY sources, without Python's generated files."""
    files: set[str] = set()
    for source in sources:
        path = ROOT / source
        if path.is_file():
            files.add(source)
            continue
        for file in path.rglob("*"):
            parts = file.relative_to(ROOT).parts
            if file.is_file() and "__pycache__" not in parts and file.suffix not in (".pyc", ".pyo"):
                files.add("/".join(parts))
    return files


def test_the_build_context_is_exactly_what_the_dockerfile_copies(dockerfile: DockerfileParser) -> None:
    """Nothing but the COPY sources is sent to the builder or hashed by the provider, and each of them is."""
    sources = _copied_sources(dockerfile)
    context = set(context_files(ROOT))
    expected = _source_files(sources)
    assert context - expected == set(), "in the context but copied by no COPY"
    assert expected - context == set(), "copied by a COPY but left out of the context by .dockerignore"
    # Every COPY source is inside the allowlist, and is not empty there.
    for source in sources:
        assert any(f == source or f.startswith(source.rstrip("/") + "/") for f in context), source
    # The deployment tools and the repository's own documentation are not.
    assert not [f for f in context if f.split("/")[0] in ("infra", ".github", "stacks", "tests", "docs")]
    assert not {"Makefile", "README.md", "Pulumi.yaml", ".dockerignore"} & context


def test_the_dockerignore_is_an_allowlist() -> None:
    """A new top-level file or directory stays out without anyone adding it to .dockerignore."""
    # The provider (getIgnorePatterns) and BuildKit prefer <Dockerfile>.dockerignore: there must be none.
    assert not (DOCKERFILE.parent / "Dockerfile.dockerignore").exists()
    patterns = dockerignore_patterns(ROOT)
    assert patterns[0] == "*"
    assert all(p.startswith("!") or p.startswith("**/") for p in patterns[1:]), patterns


_DECOYS = {
    "infra/components/image.py": "# the Pulumi program\n",
    ".github/workflows/pulumi-up.yml": "name: pulumi-up\n",
    "stacks/Pulumi.dev.yaml": "config: {}\n",
    "tests/test_image.py": "# a test\n",
    "Makefile": "setup:\n\ttrue\n",
    "README.md": "# duplexops\n",
    "docs/runtime.md": "# The runtime\n",
    "Pulumi.yaml": "name: duplexops\n",
    "runtime/__pycache__/server.cpython-311.pyc": "bytecode",
    "runtime/.server.py.swp": "editor swap file",
}


@pytest.fixture
def repo_copy(dockerfile: DockerfileParser, tmp_path: Path) -> Path:
    """A copy of what the context can hold: .dockerignore, the Dockerfile, the COPY sources, and decoys
    that must stay out (the program, workflows, stacks, tests, Makefile, README, docs, generated files)."""
    root = tmp_path / "repo"
    for relative in [".dockerignore", "images/runtime/Dockerfile", *_copied_sources(dockerfile)]:
        source, target = ROOT / relative, root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    for relative, text in _DECOYS.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


def _edit(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n# edited\n")


@pytest.mark.parametrize("relative", [*_DECOYS, "NOTES.txt", "infra/new_module.py", ".dockerignore.bak"])
def test_a_change_outside_the_allowlist_keeps_the_context_hash(repo_copy: Path, relative: str) -> None:
    dockerfile = repo_copy / "images/runtime/Dockerfile"
    before = provider_context_hash(repo_copy, dockerfile)
    _edit(repo_copy / relative)
    assert provider_context_hash(repo_copy, dockerfile) == before


@pytest.mark.parametrize(
    "relative",
    [
        "runtime/frontend/server.py",
        "runtime/new_module.py",
        "pyproject.toml",
        "requirements.lock",
        "images/runtime/README.md",
        "images/runtime/Dockerfile",
    ],
)
def test_a_change_inside_the_allowlist_changes_the_context_hash(repo_copy: Path, relative: str) -> None:
    dockerfile = repo_copy / "images/runtime/Dockerfile"
    before = provider_context_hash(repo_copy, dockerfile)
    _edit(repo_copy / relative)
    assert provider_context_hash(repo_copy, dockerfile) != before


def test_a_mode_change_inside_the_allowlist_changes_the_context_hash(repo_copy: Path) -> None:
    dockerfile = repo_copy / "images/runtime/Dockerfile"
    before = provider_context_hash(repo_copy, dockerfile)
    (repo_copy / "runtime/tools/cli.py").chmod(0o755)
    assert provider_context_hash(repo_copy, dockerfile) != before


def test_dependencies_are_installed_before_the_runtime_is_copied(dockerfile: DockerfileParser) -> None:
    """A change of runtime/ leaves the dependency layer (torch, gigabytes) to the build cache."""
    steps = [(i["instruction"], i["value"]) for i in dockerfile.structure]
    install = next(n for n, (kind, value) in enumerate(steps) if kind == "RUN" and ".[runtime," in value)
    copy_runtime = next(
        n for n, (kind, value) in enumerate(steps) if kind == "COPY" and value.split()[0] == "runtime"
    )
    assert install < copy_runtime


def test_the_dockerfile_takes_source_date_epoch(dockerfile: DockerfileParser) -> None:
    """Declared in the stage, so RUN steps see it too (BuildKit's docs/build-repro.md)."""
    assert "SOURCE_DATE_EPOCH" in [value.split("=")[0] for value in _instructions(dockerfile, "ARG")]


@pytest.fixture(scope="module")
def dev_image() -> dict:
    """The dev stack's docker-build Image inputs, from the whole program under Pulumi's mocks."""
    from pulumi_harness import run_stack

    return run_stack("dev").one("docker-build:index:Image").plain


def test_the_program_builds_the_allowlisted_context(dev_image: dict) -> None:
    """The context the program passes is the one whose hash the tests above compute."""
    assert (Path.cwd() / dev_image["context"]["location"]).resolve() == ROOT
    assert (Path.cwd() / dev_image["dockerfile"]["location"]).resolve() == DOCKERFILE
    assert dockerignore_patterns(ROOT)[0] == "*"


def test_the_build_uses_a_registry_cache_and_a_fixed_timestamp(dev_image: dict) -> None:
    [tag] = dev_image["tags"]
    cache_ref = tag.rsplit(":", 1)[0] + ":buildcache"
    assert dev_image["cacheFrom"] == [{"registry": {"ref": cache_ref}}]
    [cache_to] = dev_image["cacheTo"]
    assert cache_to["registry"]["ref"] == cache_ref
    assert cache_to["registry"]["mode"] == "max"
    assert cache_to["registry"]["imageManifest"] is True and cache_to["registry"]["ociMediaTypes"] is True
    assert dev_image["buildArgs"] == {"SOURCE_DATE_EPOCH": "0"}


# --------------------------------------------------------------------------------------------------------
# Built once per push, promoted to every stack (issue 20, item 15)
# --------------------------------------------------------------------------------------------------------

CI_IMAGE = "us-central1-docker.pkg.dev/ci-project/duplexops-build/duplex-runtime@sha256:" + "ab" * 32
"""A digest-pinned reference as pulumi-up.yml's image job hands it to every stack."""


@pytest.mark.parametrize("stack", ["dev", "scale5-gcp", "multi-region"])
def test_a_ci_built_image_is_copied_by_digest_not_built_again(stack: str) -> None:
    """With ``duplexops:runtimeImage`` set (CI sets it for each update), a cloud stack builds nothing: it
    copies that digest into its own repository (``crane copy`` keeps it) and runs exactly that digest. Guards
    against building the image once per GCP stack (three builds per push, three different digests)."""
    from pulumi_harness import run_stack

    run = run_stack(stack, overrides={"duplexops:runtimeImage": CI_IMAGE})
    assert run.of_type("docker-build:index:Image") == []
    # The stack's own repository gets the CI digest; multi-region copies it on to each further region's
    # repository (test_stack_multi_region.py::test_each_region_pulls_from_its_own_registry).
    [copy] = [c for c in run.of_type("command:local:Command") if c.plain["environment"]["SOURCE"] == CI_IMAGE]
    repo = run.named("runtime-image-repository").plain
    target = f"{repo['location']}-docker.pkg.dev/{repo['project']}/{repo['repositoryId']}/duplex-runtime"
    assert copy.plain["environment"] == {"SOURCE": CI_IMAGE, "TARGET": f"{target}:latest"}
    assert CI_IMAGE in copy.plain["triggers"]  # a new digest copies again
    assert 'crane copy "$SOURCE" "$TARGET"' in copy.plain["create"]
    assert "gcloud auth configure-docker" in copy.plain["create"]  # fresh tokens, no one-hour login
    assert run.outputs["image"] == f"{target}@sha256:{'ab' * 32}"


def test_without_a_ci_image_the_stack_builds_it_itself() -> None:
    """``pulumi up`` from a workstation (no runtimeImage): the docker-build path, and no copy."""
    from pulumi_harness import run_stack

    run = run_stack("dev", overrides={"duplexops:runtimeImage": None})
    assert len(run.of_type("docker-build:index:Image")) == 1
    assert run.of_type("command:local:Command") == []


@pytest.mark.parametrize("reference", ["registry.example/duplex-runtime:latest", "x@sha256:abc", ""])
def test_a_promoted_image_must_be_digest_pinned(reference: str) -> None:
    from infra.components.image import digest_of

    with pytest.raises(ValueError, match="not digest-pinned; allowed: <repository>@sha256:<64 hex digits>"):
        digest_of(reference)


def test_runtime_image_is_a_stack_key_of_every_topology() -> None:
    """The key CI sets (pulumi-up-stack.yml's config-map) is read by every topology, and a tag is refused."""
    from pulumi_harness import stack_config

    from infra.stack_config import KEYS_OF, StackConfigError, parse_stack_config

    for keys in KEYS_OF.values():
        assert "duplexops:runtimeImage" in [f.alias for f in keys.model_fields.values()], keys
    config, secret_keys = stack_config("dev", overrides={"duplexops:runtimeImage": "repo/image:latest"})
    with pytest.raises(StackConfigError, match="runtimeImage"):
        parse_stack_config(config, stack="dev", secret_keys=set(secret_keys))


def test_a_promoted_image_can_be_copied_on_to_another_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """``promote`` takes an Output too (a repository per region: the second copy reads the first's
    ``image_ref``), and the digest survives both copies."""
    import pulumi
    from pulumi_harness import run_stack

    import infra.__main__
    from infra.components.image import promote

    first_repo = "us-central1-docker.pkg.dev/p/duplex/duplex-runtime"
    second_repo = "europe-west4-docker.pkg.dev/p/duplex/duplex-runtime"

    def two_regions() -> dict[str, object]:
        options = pulumi.ResourceOptions()
        _, first = promote("copy-us", CI_IMAGE, first_repo, "latest", options)
        _, second = promote("copy-eu", first, pulumi.Output.from_input(second_repo), "latest", options)
        return {"first": first, "second": second}

    monkeypatch.setattr(infra.__main__, "main", two_regions)
    run = run_stack("dev")
    digest = "sha256:" + "ab" * 32
    assert run.outputs == {"first": f"{first_repo}@{digest}", "second": f"{second_repo}@{digest}"}
    environments = {c.name: c.plain["environment"] for c in run.of_type("command:local:Command")}
    assert environments["copy-eu"] == {"SOURCE": f"{first_repo}@{digest}", "TARGET": f"{second_repo}:latest"}
