"""The gate, written once: who may open a session on ``/api/chat``, ``/api/rtc`` (the offer and
``/api/rtc/ice-servers``) and what ``/api/admission`` answers (issue 31: three copies had drifted).

Two halves, so a carrier that authenticates after its upgrade (a phone media stream: its token comes in
its first message) runs the same checks in two steps:

- :func:`admit_connection`: what the connection itself shows, before any work: the handshake rate limits
  (per client address, then global; ``runtime.frontend.gate.ratelimit``) and the browser origin
  (``DUPLEX_ALLOWED_ORIGINS``). A carrier calls it when the connection arrives.
- :func:`admit_token`: the session token (signature, key, audience, time), the persona it allows and the
  replay check, against the session request parsed once. A carrier calls it on its first message, with the
  token that message carries; a connection presenting a resume credential skips it (the single-use
  credential is the right to the session, no token is spent).

:func:`admit` runs both for an HTTP request and returns one :class:`Admitted` (claims, client address, the
:class:`~runtime.frontend.gate.query.SessionRequest` parsed once, the resume credential as presented), or
raises :class:`GateRefused`. Every refusal is counted exactly once, where it belongs
(``RuntimeMetrics.refused``: a connection that presented a resume credential in
``duplex_resume_refused_total``, any other in ``duplex_admissions_refused_total``), by the function that
raises it; callers only answer it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.api import replayed_message
from runtime.frontend.codecs.protocol import ProtocolError
from runtime.frontend.gate.access import Access, RequestView, bearer_token, session_token
from runtime.frontend.gate.query import (
    RESUME_HEADER,
    TEXT_PROMPT_HEADER,
    ResumePresented,
    SessionRequest,
    parse_session_query,
)
from runtime.frontend.gate.refusals import REFUSALS
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected
from runtime.metrics import RuntimeMetrics

__all__ = [
    "Admitted",
    "Connection",
    "GateRefused",
    "admit",
    "admit_connection",
    "admit_token",
    "resume_presented",
]


class GateRefused(Exception):
    """A request refused by the gate, counted already (``RuntimeMetrics.refused``, once).

    Attributes:
        reason: a key of ``runtime.frontend.gate.refusals.REFUSALS`` (``rate_limited``, an access reason of
            ``runtime.frontend.gate.tokens.REFUSAL_STATUS``).
        status: the HTTP status of the refusal (the table's; 429 for ``rate_limited``).
        message: the sentence the caller reads (never a secret).
        retry_after: the ``Retry-After`` value in whole seconds (``rate_limited``), else None.
        resume: the refused connection presented a resume credential (counted in
            ``duplex_resume_refused_total``).
    """

    def __init__(self, reason: str, message: str, *, resume: bool, retry_after: str | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.status = REFUSALS[reason].status
        self.message = message
        self.resume = resume
        self.retry_after = retry_after

    @property
    def www_authenticate(self) -> str | None:
        """The ``WWW-Authenticate`` value of a 401 (RFC 6750, 3), else None."""
        if self.status != 401:
            return None
        return 'Bearer realm="duplex"' + ("" if self.reason == "missing" else ', error="invalid_token"')


@dataclass(frozen=True)
class Connection:
    """A connection past :func:`admit_connection`: the caller's address (trusted proxies applied) and
    whether it presented a resume credential (its refusals count in ``duplex_resume_refused_total``)."""

    client: str
    resume: bool


@dataclass(frozen=True)
class Admitted:
    """A request the gate let through.

    Attributes:
        claims: the session token's claims; None with ``auth_mode=off`` or for a resume (no token).
        client: the caller's address (``Access.client_address``).
        request: the session query parsed once (``parse_session_query``), or None when it does not parse:
            then ``query_error`` says why and the session refuses it ``bad_request`` (after the upgrade
            on ``/api/chat``: 1008 with its 0x05; 400 on ``/api/rtc``).
        query_error: why the query does not parse, or None.
        presented: the resume credential as the request presented it (header, subprotocol, query).
    """

    claims: TokenClaims | None
    client: str
    request: SessionRequest | None
    query_error: ProtocolError | None = None
    presented: ResumePresented = field(default_factory=ResumePresented)

    @property
    def resume(self) -> bool:
        """The request presented a resume credential."""
        return self.presented.given


def resume_presented(view: RequestView, *, subprotocols: bool = True) -> ResumePresented:
    """The resume credential as ``view`` presents it: the :data:`RESUME_HEADER` header, the
    ``duplex.resume.<credential>`` subprotocol (``subprotocols``: a WebSocket upgrade) and the deprecated
    ``?resume=`` (issue 34: a credential in the URL is kept by proxies' and load balancers' logs)."""
    protocols = view.get_all("Sec-WebSocket-Protocol") if subprotocols else ()
    return ResumePresented.of(view.param("resume"), view.get_all(RESUME_HEADER), protocols)


def admit_connection(
    access: Access,
    metrics: RuntimeMetrics,
    view: RequestView,
    *,
    origin: str | None,
    resume: bool,
    probe: bool = False,
) -> Connection:
    """The connection's half of the gate, before any work (no token verified, no Redis, no persona): the
    handshake rate limits, then the origin (None: not a browser, not checked).

    Args:
        access: the node's access rules.
        metrics: where the refusal is counted.
        view: the request (peer address, headers, query).
        origin: the browser origin to check (the ``Origin`` header; ``/api/admission`` also takes
            ``?origin=``).
        resume: the connection presented a resume credential (where a refusal counts).
        probe: ``/api/admission``: its origin verdict is reported, not counted (its rate limit is: the
            probe spends a handshake).

    Raises:
        GateRefused: ``rate_limited`` (429, ``Retry-After``) or ``origin_not_allowed`` (403), counted
            (but a probe's origin verdict).
    """
    limited = access.rate_limited(view)
    if limited is not None:
        metrics.refused("rate_limited", resume=resume)
        message = f"too many handshakes ({limited.scope} limit); retry after {limited.retry_after_header} s"
        raise GateRefused("rate_limited", message, resume=resume, retry_after=limited.retry_after_header)
    try:
        access.check_origin(origin)
    except TokenRejected as exc:
        if not probe:
            metrics.refused(exc.reason, resume=resume)
        raise GateRefused(exc.reason, exc.detail, resume=resume) from None
    return Connection(access.client_address(view), resume)


async def admit_token(
    access: Access,
    metrics: RuntimeMetrics,
    token: str | None,
    request: SessionRequest | None,
    *,
    count: bool = True,
) -> TokenClaims | None:
    """The token's half of the gate: signature, key, audience and time, then the persona the token allows
    (``request.voice_prompt``) and the replay check. Nothing is spent (``Access.spend`` does, once, when
    the session holds its slot). ``request`` None (a query that did not parse) skips the persona and
    replay checks: the session refuses it ``bad_request``, naming the parameter. A carrier calls this on
    its first message, after :func:`admit_connection` (never for a resume: the credential is the right).

    Args:
        access: the node's access rules.
        metrics: where the refusal is counted (a new session's: ``duplex_admissions_refused_total``).
        token: the session token as presented (None: none was).
        request: the session request, parsed once.
        count: False for a probe (``/api/admission``), which reports and counts nothing.

    Returns:
        The token's claims; None with ``auth_mode=off``.

    Raises:
        GateRefused: an access reason of ``runtime.frontend.gate.tokens.REFUSAL_STATUS`` (401, 403, or 503
            when the replay check is unavailable), counted unless ``count`` is False.
    """
    try:
        if access.verifier is None:
            return None
        claims = access.verifier.verify(token)
        if request is not None:
            access.verifier.check_persona(claims, request.voice_prompt)
            if access.replay_guard is not None and await access.replay_guard.seen(claims):
                raise TokenRejected("replayed", replayed_message(claims.token_id))
        return claims
    except TokenRejected as exc:
        if count:
            metrics.refused(exc.reason, resume=False)
        raise GateRefused(exc.reason, exc.detail, resume=False) from None


URL_SECRETS: dict[str, str] = {
    "token": "the duplex.token.<jwt> WebSocket subprotocol, or an Authorization: Bearer header",
    "resume": f"the {RESUME_HEADER} header, or the duplex.resume.<credential> WebSocket subprotocol",
    "text_prompt": 'text_prompt_in=metadata and a first 0x04 metadata message {"text_prompt": ...} on '
    f"/api/chat, the {TEXT_PROMPT_HEADER} header (percent-encoded UTF-8) on /api/rtc",
}
"""The query parameters that carry a secret (a session token, a resume credential, the persona's role
prompt), and where each goes instead: what ``DUPLEX_URL_SECRETS=refuse`` refuses in a URL."""


def refuse_url_secrets(
    metrics: RuntimeMetrics, view: RequestView, *, resume: bool, count: bool = True
) -> None:
    """Refuse a request whose URL carries one of :data:`URL_SECRETS` (``DUPLEX_URL_SECRETS=refuse``: a load
    balancer that logs full URLs, e.g. GKE's into Cloud Logging, would keep it; issue 34, item 9).

    Raises:
        GateRefused: ``bad_request`` (400) naming the parameter and where it goes instead; counted once
            (unless ``count`` is False: a probe's verdict).
    """
    for name, instead in URL_SECRETS.items():
        if view.param(name) is not None:
            if count:
                metrics.refused("bad_request", resume=resume)
            message = (
                f"bad request: {name}= in the URL: this node refuses secrets in URLs (DUPLEX_URL_SECRETS="
                f"refuse: load balancers log full URLs); send it as {instead}"
            )
            raise GateRefused("bad_request", message, resume=resume)


async def admit(
    access: Access,
    metrics: RuntimeMetrics,
    view: RequestView,
    *,
    subprotocols: bool = True,
    probe: bool = False,
) -> Admitted:
    """The whole gate for an HTTP request: :func:`admit_connection`, the query parsed once, then (unless
    the request presents a resume credential) :func:`admit_token` with the token from the
    ``duplex.token.<jwt>`` subprotocol (``subprotocols``: a WebSocket upgrade), ``Authorization: Bearer``
    or ``?token=``.

    Args:
        access: the node's access rules.
        metrics: where a refusal is counted, once.
        view: the request.
        subprotocols: the request is a WebSocket upgrade (its subprotocols may carry the token and the
            resume credential).
        probe: ``/api/admission``: the origin may also come as ``?origin=`` (a same-origin GET carries
            none), a resume credential is not looked for, and only the rate limit's refusal is counted
            (the probe spends a handshake; its verdicts are not refusals).

    Raises:
        GateRefused: the reason, its status and sentence (counted once, unless a probe's verdict).
    """
    presented = ResumePresented() if probe else resume_presented(view, subprotocols=subprotocols)
    origin = view.get("Origin")
    if probe and origin is None:
        origin = view.param("origin")
    connection = admit_connection(access, metrics, view, origin=origin, resume=presented.given, probe=probe)
    if access.config.url_secrets == "refuse":
        refuse_url_secrets(metrics, view, resume=presented.given, count=not probe)
    request: SessionRequest | None = None
    query_error: ProtocolError | None = None
    try:
        request = parse_session_query(view.query)
    except ProtocolError as exc:
        query_error = exc
    claims = None
    if not presented.given:  # a resume's credential is the right to the session: no token is spent
        token = (session_token(view) if subprotocols else None) or bearer_token(view) or view.param("token")
        claims = await admit_token(access, metrics, token, request, count=not probe)
    return Admitted(claims, connection.client, request, query_error, presented)
