"""Runtime settings and the CLI surface (no model loaded here)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from infra.cli import app
from runtime.config import RuntimeConfig
from runtime.tools.cli import app as runtime_app


def test_environment_sets_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_MAX_SESSIONS", "7")
    monkeypatch.setenv("DUPLEX_MODEL", "personaplex-7b")
    config = RuntimeConfig()
    assert config.max_sessions == 7
    assert config.model == "personaplex-7b"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "gpt-4", "allowed: moshi-7b, personaplex-7b, sim, tiny"),
        ("device", "tpu", "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ("max_sessions", 0, "greater than or equal to 1"),
        ("port", 70000, "less than or equal to 65535"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        RuntimeConfig(**{field: value})
    assert field in str(info.value)
    assert message in str(info.value)


def test_unknown_setting_is_refused() -> None:
    with pytest.raises(ValidationError, match="max_session"):
        RuntimeConfig(max_session=3)


def test_serve_with_a_bad_env_value_exits_2_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_MAX_SESSIONS", "zero")
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2
    assert "max_sessions" in result.output


RUNTIME_COMMANDS = (
    "serve",
    "demo",
    "loadgen",
    "bench",
    "bench-persona",
    "token",
    "token mint",
    "token keygen",
)
DEPLOYMENT_COMMANDS = ("capacity", "node", "node profiles", "node render", "node up")


def test_every_command_has_help() -> None:
    runner = CliRunner()
    for command in (*RUNTIME_COMMANDS, *DEPLOYMENT_COMMANDS):
        result = runner.invoke(app, [*command.split(), "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert "Usage" in result.output


def test_the_runtimes_commands_alone_make_the_images_cli() -> None:
    """``runtime.tools.cli.app`` (the image's ``duplex-runtime``) has the runtime's commands and none of
    infra's;
    building the whole ``duplex`` (``infra.cli``) leaves it so."""
    runner = CliRunner()
    for command in RUNTIME_COMMANDS:
        assert runner.invoke(runtime_app, [*command.split(), "--help"]).exit_code == 0, command
    for command in ("capacity", "node"):
        result = runner.invoke(runtime_app, [command, "--help"])
        assert result.exit_code == 2 and "No such command" in result.output, result.output


def test_opus_complexity_needs_the_pyav_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = RuntimeConfig.model_fields
    assert (fields["opus_encoder"].default, fields["opus_complexity"].default) == ("sphn", 10)
    monkeypatch.setenv("DUPLEX_OPUS_ENCODER", "pyav")
    monkeypatch.setenv("DUPLEX_OPUS_COMPLEXITY", "5")
    config = RuntimeConfig()
    assert (config.opus_encoder, config.opus_complexity) == ("pyav", 5)
    with pytest.raises(ValidationError, match="DUPLEX_OPUS_ENCODER=pyav"):
        RuntimeConfig(opus_encoder="sphn", opus_complexity=5)
    with pytest.raises(ValidationError, match="less than or equal to 10"):
        RuntimeConfig(opus_complexity=11)
    with pytest.raises(ValidationError, match="'sphn' or 'pyav'"):
        RuntimeConfig(opus_encoder="ffmpeg")
