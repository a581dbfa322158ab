"""The port belongs to one node (runtime/multiproc.py, ``PortLock``).

Guards issue 21: a second ``duplex serve --workers N`` (N >= 1) on a port another node already served
started without error; its workers bound with ``SO_REUSEPORT`` beside the first node's and the kernel split
callers between two nodes. Now the second supervisor stops at start with a message naming the port and the
first node's supervisor. ``--workers 0`` keeps failing as it did ("address already in use").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_process_split import REPO, serve_command, sim_node_env, split_node

from runtime.multiproc import PortLock, PortTaken
from runtime.tools.local_redis import free_loopback_port


def _serve(port: int, workers: int) -> subprocess.CompletedProcess[str]:
    """``duplex serve --port PORT --workers N`` on the sim model, run to its exit (it should not start)."""
    # COLUMNS: Rich wraps at the terminal's width; keep the message on one line.
    env = sim_node_env(COLUMNS="400")
    return subprocess.run(
        serve_command(port, workers), env=env, capture_output=True, text=True, timeout=180, check=False
    )


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_second_node_on_a_served_port_fails_at_start(tmp_path: Path) -> None:
    async with split_node(tmp_path, workers=1) as node:
        second = _serve(node.port, workers=1)
        output = " ".join((second.stdout + second.stderr).split())
        assert second.returncode != 0, output
        assert f"port {node.port} is already served by another duplex node" in output
        assert f"supervisor pid {node.process.pid}" in output  # the first node's supervisor, by name
        assert "another port (--port, DUPLEX_PORT)" in output
        one_process = _serve(node.port, workers=0)  # as before: the single process cannot bind
        output = " ".join((one_process.stdout + one_process.stderr).split())
        assert one_process.returncode != 0 and "address already in use" in output.lower(), output
        assert node.process.poll() is None  # the first node is untouched


def test_a_port_another_program_listens_on_is_refused_with_its_pid() -> None:
    """A listener that holds no lock (``--workers 0``, nginx...): the supervisor's own bind finds it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        lock = PortLock(port)
        with pytest.raises(
            PortTaken, match=rf"port {port} on 127.0.0.1 is already in use by pid {os.getpid()}"
        ):
            lock.acquire()
        assert not lock.held  # the claim taken before the check is given back


def test_the_claim_is_exclusive_and_dies_with_its_process() -> None:
    port = free_loopback_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from runtime.multiproc import PortLock; lock = PortLock({port}); lock.acquire(); "
            "print('held', flush=True); input()",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(PortTaken, match=rf"port {port} .*supervisor pid {holder.pid} \("):
            PortLock(port).acquire()
        holder.send_signal(signal.SIGKILL)  # no cleanup runs: the kernel frees the name
        holder.wait(30)
        lock = PortLock(port)
        lock.acquire()
        assert lock.held
        lock.release()
        again = PortLock(port)
        again.acquire()  # released: free again
        again.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


def test_bad_ports_are_refused() -> None:
    for bad in (0, 70000):
        with pytest.raises(ValueError, match="port must be in 1..65535"):
            PortLock(bad)
