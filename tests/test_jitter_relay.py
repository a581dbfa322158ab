"""The jitter relay (``infra.node.local.jitter_relay``) on its own, against a plain TCP server on loopback: it
tunnels ``CONNECT`` to loopback only, passes bytes both ways, cuts the server's bytes at TLS record
boundaries (a record split over several reads, or several in one read), keeps their order under random
delays, counts audio-sized records, and refuses bad settings. Its use with a browser is in
``test_browser_client``. No assertion on how long anything took: counts and order only."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from infra.node.local.jitter_relay import AUDIO_RECORD_MIN_BYTES, JitterRelay
from infra.node.local.playout_bench import summarize_leads

TIMEOUT_S = 30.0  # hang guard


def record(index: int, size: int) -> bytes:
    """A TLS application-data record of ``size`` payload bytes, each byte the record's index."""
    return bytes([0x17, 3, 3]) + size.to_bytes(2, "big") + bytes([index % 256]) * size


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def upstream() -> Iterator[int]:
    """A server that reads one line, then answers with 40 records (every 4th audio-sized) in odd-sized
    writes that split and join records."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            data = b"".join(record(i, 3841 if i % 4 == 0 else 40) for i in range(40))
            for start in range(0, len(data), 1000):
                self.wfile.write(data[start : start + 1000])

    with _Server(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield server.server_address[1]
        server.shutdown()


def tunnel(relay: JitterRelay, target: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", relay.port), timeout=TIMEOUT_S)
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            break
        head += chunk
    return sock, head


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("max_delay_ms", [0.0, 30.0])
def test_records_pass_in_order(upstream: int, max_delay_ms: float) -> None:
    with JitterRelay(max_delay_ms=max_delay_ms, seed=1) as relay:
        sock, head = tunnel(relay, f"localhost:{upstream}")
        assert head.startswith(b"HTTP/1.1 200")
        sock.sendall(b"hello\n")
        data = read_all(sock)
        sock.close()
    expected = b"".join(record(i, 3841 if i % 4 == 0 else 40) for i in range(40))
    assert data == expected  # every byte, in order, whatever each record's delay
    assert relay.chunks == 40 and relay.audio_records == 10
    assert (relay.delayed_ms > 0) == (max_delay_ms > 0)
    assert relay.delayed_ms <= 40 * max_delay_ms
    assert 3841 + 5 >= AUDIO_RECORD_MIN_BYTES > 40 + 5


def test_paced_records_still_pass_in_order(upstream: int) -> None:
    with JitterRelay(seed=2, pace_lead_ms=20.0) as relay:
        sock, _ = tunnel(relay, f"127.0.0.1:{upstream}")
        sock.sendall(b"hello\n")
        data = read_all(sock)
        sock.close()
    assert data == b"".join(record(i, 3841 if i % 4 == 0 else 40) for i in range(40))
    assert relay.audio_records == 10 and relay.late_for_pace <= relay.audio_records


def test_only_loopback_targets(upstream: int) -> None:
    with JitterRelay() as relay:
        for target in ("example.com:443", "10.0.0.1:443", f"localhost:{upstream}x", "nonsense"):
            sock, head = tunnel(relay, target)
            assert head.startswith(b"HTTP/1.1 403"), target
            sock.close()
        assert relay.chunks == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_delay_ms"):
        JitterRelay(max_delay_ms=-1)
    with pytest.raises(ValueError, match="pace"):
        JitterRelay(pace_lead_ms=-5)
    relay = JitterRelay()
    with pytest.raises(ValueError, match="max_delay_ms"), relay.jitter(-1):
        pass
    with relay.jitter(50):
        assert relay.max_delay_ms == 50
    assert relay.max_delay_ms == 0
    relay.stop()  # never started: nothing to do


def test_summarize_leads_skips_the_first_frame() -> None:
    assert summarize_leads([40, 10, 20, 30]) == {"mean": 20, "p50": 20, "p95": 30, "max": 30}
    with pytest.raises(ValueError, match="two scheduled frames"):
        summarize_leads([40])
