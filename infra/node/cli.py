"""``duplex node``: node profiles, the rendered bundle, and bringing the local node up (the main job).

Commands: ``profiles`` (the built-in profiles as a table), ``render PROFILE OUT`` (write a profile's bundle),
``up`` (start the local node as real processes, stream sessions through nginx over TLS, show Prometheus's
figures, stop; exit 0 when everything worked, 1 when something did not, 2 on bad input or a missing
package).
"""

from __future__ import annotations

import json
import logging
import signal
import tempfile
import threading
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from infra.node.bundle.carriers import CARRIER_PATHS
from infra.node.profile.profiles import PROFILES

app = typer.Typer(help="Node profiles, the rendered node bundle, and the local node.", no_args_is_help=True)
console = Console()


@app.command("profiles")
def profiles_command() -> None:
    """List the built-in node profiles."""
    table = Table(title="node profiles")
    for column in ("profile", "gpu", "model", "precision", "sessions", "deployment", "https", "domain"):
        table.add_column(column)
    for p in PROFILES.values():
        table.add_row(
            p.name, p.gpu or "none (CPU)", p.model, p.precision, str(p.sessions), p.deployment,
            str(p.ports.https), p.domain,
        )  # fmt: skip
    console.print(table)
    for p in PROFILES.values():
        for warning in p.first_audio_warnings:
            console.print(f"warning: {p.name}: {warning}", style="yellow", markup=False)


@app.command("render")
def render_command(
    profile: Annotated[str, typer.Argument(help=f"Profile: {', '.join(PROFILES)}")],
    out: Annotated[Path, typer.Argument(help="Directory to write the bundle into")],
) -> None:
    """Write PROFILE's bundle (nginx, Redis, Prometheus, Grafana, Compose, cloud-init) into OUT."""
    from infra.node.bundle.render import render_bundle, write_bundle

    if profile not in PROFILES:
        console.print(f"[red]unknown profile {profile!r}[/red]; allowed: {', '.join(PROFILES)}")
        raise typer.Exit(2)
    for path in write_bundle(render_bundle(PROFILES[profile]), out):
        console.print(str(path))
    for warning in PROFILES[profile].first_audio_warnings:
        console.print(f"warning: {warning}", style="yellow", markup=False)


def _transport_table(rows: list[dict[str, object]]) -> Table:
    """``bringup.transport_rows`` as a table: the transports side by side (times in ms)."""

    def ms(value: object) -> str:
        return "-" if value is None else f"{float(value):.0f}"  # type: ignore[arg-type]

    table = Table(
        title="WebSocket, WebRTC, phone calls and LiveKit's plugin side by side",
        caption="ms; 1st: the client's first frame sent -> first audio back (twilio: the call's start -> "
        "the first agent frame; livekit: the plugin's first push_audio -> its first audio frame); ICE: POST "
        "-> connected; PLC: 20 ms packets concealed; webrtc/turn: relay-only through the node's coturn; "
        "audio s: seconds of audio the LiveKit plugin delivered",
    )
    columns = ("transport", "served", "1st p50", "1st p99", "lost", "ICE p50", "ICE p99", "PLC", "audio s")
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            f"{row['transport']}{'/turn' if row['relay_only'] else ''}",
            f"{row['served']}/{row['sessions']}",
            ms(row["first_audio_ms_p50"]),
            ms(row["first_audio_ms_p99"]),
            "-" if row["frames_lost"] is None else str(row["frames_lost"]),
            ms(row["ice_connect_ms_p50"]),
            ms(row["ice_connect_ms_p99"]),
            "-" if row["concealed_packets"] is None else str(row["concealed_packets"]),
            "-" if row.get("audio_s") is None else f"{float(row['audio_s']):.0f}",  # type: ignore[arg-type]
        )
    return table


def _resume_table(row: dict[str, object]) -> Table:
    """``ResumeCheck.as_row``: the session dropped and resumed through nginx (times in ms)."""

    def ms(value: object) -> str:
        return "-" if value is None else f"{float(value):.0f}"  # type: ignore[arg-type]

    table = Table(
        title="one WebSocket session dropped (TCP cut, no close frame) and resumed",
        caption="ms from the reconnect: handshake, audio again; gap: the server's, last frame -> resume",
    )
    for column in ("transport", "resumed", "same id", "same slot", "handshake", "audio again", "gap"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_row(
        str(row["transport"]),
        "yes" if row["resumed"] else "NO",
        "yes" if row["same_session"] else "no",
        "yes" if row["same_slot"] else "no",
        ms(row["handshake_ms"]),
        ms(row["audio_again_ms"]),
        ms(row["gap_ms"]),
    )
    return table


def _print_check(check, node) -> None:  # noqa: ANN001 (NodeCheck, LocalNode: imported lazily)
    from infra.node.local.bringup import transport_rows
    from runtime.tools.loadgen import load_table

    if check.load is not None:
        console.print(load_table(f"sessions through {node.wss_url}/api/chat", check.load))
    if check.extra_caller is not None:
        console.print(f"extra caller at the cap: {check.extra_caller.refusal_reason or 'served (!)'}")
    if check.rtc_load is not None:
        route = "relay-only via coturn" if check.rtc_relay else "direct"
        title = f"WebRTC sessions through {node.https_url}/api/rtc ({route})"
        console.print(load_table(title, check.rtc_load))
    for carrier, report in check.phone_loads.items():
        console.print(load_table(f"{carrier} calls through {node.wss_url}{CARRIER_PATHS[carrier]}", report))
    rows = transport_rows(check)
    if rows:
        console.print(_transport_table(rows))
    for row in rows:
        if row.get("failure"):
            console.print(f"[red]{row['transport']}: {row['failure']}[/red]")
    if check.resume is not None:
        console.print(_resume_table(check.resume.as_row()))
    if check.scraped:
        table = Table(title=f"the node's figures, from Prometheus ({node.prometheus_url})")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for name, value in check.scraped.items():
            table.add_row(name, "-" if value is None else f"{value:.1f}")
        console.print(table)
    for problem in check.problems:
        console.print(f"[red]problem:[/red] {problem}")


BROWSER_LINK_TTL_S = 900.0
"""Lifetime (s) of the token in the browser link ``duplex node up --keep-running`` prints: 15 min."""


def _print_browser_client(node) -> None:  # noqa: ANN001 (LocalNode: imported lazily)
    """The browser client's address, a one-conversation link carrying a fresh token in its fragment (never
    sent to the server, never logged), and how to mint more tokens."""
    from infra.node.bundle.services import SECRET_FILES, token_audience

    token = node.mint_token(ttl_s=BROWSER_LINK_TTL_S)
    minutes = BROWSER_LINK_TTL_S / 60
    page = f"{node.https_url}/"
    console.print(f"browser client: {page} (self-signed certificate: accept the browser's warning)")
    console.print(f"one conversation, within {minutes:g} min: {page}#token={token}", soft_wrap=True)
    keys = node.node_dir / SECRET_FILES["token_keys"]
    audience = token_audience(node.profile)
    console.print(f"more tokens: duplex token mint --key-file {keys} --audience {audience}", soft_wrap=True)


@app.command("up")
def up_command(
    node_dir: Annotated[
        Path | None, typer.Option("--dir", help="Node directory (default: a temporary one, removed after)")
    ] = None,
    free_ports: Annotated[
        bool, typer.Option(help="Use free loopback ports instead of the profile's")
    ] = False,
    sessions: Annotated[
        int | None, typer.Option(help="Sessions to stream (default: the node's slots)")
    ] = None,
    wav: Annotated[
        list[Path] | None, typer.Option(help="Speech WAV files (default: espeak-ng speech)")
    ] = None,
    keep_running: Annotated[bool, typer.Option(help="Leave the node running until Ctrl-C")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON")] = False,
    webrtc: Annotated[
        bool,
        typer.Option(
            help="After the wss:// run, stream as many sessions over WebRTC (signalling through nginx, "
            "media relay-only through the node's coturn) and print both transports side by side"
        ),
    ] = True,
    livekit: Annotated[
        bool,
        typer.Option(
            help="Then as many sessions through LiveKit's PersonaPlex plugin, unmodified, over wss:// "
            "(run with .venv-livekit's Python: `make livekit-deps`; DUPLEX_LIVEKIT_PYTHON overrides)"
        ),
    ] = True,
) -> None:
    """The main job: bring the local node up (redis, exporters, runtime with the tiny model, Prometheus,
    nginx with a self-signed certificate, coturn, all on loopback), stream sessions of real speech through
    wss:// at real-time pace plus one extra caller that must be refused, then one resumable session whose
    TCP connection is cut and resumed, then as many over WebRTC through the node's TURN relay, print both
    transports side by side and the resume, show Prometheus's figures, stop."""
    logging.basicConfig(level=logging.WARNING)
    from infra.node.local.bringup import bring_up_and_check
    from infra.node.local.node import LocalNode, MissingBinaryError, NodeStartError, free_port_profile
    from runtime.tools.loadgen import load_speech

    profile = free_port_profile() if free_ports else PROFILES["local"]
    with tempfile.TemporaryDirectory(prefix="duplex-node-") as tmp:
        node = LocalNode(node_dir or Path(tmp), profile)
        try:
            with console.status("starting the local node") as status:
                node.start(progress=lambda message: status.update(message))
        except (MissingBinaryError, NodeStartError) as exc:
            console.print(f"[red]the node did not start:[/red] {exc}")
            raise typer.Exit(2 if isinstance(exc, MissingBinaryError) else 1) from None
        try:
            console.print(
                f"node up: {node.wss_url}/api/chat  Prometheus {node.prometheus_url}  "
                f"Alertmanager {node.alertmanager_url}"
            )
            console.print(f"logs: {node.node_dir}/logs")
            count = sessions or profile.sessions
            speech = load_speech(wav, count)
            frames = sum(len(speech[i % len(speech)]) // 1920 for i in range(count))
            with Progress(
                TextColumn("[progress.description]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                task = progress.add_task("frames streamed", total=frames)
                check = bring_up_and_check(
                    node,
                    speech,
                    sessions=count,
                    on_frame=lambda: progress.advance(task),
                    progress=lambda message: progress.update(task, description=message),
                    webrtc=webrtc,
                    livekit=livekit,
                )
            if json_out:
                print(json.dumps(check.as_dict(), default=str))
            else:
                _print_check(check, node)
            if keep_running and not check.dead_processes:
                console.print(f"node running: {node.wss_url}/api/chat; Ctrl-C to stop")
                _print_browser_client(node)
                stop = threading.Event()
                signal.signal(signal.SIGTERM, lambda *_: stop.set())
                try:
                    while not stop.wait(1.0) and not node.dead_processes():
                        pass
                except KeyboardInterrupt:
                    pass
        finally:
            with console.status("stopping the local node"):
                codes = node.stop()
        if not json_out:
            console.print(f"stopped: {', '.join(f'{name} ({code})' for name, code in codes.items())}")
            console.print("[green]node check passed[/green]" if check.ok else "[red]node check failed[/red]")
    raise typer.Exit(0 if check.ok else 1)
