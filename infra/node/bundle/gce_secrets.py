"""The Secret Manager secrets of a GCE node (``infra.node.bundle.cloud_init``): which roles exist beyond the
bundle's ``SECRET_FILES`` (``EXTRA_SECRET_ROLES``), the check of the secret ids a stack passes against the
profile, and where each secret lands on the VM with which mode. Secret values never enter the user-data:
the preparation script fetches them by id at every start. ``infra.node.bundle.cloud_init`` re-exports the
public names."""

from __future__ import annotations

import re

from infra.node.bundle.compose import CONTAINER_READ_SECRETS
from infra.node.bundle.services import OPTIONAL_SECRET_FILES, SECRET_FILES, SECRETS_DIR, optional_secret_roles
from infra.node.profile.profiles import NodeProfile

__all__ = ["EXTRA_SECRET_ROLES", "HF_TOKEN_FILE", "check_secrets", "secret_targets"]

HF_TOKEN_FILE = f"{SECRETS_DIR}/hf-token.env"
"""Where the Hugging Face token goes (``HF_TOKEN=...``, bundle-relative); the unit's ``EnvironmentFile``."""

EXTRA_SECRET_ROLES = {
    "hf_token": f"the bare Hugging Face token, written as HF_TOKEN=... to {HF_TOKEN_FILE}",
    "tls_certificate": "PEM certificate chain, written to tls.certificate_path (tls.mode: files)",
    "tls_private_key": "PEM private key, written to tls.private_key_path (tls.mode: files)",
    "alert_email_password": "the SMTP password of the e-mail alert receiver (alerting.email_password)",
    "alert_pagerduty_routing_key": "the PagerDuty Events API v2 routing key (alerting.pagerduty)",
}
"""Optional Secret Manager roles beyond ``SECRET_FILES``, with what each secret holds."""

_SECRET_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_PROJECT_ID_RE = re.compile(r"^([a-z][a-z0-9.-]{0,61}[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]$")


def check_secrets(
    profile: NodeProfile, secrets: dict[str, str] | None, project_id: str | None
) -> dict[str, str] | None:
    """``secrets`` (``{role: Secret Manager secret id}``) sorted by role, after checking them against the
    profile; None stays None.

    Raises:
        ValueError: a project id that is not one, an unknown or missing role (naming the allowed ones), a
            malformed secret id, a role the profile does not use, or half of a TLS pair.
    """
    if project_id is not None and not _PROJECT_ID_RE.match(project_id):
        raise ValueError(f"project_id {project_id!r} is not a Google Cloud project id")
    if secrets is None:
        return None
    allowed = set(SECRET_FILES) | set(EXTRA_SECRET_ROLES)
    unknown = sorted(set(secrets) - allowed)
    if unknown:
        raise ValueError(
            f"secret_manager_secrets: unknown role(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    missing = sorted((set(SECRET_FILES) | set(optional_secret_roles(profile))) - set(secrets))
    if missing:
        raise ValueError(
            f"secret_manager_secrets: missing role(s) {', '.join(missing)}; every role of SECRET_FILES, and "
            "those the profile's alert receivers use, needs a Secret Manager secret"
        )
    for role, secret_id in secrets.items():
        if not _SECRET_ID_RE.match(secret_id):
            raise ValueError(
                f"secret_manager_secrets[{role!r}]: {secret_id!r} is not a Secret Manager secret id "
                "(1-255 letters, digits, '_' or '-')"
            )
    unused = sorted(set(secrets) & (set(OPTIONAL_SECRET_FILES) - set(optional_secret_roles(profile))))
    if unused:
        raise ValueError(
            f"secret_manager_secrets: {', '.join(unused)} given but the profile's alerting does not use it "
            "(alerting.email_password, alerting.pagerduty)"
        )
    tls_roles = {"tls_certificate", "tls_private_key"} & set(secrets)
    if tls_roles and profile.tls.mode != "files":
        raise ValueError(
            f"secret_manager_secrets: {', '.join(sorted(tls_roles))} given but tls.mode is "
            f"{profile.tls.mode!r}; set tls.mode to 'files' to install a certificate from Secret Manager"
        )
    if len(tls_roles) == 1:
        raise ValueError("secret_manager_secrets: tls_certificate and tls_private_key go together")
    return {role: secrets[role] for role in sorted(secrets)}


def secret_targets(profile: NodeProfile, root: str) -> dict[str, tuple[str, str, str]]:
    """{role: (absolute path on the VM, mode, env variable name or "")}, bundle files under ``root``."""
    targets = {
        role: (f"{root}/{path}", "0640" if role in CONTAINER_READ_SECRETS else "0600", "")
        for role, path in SECRET_FILES.items()
    }
    targets["hf_token"] = (f"{root}/{HF_TOKEN_FILE}", "0600", "HF_TOKEN")
    targets["tls_certificate"] = (profile.tls.certificate_path, "0644", "")
    targets["tls_private_key"] = (profile.tls.private_key_path, "0600", "")
    for role, path in OPTIONAL_SECRET_FILES.items():
        targets[role] = (f"{root}/{path}", "0640", "")
    return targets
