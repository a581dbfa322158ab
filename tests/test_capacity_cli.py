"""The ``capacity`` command: exit codes, JSON shape, tables and the Scale-5 report."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infra.capacity.cli import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_feasible_exits_zero_and_prints_tables():
    r = _run("--model", "personaplex-7b", "--gpu", "l40s", "--precision", "int8", "--sessions", "5")
    assert r.exit_code == 0, r.output
    for title in ("GPU memory", "Tick", "First audio", "Network", "Power", "FEASIBLE"):
        assert title in r.output


def test_infeasible_exits_one():
    r = _run("--model", "personaplex-7b", "--gpu", "t4", "--precision", "fp16", "--sessions", "4")
    assert r.exit_code == 1
    assert "INFEASIBLE" in r.output and "out of memory by" in r.output


def test_machine_type_refusal_exits_one():
    r = _run(
        "--model", "moshi-7b", "--gpu", "a100-40gb", "--precision", "bf16", "--machine-type", "n1-standard-8"
    )
    assert r.exit_code == 1
    assert "machine_type_cannot_carry_gpu" in r.output


def test_json_shape():
    r = _run(
        "--model",
        "moshi-7b",
        "--gpu",
        "h100",
        "--precision",
        "int8",
        "--sessions",
        "5",
        "--nodes",
        "2",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d) == {"config", "model", "memory", "tick", "latency", "network", "power", "verdict"}
    assert (
        d["config"]["sessions"] == 5 and d["config"]["nodes"] == 2 and d["config"]["kv_precision"] == "fp16"
    )
    assert d["verdict"]["feasible"] is True and d["verdict"]["problems"] == []
    assert isinstance(d["memory"]["required_bytes"], int)
    assert {r["name"] for r in d["memory"]["per_slot"]} >= {
        "KV cache, temporal transformer",
        "Mimi streaming state",
    }
    assert d["tick"]["budget_ms"] == 64.0
    assert d["power"]["machine_type"] == "a3-highgpu-1g"


def test_json_infeasible_lists_reasons():
    r = _run("--model", "tiny", "--gpu", "t4", "--precision", "bf16", "--json")
    assert r.exit_code == 1
    d = json.loads(r.output)
    assert {p["reason"] for p in d["verdict"]["problems"]} == {"precision_unsupported"}


def test_cfg_and_kv_precision_flags():
    r = _run(
        "--model", "moshi-7b", "--gpu", "h100", "--kv-precision", "fp8", "--cfg", "--margin", "0.1", "--json"
    )
    d = json.loads(r.output)
    assert (
        d["config"]["cfg"] is True and d["config"]["kv_precision"] == "fp8" and d["tick"]["budget_ms"] == 72.0
    )


def test_bad_input_exits_two_naming_field_and_values():
    r = _run("--model", "llama", "--gpu", "l4")
    assert r.exit_code == 2
    assert "model" in r.output and "personaplex-7b" in r.output
    r = _run("--model", "tiny", "--gpu", "rtx4090")
    assert r.exit_code == 2 and "gpu" in r.output and "l40s" in r.output
    r = _run("--model", "tiny", "--gpu", "l4", "--precision", "int2")
    assert r.exit_code == 2 and "precision" in r.output
    r = _run("--model", "tiny", "--gpu", "l4", "--sessions", "0")
    assert r.exit_code == 2 and "sessions" in r.output
    r = _run("--gpu", "l4")
    assert r.exit_code == 2 and "model" in r.output


def test_compare_scale5_report():
    r = _run("--compare-scale5")
    assert r.exit_code == 0, r.output
    assert "DIFFERS" in r.output and "Scale-5" in r.output
    r = _run("--compare-scale5", "--model", "moshi-7b", "--json")
    d = json.loads(r.output)
    assert d["model"] == "moshi-7b"
    assert any(not row["agrees"] and row["reason"] for row in d["rows"])
    assert {"topic", "item", "gpu", "theirs", "ours", "agrees", "reason"} <= set(d["rows"][0])


def test_first_audio_p99_is_printed_and_staggering_is_an_option():
    """Issue 24: the latency table has a p99 column and a caption with the caller's p99 and the runtime's
    own (tests/test_capacity_latency_pinned.py works the figures); ``--stagger-groups 2`` halves the phase
    wait and is refused where the sub-tick does not fit; a bad count exits 2 naming the allowed values."""
    r = _run("--model", "personaplex-7b", "--gpu", "a100-80gb-pcie", "--precision", "int8", "--sessions", "5")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "first audio p99: 328 ms for the caller (every term), 178 ms as the runtime measures it" in text
    r = _run(
        "--model", "personaplex-7b", "--gpu", "a100-80gb-pcie", "--precision", "int8", "--sessions", "5",
        "--stagger-groups", "2", "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    latency = json.loads(r.output)["latency"]
    assert round(latency["runtime_p99_ms"], 1) == 138.6 and latency["stagger_groups"] == 2
    r = _run("--model", "personaplex-7b", "--gpu", "l40s", "--precision", "int8", "--sessions", "5",
             "--stagger-groups", "2")  # fmt: skip
    assert r.exit_code == 1 and "staggered groups" in " ".join(r.output.split())
    r = _run("--model", "moshi-7b", "--gpu", "l40s", "--stagger-groups", "3")
    assert r.exit_code == 2 and "stagger_groups: must be one of 1, 2, got 3" in r.output


def test_personaplex_is_planned_as_served_and_says_what_the_checkpoint_stores():
    """PersonaPlex's checkpoint stores 16 depformer steps; the runtime loads the agent's 8
    (``served_lm_kwargs``), and the planner plans those, saying so; moshi-7b stores what it serves."""
    r = _run("--model", "personaplex-7b", "--gpu", "a100-80gb-sxm", "--precision", "bf16", "--json")
    assert r.exit_code == 0, r.output
    model = json.loads(r.output)["model"]
    assert model["dep_q"] == 8
    assert (model["lm_params"], model["stored_lm_params"]) == (7_687_729_152, 8_371_408_896)
    text = " ".join(
        _run("--model", "personaplex-7b", "--gpu", "a100-80gb-sxm", "--precision", "bf16").output.split()
    )
    assert "the checkpoint stores 8,371,408,896 LM parameters" in text
    assert "checkpoint stores" not in " ".join(
        _run("--model", "moshi-7b", "--gpu", "a100-80gb-sxm").output.split()
    )
