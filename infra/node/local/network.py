"""The local node's ports and addresses (``infra.node.local.node``): a ``local`` profile on free ports (tests,
``duplex node up --free-ports``), with a free block of relay ports above Linux's ephemeral range; this
host's IPv4 addresses (the runtime's ICE host candidates, so the peers the relay may reach); a STUN Binding
probe of the relay; whether a TCP port is taken. ``infra.node.local.node`` re-exports the public names."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import random
import socket
import struct

from infra.node.profile.profiles import NodeProfile, get_profile
from infra.node.profile.relay import relay_port_range
from runtime.tools.local_redis import free_loopback_port

__all__ = ["free_port_profile", "host_ipv4_addresses", "port_in_use", "stun_binding_ok", "udp_ports_free"]


def free_port_profile(**overrides: object) -> NodeProfile:
    """The ``local`` profile with every port replaced by a free loopback port (tests, ``--free-ports``)."""
    names = (
        "https",
        "http",
        "runtime",
        "redis",
        "prometheus",
        "grafana",
        "node_exporter",
        "redis_exporter",
        "alertmanager",
    )
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(names):
        ports = {name: free_loopback_port() for name in names}
    ports["dcgm_exporter"] = 1 + max(ports.values())  # unused on a CPU node, must merely be distinct
    if "relay" not in overrides:
        relay_port = _free_udp_port(exclude=set(ports.values()))
        tls_port = free_loopback_port()
        while tls_port in {*ports.values(), relay_port}:
            tls_port = free_loopback_port()
        # A free block of relay ports above Linux's ephemeral range (infra.node.profile.relay), from a random
        # start so that nodes started at once (parallel test runs) rarely pick the same one.
        wanted = overrides.get("max_sessions")
        sessions = wanted if isinstance(wanted, int) else 5
        base = get_profile("local").relay
        size = 1 + relay_port_range(base, sessions)[1] - base.relay_min_port
        blocks = list(range(base.relay_min_port, 65536 - size, size))
        first = random.randrange(len(blocks))
        start = next(b for b in blocks[first:] + blocks[:first] if udp_ports_free(b, size))
        overrides["relay"] = {"port": relay_port, "tls_port": tls_port, "relay_min_port": start}
    return get_profile("local", ports=ports, **overrides)


def udp_ports_free(first: int, count: int) -> bool:
    """Whether UDP ports ``first`` .. ``first + count - 1`` can all be bound on loopback now."""
    for port in range(first, first + count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _free_udp_port(exclude: set[int]) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in exclude:
            return port


def host_ipv4_addresses() -> tuple[str, ...]:
    """This host's IPv4 interface addresses but loopback (``SIOCGIFADDR``, one per interface): the host
    candidates the runtime's ICE agent gathers (aioice 0.13 skips only 127.0.0.1), so the peers the local
    node's relay may reach. Empty where no interface has one."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            address = socket.inet_ntoa(answer[20:24])
            if not ipaddress.ip_address(address).is_loopback and address not in found:
                found.append(address)
    return tuple(found)


def stun_binding_ok(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """A STUN Binding request (RFC 8489 section 5: type 0x0001, the magic cookie, a random transaction id)
    to ``host:port`` over UDP is answered with a Binding success response carrying the same id."""
    transaction = os.urandom(12)
    request = struct.pack("!HHI", 0x0001, 0, 0x2112A442) + transaction
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.sendto(request, (host, port))
            answer = sock.recv(2048)
        except OSError:
            return False
    return len(answer) >= 20 and answer[:2] == b"\x01\x01" and answer[8:20] == transaction


def port_in_use(host: str, port: int) -> bool:
    """Whether a TCP socket cannot bind ``host:port`` (something listens there, or it is not ours)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False
