"""The HTTP side of the node's port: one route table for the loading and the serving phases, served by
aiohttp (``build_app``; the loading phase's ``build_loading_app``; the listener's limits:
``runtime.frontend.listener``).

Every route answers GET only but the sessions API's items (GET and DELETE:
``runtime.frontend.sessions_api``) and WebRTC's (``/api/rtc``: POST an offer; its sessions' resources under
``/api/rtc/``: DELETE; ``runtime.frontend.transports.webrtc.signalling``), 405 with ``Allow`` otherwise (RFC
9110 15.5.6); an unknown path gets 404 naming the routes. While the model loads (the pre-load server of
``--workers 0``, or a worker whose engine has not answered yet) each route gives its ``loading`` answer:
``/healthz`` 200 ``loading``, ``/readyz`` 503 ``{"ready": false, "reason": "loading the model"}``,
``/slotz`` 503, ``/metrics`` the registry (with ``duplex_loading 1``), ``/api/admission`` ``not_ready``,
everything else
(``/api/chat`` included: no upgrade) 503 ``LOADING_MESSAGE``. Serving: ``/api/chat``, ``/api/rtc`` and
``/api/rtc/ice-servers`` pass the gate (``runtime.frontend.gate.admission.admit``: rate limits, origin,
token, persona, replay; each refusal counted once) before any upgrade or answer, refusals as plain HTTP
statuses; ``/api/admission`` runs the same gate as a probe and the session's checks, without spending
anything (``runtime.frontend.gate.refusals.Admission``); ``/readyz`` means serving (a full node stays
ready), ``/slotz`` has a free slot, and every serving answer carries the ORCA slot load report
(``runtime.frontend.gate.slot_load``). Why aiohttp and not websockets'
``process_request``: docs/runtime.md, "The HTTP layer".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.engine.api import node_full_message
from runtime.engine.persona_limits import (
    TEXT_PROMPT_MAX_CHARS,
    TEXT_PROMPT_MAX_TOKENS,
    VOICE_PROMPT_MAX_CHARS,
)
from runtime.frontend.gate.access import RequestView
from runtime.frontend.gate.admission import GateRefused, admit, admit_connection
from runtime.frontend.gate.refusals import LOADING_MESSAGE, Admission, SessionRefused
from runtime.frontend.gate.slot_load import LOAD_REPORT_HEADER, SLOTZ_PATH, SlotLoad
from runtime.frontend.listener import HEADER_DEADLINE, READ_BUFSIZE, HeaderDeadline, listener_args
from runtime.frontend.session.conversation import FrontEnd, plan_session
from runtime.frontend.sessions_api import SESSIONS_PATH, sessions_collection, sessions_item
from runtime.frontend.transports import websocket as ws
from runtime.frontend.transports.carriers import edge as carrier_edge
from runtime.frontend.transports.carriers.dialect import Dialect
from runtime.frontend.transports.carriers.exotel import ExotelDialect
from runtime.frontend.transports.carriers.plivo import PlivoDialect
from runtime.frontend.transports.carriers.telnyx import TelnyxDialect
from runtime.frontend.transports.carriers.twilio import TwilioDialect
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
    "slot_load",
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


# --- loading phase ------------------------------------------------------------------------------------


def _loading_refused(loading: Loading) -> web.Response:
    return text_response(503, LOADING_MESSAGE + "\n")


def _loading_healthz(loading: Loading) -> web.Response:
    return text_response(200, "loading\n")


def _loading_readyz(loading: Loading) -> web.Response:
    return _json(503, {"ready": False, "reason": "loading the model", **loading.detail})


def _loading_slotz(loading: Loading) -> web.Response:
    return _json(503, {"free_slots": 0, "reason": "loading the model", **loading.detail})


def _loading_metrics(loading: Loading) -> web.Response:
    return response(200, loading.render_metrics(), PROMETHEUS_CONTENT_TYPE)


def _loading_admission(loading: Loading) -> web.Response:
    admission_ = Admission(False, 503, "not_ready", LOADING_MESSAGE)
    return response(200, admission_.as_json(), "application/json", cache_control="no-store")


# --- serving phase ------------------------------------------------------------------------------------


def _refused(refused: GateRefused) -> web.Response:
    """A gate refusal as a plain status (counted already by the gate): ``<reason>: <sentence>``,
    ``Retry-After`` on 429, ``WWW-Authenticate`` on 401 (RFC 6750, 3). The connection ends after it."""
    log.info("refused %s: %s", "resume" if refused.resume else "handshake", refused)
    answer = text_response(refused.status, f"{refused.reason}: {refused.message}\n")
    if refused.retry_after is not None:
        answer.headers["Retry-After"] = refused.retry_after
    if refused.www_authenticate is not None:
        answer.headers["WWW-Authenticate"] = refused.www_authenticate
    answer.force_close()  # a refused upgrade ends its connection (as a WebSocket server's does)
    return answer


async def _chat(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    try:
        admitted = await admit(front.access, front.metrics, request_view(request))
    except GateRefused as refused:
        return _refused(refused)
    answer = await ws.serve_chat(front, request, admitted)
    if isinstance(answer, web.Response):
        answer.force_close()  # a refused upgrade (426) ends its connection
    return answer


def _carrier(dialect: type[Dialect]) -> Callable[[FrontEnd, web.Request], Awaitable[web.StreamResponse]]:
    """``/api/carriers/<carrier>``: the connection's gate (rate limits; a carrier is not a browser: no
    origin), then the carrier's bridge (its signature, the upgrade, the token on the ``start`` message)."""

    async def serve(front: FrontEnd, request: web.Request) -> web.StreamResponse:
        try:
            connection = admit_connection(
                front.access, front.metrics, request_view(request), origin=None, resume=False
            )
        except GateRefused as refused:
            return _refused(refused)
        return await carrier_edge.serve_upgrade(front, request, connection.client, dialect)

    return serve


async def _rtc(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    """``/api/rtc`` (POST an offer) and ``/api/rtc/ice-servers`` (GET): the gate (``admit``: the rate
    limits, the origin, then the token as ``Authorization: Bearer`` or ``?token=``; a resume, ``POST
    /api/rtc`` with ``Duplex-Resume-Credential: <credential>`` or the deprecated ``?resume=``, needs no
    token: the single-use credential is the right to the session, as on ``/api/chat``); an offer's body
    must then arrive within ``DUPLEX_HTTP_BODY_TIMEOUT_S`` (else 408, connection closed: issue 34, item 10);
    then ``runtime.frontend.transports.webrtc.signalling``."""
    try:
        admitted = await admit(front.access, front.metrics, request_view(request), subprotocols=False)
    except GateRefused as refused:
        return _refused(refused)
    if request.path == rtc.ICE_SERVERS_PATH:
        return await rtc.serve_ice_servers(front, request, admitted.claims)
    late = await _body_late(request, front.config.http_body_timeout_s)
    if late is not None:
        front.metrics.refused("bad_request", resume=admitted.resume)
        return late
    return await rtc.serve_offer(front, request, admitted)


async def _body_late(request: web.Request, timeout_s: float) -> web.Response | None:
    """Wait, at most ``timeout_s``, for the whole request body (buffered by aiohttp, not consumed: the
    handler reads it after); a 408 that closes the connection when it is late, else None. A body declared
    larger than aiohttp's read buffer is left to the handler (its own size limit answers 413)."""
    if not request.body_exists:
        return None
    if request.content_length is not None and request.content_length > READ_BUFSIZE:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            await request.content.wait_eof()
    except TimeoutError:
        log.info("refused request: its body did not arrive within %g s (%s)", timeout_s, request.path)
        answer = text_response(408, f"bad_request: the request body did not arrive within {timeout_s:g} s\n")
        answer.force_close()
        return answer
    return None


async def _rtc_resource(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    """``DELETE /api/rtc/<session id>/<key>`` behind the handshake rate limits (per client address, then
    global), as a ``POST`` is (issue 34, item 11: a stream of guessed hang-ups cost a Redis round trip
    each). No origin check: a hang-up carries its key."""
    try:
        admit_connection(front.access, front.metrics, request_view(request), origin=None, resume=False)
    except GateRefused as refused:
        return _refused(refused)
    return await rtc.delete_session(front, request)


async def _admission(front: FrontEnd, request: web.Request) -> web.Response:
    try:
        answer = await admission(front, request_view(request))
    except GateRefused as refused:  # the rate limit: counted, and answered 200 with its reason
        body = Admission(False, refused.status, refused.reason, refused.message).as_json()
        limited = response(200, body, "application/json", cache_control="no-store")
        assert refused.retry_after is not None
        limited.headers["Retry-After"] = refused.retry_after
        return limited
    return response(200, answer.as_json(), "application/json", cache_control="no-store")


async def admission(front: FrontEnd, view: RequestView) -> Admission:
    """``GET /api/admission``: the gate of a ``/api/chat`` upgrade (``admit``, as a probe) and the checks of
    the session after it (query, persona, drain, readiness, capacity), made without spending the token or
    taking a slot. The token comes as ``Authorization: Bearer <jwt>`` (or ``?token=``), the origin from
    ``Origin``, else an ``origin`` query parameter (a same-origin GET carries none).

    Raises:
        GateRefused: ``rate_limited`` only (counted: a probe spends a handshake); every other verdict is
            the returned :class:`Admission`.
    """
    try:
        admitted = await admit(front.access, front.metrics, view, subprotocols=False, probe=True)
    except GateRefused as refused:
        if refused.reason == "rate_limited":
            raise
        return Admission(False, refused.status, refused.reason, str(refused))
    try:
        plan_session(front, admitted.request if admitted.request is not None else view.query)
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
    "text_prompt_max_chars", "text_prompt_max_tokens", "frame": {"sample_rate_hz", "samples", "ms"}}`` (the
    model's frame, :class:`runtime.engine.api.FrameFormat`: what a client sends and receives). A session may
    also name no voice (the model's own)
    and any text prompt within both text limits; NVIDIA's preset ``NATF2`` may be asked for as
    ``NATF2.pt``."""
    status = front.backend.status()
    body: dict[str, object] = {
        "voices": list(status.voices),
        "voices_refused": list(status.voices_refused),
        "voice_prompt_max_chars": VOICE_PROMPT_MAX_CHARS,
        "text_prompt_max_chars": TEXT_PROMPT_MAX_CHARS,
        "text_prompt_max_tokens": TEXT_PROMPT_MAX_TOKENS,
        "frame": status.frame.as_json(),
    }
    return _json(200, body, cache_control="no-cache")


async def _healthz(front: FrontEnd, request: web.Request) -> web.Response:
    healthy, text = front.health()
    return text_response(200 if healthy else 500, text + "\n")


async def _readyz(front: FrontEnd, request: web.Request) -> web.Response:
    body = front.readiness_json()
    return _json(200 if body["ready"] else 503, body)


def slot_load(front: FrontEnd) -> SlotLoad:
    """The node's slot load now, the upgrades reserved at the edge included
    (``runtime.frontend.gate.slot_load``)."""
    return SlotLoad.of(front.backend.status(), front.upgrades.count)


async def _slotz(front: FrontEnd, request: web.Request) -> web.Response:
    """``GET /slotz``: 200 when a new caller would find a free slot, else 503 (full, draining or not
    ready); JSON ``SlotLoad.as_json`` either way, with ``ready``. ``/readyz`` stays 200 on a full node."""
    load = slot_load(front)
    ready = bool(front.readiness()[0])
    return _json(200 if ready and load.free > 0 else 503, {"ready": ready, **load.as_json()})


async def _metrics(front: FrontEnd, request: web.Request) -> web.Response:
    return response(200, front.render_metrics(), PROMETHEUS_CONTENT_TYPE)


ROUTES: dict[str, Route] = {
    CHAT_PATH: Route(("GET",), _chat, _loading_refused),
    ADMISSION_PATH: Route(("GET",), _admission, _loading_admission),
    PERSONAS_PATH: Route(("GET",), _personas, _loading_refused),
    "/healthz": Route(("GET",), _healthz, _loading_healthz),
    "/readyz": Route(("GET",), _readyz, _loading_readyz),
    SLOTZ_PATH: Route(("GET",), _slotz, _loading_slotz),
    "/metrics": Route(("GET",), _metrics, _loading_metrics),
    # The sessions API (runtime.frontend.sessions_api): the collection, and every path below it.
    SESSIONS_PATH: Route(("GET",), sessions_collection, _loading_refused),
    SESSIONS_PATH + "/*": Route(("GET", "DELETE"), sessions_item, _loading_refused),
    rtc.RTC_PATH: Route(("POST",), _rtc, _loading_refused),
    rtc.ICE_SERVERS_PATH: Route(("GET",), _rtc, _loading_refused),
    TwilioDialect.path: Route(("GET",), _carrier(TwilioDialect), _loading_refused),
    PlivoDialect.path: Route(("GET",), _carrier(PlivoDialect), _loading_refused),
    TelnyxDialect.path: Route(("GET",), _carrier(TelnyxDialect), _loading_refused),
    ExotelDialect.path: Route(("GET",), _carrier(ExotelDialect), _loading_refused),
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
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    server_header: str | None,
    config: RuntimeConfig | None,
    load_report: Callable[[], str] | None = None,
) -> web.Application:
    """One catch-all aiohttp route to ``handler``, which looks the path up in :data:`ROUTES` (aiohttp's
    own router would answer 404 and 405 in its own words), the ``Server`` header when given, and the ORCA
    load report (``load_report``: the ``endpoint-load-metrics`` value) on every response when given. The
    listener's limits (``config``; None: the settings' defaults): the request line and header sizes,
    ``DUPLEX_HTTP_IDLE_TIMEOUT_S`` (aiohttp's ``keepalive_timeout``: an idle connection between requests),
    ``DUPLEX_HTTP_HEADER_TIMEOUT_S`` (:class:`HeaderDeadline`, in the app as :data:`HEADER_DEADLINE`) and
    parse errors logged as one INFO line (:class:`BadRequestLog`)."""
    defaults = RuntimeConfig.model_fields
    idle_s = defaults["http_idle_timeout_s"].default if config is None else config.http_idle_timeout_s
    header_s = defaults["http_header_timeout_s"].default if config is None else config.http_header_timeout_s
    app = web.Application(handler_args=listener_args(idle_s))
    deadline = HeaderDeadline(header_s)
    app[HEADER_DEADLINE] = deadline

    async def started(request: web.Request) -> web.StreamResponse:
        deadline.started(request)
        return await handler(request)

    app.router.add_route("*", "/{path:.*}", started)
    if server_header is not None or load_report is not None:

        async def set_headers(request: web.Request, answer: web.StreamResponse) -> None:
            if server_header is not None:
                answer.headers["Server"] = server_header
            if load_report is not None:
                answer.headers[LOAD_REPORT_HEADER] = load_report()

        # aiohttp types its Signal's items wrongly (a callable of a callable); this is its documented use.
        app.on_response_prepare.append(set_headers)  # type: ignore[arg-type]
    return app


def build_loading_app(loading: Loading, config: RuntimeConfig | None = None) -> web.Application:
    """The pre-load server's application: every route's loading answer; nothing is upgraded (``config``:
    the listener's limits, as :func:`build_app`'s)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        route, refused = _route(request)
        if route is None:
            assert refused is not None
            return refused
        return route.loading(loading)

    return _application(answer, None, config)


def build_app(front: FrontEnd, *, server_header: str | None = None) -> web.Application:
    """The serving application of ``front``: a route's loading answer while the backend loads (a worker
    whose engine has not answered yet), else its serving handler. Every response carries the node's slot
    utilisation as an ORCA load report (``endpoint-load-metrics``: ``runtime.frontend.gate.slot_load``), which
    the multi-region stack's load balancer balances on."""

    async def dispatch(request: web.Request) -> web.StreamResponse:
        route, refused = _route(request)
        if route is None:
            assert refused is not None
            return refused
        status = front.backend.status()
        if not status.loaded and not front.draining:
            return route.loading(Loading(front.render_metrics, status.detail))
        return await route.serve(front, request)

    return _application(dispatch, server_header, front.config, lambda: slot_load(front).header())
