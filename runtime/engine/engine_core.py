"""The engine process of ``duplex serve --workers N``: the model, the slots, the waiting room and the 80 ms
tick, and no socket to any caller (vLLM v1's ``EngineCore``, ``vllm/v1/engine/core.py``).

It binds one ZeroMQ ROUTER socket (``runtime.ipc``) that the front-end workers connect to, and runs:

- the tick thread (``runtime.engine.scheduler.SlotScheduler``), exactly as in one process: it never touches a
  socket; outputs reach the event loop with ``call_soon_threadsafe`` and leave, one ``Outputs`` message per
  worker per tick, with ``zmq.NOBLOCK`` (a full queue drops and counts ``slow_worker``; it never waits);
- admission (``runtime.engine.waiting_room.SlotAdmission``): global and exact, since the slots live here
alone,
  however many workers take handshakes at once;
- a ``Status`` broadcast every ``STATUS_PERIOD_S`` (slots, free, waiting, tick alive, draining, voices) that
  the workers answer ``/readyz``, ``/healthz`` and ``/api/admission`` from;
- worker liveness: a worker silent for ``WORKER_TIMEOUT_S`` (killed, hung) loses its sessions' slots and
  places (a resumable session's slot is held for a resume through another worker); the others go on;
- resume (``runtime.engine.resume``): ``Detach`` holds a session's slot, ``Resume`` from any worker hands it
  over (the worker that held it before is told ``Moved``), ``HoldExpired`` tells the holder nobody came.

The slots themselves (model, scheduler, waiting room, persona prompts, the token ledger, the resume holds)
are :class:`LocalSlots` (``runtime.engine.local_slots``, re-exported here), the in-process implementation
of ``runtime.engine.api.SlotBackend``: ``--workers 0`` uses it directly, the engine process serves it to
the workers.

Engine side only: it imports no front-end module (server, protocol, codecs, tokens, session store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from runtime import ipc
from runtime.engine.api import (
    AdmitRequest,
    FirstAudioTiming,
    Refusal,
    SamplingParams,
    SessionSink,
    SlotLease,
)
from runtime.engine.local_slots import LocalSlots
from runtime.engine.models import ModelBundle
from runtime.engine.resume import credential_session
from runtime.fleet.deletion_cost import sessions_on, start_deletion_cost
from runtime.metrics import RuntimeMetrics

__all__ = ["STATUS_PERIOD_S", "WORKER_TIMEOUT_S", "EngineCore", "LocalSlots"]

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.1
"""How often the engine tells every worker the slots' state."""
WORKER_TIMEOUT_S = 5.0
"""A worker not heard from for this long is gone: its sessions' slots are freed."""
SEND_HWM = 10_000
"""Messages queued per worker before the engine drops output (ZeroMQ's send high-water mark)."""


class _WorkerSink(SessionSink):
    """A worker's session as the engine's slots see it: outputs go back to that worker."""

    def __init__(self, core: EngineCore, worker: bytes, session_id: str) -> None:
        self.core = core
        self.worker = worker
        self.session_id = session_id

    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        self.core._output(self.worker, self.session_id, pcm, piece)

    def on_prompt_done(self) -> None:
        self.core._send(self.worker, ipc.PromptDone(self.session_id))

    def on_first_audio(self, timing: FirstAudioTiming) -> None:
        # Sent at once, so ahead of the Outputs that carry the first audio (flushed later in this loop turn).
        self.core._send(self.worker, ipc.FirstAudio(self.session_id, *timing.as_tuple()))

    def on_hold_expired(self) -> None:
        if self.core.sessions.pop(self.session_id, None) is not None:
            self.core._send(self.worker, ipc.HoldExpired(self.session_id))


@dataclass(eq=False)
class _Remote:
    """A session of one worker, as the engine holds it: the admission under way, then the lease."""

    worker: bytes
    admit_task: asyncio.Task[None] | None = None
    lease: SlotLease | None = None


@dataclass
class _Worker:
    identity: bytes
    pid: int
    last_seen: float
    outputs: list[tuple[str, bytes, str]] = field(default_factory=list)


class EngineCore:
    """Serves the slots of one model copy (:class:`LocalSlots`) to front-end workers over ``address``.

    Args:
        config: the node's settings (as :class:`LocalSlots`, plus ``drain_grace_s``).
        bundle: the loaded models.
        address: ZeroMQ endpoint to bind, e.g. ``ipc:///tmp/duplex-xyz/engine.sock``.
        metrics: this process's metrics (shared with the workers' through prometheus_client's
            multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set).
    """

    def __init__(self, config, bundle: ModelBundle, address: str, metrics: RuntimeMetrics | None = None):  # type: ignore[no-untyped-def]
        self.config = config
        self.address = address
        self.metrics = metrics or RuntimeMetrics()
        # replay_check=memory: the slots' owner keeps the node's one memory of spent tokens.
        spends = config.token_replay_check == "memory"
        self.slots = LocalSlots(config, bundle, self.metrics, spends_tokens=spends)
        self.sessions: dict[str, _Remote] = {}
        self.workers: dict[bytes, _Worker] = {}
        self._flush_scheduled = False
        self._stop = asyncio.Event()
        self._socket: zmq.asyncio.Socket | None = None

    @property
    def draining(self) -> bool:
        return self.slots.draining

    # --- lifecycle ------------------------------------------------------------------------------------

    def warm_up(self, frames: int = 4) -> None:
        """:meth:`LocalSlots.warm_up` (blocking)."""
        self.slots.warm_up(frames)

    async def run(self) -> None:
        """Bind, start the tick, serve until :meth:`stop` (SIGTERM: drain first), then close."""
        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker raises instead of silently dropping
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._socket = sock
        await self.slots.start()
        self.metrics.ready.set(1)
        log.info(
            "engine: %d slots, listening for front-end workers on %s", self.slots.engine.slots, self.address
        )
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._broadcast())]
        deletion_cost = start_deletion_cost(
            self.config, self.metrics, lambda: sessions_on(self.slots.status()), dict(os.environ)
        )
        try:
            await self._stop.wait()
        finally:
            if deletion_cost is not None:
                await deletion_cost.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.slots.close()
            sock.close(0)

    def stop(self) -> None:
        self._stop.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new sessions; stop once every session ended or ``grace_s`` + 5 s passed (the workers
        close theirs at their own grace)."""
        self.slots.draining = True
        self.metrics.draining.set(1)
        self.metrics.ready.set(0)
        deadline = time.monotonic() + grace_s + 5.0
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.stop()

    # --- messages -------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            identity, data = await self._socket.recv_multipart()
            try:
                message = ipc.decode(data)
            except Exception:  # a version mismatch between processes: say so once per message, go on
                log.exception("engine: undecodable message from worker %r", identity)
                continue
            worker = self.workers.get(identity)
            if worker is not None:
                worker.last_seen = time.monotonic()
            if isinstance(message, ipc.Frame):
                remote = self.sessions.get(message.session_id)
                if remote is not None and remote.lease is not None and remote.worker == identity:
                    frame = np.frombuffer(message.pcm, dtype="<f4")
                    if not self.slots.push_frame(remote.lease, frame):
                        self.metrics.frames_dropped.labels(reason="input_overflow").inc()
            elif isinstance(message, ipc.Hello):
                if worker is None:
                    log.info("engine: worker %s (pid %d) connected", message.worker, message.pid)
                    self.workers[identity] = _Worker(identity, message.pid, time.monotonic())
            elif isinstance(message, ipc.Admit):
                self._admit(identity, message)
            elif isinstance(message, ipc.Release):
                self._release(message.session_id, identity)
            elif isinstance(message, ipc.Detach):
                self._detach(message.session_id, identity)
            elif isinstance(message, ipc.Resume):
                asyncio.create_task(self._resume(identity, message))
            elif isinstance(message, ipc.Hangup | ipc.HangupResult):
                self._route_hangup(identity, message)
            elif isinstance(message, ipc.SpendToken):
                fresh = self.slots.record_token(message.token_id, message.expires_at, message.check_only)
                self._send(identity, ipc.TokenSpent(message.request_id, fresh))

    def _admit(self, worker: bytes, message: ipc.Admit) -> None:
        sid = message.session_id
        try:
            sampling = SamplingParams(*message.sampling)
        except (ValueError, TypeError) as exc:
            self._send(worker, ipc.Refused(sid, "bad_request", f"bad request: {exc}"))
            return
        request = AdmitRequest(
            sid,
            message.voice_prompt or None,
            message.text_prompt or None,
            sampling,
            client=message.client,
            token_id=message.token_id,
            token_expires_at=message.token_expires_at,
            resumable=message.resumable,
            meta=message.meta,
        )
        remote = _Remote(worker)
        self.sessions[sid] = remote
        remote.admit_task = asyncio.create_task(self._wait_for_slot(remote, request))

    async def _wait_for_slot(self, remote: _Remote, request: AdmitRequest) -> None:
        sid = request.session_id
        try:
            remote.lease = await self.slots.admit(request, _WorkerSink(self, remote.worker, sid))
        except Refusal as exc:
            self.sessions.pop(sid, None)
            self._send(remote.worker, ipc.Refused(sid, exc.reason, exc.message))
            return
        self._send(remote.worker, ipc.Admitted(sid, remote.lease.slot, remote.lease.resume_credential))

    def _route_hangup(self, sender: bytes, message: ipc.Hangup | ipc.HangupResult) -> None:
        """A hang-up between workers (``runtime.ipc.Hangup``): the request to the worker holding the
        session (or ``ended=False`` back at once when none does), the holder's answer to the asker."""
        if isinstance(message, ipc.HangupResult):
            self._send(
                message.requester, ipc.HangupResult(message.request_id, message.session_id, message.ended)
            )
            return
        remote = self.sessions.get(message.session_id)
        if remote is None:
            self._send(sender, ipc.HangupResult(message.request_id, message.session_id, False))
            return
        self._send(remote.worker, ipc.Hangup(message.request_id, message.session_id, message.key, sender))

    def _release(self, session_id: str, worker: bytes | None = None) -> None:
        """End a session (``worker``: only when that worker holds it: a session resumed elsewhere is not
        its former worker's to end)."""
        remote = self.sessions.get(session_id)
        if remote is None or (worker is not None and remote.worker != worker):
            return
        del self.sessions[session_id]
        if remote.admit_task is not None and not remote.admit_task.done():
            remote.admit_task.cancel()  # leaves the waiting room (a slot granted meanwhile is given back)
        if remote.lease is not None:
            self.slots.release(remote.lease)

    def _detach(self, session_id: str, worker: bytes | None = None) -> None:
        """Hold a session's slot for a resume (``LocalSlots.detach``), or end it when it is not resumable."""
        remote = self.sessions.get(session_id)
        if remote is None or (worker is not None and remote.worker != worker):
            return
        if remote.lease is None or not self.slots.detach(remote.lease):
            self._release(session_id)

    async def _resume(self, worker: bytes, message: ipc.Resume) -> None:
        """A resume through ``worker``: the slot's outputs go there from now on; the worker that held the
        session before (another one) is told ``Moved``."""
        parsed = credential_session(message.credential)
        sink = _WorkerSink(self, worker, parsed[0] if parsed else "")
        try:
            grant = await self.slots.resume(message.credential, sink, message.client)
        except Refusal as exc:
            self._send(worker, ipc.Refused(message.ref, exc.reason, exc.message))
            return
        sid, lease = grant.lease.session_id, grant.lease
        remote = self.sessions.setdefault(sid, _Remote(worker))
        if remote.worker != worker:
            self._send(remote.worker, ipc.Moved(sid))
        remote.worker, remote.lease = worker, lease
        reply = ipc.Resumed(
            message.ref, sid, lease.slot, lease.resume_credential, grant.gap_s, grant.meta, grant.transcript
        )
        self._send(worker, reply)

    def _output(self, worker: bytes, session_id: str, pcm: np.ndarray | None, piece: str | None) -> None:
        """On the event loop, once per session per tick: batch the outputs by worker, flush once."""
        state = self.workers.get(worker)
        if state is None:
            return
        state.outputs.append((session_id, b"" if pcm is None else pcm.astype("<f4").tobytes(), piece or ""))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        for worker in self.workers.values():
            if worker.outputs:
                items, worker.outputs = worker.outputs, []
                if not self._send(worker.identity, ipc.Outputs(items)):
                    self.metrics.frames_dropped.labels(reason="slow_worker").inc(len(items))

    def _send(self, worker: bytes, message: ipc.Message) -> bool:
        """Send without waiting; False when the worker's queue is full or the worker is gone."""
        assert self._socket is not None
        try:
            self._socket.send_multipart([worker, ipc.encode(message)], flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            return False
        return True

    async def _broadcast(self) -> None:
        """The ``Status`` to every worker; a worker silent past ``WORKER_TIMEOUT_S`` loses its sessions."""
        while True:
            now = time.monotonic()
            for identity, worker in list(self.workers.items()):
                if now - worker.last_seen > WORKER_TIMEOUT_S:
                    self._forget_worker(identity)
            status = self.slots.status()
            message = ipc.Status(
                slots=status.slots,
                free_slots=status.free_slots,
                waiting=status.waiting,
                tick_alive=status.tick_alive,
                draining=self.draining,
                voices=list(status.voices),
                engine_pid=os.getpid(),
                voices_refused=list(status.voices_refused),
                frame_sample_rate_hz=status.frame.sample_rate_hz,
                frame_samples=status.frame.samples,
            )
            for identity in list(self.workers):
                self._send(identity, message)
            await asyncio.sleep(STATUS_PERIOD_S)

    def _forget_worker(self, identity: bytes) -> None:
        worker = self.workers.pop(identity)
        gone = [sid for sid, remote in self.sessions.items() if remote.worker == identity]
        log.warning(
            "engine: worker pid %d silent for %.0f s: ending its %d sessions",
            worker.pid,
            WORKER_TIMEOUT_S,
            len(gone),
        )
        for sid in gone:  # a resumable session is held: its caller may resume through another worker
            self._detach(sid)


def engine_main(config, address: str) -> None:  # type: ignore[no-untyped-def]
    """Entry point of the engine process (``runtime.multiproc``): load, warm, serve; SIGTERM drains."""

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine %(name)s: %(message)s")
    from runtime.child_process import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; Ctrl-C reaches it
    bundle = config.load_model_bundle()
    core = EngineCore(config, bundle, address)
    core.warm_up()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGTERM, lambda: asyncio.ensure_future(core.drain(config.drain_grace_s))
        )
        await core.run()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
