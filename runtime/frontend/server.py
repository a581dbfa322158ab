"""The WebSocket server: Kyutai's wire protocol on ``/api/chat``, health, readiness and metrics over HTTP.

It speaks the protocol and knows nothing of tensors: frames go to the slot scheduler, frames and text
come back from it. One :class:`ChatSession` per connection. Endpoints:

- ``GET /api/chat`` (WebSocket): a conversation. Query parameters:
  see :func:`runtime.frontend.protocol.parse_session_query`.
  Access check first, before the upgrade (``process_request``), so no WebSocket is opened, no slot is
  taken and nginx and clients see a plain HTTP status: the ``Origin`` header against
  ``DUPLEX_ALLOWED_ORIGINS`` (403), then, with ``DUPLEX_AUTH_MODE=token``, the session token from the
  ``token`` query parameter or the ``Sec-WebSocket-Protocol`` ``duplex.token.<jwt>`` (which the server then
  selects, as browsers require): 401 for a missing or invalid token, 403 for a replayed one or a voice
  prompt it does not allow, 503 when the replay check cannot be made (``runtime.frontend.tokens``).
  Later refusals happen after the upgrade, as a 0x05 error message naming the reason, then a close code:
  1013 (try again later) when the node is full or draining, 1008 (policy) for a bad request.
  A client's 0x06 ping is echoed back unchanged (clients time the round trip with it).
- ``GET /api/admission``: the same checks as ``/api/chat`` (origin, token, persona, replay, request, drain,
  capacity), made without spending the token or taking a slot, answered as JSON
  ``{"ok", "status", "reason", "message"}`` (:class:`Admission`). A browser cannot read the HTTP status of
  a refused WebSocket upgrade (it sees close code 1006 only): the web client asks here why. The token comes
  as ``Authorization: Bearer <jwt>`` (or ``?token=``), the origin from the ``Origin`` header, else from an
  ``origin`` query parameter (browsers send no ``Origin`` on a same-origin GET). Advisory only: it grants
  nothing, and a slot free now may be taken before the upgrade.
- ``GET /api/personas``: the voice prompts this node has (``voices_dir``) and the text prompt's limit
  (``runtime.frontend.protocol.TEXT_PROMPT_LIMIT``: characters and tokens), JSON.
- A long text prompt need not go in the URL: with ``text_prompt_in=metadata`` the client's first message
  is a 0x04 metadata object ``{"text_prompt": "..."}`` (within ``METADATA_PROMPT_TIMEOUT_S``), checked
  against the same limit; the slot is taken only once it has arrived.
- ``GET /healthz``: 200 while the process and its tick thread are alive.
- While the model loads (``loading_status``, minutes for a 7B model) the same address answers already:
  ``/healthz`` 200 ``loading``, ``/readyz`` 503 ``{"ready": false, "reason": "loading the model"}``,
  ``/metrics`` with ``duplex_loading 1``, ``/api/admission`` ``not_ready``, everything else 503: probes
  and Prometheus see a live process that is not ready yet, not a refused connection.
- ``GET /readyz``: 200 when the model is loaded and warm, a slot is free and the node is not draining;
  503 with a JSON reason otherwise.
- ``GET /metrics``: Prometheus text format.

Drain (SIGTERM): ``/readyz`` turns 503, new sessions are refused, running ones may finish until the grace
period ends, then they are closed with 1001 (going away). A GCE host-maintenance notice
(``DUPLEX_MAINTENANCE_WATCH=gce``, :mod:`runtime.frontend.maintenance`) does the first two without closing
anything,
and is undone when the notice clears.

Guards (issue 16): every route answers GET only (405 with ``Allow`` otherwise); upgrades and admission checks
pass per-client and global handshake rate limits first (429, ``runtime.frontend.ratelimit``); ``/metrics`` is
rendered at most once per ``metrics_cache_s``; websockets' access lines are at DEBUG (``runtime.access``).
A caller is read (and its audio dropped) until its handshake, so one that leaves while it waits for a slot
(the waiting room, ``runtime.engine.waiting_room``) or while its persona prompt runs gives its place back at
once;
its token is spent only when it gets its slot. :class:`DuplexServer` holds the model in its process; with
``--workers N`` the same front end runs in worker processes without it (``runtime.frontend.worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
import secrets
import signal
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import parse_qs, urlsplit

import numpy as np
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

from runtime.config import RuntimeConfig
from runtime.engine.batch import PromptStep
from runtime.engine.models import ModelBundle
from runtime.engine.persona import Persona, PersonaError, VoiceCatalog, build_prompt
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import NodeFull, SlotScheduler, SlotSession
from runtime.engine.sim import make_engine
from runtime.engine.waiting_room import SlotAdmission, WaitingRoomFull, WaitTimeout, open_slots
from runtime.frontend.audio_codec import make_codec
from runtime.frontend.maintenance import MaintenanceWatcher, start_maintenance_watch
from runtime.frontend.protocol import (
    TEXT_PROMPT_IN_METADATA,
    TEXT_PROMPT_MAX_CHARS,
    TEXT_PROMPT_MAX_TOKENS,
    VOICE_PROMPT_MAX_CHARS,
    AudioMessage,
    MetadataMessage,
    PingMessage,
    ProtocolError,
    SessionRequest,
    encode_audio,
    encode_error,
    encode_handshake,
    encode_ping,
    encode_text,
    parse_client_message,
    parse_prompt_metadata,
    parse_session_query,
)
from runtime.frontend.ratelimit import HandshakeLimiter, RateLimited
from runtime.frontend.session_store import SessionRecord, SessionStore
from runtime.frontend.tokens import (
    REFUSAL_STATUS,
    SUBPROTOCOL_PREFIX,
    MemoryReplayGuard,
    RedisReplayGuard,
    ReplayGuard,
    TokenClaims,
    TokenRejected,
    TokenVerifier,
)
from runtime.metrics import PROMETHEUS_CONTENT_TYPE, RuntimeMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

CHAT_PATH = "/api/chat"
ADMISSION_PATH = "/api/admission"
PERSONAS_PATH = "/api/personas"
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN_LATER = 1013
PROMPT_TIMEOUT_S = 120.0
"""Longest wait for a persona prompt to be fed before the handshake."""
METADATA_PROMPT_TIMEOUT_S = 10.0
"""With ``text_prompt_in=metadata``: longest wait for the 0x04 message carrying the text prompt."""
_FATAL_PROTOCOL_REASONS = frozenset({"bad_opus"})
"""Errors after which the session's input cannot recover: the session is closed (1008)."""
DRAINING_MESSAGE = "node is draining for shutdown; connect to another node"
"""The 0x05 reason sent to a session refused while the node drains (and the admission check's message)."""
ADMISSION_REASONS: tuple[str, ...] = (
    "ok",
    *REFUSAL_STATUS,
    "bad_request",
    "draining",
    "not_ready",
    "node_full",
    "rate_limited",
)
"""Every ``reason`` :class:`Admission` can carry: ``ok``, the token and origin refusals of
``runtime.frontend.tokens.REFUSAL_STATUS``, and the refusals made after the upgrade."""


LOADING_MESSAGE = "node is loading the model; try again in a few minutes"
"""What every request but the probes gets while the model loads."""
ROUTES: dict[str, tuple[str, ...]] = {
    CHAT_PATH: ("GET",),
    ADMISSION_PATH: ("GET",),
    PERSONAS_PATH: ("GET",),
    "/healthz": ("GET",),
    "/readyz": ("GET",),
    "/metrics": ("GET",),
}
"""Every HTTP route and its methods: another method gets 405 with ``Allow`` (RFC 9110, 15.5.6)."""


class _AccessLog(logging.LoggerAdapter):
    """websockets' per-connection logger with its INFO lines ("connection rejected (200 OK)", "connection
    open", "connection closed") moved to DEBUG: one line per HTTP request wrote 8 MB in 22 minutes under
    test (issue 16). Warnings and errors pass unchanged."""

    def log(self, level: int, msg: object, *args: object, **kwargs: object) -> None:
        level = logging.DEBUG if level == logging.INFO else level
        super().log(level, msg, *args, **kwargs)  # type: ignore[arg-type]


ACCESS_LOG = _AccessLog(logging.getLogger("runtime.access"), {})
"""The logger given to ``websockets.serve``: enable DEBUG on ``runtime.access`` to see every request."""


def node_full_message(slots: int) -> str:
    """The 0x05 reason sent to a session refused because all ``slots`` are in use."""
    return f"node full: all {slots} slots in use (max_sessions={slots}); try again later"


class AdmissionRefused(Exception):
    """A session refused by the slots' owner for a reason other than a full node (the engine process of
    ``--workers N`` refusing a bad persona, or draining, or not answering).

    Attributes:
        reason: the metric label and the admission reason (``bad_request``, ``draining``, ``not_ready``).
        message: the 0x05 error's sentence.
        close_code: 1008 for a bad request, 1013 otherwise.
    """

    def __init__(self, reason: str, message: str, close_code: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.close_code = close_code


@dataclass(frozen=True)
class Admission:
    """What ``GET /api/admission`` answers: would ``/api/chat`` with this query, token and origin open a
    session now, and if not, why (the same words the refusal itself would carry).

    Attributes:
        ok: a session would be admitted now.
        status: the HTTP status equivalent: 200 when ok; the upgrade's own 401/403/503 for a token or origin
            refusal (``runtime.frontend.tokens.REFUSAL_STATUS``); 400 for a bad request (refused after the
            upgrade
            with close code 1008); 503 for a full, draining or not-ready node (close code 1013).
        reason: one of :data:`ADMISSION_REASONS` (snake_case, stable: clients map it to their own words).
        message: the runtime's sentence.
    """

    ok: bool
    status: int
    reason: str
    message: str

    def as_json(self) -> bytes:
        """The JSON body, UTF-8, newline-terminated."""
        body = {"ok": self.ok, "status": self.status, "reason": self.reason, "message": self.message}
        return (json.dumps(body) + "\n").encode()


def sampling_from_request(request: SessionRequest) -> SamplingParams:
    """The session's sampling settings: its query values where given, moshi's defaults elsewhere, and a
    random seed when the session names none.

    Raises:
        ValueError: a value out of range (the message names it).
    """
    defaults = SamplingParams()
    return SamplingParams(
        audio_temperature=defaults.audio_temperature
        if request.audio_temperature is None
        else request.audio_temperature,
        audio_top_k=defaults.audio_top_k if request.audio_topk is None else request.audio_topk,
        text_temperature=defaults.text_temperature
        if request.text_temperature is None
        else request.text_temperature,
        text_top_k=defaults.text_top_k if request.text_topk is None else request.text_topk,
        seed=secrets.randbelow(2**31) if request.seed is None else request.seed,
    )


@dataclass
class SessionOutcome:
    """How a session ended, for logs, metrics and the registry."""

    reason: str
    close_code: int = CLOSE_NORMAL


class ChatSession:
    """One admitted conversation: its socket, codecs, slot and outbound queue."""

    def __init__(
        self, server: DuplexServer, connection: ServerConnection, request: SessionRequest, persona: Persona
    ):
        self.server = server
        self.connection = connection
        self.request = request
        self.persona = persona
        self.session_id = uuid.uuid4().hex
        config = server.config
        self.assembler, self.encoder = make_codec(
            request.format,
            config.max_inbox_frames,
            opus_encoder=config.opus_encoder,
            opus_complexity=config.opus_complexity,
        )
        self.outbox: asyncio.Queue[tuple[np.ndarray | None, str | None]] = asyncio.Queue(
            config.max_outbox_frames
        )
        self.ready = asyncio.Event()
        self.first_audio_sent = False
        self.frames_in = 0
        self.frames_out = 0
        self.slot_session: SlotSession | None = None
        self.claims: TokenClaims | None = None

    @property
    def max_session_s(self) -> float:
        """The node's longest session, or the token's ``max_session_s`` when shorter."""
        limit = self.server.config.max_session_s
        if self.claims is not None and self.claims.max_session_s is not None:
            limit = min(limit, self.claims.max_session_s)
        return limit

    # Called on the event loop by the scheduler (via call_soon_threadsafe).
    def on_output(self, pcm: np.ndarray | None, piece: str | None) -> None:
        if self.outbox.full():
            self.outbox.get_nowait()
            self.server.metrics.frames_dropped.labels(reason="slow_client").inc()
        self.outbox.put_nowait((pcm, piece))

    def on_prompt_done(self) -> None:
        self.ready.set()

    async def send_loop(self) -> None:
        metrics = self.server.metrics
        store = self.server.store
        while True:
            pcm, piece = await self.outbox.get()
            if pcm is not None:
                payload = self.encoder.encode(pcm)
                if not self.first_audio_sent and self.slot_session and self.slot_session.first_input_at:
                    self.first_audio_sent = True
                    metrics.first_audio_latency.observe(time.monotonic() - self.slot_session.first_input_at)
                self.frames_out += 1
                if payload:
                    await self.connection.send(encode_audio(payload))
            if piece is not None:
                await self.connection.send(encode_text(piece))
                if store is not None:  # after the send: the transcript holds what the client was sent
                    store.append_transcript(self.session_id, piece)

    async def receive_loop(self) -> SessionOutcome:
        """Read client messages until the client leaves; frames go to the slot's inbox."""
        metrics = self.server.metrics
        assert self.slot_session is not None
        async for message in self.connection:
            try:
                parsed = parse_client_message(message, max_message_bytes=self.server.config.max_message_bytes)
                if isinstance(parsed, PingMessage):
                    # Echoed unchanged: the client times the round trip (the web client shows it in ms).
                    await self.connection.send(encode_ping(parsed.payload))
                    continue
                if not isinstance(parsed, AudioMessage):
                    continue  # control and metadata carry nothing the batch needs
                if not self.ready.is_set():
                    continue  # audio before the handshake is dropped, as moshi's server does
                for frame in self.assembler.push(parsed.payload):
                    self.frames_in += 1
                    if not self.slot_session.push_frame(frame):
                        metrics.frames_dropped.labels(reason="input_overflow").inc()
            except ProtocolError as exc:
                metrics.protocol_errors.labels(reason=exc.reason).inc()
                if exc.reason == "too_fast":
                    metrics.frames_dropped.labels(reason="input_overflow").inc()
                await self.connection.send(encode_error(f"{exc.reason}: {exc}"))
                if exc.reason in _FATAL_PROTOCOL_REASONS:
                    return SessionOutcome(f"protocol_{exc.reason}", CLOSE_POLICY)
        return SessionOutcome("client_closed")


class DuplexServer:
    """The batched runtime's server: one model copy, ``config.max_sessions`` slots.

    Args:
        config: validated settings.
        bundle: the loaded models (see :func:`runtime.engine.models.load_model`).
        store: the Redis session store, or None to run without one.
        metrics: metrics registry; a fresh one by default.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        bundle: ModelBundle,
        *,
        store: SessionStore | None = None,
        metrics: RuntimeMetrics | None = None,
    ) -> None:
        self.bundle = bundle
        self.voices = VoiceCatalog.load(config.voices_dir, bundle.mimi)
        self.engine = make_engine(
            config.model, bundle, config.max_sessions, config.sim_step_ms, prefill=config.prompt_prefill
        )
        self.scheduler: SlotScheduler | None = None
        self.slot_admission: SlotAdmission | None = None
        self._init_front_end(config, store, metrics)

    def _init_front_end(
        self, config: RuntimeConfig, store: SessionStore | None, metrics: RuntimeMetrics | None
    ) -> None:
        """What every front end holds, with or without the model in its process."""
        self.config = config
        self.store = store
        self.metrics = metrics or RuntimeMetrics()
        self.sessions: set[ChatSession] = set()
        self.draining = False
        self.warm = False
        self.maintenance: MaintenanceWatcher | None = None
        self._server: Server | None = None
        self.verifier: TokenVerifier | None = None
        self.replay_guard: ReplayGuard | None = None
        if config.auth_mode == "token":
            config.check_access_control()
            self.verifier = TokenVerifier(config.signing_keys(), config.token_audience, config.token_leeway_s)
            self.replay_guard = _replay_guard(config, self.metrics)
        # The claims of each admitted handshake, from process_request to the session's handler.
        self._claims: weakref.WeakKeyDictionary[ServerConnection, TokenClaims] = weakref.WeakKeyDictionary()
        self.limiter = HandshakeLimiter(
            per_client_rate=config.handshake_rate_per_client,
            per_client_burst=config.handshake_burst_per_client,
            global_rate=config.handshake_rate_global,
            global_burst=config.handshake_burst_global,
        )
        self._trusted_proxies = [ipaddress.ip_network(c, strict=False) for c in config.trusted_proxies]
        self._metrics_cache: tuple[float, bytes] | None = None

    # --- lifecycle ------------------------------------------------------------------------------------

    def warm_up(self, frames: int = 4) -> None:
        """Run ``frames`` silent ticks through slot 0, then free it, and every prefill chunk size once:
        first-call costs leave the hot path."""
        self.engine.warm_up_prefill()
        self.engine.join(0, SamplingParams())
        silence = np.zeros((self.engine.slots, 1920), dtype=np.float32)
        for _ in range(frames + 1):
            self.engine.tick(silence)
        self.engine.leave(0)
        self.warm = True

    async def start(self) -> None:
        """Warm the model, start the tick thread and the store, and listen."""
        if not self.warm:
            await asyncio.to_thread(self.warm_up)
        loop = asyncio.get_running_loop()
        self.slot_admission = open_slots(
            self.engine,
            self.bundle.text_tokenizer,
            self.metrics,
            loop,
            wait_s=self.config.waiting_room_s,
            max_waiting=self.config.waiting_room_size,
        )
        self.scheduler = self.slot_admission.scheduler
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
        )
        self.metrics.ready.set(1)
        self.maintenance = start_maintenance_watch(self.config, self.metrics, self._on_maintenance_notice)
        log.info("listening on %s:%d with %d slots", self.config.host, self.port, self.slots)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop admitting, let running sessions go on for ``grace_s`` (default the config's), then close
        the rest with 1001 and stop listening."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self._stop_maintenance_watch()  # a SIGTERM drain is final: a cleared notice must not undo it
        self.draining = True
        self.metrics.draining.set(1)
        self.metrics.ready.set(0)
        log.info("draining: %d sessions, grace %.1f s", len(self.sessions), grace)
        deadline = time.monotonic() + grace
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.gather(
            *(s.connection.close(CLOSE_GOING_AWAY, "server draining") for s in list(self.sessions)),
            return_exceptions=True,
        )
        while self.sessions and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)
        await self.close()

    async def close(self) -> None:
        """Stop listening, stop the tick thread, flush the store."""
        self._stop_maintenance_watch()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)
        if self.store is not None:
            await self.store.close()
        if self.replay_guard is not None:
            await self.replay_guard.close()

    def _on_maintenance_notice(self, pending: bool) -> None:
        """A host maintenance notice (True) stops admissions as a drain does, live sessions go on; its end
        (False) admits again. Called on the loop by
        :class:`runtime.frontend.maintenance.MaintenanceWatcher`."""
        self.draining = pending
        self.metrics.draining.set(int(pending))
        self.metrics.ready.set(int(not pending))

    def _stop_maintenance_watch(self) -> None:
        if self.maintenance is not None:
            self.maintenance.stop()
            self.maintenance = None

    async def serve_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, then drain."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.drain()

    # --- HTTP -----------------------------------------------------------------------------------------

    # --- what the front end asks of the slots' owner (runtime.frontend.worker overrides these)
    # ---------------------

    @property
    def slots(self) -> int:
        """B, the node's slots."""
        return self.engine.slots

    @property
    def free_slots(self) -> int:
        """Slots free now (0 before the tick loop starts)."""
        return self.scheduler.free_slots if self.scheduler is not None else 0

    @property
    def tick_alive(self) -> bool:
        """The tick loop runs."""
        return self.scheduler is not None and self.scheduler.alive

    @property
    def voice_names(self) -> list[str]:
        return self.voices.names

    def health(self) -> tuple[bool, str]:
        """(healthy, text): what ``/healthz`` answers (200 or 500)."""
        return (True, "ok") if self.tick_alive else (False, "tick loop stopped")

    def _slot_session(
        self, session: ChatSession, prompt: list[PromptStep] | None, sampling: SamplingParams
    ) -> SlotSession:
        """The scheduler's view of ``session``."""
        return SlotSession(
            session.session_id,
            sampling,
            prompt or [],
            on_output=session.on_output,
            on_prompt_done=session.on_prompt_done,
            max_inbox_frames=self.config.max_inbox_frames,
        )

    async def _admit(self, slot_session: SlotSession) -> int:
        """A slot for ``slot_session`` (see ``SlotAdmission.admit``, its errors included)."""
        assert self.slot_admission is not None
        return await self.slot_admission.admit(slot_session)

    def _release(self, slot_session: SlotSession) -> None:
        assert self.scheduler is not None
        self.scheduler.release(slot_session)

    def readiness_json(self) -> dict[str, object]:
        """``/readyz``'s JSON body: ``{"ready", "reason"}``."""
        ready, reason = self.readiness()
        return {"ready": ready, "reason": reason}

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): what ``/readyz`` answers."""
        if self.draining:
            return False, "draining"
        if not self.warm:
            return False, "warming up"
        if not self.tick_alive:
            return False, "tick loop stopped"
        free = self.free_slots
        if free == 0:
            return False, f"node full: {self.slots} of {self.slots} slots in use"
        return True, f"{free} of {self.slots} slots free"

    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        methods = ROUTES.get(path)
        if methods is None:
            return connection.respond(404, f"no route {path}; try {', '.join(ROUTES)}\n")
        if request.method not in methods:
            response = connection.respond(405, f"{request.method} is not allowed on {path}\n")
            response.headers["Allow"] = ", ".join(methods)
            return response
        if path in (CHAT_PATH, ADMISSION_PATH):
            # First, before any work (token verify, Redis, persona): the handshake rate limits.
            limited = self.limiter.check(self.client_address(connection))
            if limited is not None:
                return self._refuse_rate_limited(connection, limited, as_admission=path == ADMISSION_PATH)
        if path == CHAT_PATH:
            try:
                await self._check_access(connection, request)
            except TokenRejected as exc:
                return self._refuse_handshake(connection, exc)
            return None
        if path == ADMISSION_PATH:
            admission = await self.admission(request)
            return _response(200, admission.as_json(), "application/json", cache_control="no-store")
        if path == PERSONAS_PATH:
            return _response(200, self.personas_json(), "application/json", cache_control="no-cache")
        if path == "/healthz":
            healthy, text = self.health()
            return connection.respond(200 if healthy else 500, text + "\n")
        if path == "/readyz":
            body_json = self.readiness_json()
            body = json.dumps(body_json) + "\n"
            return _response(200 if body_json["ready"] else 503, body.encode(), "application/json")
        assert path == "/metrics"
        return _response(200, self.render_metrics(), PROMETHEUS_CONTENT_TYPE)

    def render_metrics(self, now: float | None = None) -> bytes:
        """``GET /metrics``: the registry's text, rendered at most once per ``config.metrics_cache_s``
        (a scrape flood costs one rendering per period, not one per request)."""
        now = time.monotonic() if now is None else now
        cached = self._metrics_cache
        if cached is not None and now - cached[0] < self.config.metrics_cache_s:
            return cached[1]
        if self.store is not None:
            self.metrics.redis_backlog.set(self.store.backlog)
        body = self.metrics.render()
        self._metrics_cache = (now, body)
        return body

    def client_address(self, connection: ServerConnection) -> str:
        """The caller's address for rate limits and logs: the socket's peer, or, when that peer is a
        trusted proxy (``config.trusted_proxies``: nginx on the node, a load balancer), the ``X-Real-IP``
        it set, else the right-most address of ``X-Forwarded-For`` that is not itself a trusted proxy."""
        address = connection.remote_address
        peer = str(address[0]) if address else "?"
        if not self._trusted(peer) or connection.request is None:
            return peer
        headers = connection.request.headers
        real_ip = headers.get("X-Real-IP")
        if real_ip:
            return real_ip.strip()
        forwarded = [a.strip() for h in headers.get_all("X-Forwarded-For") for a in h.split(",")]
        for hop in reversed(forwarded):
            if hop and not self._trusted(hop):
                return hop
        return peer

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted_proxies)

    def _refuse_rate_limited(
        self, connection: ServerConnection, limited: RateLimited, *, as_admission: bool
    ) -> Response:
        """429 with ``Retry-After`` (``/api/admission``: its usual JSON, status 200, reason rate_limited)."""
        self.metrics.admissions_refused.labels(reason="rate_limited").inc()
        message = f"too many handshakes ({limited.scope} limit); retry after {limited.retry_after_header} s"
        if as_admission:
            admission = Admission(False, 429, "rate_limited", message)
            response = _response(200, admission.as_json(), "application/json", cache_control="no-store")
        else:
            response = connection.respond(429, f"rate_limited: {message}\n")
        response.headers["Retry-After"] = limited.retry_after_header
        return response

    def personas_json(self) -> bytes:
        """``GET /api/personas``: ``{"voices": [names], "voice_prompt_max_chars", "text_prompt_max_chars",
        "text_prompt_max_tokens"}``. A session may also name no voice (the model's own) and any text prompt
        within both text limits (``TEXT_PROMPT_LIMIT``)."""
        body = {
            "voices": self.voice_names,
            "voice_prompt_max_chars": VOICE_PROMPT_MAX_CHARS,
            "text_prompt_max_chars": TEXT_PROMPT_MAX_CHARS,
            "text_prompt_max_tokens": TEXT_PROMPT_MAX_TOKENS,
        }
        return (json.dumps(body) + "\n").encode()

    async def admission(self, request: Request) -> Admission:
        """``GET /api/admission``: the checks of a ``/api/chat`` upgrade and of the session after it, in the
        same order (origin, token, query, persona, replay, persona prompt, drain, readiness, capacity), made
        without spending the token (``ReplayGuard.seen``) or taking a slot. Never raises for bad input:
        every refusal is an :class:`Admission` with its reason."""
        query = urlsplit(request.path).query
        params = parse_qs(query)
        origin = request.headers.get("Origin") or (params.get("origin") or [None])[0]
        try:
            self._check_origin(origin)
            claims = None
            if self.verifier is not None:
                claims = self.verifier.verify(_bearer_token(request) or _token_of(request))
            try:
                session_request = parse_session_query(query)
            except ProtocolError as exc:
                return Admission(False, 400, "bad_request", f"bad request: {exc}")
            if claims is not None and self.verifier is not None:
                self.verifier.check_persona(claims, session_request.voice_prompt)
                if self.replay_guard is not None and await self.replay_guard.seen(claims):
                    raise TokenRejected(
                        "replayed", f"token {claims.token_id} was already used; tokens are single-use"
                    )
        except TokenRejected as exc:
            return Admission(False, exc.status, exc.reason, str(exc))
        try:
            self._plan_session(query)
        except (ProtocolError, PersonaError, ValueError) as exc:
            return Admission(False, 400, "bad_request", f"bad request: {exc}")
        if self.draining:
            return Admission(False, 503, "draining", DRAINING_MESSAGE)
        if not self.warm or not self.tick_alive:
            return Admission(False, 503, "not_ready", f"node not ready: {self.readiness()[1]}")
        free = self.free_slots
        if free == 0:
            return Admission(False, 503, "node_full", node_full_message(self.slots))
        slots = self.slots
        return Admission(True, 200, "ok", f"a session would be admitted: {free} of {slots} slots free")

    # --- access ---------------------------------------------------------------------------------------

    async def _check_access(self, connection: ServerConnection, request: Request) -> None:
        """The checks made before the upgrade, in order: origin, token (signature, key, audience, time),
        persona, replay. On success the claims wait in ``_claims`` for the session's handler.

        Raises:
            TokenRejected: the reason and what to tell the caller.
        """
        self._check_origin(request.headers.get("Origin"))
        if self.verifier is None:
            return
        claims = self.verifier.verify(_token_of(request))
        try:
            voice_prompt = parse_session_query(urlsplit(request.path).query).voice_prompt
        except ProtocolError:
            return  # refused after the upgrade with 1008, naming the parameter; the token is not spent
        self.verifier.check_persona(claims, voice_prompt)
        # Only checked here: the token is spent when the session takes its slot (``_spend_token``), so
        # a refused upgrade (426, 400) or a full node does not spend it.
        if self.replay_guard is not None and await self.replay_guard.seen(claims):
            raise TokenRejected(
                "replayed", f"token {claims.token_id} was already used; tokens are single-use"
            )
        self._claims[connection] = claims

    def _check_origin(self, origin: str | None) -> None:
        """Raises ``TokenRejected("origin_not_allowed")`` for a browser origin not in the allow-list (None:
        not a browser, not checked)."""
        if origin is not None and not self._origin_allowed(origin):
            raise TokenRejected(
                "origin_not_allowed",
                f"origin {origin!r} may not open sessions on this node (DUPLEX_ALLOWED_ORIGINS)",
            )

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.config.allowed_origins
        return "*" in allowed or origin.strip().rstrip("/").lower() in allowed

    def _refuse_handshake(self, connection: ServerConnection, exc: TokenRejected) -> Response:
        self.metrics.admissions_refused.labels(reason=exc.reason).inc()
        log.debug("refused handshake from %s: %s", self.client_address(connection), exc)
        response = connection.respond(exc.status, f"{exc.reason}: {exc.detail}\n")
        if exc.status == 401:  # RFC 6750, 3
            error = "" if exc.reason == "missing" else ', error="invalid_token"'
            response.headers["WWW-Authenticate"] = f'Bearer realm="duplex"{error}'
        return response

    # --- sessions -------------------------------------------------------------------------------------

    async def _refuse(self, connection: ServerConnection, reason: str, message: str, code: int) -> None:
        self.metrics.admissions_refused.labels(reason=reason).inc()
        log.info("refused session: %s", message)
        try:
            await connection.send(encode_error(message))
            await connection.close(code, message[:120])
        except ConnectionClosed:
            pass

    def _plan_session(
        self, query: str, text_prompt: str | None = None
    ) -> tuple[SessionRequest, Persona, list[PromptStep], SamplingParams]:
        """What a ``/api/chat`` query asks for: the request, its persona, the persona's prompt steps and the
        sampling settings; ``text_prompt``: the prompt that came as metadata (``text_prompt_in=metadata``).

        Raises:
            ProtocolError: a bad query parameter.
            PersonaError: an unknown voice, or a text prompt over the token limit.
            ValueError: a sampling value out of range.
        """
        request = parse_session_query(query)
        if text_prompt is not None:
            request = dataclasses.replace(request, text_prompt=text_prompt)
        persona = Persona(request.voice_prompt, request.text_prompt)
        prompt = build_prompt(
            persona,
            self.voices,
            self.bundle.text_tokenizer,
            silence_codes=self.engine.silence_codes.cpu(),
            sine_codes=self.engine.sine_codes.cpu(),
        )
        return request, persona, prompt, sampling_from_request(request)

    async def _metadata_prompt(self, connection: ServerConnection, query: str) -> str | None:
        """With ``text_prompt_in=metadata``, the text prompt from the client's first message (a 0x04
        metadata ``{"text_prompt": ...}``); None otherwise (a bad query is left to ``_plan_session``).

        Raises:
            ProtocolError: ``bad_metadata``: another kind of message first, a bad object, a prompt over the
                limit, or nothing within ``METADATA_PROMPT_TIMEOUT_S``.
            ConnectionClosed: the client left.
        """
        try:
            wanted = parse_session_query(query).text_prompt_in == TEXT_PROMPT_IN_METADATA
        except ProtocolError:
            return None
        if not wanted:
            return None
        try:
            async with asyncio.timeout(METADATA_PROMPT_TIMEOUT_S):
                message = await connection.recv()
        except TimeoutError:
            raise ProtocolError(
                "bad_metadata",
                f"text_prompt_in=metadata: no 0x04 metadata message within {METADATA_PROMPT_TIMEOUT_S:g} s",
            ) from None
        parsed = parse_client_message(message, max_message_bytes=self.config.max_message_bytes)
        if not isinstance(parsed, MetadataMessage):
            raise ProtocolError(
                "bad_metadata",
                f'text_prompt_in=metadata: the first message must be 0x04 metadata {{"text_prompt": ...}}, '
                f"got {type(parsed).__name__}",
            )
        return parse_prompt_metadata(parsed.data)

    async def _handle(self, connection: ServerConnection) -> None:
        query = urlsplit(connection.request.path).query if connection.request else ""
        try:
            request, persona, prompt, sampling = self._plan_session(
                query, await self._metadata_prompt(connection, query)
            )
        except (ProtocolError, PersonaError, ValueError) as exc:
            await self._refuse(connection, "bad_request", f"bad request: {exc}", CLOSE_POLICY)
            return
        except ConnectionClosed:
            return
        if request.ignored_params:
            log.debug("ignored query parameters: %s", ", ".join(request.ignored_params))
        if self.draining:
            await self._refuse(connection, "draining", DRAINING_MESSAGE, CLOSE_TRY_AGAIN_LATER)
            return
        session = ChatSession(self, connection, request, persona)
        session.claims = self._claims.pop(connection, None)
        session.slot_session = self._slot_session(session, prompt, sampling)
        # Until its handshake the client is read and its messages dropped (Kyutai's client sends audio
        # before it): so a client leaving while it waits for a slot or while its persona prompt runs is
        # seen at once and gives its place back, instead of holding a slot until the prompt ends.
        left = asyncio.create_task(_read_until_closed(connection), name=f"pre-handshake {session.session_id}")
        try:
            slot = await _unless_left(self._admit(session.slot_session), left)
        except _ClientLeft:
            return
        except WaitingRoomFull as exc:
            left.cancel()
            await self._refuse(connection, "waiting_room_full", f"node full: {exc}", CLOSE_TRY_AGAIN_LATER)
            return
        except WaitTimeout as exc:
            left.cancel()
            await self._refuse(connection, "wait_timeout", f"node full: {exc}", CLOSE_TRY_AGAIN_LATER)
            return
        except NodeFull:
            left.cancel()
            await self._refuse(connection, "node_full", node_full_message(self.slots), CLOSE_TRY_AGAIN_LATER)
            return
        except AdmissionRefused as exc:
            left.cancel()
            await self._refuse(connection, exc.reason, exc.message, exc.close_code)
            return
        self.sessions.add(session)
        outcome = SessionOutcome("client_closed")
        sender: asyncio.Task[None] | None = None
        started = False
        try:
            # The token is spent now that the session holds a slot, and not before: a refused upgrade
            # or a full node leaves it unspent (issue 16).
            rejection = await self._spend_token(session.claims)
            if rejection is not None:
                left.cancel()
                outcome = SessionOutcome(f"token_{rejection.reason}", rejection.close_code)
                await self._refuse(connection, rejection.reason, str(rejection.exc), rejection.close_code)
                return
            started = True
            self.metrics.sessions_started.inc()
            if self.store is not None:
                self.store.register_session(
                    SessionRecord(
                        session.session_id,
                        self.config.node_id,
                        slot,
                        time.time(),
                        persona.label,
                        request.format.value,
                    )
                )
            await _unless_left(asyncio.wait_for(session.ready.wait(), PROMPT_TIMEOUT_S), left)
            left.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await left
            await connection.send(encode_handshake())
            sender = asyncio.create_task(session.send_loop())
            limit = session.max_session_s
            try:
                async with asyncio.timeout(limit):
                    outcome = await session.receive_loop()
            except TimeoutError:
                outcome = SessionOutcome("max_session_length")
                source = "" if limit == self.config.max_session_s else " (the token's limit)"
                await connection.send(encode_error(f"session reached max_session_s={limit:g}{source}"))
        except (ConnectionClosed, _ClientLeft):
            outcome = SessionOutcome("client_closed")
        except TimeoutError:
            outcome = SessionOutcome("prompt_timeout", CLOSE_TRY_AGAIN_LATER)
        finally:
            left.cancel()
            self._release(session.slot_session)
            if sender is not None:
                sender.cancel()
            self.sessions.discard(session)
            if started:
                if self.draining and connection.close_code == CLOSE_GOING_AWAY:
                    outcome = SessionOutcome("drained", CLOSE_GOING_AWAY)
                self.metrics.sessions_ended.labels(reason=outcome.reason).inc()
                if self.store is not None:
                    self.store.end_session(session.session_id, outcome.reason)
                log.info(
                    "session %s ended (%s): %d frames in, %d out",
                    session.session_id,
                    outcome.reason,
                    session.frames_in,
                    session.frames_out,
                )
        with contextlib.suppress(ConnectionClosed):
            await connection.close(outcome.close_code, outcome.reason)

    async def _spend_token(self, claims: TokenClaims | None) -> _SpendRefused | None:
        """Spend the session's token (single use); None when spent or when there is nothing to spend."""
        if claims is None or self.replay_guard is None:
            return None
        try:
            await self.replay_guard.spend(claims)
        except TokenRejected as exc:
            code = CLOSE_TRY_AGAIN_LATER if exc.status == 503 else CLOSE_POLICY
            return _SpendRefused(exc.reason, exc, code)
        return None


@dataclass(frozen=True)
class _SpendRefused:
    reason: str
    exc: TokenRejected
    close_code: int


class _ClientLeft(Exception):
    """The client closed its connection before its handshake."""


async def _read_until_closed(connection: ServerConnection) -> None:
    """Read and drop messages until the connection closes (returns then)."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await connection.recv()


async def _unless_left(awaitable: Awaitable[T], left: asyncio.Task[None]) -> T:
    """Await ``awaitable`` unless the ``left`` task (:func:`_read_until_closed`) ends first.

    Raises:
        _ClientLeft: the client left first (``awaitable`` is cancelled).
    """
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _ClientLeft()


def _token_of(request: Request) -> str | None:
    """The session token: the ``duplex.token.<jwt>`` subprotocol, else the ``token`` query parameter."""
    for header in request.headers.get_all("Sec-WebSocket-Protocol"):
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(SUBPROTOCOL_PREFIX):
                return offered.removeprefix(SUBPROTOCOL_PREFIX)
    values = parse_qs(urlsplit(request.path).query).get("token")
    return values[0] if values else None


def _bearer_token(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer <jwt>`` header (RFC 6750, 2.1), or None."""
    scheme, _, value = (request.headers.get("Authorization") or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def _select_token_subprotocol(
    connection: ServerConnection, subprotocols: Sequence[Subprotocol]
) -> Subprotocol | None:
    """Select the ``duplex.token.<jwt>`` subprotocol when the client offered one: a browser fails the
    handshake unless the server names one of the subprotocols it offered."""
    for offered in subprotocols:
        if offered.startswith(SUBPROTOCOL_PREFIX):
            return offered
    return None


def _replay_guard(config: RuntimeConfig, metrics: RuntimeMetrics) -> ReplayGuard | None:
    """The replay check that ``DUPLEX_TOKEN_REPLAY_CHECK`` names (None for ``off``)."""
    mode = config.token_replay_check
    if mode == "off":
        return None
    if mode == "memory":
        return MemoryReplayGuard(config.token_leeway_s)
    assert config.redis_url is not None  # check_access_control
    return RedisReplayGuard(
        config.redis_url,
        leeway_s=config.token_leeway_s,
        fallback=MemoryReplayGuard(config.token_leeway_s) if mode == "redis-or-memory" else None,
        on_error=lambda: metrics.redis_errors.labels(op="token_replay_check").inc(),
    )


def _response(status: int, body: bytes, content_type: str, *, cache_control: str | None = None) -> Response:
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body)))])
    if cache_control is not None:
        headers["Cache-Control"] = cache_control
    return Response(status, reason, headers, body)


@contextlib.asynccontextmanager
async def loading_status(config: RuntimeConfig, metrics: RuntimeMetrics) -> AsyncIterator[Server | None]:
    """Answer on the runtime's address while the model loads, then free the address for the real server.

    Inside the context: ``/healthz`` 200 ``loading`` (the process is alive), ``/readyz`` 503
    ``{"ready": false, "reason": "loading the model"}``, ``/metrics`` the registry of ``metrics`` (with
    ``duplex_loading`` 1 and ``duplex_ready`` 0: Prometheus's ``up`` is 1, so ``RuntimeDown`` stays quiet
    during a load of minutes), ``/api/admission`` an ``Admission`` ``not_ready``, anything else 503 with
    ``LOADING_MESSAGE``. Nothing is upgraded to a WebSocket. ``duplex_loading`` is 0 again on exit.

    Yields the listening server, or None when ``config.port`` is 0 (an ephemeral port: the real server
    would listen elsewhere, so there is nothing to hold).

    Raises:
        OSError: the address is in use.
    """
    metrics.loading.set(1)
    metrics.ready.set(0)

    def answer(connection: ServerConnection, request: Request) -> Response:
        path = urlsplit(request.path).path
        if path == "/healthz":
            return connection.respond(200, "loading\n")
        if path == "/readyz":
            body = json.dumps({"ready": False, "reason": "loading the model"}) + "\n"
            return _response(503, body.encode(), "application/json")
        if path == "/metrics":
            return _response(200, metrics.render(), PROMETHEUS_CONTENT_TYPE)
        if path == ADMISSION_PATH:
            admission = Admission(False, 503, "not_ready", LOADING_MESSAGE)
            return _response(200, admission.as_json(), "application/json", cache_control="no-store")
        return connection.respond(503, LOADING_MESSAGE + "\n")

    async def never_upgraded(connection: ServerConnection) -> None:  # every request is answered above
        await connection.close()

    server = None
    if config.port != 0:
        server = await serve(never_upgraded, config.host, config.port, process_request=answer)
        log.info("loading the model; %s:%d answers the probes meanwhile", config.host, config.port)
    try:
        yield server
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
        metrics.loading.set(0)


def build_server(config: RuntimeConfig, *, metrics: RuntimeMetrics | None = None) -> DuplexServer:
    """Load the model named by ``config`` and build the server and its store (not started); ``metrics``: the
    registry to keep (the one ``loading_status`` served), a fresh one by default."""

    config.check_access_control()  # before the model loads: a missing key stops the process at once
    bundle = config.load_model_bundle()
    metrics = metrics or RuntimeMetrics()
    return DuplexServer(config, bundle, store=build_store(config, metrics), metrics=metrics)


def build_store(config: RuntimeConfig, metrics: RuntimeMetrics) -> SessionStore | None:
    """The Redis session store of ``config.redis_url`` (not started), or None without one."""
    if not config.redis_url:
        return None
    return SessionStore(
        config.redis_url,
        config.node_id,
        session_ttl_s=config.transcript_ttl_s,
        transcript_ttl_s=config.transcript_ttl_s,
        on_error=lambda op: metrics.redis_errors.labels(op=op).inc(),
        on_backlog=metrics.redis_backlog.set,
    )
