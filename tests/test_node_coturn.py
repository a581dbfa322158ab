"""The node's TURN relay, for real: coturn (Debian's ``turnserver`` 4.6.1) started on loopback from the
configuration ``infra.node.bundle.coturn`` renders, exercised with coturn's own test client
(``turnutils_uclient``) and echo peer (``turnutils_peer``), with credentials minted by
``runtime.frontend.transports.webrtc.turn`` the way the runtime
mints them per session.

What must hold: minted credentials allocate and relay UDP to the runtime's address (TURN over UDP and over
TLS with the node's certificate); a wrong password, an expired username or another secret's credentials are
refused; the relay reaches the runtime's address only (loopback and other private addresses are forbidden
peers); one session's credentials hold at most ``ALLOCATIONS_PER_SESSION`` allocations; no CLI port.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.node.bundle.coturn import coturn_args, render_turnserver_conf
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.node import free_port_profile, host_ipv4_addresses, stun_binding_ok
from infra.node.profile.profiles import NodeProfile
from infra.node.profile.relay import ALLOCATIONS_PER_SESSION, relay_port_range
from runtime.frontend.transports.webrtc.turn import TurnCredentials, mint_turn_credentials
from runtime.tools.local_redis import free_loopback_port

SECRET = "coturn-test-secret-0123456789abcdefghijklmnop"
PREVIOUS = "coturn-previous-secret-0123456789abcdefghijkl"
"""The secret ``SECRET`` replaced (a rotation in progress: ``turnSecretPrevious``), still accepted."""
WAIT_S = 60.0
"""Hang guard for a process to answer (not a speed bound)."""


@dataclass
class Relay:
    profile: NodeProfile
    peer: tuple[str, int]
    log: Path


def _wait(check: object, what: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():  # type: ignore[operator]
        assert process.poll() is None, f"{what} exited: {log.read_text(errors='replace')[-2000:]}"
        assert time.monotonic() < deadline, f"{what} not ready after {WAIT_S} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    """coturn from the rendered configuration, and an echo peer at the host's address (the runtime's ICE
    host candidate on a real node), both on free ports."""
    addresses = host_ipv4_addresses()
    assert addresses, "this host has no IPv4 address but loopback: the runtime would gather no candidate"
    directory = tmp_path_factory.mktemp("coturn")
    profile = free_port_profile()
    profile = profile.model_copy(
        update={"relay": profile.relay.model_copy(update={"peer_networks": (addresses[0],)})}
    )
    write_self_signed_certificate(
        directory / profile.tls.certificate_path, directory / profile.tls.private_key_path, domain="localhost"
    )
    conf = render_turnserver_conf(profile, SECRET, previous_secrets=(PREVIOUS,))
    (directory / "turnserver.conf").write_text(conf)
    log = directory / "coturn.log"
    peer_port = free_loopback_port()
    with open(log, "wb") as out, open(directory / "peer.log", "wb") as peer_out:
        coturn = subprocess.Popen(
            ["turnserver", *coturn_args("turnserver.conf", str(directory / "turnserver.pid"))],
            cwd=directory,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        peer = subprocess.Popen(
            ["turnutils_peer", "-L", addresses[0], "-p", str(peer_port)], stdout=peer_out, stderr=peer_out
        )
    try:
        _wait(lambda: stun_binding_ok("127.0.0.1", profile.relay.port), "coturn", coturn, log)
        yield Relay(profile, (addresses[0], peer_port), log)
    finally:
        for process in (peer, coturn):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _mint(
    session_id: str, *, ttl_s: int = 600, now: float | None = None, secret: str = SECRET
) -> TurnCredentials:
    return mint_turn_credentials(secret.encode(), session_id, ttl_s, time.time() if now is None else now)


def _uclient(
    relay: Relay,
    credentials: TurnCredentials,
    *,
    password: str | None = None,
    tls: bool = False,
    peer: tuple[str, int] | None = None,
    clients: int = 1,
    verbose: bool = False,
) -> str:
    """Run coturn's test client: ``clients`` allocations with these credentials, 5 messages of 100 bytes
    each to the peer through the relay, echoed back; returns its output."""
    host, port = peer or relay.peer
    relay_port = relay.profile.relay.tls_port if tls else relay.profile.relay.port
    argv = ["turnutils_uclient", "-u", credentials.username, "-w", password or credentials.password]
    argv += ["-e", host, "-r", str(port), "-p", str(relay_port), "-n", "5", "-m", str(clients), "-c"]
    argv += ["-t", "-S"] if tls else []
    argv += ["-v"] if verbose else []
    result = subprocess.run([*argv, "127.0.0.1"], capture_output=True, text=True, timeout=WAIT_S * 2)
    return result.stdout + result.stderr


def _received(output: str) -> int:
    """Messages echoed back through the relay (the client's last ``tot_recv_msgs`` count); 0 if none."""
    counts = re.findall(r"start_mclient: tot_send_msgs=(\d+), tot_recv_msgs=(\d+)", output)
    return int(counts[-1][1]) if counts else 0


def test_minted_credentials_relay_udp_to_the_runtime_address(relay: Relay) -> None:
    output = _uclient(relay, _mint("session-udp"))
    # Echoed back through the relay: at least one of the 5 (how many arrive before the client stops waiting
    # depends on the machine's load, not on the relay).
    assert _received(output) >= 1, output


def test_turn_over_tls_with_the_node_certificate(relay: Relay) -> None:
    output = _uclient(relay, _mint("session-tls"), tls=True)
    assert "method=TLSv1.3" in output or "method=TLSv1.2" in output, output
    assert _received(output) >= 1, output


@pytest.mark.parametrize(
    "case",
    ["wrong-password", "expired", "other-secret"],
)
def test_bad_credentials_are_refused(relay: Relay, case: str) -> None:
    if case == "wrong-password":
        good = _mint("session-wrong")
        output = _uclient(relay, good, password=_mint("session-other").password)
    elif case == "expired":  # valid an hour ago, for a minute
        output = _uclient(relay, _mint("session-expired", ttl_s=60, now=time.time() - 3600))
    else:
        output = _uclient(relay, _mint("session-foreign", secret="another-secret-" + "x" * 32))
    assert "Cannot complete Allocation" in output, output
    assert _received(output) == 0, output


def test_during_a_rotation_the_previous_secret_still_relays(relay: Relay) -> None:
    """Credentials a runtime minted before the rotation (the previous secret) keep working; the other-secret
    case above shows a secret coturn was not given is still refused."""
    output = _uclient(relay, _mint("session-rotated", secret=PREVIOUS))
    assert _received(output) >= 1, output


@pytest.mark.parametrize("peer_host", ["127.0.0.1", "10.20.30.40", "169.254.169.254"])
def test_only_the_runtime_address_is_a_peer(relay: Relay, peer_host: str) -> None:
    """Loopback, another private address and the cloud metadata server are forbidden peers (403)."""
    output = _uclient(relay, _mint(f"session-peer-{peer_host.replace('.', '-')}"), peer=(peer_host, 3480))
    assert "403 (Forbidden IP)" in output, output
    assert _received(output) == 0, output


def test_one_session_holds_at_most_its_quota_of_allocations(relay: Relay) -> None:
    output = _uclient(relay, _mint("session-quota"), clients=ALLOCATIONS_PER_SESSION + 1)
    assert "486 (Allocation Quota Reached)" in output, output


def test_relay_ports_and_admin_surface(relay: Relay) -> None:
    """Allocations come from the rendered relay range; the CLI (telnet, 5766) is off; no plain TCP TURN."""
    low, high = relay_port_range(relay.profile.relay, relay.profile.sessions)
    output = _uclient(relay, _mint("session-ports"), clients=2, verbose=True)
    ports = [int(p) for p in re.findall(r"Received relay addr: 127\.0\.0\.1:(\d+)", output)]
    assert ports and all(low <= p <= high for p in ports), (low, high, output)
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", 5766)) != 0, "coturn's CLI port answers"
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", relay.profile.relay.port)) != 0, "plain TCP TURN is on"
