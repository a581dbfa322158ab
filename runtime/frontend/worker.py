"""A front-end worker process of ``duplex serve --workers N``: WebSockets, codecs, tokens, Redis and HTTP on
the node's port, with the slots in the engine process (``runtime.engine.engine_core``) reached over ZeroMQ
(``runtime.ipc``). vLLM v1's API server to its ``EngineCoreClient`` (``vllm/v1/engine/core_client.py``).

Every worker listens on the same port with ``SO_REUSEPORT`` (the kernel spreads new connections over the
workers), so nginx, the GKE Service and the Compose file see one port as before. A worker is
:class:`runtime.frontend.server.DuplexServer` with the model taken out: it asks the engine for a slot
(``Admit``), streams a session's frames to it (``Frame``), gets one ``Outputs`` message per tick back,
and answers ``/readyz``, ``/healthz`` and ``/api/admission`` from the engine's last ``Status``:

- no ``Status`` yet (the model still loads): ``/healthz`` 200 ``loading``, ``/readyz`` 503;
- none for ``ENGINE_TIMEOUT_S`` after one was heard (the engine died or hangs): ``/healthz`` 500
  ``engine unreachable``, ``/readyz`` 503, and the worker's sessions are closed (1011);
- the engine's tick loop stopped: ``/healthz`` 500 as in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time

import numpy as np
import zmq
import zmq.asyncio
from websockets.asyncio.server import serve

from runtime import ipc
from runtime.config import RuntimeConfig
from runtime.engine.persona import Persona
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import NodeFull
from runtime.engine.waiting_room import WaitingRoomFull, WaitTimeout
from runtime.frontend.maintenance import start_maintenance_watch
from runtime.frontend.protocol import parse_session_query
from runtime.frontend.server import (
    ACCESS_LOG,
    AdmissionRefused,
    ChatSession,
    DuplexServer,
    _select_token_subprotocol,
    sampling_from_request,
)
from runtime.frontend.session_store import SessionStore
from runtime.metrics import RuntimeMetrics

__all__ = ["ENGINE_TIMEOUT_S", "EngineClient", "RemoteSlotSession", "WorkerServer", "worker_main"]

log = logging.getLogger(__name__)

ENGINE_TIMEOUT_S = 5.0
"""No ``Status`` from the engine for this long (it sends one every 0.1 s): the engine is gone (5 s: a
busy host may delay a broadcast by seconds without anything being wrong)."""
HEARTBEAT_S = 0.5
"""How often a worker says ``Hello`` (the engine forgets a worker silent for 5 s)."""
CLOSE_INTERNAL_ERROR = 1011


class RemoteSlotSession:
    """What ``ChatSession`` needs of its slot, kept in the worker: frames go to the engine.

    Attributes:
        session_id, sampling: as ``runtime.engine.scheduler.SlotSession``.
        first_input_at: monotonic time of the first frame pushed (first-audio latency).
    """

    def __init__(self, session: ChatSession, sampling: SamplingParams, client: EngineClient) -> None:
        self.session = session
        self.session_id = session.session_id
        self.sampling = sampling
        self.client = client
        self.first_input_at: float | None = None
        self.slot = -1

    def push_frame(self, frame: np.ndarray) -> bool:
        """Send one ``[1920]`` float32 frame to the engine; False when it could not be queued."""
        if self.first_input_at is None:
            self.first_input_at = time.monotonic()
        pcm = np.ascontiguousarray(frame, dtype="<f4").tobytes()
        return self.client.send(ipc.Frame(self.session_id, pcm))


class EngineClient:
    """The worker's DEALER socket to the engine and what it last heard from it.

    Args:
        address: the engine's ZeroMQ endpoint.
        worker_id: this worker's identity on the engine's ROUTER.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, address: str, worker_id: str, *, clock=time.monotonic) -> None:  # type: ignore[no-untyped-def]
        self.address = address
        self.worker_id = worker_id
        self._clock = clock
        self.status: ipc.Status | None = None
        self.status_at: float | None = None
        self.sessions: dict[str, RemoteSlotSession] = {}
        self._pending: dict[str, asyncio.Future[int]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.on_engine_lost: list = []  # callables, called once when the engine goes silent
        self.on_first_status: list = []  # callables, called when the engine is first heard (model loaded)

    def start(self) -> None:
        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.DEALER)
        # The pid makes a restarted worker a new peer: the engine ends the dead one's sessions on its own.
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}:{os.getpid()}".encode())
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._heartbeat())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(0)

    @property
    def engine_heard(self) -> bool:
        """A ``Status`` arrived within ``ENGINE_TIMEOUT_S``."""
        return self.status_at is not None and self._clock() - self.status_at < ENGINE_TIMEOUT_S

    @property
    def engine_lost(self) -> bool:
        """The engine was heard once and has been silent for ``ENGINE_TIMEOUT_S`` since."""
        return self.status_at is not None and not self.engine_heard

    def send(self, message: ipc.Message) -> bool:
        """Queue ``message`` without waiting; False when the queue is full (the engine is not reading)."""
        if self._socket is None:
            return False
        try:
            self._socket.send(ipc.encode(message), flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            return False
        return True

    async def admit(
        self,
        remote: RemoteSlotSession,
        voice: str,
        text: str,
        max_inbox_frames: int,
        token: tuple[str, float] = ("", 0.0),
    ) -> int:
        """Ask the engine for a slot and wait for the answer (it may wait in the engine's waiting room).

        Raises:
            NodeFull, WaitingRoomFull, WaitTimeout: as ``SlotAdmission.admit`` in one process.
            AdmissionRefused: the engine refused otherwise (bad_request, draining), or is unreachable.
        """
        sid = remote.session_id
        if not self.engine_heard:
            raise AdmissionRefused("not_ready", "node not ready: the engine is not answering", 1013)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[sid] = future
        self.sessions[sid] = remote
        s = remote.sampling
        sampling = (s.audio_temperature, s.audio_top_k, s.text_temperature, s.text_top_k, s.seed)
        try:
            if not self.send(ipc.Admit(sid, voice, text, sampling, max_inbox_frames, *token)):
                raise AdmissionRefused("not_ready", "node not ready: the engine's queue is full", 1013)
            remote.slot = await future
            return remote.slot
        except BaseException:
            self.release(remote)
            raise
        finally:
            self._pending.pop(sid, None)

    def release(self, remote: RemoteSlotSession) -> None:
        """The session ended or left: the engine frees its slot or its place in the waiting room."""
        if self.sessions.pop(remote.session_id, None) is not None:
            self.send(ipc.Release(remote.session_id))

    async def _heartbeat(self) -> None:
        lost_reported = False
        while True:
            self.send(ipc.Hello(self.worker_id, os.getpid()))
            if self.engine_lost and not lost_reported:
                lost_reported = True
                log.error("worker %s: no word from the engine for %.1f s", self.worker_id, ENGINE_TIMEOUT_S)
                for callback in self.on_engine_lost:
                    callback()
            elif self.engine_heard:
                lost_reported = False
            await asyncio.sleep(HEARTBEAT_S if not self.engine_lost else 0.1)

    async def _receive(self) -> None:
        assert self._socket is not None
        while True:
            data = await self._socket.recv()
            try:
                message = ipc.decode(data)
            except Exception:
                log.exception("worker %s: undecodable message from the engine", self.worker_id)
                continue
            if isinstance(message, ipc.Outputs):
                for sid, pcm, piece in message.items:
                    remote = self.sessions.get(sid)
                    if remote is not None:
                        frame = np.frombuffer(pcm, dtype="<f4") if pcm else None
                        remote.session.on_output(frame, piece or None)
            elif isinstance(message, ipc.Status):
                first = self.status is None
                self.status = message
                self.status_at = self._clock()
                if first:
                    for callback in self.on_first_status:
                        callback()
            elif isinstance(message, ipc.PromptDone):
                remote = self.sessions.get(message.session_id)
                if remote is not None:
                    remote.session.on_prompt_done()
            elif isinstance(message, ipc.Admitted):
                future = self._pending.get(message.session_id)
                if future is not None and not future.done():
                    future.set_result(message.slot)
                elif future is None:  # it left meanwhile: give the slot back
                    self.send(ipc.Release(message.session_id))
            elif isinstance(message, ipc.Refused):
                self.sessions.pop(message.session_id, None)
                future = self._pending.get(message.session_id)
                if future is not None and not future.done():
                    future.set_exception(_refusal(message))


def _refusal(message: ipc.Refused) -> Exception:
    """The exception ``DuplexServer._handle`` expects for an engine's refusal."""
    if message.reason == "waiting_room_full":
        return WaitingRoomFull(message.message.removeprefix("node full: "))
    if message.reason == "wait_timeout":
        return WaitTimeout(message.message.removeprefix("node full: "))
    if message.reason == "node_full":
        return NodeFull(message.message)
    code = 1008 if message.reason in ("bad_request", "replayed") else 1013
    return AdmissionRefused(message.reason, message.message, code)


class WorkerServer(DuplexServer):
    """A front end without the model: :class:`DuplexServer`'s protocol, HTTP and access control, with the
    slots in the engine process.

    Args:
        config: the node's settings (``port`` is shared by every worker through ``SO_REUSEPORT``).
        address: the engine's ZeroMQ endpoint.
        worker_id: a name unique among the node's workers.
        store, metrics: as ``DuplexServer``.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        address: str,
        worker_id: str,
        *,
        store: SessionStore | None = None,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self._init_front_end(config, store, metrics)
        self.client = EngineClient(address, worker_id)
        self.client.on_engine_lost.append(self._engine_lost)
        self.client.on_first_status.append(lambda: self.metrics.loading.set(0))
        self.metrics.loading.set(1)  # until the engine has loaded the model and answers

    # --- the slots, from the engine's Status ----------------------------------------------------------

    @property
    def warm(self) -> bool:  # type: ignore[override]
        return self.client.status is not None

    @warm.setter
    def warm(self, value: bool) -> None:
        pass  # set by the engine's first Status

    @property
    def slots(self) -> int:
        return self.client.status.slots if self.client.status else self.config.max_sessions

    @property
    def free_slots(self) -> int:
        status = self.client.status
        return status.free_slots if status is not None and self.client.engine_heard else 0

    @property
    def tick_alive(self) -> bool:
        status = self.client.status
        return status is not None and self.client.engine_heard and status.tick_alive

    @property
    def voice_names(self) -> list[str]:
        return list(self.client.status.voices) if self.client.status else []

    def health(self) -> tuple[bool, str]:
        if self.client.status is None:
            return True, "loading"
        if not self.client.engine_heard:
            return False, "engine unreachable"
        return (True, "ok") if self.client.status.tick_alive else (False, "tick loop stopped")

    def readiness_json(self) -> dict[str, object]:
        """``/readyz``'s body: the base fields, and the engine's pid and this worker's id."""
        body = super().readiness_json()
        body["worker"] = self.client.worker_id
        body["engine_pid"] = self.client.status.engine_pid if self.client.status else None
        return body

    def readiness(self) -> tuple[bool, str]:
        if self.client.status is None and not self.draining:
            return False, "loading the model"
        if self.client.engine_lost:
            return False, "engine unreachable"
        return super().readiness()

    def _plan_session(self, query: str, text_prompt: str | None = None):  # type: ignore[no-untyped-def]
        """The request, persona and sampling; the prompt is built by the engine (None here), which also
        counts the text prompt's tokens (it alone has the tokenizer). ``text_prompt``: one that came as
        0x04 metadata (``text_prompt_in=metadata``).

        Raises:
            ProtocolError: a bad query parameter; ValueError: a sampling value out of range, or a voice
                this node does not have.
        """
        request = parse_session_query(query)
        if text_prompt is not None:
            request = dataclasses.replace(request, text_prompt=text_prompt)
        voices = self.voice_names
        if request.voice_prompt and self.client.status is not None and request.voice_prompt not in voices:
            raise ValueError(f"unknown voice prompt {request.voice_prompt!r}; this node has: {voices}")
        return (
            request,
            Persona(request.voice_prompt, request.text_prompt),
            None,
            sampling_from_request(request),
        )

    def _slot_session(self, session, prompt, sampling):  # type: ignore[no-untyped-def, override]
        session.remote_query = (session.persona.voice_prompt or "", session.persona.text_prompt or "")
        return RemoteSlotSession(session, sampling, self.client)

    async def _admit(self, slot_session) -> int:  # type: ignore[no-untyped-def, override]
        voice, text = slot_session.session.remote_query
        claims = slot_session.session.claims
        token = ("", 0.0)
        if claims is not None and self._engine_spends_tokens:
            token = (claims.token_id, claims.expires_at)
        return await self.client.admit(slot_session, voice, text, self.config.max_inbox_frames, token)

    @property
    def _engine_spends_tokens(self) -> bool:
        """``replay_check=memory``: one memory for every worker, the engine's (a worker's own would let a
        token be used once per worker)."""
        return self.config.token_replay_check == "memory"

    async def _spend_token(self, claims):  # type: ignore[no-untyped-def, override]
        if self._engine_spends_tokens:
            return None  # spent by the engine when it gave the slot (Refused "replayed" otherwise)
        return await super()._spend_token(claims)

    def _release(self, slot_session) -> None:  # type: ignore[no-untyped-def, override]
        self.client.release(slot_session)

    def _engine_lost(self) -> None:
        """Close this worker's sessions: their slots are gone with the engine."""
        for session in list(self.sessions):
            asyncio.ensure_future(session.connection.close(CLOSE_INTERNAL_ERROR, "engine unreachable"))

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the engine and listen on the shared port (``SO_REUSEPORT``)."""
        self.client.start()
        if self.store is not None:
            await self.store.start()
        self._server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            select_subprotocol=_select_token_subprotocol,
            max_size=self.config.max_message_bytes,
            compression=None,
            logger=ACCESS_LOG,
            reuse_port=True,
            server_header=f"duplex {self.client.worker_id} pid={os.getpid()}",
        )
        self.metrics.ready.set(1)
        # A GCE maintenance notice stops this worker's admissions as in one process (each worker watches).
        self.maintenance = start_maintenance_watch(self.config, self.metrics, self._on_maintenance_notice)
        log.info("worker %s listening on %s:%d", self.client.worker_id, self.config.host, self.port)

    async def close(self) -> None:
        self._stop_maintenance_watch()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        await self.client.close()
        if self.store is not None:
            await self.store.close()
        if self.replay_guard is not None:
            await self.replay_guard.close()


def worker_main(config: RuntimeConfig, address: str, worker_id: str) -> None:
    """Entry point of a worker process (``runtime.multiproc``): serve until SIGTERM, then drain."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s {worker_id} %(name)s: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; Ctrl-C reaches it
    from runtime.child_process import die_with_parent
    from runtime.frontend.server import build_store

    die_with_parent()

    metrics = RuntimeMetrics()
    server = WorkerServer(config, address, worker_id, store=build_store(config, metrics), metrics=metrics)

    async def main() -> None:
        await server.start()
        await server.serve_until_signal()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
