"""The sessions API: an application backend lists its conversations, reads one back, downloads its
recording and erases it, on the node's port (``runtime.frontend.http`` routes ``/api/sessions`` here).

- ``GET /api/sessions[?state=active|ended&limit=N&before=T]`` (``sessions:read``): 200
  ``{"sessions": [...]}``, newest first (``before``: the last ``started_at`` of the previous page);
- ``GET /api/sessions/<id>[?include=persona]`` (``sessions:read``): 200 the session with its transcript (and
  its text prompt with ``include=persona``), 404;
- ``GET /api/sessions/<id>/recording/<caller|agent>`` (``sessions:recordings``): 200 ``audio/ogg``, 404,
  409 while the session is live;
- ``DELETE /api/sessions/<id>`` (``sessions:erase``): 204, 404, 409 while the session is live.

Every request carries an application token (``runtime.frontend.gate.app_tokens``) as ``Authorization:
Bearer``: none or an invalid one 401, a session token or a missing scope 403; a node without application
keys answers 403 ``api_off``. The token's tenant is passed to the session reader: a tenant sees, reads and
erases its own sessions only (another tenant's session is 404, as an unknown one); a recording whose record
is gone (past retention) is erased for the default tenant only, since nothing says whose it was. ``<id>`` is
32 lowercase hex digits; anything else (``..``, ``/``, percent-encoded tricks) gets 400 naming the rule,
before any lookup. Erase is not repeatable: the second ``DELETE`` of a session gets 404, as an unknown or
expired one does (404 after a retried ``DELETE`` means nothing of the session is held: the erase is done). A
live session cannot be erased (409: end it first). Bodies: ``runtime.frontend.store.records``; the API:
docs/sessions-api.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from typing import Any

import redis.exceptions
from aiohttp import web

from runtime.frontend.gate.access import RequestView, bearer_token
from runtime.frontend.gate.app_tokens import (
    SCOPE_ERASE,
    SCOPE_READ,
    SCOPE_RECORDINGS,
    AppClaims,
    verify_app_token,
)
from runtime.frontend.gate.tokens import DEFAULT_TENANT, TokenRejected
from runtime.frontend.session.conversation import FrontEnd
from runtime.frontend.store.interface import SessionLive, SessionReader
from runtime.frontend.store.recordings import OGG_OPUS_CONTENT_TYPE, SESSION_ID_RE, SIDES, RecordingStore
from runtime.frontend.store.records import LIST_MAX

__all__ = ["SESSIONS_PATH", "sessions_collection", "sessions_item"]

log = logging.getLogger(__name__)

SESSIONS_PATH = "/api/sessions"
_STATES = ("active", "ended")
_LIMIT_RE = re.compile(r"[0-9]{1,7}")
"""``limit``: ASCII digits only (``str.isdigit`` also takes ``²``, which ``int`` refuses)."""


def _json(status: int, body: dict[str, Any]) -> web.Response:
    answer = web.Response(status=status, body=(json.dumps(body) + "\n").encode())
    answer.headers["Content-Type"] = "application/json"
    answer.headers["Cache-Control"] = "no-store"
    return answer


def _error(status: int, reason: str, message: str) -> web.Response:
    """``{"error": reason, "message": ...}`` with ``status`` (401s with ``WWW-Authenticate``, RFC 6750)."""
    answer = _json(status, {"error": reason, "message": message})
    if status == 401:
        error = "" if reason == "missing" else ', error="invalid_token"'
        answer.headers["WWW-Authenticate"] = f'Bearer realm="duplex"{error}'
    elif reason == "insufficient_scope":
        answer.headers["WWW-Authenticate"] = 'Bearer realm="duplex", error="insufficient_scope"'
    return answer


def _authorize(front: FrontEnd, request: web.Request, scope: str) -> AppClaims | web.Response:
    """The request's application token's claims when it grants ``scope``, else the refusal (403
    ``api_off`` on a node without access control or without application keys)."""
    verifier = getattr(front.access, "app_verifier", None)
    if verifier is None:
        if front.access.verifier is None:
            message = "the sessions API needs access control: it is off on this node (DUPLEX_AUTH_MODE=off)"
        else:
            message = (
                "the sessions API needs application-token keys: this node has none (set "
                "DUPLEX_APP_TOKEN_KEYS; session-token keys do not sign application tokens)"
            )
        return _error(403, "api_off", message)
    view_token = bearer_token(RequestView("", request.headers.items(), ""))  # never ?token=: URLs get logged
    try:
        return verify_app_token(verifier, view_token, scope)
    except TokenRejected as exc:
        return _error(exc.status, exc.reason, f"{exc.reason}: {exc.detail}")


def _records(front: FrontEnd) -> SessionReader | None:
    return getattr(front, "records", None)


def _no_store() -> web.Response:
    return _error(
        503, "no_store", "the sessions API needs the session store: this node has no DUPLEX_REDIS_URL"
    )


def _store_down(exc: Exception) -> web.Response:
    log.warning("sessions API: redis failed: %r", exc)
    answer = _error(
        503, "store_unavailable", f"the session store (Redis) is unavailable: {type(exc).__name__}"
    )
    answer.headers["Retry-After"] = "1"
    return answer


def _bad_id(value: str) -> web.Response:
    shown = value if len(value) <= 40 else value[:37] + "..."
    return _error(
        400,
        "bad_session_id",
        f"session id {shown!r} is invalid: expected 32 lowercase hex digits (a uuid without dashes)",
    )


def _list_params(request: web.Request) -> tuple[str | None, int, float | None] | web.Response:
    query = request.query
    unknown = sorted(set(query) - {"state", "limit", "before"})
    if unknown:
        return _error(
            400, "bad_query", f"unknown query parameter {unknown[0]!r}; allowed: state, limit, before"
        )
    state = query.get("state") or None
    if state is not None and state not in _STATES:
        return _error(400, "bad_query", f"state={state!r} is invalid: expected active or ended")
    limit_text = query.get("limit", "100")
    if not _LIMIT_RE.fullmatch(limit_text) or not 1 <= int(limit_text) <= LIST_MAX:
        return _error(
            400, "bad_query", f"limit={limit_text[:20]!r} is invalid: expected a whole number 1..{LIST_MAX}"
        )
    before = None
    if "before" in query:
        try:
            before = float(query["before"])
        except ValueError:
            before = math.nan
        if not math.isfinite(before):
            return _error(
                400, "bad_query", "before must be a unix time in seconds (the last started_at of a page)"
            )
    return state, int(limit_text), before


async def sessions_collection(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    """``GET /api/sessions``: live and recent sessions, newest first."""
    claims = _authorize(front, request, SCOPE_READ)
    if isinstance(claims, web.Response):
        return claims
    params = _list_params(request)
    if isinstance(params, web.Response):
        return params
    records = _records(front)
    if records is None:
        return _no_store()
    state, limit, before = params
    try:
        found = await records.list(state=state, limit=limit, before=before, tenant=claims.tenant)
    except (TimeoutError, redis.exceptions.RedisError, OSError) as exc:
        return _store_down(exc)
    return _json(200, {"sessions": found})


async def sessions_item(front: FrontEnd, request: web.Request) -> web.StreamResponse:
    """``/api/sessions/<id>`` (GET, DELETE) and ``/api/sessions/<id>/recording/<side>`` (GET)."""
    parts = request.path[len(SESSIONS_PATH) + 1 :].split("/")
    session_id = parts[0]
    if not SESSION_ID_RE.fullmatch(session_id):
        return _bad_id(session_id)
    recording = len(parts) == 3 and parts[1] == "recording"
    if len(parts) > 1 and not recording:
        return _error(
            404,
            "no_route",
            f"no route {request.path}; try {SESSIONS_PATH}/<id> or {SESSIONS_PATH}/<id>/recording/<side>",
        )
    if recording and parts[2] not in SIDES:
        return _error(
            400, "bad_side", f"recording side {parts[2][:20]!r} is invalid: expected caller or agent"
        )
    if request.method == "DELETE" and recording:
        answer = _error(405, "method_not_allowed", "DELETE is not allowed on a recording: erase the session")
        answer.headers["Allow"] = "GET"
        return answer
    scope = SCOPE_READ if request.method != "DELETE" else SCOPE_ERASE
    if recording:
        scope = SCOPE_RECORDINGS
    claims = _authorize(front, request, scope)
    if isinstance(claims, web.Response):
        return claims
    records = _records(front)
    if records is None:
        return _no_store()
    tenant = claims.tenant
    try:
        if request.method == "DELETE":
            return await _erase(front, records, session_id, tenant)
        if recording:
            return await _recording(front, records, session_id, parts[2], tenant)
        include = _include(request)
        if isinstance(include, web.Response):
            return include
        body = await records.read(session_id, include_persona=include, tenant=tenant)
    except (TimeoutError, redis.exceptions.RedisError, OSError) as exc:
        return _store_down(exc)
    if body is None:
        return _unknown(session_id)
    return _json(200, body)


def _include(request: web.Request) -> bool | web.Response:
    """``?include=persona`` on a session's read: True (its text prompt in the body), else False; another
    ``include`` value: 400 naming it."""
    values = request.query.getall("include", [])
    if any(value != "persona" for value in values):
        bad = next(value for value in values if value != "persona")
        return _error(400, "bad_query", f"include={bad[:20]!r} is invalid: expected persona")
    return bool(values)


def _unknown(session_id: str) -> web.Response:
    return _error(
        404,
        "unknown_session",
        f"no session {session_id} on this node's store: never started, past its retention, or erased",
    )


def _recordings(front: FrontEnd) -> RecordingStore | None:
    return getattr(front, "recordings", None)


async def _erase(front: FrontEnd, records: SessionReader, session_id: str, tenant: str) -> web.Response:
    try:
        existed = await records.erase(session_id, tenant=tenant)
    except SessionLive:
        return _error(
            409, "session_live", f"session {session_id} is still going on: erase it once it has ended"
        )
    # Recording files carry no tenant: without this tenant's record they go only when no record at all
    # is left (past retention) and the token is the default tenant's (the operator's).
    orphan = not existed and tenant == DEFAULT_TENANT and await records.state(session_id) is None
    store = _recordings(front)
    removed = 0
    if store is not None and (existed or orphan):
        removed = await asyncio.to_thread(store.erase, session_id)
    if not existed and not removed:
        return _unknown(session_id)
    log.info("session %s erased on request (%d recording files)", session_id, removed)
    return web.Response(status=204)


async def _recording(
    front: FrontEnd, records: SessionReader, session_id: str, side: str, tenant: str
) -> web.StreamResponse:
    state = await records.state(session_id, tenant=tenant)
    if state is None:
        return _unknown(session_id)
    if state != "ended":
        return _error(
            409,
            "session_live",
            f"session {session_id} is still going on: its recording is finished when it ends",
        )
    store = _recordings(front)
    path = None if store is None else await asyncio.to_thread(store.local_path, session_id, side)
    if path is None:
        return _error(
            404,
            "no_recording",
            f"no {side} recording of session {session_id}: not consented, recording off on this node, "
            "stopped by a write error, or not finished yet (its files are closed just after the session "
            "ends: retry in a few seconds)",
        )
    answer = web.FileResponse(
        path, headers={"Content-Type": OGG_OPUS_CONTENT_TYPE, "Cache-Control": "no-store"}
    )
    return answer
