"""coturn's ``turnserver.conf`` for a node, rendered from its profile and the TURN secret.

The file holds coturn's ``static-auth-secret`` (the same secret the runtime mints TURN credentials with,
``DUPLEX_TURN_SECRET``; ``runtime/frontend/transports/webrtc/turn.py``), so it is a secret file of the node
(``infra.node.bundle.services.SECRET_FILES["turnserver_conf"]``), never part of the public bundle. What it
sets, and why (coturn 4.6 option names; README.turnserver of the Debian package ``coturn`` 4.6.1):

- authentication: ``use-auth-secret`` + ``static-auth-secret`` (the TURN REST scheme: the password is
  recomputed from the username ``<expiry>:<session id>``; expired usernames are refused), ``realm``;
- listeners: ``listening-port`` (TURN over UDP) and ``tls-listening-port`` (TURN over TLS) with the node's
  nginx certificate and key (``tls.certificate_path``, ``tls.private_key_path``: the same files, renewed by
  ACME in place); no plain TCP, no DTLS, no TCP relays (browsers use neither), TLS 1.2 and later only;
- relay: ``min-port``/``max-port`` from ``infra.node.profile.relay.relay_port_range``, ``user-quota`` and
  ``total-quota`` from ``relay_quota``;
- peers: every address is denied (``denied-peer-ip`` over the whole IPv4 and IPv6 spaces) except the
  runtime's (``allowed-peer-ip``: an allowed rule wins over a denied one), loopback and multicast peers
  refused: a caller holding credentials reaches the runtime's ICE sockets and nothing else on the node's
  network (no metadata server, no Redis, no other host);
- no CLI (``no-cli``), no web admin, no software version in responses, no RFC 5780 NAT discovery (STUN
  amplification), fingerprints on;
- metrics: ``prometheus`` on ``relay.metrics_port`` in a ``compose`` node (the coturn/coturn image is built
  with prometheus-client-c; Debian's package is not, so the local node runs none); usernames are not used
  as labels (each session has its own: an unbounded series count).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from infra.node.profile.profiles import NodeProfile
from infra.node.profile.relay import relay_port_range, relay_quota

__all__ = [
    "CONTAINER_CONFIG_PATH",
    "DENY_ALL_PEERS",
    "coturn_args",
    "peer_ranges",
    "render_turnserver_conf",
]

CONTAINER_CONFIG_PATH = "/etc/coturn/turnserver.conf"
"""Where a ``compose`` node's coturn container reads its configuration (a Compose secret)."""

DENY_ALL_PEERS = ("0.0.0.0-255.255.255.255", "::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
"""``denied-peer-ip`` ranges covering every IPv4 and IPv6 address."""

_SECRET_FORBIDDEN = set(" \t\r\n#\"'")


def peer_ranges(profile: NodeProfile) -> list[str]:
    """The ``allowed-peer-ip`` values: ``relay.peer_networks`` as coturn's ``first-last`` ranges, or, when
    empty, the runtime's fixed address on the Compose network (``compose`` nodes). A ``processes`` node
    with none allows no peer (the local node fills in the host's addresses when it starts)."""
    relay = profile.relay
    if relay.peer_networks:
        networks = [ipaddress.ip_network(cidr, strict=False) for cidr in relay.peer_networks]
    elif profile.deployment == "compose":
        networks = [ipaddress.ip_network(relay.runtime_address)]
    else:
        networks = []
    return [
        str(n.network_address) if n.num_addresses == 1 else f"{n.network_address}-{n.broadcast_address}"
        for n in networks
    ]


def render_turnserver_conf(
    profile: NodeProfile, secret: str, *, tls: bool = True, previous_secrets: Sequence[str] = ()
) -> str:
    """``turnserver.conf`` for ``profile`` (see the module docstring), holding ``secret``. Deterministic.

    ``previous_secrets``: secrets coturn still accepts after ``secret`` during a rotation (one
    ``static-auth-secret`` line each; coturn 4.6 checks a credential against every one: README.turnserver,
    and tried here on Debian's 4.6.1), so that credentials minted with the old secret keep working while
    the runtime mints with the new one (docs/deploying.md, "The TURN secret and its rotation").

    Paths: the certificate and key as the profile names them (a ``compose`` node mounts their directories
    at the same paths; the local node runs coturn from its node directory, so relative paths resolve there).
    ``tls`` False: no TLS listener (``no-tls``; a Kubernetes region without a certificate for its TURN name).

    Raises:
        ValueError: the relay is disabled, the secret is under 32 bytes or holds whitespace, quotes or
            ``#`` (coturn's configuration syntax has no quoting), or the relay range does not fit.
    """
    relay = profile.relay
    if not relay.enabled:
        raise ValueError(f"profile {profile.name!r} has relay.enabled false: it runs no coturn")
    for value in (secret, *previous_secrets):
        if len(value.encode()) < 32 or _SECRET_FORBIDDEN & set(value):
            raise ValueError(
                "the TURN secret must be at least 32 bytes without whitespace, quotes or '#' "
                "(it is written into turnserver.conf unquoted)"
            )
    low, high = relay_port_range(relay, profile.sessions)
    user_quota, total_quota = relay_quota(profile.sessions)
    lines = [
        f"# Rendered by infra.node.bundle.coturn for profile {profile.name!r}. Do not edit: re-render.",
        "# Secret file: it holds the TURN REST shared secret (static-auth-secret).",
        "",
        "# Authentication: TURN REST credentials minted per session (runtime/frontend/transports/webrtc).",
        "fingerprint",
        "use-auth-secret",
        f"static-auth-secret={secret}",
        *(f"static-auth-secret={old}" for old in previous_secrets if old != secret),
        f"realm={profile.domain}",
        f"server-name={profile.domain}",
        "stale-nonce=600",
        "",
        "# Listeners: TURN over UDP and TURN over TLS (the node's nginx certificate).",
    ]
    if profile.deployment == "processes":
        lines.append(f"listening-ip={profile.public_address}")
    lines += [
        f"listening-port={relay.port}",
        *(
            [
                f"tls-listening-port={relay.tls_port}",
                f"cert={profile.tls.certificate_path}",
                f"pkey={profile.tls.private_key_path}",
            ]
            if tls
            else ["no-tls"]
        ),
        "no-tcp",
        "no-dtls",
        "no-tlsv1",
        "no-tlsv1_1",
        "",
        f"# Relay: {high - low + 1} UDP ports for {profile.sessions} sessions (infra.node.profile.relay).",
        f"min-port={low}",
        f"max-port={high}",
        f"user-quota={user_quota}",
        f"total-quota={total_quota}",
        "no-tcp-relay",
        "",
        "# Peers: the runtime's ICE sockets only.",
        "no-multicast-peers",
        *(f"denied-peer-ip={r}" for r in DENY_ALL_PEERS),
        *(f"allowed-peer-ip={r}" for r in peer_ranges(profile)),
        "",
        "# No admin surface, no version banner, no NAT discovery (STUN amplification).",
        "no-cli",
        "no-software-attribute",
        "no-rfc5780",
        "no-stun-backward-compatibility",
        "response-origin-only-with-rfc5780",
        "log-file=stdout",
        "simple-log",
    ]
    if profile.deployment == "compose":
        lines += ["", "# Metrics for the node's Prometheus (private network).", "prometheus"]
        lines.append(f"prometheus-port={relay.metrics_port}")
    return "\n".join(lines) + "\n"


def coturn_args(config_path: str, pid_file: str) -> list[str]:
    """``turnserver``'s command line (without the program name): the configuration file and a pid file
    the process can write (the default, ``/var/run/turnserver.pid``, needs root).

    Raises:
        ValueError: an empty path.
    """
    for name, value in (("config_path", config_path), ("pid_file", pid_file)):
        if not value:
            raise ValueError(f"{name} must not be empty")
    return ["-c", config_path, f"--pidfile={pid_file}"]
