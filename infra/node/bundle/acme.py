"""Certificates from an ACME CA (Let's Encrypt) for a node whose profile says ``tls.mode: acme``: ACME HTTP-01
through the node's own nginx (``nginx_webroot``), obtained and renewed by one certbot command
(``certbot_command``) that a systemd service and a twice-daily timer run (``render_acme_host_files``),
installed by a deploy hook (``deploy_hook_script``) that copies the chain and key atomically and reloads
nginx without cutting sessions. certbot's state lives under ``profile.data_dir`` (``acme_dirs``).

Until the first certificate is issued, a second timer (``FIRST_TIMER``) retries every 5 minutes: a domain
pointed at the node after its first boot gets its certificate within minutes, not at the next twice-daily
run. Each run writes node_exporter textfile metrics (``textfile_dir``, ``METRICS_FILE``): the served
certificate's ``notAfter`` and the run's result, which ``infra.node.monitoring.cert_rules`` alerts on (Let's
Encrypt sends no expiry e-mail since 2025-06-04).

How a node gets and keeps its certificate, what it needs, and the tests: docs/deploying.md, "Certificates
on a single node"."""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from infra.node.profile.profiles import NodeProfile

__all__ = [
    "ACME_CHALLENGE_PREFIX",
    "CERT_NAME",
    "DEPLOY_HOOK",
    "FIRST_SERVICE",
    "FIRST_TIMER",
    "METRICS_FILE",
    "RENEW_SCRIPT",
    "SERVICE",
    "TIMER",
    "TIMERS",
    "WEBROOT_CONTAINER",
    "AcmeDirs",
    "acme_dirs",
    "certbot_command",
    "deploy_hook_script",
    "nginx_webroot",
    "render_acme_host_files",
    "textfile_dir",
]

ACME_CHALLENGE_PREFIX = "/.well-known/acme-challenge/"
"""The path HTTP-01 tokens are fetched under (RFC 8555, section 8.3)."""

WEBROOT_CONTAINER = "/var/www/acme"
"""Where a ``compose`` node's nginx container sees the webroot (mounted read-only)."""

CERT_NAME = "duplex-node"
"""certbot's name for the node's certificate lineage (``<config dir>/live/duplex-node/``)."""

RENEW_SCRIPT = "/usr/local/sbin/duplex-certbot"
"""On a host: waits for nginx on port 80, then runs ``certbot_command`` (the service's ``ExecStart``)."""
DEPLOY_HOOK = "/usr/local/sbin/duplex-certbot-deploy"
"""On a host: certbot's deploy hook (``deploy_hook_script``)."""
SERVICE = "duplex-certbot.service"
TIMER = "duplex-certbot.timer"
FIRST_SERVICE = "duplex-certbot-first.service"
"""Starts ``SERVICE`` while the node has no certificate from the CA yet (``ConditionPathExists``)."""
FIRST_TIMER = "duplex-certbot-first.timer"
"""Runs ``FIRST_SERVICE`` every 5 minutes (a no-op once the first certificate is issued)."""

TIMERS = (TIMER, FIRST_TIMER)
"""The timers a node enables (``systemctl enable --now``)."""

FIRST_RETRY_S = 300
"""The first issuance's retry period (s): the renew script checks DNS every run, and after a failed certbot
run waits ``FIRST_RETRY_S * 2**(failures - 1)`` s, at most ``FIRST_BACKOFF_MAX_S``, before the next one."""
FIRST_BACKOFF_MAX_S = 3600
"""The longest wait between failed first issuances (s): Let's Encrypt allows 5 failed validations per
account, hostname and hour (letsencrypt.org/docs/rate-limits, "Authorization Failures per Identifier per
Account"); 5, 10, 20, 40, then 60 min stays within it."""

METRICS_FILE = "duplex-acme.prom"
"""The renew script's node_exporter textfile (in ``textfile_dir``): ``duplex_tls_certificate_not_after_
timestamp_seconds`` (the served certificate's notAfter, Unix s), ``duplex_acme_renewal_success`` (1 or 0:
the last run's result) and ``duplex_acme_renewal_last_run_timestamp_seconds`` (Unix s), each labelled
``domain``."""

NGINX_WAIT_S = 2700
"""How long the renew script waits for nginx to answer on port 80 (s): on a first boot nginx starts only
once the runtime is healthy, after the weights download and the model load (45 min)."""


@dataclass(frozen=True)
class AcmeDirs:
    """certbot's directories on the host (absolute paths).

    Attributes:
        webroot: where certbot writes challenge tokens (nginx serves it at ``ACME_CHALLENGE_PREFIX``).
        config_dir: certbot's ``--config-dir`` (account, certificates, renewal settings).
        work_dir, logs_dir: certbot's ``--work-dir`` and ``--logs-dir``.
    """

    webroot: str
    config_dir: str
    work_dir: str
    logs_dir: str

    @property
    def live_dir(self) -> str:
        """The current certificate's directory (``fullchain.pem``, ``privkey.pem``)."""
        return posixpath.join(self.config_dir, "live", CERT_NAME)


def acme_dirs(profile: NodeProfile, node_dir: str | None = None) -> AcmeDirs:
    """certbot's directories for ``profile``: under ``profile.data_dir/acme`` on a ``compose`` node (kept
    with the node's data), under ``node_dir/acme`` on a ``processes`` node (the node directory).

    Raises:
        ValueError: a ``processes`` profile without an absolute ``node_dir``.
    """
    if profile.deployment == "compose":
        base = posixpath.join(profile.data_dir, "acme")
    else:
        if node_dir is None or not posixpath.isabs(node_dir):
            raise ValueError(
                f"node_dir: a processes node needs the absolute node directory, got {node_dir!r}"
            )
        base = posixpath.join(node_dir, "acme")
    return AcmeDirs(
        webroot=posixpath.join(base, "webroot"),
        config_dir=posixpath.join(base, "letsencrypt"),
        work_dir=posixpath.join(base, "work"),
        logs_dir=posixpath.join(base, "logs"),
    )


def textfile_dir(profile: NodeProfile) -> str:
    """The host directory of node_exporter's textfile collector (``--collector.textfile.directory``, seen by
    the node-exporter container under ``/host``): ``profile.data_dir/node-exporter``."""
    return posixpath.join(profile.data_dir, "node-exporter")


def nginx_webroot(profile: NodeProfile) -> str:
    """nginx's ``root`` for ``ACME_CHALLENGE_PREFIX``: ``WEBROOT_CONTAINER`` in a container, ``acme/webroot``
    relative to nginx's prefix (the node directory) on a ``processes`` node."""
    return WEBROOT_CONTAINER if profile.deployment == "compose" else "acme/webroot"


def certbot_command(profile: NodeProfile, dirs: AcmeDirs, *, deploy_hook: str) -> list[str]:
    """certbot's argv: obtain (or, once due, renew) the certificate for ``profile.domain`` from
    ``tls.acme_directory`` by HTTP-01 through ``dirs.webroot``; ``deploy_hook`` (a shell command) runs
    after each issuance. Non-interactive: the CA's terms of service are accepted on the operator's behalf
    (``--agree-tos``), as every unattended ACME client does.

    Raises:
        ValueError: ``tls.mode`` is not ``acme``.
    """
    tls = profile.tls
    if tls.mode != "acme" or tls.acme_email is None:
        raise ValueError(
            f"tls.mode: profile {profile.name!r} has tls.mode {tls.mode!r}; certbot runs only for 'acme'"
        )
    return [
        "certbot",
        "certonly",
        "--non-interactive",
        "--agree-tos",
        "--no-eff-email",
        "--email",
        tls.acme_email,
        "--server",
        tls.acme_directory,
        "--webroot",
        "--webroot-path",
        dirs.webroot,
        "--domain",
        profile.domain,
        "--cert-name",
        CERT_NAME,
        "--keep-until-expiring",
        "--config-dir",
        dirs.config_dir,
        "--work-dir",
        dirs.work_dir,
        "--logs-dir",
        dirs.logs_dir,
        "--deploy-hook",
        deploy_hook,
    ]


def deploy_hook_script(certificate_path: str, private_key_path: str, reload_command: str) -> str:
    """certbot's deploy hook as a POSIX shell script: copy ``$RENEWED_LINEAGE/fullchain.pem`` (0644) and
    ``privkey.pem`` (0600) to the paths nginx reads, each through a temporary file and a rename (nginx
    never reads half a file), then run ``reload_command`` (a shell command that reloads nginx).

    Raises:
        ValueError: a path is not absolute.
    """
    for name, path in (("certificate_path", certificate_path), ("private_key_path", private_key_path)):
        if not posixpath.isabs(path):
            raise ValueError(f"{name}: {path!r} must be an absolute path")
    q = shlex.quote
    crt, key = q(certificate_path), q(private_key_path)
    return f"""#!/bin/sh
# Rendered by infra.node.bundle.acme: certbot's deploy hook. Installs the issued certificate where nginx
# reads it,
# then reloads nginx (open sessions go on).
set -eu
: "${{RENEWED_LINEAGE:?certbot sets RENEWED_LINEAGE for a deploy hook}}"
umask 077
install -m 0600 "$RENEWED_LINEAGE/privkey.pem" {key}.tmp
install -m 0644 "$RENEWED_LINEAGE/fullchain.pem" {crt}.tmp
mv -f {key}.tmp {key}
mv -f {crt}.tmp {crt}
echo "duplex-certbot-deploy: installed $(openssl x509 -noout -serial -in {crt}) for nginx" >&2
{reload_command}
"""


def _metrics_function(profile: NodeProfile) -> str:
    """The renew script's ``metrics SUCCESS`` shell function: writes ``METRICS_FILE`` atomically (a
    temporary file and a rename, as node_exporter's textfile collector asks) with the served certificate's
    notAfter (left out while there is no certificate) and this run's result (1 or 0)."""
    q = shlex.quote
    # A DNS name (NodeProfile checks it): nothing to escape but the quotes, inside the shell's own.
    labels = f'{{domain=\\"{profile.domain}\\"}}'
    not_after = "duplex_tls_certificate_not_after_timestamp_seconds"
    success = "duplex_acme_renewal_success"
    last_run = "duplex_acme_renewal_last_run_timestamp_seconds"
    return f"""# metrics SUCCESS: textfile metrics for node_exporter (infra.node.monitoring.cert_rules).
metrics() {{
    mkdir -p "$TEXTFILE" && chmod 0755 "$TEXTFILE"
    tmp="$TEXTFILE/.{METRICS_FILE}.tmp"
    {{
        if end=$(openssl x509 -noout -enddate -in {q(profile.tls.certificate_path)} 2>/dev/null); then
            echo "# HELP {not_after} The served TLS certificate's notAfter (Unix time, s)."
            echo "# TYPE {not_after} gauge"
            echo "{not_after}{labels} $(date -u -d "${{end#notAfter=}}" +%s)"
        fi
        echo "# HELP {success} 1 when the last certbot run obtained or kept a valid certificate, else 0."
        echo "# TYPE {success} gauge"
        echo "{success}{labels} $1"
        echo "# HELP {last_run} When certbot last ran (Unix time, s)."
        echo "# TYPE {last_run} gauge"
        echo "{last_run}{labels} $(date +%s)"
    }} >"$tmp"
    chmod 0644 "$tmp" && mv -f "$tmp" "$TEXTFILE/{METRICS_FILE}"
}}
"""


def _renew_script(profile: NodeProfile, dirs: AcmeDirs) -> str:
    q = shlex.quote
    argv = " ".join(q(arg) for arg in certbot_command(profile, dirs, deploy_hook=DEPLOY_HOOK))
    # nginx's plain HTTP port where Compose publishes it (every address: probe loopback).
    host = "127.0.0.1" if profile.public_address in ("0.0.0.0", "::") else profile.public_address
    probe = f"http://{host}:{profile.ports.http}{ACME_CHALLENGE_PREFIX}duplex-probe"
    webroot_challenges = q(posixpath.join(dirs.webroot, ACME_CHALLENGE_PREFIX.strip("/")))
    return f"""#!/bin/sh
# Rendered by infra.node.bundle.acme for profile {profile.name!r}: obtains the node's certificate for
# {profile.domain} from {profile.tls.acme_directory}, or renews it once due (a no-op before), and writes
# node_exporter textfile metrics of the result.
set -eu
TEXTFILE={q(textfile_dir(profile))}
LIVE={q(posixpath.join(dirs.live_dir, "fullchain.pem"))}
FAILURES={q(posixpath.join(dirs.work_dir, "first-issuance-failures"))}
{_metrics_function(profile)}
mkdir -p {webroot_challenges} {q(dirs.config_dir)} {q(dirs.work_dir)} {q(dirs.logs_dir)}
chmod 0755 {q(dirs.webroot)} {webroot_challenges}
# nginx must answer HTTP-01 on port {profile.ports.http}: on a first boot it starts after the model load.
waited=0
until curl -s -o /dev/null --max-time 5 {q(probe)}; do
    if [ "$waited" -ge {NGINX_WAIT_S} ]; then
        echo "duplex-certbot: nginx does not answer on port {profile.ports.http}; the timer retries" >&2
        metrics 0
        exit 1
    fi
    sleep 10
    waited=$((waited + 10))
done
if [ ! -s "$LIVE" ]; then
    # No certificate from the CA yet ({FIRST_TIMER} runs this every {FIRST_RETRY_S // 60} min): a name
    # not in DNS yet costs no validation; after failed ones, back off (the CA's rate limit).
    if ! getent ahosts {q(profile.domain)} >/dev/null; then
        echo "duplex-certbot: {profile.domain} does not resolve yet: point its DNS at this node" >&2
        metrics 0
        exit 1
    fi
    if [ -s "$FAILURES" ]; then
        read -r failures last <"$FAILURES"
        delay={FIRST_RETRY_S}
        i=1
        while [ "$i" -lt "$failures" ] && [ "$delay" -lt {FIRST_BACKOFF_MAX_S} ]; do
            delay=$((delay * 2))
            i=$((i + 1))
        done
        if [ "$delay" -gt {FIRST_BACKOFF_MAX_S} ]; then delay={FIRST_BACKOFF_MAX_S}; fi
        if [ $(($(date +%s) - last)) -lt "$delay" ]; then
            echo "duplex-certbot: $failures failed issuances; the next one $delay s after the last" >&2
            exit 0
        fi
    fi
fi
status=0
{argv} || status=$?
if [ "$status" -eq 0 ]; then
    rm -f "$FAILURES"
    metrics 1
else
    if [ ! -s "$LIVE" ]; then
        failures=0
        if [ -s "$FAILURES" ]; then read -r failures last <"$FAILURES"; fi
        echo "$((failures + 1)) $(date +%s)" >"$FAILURES"
    fi
    metrics 0
fi
exit "$status"
"""


def render_acme_host_files(profile: NodeProfile, *, reload_command: str) -> dict[str, tuple[str, str]]:
    """The host files of ACME on a ``compose`` node, ``{absolute path: (mode, content)}``: the renew script
    (``RENEW_SCRIPT``), the deploy hook (``DEPLOY_HOOK``), the systemd service (``SERVICE``: the renew
    script, oneshot) and its timer (``TIMER``: twice a day at a random minute, and 5 minutes after boot,
    as certbot's own timer does), and the first issuance's retry (``FIRST_SERVICE``, skipped once
    certbot's lineage has a certificate, and ``FIRST_TIMER``: every 5 minutes). Enable both timers
    (``TIMERS``). ``reload_command`` reloads the node's nginx.

    Raises:
        ValueError: ``tls.mode`` is not ``acme``, or the profile is not a ``compose`` node.
    """
    if profile.deployment != "compose":
        raise ValueError(f"deployment: ACME host files are for compose nodes, not {profile.deployment!r}")
    dirs = acme_dirs(profile)
    renew = _renew_script(profile, dirs)  # raises for a non-acme profile
    hook = deploy_hook_script(profile.tls.certificate_path, profile.tls.private_key_path, reload_command)
    service = f"""# Rendered by infra.node.bundle.acme for profile {profile.name!r}. Do not edit: re-render.
[Unit]
Description=Duplex node certificate for {profile.domain} (certbot, ACME HTTP-01)
After=network-online.target docker.service
Wants=network-online.target

[Service]
Type=oneshot
ExecStart={RENEW_SCRIPT}
TimeoutStartSec={NGINX_WAIT_S + 600}
"""
    timer = f"""# Rendered by infra.node.bundle.acme for profile {profile.name!r}. Do not edit: re-render.
[Unit]
Description=Obtain or renew the duplex node's certificate twice a day

[Timer]
OnBootSec=5min
OnCalendar=*-*-* 00,12:00:00
RandomizedDelaySec=1h
Persistent=true

[Install]
WantedBy=timers.target
"""
    header = f"# Rendered by infra.node.bundle.acme for profile {profile.name!r}. Do not edit: re-render."
    first_service = f"""{header}
[Unit]
Description=Obtain the duplex node's first certificate (retried until issued)
ConditionPathExists=!{posixpath.join(dirs.live_dir, "fullchain.pem")}

[Service]
Type=oneshot
ExecStart=-/bin/systemctl start {SERVICE}
"""
    first_timer = f"""{header}
[Unit]
Description=Retry the duplex node's first certificate every {FIRST_RETRY_S // 60} minutes until it is issued

[Timer]
OnCalendar=*:0/{FIRST_RETRY_S // 60}
AccuracySec=30s

[Install]
WantedBy=timers.target
"""
    return {
        RENEW_SCRIPT: ("0755", renew),
        DEPLOY_HOOK: ("0755", hook),
        f"/etc/systemd/system/{SERVICE}": ("0644", service),
        f"/etc/systemd/system/{TIMER}": ("0644", timer),
        f"/etc/systemd/system/{FIRST_SERVICE}": ("0644", first_service),
        f"/etc/systemd/system/{FIRST_TIMER}": ("0644", first_timer),
    }
