"""WebRTC signalling on ``/api/rtc``: one HTTP request per session, WHIP-shaped (RFC 9725), as OpenAI's
``POST /v1/realtime/calls``. Non-trickle ICE: the answer carries every server candidate.

- ``GET /api/rtc/ice-servers`` (``Authorization: Bearer <session token>``): ``{"iceServers": [...]}``, the
  ``RTCConfiguration`` a browser passes to ``new RTCPeerConnection()``, with TURN credentials minted for
  this caller (``runtime.frontend.transports.webrtc.turn``): a client that must relay needs them before it
  makes its offer.
  The token is checked, not spent.
- ``POST /api/rtc?<the /api/chat query>`` with the offer (``Content-Type: application/sdp``) and the token as
  ``Authorization: Bearer``: ``201 Created``, the answer (``application/sdp``), ``Location:
  /api/rtc/<session id>/<key>`` and the ICE servers as ``Link: <url>; rel="ice-server"; username=...;
  credential=...; credential-type="password"`` headers (RFC 9725, 4.6). Every refusal comes before the
  answer, as a plain HTTP status with ``/api/chat``'s reasons (``runtime.frontend.gate.refusals``): 400 (bad
  query, malformed SDP, no audio, no Opus), 401/403 (token, origin), 413 (offer over
  :data:`MAX_OFFER_BYTES`), 415 (not ``application/sdp``), 429 and 503 with ``Retry-After``. A refused offer
  takes no slot and spends no token. An answered one spends it when ICE and DTLS connect
  (``runtime.frontend.transports.webrtc.peer``), so a caller whose ICE fails can fall back to ``/api/chat``
  with it.
- ``DELETE /api/rtc/<session id>/<key>``: ends the session (200), 404 when no such session (or a wrong key).
  With ``--workers N`` the DELETE may reach another worker than the POST (``SO_REUSEPORT``): a worker that
  does not hold the session asks the engine, which forwards the request to the worker that does
  (``runtime.ipc.Hangup``). A ``DELETE`` of a call held for a resume ends the hold (the slot freed).
- Resume (docs/runtime.md, "Resume"): with ``resumable=1`` the DataChannel's 0x00 is followed by a 0x04
  metadata message with the session id and a single-use credential, as on ``/api/chat``. ``POST
  /api/rtc`` with ``Duplex-Resume-Credential: <credential>`` (the deprecated ``?resume=`` too), a fresh
  offer and no token (the credential is the right, as on
  ``/api/chat``: nothing is spent or capped per token) takes over the slot of a session held after its
  transport was lost, whichever transport it had and through any worker; the session id, slot and
  transcript go on, the 201 carries the next credential in :data:`RESUME_HEADER` and the 0x04 after the
  0x00 says ``resumed`` and ``gap_ms``. Its refusals come before the answer, with ``/api/chat``'s reasons
  and statuses: 404 ``resume_off``, 403 ``resume_invalid`` and ``resume_replayed``, 410 ``resume_expired``;
  they take no slot. The offer is read before the credential, so a malformed one spends nothing.

The rate limits and the token check run in ``runtime.frontend.http`` before these handlers, as for
``/api/chat``. The session itself: ``runtime.frontend.transports.webrtc.peer``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import urllib.parse
import uuid
import weakref
from collections.abc import Callable

from aiohttp import web

from runtime.engine.api import SamplingParams
from runtime.frontend.gate.admission import Admitted
from runtime.frontend.gate.query import (
    RESUME_HEADER,
    TEXT_PROMPT_HEADER,
    TEXT_PROMPT_IN_METADATA,
    SessionRequest,
)
from runtime.frontend.gate.refusals import SessionRefused
from runtime.frontend.gate.tokens import TokenClaims
from runtime.frontend.session.conversation import FrontEnd, SessionOutcome, plan_session
from runtime.frontend.session.lifecycle import run
from runtime.frontend.transports.webrtc.edge import Refused, RtcTransport
from runtime.frontend.transports.webrtc.peer import OfferRejected, RtcPeer
from runtime.frontend.transports.webrtc.turn import TURN_ID_RE, IceServer, ice_servers, mint_turn_credentials
from runtime.region_routes import offer_url

__all__ = [
    "ICE_SERVERS_PATH",
    "MAX_OFFER_BYTES",
    "RESOURCE_PREFIX",
    "RESUME_HEADER",
    "RETRY_AFTER_S",
    "RTC_PATH",
    "RtcRegistry",
    "delete_session",
    "end_all",
    "ice_servers_for",
    "link_headers",
    "registry",
    "serve_ice_servers",
    "serve_offer",
]

log = logging.getLogger(__name__)

RTC_PATH = "/api/rtc"
ICE_SERVERS_PATH = "/api/rtc/ice-servers"
RESOURCE_PREFIX = "/api/rtc/"
MAX_OFFER_BYTES = 32_768
"""Largest SDP offer read (bytes): a browser's offer with audio and a DataChannel is 2-6 KB."""
RETRY_AFTER_S = 5
"""``Retry-After`` of a 503 (node full, waiting room full or timed out, draining, not ready)."""
ONE_CONNECTING_MESSAGE = (
    "rate limited: a WebRTC call with this token is still connecting; retry when it has connected or ended"
)
"""The sentence of a second offer with one token while the first's call connects (429)."""
# RESUME_HEADER (Duplex-Resume-Credential, from session_query): a resume presents its credential in it
# (POST /api/rtc with a fresh offer), and its 201 carries the session's next credential in it, as its 0x04
# will once connected: when that resume's ICE does not connect, the session is held again and the caller's
# next try may present it (or the one it presented, which is spent only by the new connection's first frame:
# runtime.engine.resume).
_RESOURCE_RE = re.compile(r"(?P<sid>[0-9a-f]{32})/(?P<key>[A-Za-z0-9_-]{16,64})")


class RtcRegistry:
    """This process's WebRTC sessions by session id, and the hang-up other workers ask for."""

    def __init__(self, front: FrontEnd) -> None:
        self.peers: dict[str, RtcPeer] = {}
        self.connecting: set[str] = set()
        """Token ids of this process's answered calls not connected yet (their tokens unspent): one each."""
        front.backend.on_hangup = self.hang_up_local

    def forget(self, peer: RtcPeer) -> None:
        """``peer``'s session has ended (or was resumed: a new peer of this process may hold its id now)."""
        if peer.session is not None:
            if self.peers.get(peer.session.session_id) is peer:
                del self.peers[peer.session.session_id]
            self.settled(peer.session.claims)

    def settled(self, claims: TokenClaims | None) -> None:
        """The call holding ``claims`` has connected (its token spent or refused) or ended."""
        if claims is not None:
            self.connecting.discard(claims.token_id)

    def hang_up_local(self, session_id: str, key: str) -> bool:
        """End this process's session ``session_id`` if ``key`` is its key (compared in constant time)."""
        peer = self.peers.get(session_id)
        if peer is None or not hmac.compare_digest(peer.key.encode(), key.encode()):
            return False
        peer.end(SessionOutcome("client_closed"), hang_up=True)  # a hang-up: no hold, or the hold ended
        # Hung up: a second DELETE is a 404 at once, not only once the lifecycle has wound down (forget).
        del self.peers[session_id]
        return True


_REGISTRIES: weakref.WeakKeyDictionary[FrontEnd, RtcRegistry] = weakref.WeakKeyDictionary()


def registry(front: FrontEnd) -> RtcRegistry:
    """The WebRTC sessions of ``front`` (made on first use)."""
    found = _REGISTRIES.get(front)
    if found is None:
        found = _REGISTRIES[front] = RtcRegistry(front)
    return found


async def end_all(front: FrontEnd) -> None:
    """End every WebRTC session of ``front`` and wait until their peer connections are closed (the server
    closes: sessions a drain did not end)."""
    found = _REGISTRIES.get(front)
    if found is None:
        return
    peers = list(found.peers.values())
    for peer in peers:
        peer.end(SessionOutcome("server_closed", 1001), hang_up=True)
    await asyncio.gather(*(peer.wait_closed() for peer in peers), return_exceptions=True)


def ice_servers_for(front: FrontEnd, claims: TokenClaims | None, session_id: str = "") -> list[IceServer]:
    """The ICE servers of a caller: ``DUPLEX_TURN_URLS`` with TURN credentials when ``DUPLEX_TURN_SECRET`` is
    set, minted under the session token's id with an expiry fixed by the token (its ``exp`` plus
    ``DUPLEX_TURN_TTL_S``): every answer and ``ice-servers`` call of one token gives the same username, so
    coturn's per-username ``user-quota`` (4 allocations) binds per token (issue 34, item 2: a fresh username
    per answered offer let 11 unconnected offers of one token take all 40 of a node's allocations). Without a
    token (a resume: the credential is the right) under ``session_id``, from now; with neither, a random
    id."""
    config = front.config
    credentials = None
    if config.turn_secret is not None:
        secret = config.turn_secret.get_secret_value().encode()
        holder, base = session_id, time.time()
        if claims is not None and TURN_ID_RE.fullmatch(claims.token_id):
            holder, base = claims.token_id, claims.expires_at
        if not TURN_ID_RE.fullmatch(holder):
            holder = uuid.uuid4().hex
        credentials = mint_turn_credentials(secret, holder, config.turn_ttl_s, base)
    return ice_servers(config.turn_urls, credentials)


def _turn_holder(claims: TokenClaims | None, fallback: str) -> tuple[str, float | None]:
    """The TURN username's id and mint time for a caller: the token's ``jti`` and ``iat`` (every answer
    and ``ice-servers`` of one token: one coturn user), else ``fallback`` (a fresh id) minted now."""
    if claims is not None and re.fullmatch(r"[A-Za-z0-9_-]{1,128}", claims.token_id):
        return claims.token_id, claims.issued_at
    return fallback, None


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def link_headers(servers: list[IceServer]) -> list[str]:
    """One ``Link`` header value per URL (RFC 9725, 4.6): ``<url>; rel="ice-server"`` and, for TURN,
    ``username``, ``credential`` and ``credential-type="password"``."""
    links = []
    for server in servers:
        for url in server.urls:
            link = f'<{url}>; rel="ice-server"'
            if server.username:
                link += (
                    f"; username={_quoted(server.username)}; credential={_quoted(server.credential)}"
                    '; credential-type="password"'
                )
            links.append(link)
    return links


def _plain(status: int, text: str, *, retry_after: int | None = None) -> web.Response:
    answer = web.Response(status=status, text=text + "\n", content_type="text/plain", charset="utf-8")
    if retry_after is not None:
        answer.headers["Retry-After"] = str(retry_after)
    return answer


def _refused(
    front: FrontEnd, exc: SessionRefused, *, resume: bool = False, counted: bool = False
) -> web.Response:
    """A refusal before the answer: its status from the table, ``Retry-After`` on 429 and 503. Counted once
    (``RuntimeMetrics.refused``: a resume (a credential presented) in ``duplex_resume_refused_total`` only),
    unless ``counted`` (``ChatSession.resume`` counted it already)."""
    if not counted:
        front.metrics.refused(exc.reason, resume=resume)
    log.info("refused WebRTC session: %s", exc.message)
    status = exc.kind.status
    return _plain(
        status, f"{exc.reason}: {exc.message}", retry_after=RETRY_AFTER_S if status in (429, 503) else None
    )


def _client_gone(request: web.Request) -> Callable[[], bool]:
    """Whether ``request``'s connection has closed (aiohttp runs a handler to its end after its client left,
    since ``handler_cancellation`` is off by default: aiohttp 3.9's "Web handler cancellation")."""

    def gone() -> bool:
        transport = request.transport
        return transport is None or transport.is_closing()

    return gone


async def _read_offer(request: web.Request) -> str:
    """The offer's text.

    Raises:
        web.HTTPException: 415 (not application/sdp), 413 (over MAX_OFFER_BYTES), 400 (not UTF-8, empty).
    """
    if request.content_type != "application/sdp":
        raise web.HTTPUnsupportedMediaType(
            text=f"send the SDP offer as Content-Type: application/sdp, not {request.content_type!r}\n"
        )
    too_large = web.HTTPRequestEntityTooLarge(
        max_size=MAX_OFFER_BYTES,
        actual_size=request.content_length or MAX_OFFER_BYTES + 1,
        text=f"the SDP offer is over {MAX_OFFER_BYTES} bytes\n",
    )
    if request.content_length is not None and request.content_length > MAX_OFFER_BYTES:
        raise too_large
    body = bytearray()
    while chunk := await request.content.read(8192):
        body += chunk
        if len(body) > MAX_OFFER_BYTES:
            raise too_large
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise web.HTTPBadRequest(text="the SDP offer is not UTF-8 text\n") from None
    if not text.strip():
        raise web.HTTPBadRequest(text="empty SDP offer: POST the offer's SDP as the body\n")
    return text


def _header_prompt(request: web.Request, admitted: Admitted) -> str | None:
    """The text prompt of a :data:`TEXT_PROMPT_HEADER` header (percent-encoded UTF-8), or None without one.

    Raises:
        SessionRefused: ``bad_request``: two such headers, one beside ``text_prompt=`` in the query, or one
            that is not percent-encoded UTF-8.
    """
    values = request.headers.getall(TEXT_PROMPT_HEADER, [])
    if not values:
        return None
    if admitted.request is not None and admitted.request.text_prompt is not None:
        raise SessionRefused(
            "bad_request", f"bad request: a text prompt in {TEXT_PROMPT_HEADER} and in the query: send one"
        )
    if len(values) > 1:
        raise SessionRefused(
            "bad_request", f"bad request: {len(values)} {TEXT_PROMPT_HEADER} headers: send one"
        )
    try:
        return urllib.parse.unquote(values[0], errors="strict")
    except UnicodeDecodeError:
        raise SessionRefused(
            "bad_request",
            f"bad request: {TEXT_PROMPT_HEADER} is not percent-encoded UTF-8 (the prompt's "
            "encodeURIComponent)",
        ) from None


async def serve_offer(front: FrontEnd, request: web.Request, admitted: Admitted) -> web.StreamResponse:
    """``POST /api/rtc`` after the gate (``runtime.frontend.gate.admission.admit``); ``admitted``: the
    claims, the client, the query parsed once and the resume credential as presented
    (:data:`RESUME_HEADER`, or the deprecated ``?resume=``)."""
    posted_at = time.monotonic()
    claims, client, presented = admitted.claims, admitted.client, admitted.presented
    resume = presented.given  # its refusals count in duplex_resume_refused_total only
    try:
        sdp = await _read_offer(request)
    except web.HTTPException as exc:
        front.metrics.refused("bad_request", resume=resume)
        return _plain(exc.status, (exc.text or exc.reason).strip())
    try:
        session_request, sampling = plan_session(
            front, admitted.request or request.query_string, _header_prompt(request, admitted), presented
        )
        if session_request.text_prompt_in == TEXT_PROMPT_IN_METADATA:
            raise SessionRefused(
                "bad_request",
                "bad request: text_prompt_in=metadata is not available on /api/rtc (the session starts "
                f"with the answer): give the text prompt in the {TEXT_PROMPT_HEADER} header",
            )
    except SessionRefused as exc:
        return _refused(front, exc, resume=resume)
    if front.draining:
        return _refused(front, SessionRefused("draining"), resume=resume)
    # A token is spent when its call connects, so one token could hold a slot per POST until each timed
    # out: one call connecting per token (per worker) at a time.
    sessions = registry(front)
    if claims is not None and claims.token_id in sessions.connecting:
        return _refused(front, SessionRefused("rate_limited", ONE_CONNECTING_MESSAGE))
    if claims is not None:
        sessions.connecting.add(claims.token_id)
    response: web.StreamResponse | None = None
    try:
        response = await _answer(
            front, sessions, sdp, session_request, sampling, claims, client, posted_at, _client_gone(request)
        )
        return response
    finally:
        if response is None or response.status != 201:  # no call answered: nothing connecting holds it
            sessions.settled(claims)


async def _answer(
    front: FrontEnd,
    sessions: RtcRegistry,
    sdp: str,
    session_request: SessionRequest,
    sampling: SamplingParams,
    claims: TokenClaims | None,
    client: str,
    posted_at: float,
    client_gone: Callable[[], bool],
) -> web.StreamResponse:
    """The offer's session admitted and its answer (201), or the refusal: ``serve_offer``'s second half.
    ``client_gone``: whether the POST's connection has closed (read after the waiting room)."""
    resume = bool(session_request.resume)
    peer = RtcPeer(front, posted_at)
    try:
        await peer.accept_offer(sdp)
    except OfferRejected as exc:
        await peer.close()
        return _refused(front, SessionRefused("bad_request", f"bad request: {exc}"), resume=resume)

    def started(answered: RtcPeer) -> None:
        assert answered.session is not None
        sessions.peers[answered.session.session_id] = answered
        answered.on_token_settled = lambda: sessions.settled(claims)

    edge = RtcTransport(peer, client_gone, started, sessions.forget)
    task = peer.task = asyncio.create_task(
        run(front, edge, session_request, sampling, claims, client), name="rtc session"
    )
    try:  # the session goes on in its task, beyond this POST
        waited: set[asyncio.Future[object]] = {edge.answered, task}  # type: ignore[arg-type]
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        if not edge.answered.done():
            task.cancel()
        raise
    if not edge.answered.done():  # the lifecycle ended without a word: its error, or a plain 500
        task.result()
        raise RuntimeError("the WebRTC session ended before its answer")
    answered = edge.answered.result()  # the error that made the answer fail is raised here
    if isinstance(answered, Refused):
        return _refused(front, answered.exc, resume=resume, counted=answered.counted)
    if answered is None:
        return _plain(499, "client closed the request before its answer")
    session = edge.session
    assert session is not None
    front.metrics.rtc_answer.observe(time.monotonic() - posted_at)
    response = web.Response(status=201, text=answered, content_type="application/sdp")
    response.headers["Location"] = f"{RESOURCE_PREFIX}{session.session_id}/{peer.key}"
    response.headers["Cache-Control"] = "no-store"
    if session.resumed is not None:  # the next credential, before ICE: a resume that never connects is held
        credential = session.resume_metadata().get("resume")
        if isinstance(credential, str):
            response.headers[RESUME_HEADER] = credential
    for link in link_headers(ice_servers_for(front, session.claims, session.session_id)):
        response.headers.add("Link", link)
    return response


async def serve_ice_servers(
    front: FrontEnd, request: web.Request, claims: TokenClaims | None
) -> web.Response:
    """``GET /api/rtc/ice-servers`` after the access check: ``{"iceServers": [...]}`` (``RTCConfiguration``)
    with credentials minted for the token's id, and the same as ``Link`` headers. With ``DUPLEX_REGION`` and
    ``DUPLEX_PUBLIC_URL`` set (multi-region) also ``"offer_url"``: ``https://<domain>/r/<region>/api/rtc``,
    where the caller posts its offer so that it is answered in the region whose TURN relay these ICE
    servers name (``runtime.region_routes.offer_url``)."""
    servers = ice_servers_for(front, claims)
    answer: dict[str, object] = {"iceServers": [server.as_json() for server in servers]}
    config = front.config
    if config.region and config.public_url:
        answer["offer_url"] = offer_url(config.public_url, config.region)
    response = web.json_response(answer)
    response.headers["Cache-Control"] = "no-store"
    for link in link_headers(servers):
        response.headers.add("Link", link)
    return response


async def delete_session(front: FrontEnd, request: web.Request) -> web.Response:
    """``DELETE /api/rtc/<session id>/<key>``: 200 when the session was ended (here or by the worker that
    holds it), 404 otherwise (the rate limit is checked before: ``runtime.frontend.http``)."""
    match = _RESOURCE_RE.fullmatch(request.path.removeprefix(RESOURCE_PREFIX))
    if match is None:
        return _plain(404, f"no WebRTC session at {request.path}: DELETE the Location the POST answered")
    session_id, key = match["sid"], match["key"]
    if registry(front).hang_up_local(session_id, key) or await front.backend.hang_up(session_id, key):
        return _plain(200, f"session {session_id} ended")
    return _plain(404, f"no WebRTC session {session_id} on this node (ended already, or a wrong key)")
