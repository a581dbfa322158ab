"""A throwaway ``redis-server`` on a loopback port, for the demo (``duplex demo``) and the tests.

:class:`RedisServer` runs ``redis-server`` (found on PATH; Debian package ``redis-server``) on a free
127.0.0.1 port without persistence, with its working dir and log under ``workdir``. It can be stopped and
started again on the SAME port, so clients see an outage and a restart. Production nodes run Redis as a
service instead (see the node bundle).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class LocalRedisError(RuntimeError):
    """redis-server is missing or did not come up; the message says which and how to fix it."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (another process may take it before you bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A ``redis-server`` child process on ``127.0.0.1:port``.

    Args:
        workdir: directory for its ``--dir`` (dump file) and its log file ``redis.log``.
        port: TCP port; a free one is picked when None. Kept across :meth:`stop`/:meth:`start`.

    Raises:
        LocalRedisError (from :meth:`start`): ``redis-server`` is not on PATH, exits early, or
            does not answer PING within ``startup_timeout_s``.
    """

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_loopback_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:{port}/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, startup_timeout_s: float = 10.0) -> None:
        """Start the server (on the same port as before, if restarted) and wait until PING answers."""
        if self.running:
            return
        exe = shutil.which("redis-server")
        if exe is None:
            raise LocalRedisError(
                "redis-server not found on PATH: install Redis >= 6 (apt-get install redis-server)"
            )
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child process owns it
        try:
            self.proc = subprocess.Popen(
                [
                    exe,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._command(b"PING", timeout_s=0.2) == b"+PONG":
                return
            time.sleep(0.02)
        self.stop()
        tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        raise LocalRedisError(f"redis-server did not answer PING on port {self.port}:\n{tail}")

    def stop(self, *, save: bool = False, timeout_s: float = 5.0) -> None:
        """Stop the server: ``SHUTDOWN NOSAVE`` (the next :meth:`start` comes back empty) or
        ``SHUTDOWN SAVE`` (the next :meth:`start` reloads the data); terminate, then kill, if it is
        still alive after ``timeout_s`` (s)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            self._command(b"SHUTDOWN SAVE" if save else b"SHUTDOWN NOSAVE", timeout_s=1.0)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.proc = None
        if not save:  # an earlier stop(save=True) left a dump: the next start must come back empty
            (self.workdir / "dump.rdb").unlink(missing_ok=True)

    def _command(self, cmd: bytes, timeout_s: float) -> bytes | None:
        """Send one inline command; the first reply line, or None when unreachable/closed."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as s:
                s.sendall(cmd + b"\r\n")
                return s.recv(64).split(b"\r\n", 1)[0] or None
        except OSError:
            return None
