"""``duplex serve --workers N`` in one test process: the engine (``EngineCore`` over ``LocalSlots`` with the
tiny model) and N front ends over ``EngineClient``, on one port with ``SO_REUSEPORT``, talking over a real
ZeroMQ ``ipc://`` socket, sharing one metrics registry (as the node's multiprocess registry adds its
processes up). The same front-end code as ``--workers 0``, reached through the same ``server`` surface the
end-to-end tests use (``port``, ``backend``, ``sessions``, ``metrics``, ``render_metrics``...)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from runtime.config import RuntimeConfig
from runtime.engine.engine_core import EngineCore, LocalSlots
from runtime.engine.models import ModelBundle
from runtime.frontend.engine_client import EngineClient
from runtime.frontend.server import DuplexServer
from runtime.frontend.session.conversation import ChatSession
from runtime.frontend.store.redis_store import SessionStore
from runtime.frontend.worker import worker_share
from runtime.metrics import RuntimeMetrics
from runtime.tools.local_redis import free_loopback_port


class InProcessNode:
    """An engine and ``workers`` front ends (see the module docstring). ``config.port`` 0 picks a free one."""

    def __init__(
        self,
        config: RuntimeConfig,
        bundle: ModelBundle,
        *,
        workers: int = 2,
        store: SessionStore | None = None,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        port = config.port or free_loopback_port()
        self.config = config.model_copy(update={"port": port, "workers": workers})
        self.metrics = metrics or RuntimeMetrics()
        self.store = store
        self._dir = tempfile.TemporaryDirectory(prefix="duplex-node-test-")
        address = f"ipc://{Path(self._dir.name) / 'engine.sock'}"
        self.engine = EngineCore(self.config, bundle, address, self.metrics)
        share = worker_share(self.config)
        self.workers = [
            DuplexServer(
                share,
                EngineClient(
                    address,
                    f"worker-{i}",
                    slots=share.max_sessions,
                    spends_tokens=share.token_replay_check == "memory",
                    max_inbox_frames=share.max_inbox_frames,
                ),
                store=store,  # one store object (start and close are idempotent)
                metrics=self.metrics,
                worker_id=f"worker-{i}",
            )
            for i in range(workers)
        ]
        self._engine_task: asyncio.Task[None] | None = None

    @property
    def backend(self) -> LocalSlots:
        """The engine's slots (status, waiting room, prompts)."""
        return self.engine.slots

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def sessions(self) -> set[ChatSession]:
        return set().union(*(w.sessions for w in self.workers))

    @property
    def draining(self) -> bool:
        return all(w.draining for w in self.workers)

    def render_metrics(self, now: float | None = None) -> bytes:
        return self.workers[0].render_metrics(now)

    async def start(self) -> None:
        await asyncio.to_thread(self.engine.warm_up)
        self._engine_task = asyncio.create_task(self.engine.run())
        for worker in self.workers:
            await worker.start()
        async with asyncio.timeout(30):
            while not all(w.backend.status().loaded for w in self.workers):
                await asyncio.sleep(0.02)

    async def drain(self, grace_s: float | None = None) -> None:
        await asyncio.gather(*(w.drain(grace_s) for w in self.workers))
        await self.close()

    async def close(self) -> None:
        for worker in self.workers:
            await worker.close()
        if self._engine_task is not None:
            self.engine.stop()
            await self._engine_task
            self._engine_task = None
        self._dir.cleanup()
