"""cloud-init user-data of a GCE node (``infra.node.bundle.cloud_init``): valid for the real
``cloud-init schema``, every bundle file written and decoding to the same bytes, no secret values, under GCE's
metadata limit, and a preparation script that really fetches secrets (with a stand-in ``gcloud``) and prepares
the host.

``cloud-init`` is the Debian/Ubuntu package's binary (CI installs it); without it the schema tests skip.
"""

from __future__ import annotations

import base64
import gzip
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.node.bundle.cloud_init import (
    DLVM_IMAGE_FAMILY,
    DLVM_IMAGE_PROJECT,
    GCE_METADATA_VALUE_LIMIT,
    NODE_ROOT,
    PREPARE_SCRIPT,
    UNIT_NAME,
    USER_DATA_FILE,
    render_cloud_init,
)
from infra.node.bundle.compose import COMPOSE_FILE, node_stop_timeout_s, render_compose
from infra.node.bundle.services import SECRET_FILES, NodeSecrets, secret_files
from infra.node.profile.profiles import PROFILES, NodeProfile, get_profile

GPU_PROFILES = sorted(name for name, p in PROFILES.items() if p.deployment == "compose" and p.gpu is not None)

SECRET_IDS = {role: f"duplex-{role.replace('_', '-')}" for role in SECRET_FILES}
SECRET_IDS_WITH_HF = {**SECRET_IDS, "hf_token": "duplex-hf-token"}


def _fake_bundle(profile: NodeProfile) -> dict[str, bytes]:
    """A small bundle with the real compose.yaml (so the other renderers are not needed)."""
    return {
        **render_compose(profile),
        "nginx/nginx.conf": b"events {}\nhttp {}\n",
        "redis/redis.conf": b"include /usr/local/etc/redis/redis-auth.conf\n",
        "prometheus/prometheus.yml": b"global: {}\n",
        "grafana/dashboards/binary.json": bytes(range(256)) + b"\x00\xff not utf-8 \xc3\x28",
        "empty/file": b"",
    }


def _real_bundle(profile: NodeProfile) -> dict[str, bytes]:
    from infra.node.bundle.render import render_bundle

    return render_bundle(profile)


def _user_data(profile: NodeProfile, bundle: dict[str, bytes], **kwargs: Any) -> bytes:
    files = render_cloud_init(profile, bundle, **kwargs)
    assert list(files) == [USER_DATA_FILE]
    return files[USER_DATA_FILE]


def _parse(user_data: bytes) -> dict[str, Any]:
    assert user_data.startswith(b"#cloud-config\n")
    return yaml.safe_load(user_data)


def _written(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["path"]: entry for entry in document["write_files"]}


def _decode(entry: dict[str, Any]) -> bytes:
    assert entry["encoding"] == "gz+b64"
    return gzip.decompress(base64.b64decode(entry["content"]))


def _script(document: dict[str, Any]) -> str:
    return _written(document)[PREPARE_SCRIPT]["content"]


def _unit(document: dict[str, Any]) -> str:
    return _written(document)[f"/etc/systemd/system/{UNIT_NAME}"]["content"]


# --- the real cloud-init schema ------------------------------------------------------------------------


def _cloud_init() -> str:
    binary = shutil.which("cloud-init")
    if binary is None:
        pytest.skip("cloud-init is not installed (apt-get install cloud-init); CI installs it")
    return binary


def _schema_check(user_data: bytes, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "user-data.yaml"
    path.write_bytes(user_data)
    return subprocess.run(
        [_cloud_init(), "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", GPU_PROFILES)
@pytest.mark.parametrize("secrets", [None, SECRET_IDS_WITH_HF], ids=["no-secret-manager", "secret-manager"])
def test_cloud_init_schema_accepts_the_user_data(
    name: str, secrets: dict[str, str] | None, tmp_path: Path
) -> None:
    profile = PROFILES[name]
    user_data = _user_data(
        profile, _real_bundle(profile), secret_manager_secrets=secrets, project_id="duplex-prod"
    )
    result = _schema_check(user_data, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("breakage", ["write_files not a list", "runcmd not a list", "file without path"])
def test_cloud_init_schema_rejects_a_broken_document(breakage: str, tmp_path: Path) -> None:
    profile = PROFILES["l40s"]
    document = _parse(_user_data(profile, _fake_bundle(profile)))
    if breakage == "write_files not a list":
        document["write_files"] = "nope"
    elif breakage == "runcmd not a list":
        document["runcmd"] = "systemctl start duplex-node"
    else:
        del document["write_files"][0]["path"]
    broken = b"#cloud-config\n" + yaml.safe_dump(document).encode()
    result = _schema_check(broken, tmp_path)
    assert result.returncode != 0, f"{breakage}: cloud-init accepted it\n{result.stdout}{result.stderr}"


# --- contents ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bundle_kind", ["fake", "real"])
def test_every_bundle_file_is_written_and_decodes_to_the_same_bytes(bundle_kind: str) -> None:
    profile = PROFILES["l40s"]
    bundle = _fake_bundle(profile) if bundle_kind == "fake" else _real_bundle(profile)
    written = _written(_parse(_user_data(profile, bundle)))
    expected = {f"{NODE_ROOT}/{path}": content for path, content in bundle.items() if path != USER_DATA_FILE}
    assert expected, "empty bundle"
    for path, content in expected.items():
        assert path in written, f"{path} is not written"
        entry = written[path]
        assert _decode(entry) == content, path
        assert (entry["owner"], entry["permissions"]) == ("root:root", "0644")
    bundle_entries = {p for p in written if p.startswith(NODE_ROOT + "/")}
    assert bundle_entries == set(expected)  # nothing else under /etc/duplex; not the user-data itself
    assert f"{NODE_ROOT}/{USER_DATA_FILE}" not in written


def test_render_bundle_embeds_the_same_user_data() -> None:
    profile = PROFILES["t4-int8"]
    bundle = _real_bundle(profile)
    assert bundle[USER_DATA_FILE] == _user_data(profile, bundle)
    without = {path: content for path, content in bundle.items() if path != USER_DATA_FILE}
    assert bundle[USER_DATA_FILE] == _user_data(profile, without)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_no_secret_values_in_the_user_data(name: str) -> None:
    profile = PROFILES[name]
    node_secrets = NodeSecrets.generate()
    user_data = _user_data(profile, _real_bundle(profile), secret_manager_secrets=SECRET_IDS_WITH_HF)
    document = _parse(user_data)
    texts = [user_data] + [_decode(e) for e in document["write_files"] if e.get("encoding") == "gz+b64"]
    values = [node_secrets.redis_password.encode(), node_secrets.grafana_admin_password.encode()]
    values += [content.strip() for content in secret_files(profile, node_secrets).values()]
    for text in texts:
        for value in values:
            assert value not in text


def test_secret_files_in_the_bundle_are_refused() -> None:
    profile = PROFILES["l40s"]
    bundle = {**_fake_bundle(profile), **secret_files(profile, NodeSecrets.generate())}
    with pytest.raises(ValueError, match="secret"):
        render_cloud_init(profile, bundle)


@pytest.mark.parametrize("path", ["/etc/passwd", "../escape", "nginx/../../escape"])
def test_paths_outside_the_bundle_are_refused(path: str) -> None:
    profile = PROFILES["l40s"]
    with pytest.raises(ValueError, match="relative"):
        render_cloud_init(profile, {**_fake_bundle(profile), path: b"x"})


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_user_data_fits_in_one_gce_metadata_value(name: str) -> None:
    profile = PROFILES[name]
    user_data = _user_data(profile, _real_bundle(profile), secret_manager_secrets=SECRET_IDS_WITH_HF)
    assert len(user_data) < GCE_METADATA_VALUE_LIMIT == 256 * 1024


def test_oversized_user_data_is_refused() -> None:
    profile = PROFILES["l40s"]
    incompressible = os.urandom(GCE_METADATA_VALUE_LIMIT)
    bundle = {**_fake_bundle(profile), "grafana/dashboards/huge.json": incompressible}
    with pytest.raises(ValueError, match=r"over GCE's 262144-byte limit.*grafana/dashboards/huge\.json"):
        render_cloud_init(profile, bundle)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_deterministic(name: str) -> None:
    profile = PROFILES[name]
    first = _user_data(
        profile, _real_bundle(profile), secret_manager_secrets=SECRET_IDS, project_id="p-123456"
    )
    again = _user_data(
        profile, _real_bundle(profile), secret_manager_secrets=SECRET_IDS, project_id="p-123456"
    )
    assert first == again


def test_local_profile_is_refused() -> None:
    with pytest.raises(ValueError, match=r"deployment.*'local'"):
        render_cloud_init(PROFILES["local"], {"nginx/nginx.conf": b""})


def test_bundle_without_compose_file_is_refused() -> None:
    with pytest.raises(ValueError, match=COMPOSE_FILE):
        render_cloud_init(PROFILES["l40s"], {"nginx/nginx.conf": b""})


# --- secrets -------------------------------------------------------------------------------------------


def test_secrets_are_fetched_from_secret_manager_by_id() -> None:
    profile = PROFILES["l40s"]
    document = _parse(
        _user_data(
            profile,
            _fake_bundle(profile),
            secret_manager_secrets=SECRET_IDS_WITH_HF,
            project_id="duplex-prod",
        )
    )
    script = _script(document)
    assert "umask 077" in script
    assert 'gcloud secrets versions access latest --secret="$secret" --project=duplex-prod' in script
    for role, secret_id in SECRET_IDS.items():
        assert f"fetch {secret_id} {NODE_ROOT}/{SECRET_FILES[role]} " in script, role
    assert f"fetch duplex-hf-token {NODE_ROOT}/secrets/hf-token.env 0600 HF_TOKEN" in script
    assert "EnvironmentFile=-/etc/duplex/secrets/hf-token.env" in _unit(document)
    assert "HF_TOKEN=" not in _unit(document)


def test_project_defaults_to_the_vms_own() -> None:
    profile = PROFILES["l40s"]
    script = _script(_parse(_user_data(profile, _fake_bundle(profile), secret_manager_secrets=SECRET_IDS)))
    assert "--project" not in script


def test_without_secret_manager_the_files_are_checked_not_fetched() -> None:
    profile = PROFILES["l40s"]
    script = _script(_parse(_user_data(profile, _fake_bundle(profile))))
    assert "gcloud" not in script
    for path in SECRET_FILES.values():
        assert f"{NODE_ROOT}/{path}" in script


@pytest.mark.parametrize(
    ("secrets", "project_id", "message"),
    [
        ({k: v for k, v in SECRET_IDS.items() if k != "runtime_env"}, None, "missing role.*runtime_env"),
        ({**SECRET_IDS, "ssh_key": "x"}, None, "unknown role.*ssh_key"),
        (
            {**SECRET_IDS, "runtime_env": "bad id; rm -rf /"},
            None,
            "runtime_env.*not a Secret Manager secret id",
        ),
        (SECRET_IDS, "Not_A_Project", "project_id"),
        ({**SECRET_IDS, "tls_certificate": "crt", "tls_private_key": "key"}, None, "tls.mode"),
    ],
)
def test_bad_secret_arguments_are_refused(
    secrets: dict[str, str], project_id: str | None, message: str
) -> None:
    profile = PROFILES["l40s"]
    with pytest.raises(ValueError, match=message):
        render_cloud_init(
            profile, _fake_bundle(profile), secret_manager_secrets=secrets, project_id=project_id
        )


# --- the unit and the TLS step -------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_unit_runs_compose_and_covers_the_drain(name: str) -> None:
    profile = PROFILES[name]
    document = _parse(_user_data(profile, _fake_bundle(profile)))
    unit = _unit(document)
    compose = f"/usr/bin/docker compose --project-directory {NODE_ROOT} --file {NODE_ROOT}/{COMPOSE_FILE}"
    assert f"ExecStart={compose} up " in unit
    assert f"ExecStop={compose} down" in unit
    assert f"ExecStartPre={PREPARE_SCRIPT}" in unit
    assert f"WorkingDirectory={NODE_ROOT}" in unit
    assert "WantedBy=multi-user.target" in unit and "Requires=docker.service" in unit
    timeout = int(
        next(line for line in unit.splitlines() if line.startswith("TimeoutStopSec=")).split("=")[1]
    )
    assert timeout == node_stop_timeout_s(profile) > profile.limits.drain_grace_s
    assert ["systemctl", "enable", UNIT_NAME] in document["runcmd"]
    assert ["systemctl", "start", "--no-block", UNIT_NAME] in document["runcmd"]
    assert DLVM_IMAGE_FAMILY in _document_text(profile) and DLVM_IMAGE_PROJECT in _document_text(profile)


@pytest.mark.parametrize("name", GPU_PROFILES)
def test_unit_turns_on_the_gce_maintenance_watch(name: str) -> None:
    """cloud-init renders only GCE VMs: their unit sets DUPLEX_MAINTENANCE_WATCH=gce, which compose.yaml
    passes to the runtime (``${DUPLEX_MAINTENANCE_WATCH:-off}``; off on on-premises hosts)."""
    from runtime.config import RuntimeConfig

    profile = PROFILES[name]
    unit = _unit(_parse(_user_data(profile, _fake_bundle(profile))))
    assert "Environment=DUPLEX_MAINTENANCE_WATCH=gce" in unit.splitlines()
    runtime_env = yaml.safe_load(render_compose(profile)[COMPOSE_FILE])["services"]["runtime"]["environment"]
    assert runtime_env["DUPLEX_MAINTENANCE_WATCH"] == "${DUPLEX_MAINTENANCE_WATCH:-off}"
    assert RuntimeConfig(maintenance_watch="gce").maintenance_watch == "gce"


def _document_text(profile: NodeProfile) -> str:
    return _user_data(profile, _fake_bundle(profile)).decode()


def test_self_signed_certificate_only_for_self_signed_profiles() -> None:
    self_signed = PROFILES["l40s"]
    assert self_signed.tls.mode == "self-signed"
    script = _script(_parse(_user_data(self_signed, _fake_bundle(self_signed))))
    assert "openssl req -x509" in script and f"[ ! -s {self_signed.tls.certificate_path} ]" in script
    files_mode = get_profile("l40s", tls={"mode": "files"})
    script = _script(_parse(_user_data(files_mode, _fake_bundle(files_mode))))
    assert "openssl req" not in script and "tls.mode: files" in script


# --- the preparation script, run ---------------------------------------------------------------------------


def _sandbox_profile(tmp_path: Path, **overrides: Any) -> NodeProfile:
    return get_profile(
        "l40s",
        data_dir=str(tmp_path / "data"),
        model_cache_dir=str(tmp_path / "data" / "models"),
        tls={
            "certificate_path": str(tmp_path / "tls" / "node.crt"),
            "private_key_path": str(tmp_path / "tls" / "node.key"),
            **overrides.pop("tls", {}),
        },
        **overrides,
    )


def _run_prepare(script: str, tmp_path: Path, secrets: dict[str, bytes]) -> subprocess.CompletedProcess[str]:
    """Run the script with NODE_ROOT moved under tmp_path, a stand-in gcloud serving ``secrets`` by id,
    no pause between retries, and (unless root) a no-op chown."""
    bin_dir = tmp_path / "bin"
    store = tmp_path / "secret-manager"
    bin_dir.mkdir(exist_ok=True)
    store.mkdir(exist_ok=True)
    for secret_id, value in secrets.items():
        (store / secret_id).write_bytes(value)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in --secret=*) s="${a#--secret=}";; esac; done\n'
        f'echo "$*" >> {tmp_path}/gcloud.log\n'
        f'[ -f "{store}/$s" ] || {{ echo "NOT_FOUND: $s" >&2; exit 1; }}\n'
        f'cat "{store}/$s"\n'
    )
    gcloud.chmod(0o755)
    if os.geteuid() != 0:
        (bin_dir / "chown").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "chown").chmod(0o755)
    runnable = script.replace(NODE_ROOT, str(tmp_path / "root")).replace("sleep 10", "sleep 0")
    path = tmp_path / "prepare.sh"
    path.write_text(runnable)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["sh", str(path)], capture_output=True, text=True, env=env, timeout=120)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_prepare_script_fetches_secrets_and_prepares_the_host(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    profile = _sandbox_profile(tmp_path)
    node_secrets = NodeSecrets.generate()
    contents = secret_files(profile, node_secrets)
    store = {SECRET_IDS[role]: contents[path] for role, path in SECRET_FILES.items()}
    store["duplex-hf-token"] = b"hf_example_token\n"
    document = _parse(_user_data(profile, _fake_bundle(profile), secret_manager_secrets=SECRET_IDS_WITH_HF))
    result = _run_prepare(_script(document), tmp_path, store)
    assert result.returncode == 0, result.stderr

    root = tmp_path / "root"
    assert _mode(root / "secrets") == 0o700
    for role, path in SECRET_FILES.items():
        target = root / path
        assert target.read_bytes() == contents[path], role
        expected_mode = (
            0o640
            if role
            in (
                "redis_auth_conf",
                "redis_password",
                "grafana_admin_password",
                "token_keys",
                "app_token_keys",  # read by the runtime's container too (DUPLEX_APP_TOKEN_KEYS_FILE)
                "turnserver_conf",
            )
            else 0o600
        )
        assert _mode(target) == expected_mode, role
    hf = root / "secrets" / "hf-token.env"
    assert hf.read_text() == "HF_TOKEN=hf_example_token\n" and _mode(hf) == 0o600
    assert not list((root / "secrets").glob("*.tmp"))

    for directory in ("models", "redis", "prometheus", "grafana"):
        assert _mode(tmp_path / "data" / directory) == 0o750
    crt, key = Path(profile.tls.certificate_path), Path(profile.tls.private_key_path)
    assert crt.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert (_mode(crt), _mode(key)) == (0o644, 0o600)
    if os.geteuid() == 0:
        assert (tmp_path / "data" / "models").stat().st_uid == 10001
        assert (tmp_path / "data" / "redis").stat().st_uid == 999

    # Idempotent: a second start keeps the certificate and fetches the secrets again.
    certificate = crt.read_bytes()
    again = _run_prepare(_script(document), tmp_path, store)
    assert again.returncode == 0, again.stderr
    assert crt.read_bytes() == certificate


def test_prepare_script_keeps_a_previous_secret_or_stops(tmp_path: Path) -> None:
    profile = _sandbox_profile(tmp_path, tls={"mode": "files"})
    Path(profile.tls.certificate_path).parent.mkdir(parents=True)
    Path(profile.tls.certificate_path).write_text("cert")
    Path(profile.tls.private_key_path).write_text("key")
    contents = secret_files(profile, NodeSecrets.generate())
    store = {SECRET_IDS[role]: contents[path] for role, path in SECRET_FILES.items()}
    script = _script(_parse(_user_data(profile, _fake_bundle(profile), secret_manager_secrets=SECRET_IDS)))
    assert _run_prepare(script, tmp_path, store).returncode == 0

    runtime_env = tmp_path / "root" / SECRET_FILES["runtime_env"]
    (tmp_path / "secret-manager" / SECRET_IDS["runtime_env"]).unlink()
    kept = _run_prepare(script, tmp_path, {})
    assert kept.returncode == 0, kept.stderr
    assert "keeping the previous" in kept.stderr
    assert runtime_env.read_bytes() == contents[SECRET_FILES["runtime_env"]]

    runtime_env.unlink()
    failed = _run_prepare(script, tmp_path, {})
    assert failed.returncode != 0
    assert f"cannot read secret {SECRET_IDS['runtime_env']}" in failed.stderr


def test_prepare_script_without_secret_manager_requires_the_files(tmp_path: Path) -> None:
    profile = _sandbox_profile(tmp_path, tls={"mode": "files"})
    script = _script(_parse(_user_data(profile, _fake_bundle(profile))))
    missing_tls = _run_prepare(script, tmp_path, {})
    assert missing_tls.returncode != 0 and "tls.mode: files" in missing_tls.stderr

    Path(profile.tls.certificate_path).write_text("cert")
    Path(profile.tls.private_key_path).write_text("key")
    missing = _run_prepare(script, tmp_path, {})
    assert missing.returncode != 0 and "missing secret file" in missing.stderr

    (tmp_path / "root" / "secrets").mkdir(parents=True, exist_ok=True)
    for path, content in secret_files(profile, NodeSecrets.generate()).items():
        (tmp_path / "root" / path).write_bytes(content)
    ok = _run_prepare(script, tmp_path, {})
    assert ok.returncode == 0, ok.stderr
    assert _mode(tmp_path / "root" / SECRET_FILES["grafana_admin_password"]) == 0o640


def test_tls_files_can_come_from_secret_manager() -> None:
    profile = get_profile("l40s", tls={"mode": "files"})
    secrets = {**SECRET_IDS, "tls_certificate": "duplex-tls-crt", "tls_private_key": "duplex-tls-key"}
    script = _script(_parse(_user_data(profile, _fake_bundle(profile), secret_manager_secrets=secrets)))
    assert f"fetch duplex-tls-crt {profile.tls.certificate_path} 0644" in script
    assert f"fetch duplex-tls-key {profile.tls.private_key_path} 0600" in script
    assert "openssl req" not in script
    with pytest.raises(ValueError, match="go together"):
        render_cloud_init(
            profile, _fake_bundle(profile), secret_manager_secrets={**SECRET_IDS, "tls_certificate": "c"}
        )


def test_the_browser_client_reaches_the_vm() -> None:
    """The client's files travel in the user-data with the rest of the bundle, where Compose mounts them."""
    from infra.node.bundle.webclient import WEB_DIR, render_web

    profile = PROFILES["l40s"]
    written = _written(_parse(_user_data(profile, _real_bundle(profile))))
    web = render_web()
    assert f"{WEB_DIR}/index.html" in web and len(web) >= 6
    for path, content in web.items():
        entry = written[f"{NODE_ROOT}/{path}"]
        assert _decode(entry) == content, path
        assert (entry["owner"], entry["permissions"]) == ("root:root", "0644")
    nginx_mounts = yaml.safe_load(render_compose(profile)[COMPOSE_FILE])["services"]["nginx"]["volumes"]
    assert any(volume.startswith(f"./{WEB_DIR}:") for volume in nginx_mounts)
