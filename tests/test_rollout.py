"""The node's rollout agent (``infra.node.bundle.rollout``), run here for real: the rendered POSIX script
against a fake GCE metadata server on loopback (the ``duplex-runtime-image`` key with ETags and
``wait_for_change``, as GCE answers), a real ``compose.yaml`` rendered by the node bundle, and fake
``docker``, ``systemctl`` and preparation script that record what they were asked (no Docker here). Also
the user-data that no longer carries the digest, and the data disk cloud-init mounts.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from test_server_e2e import speech  # noqa: F401 - a fixture

from infra.node.bundle.render import render_bundle
from infra.node.bundle.rollout import (
    ROLLOUT_METADATA_KEY,
    add_rollout,
    data_disk_path,
    pending_image,
    render_agent,
    render_rollout_files,
)
from infra.node.profile.profiles import get_profile

REPO = "us-central1-docker.pkg.dev/my-gcp-project/duplex-dev/duplex-runtime"
IMAGE_A = f"{REPO}@sha256:" + "a" * 64
IMAGE_B = f"{REPO}@sha256:" + "b" * 64
KEY_PATH = f"/computeMetadata/v1/instance/attributes/{ROLLOUT_METADATA_KEY}"


class FakeMetadata:
    """The one attribute key, with an ETag per value; ``wait_for_change`` answers when the ETag differs."""

    def __init__(self, value: str) -> None:
        self.value, self.version = value, 1
        self.changed = threading.Condition()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                if parts.path != KEY_PATH:
                    return self._answer(404, "not found", None)
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._answer(403, "Missing Metadata-Flavor:Google header.", None)
                with fake.changed:
                    if query.get("wait_for_change") == ["true"]:
                        last = query.get("last_etag", [""])[0]
                        fake.changed.wait_for(lambda: fake.etag != last, 10)
                    value, etag = fake.value, fake.etag
                return self._answer(200, value, etag)

            def _answer(self, status: int, body: str, etag: str | None) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                if etag:
                    self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.root = f"http://127.0.0.1:{self.httpd.server_address[1]}/computeMetadata/v1"

    @property
    def etag(self) -> str:
        return f"{self.version:016x}"

    def set(self, value: str) -> None:
        with self.changed:
            self.value, self.version = value, self.version + 1
            self.changed.notify_all()


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata(IMAGE_A)
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


PROFILE = get_profile("t4-int8", runtime_image=pending_image(IMAGE_A))


class Node:
    """A node's /etc/duplex in ``tmp_path`` with the bundle's compose.yaml, the agent, and fake commands
    that append ``<name> <args> [runtime image in compose.yaml]`` to ``calls.log``."""

    def __init__(self, tmp_path: Path, metadata_root: str, *, docker_fails: bool = False) -> None:
        self.root = tmp_path / "etc-duplex"
        self.root.mkdir()
        self.compose = self.root / "compose.yaml"
        self.compose.write_bytes(render_bundle(PROFILE)["compose.yaml"])
        self.agent = tmp_path / "duplex-rollout"
        self.agent.write_text(render_agent(PROFILE))
        self.log = tmp_path / "calls.log"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        record = (
            f'img=$(sed -n "s/^    image: \\(.*duplex-runtime@.*\\)$/\\1/p" {self.compose})\n'
            f'echo "$(basename "$0") $* [$img]" >>{self.log}\n'
        )
        for name, status in (("docker", 1 if docker_fails else 0), ("systemctl", 0), ("prepare", 0)):
            path = bin_dir / name
            path.write_text(f"#!/bin/sh\n{record}exit {status}\n")
            path.chmod(0o755)
        self.env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "DUPLEX_ROLLOUT_ROOT": str(self.root),
            "DUPLEX_METADATA_URL": metadata_root,
            "DUPLEX_ROLLOUT_PREPARE": str(bin_dir / "prepare"),
            "DUPLEX_ROLLOUT_RETRY_S": "0",
            "DOCKER_CONFIG": str(tmp_path / "docker"),
        }

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", str(self.agent), *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def runtime_image(self) -> str:
        return yaml.safe_load(self.compose.read_text())["services"]["runtime"]["image"]

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


def test_sync_writes_the_metadata_image_into_compose(tmp_path: Path, metadata: FakeMetadata) -> None:
    """Guards item 9: the user-data names a pending image (repository, zeros); before every start of the
    node unit the agent writes the image of the metadata key, and only the runtime's line changes."""
    node = Node(tmp_path, metadata.root)
    before = yaml.safe_load(node.compose.read_text())
    assert node.runtime_image() == pending_image(IMAGE_A)
    done = node.run("sync")
    assert done.returncode == 0, done.stderr
    after = yaml.safe_load(node.compose.read_text())
    assert after["services"]["runtime"]["image"] == IMAGE_A
    before["services"]["runtime"]["image"] = IMAGE_A
    assert after == before, "nothing else changes"
    assert node.calls() == [], "sync neither pulls nor restarts (the unit is starting)"
    assert node.run("sync").returncode == 0 and node.runtime_image() == IMAGE_A  # idempotent


def test_a_new_digest_is_pulled_while_serving_then_the_node_restarts(
    tmp_path: Path, metadata: FakeMetadata
) -> None:
    """Guards item 9: a new digest in the metadata key rolls out without a new VM: the registry login
    (preparation script), the pull while the old image still runs, compose.yaml, then one restart of the
    node unit (whose stop drains), in this order."""
    node = Node(tmp_path, metadata.root)
    assert node.run("sync").returncode == 0
    metadata.set(IMAGE_B)
    done = node.run("watch", "--once")
    assert done.returncode == 0, done.stderr
    assert node.runtime_image() == IMAGE_B
    assert node.calls() == [
        f"prepare  [{IMAGE_A}]",
        f"docker pull --quiet {IMAGE_B} [{IMAGE_A}]",
        f"systemctl restart duplex-node.service [{IMAGE_B}]",
    ]
    assert "rolled out" in done.stderr


def test_the_watch_waits_for_a_change_and_rolls_it_out(tmp_path: Path, metadata: FakeMetadata) -> None:
    """The watch long-polls (``wait_for_change`` with the last ETag) and acts on the change when it comes."""
    node = Node(tmp_path, metadata.root)
    assert node.run("sync").returncode == 0
    proc = subprocess.Popen(["sh", str(node.agent), "watch"], env=node.env, stderr=subprocess.PIPE, text=True)
    try:
        metadata.set(IMAGE_B)
        for _ in range(200):
            if any(c.startswith("systemctl restart") for c in node.calls()):
                break
            threading.Event().wait(0.05)
        assert node.runtime_image() == IMAGE_B
        assert [c.split()[0] for c in node.calls()] == ["prepare", "docker", "systemctl"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "ghcr.io/org/runtime:latest",
        f"{REPO}@sha256:short",
        # Issue 33: digest-pinned, but not the stack's repository (another registry; a sibling name).
        "ghcr.io/attacker/runtime@sha256:" + "c" * 64,
        f"{REPO}-evil@sha256:" + "c" * 64,
        "us-central1-docker.pkg.dev/other-project/duplex-dev/duplex-runtime@sha256:" + "c" * 64,
    ],
)
def test_a_value_that_is_not_digest_pinned_is_refused(
    tmp_path: Path, metadata: FakeMetadata, value: str
) -> None:
    node = Node(tmp_path, metadata.root)
    assert node.run("sync").returncode == 0
    metadata.set(value)
    done = node.run("watch", "--once")
    assert done.returncode == 0
    assert "refusing metadata value" in done.stderr and f"not {REPO}@sha256:<64 hex>" in done.stderr
    assert node.runtime_image() == IMAGE_A and node.calls() == []
    assert node.run("sync").returncode == 1, "the unit does not start on a refused value"


def test_a_failed_pull_changes_nothing(tmp_path: Path, metadata: FakeMetadata) -> None:
    node = Node(tmp_path, metadata.root, docker_fails=True)
    assert node.run("sync").returncode == 0
    metadata.set(IMAGE_B)
    done = node.run("watch", "--once")
    assert done.returncode == 1 and f"cannot pull {IMAGE_B}" in done.stderr
    assert node.runtime_image() == IMAGE_A
    assert not any(c.startswith("systemctl") for c in node.calls())


def test_sync_without_the_metadata_server(tmp_path: Path, metadata: FakeMetadata) -> None:
    """A first start cannot guess the image (it fails and the unit retries); later starts keep the last."""
    node = Node(tmp_path, metadata.root)
    node.env["DUPLEX_METADATA_URL"] = "http://127.0.0.1:9/computeMetadata/v1"
    done = node.run("sync")
    assert done.returncode == 1 and "no image was ever set" in done.stderr
    node.env["DUPLEX_METADATA_URL"] = metadata.root
    assert node.run("sync").returncode == 0
    node.env["DUPLEX_METADATA_URL"] = "http://127.0.0.1:9/computeMetadata/v1"
    done = node.run("sync")
    assert done.returncode == 0 and f"keeping {IMAGE_A}" in done.stderr
    assert node.runtime_image() == IMAGE_A


def test_user_data_carries_the_agent_and_the_data_disk() -> None:
    """The node unit waits for the data disk's mount and syncs the image first; cloud-init formats the
    data disk only when it has no file system (``overwrite: false``) and mounts it at ``data_dir``."""
    from infra.node.bundle.cloud_init import USER_DATA_FILE, render_cloud_init

    user_data = render_cloud_init(PROFILE, render_bundle(PROFILE))[USER_DATA_FILE].decode()
    merged = add_rollout(user_data, PROFILE)
    assert merged.startswith("#cloud-config\n# Rendered by infra.node.bundle.cloud_init")
    document = yaml.safe_load(merged)
    written = {f["path"]: f for f in document["write_files"]}
    for path, content in render_rollout_files(PROFILE).items():
        assert written[path]["content"] == content
    drop_in = written["/etc/systemd/system/duplex-node.service.d/10-rollout.conf"]["content"]
    assert "RequiresMountsFor=/var/lib/duplex" in drop_in
    assert "ExecStartPre=/usr/local/sbin/duplex-rollout sync" in drop_in
    assert document["fs_setup"] == [
        {"label": "duplex-data", "filesystem": "ext4", "device": data_disk_path(), "overwrite": False}
    ]
    assert document["mounts"] == [
        [data_disk_path(), "/var/lib/duplex", "ext4", "defaults,nofail,discard", "0", "2"]
    ]
    runcmd = document["runcmd"]
    assert runcmd.index(["systemctl", "enable", "duplex-rollout.service"]) < runcmd.index(
        ["systemctl", "start", "--no-block", "duplex-node.service"]
    )
    assert runcmd[-1] == ["systemctl", "start", "--no-block", "duplex-rollout.service"]
    with pytest.raises(ValueError, match="#cloud-config"):
        add_rollout("runcmd: []\n", PROFILE)
    padded = user_data.replace("#cloud-config\n", "#cloud-config\n# " + "x" * 256 * 1024 + "\n", 1)
    with pytest.raises(ValueError, match="over GCE's 262144-byte limit"):
        add_rollout(padded, PROFILE)


def test_pending_image_needs_a_digest() -> None:
    assert pending_image(IMAGE_B) == f"{REPO}@sha256:" + "0" * 64
    with pytest.raises(ValueError, match="digest-pinned"):
        pending_image("ghcr.io/org/runtime:latest")


# --- the whole sequence with a real runtime process -------------------------------------------------------


@pytest.mark.slow
async def test_a_rollout_drains_a_live_session_and_the_node_comes_back(
    tmp_path: Path,
    metadata: FakeMetadata,
    speech,  # noqa: ANN001, F811 - the fixture of test_server_e2e
) -> None:
    """Item 9 end to end on this machine: the rendered agent rolls a new digest out to a node whose
    ``systemctl restart`` stops a real ``duplex serve`` process (SIGTERM, its drain) and starts it again,
    as the node unit's ExecStop/ExecStart do. The live session is closed with 1001 after the drain grace
    (not cut), the new process becomes ready, and the gap is printed (no timing asserted)."""
    import asyncio
    import sys
    import time

    from test_server_e2e import http_get, live

    from runtime.tools.local_redis import free_loopback_port

    port = free_loopback_port()
    node = Node(tmp_path, metadata.root)
    assert node.run("sync").returncode == 0
    script = Path(sys.executable).with_name("duplex")
    serve = f"{script} serve --port {port} --max-sessions 2 --log-level WARNING"
    pidfile, times = tmp_path / "runtime.pid", tmp_path / "times.log"
    env = (
        "env DUPLEX_DRAIN_GRACE_S=2 DUPLEX_AUTH_MODE=off DUPLEX_NODE_ID=rollout "
        f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"
    )
    start = f"nohup {env} {serve} >>{tmp_path}/serve.log 2>&1 & echo $! >{pidfile}"
    (tmp_path / "bin" / "systemctl").write_text(
        "#!/bin/sh\n"
        f'echo "systemctl $* $(date +%s.%N)" >>{times}\n'
        f'pid=$(cat {pidfile}); kill -TERM "$pid"\n'
        f'while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done\n'
        f'echo "stopped $(date +%s.%N)" >>{times}\n'
        f"{start}\n"
    )
    subprocess.run(["sh", "-c", start], check=True, env={**os.environ, **node.env})

    async def ready(timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if (await http_get(port, "/readyz"))[0] == 200:
                    return time.monotonic()
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise AssertionError((tmp_path / "serve.log").read_text())

    try:
        await ready(240)
        async with live(f"ws://127.0.0.1:{port}/api/chat?format=pcm", speech[0]) as client:
            assert client.result.handshake, client.result.errors
            client.start_streaming()
            await asyncio.sleep(0.5)
            metadata.set(IMAGE_B)
            rolled = time.monotonic()
            agent = await asyncio.create_subprocess_exec(
                "sh", str(node.agent), "watch", "--once", env=node.env, stderr=asyncio.subprocess.PIPE
            )
            result = await client.wait_closed(timeout_s=60)
            closed_after = time.monotonic() - rolled
            _, stderr = await asyncio.wait_for(agent.communicate(), 120)
        assert agent.returncode == 0, stderr.decode()
        assert result.close_code == 1001, (result.close_code, result.close_reason)
        back = await ready(240) - rolled
        assert node.runtime_image() == IMAGE_B
        print(
            f"rollout: session closed 1001 {closed_after:.1f} s after the new digest; ready in {back:.1f} s"
        )
    finally:
        pid = pidfile.read_text().strip()
        subprocess.run(["kill", "-TERM", pid], check=False)
