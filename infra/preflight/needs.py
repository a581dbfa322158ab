"""The GPUs a stack asks GCP for, per region and per quota metric, read from its stack file.

A stack's ``stacks/Pulumi.<stack>.yaml`` (Pulumi.yaml's ``stackConfigDir``; ``pulumi config set`` writes
there, secrets as ``secure:`` values) is validated by ``infra.stack_config.parse_stack_config`` as the
program does, and turned into ``GpuNeed`` rows: one per (region, metric), and one project-wide
``GPUS_ALL_REGIONS`` row. Quota metric names: the Compute Engine v1 ``Quota.metric`` enum
(cloud.google.com/compute/docs/reference/rest/v1/regions, ``quotas[].metric``; the client libraries' enum:
``NVIDIA_T4_GPUS``, ``NVIDIA_L4_GPUS``, ``NVIDIA_A100_GPUS``, ``NVIDIA_A100_80GB_GPUS``,
``NVIDIA_H100_GPUS``, ``GPUS_ALL_REGIONS``, and ``PREEMPTIBLE_NVIDIA_*``); docs/deploying.md, "GPU quota".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra.capacity.gcp import get_machine_type
from infra.stack_config import GCP_NAMESPACE, NAMESPACE, StackConfig, StackConfigError, parse_stack_config

__all__ = [
    "ALL_REGIONS",
    "GPU_POOL_UPGRADE_SURGE",
    "PLACEHOLDER_PROJECT",
    "PROJECT_METRIC",
    "QUOTA_METRICS",
    "STACKS_DIR",
    "GpuNeed",
    "PreflightError",
    "gpu_needs",
    "load_stack",
    "quota_metrics",
    "stack_values",
]

STACKS_DIR = Path(__file__).resolve().parents[2] / "stacks"
"""Where the stack files live (``stackConfigDir: stacks`` in the repository's Pulumi.yaml)."""

PLACEHOLDER_PROJECT = "my-gcp-project"
"""The project id the committed stack files carry until the operator sets theirs."""

PROJECT_METRIC = "GPUS_ALL_REGIONS"
"""The project-wide GPU quota (``projects.get`` ``quotas[]``): every GPU in every region counts against it,
and a new project has 0 (cloud.google.com/compute/resource-usage, "GPU quota"; docs/deploying.md)."""

ALL_REGIONS = "global"
"""The scope of ``PROJECT_METRIC`` rows (``GpuNeed.region``)."""

QUOTA_METRICS: dict[str, str] = {
    "t4": "NVIDIA_T4_GPUS",
    "l4": "NVIDIA_L4_GPUS",
    "a100-40gb": "NVIDIA_A100_GPUS",
    "a100-80gb-sxm": "NVIDIA_A100_80GB_GPUS",
    "h100": "NVIDIA_H100_GPUS",
    "h200": "NVIDIA_H200_GPUS",
}
"""Regional on-demand quota metric of each GPU GCP offers (``infra.capacity.gcp.GCP_GPUS``), by catalog key:
the Compute Engine v1 ``Quota.metric`` enum (``NVIDIA_H200_GPUS`` follows the family's pattern; it was not
in the enum excerpts read, and a region that lists no such metric is reported as such)."""

PREEMPTIBLE_PREFIX = "PREEMPTIBLE_"
"""Spot (and preemptible) VMs count against ``PREEMPTIBLE_<metric>`` when the project has that quota, and
against the on-demand metric otherwise (cloud.google.com/compute/docs/instances/create-use-spot: "To prevent
Spot VMs from consuming your quotas for standard VMs' CPUs, GPUs, and disks, consider requesting preemptible
quota for Spot VMs"). Flex-start VMs are taken to count as Spot does (not confirmed in GCP's pages read
here)."""

GPU_POOL_UPGRADE_SURGE = 0
"""Surge nodes per zone of a multi-region GPU pool's upgrade (``infra.components.gke_parts`` GPU pool
``upgrade_settings``: ``max_surge 0, max_unavailable 1``): each one would be one more GPU in the region.
The runtime Deployment's own rolling update (``infra.k8s.workload.runtime_deployment``: ``maxSurge 1``) adds
no GPU: the cluster autoscaler never grows the pool past ``total_max_node_count``, so a surge pod at
``maxNodes`` waits for a node instead. ``tests/fresh_project.py`` counts the GPUs from the declared pools
and instances, so a change here that the program does not make (or the reverse) fails its quota check."""


class PreflightError(ValueError):
    """What stops the preflight before it can compare (unknown stack, missing project, no credentials, the
    Compute Engine API disabled, ...): the message names what was wrong and what to do."""


@dataclass(frozen=True)
class GpuNeed:
    """GPUs a stack takes from one quota.

    Attributes:
        region: the GCP region (``us-central1``), or ``ALL_REGIONS`` for ``PROJECT_METRIC``.
        metric: the quota metric to hold them (``NVIDIA_A100_80GB_GPUS``, ``PREEMPTIBLE_NVIDIA_T4_GPUS``).
        count: GPUs at the stack's ceiling (a multi-region pool at ``maxNodes``), >= 1.
        why: where the count comes from, for the report.
        fallback: a metric that also holds them when ``metric`` has no room (a Spot VM's on-demand metric),
            or None.
    """

    region: str
    metric: str
    count: int
    why: str
    fallback: str | None = None


def quota_metrics(gpu: str, provisioning_model: str = "standard") -> tuple[str, str | None]:
    """``(metric, fallback)`` of one ``gpu`` (catalog key) under ``provisioning_model``.

    Raises:
        PreflightError: ``gpu`` is not offered on GCP (names the GPUs that are).
    """
    if gpu not in QUOTA_METRICS:
        raise PreflightError(
            f"GPU {gpu!r} has no GCP quota metric; allowed: {', '.join(sorted(QUOTA_METRICS))}"
        )
    base = QUOTA_METRICS[gpu]
    if provisioning_model in ("spot", "flex-start"):
        return PREEMPTIBLE_PREFIX + base, base
    return base, None


def gpu_needs(config: StackConfig) -> list[GpuNeed]:
    """The GPUs ``config`` takes, one row per (region, metric) then the ``PROJECT_METRIC`` row; empty for
    a topology with no GCP GPU (``onprem-node``).

    - ``gce-node``: the VM's GPUs: ``acceleratorCount`` attached (N1), or the machine type's own (A2, G2, A3),
      under the VM's provisioning model.
    - ``multi-region``: per region, ``maxNodes`` x GPUs per node, plus ``GPU_POOL_UPGRADE_SURGE`` per zone,
      on demand (the GPU pools are not Spot). A drained region (``serving: false``) keeps its pool.

    Raises:
        PreflightError: a machine type carries a GPU with no quota metric here.
    """
    rows: dict[tuple[str, str], GpuNeed] = {}

    def add(region: str, gpu: str, count: int, model: str, why: str) -> None:
        metric, fallback = quota_metrics(gpu, model)
        old = rows.get((region, metric))
        if old is not None:
            count, why = old.count + count, f"{old.why}; {why}"
        rows[(region, metric)] = GpuNeed(region, metric, count, why, fallback)

    if config.gce is not None:
        g = config.gce
        machine = get_machine_type(g.machine_type)
        count = g.accelerator_count if g.accelerator_type else machine.gpu_count[0]
        if machine.gpu is not None and count:
            add(
                g.region,
                machine.gpu,
                count,
                g.provisioning_model,
                f"1 VM {g.machine_type} x {count} GPU ({g.provisioning_model})",
            )
    if config.multi_region is not None:
        for r in config.multi_region.regions:
            gpu = get_machine_type(r.machine_type).gpu
            if gpu is None:
                continue
            nodes = r.max_nodes + GPU_POOL_UPGRADE_SURGE * len(r.zones)
            surge = f" + upgrade surge {GPU_POOL_UPGRADE_SURGE}/zone" if GPU_POOL_UPGRADE_SURGE else ""
            add(
                r.region,
                gpu,
                nodes * r.accelerator_count,
                "standard",
                f"GPU pool at maxNodes {r.max_nodes}{surge} x {r.accelerator_count} GPU "
                f"(first up: minNodes {r.min_nodes})",
            )
    needs = list(rows.values())
    total = sum(n.count for n in needs)
    if total:
        needs.append(GpuNeed(ALL_REGIONS, PROJECT_METRIC, total, "every GPU above, all regions together"))
    return needs


# --- the stack file ------------------------------------------------------------------------------------

_SECRET_PLACEHOLDER = "preflight-reads-no-secret"
"""Stands for a secret's value (``secure:`` in the file, or not set yet): preflight reads none."""


def _as_config_string(value: Any) -> str:
    """A YAML value as Pulumi passes it to a program: strings as is, everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def stack_values(stack: str, stacks_dir: Path = STACKS_DIR) -> dict[str, str]:
    """The ``config:`` of ``stacks_dir/Pulumi.<stack>.yaml`` as Pulumi passes it to the program (strings,
    lists and mappings as JSON), each ``secure:`` (secret) value replaced by a placeholder.

    Raises:
        PreflightError: no such stack file (names the stacks there), or it is not a YAML mapping.
    """
    path = stacks_dir / f"Pulumi.{stack}.yaml"
    if not path.is_file():
        known = sorted(
            p.name.removeprefix("Pulumi.").removesuffix(".yaml") for p in stacks_dir.glob("Pulumi.*.yaml")
        )
        raise PreflightError(
            f"unknown stack {stack!r}: no {path}; allowed: {', '.join(known) or '(no stack files there)'}"
        )
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise PreflightError(f"{path} is not valid YAML: {exc}") from None
    config = document.get("config") if isinstance(document, dict) else None
    if not isinstance(config, dict):
        raise PreflightError(f"{path} has no `config:` mapping; allowed: a Pulumi stack file")
    values = {}
    for key, value in config.items():
        secret = isinstance(value, dict) and set(value) == {"secure"}
        values[str(key)] = _SECRET_PLACEHOLDER if secret else _as_config_string(value)
    return values


def load_stack(
    stack: str, *, project: str | None = None, stacks_dir: Path = STACKS_DIR
) -> StackConfig | None:
    """The validated configuration of ``stack`` (``project`` overrides ``gcp:project``), or None for a
    topology with no GCP project (``onprem-node``: the host's own GPUs, no quota).

    Secrets are never read: a required one (``hfToken``) that is not set yet is taken as set (``pulumi up``
    asks for it, quotas do not depend on it).

    Raises:
        PreflightError: unknown stack, the project missing or still ``PLACEHOLDER_PROJECT``, or the stack's
            configuration invalid (every problem, one line each).
    """
    values = stack_values(stack, stacks_dir)
    if values.get(f"{NAMESPACE}:topology") == "onprem-node":
        return None
    key = f"{GCP_NAMESPACE}:project"
    if project is not None:
        values[key] = project
    where = f"{stacks_dir / f'Pulumi.{stack}.yaml'}"
    if not values.get(key):
        raise PreflightError(
            f"{key}: missing in {where}; set it with `pulumi config set --stack {stack} {key} <project id>` "
            "or pass --project <project id>"
        )
    if values[key] == PLACEHOLDER_PROJECT:
        raise PreflightError(
            f"{key}: still the placeholder {PLACEHOLDER_PROJECT!r} in {where}; set your project with "
            f"`pulumi config set --stack {stack} {key} <project id>` or pass --project <project id>"
        )
    values.setdefault(f"{NAMESPACE}:hfToken", _SECRET_PLACEHOLDER)
    try:
        return parse_stack_config(values, stack=stack)
    except StackConfigError as exc:
        raise PreflightError(f"stack {stack!r}: {exc}") from None
