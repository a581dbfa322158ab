"""Twilio's side of a Media Stream, played against a node's ``/api/carriers/twilio``: the generic carrier
client (``runtime.tools.carrier_client``) with Twilio's messages (``runtime.tools.carrier_sides.TwilioSide``),
under the names the tests and the node's bring-up check use.
"""

from __future__ import annotations

import ssl

import numpy as np

from runtime.tools.carrier_client import PACKET_S, CallResult, carrier_call
from runtime.tools.carrier_sides import TwilioSide

__all__ = ["PACKET_S", "TwilioCallResult", "twilio_call"]

TwilioCallResult = CallResult
"""What one call saw (``runtime.tools.carrier_client.CallResult``)."""


async def twilio_call(
    base_url: str,
    caller_8k: np.ndarray,
    *,
    auth_token: str,
    stream_url: str,
    parameters: dict[str, str] | None = None,
    dtmf: tuple[tuple[int, str], ...] = (),
    hang_up: str = "stop",
    tail_s: float = 0.5,
    media_format: dict[str, object] | None = None,
    signature: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    keep_messages: int = 0,
) -> CallResult:
    """One Twilio call: :func:`runtime.tools.carrier_client.carrier_call` with :class:`TwilioSide`,
    ``auth_token`` signing ``stream_url`` (the arguments as there; ``parameters`` are the TwiML's
    ``<Parameter>`` elements).

    Raises:
        ValueError: ``hang_up`` not ``stop`` or ``drop``.
    """
    return await carrier_call(
        TwilioSide(),
        base_url,
        caller_8k,
        secret=auth_token,
        stream_url=stream_url,
        parameters=parameters,
        dtmf=dtmf,
        hang_up=hang_up,
        tail_s=tail_s,
        media_format=media_format,
        signature=signature,
        ssl_context=ssl_context,
        keep_messages=keep_messages,
    )
