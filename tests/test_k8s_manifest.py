"""``infra.k8s.manifest``: apply order, manifests back from Pulumi's mocks (``to_manifest``), the YAML file,
strict validation of the CRD kinds and unknown kinds; and the two programs the objects run: the weights
Job's download script (against a stand-in ``huggingface_hub``) and the preStop hook (against a real
``duplex serve``)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from infra.k8s import workload as k8s_workload
from infra.k8s.manifest import (
    UnknownKindError,
    to_manifest,
    validate_manifests,
    write_manifests,
)
from infra.k8s.region import APPLY_FIRST
from runtime.tools.local_redis import free_loopback_port

_SECRET_SIG = {"4dabf18193072939515e22adb298388d": "1b47061264138c4ac30d75fd1eb44270"}


def _floatified(value):
    """What Pulumi's mocks make of a manifest: every number a float, stringData a wrapped secret."""
    if isinstance(value, dict):
        return {k: _floatified(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floatified(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# --- order, to_manifest, YAML -------------------------------------------------------------------------------


def test_apply_order_puts_foundations_first(objects: list[dict]) -> None:
    kinds = [o["kind"] for o in objects]
    firsts = [k for k in kinds if k in APPLY_FIRST]
    assert kinds[: len(firsts)] == firsts
    assert firsts == sorted(firsts, key=APPLY_FIRST.index)
    assert kinds.index("Job") < kinds.index("Deployment")
    assert kinds[-1] == "ClusterRules"


def test_to_manifest_undoes_pulumis_mocks(objects: list[dict]) -> None:
    for obj in objects:
        captured = _floatified(obj)
        if obj["kind"] == "Secret":
            captured["stringData"] = {**_SECRET_SIG, "value": captured["stringData"]}
        captured["__defaults"] = []
        captured["metadata"] = {**captured["metadata"], "uid": None}
        assert to_manifest(captured) == obj
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    body = {k: v for k, v in _floatified(deployment).items() if k not in ("apiVersion", "kind")}
    assert to_manifest("kubernetes:apps/v1:Deployment", body) == deployment
    service = next(o for o in objects if o["kind"] == "Service")
    body = {k: v for k, v in service.items() if k not in ("apiVersion", "kind")}
    assert to_manifest("kubernetes:core/v1:Service", body)["apiVersion"] == "v1"
    assert to_manifest({"a": 80.0, "b": 0.5, "c": True})["a"] == 80
    assert to_manifest({"a": 80.0, "b": 0.5, "c": True})["b"] == 0.5


def test_written_yaml_reads_back_equal(objects: list[dict], tmp_path: Path) -> None:
    path = write_manifests(objects, tmp_path / "region.yaml")
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert documents == objects
    assert validate_manifests(documents) == []
    text = path.read_text()
    assert "ca.pem: |" in text  # multi-line values as literal blocks


# --- validation ------------------------------------------------------------------------------------------


def test_crd_kinds_are_validated_strictly(objects: list[dict]) -> None:
    monitoring = copy.deepcopy(next(o for o in objects if o["kind"] == "PodMonitoring"))
    monitoring["spec"]["endpoints"][0]["intervall"] = "5s"
    monitoring["spec"]["endpoints"][0]["port"] = True
    monitoring["metadata"]["generation"] = 3
    problems = validate_manifests([monitoring])
    where = f"PodMonitoring duplex/{monitoring['metadata']['name']}"
    assert any(
        p.startswith(f"{where}: spec.endpoints[0]: ") and "'intervall' was unexpected" in p for p in problems
    )
    assert any(p.startswith(f"{where}: spec.endpoints[0].port: ") for p in problems)
    assert any("metadata.generation: unknown field" in p for p in problems)

    rules = copy.deepcopy(next(o for o in objects if o["kind"] == "ClusterRules"))
    del rules["spec"]["groups"][0]["interval"]
    rules["metadata"]["namespace"] = "duplex"
    problems = validate_manifests([rules])
    assert any("spec.groups[0]: 'interval' is a required property" in p for p in problems)
    assert any("ClusterRules is cluster-scoped" in p for p in problems)


def test_duplicates_and_missing_names_are_problems(objects: list[dict]) -> None:
    service = next(o for o in objects if o["kind"] == "Service")
    problems = validate_manifests([service, copy.deepcopy(service), {"kind": "Service"}])
    assert any("same kind, namespace and name" in p for p in problems)
    assert any(p.startswith("object #2: needs apiVersion, kind and metadata.name") for p in problems)


def test_unknown_kinds_raise() -> None:
    unknown = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "x"}}
    with pytest.raises(UnknownKindError, match="Widget.*example.com/v1.*PodMonitoring"):
        validate_manifests([unknown])


# --- the programs the objects run --------------------------------------------------------------------------


_STUB_HUB = """\
import os, pathlib
def snapshot_download(repo_id, local_dir):
    calls = pathlib.Path(os.environ["STUB_CALLS"])
    calls.write_text(calls.read_text() + repo_id + "\\n" if calls.exists() else repo_id + "\\n")
    root = pathlib.Path(local_dir)
    (root / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
    (root / ".cache" / "huggingface" / "model.safetensors.lock").write_text("")
    (root / "model.safetensors").write_bytes(b"weights")
    (root / "tokenizer_spm_32k_3.model").write_bytes(b"spm")
    return local_dir
"""


def test_weights_script_downloads_once_and_marks_completion(objects: list[dict], tmp_path: Path) -> None:
    job = next(o for o in objects if o["kind"] == "Job")
    [container] = job["spec"]["template"]["spec"]["containers"]
    program, repo, target, marker = container["command"][2:]
    stub = tmp_path / "stub"
    (stub / "huggingface_hub").mkdir(parents=True)
    (stub / "huggingface_hub" / "__init__.py").write_text(_STUB_HUB)
    local_target = tmp_path / target.lstrip("/")
    env = {**os.environ, "PYTHONPATH": str(stub), "STUB_CALLS": str(tmp_path / "calls")}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", program, repo, str(local_target), marker],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "calls").read_text() == "nvidia/personaplex-7b-v1\n"  # the second run did nothing
    assert "already complete" in result.stdout
    done = json.loads((local_target / marker).read_text())
    assert done["repo"] == repo
    assert done["files"] == ["model.safetensors", "tokenizer_spm_32k_3.model"]


def _healthy(port: int) -> bool:
    """The runtime has loaded its model and serves (``/healthz`` already answers during the load)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("sh") is None, reason="needs sh and curl")
def test_prestop_hook_drains_a_real_runtime_and_returns_when_it_has_stopped(tmp_path: Path) -> None:
    """The preStop command (with the runtime's pid for PID 1) against ``duplex serve`` (tiny, CPU): the
    runtime drains on its SIGTERM, the hook returns once it has stopped listening, and it exits 0."""
    port = free_loopback_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUPLEX_")}
    env.update(
        DUPLEX_PORT=str(port), DUPLEX_AUTH_MODE="off", DUPLEX_DRAIN_GRACE_S="1", DUPLEX_MAX_SESSIONS="1"
    )
    script = Path(sys.executable).with_name("duplex")
    command = (
        [str(script), "serve"]
        if script.exists()
        else [sys.executable, "-c", "from runtime.tools.cli import app; app()", "serve"]
    )
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        hook = k8s_workload.prestop_command(port, pid=proc.pid)
        result = subprocess.run(hook, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert not _healthy(port)  # the hook returned once the runtime stopped listening
        assert proc.wait(30) == 0, log.read_text()
        assert "draining" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
