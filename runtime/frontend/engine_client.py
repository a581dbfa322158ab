"""The slot backend over ZeroMQ (``duplex serve --workers N``): a worker's DEALER socket to the engine process
(``runtime.engine.engine_core.EngineCore``), ``runtime.engine.api.SlotBackend`` for the front end. vLLM
v1's multi-process ``EngineCoreClient`` (``vllm/v1/engine/core_client.py``).

It asks the engine for a slot (``Admit``), streams a session's frames to it (``Frame``), gets one ``Outputs``
message per tick back, and reports the slots from the engine's last ``Status``:

- no ``Status`` yet (the model still loads): not loaded (``/healthz`` 200 ``loading``, ``/readyz`` 503);
- the engine's socket disconnected (ZeroMQ's socket monitor sees the engine process exit at once), or no
  ``Status`` for ``ENGINE_TIMEOUT_S`` (a hung engine): lost, and ``on_lost`` is called once (the front end
  closes its sessions with 1011 and ``/healthz`` answers 500 ``engine unreachable``).

Torch-free: a worker process imports neither torch nor the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from runtime import ipc
from runtime.engine.api import (
    REFUSAL_REASONS,
    AdmitRequest,
    BackendStatus,
    FirstAudioTiming,
    FrameFormat,
    Refusal,
    ResumeGrant,
    SessionSink,
    SlotBackend,
    SlotLease,
)
from runtime.engine.persona_limits import voice_name

__all__ = ["ENGINE_TIMEOUT_S", "HEARTBEAT_S", "EngineClient"]

log = logging.getLogger(__name__)

ENGINE_TIMEOUT_S = 5.0
"""No ``Status`` from the engine for this long (it sends one every 0.1 s): the engine hangs (5 s: a busy
host may delay a broadcast by seconds without anything being wrong). An engine that exits is seen at once
through the socket monitor instead."""
HEARTBEAT_S = 0.5
"""How often a worker says ``Hello`` (the engine forgets a worker silent for 5 s)."""
NOT_ANSWERING = "node not ready: the engine is not answering"
HANGUP_TIMEOUT_S = 5.0
"""Longest wait for another worker's answer to a hang-up (``runtime.ipc.Hangup``): none means not ended."""


class EngineClient(SlotBackend):
    """A worker's connection to the engine's slots.

    Args:
        address: the engine's ZeroMQ endpoint.
        worker_id: this worker's identity on the engine's ROUTER.
        slots: the node's slots (``max_sessions``), reported until the engine's first ``Status``.
        spends_tokens: the engine spends tokens (``DUPLEX_TOKEN_REPLAY_CHECK=memory``: one memory per node).
        max_inbox_frames: sent with each ``Admit`` (the engine bounds the session's input).
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        address: str,
        worker_id: str,
        *,
        slots: int = 0,
        spends_tokens: bool = False,
        max_inbox_frames: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.worker_id = worker_id
        self.spends_tokens = spends_tokens
        self.on_lost = []
        self.on_loaded: Callable[[], None] | None = None
        """Called once, when the engine is first heard (its model is loaded)."""
        self._slots = slots
        self._max_inbox_frames = max_inbox_frames
        self._clock = clock
        self.status_message: ipc.Status | None = None
        self.status_at: float | None = None
        self.disconnected = False
        self._lost_reported = False
        self._sinks: dict[str, SessionSink] = {}
        self._pending: dict[str, asyncio.Future[tuple[int, str]]] = {}
        self._resuming: dict[str, asyncio.Future[ipc.Resumed]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._hangups: dict[int, asyncio.Future[bool]] = {}
        self._hangup_ids = 0
        self._spends: dict[int, asyncio.Future[bool]] = {}

    # --- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.DEALER)
        # The pid makes a restarted worker a new peer: the engine ends the dead one's sessions on its own.
        sock.setsockopt(zmq.IDENTITY, f"{self.worker_id}:{os.getpid()}".encode())
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._socket = sock
        self._tasks = [
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._monitor(monitor)),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._socket.close(0)
            self._socket = None

    # --- state ----------------------------------------------------------------------------------------

    @property
    def engine_heard(self) -> bool:
        """A ``Status`` arrived within ``ENGINE_TIMEOUT_S`` and the socket has not disconnected since."""
        return (
            self.status_at is not None
            and not self.disconnected
            and self._clock() - self.status_at < ENGINE_TIMEOUT_S
        )

    @property
    def engine_lost(self) -> bool:
        """The engine was heard once and is gone since (socket disconnected, or silent)."""
        return self.status_at is not None and not self.engine_heard

    def status(self) -> BackendStatus:
        message = self.status_message
        heard = self.engine_heard
        detail: dict[str, object] = {
            "worker": self.worker_id,
            "engine_pid": message.engine_pid if message is not None else None,
        }
        if message is None:
            return BackendStatus(False, self._slots, 0, 0, False, detail=detail)
        return BackendStatus(
            loaded=True,
            slots=message.slots,
            free_slots=message.free_slots if heard else 0,
            waiting=message.waiting,
            tick_alive=heard and message.tick_alive,
            lost=not heard,
            voices=tuple(message.voices),
            voices_refused=tuple(message.voices_refused),
            detail=detail,
            frame=FrameFormat(message.frame_sample_rate_hz, message.frame_samples),
        )

    def check_persona(self, voice_prompt: str | None, text_prompt: str | None) -> None:
        """The voice against the engine's list (the engine, which alone has the tokenizer, counts the text
        prompt's tokens at admission and refuses ``bad_request`` past the limit)."""
        if voice_prompt and self.status_message is not None:
            voices = self.status_message.voices
            # the words of runtime.engine.voices.VoiceCatalog.get, which takes NVIDIA's NATF2.pt as NATF2
            if voice_prompt not in voices and voice_name(voice_prompt) not in voices:
                known = ", ".join(sorted(voices)) or "none on this node"
                raise ValueError(f"unknown voice_prompt {voice_prompt!r}; voices on this node: {known}")

    # --- sessions -------------------------------------------------------------------------------------

    def send(self, message: ipc.Message) -> bool:
        """Queue ``message`` without waiting; False when the queue is full (the engine is not reading)."""
        if self._socket is None:
            return False
        try:
            self._socket.send(ipc.encode(message), flags=zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            return False
        return True

    async def admit(self, request: AdmitRequest, sink: SessionSink) -> SlotLease:
        sid = request.session_id
        if not self.engine_heard:
            raise Refusal("not_ready", NOT_ANSWERING)
        future: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self._pending[sid] = future
        self._sinks[sid] = sink
        lease = SlotLease(sid)
        message = ipc.Admit(
            sid,
            request.voice_prompt or "",
            request.text_prompt or "",
            request.sampling.as_tuple(),
            self._max_inbox_frames,
            request.token_id,
            request.token_expires_at,
            request.client,
            request.resumable,
            request.meta,
        )
        try:
            if not self.send(message):
                raise Refusal("not_ready", "node not ready: the engine's queue is full")
            lease.slot, lease.resume_credential = await future
            return lease
        except BaseException:
            self.release(lease)
            raise
        finally:
            self._pending.pop(sid, None)

    def push_frame(self, lease: SlotLease, frame: np.ndarray) -> bool:
        if lease.first_input_at is None:
            lease.first_input_at = time.monotonic()
        pcm = np.ascontiguousarray(frame, dtype="<f4").tobytes()
        return self.send(ipc.Frame(lease.session_id, pcm))

    def release(self, lease: SlotLease) -> None:
        if self._sinks.pop(lease.session_id, None) is not None:
            self.send(ipc.Release(lease.session_id))

    async def hang_up(self, session_id: str, key: str) -> bool:
        """Through the engine, to the worker holding ``session_id`` (``runtime.ipc.Hangup``); False when no
        worker holds it, the key is wrong, or no answer comes within ``HANGUP_TIMEOUT_S``."""
        self._hangup_ids += 1
        request_id = self._hangup_ids
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._hangups[request_id] = future
        try:
            if not self.send(ipc.Hangup(request_id, session_id, key)):
                return False
            async with asyncio.timeout(HANGUP_TIMEOUT_S):
                return await future
        except TimeoutError:
            return False
        finally:
            self._hangups.pop(request_id, None)

    async def spend_token(self, token_id: str, expires_at: float, check_only: bool = False) -> bool:
        """Through the engine, which keeps the node's spent tokens (``runtime.ipc.SpendToken``).

        Raises:
            Refusal: ``not_ready`` when the engine does not answer within ``HANGUP_TIMEOUT_S``.
        """
        self._hangup_ids += 1
        request_id = self._hangup_ids
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._spends[request_id] = future
        try:
            if not self.send(ipc.SpendToken(request_id, token_id, expires_at, check_only)):
                raise Refusal("not_ready", "node not ready: the engine's queue is full")
            async with asyncio.timeout(HANGUP_TIMEOUT_S):
                return await future
        except TimeoutError:
            raise Refusal("not_ready", NOT_ANSWERING) from None
        finally:
            self._spends.pop(request_id, None)

    def _hangup_asked(self, message: ipc.Hangup) -> None:
        """Another worker asks this one to end one of its sessions: answer whether it did."""
        handler = self.on_hangup
        ended = handler is not None and handler(message.session_id, message.key)
        self.send(ipc.HangupResult(message.request_id, message.session_id, ended, message.requester))

    def detach(self, lease: SlotLease) -> bool:
        """Ask the engine to hold the slot (its sink stays, for ``HoldExpired``); False when the session is
        not resumable (it was issued no credential)."""
        if not lease.resume_credential or lease.session_id not in self._sinks:
            return False
        return self.send(ipc.Detach(lease.session_id))

    async def resume(self, credential: str, sink: SessionSink, client: str = "") -> ResumeGrant:
        """The engine checks ``credential`` and points the slot at this worker; a session this worker held
        itself is told ``on_taken_over`` here (the engine tells another worker with ``Moved``)."""
        if not self.engine_heard:
            raise Refusal("not_ready", NOT_ANSWERING)
        ref = uuid.uuid4().hex
        future: asyncio.Future[ipc.Resumed] = asyncio.get_running_loop().create_future()
        self._resuming[ref] = future
        try:
            if not self.send(ipc.Resume(ref, credential, client)):
                raise Refusal("not_ready", "node not ready: the engine's queue is full")
            got = await future
        except asyncio.CancelledError:  # the caller left: a slot already handed here is held again
            if future.done() and not future.cancelled() and future.exception() is None:
                self.send(ipc.Detach(future.result().session_id))
            raise
        finally:
            self._resuming.pop(ref, None)
        previous = self._sinks.get(got.session_id)
        self._sinks[got.session_id] = sink
        if previous is not None and previous is not sink:
            previous.on_taken_over()
        lease = SlotLease(got.session_id, got.slot, resume_credential=got.credential)
        return ResumeGrant(lease, got.gap_s, got.meta, got.transcript)

    # --- engine -> worker -----------------------------------------------------------------------------

    def _report_lost(self, why: str) -> None:
        if self._lost_reported:
            return
        self._lost_reported = True
        log.error("worker %s: engine lost (%s)", self.worker_id, why)
        futures: list[asyncio.Future[Any]] = [*self._pending.values(), *self._resuming.values()]
        for future in futures:
            if not future.done():
                future.set_exception(Refusal("engine_lost", NOT_ANSWERING))
        for callback in self.on_lost:
            callback()

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        """ZeroMQ's socket monitor: the engine's socket closed (its process exited) is seen at once."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.status_at is not None:
                    self.disconnected = True
                    self._report_lost("its socket disconnected")
        finally:
            monitor.close(0)

    async def _heartbeat(self) -> None:
        while True:
            self.send(ipc.Hello(self.worker_id, os.getpid()))
            if self.engine_lost:
                self._report_lost(f"no word from it for {ENGINE_TIMEOUT_S:g} s")
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
                    sink = self._sinks.get(sid)
                    if sink is not None:
                        frame = np.frombuffer(pcm, dtype="<f4") if pcm else None
                        sink.on_output(frame, piece or None)
            elif isinstance(message, ipc.Status):
                if self.status_message is None and self.on_loaded is not None:
                    self.on_loaded()
                self.status_message = message
                self.status_at = self._clock()
                if not self.disconnected:
                    self._lost_reported = False
            elif isinstance(message, ipc.FirstAudio):
                sink = self._sinks.get(message.session_id)
                if sink is not None:
                    sink.on_first_audio(
                        FirstAudioTiming(
                            message.arrived_at,
                            message.taken_at,
                            message.ticks,
                            message.audio_tick_at,
                            message.audio_tick_end,
                        )
                    )
            elif isinstance(message, ipc.PromptDone):
                sink = self._sinks.get(message.session_id)
                if sink is not None:
                    sink.on_prompt_done()
            elif isinstance(message, ipc.Admitted):
                future = self._pending.get(message.session_id)
                if future is not None and not future.done():
                    future.set_result((message.slot, message.credential))
                elif future is None:  # it left meanwhile: give the slot back
                    self.send(ipc.Release(message.session_id))
            elif isinstance(message, ipc.Hangup):
                self._hangup_asked(message)
            elif isinstance(message, ipc.HangupResult):
                waiting = self._hangups.get(message.request_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(message.ended)
            elif isinstance(message, ipc.TokenSpent):
                spending = self._spends.get(message.request_id)
                if spending is not None and not spending.done():
                    spending.set_result(message.fresh)
            elif isinstance(message, ipc.Refused):
                reason = message.reason if message.reason in REFUSAL_REASONS else "not_ready"
                resuming = self._resuming.get(message.session_id)  # a resume's Refused names its ref
                if resuming is not None:
                    if not resuming.done():
                        resuming.set_exception(Refusal(reason, message.message))
                    continue
                self._sinks.pop(message.session_id, None)
                future = self._pending.get(message.session_id)
                if future is not None and not future.done():
                    future.set_exception(Refusal(reason, message.message))
            elif isinstance(message, ipc.Resumed):
                resumed = self._resuming.get(message.ref)
                if resumed is not None and not resumed.done():
                    resumed.set_result(message)
                elif resumed is None:  # the caller left meanwhile: hold the slot again for another try
                    self.send(ipc.Detach(message.session_id))
            elif isinstance(message, (ipc.Moved, ipc.HoldExpired)):
                sink = self._sinks.pop(message.session_id, None)
                if sink is not None:
                    if isinstance(message, ipc.Moved):
                        sink.on_taken_over()
                    else:
                        sink.on_hold_expired()
