"""Rolling a new runtime image onto a GCE node without replacing the VM, and the node's data disk.

The user-data names the image's *repository* only (:func:`pending_image`); the digest travels in the
instance metadata key ``ROLLOUT_METADATA_KEY``, which GCE updates in place. On the VM, ``duplex-rollout
sync`` writes the key's image into ``compose.yaml`` before every start, and ``duplex-rollout watch`` rolls
to a new digest (pull while the old image serves, then a draining restart). The data disk
(``DATA_DISK_DEVICE``) holds ``profile.data_dir``, formatted only when it has no file system.
:func:`add_rollout` adds all of this to a rendered user-data
(``infra.node.bundle.cloud_init.render_cloud_init``).

Why, the steps, and the gap a caller sees: docs/deploying.md, "Deploys a user does not notice"; the data
disk: docs/deploying.md, "Stack `dev` (GCP, T4, INT8)"."""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from infra.node.bundle.cloud_init import GCE_METADATA_VALUE_LIMIT, NODE_ROOT, PREPARE_SCRIPT, UNIT_NAME
from infra.node.bundle.compose import COMPOSE_FILE
from infra.node.profile.profiles import NodeProfile
from infra.yaml_text import dump_yaml

__all__ = [
    "AGENT_PATH",
    "AGENT_UNIT",
    "DATA_DISK_DEVICE",
    "IMAGE_REF_RE",
    "METADATA_ROOT",
    "ROLLOUT_METADATA_KEY",
    "add_rollout",
    "data_disk_path",
    "image_repository",
    "pending_image",
    "render_agent",
    "render_rollout_files",
]

ROLLOUT_METADATA_KEY = "duplex-runtime-image"
"""Instance metadata key holding the digest-pinned image the node runs (updated in place by ``up``)."""

DATA_DISK_DEVICE = "duplex-data"
"""``device_name`` of the data disk: the guest sees it as ``/dev/disk/by-id/google-duplex-data``
(cloud.google.com/compute/docs/disks/set-persistent-device-name-in-linux-vm)."""

METADATA_ROOT = "http://metadata.google.internal/computeMetadata/v1"
"""GCE's metadata server (cloud.google.com/compute/docs/metadata/querying-metadata)."""

AGENT_PATH = "/usr/local/sbin/duplex-rollout"
AGENT_UNIT = "duplex-rollout.service"
_DROP_IN = f"/etc/systemd/system/{UNIT_NAME}.d/10-rollout.conf"

IMAGE_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
"""A digest-pinned image reference the agent accepts (anything else in the key is refused and logged)."""

_ZERO_DIGEST = "sha256:" + "0" * 64


def data_disk_path() -> str:
    """The data disk's stable device path on the VM."""
    return f"/dev/disk/by-id/google-{DATA_DISK_DEVICE}"


def pending_image(image_ref: str) -> str:
    """The image the user-data names: ``image_ref``'s repository with a digest of zeros, so the user-data
    (and the VM) stays the same when only the digest changes; the agent writes the real one.

    Raises:
        ValueError: ``image_ref`` is not digest-pinned (``repo@sha256:<64 hex>``).

    >>> pending_image("us-docker.pkg.dev/p/r/runtime@sha256:" + "a" * 64).endswith("0" * 64)
    True
    """
    if not IMAGE_REF_RE.match(image_ref):
        raise ValueError(
            f"image_ref {image_ref!r} must be digest-pinned: <repository>@sha256:<64 hex digits>"
        )
    return image_ref.rsplit("@", 1)[0] + "@" + _ZERO_DIGEST


def image_repository(image: str) -> str:
    """``image`` without its digest and tag: the repository (``host/path/name``).

    >>> image_repository("us-docker.pkg.dev/p/r/runtime:dev@sha256:" + "a" * 64)
    'us-docker.pkg.dev/p/r/runtime'
    """
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def render_agent(profile: NodeProfile) -> str:
    """The agent script (POSIX sh; ``sync`` or ``watch``). It accepts only a digest of the repository the
    user-data names (``image_repository(profile.runtime_image)``, the stack's Artifact Registry
    repository, which the VM's service account may read): whoever can set instance metadata cannot make
    the node run an image from another registry (issue 33). Paths and commands can be pointed elsewhere
    with ``DUPLEX_ROLLOUT_ROOT`` (the bundle root), ``DUPLEX_METADATA_URL`` (the metadata root),
    ``DUPLEX_ROLLOUT_PREPARE`` (the preparation script), ``DUPLEX_ROLLOUT_RETRY_S`` (pause between the
    5 reads ``sync`` tries, 5 s) and ``PATH`` (``docker``, ``systemctl``, ``curl``):
    what the tests do. ``watch --once`` reads the key once, rolls out what changed, and exits."""
    q = shlex.quote
    repo = image_repository(profile.runtime_image)
    allowed = f"{repo}@sha256:<64 hex>"
    return f"""#!/bin/sh
# Rendered by infra.node.bundle.rollout for profile {profile.name!r}. Do not edit: re-render.
# duplex-rollout sync        : write the image of metadata key {ROLLOUT_METADATA_KEY} into compose.yaml
# duplex-rollout watch [--once]: on each new image: prepare, pull, write, restart {UNIT_NAME} (drains)
set -eu
ROOT="${{DUPLEX_ROLLOUT_ROOT:-{NODE_ROOT}}}"
MD="${{DUPLEX_METADATA_URL:-{METADATA_ROOT}}}/instance/attributes/{ROLLOUT_METADATA_KEY}"
PREPARE="${{DUPLEX_ROLLOUT_PREPARE:-{PREPARE_SCRIPT}}}"
RETRY_S="${{DUPLEX_ROLLOUT_RETRY_S:-5}}"
COMPOSE_YAML="$ROOT/{COMPOSE_FILE}"
STATE="$ROOT/.runtime-image"
export DOCKER_CONFIG="${{DOCKER_CONFIG:-/root/.docker}}"
log() {{ echo "duplex-rollout: $*" >&2; }}

# current: the image compose.yaml runs (the pending one of the user-data until the first write)
current() {{
    cat "$STATE" 2>/dev/null ||
        sed -n 's/^ *image: *\\([^ ]*@{_ZERO_DIGEST}\\) *$/\\1/p' "$COMPOSE_YAML" | head -n 1
}}
# valid IMAGE: digest-pinned, and of the repository the user-data names (no other registry)
valid() {{
    printf '%s\\n' "$1" | grep -Eq {q(IMAGE_REF_RE.pattern)} || return 1
    case "$1" in {q(repo)}@sha256:*) ;; *) return 1 ;; esac
}}

# read [ETAG]: the key's value into $value and its ETag into $etag (waits for a change when ETAG is given)
read_key() {{
    url="$MD"
    if [ -n "${{1:-}}" ]; then url="$MD?wait_for_change=true&last_etag=$1&timeout_sec=300"; fi
    headers=$(mktemp)
    value=$(curl -sS -f --max-time 330 -H 'Metadata-Flavor: Google' -D "$headers" "$url") || {{
        rm -f "$headers"; return 1
    }}
    etag=$(sed -n 's/^[Ee][Tt][Aa][Gg]: *\\([^[:space:]]*\\).*/\\1/p' "$headers")
    rm -f "$headers"
}}

# write IMAGE: put IMAGE in place of the current one in compose.yaml (the runtime's line only)
write() {{
    old=$(current)
    [ -n "$old" ] || {{ log "no runtime image line found in $COMPOSE_YAML"; return 1; }}
    [ "$old" = "$1" ] && return 0
    tmp="$COMPOSE_YAML.tmp"
    sed "s#^\\( *image: *\\)$old *\\$#\\1$1#" "$COMPOSE_YAML" >"$tmp"
    grep -q "image: $1\\$" "$tmp" || {{
        rm -f "$tmp"; log "could not write $1 into $COMPOSE_YAML"; return 1
    }}
    mv -f "$tmp" "$COMPOSE_YAML"
    printf '%s\\n' "$1" >"$STATE.tmp" && mv -f "$STATE.tmp" "$STATE"
    log "compose.yaml runs $1 (was $old)"
}}

sync() {{
    n=0
    until read_key; do
        n=$((n + 1))
        if [ "$n" -ge 5 ]; then
            case "$(current)" in
                *@{_ZERO_DIGEST}|"") log "cannot read $MD and no image was ever set"; exit 1 ;;
                *) log "cannot read $MD: keeping $(current)"; return 0 ;;
            esac
        fi
        sleep "$RETRY_S"
    done
    valid "$value" || {{ log "refusing metadata value '$value' (not {allowed})"; exit 1; }}
    write "$value"
}}

roll() {{
    new=$1
    valid "$new" || {{ log "refusing metadata value '$new' (not {allowed})"; return 0; }}
    [ "$new" = "$(current)" ] && return 0
    log "new image $new: preparing (registry login), pulling while the node serves"
    # (set -e is off inside a condition: every step checks its own status)
    "$PREPARE" || {{ log "preparation script failed"; return 1; }}
    docker pull --quiet "$new" || {{ log "cannot pull $new"; return 1; }}
    write "$new" || return 1
    log "restarting {UNIT_NAME}: live sessions drain for up to {profile.limits.drain_grace_s} s"
    systemctl restart {UNIT_NAME} || {{ log "restart of {UNIT_NAME} failed"; return 1; }}
    log "rolled out $new"
}}

watch() {{
    etag=""
    failures=0
    while :; do
        if read_key "$etag"; then
            failures=0
            if ! roll "$value"; then
                [ "${{1:-}}" = "--once" ] && exit 1
                log "rollout of $value failed; retrying in 60 s"; etag=""; sleep 60
            fi
            [ "${{1:-}}" = "--once" ] && exit 0
        else
            failures=$((failures + 1))
            delay=$(( failures > 6 ? 60 : 1 << (failures - 1) ))
            log "cannot read $MD (failure $failures); retrying in $delay s"
            etag=""
            sleep "$delay"
        fi
    done
}}

case "${{1:-}}" in
    sync) sync ;;
    watch) shift; watch "$@" ;;
    *) echo "usage: duplex-rollout sync | watch [--once]" >&2; exit 2 ;;
esac
"""


def _agent_unit(profile: NodeProfile) -> str:
    return f"""# Rendered by infra.node.bundle.rollout for profile {profile.name!r}. Do not edit: re-render.
[Unit]
Description=Duplex rollout: runs the image of metadata key {ROLLOUT_METADATA_KEY} ({UNIT_NAME} restarts)
After={UNIT_NAME}
Wants=network-online.target

[Service]
Type=simple
ExecStart={AGENT_PATH} watch
Restart=always
RestartSec=30

[Install]
WantedBy=multi-user.target
"""


def _drop_in(profile: NodeProfile) -> str:
    return f"""# Rendered by infra.node.bundle.rollout for profile {profile.name!r}. Do not edit: re-render.
[Unit]
RequiresMountsFor={profile.data_dir}

[Service]
ExecStartPre={AGENT_PATH} sync
"""


def render_rollout_files(profile: NodeProfile) -> dict[str, str]:
    """``{absolute path on the VM: content}``: the agent, its unit and the node unit's drop-in."""
    return {
        AGENT_PATH: render_agent(profile),
        f"/etc/systemd/system/{AGENT_UNIT}": _agent_unit(profile),
        _DROP_IN: _drop_in(profile),
    }


def add_rollout(user_data: str, profile: NodeProfile) -> str:
    """``user_data`` (a ``#cloud-config`` document of ``render_cloud_init``) with the rollout agent, the
    drop-in and the data disk's file system and mount added; its comment header is kept.

    Raises:
        ValueError: ``user_data`` is not a ``#cloud-config`` mapping with ``write_files`` and ``runcmd``, or
            the result exceeds GCE's ``GCE_METADATA_VALUE_LIMIT`` on one metadata value.
    """
    header_lines = []
    for line in user_data.splitlines():
        if not line.startswith("#"):
            break
        header_lines.append(line)
    document: Any = yaml.safe_load(user_data)
    if (
        not header_lines
        or header_lines[0] != "#cloud-config"
        or not isinstance(document, dict)
        or not isinstance(document.get("write_files"), list)
        or not isinstance(document.get("runcmd"), list)
    ):
        raise ValueError("user_data must be a #cloud-config document with write_files and runcmd")
    for path, content in render_rollout_files(profile).items():
        document["write_files"].append(
            {
                "path": path,
                "owner": "root:root",
                "permissions": "0755" if path == AGENT_PATH else "0644",
                "content": content,
            }
        )
    device = data_disk_path()
    document["fs_setup"] = [
        {"label": DATA_DISK_DEVICE, "filesystem": "ext4", "device": device, "overwrite": False}
    ]
    document["mounts"] = [[device, profile.data_dir, "ext4", "defaults,nofail,discard", "0", "2"]]
    runcmd = document["runcmd"]
    start = ["systemctl", "start", "--no-block", UNIT_NAME]
    at = runcmd.index(start) if start in runcmd else len(runcmd)
    runcmd[at:at] = [["systemctl", "daemon-reload"], ["systemctl", "enable", AGENT_UNIT]]
    runcmd.append(["systemctl", "start", "--no-block", AGENT_UNIT])
    header_lines.append(
        f"# Runtime image: metadata key {ROLLOUT_METADATA_KEY} (infra.node.bundle.rollout); "
        f"data disk {device} at "
        f"{profile.data_dir}."
    )
    merged = "\n".join(header_lines) + "\n" + dump_yaml(document, literal_blocks=True)
    if len(merged.encode()) > GCE_METADATA_VALUE_LIMIT:
        raise ValueError(
            f"the user-data with the rollout agent is {len(merged.encode())} bytes, over GCE's "
            f"{GCE_METADATA_VALUE_LIMIT}-byte limit on one metadata value"
        )
    return merged
