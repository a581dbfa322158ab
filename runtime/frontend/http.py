"""The HTTP side of the node's port: one route table for the loading and the serving phases.

Every route answers GET only (405 with ``Allow`` otherwise, RFC 9110 15.5.6); an unknown path gets 404
naming the routes. While the model loads (the pre-load server of ``--workers 0``, or a worker whose
engine has not answered yet) each route gives its ``loading`` answer: ``/healthz`` 200 ``loading``,
``/readyz`` 503 ``{"ready": false, "reason": "loading the model"}``, ``/metrics`` the registry (with
``duplex_loading 1``), ``/api/admission`` ``not_ready``, everything else (``/api/chat`` included: no upgrade)
503 ``LOADING_MESSAGE``. Serving: ``/api/chat`` passes the handshake rate limits and the access check
(``runtime.frontend.access``) before the upgrade, refusals as plain HTTP statuses; ``/api/admission`` makes
the same checks and the session's, without spending anything (``runtime.frontend.refusals.Admission``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from runtime.engine.persona_limits import (
    TEXT_PROMPT_MAX_CHARS,
    TEXT_PROMPT_MAX_TOKENS,
    VOICE_PROMPT_MAX_CHARS,
)
from runtime.frontend.access import RequestView, bearer_token, session_token
from runtime.frontend.ratelimit import RateLimited
from runtime.frontend.refusals import LOADING_MESSAGE, Admission, SessionRefused
from runtime.frontend.session import FrontEnd, plan_session
from runtime.frontend.tokens import TokenRejected
from runtime.metrics import PROMETHEUS_CONTENT_TYPE

__all__ = [
    "ADMISSION_PATH",
    "CHAT_PATH",
    "PERSONAS_PATH",
    "ROUTES",
    "Loading",
    "Route",
    "admission",
    "process_request",
    "request_view",
]

log = logging.getLogger(__name__)

CHAT_PATH = "/api/chat"
ADMISSION_PATH = "/api/admission"
PERSONAS_PATH = "/api/personas"


@dataclass(frozen=True)
class Loading:
    """What the loading phase's answers read: the metrics' rendering and ``/readyz``'s extra fields."""

    render_metrics: Callable[[], bytes]
    detail: dict[str, object]


Handler = Callable[["FrontEnd", ServerConnection, Request], Awaitable[Response | None]]
LoadingHandler = Callable[[Loading, ServerConnection], Response]


@dataclass(frozen=True)
class Route:
    """One path: its methods, its serving handler (None from it: upgrade) and its loading answer."""

    methods: tuple[str, ...]
    serve: Handler
    loading: LoadingHandler


def response(status: int, body: bytes, content_type: str, *, cache_control: str | None = None) -> Response:
    """A plain response with its length (``status``: 200, 404, 500 or 503)."""
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body)))])
    if cache_control is not None:
        headers["Cache-Control"] = cache_control
    return Response(status, reason, headers, body)


def _json(status: int, body: dict[str, object], *, cache_control: str | None = None) -> Response:
    return response(
        status, (json.dumps(body) + "\n").encode(), "application/json", cache_control=cache_control
    )


def request_view(connection: ServerConnection, request: Request) -> RequestView:
    """The transport-neutral view of a websockets request (peer, headers, query)."""
    address = connection.remote_address
    peer = str(address[0]) if address else ""
    return RequestView(peer, request.headers.raw_items(), urlsplit(request.path).query)


# --- loading phase ------------------------------------------------------------------------------------


def _loading_refused(loading: Loading, connection: ServerConnection) -> Response:
    return connection.respond(503, LOADING_MESSAGE + "\n")


def _loading_healthz(loading: Loading, connection: ServerConnection) -> Response:
    return connection.respond(200, "loading\n")


def _loading_readyz(loading: Loading, connection: ServerConnection) -> Response:
    return _json(503, {"ready": False, "reason": "loading the model", **loading.detail})


def _loading_metrics(loading: Loading, connection: ServerConnection) -> Response:
    return response(200, loading.render_metrics(), PROMETHEUS_CONTENT_TYPE)


def _loading_admission(loading: Loading, connection: ServerConnection) -> Response:
    admission_ = Admission(False, 503, "not_ready", LOADING_MESSAGE)
    return response(200, admission_.as_json(), "application/json", cache_control="no-store")


# --- serving phase ------------------------------------------------------------------------------------


def _refuse_rate_limited(
    front: FrontEnd, connection: ServerConnection, limited: RateLimited, *, as_admission: bool
) -> Response:
    """429 with ``Retry-After`` (``/api/admission``: its usual JSON, status 200, reason rate_limited)."""
    front.metrics.admissions_refused.labels(reason="rate_limited").inc()
    message = f"too many handshakes ({limited.scope} limit); retry after {limited.retry_after_header} s"
    if as_admission:
        body = Admission(False, 429, "rate_limited", message).as_json()
        answer = response(200, body, "application/json", cache_control="no-store")
    else:
        answer = connection.respond(429, f"rate_limited: {message}\n")
    answer.headers["Retry-After"] = limited.retry_after_header
    return answer


def _refuse_handshake(front: FrontEnd, connection: ServerConnection, exc: TokenRejected) -> Response:
    front.metrics.admissions_refused.labels(reason=exc.reason).inc()
    log.debug("refused handshake: %s", exc)
    answer = connection.respond(exc.status, f"{exc.reason}: {exc.detail}\n")
    if exc.status == 401:  # RFC 6750, 3
        error = "" if exc.reason == "missing" else ', error="invalid_token"'
        answer.headers["WWW-Authenticate"] = f'Bearer realm="duplex"{error}'
    return answer


async def _chat(front: FrontEnd, connection: ServerConnection, request: Request) -> Response | None:
    view = request_view(connection, request)
    # First, before any work (token verify, Redis, persona): the handshake rate limits.
    limited = front.access.rate_limited(view)
    if limited is not None:
        return _refuse_rate_limited(front, connection, limited, as_admission=False)
    try:
        claims = await front.access.check(view, origin=view.get("Origin"), token=session_token(view))
    except TokenRejected as exc:
        return _refuse_handshake(front, connection, exc)
    front.keep_admitted(connection, claims, front.access.client_address(view))
    return None


async def _admission(front: FrontEnd, connection: ServerConnection, request: Request) -> Response:
    view = request_view(connection, request)
    limited = front.access.rate_limited(view)
    if limited is not None:
        return _refuse_rate_limited(front, connection, limited, as_admission=True)
    answer = await admission(front, view)
    return response(200, answer.as_json(), "application/json", cache_control="no-store")


async def admission(front: FrontEnd, view: RequestView) -> Admission:
    """``GET /api/admission``: the checks of a ``/api/chat`` upgrade (``Access.check``) and of the session
    after it (query, persona, drain, readiness, capacity), made without spending the token or taking a
    slot. The token comes as ``Authorization: Bearer <jwt>`` (or ``?token=``), the origin from ``Origin``,
    else an ``origin`` query parameter (a same-origin GET carries none). Never raises for bad input."""
    origin = view.get("Origin") or view.param("origin")
    try:
        await front.access.check(view, origin=origin, token=bearer_token(view) or session_token(view))
    except TokenRejected as exc:
        return Admission(False, exc.status, exc.reason, str(exc))
    try:
        plan_session(front, view.query)
    except SessionRefused as exc:
        return Admission.refused(exc)
    if front.draining:
        return Admission.refused(SessionRefused("draining"))
    status = front.backend.status()
    if not status.loaded or not status.tick_alive or status.lost:
        return Admission(False, 503, "not_ready", f"node not ready: {front.readiness()[1]}")
    if status.free_slots == 0:
        from runtime.engine.api import node_full_message

        return Admission(False, 503, "node_full", node_full_message(status.slots))
    free, slots = status.free_slots, status.slots
    return Admission(True, 200, "ok", f"a session would be admitted: {free} of {slots} slots free")


async def _personas(front: FrontEnd, connection: ServerConnection, request: Request) -> Response:
    """``{"voices": [names], "voice_prompt_max_chars", "text_prompt_max_chars", "text_prompt_max_tokens"}``.
    A session may also name no voice (the model's own) and any text prompt within both text limits."""
    body: dict[str, object] = {
        "voices": list(front.backend.status().voices),
        "voice_prompt_max_chars": VOICE_PROMPT_MAX_CHARS,
        "text_prompt_max_chars": TEXT_PROMPT_MAX_CHARS,
        "text_prompt_max_tokens": TEXT_PROMPT_MAX_TOKENS,
    }
    return _json(200, body, cache_control="no-cache")


async def _healthz(front: FrontEnd, connection: ServerConnection, request: Request) -> Response:
    healthy, text = front.health()
    return connection.respond(200 if healthy else 500, text + "\n")


async def _readyz(front: FrontEnd, connection: ServerConnection, request: Request) -> Response:
    body = front.readiness_json()
    return _json(200 if body["ready"] else 503, body)


async def _metrics(front: FrontEnd, connection: ServerConnection, request: Request) -> Response:
    return response(200, front.render_metrics(), PROMETHEUS_CONTENT_TYPE)


ROUTES: dict[str, Route] = {
    CHAT_PATH: Route(("GET",), _chat, _loading_refused),
    ADMISSION_PATH: Route(("GET",), _admission, _loading_admission),
    PERSONAS_PATH: Route(("GET",), _personas, _loading_refused),
    "/healthz": Route(("GET",), _healthz, _loading_healthz),
    "/readyz": Route(("GET",), _readyz, _loading_readyz),
    "/metrics": Route(("GET",), _metrics, _loading_metrics),
}
"""Every HTTP route: its methods (another gets 405 with ``Allow``), its serving and its loading answer."""


def _route(connection: ServerConnection, request: Request) -> tuple[Route | None, Response | None]:
    path = urlsplit(request.path).path
    route = ROUTES.get(path)
    if route is None:
        return None, connection.respond(404, f"no route {path}; try {', '.join(ROUTES)}\n")
    if request.method not in route.methods:
        answer = connection.respond(405, f"{request.method} is not allowed on {path}\n")
        answer.headers["Allow"] = ", ".join(route.methods)
        return None, answer
    return route, None


def loading_request(loading: Loading) -> Callable[[ServerConnection, Request], Response]:
    """websockets' ``process_request`` of the pre-load server: every route's loading answer."""

    def answer(connection: ServerConnection, request: Request) -> Response:
        route, refused = _route(connection, request)
        if route is None:
            assert refused is not None
            return refused
        return route.loading(loading, connection)

    return answer


async def process_request(front: FrontEnd, connection: ServerConnection, request: Request) -> Response | None:
    """websockets' ``process_request`` of the serving server: a response, or None to upgrade."""
    route, refused = _route(connection, request)
    if route is None:
        return refused
    status = front.backend.status()
    if not status.loaded and not front.draining:
        return route.loading(Loading(front.render_metrics, status.detail), connection)
    return await route.serve(front, connection, request)
