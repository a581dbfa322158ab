"""The rendered nginx and Redis configurations, checked by the real programs: ``nginx -t`` for every
profile, and a redis-server started from the rendered file (password required, persistence on)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from nginx_front import start_nginx
from rendered_redis import start_rendered_redis

from infra.node.bundle.nginx import NGINX_CONF, SESSION_TIMEOUT_MARGIN_S, render_nginx
from infra.node.bundle.redis_conf import REDIS_CONF, render_redis
from infra.node.bundle.services import NodeSecrets
from infra.node.bundle.tls import write_self_signed_certificate
from infra.node.local.node import free_port_profile, nginx_global_directives
from infra.node.profile.profiles import PROFILES, get_profile
from runtime.frontend.gate.replay import RedisReplayGuard
from runtime.frontend.gate.tokens import TokenClaims, TokenRejected

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None, reason="nginx not installed (apt: nginx-light)"
)


def _nginx_test(profile_name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``nginx -t`` on the profile's config. Compose configs name container paths and the ``runtime``
    service: those are pointed at tmp_path and loopback first (nothing else changes)."""
    profile = PROFILES[profile_name]
    conf = render_nginx(profile)[NGINX_CONF].decode()
    for sub in ("logs", "run", "tls"):
        (tmp_path / sub).mkdir(exist_ok=True)
    if profile.deployment == "compose":
        conf = conf.replace("/var/run/", f"{tmp_path}/run/").replace("/var/log/nginx", f"{tmp_path}/logs")
        conf = conf.replace("/var/cache/nginx", f"{tmp_path}/run")
        conf = conf.replace(str(Path(profile.tls.certificate_path).parent), f"{tmp_path}/tls")
        conf = conf.replace("server runtime:", "server 127.0.0.1:")
        cert, key = (
            tmp_path / "tls" / Path(profile.tls.certificate_path).name,
            tmp_path / "tls" / Path(profile.tls.private_key_path).name,
        )
    else:
        cert, key = tmp_path / profile.tls.certificate_path, tmp_path / profile.tls.private_key_path
    write_self_signed_certificate(cert, key, domain=profile.domain)
    (tmp_path / "nginx").mkdir(exist_ok=True)
    (tmp_path / NGINX_CONF).write_text(conf)
    return subprocess.run(
        ["nginx", "-t", "-p", f"{tmp_path}/", "-c", NGINX_CONF, "-e", "logs/error.log"],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_nginx_accepts_every_profile(profile_name: str, tmp_path: Path) -> None:
    result = _nginx_test(profile_name, tmp_path)
    assert result.returncode == 0, result.stderr


def test_nginx_rejects_a_broken_config(tmp_path: Path) -> None:
    """The check above can fail: a config with a typo does not pass nginx -t."""
    profile = PROFILES["local"]
    conf = (
        render_nginx(profile)[NGINX_CONF]
        .decode()
        .replace("proxy_http_version 1.1;", "proxy_http_versio 1.1;")
    )
    (tmp_path / "nginx").mkdir()
    for sub in ("logs", "run"):
        (tmp_path / sub).mkdir()
    write_self_signed_certificate(
        tmp_path / profile.tls.certificate_path, tmp_path / profile.tls.private_key_path, domain="localhost"
    )
    (tmp_path / NGINX_CONF).write_text(conf)
    result = subprocess.run(
        ["nginx", "-t", "-p", f"{tmp_path}/", "-c", NGINX_CONF, "-e", "logs/error.log"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0 and "proxy_http_versio" in result.stderr


@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_nginx_config_has_what_the_node_needs(profile_name: str) -> None:
    profile = PROFILES[profile_name]
    conf = render_nginx(profile)[NGINX_CONF].decode()
    assert conf == render_nginx(profile)[NGINX_CONF].decode()  # deterministic
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in conf and "TLSv1.1" not in conf.replace("TLSv1.1 ", "")
    assert re.search(r"return 301 https://\$host", conf)
    chat = conf[conf.index("location = /api/chat") :]
    chat = chat[: chat.index("}")]
    assert "proxy_set_header Upgrade $http_upgrade;" in chat
    assert "proxy_set_header Connection $connection_upgrade;" in chat
    timeout = int(re.search(r"proxy_read_timeout (\d+)s;", chat).group(1))
    assert timeout == profile.limits.max_session_s + SESSION_TIMEOUT_MARGIN_S > profile.limits.max_session_s
    assert f"limit_conn duplex_node_sessions {profile.sessions};" in chat
    assert f"limit_conn duplex_client_sessions {profile.limits.max_sessions_per_client};" in chat
    assert "location = /healthz" in conf and "location = /readyz" in conf
    metrics = conf[conf.index("location = /metrics") :]
    assert metrics[: metrics.index("}")].strip().endswith("return 404;")
    slotz = conf[conf.index("location = /slotz") :]  # issue 33: the free-slot signal is not public
    assert slotz[: slotz.index("}")].strip().endswith("return 404;")
    assert f"at most {profile.sessions} sessions" in conf
    # Handshake floods stop at the edge: a rate per client address, 429 with a plain-text reason.
    limits = profile.limits
    assert (
        f"limit_req_zone $binary_remote_addr zone=duplex_handshakes:10m "
        f"rate={limits.handshakes_per_second_per_client:g}r/s;" in conf
    )
    assert f"limit_req zone=duplex_handshakes burst={limits.handshake_burst} nodelay;" in chat
    assert "limit_req_status 429;" in conf and "error_page 429 @too_many_handshakes;" in chat
    too_many = conf[conf.index("location @too_many_handshakes") :]
    assert 'return 429 "too many connection attempts' in too_many[: too_many.index("}")]
    # No query string (where a session token may be) in the access log.
    log_format = conf[conf.index("log_format duplex") : conf.index("access_log")]
    assert "$request_method $uri" in log_format and '"$request"' not in log_format


@pytest.mark.parametrize("carrier_name", ["twilio", "plivo", "telnyx", "exotel"])
@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_each_carrier_bridge_is_a_session_route_without_a_per_client_cap(
    profile_name: str, carrier_name: str
) -> None:
    """Issue 32: a carrier's media servers connect from a few addresses with many calls each, so the
    carrier's route holds the node's session cap and the handshake rate but not the per-client-address
    cap."""
    profile = PROFILES[profile_name]
    conf = render_nginx(profile)[NGINX_CONF].decode()
    carrier = _block(conf, f"location = /api/carriers/{carrier_name} {{")
    assert "proxy_set_header Upgrade $http_upgrade;" in carrier
    assert f"limit_conn duplex_node_sessions {profile.sessions};" in carrier
    assert "duplex_client_sessions" not in carrier
    assert f"limit_req zone=duplex_handshakes burst={profile.limits.handshake_burst} nodelay;" in carrier
    chat = _block(conf, "location = /api/chat {")
    assert (
        chat.replace(
            f"            limit_conn duplex_client_sessions {profile.limits.max_sessions_per_client};\n", ""
        ).replace("/api/chat", f"/api/carriers/{carrier_name}")
        == carrier
    )


def test_session_cap_follows_the_profile() -> None:
    conf = render_nginx(get_profile("a100-80gb", max_sessions=8))[NGINX_CONF].decode()
    assert "limit_conn duplex_node_sessions 8;" in conf


def test_handshake_rate_follows_the_profile() -> None:
    limits = {"handshakes_per_second_per_client": 0.5, "handshake_burst": 3}
    conf = render_nginx(get_profile("l40s", limits=limits))[NGINX_CONF].decode()
    assert "zone=duplex_handshakes:10m rate=30r/m;" in conf
    assert "limit_req zone=duplex_handshakes burst=3 nodelay;" in conf
    assert "at most 0.5 per second (burst 3)" in conf
    with pytest.raises(ValueError, match="whole number per minute"):
        get_profile("l40s", limits={"handshakes_per_second_per_client": 0.3333})


def _start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], int, NodeSecrets]:
    server = start_rendered_redis(directory)
    return server.process, server.port, server.secrets


def test_rendered_redis_requires_the_password_and_persists(tmp_path: Path) -> None:
    process, port, node_secrets = _start_redis(tmp_path)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=1).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong-password-0000", socket_timeout=1).ping()
        client = redis.Redis(
            port=port, username="admin", password=node_secrets.redis_password, socket_timeout=1
        )
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("save") == {"save": ""}  # no RDB snapshot keeps what was erased
        assert client.config_get("maxmemory") == {"maxmemory": str(64 * 1024 * 1024)}
    finally:
        process.terminate()
        process.wait(10)
    assert list((tmp_path / "redis" / "data").iterdir()), "no persistence files written"


def _fill(client: redis.Redis, ttl_s: int) -> bool:
    """Write 256 KiB values with a week's TTL (as transcripts) until Redis refuses one; whether it did."""
    blob = b"x" * 262_144
    for i in range(2_000):  # 500 MiB at most: far past the profile's 64 MB maxmemory
        try:
            client.set(f"duplex:transcript:filler-{i}", blob, ex=ttl_s)
        except redis.exceptions.OutOfMemoryError:
            return True
    return False


def test_a_full_redis_keeps_the_spent_token_markers(tmp_path: Path) -> None:
    """Issue 34, item 4: with volatile-ttl a full Redis evicted the minutes-long spent-token markers before
    the week-long transcripts, and a spent token then opened a second session. With noeviction the marker
    stays and the write that does not fit is refused (a spend refused so fails closed: 503
    ``replay_check_unavailable``, ``RedisReplayGuard._redis_failed``)."""
    process, port, node_secrets = _start_redis(tmp_path)
    url = (tmp_path / "secrets" / "runtime.env").read_text().split("\n")[0].partition("=")[2]  # as "runtime"

    def claims(jti: str) -> TokenClaims:
        now = time.time()
        return TokenClaims(jti, "k1", "duplex", ("*",), now, now, now + 300)

    async def scenario() -> None:
        guard = RedisReplayGuard(url, timeout_s=5.0)
        try:
            await guard.spend(claims("spent-before-full"))
            assert _fill(
                redis.Redis(
                    port=port, username="admin", password=node_secrets.redis_password, socket_timeout=5
                ),
                604_800,
            )
            assert await guard.seen(claims("spent-before-full"))  # not evicted
            with pytest.raises(TokenRejected) as replayed:
                await guard.spend(claims("spent-before-full"))
            assert replayed.value.reason == "replayed"
        finally:
            await guard.close()

    try:
        asyncio.run(scenario())
    finally:
        process.terminate()
        process.wait(10)


def test_erased_text_is_in_no_file_of_redis_after_the_rewrite(tmp_path: Path) -> None:
    """Issue 34, item 6: after an erase the text stayed in the AOF and in dump.rdb. With the rendered
    configuration (AOF alone, no snapshots) an AOF rewrite after the erase leaves it in no file."""
    process, port, node_secrets = _start_redis(tmp_path)
    client = redis.Redis(port=port, username="admin", password=node_secrets.redis_password, socket_timeout=5)
    secret = "my card number is 4111-1111-1111-1111"
    data = tmp_path / "redis" / "data"

    def files_holding(text: str) -> list[str]:
        return [
            str(p.relative_to(data))
            for p in data.rglob("*")
            if p.is_file() and text.encode() in p.read_bytes()
        ]

    try:
        client.set("duplex:transcript:erased", secret, ex=604_800)
        client.set("duplex:transcript:kept", "hello", ex=604_800)
        deadline = time.monotonic() + 10
        while not files_holding(secret) and time.monotonic() < deadline:
            time.sleep(0.1)  # appendfsync everysec
        assert files_holding(secret), "the AOF never held the text: the test proves nothing"
        client.delete("duplex:transcript:erased")
        client.bgrewriteaof()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = client.info("persistence")
            if (
                not info["aof_rewrite_in_progress"]
                and not info["aof_rewrite_scheduled"]
                and not files_holding(secret)
            ):
                break
            time.sleep(0.1)
        assert files_holding(secret) == []
        assert files_holding("hello"), "the rewrite must keep what was not erased"
        assert not (data / "dump.rdb").exists(), "a snapshot was written"  # the AOF's own base is .base.rdb
    finally:
        process.terminate()
        process.wait(10)


def test_rendered_redis_holds_no_secret() -> None:
    for profile in PROFILES.values():
        conf = render_redis(profile)[REDIS_CONF].decode()
        assert not [line for line in conf.splitlines() if line.startswith(("requirepass", "user "))]
        assert "include " in conf and "redis-auth.conf" in conf


# --- the browser client at / -------------------------------------------------------------------------------


def _block(conf: str, opening: str) -> str:
    """The text of the location block that starts with ``opening``, up to its closing brace."""
    start = conf.index(opening)
    depth, i = 0, conf.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(conf[i], 0)
        if depth == 0:
            return conf[start : i + 1]
        i += 1


@pytest.mark.parametrize("profile_name", sorted(PROFILES))
def test_browser_client_location_has_its_headers(profile_name: str) -> None:
    from infra.node.bundle.nginx import content_security_policy
    from infra.node.bundle.services import public_origin
    from infra.node.bundle.webclient import web_root

    profile = PROFILES[profile_name]
    conf = render_nginx(profile)[NGINX_CONF].decode()
    root = _block(conf[conf.index("listen") :].split("ssl_certificate ", 1)[1], "location / {")
    assert f"root {web_root(profile)};" in root
    assert "limit_except GET {" in root and "try_files $uri $uri/ =404;" in root
    assert "text/javascript js;" in root and "text/html html;" in root and "text/css css;" in root
    csp = content_security_policy(profile)
    assert f'add_header Content-Security-Policy "{csp}" always;' in root
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    wss = public_origin(profile).replace("https://", "wss://")
    assert f"connect-src 'self' {wss};" in csp + ";"
    assert "http:" not in csp and "*" not in csp  # nothing from elsewhere, no wildcard
    for header in (
        "X-Content-Type-Options nosniff",
        'Permissions-Policy "microphone=(self), camera=(), geolocation=()"',
        "Referrer-Policy no-referrer",
        "Cache-Control no-cache",
        'Strict-Transport-Security "max-age=63072000"',  # not inherited once the location adds headers
    ):
        assert f"add_header {header} always;" in root, header
    # The client's admission check verifies tokens: rate-limited like handshakes; both pass to the runtime.
    admission = _block(conf, "location = /api/admission {")
    assert f"limit_req zone=duplex_handshakes burst={profile.limits.handshake_burst} nodelay;" in admission
    assert "error_page 429 @too_many_handshakes;" in admission
    assert "proxy_pass http://duplex_runtime;" in _block(conf, "location = /api/personas {")
    # The session's location passes the caller's address (a level with proxy_set_header inherits none).
    assert "proxy_set_header X-Real-IP $remote_addr;" in _block(conf, "location = /api/chat {")


def test_nginx_serves_the_browser_client_with_its_headers(tmp_path: Path) -> None:
    """The rendered local config in a real nginx: the page, its modules as JavaScript, the headers, GET only,
    a plain-text 404."""
    import urllib.error
    import urllib.request

    from infra.node.bundle.webclient import render_web

    profile = free_port_profile()
    files = {**render_nginx(profile), **render_web()}
    process, context, base = start_nginx(profile, tmp_path, files)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )

    def get(path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        try:
            with opener.open(urllib.request.Request(base + path, method=method), timeout=5) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                status, headers, body = get("/")
                break
            except urllib.error.URLError:
                assert process.poll() is None, (tmp_path / "logs" / "error.log").read_text()
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.1)
        assert status == 200 and body == files["web/index.html"]
        assert headers["Content-Type"] == "text/html; charset=utf-8"
        assert headers["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self';")
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Permissions-Policy"].startswith("microphone=(self)")
        assert headers["Cache-Control"] == "no-cache" and headers["ETag"]
        assert headers["Strict-Transport-Security"] == "max-age=63072000"
        for name in ("app.js", "protocol.js", "player.js", "audio-worklet.js"):
            status, headers, body = get(f"/{name}")
            assert status == 200 and body == files[f"web/{name}"], name
            assert headers["Content-Type"] == "text/javascript; charset=utf-8", name  # modules need it
        assert get("/style.css")[1]["Content-Type"] == "text/css; charset=utf-8"
        assert get("/", method="POST")[0] == 403
        status, headers, body = get("/nothing-here.js")
        assert status == 404 and headers["Content-Type"] == "text/plain" and b"/api/chat" in body
        assert headers["X-Content-Type-Options"] == "nosniff"
    finally:
        process.terminate()
        process.wait(10)


def test_nginx_workers_run_as_the_node_directorys_owner_when_started_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import grp
    import os
    import pwd

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert nginx_global_directives(tmp_path) == "daemon off;"  # workers are the invoking user already
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    owner = tmp_path.stat()
    user, group = pwd.getpwuid(owner.st_uid).pw_name, grp.getgrgid(owner.st_gid).gr_name
    assert nginx_global_directives(tmp_path) == f"daemon off; user {user} {group};"
