"""Resume across pods (issue 33): on a multi-region stack a reconnect through the global entry lands on any
pod, and only the pod that holds the slot can resume it; the resume metadata's ``resume_url`` names region
and pod, and the region's resume router (``infra.k8s.resume_router``) takes it to that pod.

The harness: three real ``duplex serve --model sim`` pods on loopback, each on its own address (127.0.0.2,
.3, .4: the pod IP its ``resume_url`` names, dashed), the REAL nginx running the router's rendered config
(the pods' DNS names under the headless Service replaced by a map of their dashed addresses to loopback:
``router_nginx_conf(pod_addresses=...)``; no resolver, so any other name fails as a gone pod does), and a
model of the global entry: a second nginx that sends the URL map's regional path (``regional_path``) to the
router and every other API path round-robin over the three pods, as the load balancer sends new calls to
any pod. A drop is the client's TCP connection aborted (no close frame). Nothing here depends on the
machine's speed: every wait is for an event (a message, a status), bounded only to fail instead of hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from infra.components.global_entry import regional_path
from infra.k8s.pod_routes import RUNTIME_PODS_SERVICE
from infra.k8s.resume_router import OFFER_TRIES, router_nginx_conf
from infra.node.local.node import nginx_global_directives
from runtime.engine.resume import NOT_A_CREDENTIAL_MESSAGE
from runtime.frontend.codecs.protocol import MessageKind
from runtime.frontend.gate.query import RESUME_HEADER
from runtime.tools.rtc_client import RtcCall, encode_packets

REGION = "us-test1"
POD_ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
SLOTS = 2
"""Each pod's slots (``DUPLEX_MAX_SESSIONS``); no waiting room: a full pod answers 503 ``node_full``."""
WAIT_S = 60.0
"""The bound of every wait (s): a failure, never a pace."""
PCM_FRAME = b"\x00\x00" * 1920  # 80 ms of silence at 24 kHz, Int16 LE (format=pcm)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def http(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, str]:
    """(status, body) of one request; 4xx/5xx are returned too."""
    request = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        request.add_header("Content-Type", "application/sdp")  # the only body sent here: an offer
    try:
        with _NO_PROXY.open(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(check: Any, what: str, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                pytest.fail(f"{what}: a process exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{what}: not within {WAIT_S} s")


@dataclass(frozen=True)
class Fleet:
    """The harness: the entry model's base URL, the pods' ``(address, port)``, the processes."""

    entry: str
    pods: tuple[tuple[str, int], ...]

    def label(self, address: str) -> str:
        return address.replace(".", "-")


def entry_model_conf(port: int, router_port: int, pods: tuple[tuple[str, int], ...], temp_dir: Path) -> str:
    """The global entry's model: the URL map's regional path rule to the router, the runtime's paths
    round-robin over every pod (the load balancer sends a new call to any pod with room)."""
    prefix = regional_path(REGION).removesuffix("*")
    servers = "".join(f"        server {address}:{pod_port};\n" for address, pod_port in pods)
    proxy = """            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_read_timeout 300s;"""
    temps = "".join(f"    {kind}_temp_path {temp_dir}/{kind};\n" for kind in ("client_body", "proxy"))
    return f"""worker_processes 1;
pid {temp_dir}/entry.pid;
error_log stderr warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
{temps}    map $http_upgrade $connection_upgrade {{ default upgrade; "" close; }}
    upstream pods {{
{servers}    }}
    server {{
        listen 127.0.0.1:{port};
        location {prefix} {{
            proxy_pass http://127.0.0.1:{router_port};
{proxy}
        }}
        location /api/ {{
            proxy_pass http://pods;
{proxy}
        }}
        location / {{ return 404; }}
    }}
}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Three sim pods, the resume router and the entry model, started once for the module."""
    root = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("fleet")
    entry_port, router_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    entry = f"http://127.0.0.1:{entry_port}"
    pods = tuple((address, free_port(address)) for address in POD_ADDRESSES)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(argv: list[str], name: str, env: dict[str, str] | None = None) -> None:
        log = tmp / f"{name}.log"
        with log.open("wb") as out:
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)

    try:
        for address, port in pods:
            env = {
                **os.environ,
                "PYTHONPATH": str(root),
                "DUPLEX_HOST": address,
                "DUPLEX_PORT": str(port),
                "DUPLEX_MODEL": "sim",
                "DUPLEX_AUTH_MODE": "off",
                "DUPLEX_MAX_SESSIONS": str(SLOTS),
                "DUPLEX_NODE_ID": f"pod-{address}",
                "DUPLEX_REGION": REGION,
                "DUPLEX_PUBLIC_URL": entry,
                "DUPLEX_POD_IP": address,
                "DUPLEX_RESUME_S": "60",
            }
            start([sys.executable, "-m", "runtime.tools.cli", "serve"], f"pod-{address}", env)
        router_dir = tmp / "router"
        (router_dir / "tmp").mkdir(parents=True)
        (router_dir / "nginx.conf").write_text(
            router_nginx_conf(
                REGION,
                pod_suffix=f".{RUNTIME_PODS_SERVICE}.duplex.svc.cluster.local",
                runtime_port=8998,
                region_runtime="unused.invalid:8998",  # offer_servers stand for its DNS answer
                read_timeout_s=300,
                resolver=None,  # no DNS here: a name outside the map fails as a gone pod's does
                pod_addresses={address.replace(".", "-"): f"{address}:{port}" for address, port in pods},
                offer_servers=[f"{address}:{port}" for address, port in pods],
                port=router_port,
                temp_dir=str(router_dir / "tmp"),
            )
        )
        entry_dir = tmp / "entry"
        entry_dir.mkdir()
        (entry_dir / "nginx.conf").write_text(entry_model_conf(entry_port, router_port, pods, entry_dir))
        for name, directory in (("router", router_dir), ("entry", entry_dir)):
            argv = ["nginx", "-p", f"{directory}/", "-c", "nginx.conf", "-e", "stderr"]
            start([*argv, "-g", nginx_global_directives(directory)], name)
        for address, port in pods:
            wait_for(
                lambda a=address, p=port: http(f"http://{a}:{p}/readyz")[0] == 200, "pod ready", procs, logs
            )
        wait_for(lambda: http(f"http://127.0.0.1:{router_port}/healthz")[0] == 200, "router", procs, logs)
        wait_for(lambda: http(f"{entry}/nothing")[0] == 404, "entry model", procs, logs)
        yield Fleet(entry, pods)
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


class Call:
    """One WebSocket session: its messages as they come (0x00, 0x01 count, 0x04 objects, 0x05 texts)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.handshake = asyncio.Event()
        self.metadata: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.audio = 0
        self.changed = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                assert isinstance(message, bytes) and message
                kind, payload = message[0], message[1:]
                if kind == MessageKind.HANDSHAKE:
                    self.handshake.set()
                elif kind == MessageKind.AUDIO:
                    self.audio += 1
                elif kind == MessageKind.METADATA:
                    self.metadata.append(json.loads(payload))
                elif kind == MessageKind.ERROR:
                    self.errors.append(payload.decode())
                self.changed.set()
        except ConnectionClosed:
            pass
        finally:
            self.changed.set()

    async def until(self, check: Any, what: str) -> None:
        async with asyncio.timeout(WAIT_S):
            while not check():
                if self.reader.done():
                    raise AssertionError(f"closed before {what}: {self.ws.close_code} {self.errors}")
                self.changed.clear()
                await self.changed.wait()

    async def talk(self, frames: int) -> None:
        """Send ``frames`` frames and wait for as many more audio frames back (the slot is live)."""
        start = self.audio
        for _ in range(frames):
            await self.ws.send(bytes([MessageKind.AUDIO]) + PCM_FRAME)
        await self.until(lambda: self.audio >= start + frames, f"{frames} audio frames back")

    def drop(self) -> None:
        """The connection lost without a close frame (a phone changing cells)."""
        self.ws.transport.abort()


async def open_call(url: str, credential: str | None = None) -> Call:
    headers = None if credential is None else {RESUME_HEADER: credential}
    ws = await connect(url, additional_headers=headers, max_size=2**20, compression=None, proxy=None)
    call = Call(ws)
    await call.until(lambda: call.handshake.is_set() and bool(call.metadata), "the handshake and the 0x04")
    return call


def chat(fleet: Fleet) -> str:
    return fleet.entry.replace("http", "ws", 1) + "/api/chat?format=pcm&resumable=1"


@pytest.mark.timeout(300)
def test_a_dropped_call_on_any_pod_resumes_through_the_router(fleet: Fleet) -> None:
    """New calls through the entry land on all three pods; each names its pod in ``resume_url``, is
    dropped, and resumes there through the entry and the router: the same session, slot live again."""

    async def scenario() -> None:
        calls = [await open_call(chat(fleet)) for _ in fleet.pods]
        try:
            urls = {}
            for call in calls:
                meta = call.metadata[0]
                urls[meta["node"]] = meta["resume_url"]
                await call.talk(3)
            ws_entry = fleet.entry.replace("http", "ws", 1)
            expected = {f"pod-{a}": f"{ws_entry}/r/{REGION}/{fleet.label(a)}/api/chat" for a, _ in fleet.pods}
            assert urls == expected, "the entry's new calls reach every pod, each naming itself"
            for call in calls:
                meta = call.metadata[-1]
                call.drop()
                again = await open_call(meta["resume_url"] + "?format=pcm", meta["resume"])
                try:
                    resumed = again.metadata[0]
                    assert resumed["resumed"] is True, resumed
                    assert resumed["session_id"] == meta["session_id"] and resumed["node"] == meta["node"]
                    assert resumed["resume_url"] == meta["resume_url"] and resumed["resume"] != meta["resume"]
                    await again.talk(3)
                finally:
                    await again.ws.close()
        finally:
            for call in calls:
                call.reader.cancel()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_the_wrong_pod_refuses_harmlessly_and_the_right_one_still_resumes(fleet: Fleet) -> None:
    """A credential presented at another pod's route is refused ``resume_invalid`` (1008) by that pod, and the
    session's own pod still holds it: the resume at the right route then succeeds."""

    async def scenario() -> None:
        call = await open_call(chat(fleet))
        meta = call.metadata[0]
        await call.talk(2)
        call.drop()
        own = meta["resume_url"].split("/r/")[1].split("/")[1]
        other = next(fleet.label(a) for a, _ in fleet.pods if fleet.label(a) != own)
        wrong = meta["resume_url"].replace(f"/{own}/", f"/{other}/") + "?format=pcm"
        ws = await connect(wrong, additional_headers={RESUME_HEADER: meta["resume"]}, proxy=None)
        wrong_call = Call(ws)
        await asyncio.wait_for(wrong_call.reader, WAIT_S)
        assert ws.close_code == 1008 and wrong_call.errors == [NOT_A_CREDENTIAL_MESSAGE], wrong_call.errors
        assert not wrong_call.handshake.is_set()
        again = await open_call(meta["resume_url"] + "?format=pcm", meta["resume"])
        try:
            assert (
                again.metadata[0]["resumed"] is True and again.metadata[0]["session_id"] == meta["session_id"]
            )
            await again.talk(2)
        finally:
            await again.ws.close()

    asyncio.run(scenario())


def test_paths_outside_the_routers_shape_are_404_and_a_gone_pod_410(fleet: Fleet) -> None:
    """The router proxies only the pod routes of its region: a pod name that is not a dashed address, any
    other path of a pod (its metrics, health), another region's prefix: 404 from nginx, nothing proxied.
    A well-formed name that names no pod (gone, or never there) is 410 ``resume_expired``."""
    pod = fleet.label(fleet.pods[0][0])
    for path in (
        f"/r/{REGION}/duplex-runtime-0/api/chat",
        f"/r/{REGION}/{pod}/metrics",
        f"/r/{REGION}/{pod}/readyz",
        f"/r/{REGION}/{pod}/api/sessions",
        f"/r/{REGION}/{pod}/api/../metrics",
        f"/r/{REGION}/10.4.0.12/api/chat",
        f"/r/{REGION}/{pod}/api/chat/x",
        f"/r/{REGION}/",
    ):
        status, body = http(fleet.entry + path)
        assert status == 404 and body.startswith("not_found"), (path, status, body)
    status, body = http(f"{fleet.entry}/r/{REGION}/127-0-0-9/api/chat")
    assert status == 410 and body.startswith("resume_expired"), (status, body)


def test_the_regional_offer_path_reaches_the_regions_runtime(fleet: Fleet) -> None:
    """The ICE-servers answer names ``/r/<region>/api/rtc``; an offer posted there is answered by the
    region's runtime (here a malformed one: the runtime's own ``bad_request``, not the router's 404)."""
    status, body = http(f"{fleet.entry}/api/rtc/ice-servers")
    assert status == 200, body
    assert json.loads(body)["offer_url"] == f"{fleet.entry}/r/{REGION}/api/rtc"
    status, body = http(f"{fleet.entry}/r/{REGION}/api/rtc", "POST", b"not an offer")
    assert status == 400 and body.startswith("bad_request"), (status, body)


def post_offer(url: str, sdp: str) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one ``POST`` of an SDP offer; 4xx/5xx are returned too."""
    request = urllib.request.Request(url, data=sdp.encode(), method="POST")
    request.add_header("Content-Type", "application/sdp")
    try:
        with _NO_PROXY.open(request, timeout=30) as response:
            return response.status, dict(response.headers.items()), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), exc.read().decode()


def node_full_refusals(pod: tuple[str, int]) -> float:
    """The pod's ``duplex_admissions_refused_total{reason="node_full"}`` (0 before its first)."""
    status, text = http(f"http://{pod[0]}:{pod[1]}/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith("duplex_admissions_refused_total{") and 'reason="node_full"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def in_use(pod: tuple[str, int]) -> int:
    """Slots not free on ``pod`` (its ``/slotz``)."""
    return int(json.loads(http(f"http://{pod[0]}:{pod[1]}/slotz")[1])["in_use"])


async def until_in_use(pod: tuple[str, int], expected: int) -> None:
    """Wait (an event: the pod's own count, polled) until ``pod`` has ``expected`` slots in use."""
    async with asyncio.timeout(WAIT_S):
        while await asyncio.to_thread(in_use, pod) != expected:
            await asyncio.sleep(0.05)


async def fill(pod: tuple[str, int]) -> list[Call]:
    """Take every slot of ``pod`` with a WebSocket call made to it directly (not through the entry)."""
    await until_in_use(pod, 0)
    calls = [await open_call(f"ws://{pod[0]}:{pod[1]}/api/chat?format=pcm&resumable=1") for _ in range(SLOTS)]
    await until_in_use(pod, SLOTS)
    return calls


async def hang_up(calls: list[Call]) -> None:
    for call in calls:
        await call.ws.close()
        call.reader.cancel()


async def real_offer() -> str:
    """A browser-shaped offer (aiortc: audio and a DataChannel, host candidates)."""
    call = RtcCall("http://127.0.0.1:1", encode_packets(np.zeros(1920, dtype=np.float32)))
    try:
        return await call.offer()
    finally:
        await call.pc.close()


async def end_answered(fleet: Fleet, location: str) -> None:
    """DELETE an answered offer's ``Location`` at the pod that holds it (the others answer 404), and wait
    until that pod's slot is free again (the session ends in its own task, after the DELETE's answer)."""
    answers = [http(f"http://{address}:{port}{location}", "DELETE")[0] for address, port in fleet.pods]
    assert sorted(answers) == [200, 404, 404], answers
    await until_in_use(fleet.pods[answers.index(200)], 0)


@pytest.mark.timeout(300)
def test_a_regional_offer_that_reaches_a_full_pod_is_answered_by_a_free_one(fleet: Fleet) -> None:
    """One pod of three full: every offer posted to the regional path is answered (201) by a pod with a
    free slot, and the full pod did refuse some of them (its ``node_full`` count grew): the router sent
    those on to the next pod instead of passing the 503 to the caller."""

    async def scenario() -> None:
        full = fleet.pods[0]
        calls = await fill(full)
        try:
            sdp = await real_offer()
            before = node_full_refusals(full)
            # nginx's round-robin reaches every server within a few requests; how soon depends on the
            # rotation's state, shared with the earlier tests: 2 rounds.
            for _ in range(2 * len(fleet.pods)):
                status, headers, body = await asyncio.to_thread(
                    post_offer, f"{fleet.entry}/r/{REGION}/api/rtc?resumable=1", sdp
                )
                assert status == 201 and body.startswith("v=0"), (status, body)
                await end_answered(fleet, headers["Location"])
            # The pod counts a refusal as it answers it: wait for the count, bounded.
            async with asyncio.timeout(WAIT_S):
                while await asyncio.to_thread(node_full_refusals, full) == before:
                    await asyncio.sleep(0.05)
            assert in_use(full) == SLOTS
        finally:
            await hang_up(calls)

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_when_every_pod_is_full_the_503_and_its_retry_after_reach_the_caller(fleet: Fleet) -> None:
    """Every pod full: the offer is tried on each pod once (each counts one ``node_full``; at most
    ``OFFER_TRIES``) and the caller gets the last pod's answer: 503 ``node_full`` with ``Retry-After``,
    not nginx's 502."""

    async def scenario() -> None:
        calls = [call for pod in fleet.pods for call in await fill(pod)]
        try:
            sdp = await real_offer()
            before = [node_full_refusals(pod) for pod in fleet.pods]
            status, headers, body = await asyncio.to_thread(
                post_offer, f"{fleet.entry}/r/{REGION}/api/rtc?resumable=1", sdp
            )
            assert status == 503 and body.startswith("node_full"), (status, body)
            assert headers.get("Retry-After") == "5", headers
            assert len(fleet.pods) <= OFFER_TRIES
            expected = [count + 1 for count in before]  # each pod tried once (counted as it answers)
            async with asyncio.timeout(WAIT_S):
                while (after := [node_full_refusals(pod) for pod in fleet.pods]) != expected:
                    assert all(a <= e for a, e in zip(after, expected, strict=True)), (after, expected)
                    await asyncio.sleep(0.05)
        finally:
            await hang_up(calls)

    asyncio.run(scenario())
