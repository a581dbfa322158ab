"""``duplex bench`` measures the model ``duplex serve`` runs, built once (issue 30, item 12).

The 7B cannot be built here: its ``LMModel`` keyword arguments are recorded where moshi's class is called
(``runtime.engine.models.LMModel``) and the build stopped there, on the serve path (a checkpoint directory
in the published layout, no ``config.json``, as Kyutai's repos) and on the bench's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import runtime.engine.checkpoint_config as checkpoint_config
import runtime.engine.models as models
from runtime.config import RuntimeConfig
from runtime.engine.models import LM_WEIGHTS_FILE
from runtime.tools.cli import app


class _Built(Exception):
    """Raised by the recording LMModel once it has the keyword arguments."""


def _recorded_lm_kwargs(monkeypatch: pytest.MonkeyPatch, build: Any) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        raise _Built

    monkeypatch.setattr(models, "LMModel", record)
    monkeypatch.setattr(checkpoint_config, "LMModel", record)  # the loader's skeleton, built before weights
    with pytest.raises(_Built):
        build()
    monkeypatch.undo()
    [kwargs] = calls
    return {k: v for k, v in kwargs.items() if k not in ("device", "dtype", "quantize")}


def _personaplex_layout(directory: Path) -> Path:
    """The LM file of ``nvidia/personaplex-7b-v1`` as far as loading reads it before building the model:
    its depformer heads ``linears.0..15`` (16 stored steps), tiny tensors."""
    directory.mkdir()
    save_file({f"linears.{i}.weight": torch.zeros(2, 2) for i in range(16)}, str(directory / LM_WEIGHTS_FILE))
    return directory


def test_the_bench_builds_the_served_personaplex(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``duplex bench --model personaplex-7b`` built the 16-step depformer, with no user audio reaching
    the LM (n_q - dep_q = 0); ``duplex serve`` builds 8 steps and 8 user codebooks."""
    weights = _personaplex_layout(tmp_path / "personaplex")
    config = RuntimeConfig(model="personaplex-7b", weights=str(weights), device="cpu")
    served = _recorded_lm_kwargs(monkeypatch, config.load_model_bundle)

    def bench() -> None:
        result = CliRunner().invoke(app, ["bench", "--model", "personaplex-7b", "--batch", "1"])
        if result.exception:
            raise result.exception

    benched = _recorded_lm_kwargs(monkeypatch, bench)
    assert benched == served
    assert benched["dep_q"] == 8 and benched["n_q"] - benched["dep_q"] == 8


def test_the_bench_builds_its_model_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """One model for every engine and batch size (each engine's streaming state released before the
    next); the stock design's CPU copies are copies, not builds. It built one per engine on a GPU (up to 10
    copies of a 7B) and two on the CPU."""
    real = models.LMModel
    builds: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "LMModel", counting)
    out = tmp_path / "bench.json"
    args = ["bench", "--batch", "1", "--batch", "3", "--ticks", "2", "--stagger", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(builds) == 1
    summary = json.loads(out.read_text())
    assert {(r["design"], r["batch"]) for r in summary["rows"]} == {
        (design, b) for design in ("batched", "staggered", "stock") for b in (1, 3)
    }
    assert all(r["cuda_graphs_replayed"] is None for r in summary["rows"])  # no graphs off CUDA
    assert summary["depformer_steps"] == 8 and summary["user_codebooks"] == 8
