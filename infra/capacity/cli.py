"""The ``capacity`` command: prints the planner's tables (Rich) or JSON, and the Scale-5 comparison.

Exit codes: 0 feasible (or a comparison report), 1 infeasible, 2 bad input (unknown model, GPU, precision,
machine type, sessions < 1). Mounted by the project CLI as ``duplex capacity``.
"""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .gcp import MACHINE_TYPES
from .gpus import GPUS
from .models import MODEL_NAMES
from .plan import CapacityPlan, plan
from .seed_plan import SeedReport, compare_scale5
from .timing import TICK_MODELS
from .units import GB, KV_PRECISIONS, WEIGHT_PRECISIONS

app = typer.Typer(
    help="Capacity planner: memory, sessions, tick time, latency, network, power and cost.",
    add_completion=False,
    no_args_is_help=False,
)

EXIT_FEASIBLE = 0
EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2


def _bad(console: Console, msg: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {msg}")
    return typer.Exit(EXIT_BAD_INPUT)


def _gb(b: float) -> str:
    return f"{b / GB:.3f}" if b < 10 * GB else f"{b / GB:.2f}"


def _size(b: float) -> str:
    """Bytes as GB, MB or kB (decimal units)."""
    if b >= 0.01 * GB:
        return f"{b / GB:.3f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.1f} MB"
    return f"{b / 1e3:.1f} kB"


def render_plan(p: CapacityPlan, console: Console) -> None:
    """Print the plan's tables."""
    c = p.config
    console.print(
        f"[bold]{c.model}[/bold] on [bold]{GPUS[c.gpu].name}[/bold], weights {c.precision}, "
        f"KV {c.kv_precision}, {c.sessions} sessions/node x {c.nodes} node(s)"
        f"{', CFG' if c.cfg else ''}; GB = 10^9 bytes"
    )
    m = p.model
    t = Table(title="Model: parameters by part")
    t.add_column("part")
    t.add_column("parameters", justify="right")
    for k, v in m.params_by_part.items():
        t.add_row(k, f"{v:,}")
    t.caption = (
        f"{m.layers} layers, dim {m.dim}, {m.heads} heads, context {m.context} frames, "
        f"{m.codebooks} codebooks, dep_q {m.dep_q}"
    )
    if m.stored_lm_params and m.stored_lm_params != m.lm_params:
        t.caption += (
            f"; as served: the checkpoint stores {m.stored_lm_params:,} LM parameters "
            f"({m.stored_lm_params / 1e9:.2f} B), the runtime loads the agent's {m.dep_q} depformer steps"
        )
    console.print(t)

    mem = p.memory
    t = Table(title="GPU memory")
    t.add_column("item")
    t.add_column("counted", justify="center")
    t.add_column("size", justify="right")
    t.add_column("note")
    for x in mem.shared:
        t.add_row(x.name, "once", _size(x.bytes), x.note)
    for x in mem.per_slot:
        t.add_row(x.name, "per slot", _size(x.bytes), x.note)
    t.add_row("Per slot, all items", "per slot", _size(mem.per_slot_bytes), "")
    t.add_row("CUDA context", "once", _size(mem.cuda_context_bytes), "assumption")
    t.add_row(
        f"Required at {mem.sessions} sessions",
        "",
        _size(mem.required_bytes),
        f"incl. allocator overhead {mem.allocator_overhead:.0%}",
    )
    t.add_row(
        "Usable on the GPU",
        "",
        _size(mem.usable_bytes),
        f"{_gb(mem.gpu_memory_bytes)} GB minus {_gb(mem.headroom_bytes)} GB headroom",
    )
    t.caption = f"largest session count that fits: {mem.max_sessions}"
    console.print(t)

    tk = p.tick
    t = Table(title=f"Tick (one 80 ms step of {tk.sessions} slots), tick model '{tk.tick_model}'")
    for col in ("phase", "bytes (GB)", "GFLOP", "bound", "roofline ms", "estimate ms"):
        t.add_column(col, justify="left" if col in ("phase", "bound") else "right")
    for ph in tk.phases:
        t.add_row(
            ph.name,
            f"{ph.bytes / GB:.3f}",
            f"{ph.flops / 1e9:.1f}",
            ph.bound,
            f"{ph.roofline_ms:.2f}",
            f"{ph.estimate_ms:.2f}",
        )
    t.add_row("fixed overhead", "", "", "", "0.00", f"{tk.overhead_ms:.2f}")
    t.add_row("total", "", "", "", f"{tk.roofline_ms:.2f}", f"{tk.estimate_ms:.2f}")
    t.caption = (
        f"budget {tk.budget_ms:.1f} ms (margin {tk.margin:.0%}); largest B inside it: {tk.max_sessions}"
    )
    console.print(t)

    lat = p.latency
    t = Table(title="First audio: latency budget (ms)")
    for col in ("step", "low", "high", "p99", "runtime term", "note"):
        t.add_column(col, justify="right" if col in ("low", "high", "p99") else "left")
    for r in lat.rows:
        t.add_row(r.name, f"{r.low_ms:.1f}", f"{r.high_ms:.1f}", f"{r.p99_ms:.1f}", r.runtime_term, r.note)
    t.add_row(
        "total",
        f"{lat.low_ms:.0f}",
        f"{lat.high_ms:.0f}",
        f"{lat.p99_ms:.0f}",
        "",
        f"floor {lat.floor_ms:.0f} ms",
    )
    t.caption = (
        f"first audio p99: {lat.p99_ms:.0f} ms for the caller (every term), {lat.runtime_p99_ms:.0f} ms as "
        "the runtime measures it (duplex_first_audio_latency_seconds: the rows with a runtime term); "
        f"phase wait mean {lat.phase_wait_mean_ms:g} ms"
        + (f", {lat.stagger_groups} staggered groups" if lat.stagger_groups > 1 else "")
    )
    console.print(t)

    net = p.network
    t = Table(title=f"Network per session ({net.codec}), kbit/s")
    for col in ("direction", "audio+text", "WebSocket", "TLS", "TCP/IP", "total"):
        t.add_column(col, justify="left" if col == "direction" else "right")
    for d in net.per_session:
        t.add_row(
            d.direction,
            f"{d.audio_bps / 1e3:.1f}",
            f"{d.websocket_bps / 1e3:.2f}",
            f"{d.tls_bps / 1e3:.2f}",
            f"{d.tcp_ip_bps / 1e3:.2f}",
            f"{d.total_bps / 1e3:.1f}",
        )
    t.caption = (
        f"node ({net.node_sessions} sessions): in {net.node_ingress_bps / 1e6:.2f} Mbit/s, "
        f"out {net.node_egress_bps / 1e6:.2f} Mbit/s; {net.nodes} node(s): "
        f"in {net.fleet_ingress_bps / 1e6:.2f}, out {net.fleet_egress_bps / 1e6:.2f} Mbit/s"
    )
    console.print(t)

    pw = p.power
    t = Table(title=f"Power, heat and cost ({pw.nodes} node(s))")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("GPU under load (W/node)", f"{pw.gpu_w:.0f}")
    t.add_row("host (W/node, assumption)", f"{pw.host_w:.0f}")
    t.add_row("wall power (W, all nodes)", f"{pw.fleet_wall_w:.0f}")
    t.add_row("heat (BTU/h, all nodes)", f"{pw.fleet_btu_h:.0f}")
    t.add_row("energy (kWh/month)", f"{pw.fleet_kwh_month:.0f}")
    if pw.cloud_usd_month is not None:
        t.add_row(f"GCP {pw.machine_type} on demand (USD/month)", f"{pw.cloud_usd_month:,.0f}")
        t.caption = f"price {pw.usd_per_hour_node} USD/h, {pw.price_source}, read {pw.price_read_on}"
    else:
        t.add_row("electricity (USD/month, assumed price)", f"{pw.electricity_usd_month:,.0f}")
    console.print(t)

    verdict = p.verdict
    for w in verdict.warnings:
        console.print(f"warning: {w}", style="yellow", markup=False)
    if verdict.feasible:
        console.print(
            f"[green]FEASIBLE[/green]: {c.sessions} sessions per node; at most {verdict.max_sessions} "
            f"(memory {verdict.max_sessions_by_memory}, tick {verdict.max_sessions_by_tick})"
        )
    else:
        console.print("[red]INFEASIBLE[/red]")
        for pr in verdict.problems:
            console.print(f"  - {pr.reason.value}: {pr.detail}", markup=False)


def render_seed(r: SeedReport, console: Console) -> None:
    """Print the Scale-5 comparison."""
    t = Table(title=f"Scale-5 plan vs planner ({r.model}, INT8, 5 sessions)", show_lines=True)
    for col in ("topic", "item", "GPU", "Scale-5 plan", "planner", "", "reason"):
        t.add_column(col)
    for x in r.rows:
        mark = "[green]agrees[/green]" if x.agrees else "[red]DIFFERS[/red]"
        t.add_row(x.topic, x.item, x.gpu or "", x.theirs, x.ours, mark, x.reason)
    t.caption = f"{len(r.disagreements)} of {len(r.rows)} figures disagree"
    console.print(t)


@app.callback(invoke_without_command=True)
def capacity(
    model: Optional[str] = typer.Option(None, help=f"model preset: {', '.join(MODEL_NAMES)}"),  # noqa: UP045
    gpu: Optional[str] = typer.Option(None, help=f"GPU: {', '.join(GPUS)}"),  # noqa: UP045
    precision: str = typer.Option("bf16", help=f"weight precision: {', '.join(WEIGHT_PRECISIONS)}"),
    sessions: int = typer.Option(1, help="concurrent sessions (slots) per node"),
    nodes: int = typer.Option(1, help="node count (one GPU each)"),
    kv_precision: Optional[str] = typer.Option(  # noqa: UP045
        None, help=f"KV cache precision: {', '.join(KV_PRECISIONS)} (default: moshi's for the weights)"
    ),
    cfg: bool = typer.Option(False, "--cfg", help="classifier-free guidance (two LM rows per slot)"),
    margin: float = typer.Option(0.2, help="fraction of the 80 ms frame kept free"),
    tick_model: str = typer.Option("planning", help=f"tick model: {', '.join(TICK_MODELS)}"),
    machine_type: Optional[str] = typer.Option(  # noqa: UP045
        None, help=f"GCP machine type: {', '.join(MACHINE_TYPES)}"
    ),
    codec: str = typer.Option("opus", help="audio on the wire: opus, pcm"),
    stagger_groups: int = typer.Option(
        1, help="the runtime's DUPLEX_STAGGER_GROUPS: 1, or 2 (two groups stepped 40 ms apart)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    compare_scale5: bool = typer.Option(
        False,
        "--compare-scale5",
        help="compare the Scale-5 plan (5 sessions, INT8, L40S vs A100 80GB) with ours",
    ),
) -> None:
    """Plan a configuration; exit 0 when it holds, 1 when it does not, 2 on bad input."""
    console = Console(width=160)
    err = Console(stderr=True)
    if compare_scale5:
        try:
            report = compare_scale5_report(model or "personaplex-7b")
        except ValueError as e:
            raise _bad(err, str(e)) from None
        if as_json:
            typer.echo(json.dumps(report.model_dump(mode="json", exclude={"plans"}), indent=2))
        else:
            render_seed(report, console)
        raise typer.Exit(EXIT_FEASIBLE)
    if model is None:
        raise _bad(err, f"model: required; allowed values: {', '.join(MODEL_NAMES)}")
    if gpu is None:
        raise _bad(err, f"gpu: required; allowed values: {', '.join(GPUS)}")
    try:
        p = plan(
            model,
            gpu,
            precision,
            sessions,
            nodes,
            kv_precision=kv_precision,
            cfg=cfg,
            margin=margin,
            tick_model=tick_model,
            machine_type=machine_type,
            codec=codec,
            stagger_groups=stagger_groups,
        )
    except ValueError as e:
        raise _bad(err, str(e)) from None
    if as_json:
        typer.echo(json.dumps(p.model_dump(mode="json"), indent=2))
    else:
        render_plan(p, console)
    raise typer.Exit(EXIT_FEASIBLE if p.verdict.feasible else EXIT_INFEASIBLE)


def compare_scale5_report(model: str) -> SeedReport:
    """The Scale-5 comparison for ``model`` (a separate name so the CLI flag does not shadow it)."""
    return compare_scale5(model)
