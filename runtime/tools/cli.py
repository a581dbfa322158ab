"""The runtime's commands of ``duplex`` (Typer + Rich): ``serve``, ``demo``, ``loadgen``, ``bench``,
``bench-persona``, ``token``. ``runtime_app()`` builds a Typer app of them: ``app`` here is the runtime
image's entrypoint (``duplex-runtime``); ``infra.cli`` adds the node's and the capacity planner's
commands for the full ``duplex``. Heavy imports (torch, moshi) happen inside the commands that need them.
docs/runtime.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from runtime.config import RuntimeConfig
    from runtime.frontend.server import DuplexServer
    from runtime.metrics import RuntimeMetrics

__all__ = ["RUNTIME_HELP", "app", "main", "runtime_app", "token_app"]

RUNTIME_HELP = "Batched full-duplex speech-to-speech runtime (Moshi / PersonaPlex)."
"""The runtime's ``--help`` line (``infra.cli`` writes its own for the full ``duplex``)."""

token_app = typer.Typer(
    help="Session tokens: mint one (what an application backend does per conversation), make a signing key.",
    no_args_is_help=True,
)
console = Console()


def _config(**overrides: Any):
    """RuntimeConfig from DUPLEX_* environment variables, with the CLI flags that were given on top."""
    from pydantic import ValidationError

    from runtime.config import RuntimeConfig

    try:
        return RuntimeConfig(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            field = ".".join(str(p) for p in error["loc"])
            console.print(f"[red]invalid setting {field}[/red] (DUPLEX_{field.upper()}): {error['msg']}")
        raise typer.Exit(2) from None


def build_server(config: RuntimeConfig, *, metrics: RuntimeMetrics | None = None) -> DuplexServer:
    """``--workers 0``: load the model named by ``config`` and build the front end over its slots in this
    process (``runtime.engine.engine_core.LocalSlots``) and its store, not started; ``metrics``: the registry
    to keep (the one ``loading_status`` served), a fresh one by default. Blocking (the model loads)."""
    from runtime.engine.engine_core import LocalSlots
    from runtime.frontend.server import DuplexServer, build_store
    from runtime.metrics import RuntimeMetrics

    config.check_access_control()  # before the model loads: a missing key stops the process at once
    bundle = config.load_model_bundle()
    metrics = metrics or RuntimeMetrics()
    backend = LocalSlots(config, bundle, metrics)
    return DuplexServer(config, backend, store=build_store(config, metrics), metrics=metrics)


def serve(
    model: Annotated[str | None, typer.Option(help="Model preset: tiny, moshi-7b, personaplex-7b")] = None,
    weights: Annotated[str | None, typer.Option(help="Checkpoint directory or Hugging Face repo id")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port")] = None,
    max_sessions: Annotated[int | None, typer.Option(help="Batch slots = concurrent sessions")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Session store, redis://...")] = None,
    voices_dir: Annotated[Path | None, typer.Option(help="Directory of voice prompts")] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Front-end worker processes beside the engine process (one port, SO_REUSEPORT); 0: one "
            "process; -1: from the host's cores (DUPLEX_WORKERS)"
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Python log level")] = "INFO",
) -> None:
    """Run the batched runtime until SIGTERM/SIGINT, then drain. Settings also come from DUPLEX_* env vars."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = _config(
        model=model,
        weights=weights,
        device=device,
        host=host,
        port=port,
        max_sessions=max_sessions,
        redis_url=redis_url,
        voices_dir=voices_dir,
        workers=workers,
    )
    try:
        config.check_access_control()
    except ValueError as exc:
        console.print(f"[red]invalid access control settings[/red]: {exc}")
        raise typer.Exit(2) from None
    if config.workers != 0:
        from runtime.multiproc import PortTaken, Supervisor, default_workers

        count = default_workers() if config.workers == -1 else config.workers
        config = config.model_copy(update={"workers": count})  # each worker takes its share of the limits
        try:
            supervisor = Supervisor(config, count)
        except (ValueError, PortTaken) as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
        raise typer.Exit(supervisor.run())
    from runtime.frontend.server import loading_status
    from runtime.metrics import RuntimeMetrics

    def load(metrics: RuntimeMetrics):  # noqa: ANN202 - DuplexServer, imported lazily
        server = build_server(config, metrics=metrics)
        server.backend.warm_up()  # type: ignore[attr-defined]  # LocalSlots: blocking, in this thread
        return server

    async def main() -> None:
        metrics = RuntimeMetrics()
        # Probes and Prometheus get answers during the load (minutes for a 7B model), not refusals.
        async with loading_status(config, metrics):
            server = await asyncio.to_thread(load, metrics)
        await server.start()
        from runtime.gc_policy import parse_gc_thresholds, tune_gc

        tune_gc(parse_gc_thresholds(config.gc_thresholds))
        await server.serve_until_signal()

    asyncio.run(main())


def _sessions_table(title: str, results: list) -> Table:
    table = Table(title=title)
    for column in ("#", "handshake", "frames in", "frames out", "1st audio ms", "close"):
        table.add_column(column, no_wrap=True, min_width=max(len(column), 4))
    table.add_column("text / error", max_width=24, no_wrap=True, overflow="ellipsis")
    for i, r in enumerate(results):
        table.add_row(
            str(i),
            "yes" if r.handshake else "no",
            str(r.frames_sent),
            str(r.audio_messages),
            f"{r.first_audio_ms:.0f}" if r.first_audio_ms is not None else "-",
            str(r.close_code),
            (r.text.strip() or "-") if r.handshake else "; ".join(r.errors),
        )
    return table


def demo(
    sessions: Annotated[int, typer.Option(help="Concurrent sessions to stream")] = 5,
    max_sessions: Annotated[int, typer.Option(help="Slots on the local node")] = 5,
    redis: Annotated[bool, typer.Option(help="Start a local redis-server for the session store")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print the results as JSON")] = False,
) -> None:
    """The main job on this machine: start a local node (tiny model, CPU), stream SESSIONS concurrent
    sessions of synthesised speech (espeak-ng) at real-time pace, show what each got back, show that one
    more caller is refused, and print the node's metrics. Exits 1 if any session failed."""
    logging.basicConfig(level=logging.WARNING)
    from runtime.frontend.gate.tokens import generate_signing_key, mint_token
    from runtime.tools.loadgen import DEMO_SENTENCES, run_session, session_url, synthesize_speech
    from runtime.tools.local_redis import LocalRedisError, RedisServer

    # Access control on, as on a node: a key for this run, one fresh token per session.
    key = generate_signing_key("demo")
    audience = "duplex-demo"

    def token() -> str:
        return mint_token(key, ttl_s=120, personas=["*"], audience=audience)

    with tempfile.TemporaryDirectory() as tmp:
        local_redis = None
        if redis:
            local_redis = RedisServer(Path(tmp) / "redis")
            try:
                local_redis.start()
            except LocalRedisError as exc:
                console.print(f"[yellow]no session store: {exc}[/yellow]")
                local_redis = None
        config = _config(
            port=0,
            max_sessions=max_sessions,
            redis_url=local_redis.url if local_redis else None,
            auth_mode="token",
            token_keys=json.dumps({key.kid: key.secret.decode()}),
            token_audience=audience,
            token_replay_check="redis" if local_redis else "memory",
        )

        async def main() -> dict:
            with console.status("loading the tiny model and warming up"):
                server = build_server(config)
                await server.start()
            base = f"ws://127.0.0.1:{server.port}"
            speech = [synthesize_speech(DEMO_SENTENCES[i % len(DEMO_SENTENCES)]) for i in range(sessions)]
            console.print(
                f"node up at {base}/api/chat with {max_sessions} slots; streaming {sessions} sessions"
            )
            with console.status(f"{sessions} sessions streaming at real-time pace"):
                results = await asyncio.gather(
                    *[run_session(session_url(base), pcm, token=token()) for pcm in speech]
                )
                # One more caller while the node is full: wait for the slots to be released, hold all of
                # them open, then knock.
                while server.backend.status().free_slots < max_sessions:
                    await asyncio.sleep(0.05)
                holders = [
                    asyncio.create_task(run_session(session_url(base), speech[0][: 1920 * 25], token=token()))
                    for _ in range(max_sessions)
                ]
                await asyncio.sleep(1.0)
                extra = await run_session(session_url(base), speech[0][:1920], tail_s=0.1, token=token())
                await asyncio.gather(*holders)
            metrics = server.metrics.render().decode()
            await server.close()
            return {"results": results, "extra": extra, "metrics": metrics}

        try:
            outcome = asyncio.run(main())
        finally:
            if local_redis is not None:
                local_redis.stop()
    results, extra = outcome["results"], outcome["extra"]
    ok = all(r.handshake and r.audio_messages > 0 for r in results) and not extra.handshake
    if json_out:
        print(
            json.dumps(
                {"ok": ok, "sessions": [vars(r) for r in results], "refused": vars(extra)}, default=str
            )
        )
    else:
        console.print(_sessions_table("sessions", results))
        console.print(
            f"extra caller at the cap: close code {extra.close_code}, error: {'; '.join(extra.errors)}"
        )
        wanted = (
            "duplex_tick_duration_seconds_count",
            "duplex_ticks_over_budget_total",
            "duplex_admissions_refused",
        )
        for line in outcome["metrics"].splitlines():
            zero_refusals = line.startswith("duplex_admissions_refused") and line.endswith(" 0.0")
            if line.startswith(wanted) and "_created" not in line and not zero_refusals:
                console.print(f"  {line}")
        console.print("[green]demo passed[/green]" if ok else "[red]demo failed[/red]")
    raise typer.Exit(0 if ok else 1)


def loadgen(
    url: Annotated[
        str, typer.Option(help="Node base URL: ws://host:port or wss://host[:port]")
    ] = "ws://127.0.0.1:8998",
    sessions: Annotated[int, typer.Option(min=1, max=256, help="Concurrent sessions")] = 5,
    audio_format: Annotated[str, typer.Option("--format", help="pcm or opus")] = "pcm",
    wav: Annotated[
        list[Path] | None, typer.Option(help="Speech WAV files (default: espeak-ng speech)")
    ] = None,
    ca_cert: Annotated[
        Path | None, typer.Option(help="Trust this PEM certificate (self-signed nodes)")
    ] = None,
    max_duration_s: Annotated[
        float, typer.Option(min=1, max=3600, help="Cut the run after this (s)")
    ] = 120.0,
    stagger_s: Annotated[float, typer.Option(min=0, max=60, help="Delay between session starts (s)")] = 0.0,
    token_key_file: Annotated[
        Path | None,
        typer.Option(
            help="Mint one token per session with a key of this file (a node's secrets/token_keys.json)"
        ),
    ] = None,
    kid: Annotated[
        str | None, typer.Option(help="Key id to mint with (default: the file's only key)")
    ] = None,
    audience: Annotated[
        str, typer.Option(envvar="DUPLEX_TOKEN_AUDIENCE", help="The node's token audience")
    ] = "duplex",
    persona: Annotated[
        list[str] | None, typer.Option(help="Voice prompt the tokens allow (repeat; default: any)")
    ] = None,
    token: Annotated[str | None, typer.Option(help="A token minted elsewhere (one session only)")] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print per-session rows and totals as JSON")
    ] = False,
    pre_encode: Annotated[
        bool,
        typer.Option(
            "--pre-encode/--encode-live",
            help="Encode each clip once and replay it (measures the node), or encode per session as a "
            "live client does",
        ),
    ] = True,
    metrics_url: Annotated[
        str | None,
        typer.Option(
            help="The node's /metrics on its private address (e.g. http://127.0.0.1:8998/metrics): read "
            "before and after the run for the server's first-audio budget, term by term"
        ),
    ] = None,
    transport: Annotated[
        str,
        typer.Option(
            help="websocket (/api/chat), webrtc (/api/rtc: aiortc clients, pre-encoded Opus), twilio, "
            "plivo, telnyx or exotel (/api/carriers/<carrier>: the carrier's side of a media stream, 8 kHz)"
        ),
    ] = "websocket",
    twilio_auth_token: Annotated[
        str | None,
        typer.Option(envvar="DUPLEX_TWILIO_AUTH_TOKEN", help="--transport twilio: the auth token that signs"),
    ] = None,
    twilio_stream_url: Annotated[
        str | None,
        typer.Option(
            envvar="DUPLEX_TWILIO_STREAM_URL", help="--transport twilio: the stream URL the node checks"
        ),
    ] = None,
    plivo_auth_token: Annotated[
        str | None,
        typer.Option(envvar="DUPLEX_PLIVO_AUTH_TOKEN", help="--transport plivo: the auth token that signs"),
    ] = None,
    plivo_stream_url: Annotated[
        str | None,
        typer.Option(
            envvar="DUPLEX_PLIVO_STREAM_URL", help="--transport plivo: the stream URL the node checks"
        ),
    ] = None,
    telnyx_stream_token: Annotated[
        str | None,
        typer.Option(
            envvar="DUPLEX_TELNYX_STREAM_TOKEN", help="--transport telnyx: the stream secret the node checks"
        ),
    ] = None,
    exotel_credentials: Annotated[
        str | None,
        typer.Option(
            envvar="DUPLEX_EXOTEL_CREDENTIALS",
            help="--transport exotel: <api key>:<api token>, the Basic auth the node checks",
        ),
    ] = None,
    processes: Annotated[
        int, typer.Option(min=1, max=64, help="--transport webrtc: generator processes the sessions share")
    ] = 2,
    relay: Annotated[
        bool,
        typer.Option(
            help="--transport webrtc: relay-only (iceTransportPolicy relay) through the node's TURN server, "
            "from GET /api/rtc/ice-servers"
        ),
    ] = False,
) -> None:
    """Drive SESSIONS concurrent sessions of speech at real-time pace against a node (this one, a GCP
    node, a GKE endpoint) and report per session and in total: connect time, first-audio latency
    p50/p95/p99, inter-frame gap p99, frames lost, refusals, bytes each way; with --metrics-url the node's
    first-audio budget over the run (ingress, phase wait, ticks, tick compute, egress). With
    --token-key-file each session gets a fresh token (tokens are single-use). Exits 1 if any session was
    not served or ended early (cut before its last frame, or closed with a code other than 1000), 2 on bad
    input."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runtime.frontend.codecs.protocol import AudioFormat
    from runtime.tools.loadgen import (
        load_speech,
        run_load,
        session_url,
        trusting_context,
    )

    if not url.startswith(("ws://", "wss://")):
        console.print(f"[red]--url must start with ws:// or wss://, got {url!r}[/red]")
        raise typer.Exit(2)
    if relay and transport != "webrtc":
        console.print("[red]--relay needs --transport webrtc (the WebSocket has no relay)[/red]")
        raise typer.Exit(2)
    try:
        fmt = AudioFormat(audio_format)
        speech = load_speech(wav, sessions)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red] (--format: pcm or opus)")
        raise typer.Exit(2) from None
    context = trusting_context(ca_cert) if ca_cert else None
    tokens: str | Callable[[], str] | None = token
    if token is not None and (token_key_file is not None or sessions != 1):
        console.print(
            "[red]--token opens one session: use it with --sessions 1 and no --token-key-file[/red]"
        )
        raise typer.Exit(2)
    if token_key_file is not None:
        tokens = _token_factory(token_key_file, kid, audience=audience, personas=persona)
    carriers = {
        "twilio": (twilio_auth_token, twilio_stream_url, "Twilio"),
        "plivo": (plivo_auth_token, plivo_stream_url, "Plivo"),
        "telnyx": (telnyx_stream_token, "unsigned", "Telnyx"),  # Telnyx signs nothing: no stream URL
        "exotel": (exotel_credentials, "unsigned", "Exotel"),  # Basic auth: no stream URL either
    }
    if transport not in ("websocket", "webrtc", *carriers):
        console.print(
            f"[red]--transport must be websocket, webrtc, {', '.join(carriers)}, got {transport!r}[/red]"
        )
        raise typer.Exit(2)
    if transport in carriers:
        secret, stream_url, label = carriers[transport]
        if not secret or not stream_url:
            upper = transport.upper()
            if transport in ("telnyx", "exotel"):
                option = "--telnyx-stream-token" if transport == "telnyx" else "--exotel-credentials"
                console.print(f"[red]--transport {transport} needs {option}, as the node has it[/red]")
                raise typer.Exit(2)
            console.print(
                f"[red]--transport {transport} needs --{transport}-auth-token and "
                f"--{transport}-stream-url (or DUPLEX_{upper}_AUTH_TOKEN and DUPLEX_{upper}_STREAM_URL), as "
                "the node has them[/red]"
            )
            raise typer.Exit(2)
        from runtime.tools.loadgen_phone import run_phone_load

        phone_report = asyncio.run(
            run_phone_load(
                transport,
                url,
                speech,
                sessions=sessions,
                secret=secret,
                stream_url=stream_url,
                token=tokens,
                max_duration_s=max_duration_s,
                stagger_s=stagger_s,
            )
        )
        _print_report(phone_report, None, f"{sessions} {label} calls against {url}", json_out)
        raise typer.Exit(0 if phone_report.ok else 1)
    if transport == "webrtc":
        from runtime.tools.loadgen_rtc import run_rtc_load

        rtc_report = asyncio.run(
            run_rtc_load(
                url,
                speech,
                sessions=sessions,
                processes=processes,
                token=tokens,
                cafile=str(ca_cert) if ca_cert else None,
                max_duration_s=max_duration_s,
                stagger_s=stagger_s,
                relay=relay,
            )
        )
        _print_report(rtc_report, None, f"{sessions} WebRTC sessions against {url}", json_out)
        raise typer.Exit(0 if rtc_report.ok else 1)
    frames = sum(len(speech[i % len(speech)]) // 1920 for i in range(sessions))
    with Progress(
        TextColumn("frames streamed"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=json_out,
    ) as progress:  # fmt: skip
        task = progress.add_task("frames", total=frames)
        report = asyncio.run(
            run_load(
                session_url(url, audio_format=fmt),
                speech,
                sessions=sessions,
                ssl_context=context,
                max_duration_s=max_duration_s,
                stagger_s=stagger_s,
                on_frame=lambda: progress.advance(task),
                audio_format=fmt,
                token=tokens,
                pre_encode=pre_encode,
                metrics_url=metrics_url,
            )
        )
    _print_report(report, report.budget, f"{sessions} sessions against {url}", json_out)
    raise typer.Exit(0 if report.ok else 1)


def _print_report(report: Any, budget: object, title: str, json_out: bool) -> None:
    """``duplex loadgen``'s output: the table, or JSON (summary, first-audio budget, sessions)."""
    from runtime.tools.loadgen import load_table

    if json_out:
        print(
            json.dumps(
                {"summary": report.summary(), "first_audio_budget": budget, "sessions": report.session_rows()}
            )
        )
        return
    table = load_table(title, report)
    total = report.summary()
    if "ice_connect_ms_p50" in total:

        def ms(key: str) -> str:
            value = total[key]
            return "-" if value is None else f"{value:.0f}"

        table.caption = (
            f"{table.caption}\nPOST -> answer p50/p99 {ms('answer_ms_p50')}/{ms('answer_ms_p99')} ms; "
            f"POST -> connected p50/p99 {ms('ice_connect_ms_p50')}/{ms('ice_connect_ms_p99')} ms; "
            f"20 ms packets concealed {total['concealed_packets']}"
        )
    console.print(table)


def bench(
    model: Annotated[str, typer.Option(help="Model preset")] = "tiny",
    device: Annotated[str, typer.Option(help="cpu or cuda")] = "cpu",
    batch: Annotated[list[int] | None, typer.Option(help="Batch sizes (repeat the option)")] = None,
    ticks: Annotated[int, typer.Option(help="Measured ticks per configuration")] = 200,
    stock: Annotated[bool, typer.Option(help="Also measure the stock design")] = True,
    stagger: Annotated[
        bool, typer.Option(help="Also measure a staggered sub-tick (half the slots, DUPLEX_STAGGER_GROUPS=2)")
    ] = False,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    quantize: Annotated[
        str, typer.Option(help="LM weights: none or int8 (moshi's LLM.int8 path, as DUPLEX_QUANTIZE)")
    ] = "none",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows to this JSON file")] = None,
) -> None:
    """Tick time of the batched engine vs B stock batch-1 generators (see runtime/tools/bench.py), and the
    LM's
    parameter and KV-cache bytes at the chosen weights (``--quantize int8`` against ``none``)."""
    import torch

    from runtime.engine.models import check_quantize
    from runtime.tools.bench import bench_bundle, rows_as_dicts, run_benchmark, speedups

    try:
        check_quantize(quantize)
    except ValueError as exc:
        console.print(f"[red]--quantize: {exc}[/red]")
        raise typer.Exit(2) from None
    if threads:
        torch.set_num_threads(threads)
    sizes = batch or [1, 2, 4, 8]

    bundle = bench_bundle(model, device=device, quantize=quantize)  # once: every engine runs on it
    lm = bundle.lm
    weights_mb = bundle.lm_parameter_bytes() / 1e6
    lm.transformer.streaming_forever(1)
    states = lm.transformer.get_streaming_state().values()
    kv_mb = sum(s.kv_cache.cache.nbytes for s in states if getattr(s, "kv_cache", None) is not None) / 1e6
    lm.transformer._stop_streaming()
    user_codebooks = lm.num_codebooks - lm.dep_q - 1
    console.print(
        f"{model}, quantize={quantize}: depformer steps {lm.dep_q}, user codebooks into the LM "
        f"{user_codebooks}, LM parameters {weights_mb:.1f} MB, temporal KV cache {kv_mb:.2f} MB per slot"
    )
    rows = run_benchmark(
        bundle, sizes, ticks=ticks, stock=stock, stagger=stagger, progress=lambda m: console.log(m)
    )
    title = f"tick time, {model} ({quantize}) on {device} (torch threads {torch.get_num_threads()})"
    table = Table(title=title)
    columns = ["design", "B", "p50 ms", "p99 ms", "real-time sessions", "p99 within its period"]
    for column in [*columns, "CUDA graphs replayed"]:
        table.add_column(column)
    for r in rows:
        graphs = "-" if r.cuda_graphs_replayed is None else ("yes" if r.cuda_graphs_replayed else "NO")
        table.add_row(
            r.design,
            str(r.batch),
            f"{r.p50_ms:.1f}",
            f"{r.p99_ms:.1f}",
            f"{r.realtime_sessions:.1f}",
            "yes" if r.within_budget else "no",
            graphs,
        )
    console.print(table)
    for b, ratio in speedups(rows).items():
        console.print(f"B={b}: batched throughput {ratio:.2f}x the stock design")
    if json_path:
        summary: dict[str, object] = {"rows": rows_as_dicts(rows), "speedups": speedups(rows)}
        summary["quantize"] = quantize
        summary.update({"lm_parameter_mb": weights_mb, "temporal_kv_mb_per_slot": kv_mb})
        summary.update({"depformer_steps": lm.dep_q, "user_codebooks": user_codebooks})
        json_path.write_text(json.dumps(summary, indent=2))


def bench_persona(
    live: Annotated[int, typer.Option(help="Sessions talking while the prompted one joins")] = 4,
    prompt_tokens: Annotated[int, typer.Option(help="Text prompt tokens (wrapper included)")] = 1000,
    mode: Annotated[
        list[str] | None, typer.Option(help="prefill and/or step-by-step (repeat the option)")
    ] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here")] = None,
) -> None:
    """Connect-to-handshake time of a session with a long text prompt while others talk, with the prompt
    prefilled or fed step by step, and the tick times meanwhile (tiny preset, CPU;
    runtime/tools/prompt_bench.py).
    Needs nothing but this machine: a server on loopback, clients in this process."""
    import asyncio

    import torch

    from runtime.engine.models import build_tiny
    from runtime.tools.prompt_bench import measure_join

    if threads:
        torch.set_num_threads(threads)
    modes = mode or ["prefill", "step-by-step"]
    for m in modes:
        if m not in ("prefill", "step-by-step"):
            console.print(f"[red]--mode {m!r}: allowed: prefill, step-by-step[/red]")
            raise typer.Exit(2)
    bundle = build_tiny()
    summaries = []
    for m in modes:
        console.log(f"{m}: {live} live sessions, one joining with a {prompt_tokens}-token prompt")
        run = measure_join(bundle, prefill=m == "prefill", live=live, prompt_tokens=prompt_tokens)
        result = asyncio.run(run)
        summaries.append(result.summary())
    table = Table(title=f"persona join, tiny on cpu (torch threads {torch.get_num_threads()})")
    table.add_column("")
    for summary in summaries:
        table.add_column(str(summary["mode"]))
    for key in list(summaries[0])[1:]:
        table.add_row(key.replace("_", " "), *(str(summary[key]) for summary in summaries))
    console.print(table)
    if json_path:
        json_path.write_text(json.dumps(summaries, indent=2))


def _signing_key(key_file: Path, kid: str | None):  # noqa: ANN202 (runtime.frontend.gate.tokens.SigningKey, lazy import)
    """The key ``kid`` of ``key_file`` (its only key when ``kid`` is None); exits 2 naming the problem."""
    from runtime.frontend.gate.tokens import load_key_file

    try:
        keys = {key.kid: key for key in load_key_file(key_file)}
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    if kid is None:
        if len(keys) != 1:
            console.print(
                f"[red]{key_file} holds {len(keys)} keys: choose one with --kid ({', '.join(keys)})[/red]"
            )
            raise typer.Exit(2)
        return next(iter(keys.values()))
    if kid not in keys:
        console.print(f"[red]no key {kid!r} in {key_file}; it holds: {', '.join(keys)}[/red]")
        raise typer.Exit(2)
    return keys[kid]


def _personas(persona: list[str] | None) -> list[str]:
    """``--persona`` values as the token's ``personas`` claim: ``any`` (the default) is ``*``."""
    values = persona or ["any"]
    return ["*" if value in ("any", "*") else value for value in values]


def _token_factory(
    key_file: Path, kid: str | None, *, audience: str, personas: list[str] | None, ttl_s: float = 300.0
) -> Callable[[], str]:
    from runtime.frontend.gate.tokens import mint_token

    key = _signing_key(key_file, kid)
    claims = _personas(personas)
    try:
        mint_token(key, ttl_s=ttl_s, personas=claims, audience=audience)  # fail on bad input now
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    return lambda: mint_token(key, ttl_s=ttl_s, personas=claims, audience=audience)


@token_app.command("mint")
def token_mint(
    key_file: Annotated[
        Path,
        typer.Option(
            help='Signing keys, JSON {"kid": "secret"}: the session keys (secrets/token_keys.json), or with '
            "--app the application keys (DUPLEX_APP_TOKEN_KEYS_FILE)"
        ),
    ],
    kid: Annotated[
        str | None, typer.Option(help="Key id to sign with (default: the file's only key)")
    ] = None,
    ttl_s: Annotated[
        float, typer.Option(help="Lifetime (s): the session must open within it; 24 h at most")
    ] = 300.0,
    persona: Annotated[
        list[str] | None, typer.Option(help="Voice prompt the token allows (repeat); 'any' for all")
    ] = None,
    max_session_s: Annotated[
        float | None, typer.Option(help="Close the session after this many seconds")
    ] = None,
    audience: Annotated[
        str, typer.Option(envvar="DUPLEX_TOKEN_AUDIENCE", help="The node's DUPLEX_TOKEN_AUDIENCE")
    ] = "duplex",
    recording_consent: Annotated[
        bool, typer.Option(help="The caller consented: the node records both sides (DUPLEX_RECORDING_DIR)")
    ] = False,
    app: Annotated[
        bool, typer.Option("--app", help="Mint an application token for the sessions API instead")
    ] = False,
    scope: Annotated[
        list[str] | None,
        typer.Option(
            help="With --app: sessions:read, sessions:erase and/or sessions:recordings (repeat; default all)"
        ),
    ] = None,
    tenant: Annotated[
        str | None,
        typer.Option(help="The tenant (application) the token is for; default the key's (or 'default')"),
    ] = None,
) -> None:
    """Print one signed session token (single-use), or with --app an application token for the sessions API
    (docs/sessions-api.md). From code: runtime.frontend.gate.tokens.mint_token,
    runtime.frontend.gate.app_tokens."""
    from runtime.frontend.gate.app_tokens import SCOPES, mint_app_token
    from runtime.frontend.gate.tokens import mint_token

    key = _signing_key(key_file, kid)
    session_only = persona or max_session_s is not None or recording_consent
    if (app and session_only) or (scope and not app):
        console.print(
            "[red]--persona, --max-session-s and --recording-consent are for session tokens; --scope is for "
            "--app tokens[/red]"
        )
        raise typer.Exit(2)
    try:
        if app:
            token = mint_app_token(key, ttl_s=ttl_s, audience=audience, scopes=scope or SCOPES, tenant=tenant)
        else:
            token = mint_token(
                key,
                ttl_s=ttl_s,
                personas=_personas(persona),
                max_session_s=max_session_s,
                audience=audience,
                recording_consent=recording_consent,
                tenant=tenant,
            )
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    print(token)


@token_app.command("keygen")
def token_keygen(
    kid: Annotated[str | None, typer.Option(help="Key id (default: key-<8 hex>)")] = None,
    tenant: Annotated[
        str | None,
        typer.Option(help="Bind the key to this tenant: it then signs that tenant's tokens only"),
    ] = None,
) -> None:
    """Print a new random signing key as JSON {"kid": "secret"} (32 random bytes), or with --tenant
    {"kid": {"secret": ..., "tenant": ...}}: add it to the node's session keys (DUPLEX_TOKEN_KEYS_FILE) or
    application keys (DUPLEX_APP_TOKEN_KEYS_FILE; a kid in one set only) and to the minting backend's."""
    from runtime.signing_keys import generate_signing_key, key_json

    try:
        key = generate_signing_key(kid, tenant)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    print(json.dumps(key_json(key)))


def runtime_app(help: str = RUNTIME_HELP) -> typer.Typer:
    """A new ``duplex`` Typer app holding the runtime's commands (``serve``, ``demo``, ``loadgen``,
    ``bench``, ``bench-persona``) and the ``token`` group; the caller may add more groups to it
    (``infra.cli``)."""
    runtime = typer.Typer(name="duplex", help=help, no_args_is_help=True, add_completion=False)
    for command in (serve, demo, loadgen, bench):
        runtime.command()(command)
    runtime.command("bench-persona")(bench_persona)
    runtime.add_typer(token_app, name="token")
    return runtime


app = runtime_app()
"""The runtime's commands alone: the image's entrypoint (``duplex-runtime``, ``python -m
runtime.tools.cli``)."""


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())


if __name__ == "__main__":  # python -m runtime.tools.cli
    main()
