"""One phone carrier's protocol as the carrier-generic edge (``edge.py``) sees it: the neutral events a
carrier's messages become (:class:`CarrierEvent`), what its ``start`` message says (:class:`CallStart`), and
the :class:`Dialect` each carrier module implements (its upgrade's signature, its ``start``, its media,
clear and checkpoint messages)."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from aiohttp import web

from runtime.config import RuntimeConfig
from runtime.frontend.codecs.telephony import CarrierEncoding

__all__ = ["CallStart", "CarrierEvent", "CarrierProtocolError", "Dialect"]


class CarrierProtocolError(ValueError):
    """A carrier message this bridge refuses: ``reason`` (the outcome ``protocol_<reason>``), and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CallStart:
    """What a carrier's ``start`` message says of the call.

    Attributes:
        stream_id, call_id: the carrier's identifiers (Twilio's ``streamSid``/``callSid``, Plivo's
            ``streamId``/``callId``).
        parameters: the call's parameters (``token``, ``voice_prompt``, ...), wherever the carrier put them.
        encoding, rate_hz: the stream's audio (both directions), e.g. μ-law at 8000 Hz.
    """

    stream_id: str
    call_id: str
    parameters: dict[str, str] = field(default_factory=dict)
    encoding: CarrierEncoding = CarrierEncoding.MULAW
    rate_hz: int = 8000


@dataclass(frozen=True)
class CarrierEvent:
    """A carrier message after ``start``, in neutral terms: ``media`` (``payload``: base64 audio),
    ``played`` (``name``: a checkpoint this side sent, played out), ``dtmf`` (``digit``), ``stop`` (a
    hang-up), ``start`` (a second one: refused), ``ignore`` (an acknowledgement with nothing to do)."""

    kind: Literal["media", "played", "dtmf", "stop", "start", "ignore"]
    payload: str = ""
    name: str = ""
    digit: str = ""


class Dialect(abc.ABC):
    """One carrier's protocol, bound to one call (its :class:`CallStart`). The class methods act before
    the call exists (the upgrade, the ``start`` message)."""

    name: ClassVar[str]
    """The carrier's name: the transport's metric label and the outcome's log name (``twilio``)."""
    path: ClassVar[str]
    """The node's route for this carrier (``/api/carriers/twilio``)."""
    log: ClassVar[logging.Logger]
    """The carrier module's logger: refusals and bad input are logged there."""
    admits_on_credential: ClassVar[bool] = False
    """True: the carrier's credential admits the call (no session token; :meth:`check_persona` is the
    persona policy), for a carrier whose calls cannot carry a token (Exotel)."""
    secret_env: ClassVar[str]
    """The setting that turns the bridge on (``DUPLEX_TWILIO_AUTH_TOKEN``), named in ``carrier_off``."""

    def __init__(self, start: CallStart) -> None:
        self.start = start

    # --- before the call ------------------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def secret(cls, config: RuntimeConfig) -> str | None:
        """The node's secret for this carrier (read per call: a rotated file is picked up), or None when
        the bridge is off."""

    @classmethod
    @abc.abstractmethod
    def signed(cls, config: RuntimeConfig, secret: str, request: web.Request) -> bool:
        """Whether the upgrade ``request`` carries the carrier's valid signature with ``secret``."""

    @classmethod
    def check_persona(cls, config: RuntimeConfig, voice_prompt: str | None) -> str | None:
        """For a dialect that :attr:`admits_on_credential`: None when the call may use ``voice_prompt``,
        else the sentence of its ``persona_not_allowed`` refusal. Default: any."""
        return None

    @classmethod
    def upgrade_parameters(cls, request: web.Request) -> dict[str, str]:
        """Call parameters the upgrade itself carries (Plivo: the stream URL's query); the ``start``
        message's win over these. Default: none (Twilio drops a stream URL's query)."""
        return {}

    @classmethod
    @abc.abstractmethod
    def read_start(cls, event: dict[str, object]) -> CallStart | None:
        """One message before the call: None to skip it (Twilio's ``connected``), else the call's start.

        Raises:
            SessionRefused: ``bad_request``: another message, or a media format this bridge does not carry,
                named.
        """

    # --- the call -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def parse(self, event: dict[str, object]) -> CarrierEvent:
        """One message after ``start`` as a :class:`CarrierEvent`.

        Raises:
            CarrierProtocolError: ``unknown_event``, naming it.
        """

    @abc.abstractmethod
    def media(self, payload: str) -> dict[str, object]:
        """The message that plays ``payload`` (base64 of one 20 ms packet) to the caller."""

    @abc.abstractmethod
    def clear(self) -> dict[str, object]:
        """The message that empties the carrier's queue of the agent's audio (barge-in)."""

    @abc.abstractmethod
    def checkpoint(self, name: str) -> dict[str, object]:
        """The message the carrier echoes (:class:`CarrierEvent` ``played``) once the audio before it
        played out."""


class MediaMarkClearDialect(Dialect):
    """The message shape Twilio Media Streams introduced and Telnyx and Exotel follow: each message
    ``{"event": <kind>, <stream key>: <stream id>, <kind>: {...}}``; in: ``media`` (``payload``), ``mark``
    (its ``name`` played out), ``dtmf`` (``digit``), ``stop``; out: ``media``, ``mark``, ``clear``. The
    carriers differ in the stream id's key (:attr:`stream_key`: Twilio ``streamSid``, Exotel
    ``stream_sid``, Telnyx none), in the start message, and in what :meth:`other_event` takes."""

    stream_key: ClassVar[str | None]
    """The key that stamps each outgoing message with the stream's id, or None (Telnyx sends none)."""

    def parse(self, event: dict[str, object]) -> CarrierEvent:
        kind = event.get("event")
        body = event.get(str(kind)) if isinstance(kind, str) else None
        body = body if isinstance(body, dict) else {}
        if kind == "media":
            if not self.inbound(body):
                return CarrierEvent("ignore")
            return CarrierEvent("media", payload=str(body.get("payload", "")))
        if kind == "mark":
            return CarrierEvent("played", name=str(body.get("name")))
        if kind == "dtmf":
            return CarrierEvent("dtmf", digit=str(body.get("digit", "")))
        if kind in ("stop", "start"):
            return CarrierEvent(kind)  # type: ignore[arg-type]
        other = self.other_event(str(kind), event)
        if other is None:
            raise CarrierProtocolError("unknown_event", f"unknown event {str(kind)[:40]!r}")
        return other

    def inbound(self, media: dict[str, object]) -> bool:
        """Whether a ``media`` body is the caller's audio (default: every one)."""
        return True

    def other_event(self, kind: str, event: dict[str, object]) -> CarrierEvent | None:
        """A carrier's own event beyond the shared ones, or None: unknown (default: none)."""
        return None

    def _message(self, kind: str, body: dict[str, object] | None = None) -> dict[str, object]:
        stamp = {} if self.stream_key is None else {self.stream_key: self.start.stream_id}
        return {"event": kind, **stamp, **({kind: body} if body is not None else {})}

    def media(self, payload: str) -> dict[str, object]:
        return self._message("media", {"payload": payload})

    def clear(self) -> dict[str, object]:
        return self._message("clear")

    def checkpoint(self, name: str) -> dict[str, object]:
        return self._message("mark", {"name": name})
