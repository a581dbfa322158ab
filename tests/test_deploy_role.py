"""Each role installs its own extra: the Pulumi program and the policy pack run with ``.[deploy]`` alone
(no ``dev`` tools or validators, no torch), the runtime with ``.[runtime]`` alone (no Pulumi, no node
renderers, no ``infra`` package: the image).

Each test runs a fresh interpreter in which every installed distribution outside the role's dependency
closure is blocked (importing one of its modules raises ``ModuleNotFoundError``, as in an environment
where it was never installed): for the program, the closure of the project's base dependencies and the
``deploy`` extra (``pyproject.toml``); for the policy pack, that of ``infra/policy/requirements.txt`` (the
virtualenv the Pulumi CLI makes for it); for the runtime, the base and the ``runtime`` extra plus moshi
(installed without its dependencies). docs/packaging.md.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from infra.policy.rules import RULES, STACK_RULES

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def closure(requirements: Iterable[str]) -> set[str]:
    """Canonical names of the installed distributions that ``requirements`` pull in, transitively, with
    their extras and environment markers honoured."""
    found: set[str] = set()
    todo = [(Requirement(r), frozenset()) for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(
                sub.marker.evaluate({"extra": extra}) for extra in (req.extras or {""})
            ):
                todo.append((sub, frozenset()))
    return found


def blocked_modules(allowed: set[str], *, project: Iterable[str] = ("runtime", "infra")) -> list[str]:
    """Top-level modules that only distributions outside ``allowed`` provide, and the project's packages
    not in ``project``."""
    allowed = allowed | {canonicalize_name(PROJECT["name"])}
    blocked = [name for name in ("runtime", "infra") if name not in project]
    for module, dists in metadata.packages_distributions().items():
        if module in ("runtime", "infra"):
            continue
        if not {canonicalize_name(d) for d in dists} & allowed:
            blocked.append(module)
    return sorted(blocked)


_PRELUDE = """
import importlib.abc, json, sys
BLOCKED = frozenset(json.loads(sys.argv[1]))
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed for this role)", name=name)
sys.meta_path.insert(0, NotInstalled())
"""

_PROGRAM = """
sys.path.insert(0, "tests")
from pulumi_harness import run_stack
from infra.policy.rules import check_resources
for stack in ("dev", "scale5-gcp", "scale5-onprem", "multi-region"):
    run = run_stack(stack)
    problems = check_resources([(r.type, r.plain) for r in run.resources if r.custom])
    print(json.dumps({"stack": stack, "resources": len(run.resources), "problems": problems}))
from pulumi_harness import run_program
def bootstrap():
    from infra.bootstrap.__main__ import main
    return main()
config = {"gcp:project": "my-gcp-project", "duplexops-bootstrap:githubRepository": "acme/duplexops"}
run = run_program(bootstrap, project="duplexops-bootstrap", stack="bootstrap", config=config)
print(json.dumps({"stack": "bootstrap", "resources": len(run.resources), "problems": []}))
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(json.dumps({"blocked_but_loaded": loaded}))
"""

_POLICY_PACK = """
import runpy
import pulumi_policy
built = []
pulumi_policy.PolicyPack = lambda **kwargs: built.append(kwargs)
runpy.run_path("infra/policy", run_name="__main__")  # as `python -m pulumi.policy` runs the pack
[pack] = built
from infra.policy.rules import INSTANCE
from pulumi_policy.policy import _PolicyAnalyzerServicer
from google.protobuf import struct_pb2
from pulumi.runtime import proto
servicer = _PolicyAnalyzerServicer(pack["name"], "0.1.0", pack["policies"], pack["enforcement_level"])
props = struct_pb2.Struct()
props.update({"machineType": "a2-ultragpu-1g", "guestAccelerators": [{"type": "nvidia-tesla-t4"}]})
request = proto.AnalyzeRequest(type=INSTANCE, properties=props, urn="urn:vm", name="vm")
names = sorted(d.policyName for d in servicer.Analyze(request, None).diagnostics)
print(json.dumps({"policies": len(pack["policies"]), "violations": names}))
"""


_RUNTIME = """
from typer.testing import CliRunner
import runtime.engine.batch, runtime.frontend.server, runtime.engine.models
import runtime.frontend.store.redis_store
from runtime.tools.cli import app
result = CliRunner().invoke(app, ["serve", "--help"])
assert result.exit_code == 0, result.output
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print(json.dumps({"blocked_but_loaded": loaded}))
"""


def _run(code: str, blocked: list[str]) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", _PRELUDE + code, json.dumps(blocked)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_the_blocked_modules_are_the_other_roles() -> None:
    blocked = blocked_modules(
        closure([*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["deploy"]])
    )
    assert {"torch", "numpy", "pytest", "jsonschema", "kubernetes_validate", "hypothesis"} <= set(blocked)
    assert not {"pulumi", "pulumi_gcp", "pydantic", "yaml", "typer", "jwt"} & set(blocked)


def test_the_program_and_the_rules_run_with_the_deploy_extra_alone() -> None:
    """Every stack's program and the policy rules, and the bootstrap project's program."""
    blocked = blocked_modules(
        closure([*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["deploy"]])
    )
    *runs, last = _run(_PROGRAM, blocked)
    assert [r["stack"] for r in runs] == ["dev", "scale5-gcp", "scale5-onprem", "multi-region", "bootstrap"]
    assert all(r["resources"] > 10 and r["problems"] == [] for r in runs), runs
    assert last == {"blocked_but_loaded": []}


def test_the_policy_pack_runs_in_its_own_virtualenv() -> None:
    pins = [
        line
        for line in (ROOT / "infra/policy/requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    [result] = _run(_POLICY_PACK, blocked_modules(closure(pins)))
    assert result["policies"] == len(RULES) + len(STACK_RULES)
    assert {"gpu-instance-terminate-on-maintenance", "gpu-machine-type-match"} <= set(result["violations"])


def test_the_runtime_runs_with_the_runtime_extra_alone() -> None:
    allowed = closure([*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["runtime"]]) | {"moshi"}
    blocked = blocked_modules(allowed, project=("runtime",))
    assert {"infra", "pulumi", "grafana_foundation_sdk", "pytest"} <= set(blocked)
    assert _run(_RUNTIME, blocked) == [{"blocked_but_loaded": []}]
