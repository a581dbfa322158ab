"""``duplex preflight --stack <name>``: the stack's GPUs against the project's quotas, per region.

Exit codes: 0 every quota holds the stack (or it needs none), 1 a quota is short or missing (the table says
what to request), 2 the check could not run (unknown stack, missing project, no credentials, the Compute
Engine API disabled or refusing: the message says what to do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from infra.preflight.needs import ALL_REGIONS, STACKS_DIR, PreflightError, gpu_needs, load_stack
from infra.preflight.quotas import COMPUTE_API, ComputeQuotas, QuotaRow, Transport, access_token, compare

__all__ = ["EXIT_CANNOT_CHECK", "EXIT_OK", "EXIT_SHORT", "preflight", "run_preflight"]

EXIT_OK = 0
EXIT_SHORT = 1
EXIT_CANNOT_CHECK = 2


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def render(rows: list[QuotaRow], stack: str, project: str, console: Console) -> None:
    """The table: per region and metric, needed, limit, in use, and what to request."""
    table = Table(title=f"GPU quota for stack {stack} in project {project}")
    for column in ("region", "metric", "needed", "limit", "in use", "request", "why"):
        table.add_column(column)
    for r in rows:
        request = "-" if r.ok else (f"{r.metric} = {r.request}" if r.request is not None else "see below")
        region = "all regions" if r.need.region == ALL_REGIONS else r.need.region
        table.add_row(
            region,
            r.metric,
            str(r.need.count),
            _fmt(r.limit),
            _fmt(r.usage),
            "[green]ok[/green]" if r.ok else f"[red]{request}[/red]",
            r.need.why,
        )
    console.print(table)
    for r in rows:
        if r.problem:
            console.print(f"[red]short:[/red] {r.problem}")


def run_preflight(
    stack: str,
    *,
    project: str | None = None,
    stacks_dir: Path = STACKS_DIR,
    token: str | None = None,
    transport: Transport | None = None,
    api: str = COMPUTE_API,
) -> tuple[str, list[QuotaRow]]:
    """``(project, rows)`` of ``stack``: empty rows for a stack that needs no GCP GPU.

    Raises:
        PreflightError: the check could not run (see the module's exit code 2).
    """
    config = load_stack(stack, project=project, stacks_dir=stacks_dir)
    if config is None:
        return "", []
    needs = gpu_needs(config)
    project_id = (
        config.gce.project if config.gce else config.multi_region.project if config.multi_region else ""
    )
    if not needs:
        return project_id, []
    client = ComputeQuotas(
        token or access_token(), **({"transport": transport} if transport else {}), api=api
    )
    return project_id, compare(needs, project_id, client)


def preflight(
    stack: str = typer.Option(..., "--stack", help="The stack (stacks/Pulumi.<stack>.yaml)."),
    project: Optional[str] = typer.Option(  # noqa: UP045 (typer reads the annotation)
        None, "--project", help="The GCP project (default: the stack's gcp:project)."
    ),
    stacks_dir: Path = typer.Option(STACKS_DIR, "--stacks-dir", help="Where the stack files are."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
    api: str = typer.Option(COMPUTE_API, "--api", hidden=True, help="The Compute Engine API root (tests)."),
) -> None:
    """Check the project's GPU quotas (per region and project-wide) against what the stack needs at its
    ceiling, before `pulumi up`; say what to request when short."""
    console, err = Console(), Console(stderr=True)
    try:
        project_id, rows = run_preflight(stack, project=project, stacks_dir=stacks_dir, api=api)
    except PreflightError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_CANNOT_CHECK) from None
    ok = all(r.ok for r in rows)
    if as_json:
        console.print_json(
            json.dumps(
                [
                    {
                        "region": r.need.region,
                        "metric": r.metric,
                        "needed": r.need.count,
                        "limit": r.limit,
                        "usage": r.usage,
                        "ok": r.ok,
                        "request": r.request,
                        "problem": r.problem,
                        "why": r.need.why,
                    }
                    for r in rows
                ]
            )
        )
    elif not rows:
        console.print(f"stack {stack}: no GCP GPU quota needed (its GPUs are the host's own, or none)")
    else:
        render(rows, stack, project_id, console)
        console.print(
            "[green]every quota holds the stack[/green]"
            if ok
            else "request the quotas above (IAM & Admin > Quotas, or `gcloud beta quotas preferences "
            "create`) and run `duplex preflight` again before `pulumi up`"
        )
    raise typer.Exit(EXIT_OK if ok else EXIT_SHORT)
