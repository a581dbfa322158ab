"""Every refusal the front end makes, in one table: reason -> HTTP status (before the upgrade, and in
``/api/admission``), WebSocket close code (after the upgrade) and, where it is fixed, the sentence.

Transports read it; none writes its own codes. ``tests/test_refusals.py`` holds each row to its values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from runtime.engine.api import REFUSAL_REASONS, RESUME_OFF_MESSAGE
from runtime.frontend.gate.tokens import REFUSAL_STATUS

__all__ = [
    "ADMISSION_REASONS",
    "CLOSE_GOING_AWAY",
    "CLOSE_INTERNAL_ERROR",
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_TRY_AGAIN_LATER",
    "DRAINING_MESSAGE",
    "ENGINE_LOST_MESSAGE",
    "LOADING_MESSAGE",
    "REFUSALS",
    "Admission",
    "RefusalKind",
    "SessionRefused",
    "refusal",
]

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013

DRAINING_MESSAGE = "node is draining for shutdown; connect to another node"
"""The 0x05 reason sent to a session refused while the node drains (and the admission check's message)."""
LOADING_MESSAGE = "node is loading the model; try again in a few minutes"
"""What every request but the probes gets while the model loads."""
CARRIER_OFF_MESSAGE = "this node has no bridge for this carrier configured"
"""A carrier's route on a node without its secret (e.g. no ``DUPLEX_TWILIO_AUTH_TOKEN``)."""
CARRIER_SIGNATURE_MESSAGE = "the carrier's request signature is missing or does not match"
"""A media stream whose signature header does not sign its URL with the carrier's secret."""
ENGINE_LOST_MESSAGE = "engine unreachable"
"""The close reason of sessions whose engine process died (close code 1011)."""


@dataclass(frozen=True)
class RefusalKind:
    """One row of :data:`REFUSALS`.

    Attributes:
        status: the HTTP status (a refusal before the upgrade, or ``/api/admission``'s ``status``).
        close_code: the WebSocket close code of the same refusal after the upgrade.
        message: the fixed sentence, or "" when the refusal words its own (it names the value at fault).
    """

    status: int
    close_code: int
    message: str = ""


REFUSALS: dict[str, RefusalKind] = {
    # The access check's refusals (runtime.frontend.gate.tokens), before the upgrade or when a token is spent.
    **{
        reason: RefusalKind(status, CLOSE_TRY_AGAIN_LATER if status == 503 else CLOSE_POLICY)
        for reason, status in REFUSAL_STATUS.items()
    },
    "rate_limited": RefusalKind(429, CLOSE_TRY_AGAIN_LATER),
    "bad_request": RefusalKind(400, CLOSE_POLICY),
    "draining": RefusalKind(503, CLOSE_TRY_AGAIN_LATER, DRAINING_MESSAGE),
    "not_ready": RefusalKind(503, CLOSE_TRY_AGAIN_LATER),
    "node_full": RefusalKind(503, CLOSE_TRY_AGAIN_LATER),
    "waiting_room_full": RefusalKind(503, CLOSE_TRY_AGAIN_LATER),
    "wait_timeout": RefusalKind(503, CLOSE_TRY_AGAIN_LATER),
    "engine_lost": RefusalKind(503, CLOSE_INTERNAL_ERROR, ENGINE_LOST_MESSAGE),
    # A resume (a connection presenting a credential) refused: the session cannot be resumed with it.
    "resume_off": RefusalKind(404, CLOSE_POLICY, RESUME_OFF_MESSAGE),
    "resume_invalid": RefusalKind(403, CLOSE_POLICY),
    "resume_replayed": RefusalKind(403, CLOSE_POLICY),
    "resume_expired": RefusalKind(410, CLOSE_POLICY),
    # The session's owner is still connected and sending: a resume takes over a lost connection only
    # (runtime.engine.resume.PROBE_S); the owner keeps its call and its credential.
    "resume_live": RefusalKind(409, CLOSE_POLICY),
    # A phone carrier's media stream (runtime.frontend.transports.carriers), before its upgrade.
    "carrier_off": RefusalKind(404, CLOSE_POLICY, CARRIER_OFF_MESSAGE),
    "carrier_signature": RefusalKind(403, CLOSE_POLICY, CARRIER_SIGNATURE_MESSAGE),
}
"""Every refusal reason (the ``reason`` label of ``duplex_admissions_refused_total``) and its answers."""

assert set(REFUSAL_REASONS) <= set(REFUSALS), "every backend refusal has a row"

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
``runtime.frontend.gate.tokens.REFUSAL_STATUS``, and the refusals made after the upgrade."""


class SessionRefused(Exception):
    """A session refused, for any reason of :data:`REFUSALS`.

    Attributes:
        reason: the row's key; kind: the row; message: the sentence the caller reads.

    Raises:
        KeyError: (on construction) a reason with no row.
    """

    def __init__(self, reason: str, message: str = "") -> None:
        self.reason = reason
        self.kind = REFUSALS[reason]
        self.message = message or self.kind.message
        super().__init__(self.message)


def refusal(reason: str, message: str = "") -> SessionRefused:
    """:class:`SessionRefused` for ``reason`` (its table sentence unless ``message`` is given)."""
    return SessionRefused(reason, message)


@dataclass(frozen=True)
class Admission:
    """What ``GET /api/admission`` answers: would ``/api/chat`` with this query, token and origin open a
    session now, and if not, why (the same words the refusal itself would carry).

    Attributes:
        ok: a session would be admitted now.
        status: the HTTP status equivalent: 200 when ok, else the refusal's row in :data:`REFUSALS`.
        reason: one of :data:`ADMISSION_REASONS` (snake_case, stable: clients map it to their own words).
        message: the runtime's sentence.
    """

    ok: bool
    status: int
    reason: str
    message: str

    @classmethod
    def refused(cls, exc: SessionRefused) -> Admission:
        """The admission answer of a refusal (its status from the table)."""
        return cls(False, exc.kind.status, exc.reason, exc.message)

    def as_json(self) -> bytes:
        """The JSON body, UTF-8, newline-terminated."""
        body = {"ok": self.ok, "status": self.status, "reason": self.reason, "message": self.message}
        return (json.dumps(body) + "\n").encode()
