"""``OnPremNode``: an existing GPU host (L40S, A100, ...) brought up over SSH with ``pulumi_command``: GPU
check, the rendered bundle copied and installed, the secrets written, a registry login, certbot's renewal
(``tls.mode: acme``), ``docker compose up -d``, ``/readyz``. ``RegistryPuller``: the read-only identity
whose short-lived token the host pulls an Artifact Registry image with. What the host needs and how to use
it: docs/deploying.md, "Stack scale5-onprem".
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_command.remote as remote
import pulumi_gcp.serviceaccount as serviceaccount

from infra.capacity.gpus import GPUS
from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.node.bundle.acme import SERVICE as ACME_SERVICE
from infra.node.bundle.acme import TIMER as ACME_TIMER
from infra.node.bundle.acme import TIMERS as ACME_TIMERS
from infra.node.bundle.acme import render_acme_host_files
from infra.node.bundle.cloud_init import DOCKER_CONFIG_DIR, USER_DATA_FILE, render_prepare_script
from infra.node.bundle.compose import COMPOSE_FILE, CONTAINER_READ_SECRETS, tls_reload_command
from infra.node.bundle.render import render_bundle, write_bundle
from infra.node.bundle.services import OPTIONAL_SECRET_FILES, SECRET_FILES, SECRETS_DIR
from infra.node.profile.profiles import NodeProfile

__all__ = [
    "GPU_NAME_PATTERNS",
    "PREPARE_SCRIPT",
    "OnPremNode",
    "OnPremNodeArgs",
    "CERTBOT_PACKAGE",
    "RegistryPuller",
    "acme_install_script",
    "acme_remove_script",
    "artifact_registry_repository",
    "bundle_digest",
    "compose_up_script",
    "gpu_check_script",
    "install_script",
    "onprem_bundle",
    "ready_script",
    "registry_login_script",
    "secret_stdin",
    "secrets_script",
    "stage_script",
]

GPU_NAME_PATTERNS: dict[str, str] = {
    "t4": r"(^|[ -])T4($|[ -])",
    "l4": r"(^|[ -])L4($|[ -])",
    "l40s": r"L40S",
    "a100-40gb": r"A100.*40GB",
    "a100-80gb-pcie": r"A100.*80GB.*PCIe",
    "a100-80gb-sxm": r"A100.*SXM.*80GB",
    "h100": r"H100",
    "h200": r"H200",
}
"""Extended regular expressions (case-insensitive) matching ``nvidia-smi``'s name of each catalog GPU:
``Tesla T4``, ``NVIDIA L4``, ``NVIDIA L40S``, ``NVIDIA A100-SXM4-40GB``, ``NVIDIA A100 80GB PCIe``,
``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA H200``."""

MEMORY_TOLERANCE = 0.9
"""A GPU passes the check with at least this fraction of the catalog's memory (ECC and driver reserve)."""

PREPARE_SCRIPT = "bin/prepare-host.sh"
"""Bundle path of the host preparation script (on-premises bundles only)."""

STAGING_DIR = ".staging"
"""Directory under ``installDir`` the SSH user copies the bundle into before it is installed."""

_DOCKER = "docker"


def onprem_bundle(profile: NodeProfile, install_dir: str) -> dict[str, bytes]:
    """The files the host gets: the node bundle without the GCE user-data, plus ``PREPARE_SCRIPT``."""
    bundle = {path: content for path, content in render_bundle(profile).items() if path != USER_DATA_FILE}
    bundle[PREPARE_SCRIPT] = render_prepare_script(profile, root=install_dir).encode()
    return dict(sorted(bundle.items()))


def bundle_digest(bundle: dict[str, bytes]) -> str:
    """SHA-256 over the bundle's paths and contents (the steps' trigger)."""
    h = hashlib.sha256()
    for path in sorted(bundle):
        h.update(path.encode() + b"\0" + hashlib.sha256(bundle[path]).digest())
    return h.hexdigest()


def _as_root(script: str, user: str) -> str:
    """A command line running ``script`` with ``sh`` as root (``sudo -n`` unless the user is root)."""
    sudo = "" if user == "root" else "sudo -n "
    return f"{sudo}sh -c {shlex.quote(script)}"


def gpu_check_script(profile: NodeProfile) -> str:
    """Fails (exit 1, message on stderr) unless every GPU ``nvidia-smi`` lists is the profile's GPU."""
    assert profile.gpu is not None
    spec = GPUS[profile.gpu]
    pattern = GPU_NAME_PATTERNS[profile.gpu]
    min_mib = int(spec.memory_mib * MEMORY_TOLERANCE)
    q = shlex.quote
    return f"""set -eu
want={q(pattern)}
min_mib={min_mib}
fail() {{ echo "gpu-check: $*" >&2; exit 1; }}
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: install the NVIDIA driver"
gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader) || fail "nvidia-smi failed: $gpus"
[ -n "$gpus" ] || fail "no GPU found; profile {profile.name} needs {spec.name}"
bad=""
while IFS=, read -r name memory; do
    name=$(echo "$name" | sed 's/^ *//; s/ *$//')
    mib=$(echo "$memory" | tr -dc 0-9)
    if ! printf '%s\\n' "$name" | grep -Eiq "$want"; then
        bad="$bad; $name ($memory MiB is not {spec.name})"
    elif [ "${{mib:-0}}" -lt "$min_mib" ]; then
        bad="$bad; $name has ${{mib:-0}} MiB, below $min_mib MiB"
    fi
done <<EOF
$gpus
EOF
[ -z "$bad" ] || fail "profile {profile.name} needs {spec.name} ({spec.memory_mib} MiB); found:${{bad#;}}"
echo "gpu-check: ok: $(echo "$gpus" | tr '\\n' ';')"
"""


def stage_script(install_dir: str, owner: str) -> str:
    """Creates ``install_dir`` (root, 0755) and an empty staging directory owned by ``owner``."""
    q = shlex.quote
    staging = f"{install_dir}/{STAGING_DIR}"
    return f"""set -eu
install -d -m 0755 -o root -g root {q(install_dir)}
rm -rf {q(staging)}
install -d -m 0700 -o {q(owner)} {q(staging)}
"""


def install_script(install_dir: str, bundle: dict[str, bytes]) -> str:
    """Replaces the bundle's files under ``install_dir`` with the staged ones (root:root, 0644/0755)."""
    q = shlex.quote
    staged = f"{install_dir}/{STAGING_DIR}/bundle"
    tops = sorted({path.split("/", 1)[0] for path in bundle})
    return f"""set -eu
cd {q(install_dir)}
[ -f {q(staged + "/" + COMPOSE_FILE)} ] || {{ echo "install: nothing staged in {staged}" >&2; exit 1; }}
rm -rf {" ".join(q(t) for t in tops)}
cp -R {q(staged)}/. {q(install_dir)}/
chown -R root:root {" ".join(q(t) for t in tops)}
find {" ".join(q(t) for t in tops)} -type d -exec chmod 0755 {{}} +
find {" ".join(q(t) for t in tops)} -type f -exec chmod 0644 {{}} +
chmod 0755 {q(PREPARE_SCRIPT)}
"""


def secrets_script(install_dir: str) -> str:
    """Writes the secret files read from stdin (``secret_stdin``) into ``install_dir/secrets``."""
    q = shlex.quote
    allowed = " | ".join(
        sorted({*SECRET_FILES.values(), *OPTIONAL_SECRET_FILES.values(), f"{SECRETS_DIR}/hf-token.env"})
    )
    return f"""set -eu
umask 077
root={q(install_dir)}
install -d -m 0700 -o root -g root "$root/{SECRETS_DIR}"
seen=""
while read -r path mode data; do
    case "$path" in
        {allowed}) ;;
        *) echo "secrets: unexpected path $path" >&2; exit 1 ;;
    esac
    case "$mode" in 0600|0640) ;; *) echo "secrets: bad mode $mode for $path" >&2; exit 1 ;; esac
    printf '%s' "$data" | base64 -d >"$root/$path.tmp"
    chown root:root "$root/$path.tmp"
    chmod "$mode" "$root/$path.tmp"
    mv -f "$root/$path.tmp" "$root/$path"
    seen="$seen $path"
done
case "$seen" in *hf-token.env*) ;; *) rm -f "$root/{SECRETS_DIR}/hf-token.env" ;; esac
echo "secrets: wrote$seen"
"""


def secret_stdin(files: dict[str, str]) -> str:
    """The ``secrets`` step's stdin: one line per file, ``path mode base64(content)``."""
    import base64

    lines = []
    for path in sorted(files):
        role = next((r for r, p in SECRET_FILES.items() if p == path), None)
        read_by_a_container = role in CONTAINER_READ_SECRETS or path in OPTIONAL_SECRET_FILES.values()
        mode = "0640" if read_by_a_container else "0600"
        lines.append(f"{path} {mode} {base64.b64encode(files[path].encode()).decode()}")
    return "\n".join(lines) + "\n"


def _compose(install_dir: str) -> str:
    q = shlex.quote
    return (
        f"{_DOCKER} compose --project-directory {q(install_dir)} --file {q(install_dir + '/' + COMPOSE_FILE)}"
    )


def _hf_env(install_dir: str) -> str:
    env_file = shlex.quote(f"{install_dir}/{SECRETS_DIR}/hf-token.env")
    return f"if [ -f {env_file} ]; then set -a; . {env_file}; set +a; fi"


def registry_login_script(registry: str) -> str:
    """Logs root's Docker (``DOCKER_CONFIG_DIR``, which ``compose_up_script`` uses) in to ``registry`` with
    the access token read from stdin (user ``oauth2accesstoken``: Artifact Registry's form for a token)."""
    q = shlex.quote
    return f"""set -eu
umask 077
install -d -m 0700 -o root -g root {q(DOCKER_CONFIG_DIR)}
DOCKER_CONFIG={q(DOCKER_CONFIG_DIR)} {_DOCKER} login --username oauth2accesstoken --password-stdin \\
    {q("https://" + registry)} >/dev/null
echo "registry-login: {registry} (a token of this deploy, valid 1 h: the pulls of this deploy use it)"
"""


CERTBOT_PACKAGE = "certbot"
"""The Debian/Ubuntu package an on-premises host needs for ``tls.mode: acme`` (the deploy does not install
packages on a host it does not own: it checks, and names the package)."""


def _acme_files(profile: NodeProfile, install_dir: str) -> dict[str, tuple[str, str]]:
    """``render_acme_host_files`` for this host: nginx reloaded in Compose with SIGHUP (open sessions go
    on), as the GCE node's cloud-init does."""
    return render_acme_host_files(profile, reload_command=tls_reload_command(profile, _compose(install_dir)))


def acme_install_script(profile: NodeProfile, install_dir: str) -> str:
    """Installs certbot's renewal for ``profile.domain`` on the host (as root): fails first, naming the
    package, unless ``certbot`` (Debian/Ubuntu package ``certbot``) and ``systemctl`` are there; then writes
    the files of ``infra.node.bundle.acme.render_acme_host_files`` (renew script, deploy hook, services,
    timers;
    each through a temporary file and a rename), enables the timers (twice a day, and every 5 minutes until
    the first issuance) and starts the service once without waiting (it waits for nginx on port 80 itself,
    then obtains or renews the certificate).

    Raises:
        ValueError: ``tls.mode`` is not ``acme`` (``render_acme_host_files``).
    """
    import base64

    q = shlex.quote
    lines = [
        "set -eu",
        'fail() { echo "acme: $*" >&2; exit 1; }',
        'command -v certbot >/dev/null 2>&1 || fail "certbot not found on this host: tls.mode acme '
        f"(duplexops:acmeEmail) needs the {CERTBOT_PACKAGE} package: sudo apt-get install {CERTBOT_PACKAGE} "
        '(or leave acmeEmail unset for a self-signed certificate)"',
        'command -v systemctl >/dev/null 2>&1 || fail "systemctl not found: the renewal timer needs systemd"',
    ]
    for path, (mode, content) in _acme_files(profile, install_dir).items():
        data = base64.b64encode(content.encode()).decode()
        lines += [
            f"install -d -m 0755 {q(posixpath.dirname(path))}",
            f"printf '%s' {q(data)} | base64 -d >{q(path + '.tmp')}",
            f"chmod {mode} {q(path + '.tmp')} && mv -f {q(path + '.tmp')} {q(path)}",
        ]
    lines += [
        "systemctl daemon-reload",
        f"systemctl enable --now {' '.join(ACME_TIMERS)}",
        f"systemctl start --no-block {ACME_SERVICE}",
        f'echo "acme: certbot renews the certificate of {profile.domain} ({ACME_TIMER})"',
    ]
    return "\n".join(lines) + "\n"


def acme_remove_script(profile: NodeProfile, install_dir: str) -> str:
    """Undoes ``acme_install_script`` (as root): stops and disables the timer and the service, removes
    their files. certbot's state (account, certificates, under the data directory) stays, as the data
    does."""
    q = shlex.quote
    paths = " ".join(q(path) for path in _acme_files(profile, install_dir))
    return f"""set -eu
systemctl disable --now {" ".join(ACME_TIMERS)} 2>/dev/null || true
systemctl stop {ACME_SERVICE} 2>/dev/null || true
rm -f {paths}
systemctl daemon-reload 2>/dev/null || true
"""


def compose_up_script(install_dir: str) -> str:
    """Prepares the host and starts the node (``docker compose up -d``)."""
    q = shlex.quote
    compose = _compose(install_dir)
    return f"""set -eu
export DOCKER_CONFIG={q(DOCKER_CONFIG_DIR)}
sh {q(install_dir + "/" + PREPARE_SCRIPT)}
cd {q(install_dir)}
export DUPLEX_NODE_ID="$(hostname)"
{_hf_env(install_dir)}
{compose} config --quiet
{compose} pull --quiet
{compose} up -d --remove-orphans
{compose} ps
"""


def compose_down_script(install_dir: str) -> str:
    """Stops the node and removes ``install_dir`` (nothing else: the data directory stays)."""
    q = shlex.quote
    compose = _compose(install_dir)
    return f"""set -eu
if [ -f {q(install_dir + "/" + COMPOSE_FILE)} ]; then
    cd {q(install_dir)}
    {compose} down --remove-orphans || true
fi
cd /
rm -rf {q(install_dir)}
"""


def ready_script(profile: NodeProfile, install_dir: str, timeout_s: int) -> str:
    """Waits until nginx answers 200 on ``/readyz``; fails after ``timeout_s`` with the node's state."""
    port = profile.ports.https
    url = f"https://127.0.0.1{'' if port == 443 else f':{port}'}/readyz"
    compose = _compose(install_dir)
    return f"""set -eu
deadline=$(( $(date +%s) + {timeout_s} ))
until curl -kfsS -o /dev/null --max-time 10 {url}; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "ready: {url} did not answer 200 within {timeout_s} s (first boots download the weights)" >&2
        {compose} ps >&2 || true
        {compose} logs --no-color --tail 50 runtime >&2 || true
        exit 1
    fi
    sleep 10
done
echo "ready: {url} answers 200"
"""


@dataclass(frozen=True)
class OnPremNodeArgs:
    """An existing GPU host.

    Attributes:
        host, port, user: SSH coordinates (``user``: root, or passwordless sudo).
        private_key: the SSH private key (a secret Output).
        host_key: the host's public key line (``ssh-ed25519 AAAA...``): required, every connection of every
            step checks it (``remote.ConnectionArgs.host_key``: without it pulumi-command 1.2 ignores the
            host key, and the secrets would go to whoever answers on the address).
        install_dir: where the bundle goes (removed on destroy).
        profile: the node profile, with the image the host runs in ``runtime_image``.
        secret_files: ``{bundle path: content}`` of the node's secrets (a secret Output).
        ready_timeout_s: how long ``ready`` waits for ``/readyz``.
        local_bundle_dir: where the bundle is written locally for ``CopyToRemote`` (emptied first). An
            absolute path: the engine reads the archive from its own working directory.
        registry, registry_token: the registry to log Docker in to before the pull, and a short-lived
            token for it (a secret Output; ``RegistryPuller``); None: the host pulls with what it has.
    """

    host: str
    port: int
    user: str
    private_key: pulumi.Input[str]
    install_dir: str
    profile: NodeProfile
    secret_files: pulumi.Input[dict[str, str]]
    local_bundle_dir: str
    host_key: str
    ready_timeout_s: int = 1800
    registry: str | None = None
    registry_token: pulumi.Input[str] | None = None

    def __post_init__(self) -> None:
        if not self.host_key or len(self.host_key.split()) < 2:
            raise ValueError(
                f"host_key: {self.host_key!r} is not a public key line; allowed: the host's key, e.g. from "
                "`ssh-keyscan -t ed25519 <host>` ('ssh-ed25519 AAAA...'): secrets travel over this session"
            )


class OnPremNode(pulumi.ComponentResource):
    """The node bundle installed and started on an existing GPU host over SSH. The stack builds no image:
    the host runs the digest-pinned ``runtimeImage`` of the configuration.

    Steps (``remote.Command`` unless said), each after the one before:

    1. ``gpu-check``: ``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader`` must show the
       profile's GPU on every line (name pattern and at least 90 % of the catalog's memory), else it fails
       naming what it found;
    2. ``stage`` (``installDir`` and a staging directory the SSH user owns), ``bundle``
       (``remote.CopyToRemote`` of the rendered bundle, a ``FileArchive`` written under the local build
       directory) and ``install`` (root-owned copy into ``installDir``, old bundle files replaced;
       ``secrets/`` and ``tls/`` kept);
    3. ``secrets``: the secret files written from ``stdin`` (never on a command line) into
       ``installDir/secrets`` (0700): 0640 for the files a container reads itself
       (``infra.node.bundle.compose.CONTAINER_READ_SECRETS``), 0600 for the others;
    3b. ``acme`` (``tls.mode: acme`` only, right after ``gpu-check``): ``acme_install_script``: certbot
       required on the host (else it fails naming the package), the renew script, deploy hook (nginx
       reloaded with ``docker compose kill --signal HUP nginx``), service and timer of
       ``infra.node.bundle.acme``;
       its ``delete`` removes them. Like ``compose-up``, a change is an update;
    4. ``compose-up``: the preparation script of ``infra.node.bundle.cloud_init.render_prepare_script`` (host
       directories with their owners, a self-signed certificate when none exists, the secrets checked), then
       ``docker compose up -d``. Its ``delete`` runs ``docker compose down`` and removes ``installDir``:
       destroy removes what the stack installed (the data directory, with the model cache, Redis, Prometheus
       and Grafana data, stays);
    5. ``ready``: polls ``https://127.0.0.1/readyz`` (``curl -k``) until it answers 200, or fails after
       ``ready_timeout_s`` with ``docker compose ps`` and the runtime's last log lines.

    Steps 1-3 and 5 carry the bundle's hash in ``triggers``: a changed profile, image or script re-runs them.
    ``compose-up`` carries it in its ``environment`` instead, so a change runs it again as an update
    (``docker compose up -d`` recreates what changed) rather than a replacement, whose ``delete`` would take
    the node down and remove ``installDir`` after the new bundle was installed. Its ``triggers`` are where
    the node is (host, port, ``installDir``): moving it replaces it, deleting the old one first.
    """

    bundle: dict[str, bytes]
    bundle_sha256: str
    gpu_check: remote.Command
    copy: remote.CopyToRemote
    acme: remote.Command | None = None
    """certbot's renewal on the host (``acme_install_script``), with ``tls.mode: acme`` only."""
    compose_up: remote.Command
    ready: remote.Command

    def __init__(self, name: str, args: OnPremNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:OnPremNode", name, None, opts)
        deps = dependencies(opts)
        profile, install_dir, user = args.profile, args.install_dir, args.user
        self.bundle = onprem_bundle(profile, install_dir)
        self.bundle_sha256 = digest = bundle_digest(self.bundle)
        local = Path(args.local_bundle_dir).resolve()
        if local.exists():
            shutil.rmtree(local)
        write_bundle(self.bundle, local)

        connection = remote.ConnectionArgs(
            host=args.host,
            port=args.port,
            user=user,
            private_key=pulumi.Output.secret(args.private_key),
            host_key=args.host_key,
            dial_error_limit=10,
            per_dial_timeout=15,
        )
        conn: pulumi.Output[remote.ConnectionArgs] = pulumi.Output.secret(connection)

        def step(
            step_name: str,
            after: list[pulumi.Resource],
            create: str,
            stdin: pulumi.Input[str] | None = None,
        ) -> remote.Command:
            return remote.Command(
                f"{name}-{step_name}",
                connection=conn,
                create=create,
                stdin=stdin,
                triggers=[digest],
                opts=child_options(self, [*deps, *after]),
            )

        def stdin_of(files: dict[str, str]) -> str:
            return secret_stdin(dict(files))

        self.gpu_check = step("gpu-check", [], create=gpu_check_script(profile))
        stage = step("stage", [self.gpu_check], create=_as_root(stage_script(install_dir, user), user))
        self.copy = remote.CopyToRemote(
            f"{name}-bundle",
            connection=conn,
            source=pulumi.FileArchive(str(local)),
            remote_path=f"{install_dir}/{STAGING_DIR}",
            triggers=[digest],
            opts=child_options(self, [*deps, stage]),
        )
        install = step(
            "install", [self.copy], create=_as_root(install_script(install_dir, self.bundle), user)
        )
        secrets = step(
            "secrets",
            [install],
            create=_as_root(secrets_script(install_dir), user),
            stdin=pulumi.Output.secret(pulumi.Output.from_input(args.secret_files).apply(stdin_of)),
        )
        before_up: list[pulumi.Resource] = [install, secrets]
        if profile.tls.mode == "acme":
            # Right after the GPU check: a host without certbot fails before anything changes on it. The
            # files' hash in `environment`: a change is an update (create runs again), never a replacement
            # whose delete would remove the new files.
            acme_sha256 = hashlib.sha256(acme_install_script(profile, install_dir).encode()).hexdigest()
            self.acme = remote.Command(
                f"{name}-acme",
                connection=conn,
                create=_as_root(acme_install_script(profile, install_dir), user),
                delete=_as_root(acme_remove_script(profile, install_dir), user),
                environment={"DUPLEX_ACME_SHA256": acme_sha256},
                triggers=[args.host, str(args.port), install_dir],
                opts=child_options(self, [*deps, self.gpu_check], delete_before_replace=True),
            )
            before_up.append(self.acme)
        if args.registry is not None and args.registry_token is not None:
            # Runs at every deploy (a new token each time), before compose-up pulls the new image.
            before_up.append(
                remote.Command(
                    f"{name}-registry-login",
                    connection=conn,
                    create=_as_root(registry_login_script(args.registry), user),
                    stdin=pulumi.Output.secret(args.registry_token),
                    opts=child_options(self, [*deps, secrets]),
                )
            )
        self.compose_up = remote.Command(
            f"{name}-compose-up",
            connection=conn,
            create=_as_root(compose_up_script(install_dir), user),
            delete=_as_root(compose_down_script(install_dir), user),
            # A changed bundle changes this input: an update runs `create` again (sshd may drop the
            # variable itself, which nothing reads).
            environment={"DUPLEX_BUNDLE_SHA256": digest},
            triggers=[args.host, str(args.port), install_dir],
            opts=child_options(self, [*deps, *before_up], delete_before_replace=True),
        )
        self.ready = step(
            "ready",
            [self.compose_up],
            create=_as_root(ready_script(profile, install_dir, args.ready_timeout_s), user),
        )
        self.register_outputs({"bundle_sha256": digest, "ready": self.ready.stdout})


def artifact_registry_repository(image: str) -> tuple[str, str, str, str] | None:
    """``(registry host, project, location, repository id)`` of an Artifact Registry image reference
    (``LOCATION-docker.pkg.dev/PROJECT/REPOSITORY/IMAGE@sha256:...``), or None for another registry.

    >>> artifact_registry_repository("us-central1-docker.pkg.dev/p-1/repo/runtime@sha256:" + "a" * 64)
    ('us-central1-docker.pkg.dev', 'p-1', 'us-central1', 'repo')
    """
    host, _, path = image.partition("/")
    if not host.endswith("-docker.pkg.dev") or path.count("/") < 2:
        return None
    project, repository = path.split("/")[:2]
    return host, project, host.removesuffix("-docker.pkg.dev"), repository


class RegistryPuller(pulumi.ComponentResource):
    """A 1-hour access token of the read-only image puller account, minted at each deploy by the deploying
    identity (``iamcredentials generateAccessToken``). The token travels to the host over the pinned SSH
    session and is used by the same deploy's pull; the host keeps no standing credential (a service
    account key is refused by the secure-by-default organization policy
    ``iam.disableServiceAccountKeyCreation``). A restart or reboot of the host runs the image already
    pulled; only a deploy pulls, and each deploy brings a fresh token.

    The account and both its grants (``roles/artifactregistry.reader`` on the build repository, and
    ``roles/iam.serviceAccountTokenCreator`` on it for the deployer) belong to the bootstrap project
    (``infra/bootstrap``), not to the stack: IAM is eventually consistent, "changes to allow or deny
    policies typically propagate in 2 minutes, but could potentially take 7 minutes or longer"
    (cloud.google.com/iam/docs/access-change-propagation), so a grant made in the same ``up`` that mints the
    token and pulls raced that propagation (403 on a first ``up``). Made by the bootstrap, they exist
    before the stack's first ``up``.

    Attributes:
        registry: the registry host (``us-central1-docker.pkg.dev``).
        token: the access token (secret Output).
        account: the puller account's e-mail (``<PULLER_ACCOUNT_ID>@<the image's project>``).
    """

    registry: str
    token: pulumi.Output[str]
    account: str

    def __init__(
        self, name: str, image: str, account_id: str, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        """``account_id``: the bootstrap's puller account (in the image's project).

        Raises: ValueError: ``image`` is not in Artifact Registry (``artifact_registry_repository``)."""
        super().__init__(f"{COMPONENT_PACKAGE}:RegistryPuller", name, None, opts)
        found = artifact_registry_repository(image)
        if found is None:
            raise ValueError(
                f"image {image!r} is not in Artifact Registry (LOCATION-docker.pkg.dev/PROJECT/REPO/...)"
            )
        self.registry, project, _location, _repository = found
        self.account = f"{account_id}@{project}.iam.gserviceaccount.com"
        result = serviceaccount.get_account_access_token_output(
            target_service_account=self.account,
            scopes=["https://www.googleapis.com/auth/cloud-platform"],
            lifetime="3600s",
            opts=pulumi.InvokeOutputOptions(depends_on=dependencies(opts), parent=self),
        )
        self.token = pulumi.Output.secret(result.access_token)
        self.register_outputs({"account": self.account, "registry": self.registry})
