"""Run the Pulumi program of a stack under Pulumi's mocks, without the CLI, the engine or any cloud, and
return what it declared.

``run_stack("dev")`` loads ``stacks/Pulumi.dev.yaml``, adds fake secrets (``FAKE_SECRETS``, as secret
config), sets ``pulumi.runtime.set_mocks`` (project ``duplexops``, the stack's name, not a preview) and
runs ``infra.__main__.main`` once. The result (``StackRun``) holds every resource the program registered
(type token, logical name, inputs as the provider would get them: camelCase keys, secret values wrapped),
every provider function call, and the program's outputs resolved, with which of them are secret.

Use it from any test module (the multi-region stacks, the policy pack); pytest puts ``tests/`` on
``sys.path``::

    from pulumi_harness import run_stack
    run = run_stack("scale5-gcp")
    [vm] = run.of_type("gcp:compute/instance:Instance")
    assert vm.plain["machineType"] == "a2-ultragpu-1g"

A wrong configuration raises ``infra.stack_config.StackConfigError`` from ``run_stack`` (``run_stack``
records nothing then: the program fails before declaring a resource). Runs are sequential (Pulumi's
runtime state is process-wide): do not call ``run_stack`` from several threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
import yaml
from pulumi.runtime import rpc

__all__ = [
    "FAKE_PROMOTED",
    "FAKE_SECRETS",
    "LAST_MOCKS",
    "REPO_ROOT",
    "STACKS",
    "RecordedCall",
    "RecordedResource",
    "RecordingMocks",
    "StackRun",
    "load_stack_file",
    "plain",
    "run_program",
    "run_stack",
    "secret_paths",
    "stack_config",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
STACKS_DIR = REPO_ROOT / "stacks"
STACKS = ("dev", "scale5-gcp", "scale5-onprem")
"""The single-node stacks (``stacks/Pulumi.<stack>.yaml``)."""

PROJECT = "duplexops"

_FAKE_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACBmYWtlLWtleS1mb3ItdGVzdHMtb25seS1ub3QtYS1yZWFsLWtleQAAAJhm\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
FAKE_SECRETS: dict[str, dict[str, str]] = {
    "gce-node": {"hfToken": "hf_FakeTokenForUnitTests0123456789"},
    "multi-region": {"hfToken": "hf_FakeTokenForUnitTests0123456789"},
    "onprem-node": {
        "onpremSshPrivateKey": _FAKE_KEY,
        "hfToken": "hf_FakeTokenForUnitTests0123456789",
    },
}
"""Secret config each topology's tests inject (the stack files hold none: they are set with the CLI)."""

_PROMOTED_REPOSITORY = "us-central1-docker.pkg.dev/my-gcp-project/duplex-build/duplex-runtime"
FAKE_PROMOTED: dict[str, dict[str, str]] = {
    "onprem-node": {"duplexops:runtimeImage": f"{_PROMOTED_REPOSITORY}@sha256:" + "5" * 64},
}
"""Plain config CI gives each update and no stack file holds (the promoted image, pulumi-up.yml)."""

MOCK_ACCESS_TOKEN = "ya29.mock-access-token-for-unit-tests"
MOCK_DEPLOYER = "deployer@my-gcp-project.iam.gserviceaccount.com"
MOCK_IP = "203.0.113.10"
MOCK_PROJECT_NUMBER = "123456789012"
MOCK_GLOBAL_IP = "198.51.100.7"
MOCK_REDIS_CA = "-----BEGIN CERTIFICATE-----\nTW9jayBNZW1vcnlzdG9yZSBDQQ==\n-----END CERTIFICATE-----\n"


# --- values --------------------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """``value`` with every secret wrapper of Pulumi's wire format removed (recursively)."""
    if rpc.is_rpc_secret(value):
        return plain(rpc.unwrap_rpc_secret(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def secret_paths(value: Any, path: str = "") -> set[str]:
    """Paths (``a.b[0].c``) of the values inside ``value`` marked secret."""
    found: set[str] = set()
    if rpc.is_rpc_secret(value):
        found.add(path or ".")
        value = rpc.unwrap_rpc_secret(value)
    if isinstance(value, dict):
        for k, v in value.items():
            found |= secret_paths(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found |= secret_paths(v, f"{path}[{i}]")
    return found


@dataclass
class RecordedResource:
    """One resource the program registered: type token, logical name, inputs (camelCase; secrets wrapped
    as on the wire), and whether it is a custom (provider) resource."""

    type: str
    name: str
    inputs: dict[str, Any]
    custom: bool
    state: dict[str, Any] = field(default_factory=dict)
    urn: str = ""
    """``urn:pulumi:<stack>::duplexops::<parent types $-joined>$<type>::<name>`` (set after the run)."""
    dependencies: tuple[str, ...] = ()
    """URNs of the resources it depends on (``depends_on`` and inputs from other resources), as the engine
    would get them."""
    ignore_changes: tuple[str, ...] = ()
    """Its ``ignore_changes`` property paths."""
    replace_on_changes: tuple[str, ...] = ()
    """Its ``replace_on_changes`` property paths."""
    parent: str = ""
    """URN of its parent (the stack's for a top-level resource)."""
    provider: str = ""
    """Its explicit provider reference, ``<provider URN>::<id>`` ("" for the default provider)."""
    delete_before_replace: bool = False
    """Its ``delete_before_replace`` option: True deletes the old resource before creating its replacement
    (Pulumi's default, False, creates the new one first)."""

    @property
    def parent_types(self) -> list[str]:
        """Types of the resource's ancestors, outermost first, from its URN (the stack excluded)."""
        qualified = self.urn.split("::")[2] if self.urn else self.type
        return [t for t in qualified.split("$")[:-1] if t != "pulumi:pulumi:Stack"]

    @property
    def plain(self) -> dict[str, Any]:
        """The inputs without secret wrappers."""
        return plain(self.inputs)

    def is_secret(self, key: str) -> bool:
        """Whether input ``key`` (top level) is, or holds, a secret."""
        return any(p == key or p.startswith((key + ".", key + "[")) for p in secret_paths(self.inputs))


@dataclass
class RecordedCall:
    """One provider function call (invoke)."""

    token: str
    args: dict[str, Any]


class RecordingMocks(pulumi.runtime.Mocks):
    """Records every resource and call; answers with inputs plus the outputs the programs read."""

    def __init__(self, stack: str, *, unknown_image_digest: bool = False):
        self.stack = stack
        self.unknown_image_digest = unknown_image_digest
        self.resources: list[RecordedResource] = []
        self.calls: list[RecordedCall] = []

    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
        inputs = dict(args.inputs)
        options = _PENDING_OPTIONS.pop((args.typ, args.name), None)
        state = dict(inputs)
        state.update(_computed(args.typ, args.name, plain(inputs)))
        if self.unknown_image_digest and args.typ == "docker-build:index:Image":
            # As a preview of a new build sees it: the digest is known only once the image is pushed.
            state.update({"digest": rpc.UNKNOWN, "ref": rpc.UNKNOWN})
        resource = RecordedResource(args.typ, args.name, inputs, bool(args.custom), state)
        if options is not None:
            (
                resource.dependencies,
                resource.ignore_changes,
                resource.replace_on_changes,
                resource.parent,
                resource.provider,
                resource.delete_before_replace,
            ) = options
        self.resources.append(resource)
        return f"{args.name}-id", state

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        self.calls.append(RecordedCall(args.token, dict(args.args)))
        if args.token == "gcp:organizations/getClientConfig:getClientConfig":
            return {
                "accessToken": MOCK_ACCESS_TOKEN,
                "project": "my-gcp-project",
                "region": "us-central1",
                "zone": "us-central1-a",
                "id": "client-config",
            }, []
        if args.token == "gcp:organizations/getClientOpenIdUserInfo:getClientOpenIdUserInfo":
            return {"email": MOCK_DEPLOYER, "id": "open-id"}, []
        if args.token == "gcp:serviceaccount/getAccountAccessToken:getAccountAccessToken":
            return {"accessToken": MOCK_ACCESS_TOKEN, "id": "token", **dict(args.args)}, []
        raise NotImplementedError(f"the mocks do not answer {args.token}: add it to tests/pulumi_harness.py")


_PENDING_OPTIONS: dict[
    tuple[str, str], tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str, str, bool]
] = {}
"""Resource options of the registration under way, by (type, name): what the mock monitor received."""


def _recording_register_resource(self: Any, request: Any) -> Any:
    """``MockMonitor.RegisterResource`` that first keeps the options the mocks' ``new_resource`` is not
    given (dependencies, ignoreChanges, replaceOnChanges, parent, provider, deleteBeforeReplace)."""
    _PENDING_OPTIONS[(request.type, request.name)] = (
        tuple(request.dependencies),
        tuple(request.ignoreChanges),
        tuple(request.replaceOnChanges),
        request.parent,
        request.provider,
        bool(request.deleteBeforeReplace),
    )
    return _ORIGINAL_REGISTER_RESOURCE(self, request)


_ORIGINAL_REGISTER_RESOURCE = pulumi.runtime.mocks.MockMonitor.RegisterResource
pulumi.runtime.mocks.MockMonitor.RegisterResource = _recording_register_resource  # type: ignore[method-assign]


def _recording_read_resource(self: Any, request: Any) -> Any:
    """``MockMonitor.ReadResource`` (a ``<Resource>.get``) that first keeps its dependencies, parent and
    provider, as ``_recording_register_resource`` does for a declaration."""
    _PENDING_OPTIONS[(request.type, request.name)] = (
        tuple(request.dependencies),
        (),
        (),
        request.parent,
        request.provider,
        False,
    )
    return _ORIGINAL_READ_RESOURCE(self, request)


_ORIGINAL_READ_RESOURCE = pulumi.runtime.mocks.MockMonitor.ReadResource
pulumi.runtime.mocks.MockMonitor.ReadResource = _recording_read_resource  # type: ignore[method-assign]


def _mock_password(name: str) -> str:
    return "Mock" + hashlib.sha256(name.encode()).hexdigest()[:28]


def _computed(typ: str, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """Outputs a real provider would compute, for the types the programs read them from."""
    if typ == "gcp:artifactregistry/repository:Repository":
        return {
            "name": inputs.get("repositoryId"),
            "registryUri": f"{inputs.get('location')}-docker.pkg.dev/{inputs.get('project')}/"
            f"{inputs.get('repositoryId')}",
        }
    if typ == "docker-build:index:Image":
        digest = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
        tags = inputs.get("tags") or [f"{name}:latest"]
        return {"digest": digest, "ref": f"{tags[0].rsplit(':', 1)[0]}@{digest}", "contextHash": "mock"}
    if typ == "gcp:monitoring/uptimeCheckConfig:UptimeCheckConfig":
        return {"uptimeCheckId": f"{name}-uptime-id"}
    if typ == "gcp:serviceaccount/account:Account":
        email = f"{inputs.get('accountId')}@{inputs.get('project')}.iam.gserviceaccount.com"
        return {
            "email": email,
            "member": f"serviceAccount:{email}",
            "uniqueId": "1234567890",
            "name": f"projects/{inputs.get('project')}/serviceAccounts/{email}",
        }
    if typ == "gcp:iam/workloadIdentityPool:WorkloadIdentityPool":
        pool = f"projects/{MOCK_PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
        return {"name": pool + str(inputs.get("workloadIdentityPoolId"))}
    if typ == "gcp:iam/workloadIdentityPoolProvider:WorkloadIdentityPoolProvider":
        pool = f"projects/{MOCK_PROJECT_NUMBER}/locations/global/workloadIdentityPools/"
        return {
            "name": f"{pool}{inputs.get('workloadIdentityPoolId')}/providers/"
            f"{inputs.get('workloadIdentityPoolProviderId')}"
        }
    if typ == "gcp:compute/address:Address":
        return {"address": MOCK_IP, "selfLink": f"https://compute.googleapis.com/mock/addresses/{name}"}
    if typ == "gcp:secretmanager/secret:Secret":
        return {"name": f"projects/{inputs.get('project')}/secrets/{inputs.get('secretId')}"}
    if typ == "random:index/randomPassword:RandomPassword":
        return {"result": rpc.wrap_rpc_secret(_mock_password(name))}
    if typ == "gcp:compute/instance:Instance":
        return {"instanceId": "4242", "selfLink": f"https://compute.googleapis.com/mock/instances/{name}"}
    if typ in ("gcp:compute/network:Network", "gcp:compute/subnetwork:Subnetwork"):
        return {"selfLink": f"https://compute.googleapis.com/mock/{name}"}
    if typ == "command:remote:Command":
        return {"stdout": "", "stderr": ""}
    if typ == "gcp:container/cluster:Cluster":
        return {
            "endpoint": "192.0.2.10",
            "masterAuth": {"clusterCaCertificate": "TW9jayBjbHVzdGVyIENB"},
            "selfLink": f"https://container.googleapis.com/mock/{name}",
        }
    if typ == "gcp:redis/instance:Instance":
        return {
            "host": "10.200.0.4",
            "port": 6378,
            "authString": rpc.wrap_rpc_secret(_mock_password(name)),
            "serverCaCerts": [{"cert": MOCK_REDIS_CA}],
        }
    if typ == "gcp:storage/bucket:Bucket":
        return {"name": f"{name}-a1b2c3", "url": f"gs://{name}-a1b2c3"}
    if typ == "gcp:compute/globalAddress:GlobalAddress":
        return {"address": MOCK_GLOBAL_IP, "selfLink": f"https://compute.googleapis.com/mock/{name}"}
    return {}


# --- configuration -------------------------------------------------------------------------------------


def load_stack_file(stack: str) -> dict[str, Any]:
    """The ``config:`` mapping of ``stacks/Pulumi.<stack>.yaml`` as written."""
    document = yaml.safe_load((STACKS_DIR / f"Pulumi.{stack}.yaml").read_text())
    return dict(document.get("config") or {})


def _as_config_string(value: Any) -> str:
    """A YAML value as Pulumi passes it to a program: strings as is, everything else as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def stack_config(
    stack: str,
    *,
    overrides: Mapping[str, Any] | None = None,
    secrets: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
) -> tuple[dict[str, str], list[str]]:
    """``(config, secret keys)`` of ``stack`` as Pulumi would give them: the stack file, ``overrides``
    (full keys; ``None`` removes a key), the topology's ``FAKE_SECRETS`` (or ``secrets``, short keys of the
    ``duplexops`` namespace) as secret values, minus the ``drop``ped full keys."""
    raw = load_stack_file(stack)
    for key, value in (overrides or {}).items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    topology = str(raw.get(f"{PROJECT}:topology", ""))
    for key, value in FAKE_PROMOTED.get(topology, {}).items():
        if key not in (overrides or {}):
            raw[key] = value
    chosen = dict(FAKE_SECRETS.get(topology, {}) if secrets is None else secrets)
    secret_keys = []
    for key, value in chosen.items():
        raw[f"{PROJECT}:{key}"] = value
        secret_keys.append(f"{PROJECT}:{key}")
    for key in drop:
        raw.pop(key, None)
        if key in secret_keys:
            secret_keys.remove(key)
    return {k: _as_config_string(v) for k, v in raw.items()}, secret_keys


# --- running ---------------------------------------------------------------------------------------------


@dataclass
class StackRun:
    """What one run of the program declared and exported."""

    stack: str
    config: dict[str, str]
    resources: list[RecordedResource]
    calls: list[RecordedCall]
    outputs: dict[str, Any]
    secret_outputs: set[str]
    build_dir: Path

    def of_type(self, type_token: str) -> list[RecordedResource]:
        """Resources of ``type_token`` (``gcp:compute/instance:Instance``), in registration order."""
        return [r for r in self.resources if r.type == type_token]

    def one(self, type_token: str) -> RecordedResource:
        """The single resource of ``type_token`` (fails when there are none or several)."""
        found = self.of_type(type_token)
        assert len(found) == 1, f"{len(found)} resources of type {type_token}: {[r.name for r in found]}"
        return found[0]

    def named(self, name: str) -> RecordedResource:
        """The resource with logical name ``name``."""
        found = [r for r in self.resources if r.name == name]
        assert len(found) == 1, f"{len(found)} resources named {name}"
        return found[0]

    def by_urn(self) -> dict[str, RecordedResource]:
        """``{URN: resource}`` of every resource registered."""
        return {r.urn: r for r in self.resources if r.urn}

    def ordered_after(self, resource: RecordedResource) -> set[str]:
        """URNs of every resource that the engine creates before ``resource``: its dependencies
        (``depends_on``, inputs from other resources), its parent and its explicit provider, and theirs,
        transitively. The SDK awaits each of these URNs before it registers ``resource``
        (``pulumi.runtime.resource.prepare_resource``), and a URN resolves when its registration is done,
        i.e. after the resource is created; a component's children thus wait for the component's own
        ``depends_on``."""
        by_urn = self.by_urn()
        found: set[str] = set()
        todo = _direct_predecessors(resource)
        while todo:
            urn = todo.pop()
            if urn in found:
                continue
            found.add(urn)
            if urn in by_urn:
                todo.extend(_direct_predecessors(by_urn[urn]))
        return found

    @property
    def inventory(self) -> Counter[str]:
        """``{type token: count}`` of every resource, components included."""
        return Counter(r.type for r in self.resources)

    @property
    def secret_values(self) -> set[str]:
        """Every secret value the program handled: the injected secret config, and generated passwords."""
        values = {v for k, v in self.config.items() if k.rsplit(":", 1)[-1] in _ALL_SECRET_KEYS}
        for r in self.of_type("random:index/randomPassword:RandomPassword"):
            values.add(_mock_password(r.name))
        for r in self.of_type("gcp:redis/instance:Instance"):
            values.add(_mock_password(r.name))
        return values


def _direct_predecessors(resource: RecordedResource) -> list[str]:
    """URNs ``resource`` waits for directly: dependencies, parent, provider (its reference less the id)."""
    direct = [*resource.dependencies]
    if resource.parent:
        direct.append(resource.parent)
    if resource.provider:
        direct.append(resource.provider.rsplit("::", 1)[0])
    return direct


_ALL_SECRET_KEYS = {
    "redisPassword",
    "grafanaAdminPassword",
    "tokenSigningKeys",
    "hfToken",
    "onpremSshPrivateKey",
    "turnSecret",
}

LAST_MOCKS: RecordingMocks | None = None
"""The mocks of the latest ``run_stack`` (also when it raised: what was declared before the error)."""


def run_stack(
    stack: str,
    *,
    overrides: Mapping[str, Any] | None = None,
    secrets: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
    build_dir: Path | None = None,
    unknown_image_digest: bool = False,
) -> StackRun:
    """Run the program of ``stack`` under mocks (see ``stack_config`` for the arguments) and return what
    it declared and exported. ``build_dir``: where the on-premises bundle is written (a temporary
    directory when None). ``unknown_image_digest``: the built image's ``digest`` and ``ref`` are unknown,
    as in a preview of a new build (what depends on them is unknown too: ``rpc.UNKNOWN`` in the inputs).

    Raises:
        infra.stack_config.StackConfigError: the configuration is wrong (nothing was declared).
    """
    config, secret_keys = stack_config(stack, overrides=overrides, secrets=secrets, drop=drop)
    build = build_dir or Path(tempfile.mkdtemp(prefix=f"duplexops-{stack}-"))
    # What the CLI gives a program: the build directory, and which config keys are secrets.
    env = {"DUPLEXOPS_BUILD_DIR": str(build), "PULUMI_CONFIG_SECRET_KEYS": json.dumps(secret_keys)}

    def main() -> dict[str, Any]:
        from infra.__main__ import main as program  # after set_mocks: the program reads the mocked runtime

        return program()

    return run_program(
        main,
        project=PROJECT,
        stack=stack,
        config=config,
        secret_keys=secret_keys,
        env=env,
        build_dir=build,
        mocks=RecordingMocks(stack, unknown_image_digest=unknown_image_digest),
    )


def run_program(
    main: Callable[[], Mapping[str, Any]],
    *,
    project: str,
    stack: str,
    config: Mapping[str, str],
    secret_keys: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    build_dir: Path | None = None,
    mocks: RecordingMocks | None = None,
) -> StackRun:
    """Run the Pulumi program ``main`` (returns its outputs) of ``project`` as stack ``stack`` under the
    recording mocks, with the config ``{"<namespace>:<key>": value}`` (``secret_keys``: which are secret) and
    the environment variables ``env`` set for the run; return what it declared and exported.
    ``run_stack`` runs this repository's main program with it; the bootstrap project's tests run theirs."""
    global LAST_MOCKS
    mocks = LAST_MOCKS = mocks or RecordingMocks(stack)
    # A loop of its own: Pulumi's runtime uses the thread's current loop, which an async test before this
    # one (pytest-asyncio) may have closed and unset.
    local = getattr(asyncio.get_event_loop_policy(), "_local", None)
    previous_loop = getattr(local, "_loop", None)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pulumi.runtime.settings.ROOT.set(None)  # a fresh root stack resource for this stack
    pulumi.runtime.set_mocks(mocks, project=project, stack=stack, preview=False)
    pulumi.runtime.set_all_config(dict(config), list(secret_keys))
    env = dict(env or {})
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)

    outputs: dict[str, Any] = {}
    secret_outputs: set[str] = set()

    @pulumi.runtime.test
    def program() -> pulumi.Output[None]:
        exported = main()

        async def collect() -> None:
            for name, value in exported.items():
                out = pulumi.Output.from_input(value)
                outputs[name] = await out.future(with_unknowns=True)
                if await out.is_secret():
                    secret_outputs.add(name)

        return pulumi.Output.from_input(asyncio.ensure_future(collect()))

    try:
        program()
        urns = pulumi.runtime.settings.get_monitor().get_registered_resources()  # type: ignore[union-attr]
        by_key = {(urn.split("::")[2].split("$")[-1], urn.split("::")[-1]): urn for urn in urns}
        for resource in mocks.resources:
            resource.urn = by_key.get((resource.type, resource.name), "")
    finally:
        asyncio.set_event_loop(previous_loop)  # as it was (None included)
        loop.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return StackRun(
        stack,
        dict(config),
        list(mocks.resources),
        list(mocks.calls),
        outputs,
        secret_outputs,
        build_dir or Path(tempfile.gettempdir()),
    )
