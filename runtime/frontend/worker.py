"""A front-end worker process of ``duplex serve --workers N``: the same front end as one process
(:class:`runtime.frontend.server.DuplexServer`) over the engine process's slots, reached over ZeroMQ
(:class:`runtime.frontend.engine_client.EngineClient`). Every worker listens on the node's port with
``SO_REUSEPORT`` (the kernel spreads new connections over them).

It imports neither torch nor the model (``tests/test_import_graph.py`` holds it to that).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal

from runtime.config import RuntimeConfig
from runtime.frontend.engine_client import EngineClient
from runtime.frontend.server import DuplexServer, build_store
from runtime.gc_policy import parse_gc_thresholds, tune_gc
from runtime.metrics import RuntimeMetrics

__all__ = ["build_worker", "worker_share", "worker_main"]


def worker_share(config: RuntimeConfig) -> RuntimeConfig:
    """The settings of one of ``config.workers`` workers: the handshake rate limits (global and per client)
    split evenly, so that the workers together enforce the node's limits. The kernel spreads connections
    over the workers by a hash of each connection's addresses and ports (``SO_REUSEPORT``), so each worker
    sees about its share of the node's handshakes, one client's included; a worker refuses past its share
    even when another has room (a difference of one share at most). ``config.workers`` < 2: unchanged."""
    workers = config.workers
    if workers < 2:
        return config
    return config.model_copy(
        update={
            "handshake_rate_global": config.handshake_rate_global / workers,
            "handshake_burst_global": max(1, math.ceil(config.handshake_burst_global / workers)),
            "handshake_rate_per_client": config.handshake_rate_per_client / workers,
            "handshake_burst_per_client": max(1, math.ceil(config.handshake_burst_per_client / workers)),
        }
    )


def build_worker(config: RuntimeConfig, address: str, worker_id: str) -> DuplexServer:
    """A worker's server (not started): the front end over an :class:`EngineClient` to ``address``, with its
    share of the node's handshake limits (:func:`worker_share`)."""
    config = worker_share(config)
    metrics = RuntimeMetrics()
    backend = EngineClient(
        address,
        worker_id,
        slots=config.max_sessions,
        # replay_check=memory: one memory for every worker, the engine's (a worker's own would let a token
        # be used once per worker).
        spends_tokens=config.token_replay_check == "memory",
        max_inbox_frames=config.max_inbox_frames,
    )
    backend.on_loaded = lambda: metrics.loading.set(0)
    return DuplexServer(
        config, backend, store=build_store(config, metrics, worker_id), metrics=metrics, worker_id=worker_id
    )


def worker_main(config: RuntimeConfig, address: str, worker_id: str) -> None:
    """Entry point of a worker process (``runtime.multiproc``): serve until SIGTERM, then drain."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s {worker_id} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; Ctrl-C reaches it
    from runtime.child_process import die_with_parent

    die_with_parent()
    server = build_worker(config, address, worker_id)

    async def main() -> None:
        await server.start()
        tune_gc(parse_gc_thresholds(config.gc_thresholds))
        await server.serve_until_signal()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
