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
  places; the others go on.

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
from runtime.engine.models import ModelBundle
from runtime.engine.persona import Persona, PersonaError, VoiceCatalog, build_prompt
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import NodeFull, SlotScheduler, SlotSession
from runtime.engine.sim import make_engine
from runtime.engine.waiting_room import SlotAdmission, WaitingRoomFull, WaitTimeout, open_slots
from runtime.metrics import RuntimeMetrics

__all__ = ["EngineCore", "STATUS_PERIOD_S", "WORKER_TIMEOUT_S"]

log = logging.getLogger(__name__)

STATUS_PERIOD_S = 0.1
"""How often the engine tells every worker the slots' state."""
WORKER_TIMEOUT_S = 5.0
"""A worker not heard from for this long is gone: its sessions' slots are freed."""
SEND_HWM = 10_000
"""Messages queued per worker before the engine drops output (ZeroMQ's send high-water mark)."""


@dataclass(eq=False)
class _Remote:
    """A session of one worker, as the engine holds it."""

    worker: bytes
    slot_session: SlotSession
    admit_task: asyncio.Task[None] | None = None
    token_id: str = ""
    token_expires_at: float = 0.0


@dataclass
class _Worker:
    identity: bytes
    pid: int
    last_seen: float
    outputs: list[tuple[str, bytes, str]] = field(default_factory=list)


class EngineCore:
    """Serves the slots of one model copy to front-end workers over ``address``.

    Args:
        config: the node's settings (``max_sessions``, ``model``, ``sim_step_ms``, waiting room, drain).
            Any object with those attributes (a ``RuntimeConfig``).
        bundle: the loaded models.
        address: ZeroMQ endpoint to bind, e.g. ``ipc:///tmp/duplex-xyz/engine.sock``.
        metrics: this process's metrics (shared with the workers' through prometheus_client's
            multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set).
    """

    def __init__(self, config, bundle: ModelBundle, address: str, metrics: RuntimeMetrics | None = None):  # type: ignore[no-untyped-def]
        self.config = config
        self.bundle = bundle
        self.address = address
        self.metrics = metrics or RuntimeMetrics()
        self.engine = make_engine(
            config.model, bundle, config.max_sessions, config.sim_step_ms, prefill=config.prompt_prefill
        )
        self.voices = VoiceCatalog.load(config.voices_dir, bundle.mimi)
        self.scheduler: SlotScheduler | None = None
        self.admission: SlotAdmission | None = None
        self.sessions: dict[str, _Remote] = {}
        self.workers: dict[bytes, _Worker] = {}
        self.draining = False
        self._spent_tokens: dict[str, float] = {}  # token id -> expiry (Unix s), for replay_check=memory
        self._flush_scheduled = False
        self._stop = asyncio.Event()
        self._socket: zmq.asyncio.Socket | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    def warm_up(self, frames: int = 4) -> None:
        """As ``DuplexServer.warm_up``: every prefill chunk size, then a few silent ticks through slot 0."""
        self.engine.warm_up_prefill()
        self.engine.join(0, SamplingParams())
        silence = np.zeros((self.engine.slots, 1920), dtype=np.float32)
        for _ in range(frames + 1):
            self.engine.tick(silence)
        self.engine.leave(0)

    async def run(self) -> None:
        """Bind, start the tick, serve until :meth:`stop` (SIGTERM: drain first), then close."""
        loop = asyncio.get_running_loop()
        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.RCVHWM, SEND_HWM)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker raises instead of silently dropping
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._socket = sock
        self.admission = open_slots(
            self.engine,
            self.bundle.text_tokenizer,
            self.metrics,
            loop,
            wait_s=self.config.waiting_room_s,
            max_waiting=self.config.waiting_room_size,
        )
        self.scheduler = self.admission.scheduler
        self.metrics.ready.set(1)
        log.info("engine: %d slots, listening for front-end workers on %s", self.engine.slots, self.address)
        tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._broadcast())]
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(self.scheduler.stop)
            sock.close(0)

    def stop(self) -> None:
        self._stop.set()

    async def drain(self, grace_s: float) -> None:
        """Refuse new sessions; stop once every session ended or ``grace_s`` + 5 s passed (the workers
        close theirs at their own grace)."""
        self.draining = True
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
                if remote is not None:
                    frame = np.frombuffer(message.pcm, dtype="<f4")
                    if not remote.slot_session.push_frame(frame):
                        self.metrics.frames_dropped.labels(reason="input_overflow").inc()
            elif isinstance(message, ipc.Hello):
                if worker is None:
                    log.info("engine: worker %s (pid %d) connected", message.worker, message.pid)
                    self.workers[identity] = _Worker(identity, message.pid, time.monotonic())
            elif isinstance(message, ipc.Admit):
                self._admit(identity, message)
            elif isinstance(message, ipc.Release):
                self._release(message.session_id)

    def _admit(self, worker: bytes, message: ipc.Admit) -> None:
        sid = message.session_id
        if self.draining:
            self._send(worker, ipc.Refused(sid, "draining", "node is draining for shutdown"))
            return
        try:
            persona = Persona(message.voice_prompt or None, message.text_prompt or None)
            prompt = build_prompt(
                persona,
                self.voices,
                self.bundle.text_tokenizer,
                silence_codes=self.engine.silence_codes.cpu(),
                sine_codes=self.engine.sine_codes.cpu(),
            )
            sampling = SamplingParams(*message.sampling)
        except (PersonaError, ValueError, TypeError) as exc:
            self._send(worker, ipc.Refused(sid, "bad_request", f"bad request: {exc}"))
            return
        slot_session = SlotSession(
            sid,
            sampling,
            prompt,
            on_output=lambda pcm, piece: self._output(worker, sid, pcm, piece),
            on_prompt_done=lambda: self._send_and_forget(worker, ipc.PromptDone(sid)),
            max_inbox_frames=message.max_inbox_frames,
        )
        remote = _Remote(worker, slot_session, None, message.token_id, message.token_expires_at)
        self.sessions[sid] = remote
        remote.admit_task = asyncio.create_task(self._wait_for_slot(remote))

    async def _wait_for_slot(self, remote: _Remote) -> None:
        assert self.admission is not None
        sid = remote.slot_session.session_id
        try:
            slot = await self.admission.admit(remote.slot_session)
        except WaitingRoomFull as exc:
            refusal = ipc.Refused(sid, "waiting_room_full", f"node full: {exc}")
        except WaitTimeout as exc:
            refusal = ipc.Refused(sid, "wait_timeout", f"node full: {exc}")
        except NodeFull:
            slots = self.engine.slots
            message = f"node full: all {slots} slots in use (max_sessions={slots}); try again later"
            refusal = ipc.Refused(sid, "node_full", message)
        else:
            if not self._spend_token(remote):
                self.sessions.pop(sid, None)
                assert self.scheduler is not None
                self.scheduler.release(remote.slot_session)
                message = f"token {remote.token_id} was already used; tokens are single-use"
                self._send(remote.worker, ipc.Refused(sid, "replayed", message))
                return
            self._send(remote.worker, ipc.Admitted(sid, slot))
            return
        self.sessions.pop(sid, None)
        self._send(remote.worker, refusal)

    def _spend_token(self, remote: _Remote) -> bool:
        """Record the session's token id (``replay_check=memory``); False when it was used already."""
        if not remote.token_id:
            return True
        now = time.time()
        if len(self._spent_tokens) > 1024:
            self._spent_tokens = {t: until for t, until in self._spent_tokens.items() if until > now}
        until = self._spent_tokens.get(remote.token_id)
        if until is not None and until > now:
            return False
        self._spent_tokens[remote.token_id] = remote.token_expires_at + self.config.token_leeway_s
        return True

    def _release(self, session_id: str) -> None:
        remote = self.sessions.pop(session_id, None)
        if remote is None:
            return
        if remote.admit_task is not None and not remote.admit_task.done():
            remote.admit_task.cancel()  # leaves the waiting room (a slot granted meanwhile is given back)
        assert self.scheduler is not None
        self.scheduler.release(remote.slot_session)

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

    def _send_and_forget(self, worker: bytes, message: ipc.Message) -> None:
        self._send(worker, message)

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
        assert self.scheduler is not None and self.admission is not None
        while True:
            now = time.monotonic()
            for identity, worker in list(self.workers.items()):
                if now - worker.last_seen > WORKER_TIMEOUT_S:
                    self._forget_worker(identity)
            status = ipc.Status(
                slots=self.engine.slots,
                free_slots=self.scheduler.free_slots,
                waiting=self.admission.waiting,
                tick_alive=self.scheduler.alive,
                draining=self.draining,
                voices=self.voices.names,
                engine_pid=os.getpid(),
            )
            for identity in list(self.workers):
                self._send(identity, status)
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
        for sid in gone:
            self._release(sid)


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
