"""The node's two token verifiers, built from its settings: the session-token one (``/api/chat``,
``/api/rtc``: ``DUPLEX_TOKEN_KEYS``) and the application-token one (the sessions API:
``DUPLEX_APP_TOKEN_KEYS``), each knowing the other's keys so that a token of one kind, or signed with a key
of the other kind, is refused by name (``wrong_token_kind``, ``wrong_key_kind``), with the lifetime caps
(``DUPLEX_TOKEN_MAX_TTL_S``, ``DUPLEX_APP_TOKEN_MAX_TTL_S``) and the deny-list
(``DUPLEX_TOKEN_REVOKED_JTIS``, ``DUPLEX_TOKEN_REVOKED_KIDS``). The checks themselves:
``runtime.frontend.gate.tokens.TokenVerifier``; the kinds: ``runtime.frontend.gate.app_tokens``.
"""

from __future__ import annotations

import logging

from runtime.config import RuntimeConfig
from runtime.frontend.gate.tokens import Revocations, TokenVerifier

__all__ = ["app_token_verifier", "revocations_from_config", "session_token_verifier"]

log = logging.getLogger(__name__)


def revocations_from_config(config: RuntimeConfig) -> Revocations:
    """The deny-list of the settings ``DUPLEX_TOKEN_REVOKED_JTIS`` and ``DUPLEX_TOKEN_REVOKED_KIDS``."""
    return Revocations(frozenset(config.token_revoked_jtis), frozenset(config.token_revoked_kids))


def session_token_verifier(config: RuntimeConfig) -> TokenVerifier:
    """The node's session-token verifier: its session keys, audience, leeway, ``DUPLEX_TOKEN_MAX_TTL_S``
    and deny-list; a token signed with one of its application keys is refused as ``wrong_key_kind``.

    Raises:
        ValueError: as ``RuntimeConfig.signing_keys`` (no usable keys).
    """
    app_keys = config.app_signing_keys() if config.has_app_keys else []
    return TokenVerifier(
        config.signing_keys(),
        config.token_audience,
        config.token_leeway_s,
        max_ttl_s=config.token_max_ttl_s,
        revoked=revocations_from_config(config),
        kind="session",
        other_kind_keys=app_keys,
    )


def app_token_verifier(config: RuntimeConfig) -> TokenVerifier | None:
    """The node's application-token verifier (for the sessions API; the session-token one is
    ``runtime.frontend.gate.tokens.session_token_verifier``), or None when it has none: access
    control off, or no application keys and no opt-in to the deprecated shared use.

    With ``DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true`` and no application keys the session keys verify
    application tokens too (logged as a deprecation warning): what every node did before the two kinds
    had keys of their own.

    Raises:
        ValueError: as ``RuntimeConfig.check_access_control`` (bad or overlapping keys).
    """
    if config.auth_mode == "off":
        return None
    if config.has_app_keys:
        keys = config.app_signing_keys()
        other = config.signing_keys()
    elif config.app_tokens_use_session_keys:
        log.warning(
            "DUPLEX_APP_TOKENS_USE_SESSION_KEYS=true (deprecated): the session-token keys also sign "
            "application tokens, so whatever mints callers' tokens can mint one that reads and erases "
            "sessions; set DUPLEX_APP_TOKEN_KEYS (`duplex token keygen`) and drop this setting"
        )
        keys, other = config.signing_keys(), []
    else:
        return None
    return TokenVerifier(
        keys,
        config.token_audience,
        config.token_leeway_s,
        max_ttl_s=config.app_token_max_ttl_s,
        revoked=revocations_from_config(config),
        kind="app",
        other_kind_keys=other,
    )
