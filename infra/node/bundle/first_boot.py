"""What a GCE node installs at its first boot, made robust (issue 33): on a fresh Ubuntu VM
unattended-upgrades holds the dpkg lock for minutes, and a package install that loses it fails once and is
never retried. ``apt_lock_file`` makes every ``apt-get`` wait for the lock; ``apt_install`` and ``retried``
retry an install a few times. Used by ``infra.node.bundle.cloud_init``."""

from __future__ import annotations

from typing import Any

__all__ = [
    "APT_ATTEMPTS",
    "APT_LOCK_CONF",
    "APT_LOCK_TIMEOUT_S",
    "APT_RETRY_PAUSE_S",
    "OPS_AGENT_INSTALL",
    "apt_install",
    "apt_lock_file",
    "retried",
]

OPS_AGENT_INSTALL = (
    "{ curl -fsSL --retry 3 -o /tmp/add-google-cloud-ops-agent-repo.sh "
    "https://dl.google.com/cloudagents/add-google-cloud-ops-agent-repo.sh && "
    "bash /tmp/add-google-cloud-ops-agent-repo.sh --also-install; }"
)
"""How the VM installs Google's Ops Agent (cloud.google.com/stackdriver/docs/solutions/agents/ops-agent/
installation). Its default configuration ships the system log, which holds the node unit's journal and so
every container's output (``docker compose up`` runs in the foreground), to Cloud Logging, and the host's
metrics to Cloud Monitoring (the VM's service account needs ``roles/logging.logWriter`` and
``roles/monitoring.metricWriter``)."""

APT_LOCK_CONF = "/etc/apt/apt.conf.d/90duplex-dpkg-lock"
"""apt configuration the user-data writes before any install: every ``apt-get`` on the VM (ours, and the
Ops Agent's installer, which takes no apt options) waits up to ``APT_LOCK_TIMEOUT_S`` for the dpkg lock
instead of failing at once while unattended-upgrades holds it on a first boot (apt.conf(5),
``DPkg::Lock::Timeout``, apt >= 1.9.11; Ubuntu 22.04 has 2.4)."""
APT_LOCK_TIMEOUT_S = 600
APT_ATTEMPTS = 5
"""How many times a first-boot install is tried (``APT_RETRY_PAUSE_S`` apart) before cloud-init logs it
failed: a lock held past the timeout, a mirror or ``dl.google.com`` briefly unreachable."""
APT_RETRY_PAUSE_S = 30


def retried(command: str, what: str) -> str:
    """``command`` (a shell command) run until it succeeds, ``APT_ATTEMPTS`` times ``APT_RETRY_PAUSE_S`` s
    apart, as one ``sh -c`` script; it fails naming ``what`` after the last attempt."""
    return (
        f"n=0; until {command}; do n=$((n + 1)); "
        f'if [ "$n" -ge {APT_ATTEMPTS} ]; then '
        f'echo "duplex: {what} failed {APT_ATTEMPTS} times" >&2; exit 1; fi; '
        f"sleep {APT_RETRY_PAUSE_S}; done"
    )


def apt_install(package: str) -> str:
    """Installs the Debian package ``package`` at first boot: ``apt-get update`` then ``install``, each
    waiting for the dpkg lock (``APT_LOCK_CONF``; the option is also given on the command line), the pair
    ``retried``."""
    lock = f"-o DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"
    command = (
        f"{{ apt-get {lock} update -q && "
        f"DEBIAN_FRONTEND=noninteractive apt-get {lock} install -y -q {package}; }}"
    )
    return retried(command, f"apt-get install {package}")


def apt_lock_file() -> dict[str, Any]:
    """The cloud-init ``write_files`` entry of ``APT_LOCK_CONF``: ``DPkg::Lock::Timeout`` for every apt."""
    return {
        "path": APT_LOCK_CONF,
        "owner": "root:root",
        "permissions": "0644",
        "content": f'DPkg::Lock::Timeout "{APT_LOCK_TIMEOUT_S}";\n',
    }
