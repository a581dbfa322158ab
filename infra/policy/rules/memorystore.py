"""The rule on ``gcp:redis/instance:Instance`` (Memorystore): AUTH and transit encryption."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.policy.rules._common import (
    REDIS,
    _normalize,
    _q,
    is_unknown,
)

# --------------------------------------------------------------------------------------------------------
# Rule 5: Redis requires AUTH (and TLS)
# --------------------------------------------------------------------------------------------------------


def redis_requires_auth(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A Memorystore Redis instance (``gcp:redis/instance:Instance``) has ``authEnabled: true`` and
    ``transitEncryptionMode: "SERVER_AUTHENTICATION"``: the session store holds live conversation state,
    so clients authenticate and the AUTH string never crosses the VPC in clear text.

    Missing values are violations (the defaults are false and DISABLED). Each property passes on its own
    when it is unknown during preview.
    """
    if resource_type != REDIS:
        return []
    p = _normalize(props)
    messages = []
    auth = p.get("authEnabled")
    if not is_unknown(auth) and auth is not True:
        now = "is not set (default false)" if auth is None else f"is {_q(auth)}"
        messages.append(
            f"authEnabled {now}: Redis must require AUTH. Set authEnabled = true (Python: auth_enabled=True) "
            f"and hand the instance's authString to the runtime as a secret."
        )
    mode = p.get("transitEncryptionMode")
    if not is_unknown(mode) and not (isinstance(mode, str) and mode.upper() == "SERVER_AUTHENTICATION"):
        now = "is not set (default DISABLED)" if mode is None else f"is {_q(mode)}"
        messages.append(
            f"transitEncryptionMode {now}: the AUTH string would cross the network in clear text. Set "
            f'transitEncryptionMode = "SERVER_AUTHENTICATION" '
            f'(Python: transit_encryption_mode="SERVER_AUTHENTICATION") and give clients the server CA.'
        )
    return messages
