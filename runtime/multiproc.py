"""``duplex serve`` with the process split: one engine process and N front-end worker processes on one port.

The :class:`Supervisor` (the process ``duplex serve`` runs in) starts the engine and the workers (all on
``config.port`` with ``SO_REUSEPORT``), links them over ZeroMQ, restarts a worker that dies, and exits 1
``ENGINE_DEAD_EXIT_S`` after the engine dies so that the node is restarted. :class:`PortLock` makes a
second node on the same port fail at once with :class:`PortTaken`; :func:`default_workers` is
``--workers -1``.

The split, failures, one node per port: docs/runtime.md, "Processes: one engine, N front-end workers"."""

from __future__ import annotations

import contextlib
import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from runtime.config import RuntimeConfig

__all__ = ["ENGINE_DEAD_EXIT_S", "PortLock", "PortTaken", "Supervisor", "default_workers"]

log = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_S = 30.0
"""After the engine died, how long the workers stay up answering 500 before the supervisor exits (1)."""
MAX_RESTARTS_PER_MINUTE = 10
"""Worker restarts allowed per minute before the supervisor gives up (exit 1)."""


MAX_DEFAULT_WORKERS = 8
"""Most workers ``--workers -1`` picks (each holds dozens of Opus sessions; a node has at most 256 slots)."""


def default_workers(cpu_count: int | None = None) -> int:
    """Front-end workers ``duplex serve --workers -1`` starts on a host with ``cpu_count`` cores (default:
    this process's CPU affinity; a Kubernetes CPU limit is a quota, not a cpuset, so the Deployment sets
    ``DUPLEX_WORKERS``): one per core, between 1 and ``MAX_DEFAULT_WORKERS``.

    Why one per core and not cores - 1 (the rule before, which left a core to the engine): the workers
    (Opus, WebSockets, HTTP) are where a node's CPU goes, while the engine's tick mostly waits (on the GPU;
    the sim model sleeps). 64 Opus sessions of speech, sim model at 30 ms,
    ``python -m runtime.tools.bench_frontend sessions --workers W --sessions 64 --seconds 20`` on 2 cores:

    ====================================  ===============  ============  ============
    frames lost of 16,000                 one process (0)  1 worker      2 workers
    ====================================  ===============  ============  ============
    issue 21's run                        0                7.5 %         0.0 %
    issue 16's run (load about 3)         38 %             56 %          6 %
    shared, load 8.5-11 (Nov 2026)        93 %             100 %         95 %
    shared, load 4-6 (Nov 2026)           99 %             85 %          87 %
    ====================================  ===============  ============  ============

    The first two rows decide (the second is docs/benchmarks.md, "The front end under load (issue 16)"):
    on 2 cores 1 worker (cores - 1) was the worst setting and 2 (one per core) the best. The last two
    (one run each, November 2026) were taken while about eight other jobs shared the same 2 cores: node
    and load generator starved alike (first audio p99 0.3-1 s, gaps over 1 s), so they rank nothing.
    Above 2 cores the rule is not measured; set ``DUPLEX_WORKERS`` where a measurement says otherwise.
    """
    if cpu_count is None:  # the cores this process may run on (a cpuset), not the host's
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cpu_count or 2
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


class PortTaken(OSError):
    """The node's port is already served: by another duplex node (its :class:`PortLock`) or by another
    program listening on it. The message names the port, the holder and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EADDRINUSE, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _describe_process(pid: int) -> str:
    """``pid 1234 (python -m runtime.tools.cli serve ...)``, or just the pid where /proc does not tell."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return f"pid {pid}"
    command = " ".join(a.decode(errors="replace") for a in argv)
    return f"pid {pid} ({command[:120]})" if command else f"pid {pid}"


def _tcp_listeners(port: int) -> list[int]:
    """Pids of the processes (of those this user may inspect) with a TCP socket listening on ``port``,
    from ``/proc/net/tcp``, ``/proc/net/tcp6`` and ``/proc/<pid>/fd``; empty where /proc does not tell."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # local address "ADDR:PORT" in hex, state 0A = LISTEN, inode in column 10
                if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    pids: list[int] = []
    if not inodes:
        return pids
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
    return sorted(pids)


class PortLock:
    """An exclusive claim on TCP ``port`` for one node, held by the supervisor from its start to its exit.

    The claim is an abstract Unix socket named ``duplex-node-port-<port>``, bound and listening. Why this
    and not gunicorn's way (the supervisor binds the port once and hands the socket to its workers): the
    workers listen through ``websockets.serve`` (``runtime/frontend/worker.py``, being rewritten for a new
    HTTP layer), and a lock keeps the supervisor out of how they listen. The kernel allows one socket per
    abstract name and frees it when the socket closes or its process dies, even by SIGKILL (no stale lock
    file, nothing to clean up), and abstract names are scoped to the network namespace as ports are (two
    containers each with its own port 8998 do not collide). Children do not inherit it (Python sockets
    are not inheritable). A second node's bind fails with EADDRINUSE; it then connects and reads the
    holder's pid with ``SO_PEERCRED`` to name it (Linux ``unix(7)``, ``socket(7)``).

    A TCP listener that is not a duplex node with workers (``--workers 0``, nginx, anything) holds no
    lock: :meth:`acquire` also tries to bind the port itself (``SO_REUSEADDR``, no ``SO_REUSEPORT``),
    which fails while anything listens on it.

    Args:
        port: the node's TCP port (1..65535).
        host: the node's listen address (for the TCP check).
    Raises:
        ValueError: ``port`` outside 1..65535.
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
        self.port = port
        self.host = host
        self.name = f"\0duplex-node-port-{port}"
        self._socket: socket.socket | None = None

    @property
    def held(self) -> bool:
        return self._socket is not None

    def acquire(self) -> None:
        """Claim the port (idempotent).

        Raises:
            PortTaken: another node holds the claim, or another program listens on the port.
        """
        if self._socket is not None:
            return
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(self.name)
        except OSError as exc:
            lock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortTaken(
                f"port {self.port} is already served by another duplex node ({self._holder()}): stop it "
                "first, or give this node another port (--port, DUPLEX_PORT)"
            ) from None
        lock.listen(16)
        lock.setblocking(False)
        self._socket = lock
        try:
            self._check_tcp_port()
        except BaseException:
            self.release()
            raise

    def _holder(self) -> str:
        """The lock holder's pid and command line, read with SO_PEERCRED."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(self.name)
                credentials = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            except OSError:
                return "its supervisor's pid unknown"
        pid, _, _ = struct.unpack("3i", credentials)
        return f"supervisor {_describe_process(pid)}"

    def _check_tcp_port(self) -> None:
        infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                holders = ", ".join(_describe_process(pid) for pid in _tcp_listeners(self.port))
                raise PortTaken(
                    f"port {self.port} on {self.host} is already in use by "
                    f"{holders or 'another program'}: stop it first, or give this node another port "
                    "(--port, DUPLEX_PORT)"
                ) from None

    def answer_probes(self) -> None:
        """Accept and close the connections other nodes made to read the holder's pid (they would fill
        the socket's backlog otherwise). Non-blocking; called from the supervisor's loop."""
        if self._socket is None:
            return
        while True:
            try:
                connection, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            connection.close()

    def release(self) -> None:
        """Give the port up (idempotent); the process's exit does it too."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class Supervisor:
    """Starts and watches the engine and the workers (see the module docstring).

    Args:
        config: the node's settings; ``config.port`` must not be 0 (the workers share one port).
        workers: front-end worker processes (>= 1).
        engine_dead_exit_s: see ``ENGINE_DEAD_EXIT_S``.
    Raises:
        ValueError: ``workers`` < 1 or port 0.
        PortTaken: the port is already served (:class:`PortLock`); nothing was started.
    """

    def __init__(
        self, config: RuntimeConfig, workers: int, *, engine_dead_exit_s: float = ENGINE_DEAD_EXIT_S
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if config.port == 0:
            raise ValueError("the workers share one port: give a port (DUPLEX_PORT), not 0")
        self.port_lock = PortLock(config.port, config.host)
        self.port_lock.acquire()  # before anything else: a second node stops here
        self.config = config
        self.workers = workers
        self.engine_dead_exit_s = engine_dead_exit_s
        self._dir = tempfile.mkdtemp(prefix="duplex-node-")
        self.address = f"ipc://{self._dir}/engine.sock"
        self.metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.path.join(self._dir, "metrics")
        os.makedirs(self.metrics_dir, exist_ok=True)
        for name in os.listdir(self.metrics_dir):  # values of an earlier run must not be added in
            if name.endswith(".db"):
                os.unlink(os.path.join(self.metrics_dir, name))
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.metrics_dir  # before any child starts
        self._context = multiprocessing.get_context("spawn")
        self.engine: BaseProcess | None = None
        self.worker_processes: dict[int, BaseProcess] = {}
        self._stop = threading.Event()
        self._restarts: list[float] = []

    def _start_engine(self) -> None:
        from runtime.engine.engine_core import engine_main

        self.engine = self._context.Process(
            target=engine_main, args=(self.config, self.address), name="duplex-engine"
        )
        self.engine.start()

    def _start_worker(self, index: int) -> None:
        from runtime.frontend.worker import worker_main

        process = self._context.Process(
            target=worker_main,
            args=(self.config, self.address, f"worker-{index}"),
            name=f"duplex-worker-{index}",
        )
        process.start()
        self.worker_processes[index] = process

    def stop(self) -> None:
        """Ask :meth:`run` to drain and stop (thread-safe; the SIGTERM handler calls it)."""
        self._stop.set()

    def run(self) -> int:
        """Run until :meth:`stop` (or SIGTERM/SIGINT when called on the main thread); the exit status."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        self._start_engine()
        for index in range(self.workers):
            self._start_worker(index)
        log.info(
            "node: engine pid %s, %d front-end workers on port %d",
            self.engine.pid if self.engine else "?",
            self.workers,
            self.config.port,
        )
        status = 0
        engine_dead_at: float | None = None
        try:
            while not self._stop.wait(0.2):
                self.port_lock.answer_probes()
                if self.engine is not None and not self.engine.is_alive():
                    if engine_dead_at is None:
                        engine_dead_at = time.monotonic()
                        log.error(
                            "node: the engine process exited (code %s); every worker now answers /healthz "
                            "500; exiting in %.0f s",
                            self.engine.exitcode,
                            self.engine_dead_exit_s,
                        )
                        self._mark_dead(self.engine.pid)
                    elif time.monotonic() - engine_dead_at > self.engine_dead_exit_s:
                        status = 1
                        break
                for index, process in list(self.worker_processes.items()):
                    if process.is_alive():
                        continue
                    log.error(
                        "node: worker %d (pid %s) exited with %s; starting it again",
                        *(index, process.pid, process.exitcode),
                    )
                    self._mark_dead(process.pid)
                    now = time.monotonic()
                    self._restarts = [t for t in self._restarts if now - t < 60] + [now]
                    if len(self._restarts) > MAX_RESTARTS_PER_MINUTE:
                        log.error("node: %d worker restarts in a minute; giving up", len(self._restarts))
                        status = 1
                        self._stop.set()
                        break
                    self._start_worker(index)
        finally:
            self._shutdown()
        return status

    def _mark_dead(self, pid: int | None) -> None:
        if pid is None:
            return
        from prometheus_client import multiprocess

        with contextlib.suppress(OSError):
            multiprocess.mark_process_dead(pid, self.metrics_dir)

    def _shutdown(self) -> None:
        """SIGTERM to the workers (they drain) and the engine (it stops when its sessions are gone)."""
        processes = [*self.worker_processes.values(), *([self.engine] if self.engine else [])]
        for process in processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_grace_s + 15
        for process in processes:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)
        self.port_lock.release()
