"""The HTTP side of the node's port: one route table for the loading and the serving phases, served by
aiohttp (``build_app``; the loading phase's ``build_loading_app``).

Every route answers GET only but the sessions API's items (GET and DELETE:
``runtime.frontend.sessions_api``) and WebRTC's (``/api/rtc``: POST an offer; its sessions' resources under
``/api/rtc/``: DELETE; ``runtime.frontend.transports.webrtc.signalling``), 405 with ``Allow`` otherwise (RFC
9110 15.5.6); an unknown
path gets 404
naming the routes. While the model loads (the pre-load server of ``--workers 0``, or a worker whose
engine has not answered yet) each route gives its ``loading`` answer: ``/healthz`` 200 ``loading``,
``/readyz`` 503 ``{"ready": false, "reason": "loading the model"}``, ``/metrics`` the registry (with
``duplex_loading 1``), ``/api/admission`` ``not_ready``, everything else (``/api/chat`` included: no upgrade)
503 ``LOADING_MESSAGE``. Serving: ``/api/chat`` passes the handshake rate limits and the access check
(``runtime.frontend.gate.access``) before the upgrade, refusals as plain HTTP statuses; ``/api/admission``
makes
the same checks and the session's, without spending anything (``runtime.frontend.gate.refusals.Admission``).
Why aiohttp and not websockets' ``process_request``: docs/runtime.md, "The HTTP layer".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from runtime.engine.api import node_full_message
from runtime.engine.persona_limits import (
    TEXT_PROMPT_MAX_CHARS,
    TEXT_PROMPT_MAX_TOKENS,
    VOICE_PROMPT_MAX_CHARS,
)
from runtime.frontend.gate.access import RequestView, bearer_token, session_token
from runtime.frontend.gate.query import RESUME_HEADER, ResumePresented
from runtime.frontend.gate.ratelimit import RateLimited
from runtime.frontend.gate.refusals import LOADING_MESSAGE, Admission, SessionRefused
from runtime.frontend.gate.tokens import TokenRejected
from runtime.frontend.session.conversation import FrontEnd, plan_session
from runtime.frontend.sessions_api import SESSIONS_PATH, sessions_collection, sessions_item
from runtime.frontend.transports import websocket as ws
from runtime.frontend.transports.webrtc import signalling as rtc
from runtime.metrics import PROMETHEUS_CONTENT_TYPE

__all__ = [
    "ADMISSION_PATH",
    "CHAT_PATH",
    "PERSONAS_PATH",
    "ROUTES",
    "Loading",
    "Route",
    "admission",
    "build_app",
    "build_loading_app",
    "request_view",
]

log = logging.getLogger(__name__)

CHAT_PATH = "/api/chat"
ADMISSION_PATH = "/api/admission"
PERSONAS_PATH = "/api/personas"

MAX_REQUEST_LINE_BYTES = 8190
"""Longest request line (method, URL, version) and longest header field aiohttp reads; longer gets 400
(aiohttp's defaults, as websockets' 8 KiB before)."""


@dataclass(frozen=True)
class Loading:
    """What the loading phase's answers read: the metrics' rendering and ``/readyz``'s extra fields."""

    render_metrics: Callable[[], bytes]
    detail: dict[str, object]


Handler = Callable[["FrontEnd", web.Request], Awaitable[web.StreamResponse]]
LoadingHandler = Callable[[Loading], web.Response]


@dataclass(frozen=True)
class Route:
    """One path: its methods, its serving handler and its loading answer."""

    methods: tuple[str, ...]
    serve: Handler
    loading: LoadingHandler


def text_response(status: int, text: str) -> web.Response:
    """A ``text/plain; charset=utf-8`` answer: the refusals' and probes' shape (a line of text)."""
    return web.Response(status=status, text=text, content_type="text/plain", charset="utf-8")


def response(
    status: int, body: bytes, content_type: str, *, cache_control: str | None = None
) -> web.Response:
    """A response of ``body`` as ``content_type`` (a full media type, parameters included)."""
    answer = web.Response(status=status, body=body)
    answer.headers["Content-Type"] = content_type
    if cache_control is not None:
        answer.headers["Cache-Control"] = cache_control
    return answer


def _json(status: int, body: dict[str, object], *, cache_control: str | None = None) -> web.Response:
    return response(
        status, (json.dumps(body) + "\n").encode(), "application/json", cache_control=cache_control
    )


def request_view(request: web.Request) -> RequestView:
    """The transport-neutral view of an HTTP request (the socket's peer, headers, query)."""
    peer = ""
    if request.transport is not None:
        address = request.transport.get_extra_info("peername")
        peer = str(address[0]) if address else ""
    return RequestView(peer, request.headers.items(), request.query_string)


def resume_presented(view: RequestView, *, subprotocols: bool = True) -> ResumePresented:
    """The resume credential as ``view`` presents it: the ``Duplex-Resume-Credential`` header, the
    ``duplex.resume.<credential>`` subprotocol (``subprotocols``: a WebSocket upgrade) and the deprecated
    ``?resume=`` (issue 34: a credential in the URL is kept by proxies' and load balancers' logs)."""
    protocols = view.get_all("Sec-WebSocket-Protocol") if subprotocols else ()
    return ResumePresented.of(view.param("resume"), view.get_all(RESUME_HEADER), protocols)


# --- loading phase ------------------------------------------------------------------------------------


def _loading_refused(loading: Loading) -> web.Response:
    return text_response(503, LOADING_MESSAGE + "\n")


def _loading_healthz(loading: Loading) -> web.Response:
    return text_response(200, "loading\n")


def _loading_readyz(loading: Loading) -> web.Response:
    return _json(503, {"ready": False, "reason": "loading the model", **loading.detail})


def _loading_metrics(loading: Loading) -> web.Response:
    return response(200, loading.render_metrics(), PROMETHEUS_CONTENT_TYPE)


def _loading_admission(loading: Loading) -> web.Response:
    admission_ = Admission(False, 503, "not_ready", LOADING_MESSAGE)
    return response(200, admission_.as_json(), "application/json", cache_control="no-store")


# --- serving phase ------------------------------------------------------------------------------------


def _refuse_rate_limited(
    front: FrontEnd, limited: RateLimited, *, as_admission: bool, resume: bool = False
) -> web.Response:
    """429 with ``Retry-After`` (``/api/admission``: its usual JSON, status 200, reason rate_limited)."""
    front.metrics.refused("rate_limited", resume=resume)
    message = f"too many handshakes ({limited.scope} limit); retry after {limited.retry_after_header} s"
    if as_admission:
        body = Admission(False, 429, "rate_limited", message).as_json()
        answer = response(200, body, "application/json", cache_control="no-store")
    else:
        answer = text_response(429, f"rate_limited: {message}\n")
    answer.headers["Retry-After"] = limited.retry_after_header
    return answer


def _refuse_handshake(front: FrontEnd, exc: TokenRejected, *, resume: bool = False) -> web.Response:
    front.metrics.refused(exc.reason, resume=resume)
    log.debug("refused handshake: %s", exc)
    answer = text_response(exc.status, f"{exc.reason}: {exc.detail}\n")
    if exc.status == 401:  # RFC 6750, 3
        error = "" if exc.reason == "missing" else ', error="invalid_token"'
        answer.headers["WWW-Authenticate"] = f'Bearer realm="duplex"{error}'
    return answer


async def _chat(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    answer = await _upgrade_chat(front, request)
    if isinstance(answer, web.Response):
        answer.force_close()  # a refused upgrade ends its connection (as a WebSocket server's does)
    return answer


async def _upgrade_chat(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    view = request_view(request)
    presented = resume_presented(view)
    resume = presented.given  # its refusals count in duplex_resume_refused_total only
    # First, before any work (token verify, Redis, persona): the handshake rate limits.
    limited = front.access.rate_limited(view)
    if limited is not None:
        return _refuse_rate_limited(front, limited, as_admission=False, resume=resume)
    try:
        if resume:  # the resume credential is the right to the session: no token is spent
            front.access.check_origin(view.get("Origin"))
            claims = None
        else:
            claims = await front.access.check(view, origin=view.get("Origin"), token=session_token(view))
    except TokenRejected as exc:
        return _refuse_handshake(front, exc, resume=resume)
    return await ws.serve_chat(front, request, claims, front.access.client_address(view), presented)


async def _rtc_checked(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    """``/api/rtc`` (POST an offer) and ``/api/rtc/ice-servers`` (GET): the handshake rate limits, then the
    access check with the token as ``Authorization: Bearer`` (``?token=`` too), as ``/api/chat``'s upgrade
    (a resume, ``POST /api/rtc`` with ``Duplex-Resume-Credential: <credential>``, or the deprecated
    ``?resume=``: the origin only, no token: the single-use credential is the right to the session, as on
    ``/api/chat``); then ``runtime.frontend.transports.webrtc.signalling``."""
    view = request_view(request)
    presented = resume_presented(view, subprotocols=False)
    limited = front.access.rate_limited(view)
    if limited is not None:
        return _refuse_rate_limited(front, limited, as_admission=False)
    try:
        if request.path == rtc.RTC_PATH and presented.given:  # as /api/chat: the credential is the right
            front.access.check_origin(view.get("Origin"))
            claims = None
        else:
            token = bearer_token(view) or session_token(view)
            claims = await front.access.check(view, origin=view.get("Origin"), token=token)
    except TokenRejected as exc:
        return _refuse_handshake(front, exc)
    if request.path == rtc.ICE_SERVERS_PATH:
        return await rtc.serve_ice_servers(front, request, claims)
    return await rtc.serve_offer(front, request, claims, front.access.client_address(view), presented)


async def _rtc_resource(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    return await rtc.delete_session(front, request)


async def _admission(front: FrontEnd, request: web.Request) -> web.Response:
    view = request_view(request)
    limited = front.access.rate_limited(view)
    if limited is not None:
        return _refuse_rate_limited(front, limited, as_admission=True)
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
        return Admission(False, 503, "node_full", node_full_message(status.slots))
    free, slots = status.free_slots, status.slots
    return Admission(True, 200, "ok", f"a session would be admitted: {free} of {slots} slots free")


async def _personas(front: FrontEnd, request: web.Request) -> web.Response:
    """``{"voices": [names], "voices_refused": ["<file>: <reason>"], "voice_prompt_max_chars",
    "text_prompt_max_chars", "text_prompt_max_tokens"}``. A session may also name no voice (the model's own)
    and any text prompt within both text limits; NVIDIA's preset ``NATF2`` may be asked for as
    ``NATF2.pt``."""
    status = front.backend.status()
    body: dict[str, object] = {
        "voices": list(status.voices),
        "voices_refused": list(status.voices_refused),
        "voice_prompt_max_chars": VOICE_PROMPT_MAX_CHARS,
        "text_prompt_max_chars": TEXT_PROMPT_MAX_CHARS,
        "text_prompt_max_tokens": TEXT_PROMPT_MAX_TOKENS,
    }
    return _json(200, body, cache_control="no-cache")


async def _healthz(front: FrontEnd, request: web.Request) -> web.Response:
    healthy, text = front.health()
    return text_response(200 if healthy else 500, text + "\n")


async def _readyz(front: FrontEnd, request: web.Request) -> web.Response:
    body = front.readiness_json()
    return _json(200 if body["ready"] else 503, body)


async def _metrics(front: FrontEnd, request: web.Request) -> web.Response:
    return response(200, front.render_metrics(), PROMETHEUS_CONTENT_TYPE)


ROUTES: dict[str, Route] = {
    CHAT_PATH: Route(("GET",), _chat, _loading_refused),
    ADMISSION_PATH: Route(("GET",), _admission, _loading_admission),
    PERSONAS_PATH: Route(("GET",), _personas, _loading_refused),
    "/healthz": Route(("GET",), _healthz, _loading_healthz),
    "/readyz": Route(("GET",), _readyz, _loading_readyz),
    "/metrics": Route(("GET",), _metrics, _loading_metrics),
    # The sessions API (runtime.frontend.sessions_api): the collection, and every path below it.
    SESSIONS_PATH: Route(("GET",), sessions_collection, _loading_refused),
    SESSIONS_PATH + "/*": Route(("GET", "DELETE"), sessions_item, _loading_refused),
    rtc.RTC_PATH: Route(("POST",), _rtc_checked, _loading_refused),
    rtc.ICE_SERVERS_PATH: Route(("GET",), _rtc_checked, _loading_refused),
}
"""Every HTTP route: its methods (another gets 405 with ``Allow``), its serving and its loading answer. A key
ending in ``/*`` takes every path below it."""
RTC_RESOURCE = Route(("DELETE",), _rtc_resource, _loading_refused)
"""Every path under ``/api/rtc/`` not in :data:`ROUTES`: a WebRTC session's resource (its ``Location``)."""


def _route(request: web.Request) -> tuple[Route | None, web.Response | None]:
    path = request.path
    route = ROUTES.get(path)
    if route is None and path.startswith(SESSIONS_PATH + "/"):
        route = ROUTES[SESSIONS_PATH + "/*"]
    if route is None and path.startswith(rtc.RESOURCE_PREFIX):
        route = RTC_RESOURCE
    if route is None:
        return None, text_response(404, f"no route {path}; try {', '.join(ROUTES)}\n")
    if request.method not in route.methods:
        answer = text_response(405, f"{request.method} is not allowed on {path}\n")
        answer.headers["Allow"] = ", ".join(route.methods)
        return None, answer
    return route, None


def _application(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]], server_header: str | None
) -> web.Application:
    """One catch-all aiohttp route to ``handler``, which looks the path up in :data:`ROUTES` (aiohttp's
    own router would answer 404 and 405 in its own words), and the ``Server`` header when given."""
    app = web.Application(
        handler_args={"max_line_size": MAX_REQUEST_LINE_BYTES, "max_field_size": MAX_REQUEST_LINE_BYTES}
    )
    app.router.add_route("*", "/{path:.*}", handler)
    if server_header is not None:

        async def set_server_header(request: web.Request, answer: web.StreamResponse) -> None:
            answer.headers["Server"] = server_header

        # aiohttp types its Signal's items wrongly (a callable of a callable); this is its documented use.
        app.on_response_prepare.append(set_server_header)  # type: ignore[arg-type]
    return app


def build_loading_app(loading: Loading) -> web.Application:
    """The pre-load server's application: every route's loading answer; nothing is upgraded."""

    async def answer(request: web.Request) -> web.StreamResponse:
        route, refused = _route(request)
        if route is None:
            assert refused is not None
            return refused
        return route.loading(loading)

    return _application(answer, None)


def build_app(front: FrontEnd, *, server_header: str | None = None) -> web.Application:
    """The serving application of ``front``: a route's loading answer while the backend loads (a worker
    whose engine has not answered yet), else its serving handler."""

    async def dispatch(request: web.Request) -> web.StreamResponse:
        route, refused = _route(request)
        if route is None:
            assert refused is not None
            return refused
        status = front.backend.status()
        if not status.loaded and not front.draining:
            return route.loading(Loading(front.render_metrics, status.detail))
        return await route.serve(front, request)

    return _application(dispatch, server_header)
