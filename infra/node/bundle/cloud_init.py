"""cloud-init user-data that turns a fresh GCE VM (a Deep Learning VM image, ``DLVM_IMAGE_FAMILY``) into a
node: ``render_cloud_init`` gives ``cloud-init/user-data.yaml``, which writes the bundle under
``/etc/duplex`` and runs it under the systemd unit ``duplex-node.service`` (the preparation script, then
``docker compose up``; ``docker compose down`` within ``node_stop_timeout_s`` on stop). Secret values never
enter the user-data: it names Secret Manager secrets by id, fetched at every start. A user-data over GCE's
256 KB metadata value limit (``GCE_METADATA_VALUE_LIMIT``) is refused.

What the VM does at boot, the secrets' payloads and the service account's role: docs/deploying.md, "Stack
`dev` (GCP, T4, INT8)"."""

from __future__ import annotations

import base64
import gzip
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

from infra.node.bundle.acme import SERVICE as ACME_SERVICE
from infra.node.bundle.acme import TIMERS as ACME_TIMERS
from infra.node.bundle.acme import acme_dirs, render_acme_host_files
from infra.node.bundle.compose import (
    COMPOSE_FILE,
    CONTAINER_READ_SECRETS,
    host_directories,
    node_stop_timeout_s,
    tls_reload_command,
)
from infra.node.bundle.first_boot import OPS_AGENT_INSTALL, apt_install, apt_lock_file, retried
from infra.node.bundle.gce_secrets import EXTRA_SECRET_ROLES, HF_TOKEN_FILE, check_secrets, secret_targets
from infra.node.bundle.services import OPTIONAL_SECRET_FILES, SECRET_FILES, SECRETS_DIR, optional_secret_roles
from infra.node.profile.profiles import NodeProfile
from infra.yaml_text import dump_yaml

__all__ = [
    "DLVM_IMAGE_FAMILY",
    "DLVM_IMAGE_PROJECT",
    "DOCKER_CONFIG_DIR",
    "EXTRA_SECRET_ROLES",
    "GCE_METADATA_VALUE_LIMIT",
    "HF_TOKEN_FILE",
    "NODE_ROOT",
    "PREPARE_SCRIPT",
    "UNIT_NAME",
    "USER_DATA_FILE",
    "google_registry_host",
    "render_cloud_init",
    "render_prepare_script",
]

USER_DATA_FILE = "cloud-init/user-data.yaml"
"""The bundle path of the rendered user-data (never written onto the VM by itself)."""

NODE_ROOT = "/etc/duplex"
"""Where the bundle lives on the VM: the Compose project directory; secrets in ``NODE_ROOT/secrets``."""

UNIT_NAME = "duplex-node.service"
PREPARE_SCRIPT = "/usr/local/sbin/duplex-node-prepare"

DLVM_IMAGE_PROJECT = "deeplearning-platform-release"
DLVM_IMAGE_FAMILY = "common-cu128-ubuntu-2204-nvidia-570"
"""The boot image this user-data is written for (Ubuntu 22.04, NVIDIA driver 570, CUDA 12.8, Docker,
NVIDIA Container Toolkit, Google Cloud CLI)."""

GCE_METADATA_VALUE_LIMIT = 256 * 1024
"""Largest value of one GCE metadata entry, in bytes (the user-data is one entry)."""

_DOCKER = "/usr/bin/docker"
_GOOGLE_REGISTRY_RE = re.compile(r"^([a-z0-9-]+-docker\.pkg\.dev|([a-z]+\.)?gcr\.io)/")

DOCKER_CONFIG_DIR = "/root/.docker"
"""Docker's configuration directory for the unit's ``docker compose`` (registry logins)."""


def google_registry_host(image: str) -> str | None:
    """The registry host of ``image`` when it is Artifact Registry (``REGION-docker.pkg.dev``) or Container
    Registry (``gcr.io``): the VM logs Docker in to it with its service account. None otherwise.

    >>> google_registry_host("us-central1-docker.pkg.dev/p/repo/runtime@sha256:" + "0" * 64)
    'us-central1-docker.pkg.dev'
    """
    match = _GOOGLE_REGISTRY_RE.match(image)
    return match.group(1) if match else None


GUEST_ATTRIBUTE_TLS_SHA256 = "duplex/tls-sha256"
"""The GCE guest attribute (namespace/key) where the node publishes its serving certificate's SHA-256
fingerprint at each start (needs the instance metadata ``enable-guest-attributes: TRUE``); read it with
``gcloud compute instances get-guest-attributes VM --zone ZONE --query-path=duplex/tls-sha256``."""

_SECRET_FETCH_ATTEMPTS = 5
_SECRET_FETCH_PAUSE_S = 10
_SELF_SIGNED_DAYS = 365


def render_cloud_init(
    profile: NodeProfile,
    bundle: dict[str, bytes],
    *,
    secret_manager_secrets: dict[str, str] | None = None,
    project_id: str | None = None,
) -> dict[str, bytes]:
    """``{"cloud-init/user-data.yaml": ...}``: a ``#cloud-config`` document that installs ``bundle`` (from
    ``render_bundle``; its own user-data entry is left out) under ``/etc/duplex`` on a fresh VM and runs
    the node with systemd. The same arguments always give the same bytes.

    Args:
        secret_manager_secrets: ``{role: Secret Manager secret id}`` for every role of ``SECRET_FILES``
            (plus, optionally, the roles of ``EXTRA_SECRET_ROLES``). None: the secrets are put in place
            by other means before the unit starts; the unit checks that they are there.
        project_id: the project holding the secrets; None: the VM's own project (gcloud's default there).

    Raises:
        ValueError: the profile is not a ``compose`` node; the bundle holds a secret file or a path that
            is absolute or climbs out; a role is unknown or missing, a secret or project id is malformed,
            or a TLS secret is given for a self-signed profile; the user-data exceeds
            ``GCE_METADATA_VALUE_LIMIT``.
    """
    if profile.deployment != "compose":
        raise ValueError(
            f"deployment: profile {profile.name!r} has deployment={profile.deployment!r}; cloud-init "
            "user-data is rendered only for deployment='compose' (a VM running compose.yaml)"
        )
    if COMPOSE_FILE not in bundle:
        raise ValueError(
            f"the bundle has no {COMPOSE_FILE}: render it with infra.node.bundle.render.render_bundle"
        )
    files = _bundle_files(bundle)
    secret_roles = check_secrets(profile, secret_manager_secrets, project_id)
    compose = f"{_DOCKER} compose --project-directory {NODE_ROOT} --file {NODE_ROOT}/{COMPOSE_FILE}"

    write_files: list[dict[str, Any]] = [
        {
            "path": f"{NODE_ROOT}/{path}",
            "owner": "root:root",
            "permissions": "0644",
            "encoding": "gz+b64",
            "content": base64.b64encode(gzip.compress(content, compresslevel=9, mtime=0)).decode("ascii"),
        }
        for path, content in files.items()
    ]
    write_files.append(
        {
            "path": PREPARE_SCRIPT,
            "owner": "root:root",
            "permissions": "0755",
            "content": _prepare_script(profile, secret_roles, project_id, on_gce=True),
        }
    )
    write_files.append(
        {
            "path": f"/etc/systemd/system/{UNIT_NAME}",
            "owner": "root:root",
            "permissions": "0644",
            "content": _unit(profile, compose),
        }
    )
    runcmd_acme: list[list[str]] = []
    if profile.tls.mode == "acme":
        acme_files = render_acme_host_files(profile, reload_command=tls_reload_command(profile, compose))
        for path, (mode, content) in acme_files.items():
            write_files.append({"path": path, "owner": "root:root", "permissions": mode, "content": content})
        install_certbot = f"command -v certbot >/dev/null || {{ {apt_install('certbot')}; }}"
        runcmd_acme = [["sh", "-c", install_certbot], ["systemctl", "enable", "--now", *ACME_TIMERS]]
    install_compose = (
        f"{_DOCKER} compose version >/dev/null 2>&1 || {{ {apt_install('docker-compose-plugin')}; }}"
    )
    write_files.insert(0, apt_lock_file())  # before any install (write_files runs before runcmd)
    ops_agent = retried(OPS_AGENT_INSTALL, "the Ops Agent install")
    document = {
        "write_files": write_files,
        "runcmd": [
            ["sh", "-c", install_compose],
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", UNIT_NAME],
            ["systemctl", "start", "--no-block", UNIT_NAME],
            *runcmd_acme,
            # Logs and host metrics leave the VM (OPS_AGENT_INSTALL); the node does not wait for it.
            ["sh", "-c", f"systemctl is-active --quiet google-cloud-ops-agent || {{ {ops_agent}; }}"],
        ],
    }
    secrets_note = (
        "they are fetched from Secret Manager when the node starts"
        if secret_roles is not None
        else f"write them into {NODE_ROOT}/{SECRETS_DIR}/ before the node starts"
    )
    header = (
        "#cloud-config\n"
        f"# Rendered by infra.node.bundle.cloud_init for profile {profile.name!r}. Do not edit: re-render.\n"
        f"# Boot image: family {DLVM_IMAGE_FAMILY} in project {DLVM_IMAGE_PROJECT}.\n"
        f"# No secret values here: {secrets_note}.\n"
    )
    user_data = (header + _dump(document)).encode()
    if len(user_data) > GCE_METADATA_VALUE_LIMIT:
        largest = sorted(files.items(), key=lambda item: len(item[1]), reverse=True)[:5]
        sizes = ", ".join(f"{path} ({len(content)} bytes)" for path, content in largest)
        raise ValueError(
            f"the user-data is {len(user_data)} bytes, over GCE's {GCE_METADATA_VALUE_LIMIT}-byte limit on "
            f"one metadata value (files gzip-compressed); largest bundle files: {sizes}"
        )
    return {USER_DATA_FILE: user_data}


def _bundle_files(bundle: dict[str, bytes]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for path in sorted(bundle):
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            raise ValueError(f"bundle path {path!r} must be relative and stay inside the bundle")
        if pure.parts[0] == SECRETS_DIR:
            raise ValueError(
                f"bundle path {path!r} is a secret file: secrets never go into user-data (instance metadata "
                "is readable on the VM and by project viewers); name Secret Manager secrets instead"
            )
        if path == USER_DATA_FILE:
            continue
        files[path] = bundle[path]
    return files


# --- the preparation script ------------------------------------------------------------------------------


def render_prepare_script(profile: NodeProfile, *, root: str = NODE_ROOT) -> str:
    """The preparation script for a node whose secrets are written by other means (over SSH: the
    on-premises stack) into ``root/secrets``: host directories, the self-signed certificate when none
    exists, then a check that every secret file is there (modes fixed). ``root`` is the bundle root on the
    host (absolute). Run it as root before ``docker compose up``; it is idempotent.

    Raises:
        ValueError: ``root`` is not an absolute path of letters, digits, '.', '_', '-' and '/'.
    """
    if not re.match(r"^/[A-Za-z0-9._/-]*$", root):
        raise ValueError(f"root: {root!r} must be an absolute path of letters, digits, '.', '_', '-' and '/'")
    return _prepare_script(profile, None, None, root=root.rstrip("/") or "/")


def _prepare_script(
    profile: NodeProfile,
    secrets: dict[str, str] | None,
    project_id: str | None,
    *,
    root: str = NODE_ROOT,
    on_gce: bool = False,
) -> str:
    q = shlex.quote
    lines = [
        "#!/bin/sh",
        f"# Rendered by infra.node.bundle.cloud_init for profile {profile.name!r}. Run by {UNIT_NAME} before",
        "# `docker compose up`: host directories, TLS certificate, secrets. Idempotent.",
        "set -eu",
        'export PATH="$PATH:/snap/bin:/usr/lib/google-cloud-sdk/bin"',
        'export HOME="${HOME:-/root}"',
        f"ROOT={q(root)}",
        'log() { echo "duplex-node-prepare: $*" >&2; }',
        "",
        "# Directories the containers write, owned by the users they run as.",
        "umask 022",
    ]
    for d in host_directories(profile):
        path = q(d.path)
        lines.append(f"mkdir -p {path} && chown {d.uid}:{d.gid} {path} && chmod {d.mode:04o} {path}")

    registry = google_registry_host(profile.runtime_image) if on_gce else None
    if registry is not None:
        lines += [
            "",
            f"# The runtime image is in {registry}: log Docker in with the VM service account's token",
            f"# (roles/artifactregistry.reader); docker compose reads {DOCKER_CONFIG_DIR} (set by the unit).",
            f"export DOCKER_CONFIG={q(DOCKER_CONFIG_DIR)}",
            "n=0",
            "until gcloud auth print-access-token --quiet | "
            f"{_DOCKER} login --username oauth2accesstoken --password-stdin "
            f"{q('https://' + registry)} >/dev/null; do",
            "    n=$((n + 1))",
            f'    if [ "$n" -ge {_SECRET_FETCH_ATTEMPTS} ]; then',
            f'        log "cannot log Docker in to {registry} (service account role?)"; exit 1',
            "    fi",
            f"    sleep {_SECRET_FETCH_PAUSE_S}",
            "done",
        ]

    crt, key = q(profile.tls.certificate_path), q(profile.tls.private_key_path)
    lines += ["", f"# TLS (tls.mode: {profile.tls.mode})."]
    if profile.tls.mode == "acme":
        # A certificate certbot already holds (its state is under data_dir, kept with the node's data)
        # goes where nginx reads it; else the self-signed one below lets nginx start until the first is
        # issued (infra.node.bundle.acme).
        live = acme_dirs(profile).live_dir
        chain, private = q(f"{live}/fullchain.pem"), q(f"{live}/privkey.pem")
        lines += [
            f"if [ -s {chain} ] && [ -s {private} ] && ! cmp -s {chain} {crt}; then",
            f'    log "installing the ACME certificate of {live}"',
            f"    install -m 0600 {private} {key}.tmp && mv -f {key}.tmp {key}",
            f"    install -m 0644 {chain} {crt}.tmp && mv -f {crt}.tmp {crt}",
            "fi",
        ]
    if profile.tls.mode in ("self-signed", "acme"):
        domain = profile.domain
        subject = q(f"/CN={domain}")
        names = q(f"subjectAltName=DNS:{domain},DNS:localhost,IP:127.0.0.1")
        lines += [
            f"if [ ! -s {crt} ] || [ ! -s {key} ]; then",
            f'    log "no certificate at {profile.tls.certificate_path}: generating a self-signed one"',
            "    (",
            "        umask 077",
            "        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \\",
            f"            -days {_SELF_SIGNED_DAYS} -subj {subject} -addext {names} \\",
            "            -addext extendedKeyUsage=serverAuth \\",
            f"            -keyout {key}.tmp -out {crt}.tmp",
            "    )",
            f"    chmod 0644 {crt}.tmp",
            f"    mv -f {key}.tmp {key}",
            f"    mv -f {crt}.tmp {crt}",
            "fi",
        ]
    elif secrets is None or "tls_certificate" not in secrets:
        lines += [
            f"for f in {crt} {key}; do",
            '    [ -s "$f" ] && continue',
            '    log "missing $f (tls.mode: files): install the certificate and key"; exit 1',
            "done",
        ]
    if secrets is None or "tls_certificate" not in secrets:
        lines += _fingerprint_lines(crt, on_gce=on_gce)

    lines += [
        "",
        "# Secrets: secrets/ 0700; files 0600, or 0640 (root:root) for those a container reads itself.",
        "umask 077",
        'mkdir -p "$ROOT/secrets" && chown root:root "$ROOT/secrets" && chmod 0700 "$ROOT/secrets"',
    ]
    targets = secret_targets(profile, NODE_ROOT)
    if secrets is None:
        secret_paths = [q(f"{root}/{SECRET_FILES[role]}") for role in sorted(SECRET_FILES)]
        lines += [
            "# Not from Secret Manager: whoever brings the node up writes them; check they are there.",
            f"for f in {' '.join(secret_paths)}; do",
            '    [ -s "$f" ] && continue',
            '    log "missing secret file $f: write the node\'s secrets first"; exit 1',
            "done",
        ]
        for role in sorted(CONTAINER_READ_SECRETS):
            lines.append(f"chmod 0640 {q(f'{root}/{SECRET_FILES[role]}')}")
        for role in optional_secret_roles(profile):  # the alert receivers' secrets (Alertmanager reads them)
            path = q(f"{root}/{OPTIONAL_SECRET_FILES[role]}")
            lines += [
                f'[ -s {path} ] || {{ log "missing secret file {path} (alerting)"; exit 1; }}',
                f"chmod 0640 {path}",
            ]
        return "\n".join(lines) + "\n"

    project = f" --project={q(project_id)}" if project_id is not None else ""
    lines += [
        "# fetch SECRET_ID TARGET MODE [ENV_NAME]: the latest version into TARGET (as ENV_NAME=value when",
        "# ENV_NAME is given); on failure keep an existing TARGET, else stop.",
        "fetch() {",
        "    secret=$1 target=$2 mode=$3 name=${4:-}",
        '    tmp="$target.tmp"',
        "    n=0",
        f'    until gcloud secrets versions access latest --secret="$secret"{project} --quiet >"$tmp"; do',
        "        n=$((n + 1))",
        f'        if [ "$n" -ge {_SECRET_FETCH_ATTEMPTS} ]; then',
        '            rm -f "$tmp"',
        '            if [ -s "$target" ]; then',
        '                log "cannot read secret $secret; keeping the previous $target"; return 0',
        "            fi",
        '            log "cannot read secret $secret from Secret Manager (service account role?)"; exit 1',
        "        fi",
        f"        sleep {_SECRET_FETCH_PAUSE_S}",
        "    done",
        '    if [ -n "$name" ]; then',
        '        value=$(cat "$tmp")',
        '        printf \'%s=%s\\n\' "$name" "$value" >"$tmp"',
        "    fi",
        '    chown root:root "$tmp" && chmod "$mode" "$tmp" && mv -f "$tmp" "$target"',
        "}",
    ]
    for role, secret_id in secrets.items():
        target, mode, env_name = targets[role]
        args = f"{q(secret_id)} {q(target)} {mode}" + (f" {env_name}" if env_name else "")
        lines.append(f"fetch {args}")
    if "tls_certificate" in secrets:
        lines += _fingerprint_lines(crt, on_gce=on_gce)
    return "\n".join(lines) + "\n"


def _fingerprint_lines(crt: str, *, on_gce: bool) -> list[str]:
    """Log the serving certificate's SHA-256 fingerprint (what a client pins for a self-signed one) and,
    on GCE, publish it as the guest attribute ``GUEST_ATTRIBUTE_TLS_SHA256`` (best effort)."""
    lines = [
        f"fingerprint=$(openssl x509 -noout -fingerprint -sha256 -in {crt} | cut -d= -f2)",
        'log "serving certificate SHA-256 fingerprint: $fingerprint"',
    ]
    if on_gce:
        url = f"http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/{GUEST_ATTRIBUTE_TLS_SHA256}"
        lines.append(
            f'curl -fsS -X PUT -H "Metadata-Flavor: Google" --data "$fingerprint" {url} >/dev/null 2>&1 || '
            'log "guest attributes are off (metadata enable-guest-attributes): fingerprint not published"'
        )
    return lines


# --- the systemd unit ------------------------------------------------------------------------------------


def _unit(profile: NodeProfile, compose: str) -> str:
    acme = ""
    if profile.tls.mode == "acme":
        acme = (
            "# The certificate (infra.node.bundle.acme): certbot waits for nginx on port 80, "
            "then obtains or\n"
            "# renews it.\n"
            f"ExecStartPost=-/bin/systemctl start --no-block {ACME_SERVICE}\n"
        )
    return f"""# Rendered by infra.node.bundle.cloud_init for profile {profile.name!r}: re-render, not edit.
[Unit]
Description=Duplex node {profile.name} (docker compose in {NODE_ROOT})
Requires=docker.service
After=docker.service network-online.target
Wants=network-online.target

[Service]
Type=exec
WorkingDirectory={NODE_ROOT}
# The runtime's node id: this VM's host name.
Environment=DUPLEX_NODE_ID=%H
# A GCE VM: the runtime watches the metadata server's maintenance-event and stops admitting on a host
# maintenance notice (GPU VMs get one an hour ahead; runtime/frontend/maintenance.py).
Environment=DUPLEX_MAINTENANCE_WATCH=gce
# Where the preparation script logs Docker in to a Google registry (Artifact Registry images).
Environment=DOCKER_CONFIG={DOCKER_CONFIG_DIR}
# HF_TOKEN for the runtime (compose.yaml passes it through without a value); absent without one.
EnvironmentFile=-{NODE_ROOT}/{HF_TOKEN_FILE}
ExecStartPre={PREPARE_SCRIPT}
ExecStartPre={compose} config --quiet
ExecStart={compose} up --remove-orphans --no-color
{acme}ExecStop={compose} down
# First boot: Secret Manager retries; the image pull and the model download happen in ExecStart.
TimeoutStartSec=900
# nginx's and the runtime's stop grace periods (they cover the drain grace) plus a minute.
TimeoutStopSec={node_stop_timeout_s(profile)}
Restart=on-failure
RestartSec=30

[Install]
WantedBy=multi-user.target
"""


# --- YAML ------------------------------------------------------------------------------------------------


def _dump(document: dict[str, Any]) -> str:
    return dump_yaml(document, literal_blocks=True)  # the script and the unit readable in the metadata
