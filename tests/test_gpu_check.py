"""The GPU check (``python -m runtime.tools.gpu_check``, issue 30, item 12) on the tiny preset and the CPU:
the same code path as on a GPU, in seconds. Figures are checked for consistency, never for speed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from moshi.utils.compile import CUDAGraphed

from runtime.tools import gpu_check
from runtime.tools.cuda_graphs import GraphCounter, graph_summary

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu-check")
    args = ["--preset", "tiny", "--device", "cpu", "--out", str(out), "--batch", "1", "--batch", "2"]
    args += ["--max-batch", "4", "--ticks", "2", "--eager-ticks", "1", "--warmup", "1"]
    assert gpu_check.main(args) == 0
    return json.loads((out / "gpu-check.json").read_text())


def test_the_report_has_every_phase(report: dict[str, Any]) -> None:
    assert report["schema"] == gpu_check.SCHEMA
    assert report["errors"] == [] and report["skipped"] == []
    assert report["installed_wheels"] == []  # everything is installed here
    assert report["environment"]["moshi"] == gpu_check.MOSHI_VERSION
    for key, quantize in (("bf16", "none"), ("int8", "int8")):
        part = report[key]
        assert part["quantize"] == quantize
        # The served configuration: 8 depformer steps, 8 user codebooks reaching the LM.
        assert part["depformer_steps"] == 8 and part["user_codebooks"] == 8
        assert part["lm_parameter_bytes"] > 0
        for row in part["ticks"]:
            for mode in ("eager", "graphed"):
                t = row[mode]
                assert 0 < t["p50_ms"] <= t["p99_ms"] and t["ticks"] >= 1
            assert row["within_frame"] == (row["graphed"]["p99_ms"] < gpu_check.FRAME_MS)
    assert [r["batch"] for r in report["bf16"]["ticks"]] == [1, 2]
    assert report["int8"]["lm_parameter_bytes"] < report["bf16"]["lm_parameter_bytes"]


def test_off_cuda_no_graph_is_captured(report: dict[str, Any]) -> None:
    graphs = report["bf16"]["ticks"][0]["cuda_graphs"]
    assert {"lm.graphed_main", "lm.graphed_depth", "mimi.graphed_encoder", "mimi.graphed_decoder"} <= set(
        graphs["graphs"]
    )
    assert all(
        g["disabled"] and not g["captured"] and g["eager_calls"] > 0 for g in graphs["graphs"].values()
    )
    assert graphs["summary"]["all_replayed"] is False and graphs["summary"]["captured"] == []


def test_memory_per_slot_matches_the_planner(report: dict[str, Any]) -> None:
    """The engine's streaming state per slot (tensors walked) against the planner's per-slot lines of
    state (KV caches, Mimi's streaming state, the token cache; not activations or audio buffers)."""
    from infra.capacity.gpus import get_gpu
    from infra.capacity.memory import memory_plan
    from infra.capacity.models import get_model

    plan = memory_plan(get_model("tiny"), get_gpu("l4"), "fp32", "fp32", sessions=1)
    planned = sum(line.bytes for line in plan.per_slot if "KV" in line.name or "state" in line.name)
    measured = [row["state_bytes_per_slot"] for row in report["bf16"]["ticks"]]
    for value in measured:
        assert 0.5 * planned <= value <= 2 * planned, (value, planned)


def test_the_persona_prefill_finishes(report: dict[str, Any]) -> None:
    persona = report["bf16"]["persona_prefill"]
    assert persona["finished"] is True
    assert persona["prompt_steps"] == sum(gpu_check.PERSONA_STEPS)
    assert persona["ticks_to_live"] >= 1 and persona["wall_ms"] > 0


def test_the_search_is_consistent(report: dict[str, Any]) -> None:
    search = report["bf16"]["largest_batch_within_frame"]
    rows = {r["batch"]: r["within_frame"] for r in report["bf16"]["ticks"]}
    rows.update({p["batch"]: p["within_frame"] for p in search["probes"]})
    assert search["batch"] == max((b for b, ok in rows.items() if ok), default=0)
    assert search["batch"] <= 4


def test_the_search_bisects_and_stops_at_the_budget() -> None:
    """A fake probe (fits up to 23 slots): bisection between the measured 8 (fits) and 32 (over); with a
    budget spent the search stops and says so."""
    rows = [{"batch": 1, "within_frame": True}, {"batch": 8, "within_frame": True}]
    rows.append({"batch": 32, "within_frame": False})
    asked: list[int] = []

    def probe(batch: int) -> dict[str, Any]:
        asked.append(batch)
        return {"batch": batch, "within_frame": batch <= 23}

    clock = iter(range(1000)).__next__
    found = gpu_check.search_largest(probe, rows, 64, gpu_check.Budget(1000, clock), probe_s=1)
    assert found["batch"] == 23 and found["first_over"] == 24 and found["bound"] == "frame"
    assert asked == [20, 26, 23, 24]
    spent = gpu_check.Budget(10, iter(range(0, 1000, 20)).__next__)
    found = gpu_check.search_largest(probe, rows, 64, spent, probe_s=5)
    assert found["batch"] == 8 and found["bound"] == "budget"
    assert spent.skipped and spent.skipped[0]["phase"] == "search B=20"


def test_a_short_budget_skips_phases_and_says_so(tmp_path: Path) -> None:
    """The clock runs 200 s per reading: after the bf16 phases (two readings) INT8 does not fit 330 s."""
    ticks = iter(range(0, 10**6, 200))
    args = ["--preset", "tiny", "--device", "cpu", "--out", str(tmp_path), "--batch", "1", "--ticks", "1"]
    args += ["--eager-ticks", "0", "--warmup", "0", "--max-batch", "1"]
    assert gpu_check.main(args, clock=lambda: float(next(ticks))) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["int8"] is None
    assert {s["phase"] for s in report["skipped"]} >= {"int8"}


# --- installing from carried wheels ----------------------------------------------------------------------


def _lacking(*names: str) -> Any:
    return lambda module: None if module in names else object()


def test_missing_packages_are_installed_from_the_wheels_folder(tmp_path: Path) -> None:
    (tmp_path / "moshi-0.2.13-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "bitsandbytes-0.49.2-py3-none-manylinux_2_24_x86_64.whl").write_bytes(b"")
    (tmp_path / "PyYAML-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    commands: list[list[str]] = []

    def pip(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    installed = gpu_check.ensure_packages(
        tmp_path, run=pip, find_spec=_lacking("moshi", "bitsandbytes", "yaml")
    )
    assert installed == [
        "moshi-0.2.13-py3-none-any.whl",
        "bitsandbytes-0.49.2-py3-none-manylinux_2_24_x86_64.whl",
        "PyYAML-6.0.3-cp312-cp312-manylinux_2_17_x86_64.whl",
    ]
    [command] = commands
    assert command[1:6] == ["-m", "pip", "install", "--no-index", "--no-deps"]
    assert [Path(c).name for c in command[6:]] == installed
    # Nothing lacking: pip is not run.
    assert gpu_check.ensure_packages(tmp_path, run=pip, find_spec=_lacking()) == [] and len(commands) == 1


def test_a_missing_wheel_says_how_to_carry_it(tmp_path: Path) -> None:
    def pip(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        raise AssertionError("pip must not run")

    with pytest.raises(gpu_check.SetupError, match=r"lacks moshi, sentencepiece .*make gpu-wheels"):
        gpu_check.ensure_packages(tmp_path, run=pip, find_spec=_lacking("moshi", "sentencepiece"))


def test_a_failing_pip_is_reported(tmp_path: Path) -> None:
    (tmp_path / "moshi-0.2.13-py3-none-any.whl").write_bytes(b"")

    def pip(command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: not a zip file")

    with pytest.raises(gpu_check.SetupError, match="not a zip file"):
        gpu_check.ensure_packages(tmp_path, run=pip, find_spec=_lacking("moshi"))


def test_the_requirements_are_pinned_by_the_lock() -> None:
    requirements = gpu_check.pinned_requirements()
    assert requirements[0] == f"moshi=={gpu_check.MOSHI_VERSION}"
    lock = (ROOT / "requirements.lock").read_text().splitlines()
    assert all(r in lock or r.startswith("moshi==") for r in requirements), requirements
    assert len(requirements) == len(gpu_check.NEEDED)
    makefile = (ROOT / "Makefile").read_text()
    assert f"MOSHI_VERSION ?= {gpu_check.MOSHI_VERSION}" in makefile
    assert "gpu-wheels:" in makefile and "runtime.tools.gpu_check --requirements" in makefile


def test_wheels_are_ignored_by_git() -> None:
    assert "/wheels/" in (ROOT / ".gitignore").read_text().splitlines()


# --- the graph counter -------------------------------------------------------------------------------------


def test_the_counter_tells_warm_up_capture_and_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """moshi's CUDAGraphed without CUDA: its capture is faked (a graph object set on the second call)."""

    def fake_call(self: CUDAGraphed, *args: Any) -> Any:
        if self.disable:
            return self.func(*args)
        if self._graph is None:
            if self.warmup_steps <= 0:
                self._graph = object()  # type: ignore[assignment]
            else:
                self.warmup_steps -= 1
        return self.func(*args)

    monkeypatch.setattr(CUDAGraphed, "__call__", fake_call)
    graphed, disabled = CUDAGraphed(lambda x: x + 1), CUDAGraphed(lambda x: x, disable=True)
    with GraphCounter() as counter:
        for _ in range(4):
            graphed(1)
            disabled(1)
    assert CUDAGraphed.__call__ is fake_call  # put back
    stats = {name: counter.stats[id(g)].as_dict() for name, g in (("on", graphed), ("off", disabled))}
    assert stats["on"] == {"disabled": False, "eager_calls": 1, "captures": 1, "replays": 2, "captured": True}
    assert stats["off"] == {
        "disabled": True,
        "eager_calls": 4,
        "captures": 0,
        "replays": 0,
        "captured": False,
    }
    monkeypatch.setenv("NO_CUDA_GRAPH", "1")
    with GraphCounter() as counter:
        graphed(1)
    assert counter.stats[id(graphed)].eager_calls == 1 and counter.stats[id(graphed)].replays == 0
    summary = graph_summary({"a": stats["on"], "b": stats["off"]})
    assert (
        summary["captured"] == ["a"] and summary["eager_only"] == ["b"] and summary["all_replayed"] is False
    )
