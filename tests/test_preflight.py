"""``duplex preflight`` (issue 33): a stack's GPUs per region and quota metric, read from its stack file,
against the quotas of a fake Compute Engine API on loopback that answers ``regions.get`` and
``projects.get`` with the REST reference's JSON shapes (``quotas[]`` of ``{metric, limit, usage}``;
cloud.google.com/compute/docs/reference/rest/v1/regions) and Google's error shape for a disabled API.
The HTTP path is the real one (``url_transport``, the standard library's client)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fresh_project import (
    NODE_POOL,
    declared_gpus,
    gpu_quota_after_preflight,
    gpu_quota_problems,
    preflight_requests,
)
from pulumi_harness import run_stack
from typer.testing import CliRunner

from infra.cli import app
from infra.preflight import (
    ComputeQuotas,
    PreflightError,
    access_token,
    compare,
    gpu_needs,
    load_stack,
)
from infra.preflight.needs import STACKS_DIR

PROJECT = "duplex-test-123"
TOKEN = "ya29.fake-token"


def quotas(**metrics: tuple[float, float]) -> list[dict[str, Any]]:
    """``quotas[]`` entries from ``METRIC=(limit, usage)``, among the non-GPU ones every region lists."""
    base = [
        {"metric": "CPUS", "limit": 24.0, "usage": 0.0},
        {"metric": "DISKS_TOTAL_GB", "limit": 4096.0, "usage": 0.0},
    ]
    return base + [{"metric": m, "limit": lim, "usage": use} for m, (lim, use) in metrics.items()]


DISABLED = {
    "error": {
        "code": 403,
        "message": f"Compute Engine API has not been used in project {PROJECT} before or it is disabled.",
        "errors": [{"message": "...", "domain": "usageLimits", "reason": "accessNotConfigured"}],
        "status": "PERMISSION_DENIED",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "SERVICE_DISABLED",
                "domain": "googleapis.com",
                "metadata": {"service": "compute.googleapis.com", "consumer": f"projects/{PROJECT}"},
            }
        ],
    }
}


class FakeCompute:
    """The two Compute Engine methods preflight calls, answering from ``regions`` and ``project``."""

    def __init__(self) -> None:
        self.regions: dict[str, list[dict[str, Any]]] = {}
        self.project: list[dict[str, Any]] = quotas(GPUS_ALL_REGIONS=(0.0, 0.0))
        self.error: tuple[int, dict[str, Any]] | None = None
        self.paths: list[str] = []
        self.url = ""

    def answer(self, path: str, authorization: str | None) -> tuple[int, dict[str, Any]]:
        self.paths.append(path)
        if authorization != f"Bearer {TOKEN}":
            return 401, {"error": {"code": 401, "message": "Request had invalid authentication credentials."}}
        if self.error:
            return self.error
        route, _, query = path.partition("?")
        assert query == "fields=quotas"
        parts = route.strip("/").split("/")
        if parts[:3] != ["compute", "v1", "projects"] or parts[3] != PROJECT:
            return 404, {"error": {"code": 404, "message": f"The resource '{route}' was not found"}}
        if len(parts) == 4:
            return 200, {"quotas": self.project}
        if len(parts) == 6 and parts[4] == "regions" and parts[5] in self.regions:
            return 200, {"quotas": self.regions[parts[5]]}
        return 404, {"error": {"code": 404, "message": f"The resource '{route}' was not found"}}


@pytest.fixture
def compute() -> Iterator[FakeCompute]:
    fake = FakeCompute()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = fake.answer(self.path, self.headers.get("Authorization"))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/compute/v1"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def run_cli(compute: FakeCompute, stack: str, *extra: str) -> Any:
    args = ["preflight", "--stack", stack, "--project", PROJECT, "--api", compute.url, *extra]
    return CliRunner().invoke(app, args, env={"GOOGLE_OAUTH_ACCESS_TOKEN": TOKEN, "COLUMNS": "250"})


# --- what each committed stack needs --------------------------------------------------------------------


def test_needs_of_the_committed_stacks() -> None:
    def rows(stack: str) -> list[tuple[str, str, int, str | None]]:
        config = load_stack(stack, project=PROJECT)
        assert config is not None
        return [(n.region, n.metric, n.count, n.fallback) for n in gpu_needs(config)]

    # dev: one Spot n1-standard-8 with one T4: preemptible quota, the on-demand one as fallback.
    assert rows("dev") == [
        ("us-central1", "PREEMPTIBLE_NVIDIA_T4_GPUS", 1, "NVIDIA_T4_GPUS"),
        ("global", "GPUS_ALL_REGIONS", 1, None),
    ]
    # scale5-gcp: a2-ultragpu-1g carries its A100 80 GB.
    assert rows("scale5-gcp") == [
        ("us-central1", "NVIDIA_A100_80GB_GPUS", 1, None),
        ("global", "GPUS_ALL_REGIONS", 1, None),
    ]
    # multi-region: each region's pool at maxNodes (4 and 3), 7 project-wide; not minNodes (2 and 1).
    assert rows("multi-region") == [
        ("us-central1", "NVIDIA_A100_80GB_GPUS", 4, None),
        ("europe-west4", "NVIDIA_A100_80GB_GPUS", 3, None),
        ("global", "GPUS_ALL_REGIONS", 7, None),
    ]
    assert load_stack("scale5-onprem") is None  # the host's own GPU: no project, no quota


def test_on_demand_vm_takes_the_on_demand_quota(tmp_path: Any) -> None:
    text = (STACKS_DIR / "Pulumi.dev.yaml").read_text()
    (tmp_path / "Pulumi.dev.yaml").write_text(
        text.replace("provisioningModel: spot", "provisioningModel: standard")
    )
    config = load_stack("dev", project=PROJECT, stacks_dir=tmp_path)
    assert config is not None
    assert [(n.metric, n.count, n.fallback) for n in gpu_needs(config)] == [
        ("NVIDIA_T4_GPUS", 1, None),
        ("GPUS_ALL_REGIONS", 1, None),
    ]


# --- against the project's quotas -----------------------------------------------------------------------


def test_fresh_project_says_what_to_request(compute: FakeCompute) -> None:
    """A new project: GPUS_ALL_REGIONS 0 and no A100 80 GB quota in either region."""
    compute.regions = {
        "us-central1": quotas(NVIDIA_A100_80GB_GPUS=(0.0, 0.0)),
        "europe-west4": quotas(NVIDIA_A100_80GB_GPUS=(0.0, 0.0)),
    }
    result = run_cli(compute, "multi-region")
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert "request NVIDIA_A100_80GB_GPUS = 4 in us-central1" in out
    assert "request NVIDIA_A100_80GB_GPUS = 3 in europe-west4" in out
    assert "request GPUS_ALL_REGIONS = 7 in all regions" in out
    # one regions.get per region, one projects.get
    assert sorted(p.split("?")[0].rsplit("/", 1)[-1] for p in compute.paths) == [
        PROJECT,
        "europe-west4",
        "us-central1",
    ]


def test_enough_quota_passes(compute: FakeCompute) -> None:
    compute.regions = {
        "us-central1": quotas(NVIDIA_A100_80GB_GPUS=(8.0, 2.0)),
        "europe-west4": quotas(NVIDIA_A100_80GB_GPUS=(3.0, 0.0)),
    }
    compute.project = quotas(GPUS_ALL_REGIONS=(16.0, 2.0))
    result = run_cli(compute, "multi-region")
    assert result.exit_code == 0, result.output
    assert "every quota holds the stack" in result.output


def test_usage_counts_against_the_limit(compute: FakeCompute) -> None:
    """Limit 4 with 2 in use holds 2 more, not 4: request usage + need = 6."""
    compute.regions = {
        "us-central1": quotas(NVIDIA_A100_80GB_GPUS=(4.0, 2.0)),
        "europe-west4": quotas(NVIDIA_A100_80GB_GPUS=(3.0, 0.0)),
    }
    compute.project = quotas(GPUS_ALL_REGIONS=(16.0, 2.0))
    result = run_cli(compute, "multi-region", "--json")
    assert result.exit_code == 1, result.output
    rows = {(r["region"], r["metric"]): r for r in json.loads(result.output)}
    short = rows[("us-central1", "NVIDIA_A100_80GB_GPUS")]
    assert (short["needed"], short["limit"], short["usage"], short["ok"], short["request"]) == (
        4,
        4.0,
        2.0,
        False,
        6,
    )
    assert rows[("europe-west4", "NVIDIA_A100_80GB_GPUS")]["ok"] is True
    assert rows[("global", "GPUS_ALL_REGIONS")]["ok"] is True


def test_region_missing_the_metric_is_named(compute: FakeCompute) -> None:
    compute.regions = {
        "us-central1": quotas(NVIDIA_A100_80GB_GPUS=(8.0, 0.0)),
        "europe-west4": quotas(NVIDIA_T4_GPUS=(4.0, 0.0)),  # no A100 80 GB listed there
    }
    compute.project = quotas(GPUS_ALL_REGIONS=(16.0, 0.0))
    result = run_cli(compute, "multi-region")
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert "region europe-west4 lists no NVIDIA_A100_80GB_GPUS quota: the GPU is not offered there" in out
    assert "gcloud compute accelerator-types list --filter=zone~europe-west4" in out


def test_spot_uses_the_on_demand_quota_when_no_preemptible_quota(compute: FakeCompute) -> None:
    compute.regions = {
        "us-central1": quotas(PREEMPTIBLE_NVIDIA_T4_GPUS=(0.0, 0.0), NVIDIA_T4_GPUS=(1.0, 0.0))
    }
    compute.project = quotas(GPUS_ALL_REGIONS=(1.0, 0.0))
    result = run_cli(compute, "dev", "--json")
    assert result.exit_code == 0, result.output
    [regional, _] = json.loads(result.output)
    assert (regional["metric"], regional["ok"]) == ("NVIDIA_T4_GPUS", True)
    compute.regions = {
        "us-central1": quotas(PREEMPTIBLE_NVIDIA_T4_GPUS=(0.0, 0.0), NVIDIA_T4_GPUS=(0.0, 0.0))
    }
    result = run_cli(compute, "dev")
    assert result.exit_code == 1
    assert "request PREEMPTIBLE_NVIDIA_T4_GPUS = 1 in us-central1" in " ".join(result.output.split())


def test_onprem_needs_no_quota(compute: FakeCompute) -> None:
    result = run_cli(compute, "scale5-onprem")
    assert result.exit_code == 0, result.output
    assert "no GCP GPU quota needed" in result.output
    assert compute.paths == []


# --- what stops the check, and what to do ----------------------------------------------------------------


def test_api_disabled_says_how_to_enable_it(compute: FakeCompute) -> None:
    compute.error = (403, DISABLED)
    result = run_cli(compute, "scale5-gcp")
    assert result.exit_code == 2
    assert "the Compute Engine API is not enabled in project 'duplex-test-123'" in result.output
    assert f"gcloud services enable compute.googleapis.com --project {PROJECT}" in result.output


def test_refused_credentials_and_permission(compute: FakeCompute) -> None:
    api = ComputeQuotas("ya29.expired", api=compute.url)
    with pytest.raises(
        PreflightError, match="credentials were refused.*gcloud auth application-default login"
    ):
        api.project(PROJECT)
    compute.error = (403, {"error": {"code": 403, "message": "Required 'compute.regions.get' permission"}})
    with pytest.raises(PreflightError, match=r"permission denied.*roles/compute.viewer"):
        ComputeQuotas(TOKEN, api=compute.url).region(PROJECT, "us-central1")


def test_unknown_stack_and_placeholder_project(compute: FakeCompute) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["preflight", "--stack", "prod"])
    assert result.exit_code == 2
    assert (
        "unknown stack 'prod'" in result.output
        and "allowed: dev, multi-region, scale5-gcp, scale5-onprem" in result.output
    )
    result = runner.invoke(app, ["preflight", "--stack", "dev"])
    assert result.exit_code == 2
    assert "gcp:project: still the placeholder 'my-gcp-project'" in result.output
    assert "--project" in result.output


def test_no_credentials() -> None:
    def missing(argv: list[str]) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(PreflightError, match="no credentials: gcloud is not installed"):
        access_token(env={}, run=missing)

    def logged_out(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "ERROR: Your default credentials were not found.")

    with pytest.raises(PreflightError, match="credentials were not found.*application-default login"):
        access_token(env={}, run=logged_out)
    assert access_token(env={"GOOGLE_OAUTH_ACCESS_TOKEN": " tok "}, run=missing) == "tok"


def test_compare_reads_each_region_once(compute: FakeCompute) -> None:
    compute.regions = {"us-central1": quotas(NVIDIA_A100_80GB_GPUS=(1.0, 0.0))}
    compute.project = quotas(GPUS_ALL_REGIONS=(1.0, 0.0))
    config = load_stack("scale5-gcp", project=PROJECT)
    assert config is not None
    rows = compare(gpu_needs(config), PROJECT, ComputeQuotas(TOKEN, api=compute.url))
    assert [r.ok for r in rows] == [True, True] and len(compute.paths) == 2


# --- the fresh-project model: every stack's first `up` against the quotas preflight asked for -----------


@pytest.mark.parametrize("stack", ["dev", "scale5-gcp", "scale5-onprem", "multi-region"])
def test_first_up_fits_the_quota_preflight_asks_for(stack: str) -> None:
    """The GPUs each stack's program declares (instances, pools at their maximum plus upgrade surge) fit in
    a fresh project once the operator has requested what ``duplex preflight`` said; without the requests
    (a new project: every GPU quota 0) every GCP stack fails."""
    run = run_stack(stack)
    assert gpu_quota_after_preflight(run) == []
    declared = {(n.region, n.metric): n.count for n in declared_gpus(run)}
    assert declared == preflight_requests(run)
    untouched = gpu_quota_problems(run, {})
    if stack == "scale5-onprem":
        assert untouched == [] and declared == {}
    else:
        assert any(p.startswith("global: GPUS_ALL_REGIONS") for p in untouched), untouched


def test_a_pool_that_surges_beyond_what_preflight_asked_for_fails() -> None:
    """A GPU pool upgraded with a surge node (one more GPU per zone) needs quota preflight did not ask for."""
    run = run_stack("multi-region")
    surging = []
    for r in run.resources:
        if r.type == NODE_POOL and r.plain.get("name") == "gpu":
            settings = {**r.inputs["upgradeSettings"], "maxSurge": 1}
            r = dataclasses.replace(r, inputs={**r.inputs, "upgradeSettings": settings})
        surging.append(r)
    problems = gpu_quota_after_preflight(dataclasses.replace(run, resources=surging))
    # in any order: Pulumi registers the regions' resources concurrently
    assert sorted(p.split(" (")[0] for p in problems) == [
        "europe-west4: NVIDIA_A100_80GB_GPUS 4 declared",
        "global: GPUS_ALL_REGIONS 10 declared",
        "us-central1: NVIDIA_A100_80GB_GPUS 6 declared",
    ], problems


def test_a_spot_vm_fits_the_on_demand_quota_too() -> None:
    run = run_stack("dev")
    assert (
        gpu_quota_problems(run, {("us-central1", "NVIDIA_T4_GPUS"): 1, ("global", "GPUS_ALL_REGIONS"): 1})
        == []
    )
    [short] = gpu_quota_problems(run, {("us-central1", "NVIDIA_T4_GPUS"): 1})
    assert short.startswith("global: GPUS_ALL_REGIONS 1 declared")
