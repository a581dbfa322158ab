"""``StackSecrets``: the node's secrets.

- The Redis password and Grafana's admin password come from the stack's secret configuration when given
  (``redisPassword``, ``grafanaAdminPassword``), else from a ``random.RandomPassword`` (32 letters and
  digits: the runtime puts the Redis password in a URL). They are secret Outputs either way.
- The session-token signing keys (``tokenSigningKeys``, JSON ``{"kid": "secret", ...}``) from secret
  configuration when given, else one key ``<name_prefix>-1`` whose secret is a ``random.RandomPassword``
  (48 letters and digits). The application backend mints session tokens with them.
- The TURN relay's shared secret (coturn's ``static-auth-secret``, the runtime's ``DUPLEX_TURN_SECRET``),
  where the profile's relay is on: from secret configuration when given (``turnSecret``: to share one with
  an existing coturn fleet, or to rotate it), else from a ``random.RandomPassword`` (48 letters and digits).
- The Hugging Face token (``hfToken``) only from secret configuration; absent when not given.
- ``files``: the node's secret files (``infra.node.bundle.services.secret_files``, plus
``secrets/hf-token.env``
  when there is a token), ``{bundle path: content}``, a secret Output: the on-premises stack writes them
  over SSH.
- With ``secret_manager_project`` (GCE nodes), one Secret Manager secret per role (replication automatic)
  holding exactly what ``infra.node.bundle.cloud_init`` fetches at boot: the secret file's content for the
  roles
  of ``SECRET_FILES``, the bare token for ``hf_token``. ``secret_ids`` maps role to secret id (plain: ids
  are not secret); the VM's service account gets read access to these secrets only (``GceGpuNode``).

Nothing here is ever a plain output: every value is wrapped with ``pulumi.Output.secret``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import pulumi
import pulumi_random as random

from infra.components._util import COMPONENT_PACKAGE, child_options, dependencies
from infra.node.bundle.cloud_init import HF_TOKEN_FILE
from infra.node.bundle.services import (
    OPTIONAL_SECRET_FILES,
    SECRET_FILES,
    NodeSecrets,
    optional_secret_roles,
    secret_files,
)
from infra.node.profile.profiles import NodeProfile

__all__ = ["PASSWORD_LENGTH", "StackSecrets", "StackSecretsArgs", "secret_id_for"]

PASSWORD_LENGTH = 32
TOKEN_KEY_LENGTH = 48


def secret_id_for(name_prefix: str, role: str) -> str:
    """The Secret Manager secret id of ``role`` for a node named ``name_prefix``."""
    return f"{name_prefix}-{role.replace('_', '-')}"


@dataclass(frozen=True)
class StackSecretsArgs:
    """What the secrets are made of.

    Attributes:
        name_prefix: prefix of the generated resources and secret ids.
        profile: the node's profile (the Redis URL in ``runtime.env`` names its Redis endpoint).
        redis_password, grafana_admin_password: given values (secret Outputs), or None to generate.
        token_keys: the session-token signing keys as JSON ``{"kid": "secret"}`` (secret Output), or None to
            generate one key.
        app_token_keys: the application-token (sessions API) signing keys, the same form, never a session
            key (``NodeSecrets`` refuses one), or None to generate one key.
        hf_token: the Hugging Face token (secret Output), or None.
        carrier_secrets: the phone carriers' secrets by name (``infra.node.bundle.carriers.CARRIER_SECRETS``:
        the
            stack keys ``twilioAuthToken``, ``plivoAuthToken``...), the ones set only: they go into the
            runtime's ``secrets/runtime.env`` with the stream URLs the carriers sign
            (``infra.node.bundle.carriers.carrier_settings``).
        turn_secret: the TURN REST shared secret (secret Output), or None to generate one (where the
            profile's relay is on; ignored where it is off).
        turn_secret_previous: the TURN secret being rotated out (secret Output): coturn still accepts it,
            nothing mints with it; None: none.
        secret_manager_project: the project to store the secrets in (GCE); None: no Secret Manager.
        labels: labels of the Secret Manager secrets.
        node_files: False where no node bundle runs (the multi-region stack: Memorystore makes the Redis
            AUTH string, Kubernetes Secrets carry the rest): no Redis password, ``files`` is None.
    """

    name_prefix: str
    profile: NodeProfile
    redis_password: pulumi.Input[str] | None = None
    grafana_admin_password: pulumi.Input[str] | None = None
    token_keys: pulumi.Input[str] | None = None
    app_token_keys: pulumi.Input[str] | None = None
    hf_token: pulumi.Input[str] | None = None
    carrier_secrets: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    turn_secret: pulumi.Input[str] | None = None
    turn_secret_previous: pulumi.Input[str] | None = None
    alert_secrets: Mapping[str, pulumi.Input[str]] = field(default_factory=dict)
    """The alert receivers' secrets the profile uses, ``{role of OPTIONAL_SECRET_FILES: value}``."""
    secret_manager_project: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    node_files: bool = True


class StackSecrets(pulumi.ComponentResource):
    """The node's passwords (given or generated), its secret files, and their Secret Manager secrets."""

    redis_password: pulumi.Output[str] | None
    grafana_admin_password: pulumi.Output[str]
    token_keys: pulumi.Output[str]
    app_token_keys: pulumi.Output[str]
    turn_secret: pulumi.Output[str] | None
    turn_secret_previous: pulumi.Output[str] | None
    hf_token: pulumi.Output[str] | None
    carrier_secrets: dict[str, pulumi.Output[str]]
    files: pulumi.Output[dict[str, str]] | None
    secret_ids: dict[str, str]
    secrets: dict[str, pulumi.CustomResource]
    versions: list[pulumi.CustomResource]

    def __init__(self, name: str, args: StackSecretsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__(f"{COMPONENT_PACKAGE}:StackSecrets", name, None, opts)
        deps = dependencies(opts)
        self.redis_password = (
            self._password(name, "redis-password", args.redis_password, deps) if args.node_files else None
        )
        self.grafana_admin_password = self._password(
            name, "grafana-admin-password", args.grafana_admin_password, deps
        )
        if args.token_keys is not None:
            self.token_keys = pulumi.Output.secret(args.token_keys)
        else:
            kid = f"{args.name_prefix}-1"
            key = self._password(name, "token-signing-key", None, deps, length=TOKEN_KEY_LENGTH)
            self.token_keys = pulumi.Output.secret(key.apply(lambda secret: json.dumps({kid: secret})))
        if args.app_token_keys is not None:
            self.app_token_keys = pulumi.Output.secret(args.app_token_keys)
        else:
            app_kid = f"{args.name_prefix}-app-1"
            app_key = self._password(name, "app-token-signing-key", None, deps, length=TOKEN_KEY_LENGTH)
            self.app_token_keys = pulumi.Output.secret(
                app_key.apply(lambda secret: json.dumps({app_kid: secret}))
            )
        self.hf_token = None if args.hf_token is None else pulumi.Output.secret(args.hf_token)
        self.carrier_secrets = {
            name: pulumi.Output.secret(value) for name, value in sorted(args.carrier_secrets.items())
        }
        self.turn_secret = None
        self.turn_secret_previous = None
        if args.profile.relay.enabled and args.turn_secret_previous is not None:
            self.turn_secret_previous = pulumi.Output.secret(args.turn_secret_previous)
        if args.profile.relay.enabled:
            self.turn_secret = self._password(
                name, "turn-secret", args.turn_secret, deps, length=TOKEN_KEY_LENGTH
            )

        profile = args.profile

        alert_roles = sorted(args.alert_secrets)
        carrier_names = list(self.carrier_secrets)

        def render(values: list[str | None]) -> dict[str, str]:
            redis, grafana, keys, app_keys, token, turn, turn_previous, *rest = values
            carriers, alerts = rest[: len(carrier_names)], rest[len(carrier_names) :]
            assert redis is not None and grafana is not None and keys is not None and app_keys is not None
            node_secrets = NodeSecrets(
                redis_password=redis,
                grafana_admin_password=grafana,
                token_keys=json.loads(keys),
                app_token_keys=json.loads(app_keys),
                turn_secret=turn,
                turn_secret_previous=turn_previous,
                carrier_secrets={n: v for n, v in zip(carrier_names, carriers, strict=True) if v is not None},
                **dict(zip(alert_roles, alerts, strict=True)),
            )
            files = {path: content.decode() for path, content in secret_files(profile, node_secrets).items()}
            if token:
                files[HF_TOKEN_FILE] = f"HF_TOKEN={token}\n"
            return files

        token_input: pulumi.Input[str | None] = self.hf_token if self.hf_token is not None else None
        turn_input: pulumi.Input[str | None] = self.turn_secret
        self.files = None
        if self.redis_password is None:
            if args.secret_manager_project is not None:
                raise ValueError("StackSecretsArgs: Secret Manager holds node files: keep node_files=True")
            self.register_outputs({})
            return
        self.files = pulumi.Output.secret(
            pulumi.Output.all(
                self.redis_password,
                self.grafana_admin_password,
                self.token_keys,
                self.app_token_keys,
                token_input,
                turn_input,
                self.turn_secret_previous,
                *self.carrier_secrets.values(),
                *(pulumi.Output.secret(args.alert_secrets[role]) for role in alert_roles),
            ).apply(render)
        )

        self.secret_ids = {}
        self.secrets = {}
        self.versions = []
        if args.secret_manager_project is not None:
            self._store(name, args, deps)
        self.register_outputs({"secret_ids": self.secret_ids})

    def _password(
        self,
        name: str,
        what: str,
        given: pulumi.Input[str] | None,
        deps: list[pulumi.Resource],
        *,
        length: int = PASSWORD_LENGTH,
    ) -> pulumi.Output[str]:
        if given is not None:
            return pulumi.Output.secret(given)
        generated = random.RandomPassword(
            f"{name}-{what}",
            length=length,
            special=False,
            min_lower=1,
            min_upper=1,
            min_numeric=1,
            opts=child_options(self, deps),
        )
        return pulumi.Output.secret(generated.result)

    def _store(self, name: str, args: StackSecretsArgs, deps: list[pulumi.Resource]) -> None:
        import pulumi_gcp.secretmanager as secretmanager

        project = args.secret_manager_project

        files = self.files
        assert files is not None

        def payload(path: str) -> pulumi.Output[str]:
            return pulumi.Output.secret(files.apply(lambda content: content[path]))

        payloads = {role: payload(path) for role, path in SECRET_FILES.items()}
        # the alert receivers' (infra.node.monitoring.alertmanager)
        for role in optional_secret_roles(args.profile):
            payloads[role] = payload(OPTIONAL_SECRET_FILES[role])
        if self.hf_token is not None:
            payloads["hf_token"] = self.hf_token
        for role in sorted(payloads):
            secret_id = secret_id_for(args.name_prefix, role)
            secret = secretmanager.Secret(
                f"{name}-{role.replace('_', '-')}",
                project=project,
                secret_id=secret_id,
                replication={"auto": {}},
                labels={**args.labels, "role": role.replace("_", "-")},
                opts=child_options(self, deps),
            )
            version = secretmanager.SecretVersion(
                f"{name}-{role.replace('_', '-')}-version",
                secret=secret.id,
                secret_data=payloads[role],
                opts=child_options(self, deps),
            )
            self.secret_ids[role] = secret_id
            self.secrets[role] = secret
            self.versions.append(version)
