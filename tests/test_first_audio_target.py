"""A node profile's first-audio p99 target against the capacity planner (issue 24; ``NodeProfile``,
``infra.capacity.plan.first_audio_check``), and the staggered sub-batch setting of a profile.

The target is what the node's FirstAudioLatencyHigh alert compares the runtime's
``duplex_first_audio_latency_seconds`` p99 with: phase wait + the acoustic delay's tick + the tick's compute.
A target below what the GPU could reach at its peak (the tick at its roofline) is refused: the alert would
never clear. One below the planner's estimate (but reachable) is accepted with a warning that names the
estimate and its terms. Figures (personaplex-7b INT8, 5 sessions on an L40S; the arithmetic is pinned in
``tests/test_capacity_latency_pinned.py``): phase wait p99 79.2 ms + 80 ms + tick 18.25 ms at the roofline
= 177.4 ms, 36.38 ms at the planner's estimate = 195.6 ms.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.capacity.plan import first_audio_check
from infra.node.bundle.services import runtime_settings
from infra.node.profile.profiles import PROFILES, get_profile


def test_a_target_below_what_the_gpu_can_reach_is_refused_naming_the_floor() -> None:
    with pytest.raises(ValidationError) as err:
        get_profile("l40s", limits={"first_audio_p99_target_ms": 170.0})
    text = str(err.value)
    assert "limits.first_audio_p99_target_ms=170 is below what personaplex-7b at int8 on l40s" in text
    assert "at least 177.4 ms" in text and "allowed: >= 177.4 ms" in text
    assert "phase wait p99 79.2 ms" in text


def test_a_reachable_target_below_the_estimate_is_accepted_with_a_warning() -> None:
    profile = get_profile("l40s", limits={"first_audio_p99_target_ms": 180.0})
    (warning,) = profile.first_audio_warnings
    assert "195.6 ms" in warning and "FirstAudioLatencyHigh" in warning
    assert get_profile("l40s", limits={"first_audio_p99_target_ms": 196.0}).first_audio_warnings == []


def test_the_check_itself_at_its_edges() -> None:
    """At exactly the reachable figure: accepted (warned); a hair below: refused; at the estimate: clean."""
    base = first_audio_check("personaplex-7b", "l40s", "int8", 5, 1, 300.0)
    assert not base.refused and not base.warned and base.message == ""
    assert base.reachable_ms == pytest.approx(177.4, abs=0.05)
    assert base.estimate_ms == pytest.approx(195.6, abs=0.05)
    at_floor = first_audio_check("personaplex-7b", "l40s", "int8", 5, 1, base.reachable_ms)
    assert not at_floor.refused and at_floor.warned
    below = first_audio_check("personaplex-7b", "l40s", "int8", 5, 1, base.reachable_ms - 0.01)
    assert below.refused and not below.warned
    at_estimate = first_audio_check("personaplex-7b", "l40s", "int8", 5, 1, base.estimate_ms)
    assert not at_estimate.refused and not at_estimate.warned


def test_staggering_lowers_what_is_reachable_where_the_planner_allows_it() -> None:
    """A100 80 GB (bf16, 5 sessions): two groups halve the phase wait (p99 39.6 ms): the 180 ms target the
    plain tick is warned about (182.7 ms) holds at 143.1 ms, and a target only the staggered node reaches is
    accepted with it and refused without. On the L40S a 36.4 ms whole-batch step every 40 ms is over the
    32 ms budget: the profile is refused with the planner's reason, and the runtime setting is rendered only
    where it is on."""
    plain = PROFILES["a100-80gb"]
    assert plain.first_audio_warnings and "182.7 ms" in plain.first_audio_warnings[0]
    staggered = get_profile("a100-80gb", stagger_groups=2)
    assert staggered.first_audio_warnings == []
    assert get_profile("a100-80gb", stagger_groups=2, limits={"first_audio_p99_target_ms": 165.0})
    with pytest.raises(ValidationError, match="at least 170.5 ms"):
        get_profile("a100-80gb", limits={"first_audio_p99_target_ms": 165.0})
    with pytest.raises(ValidationError, match=r"40 ms sub-tick of 2 staggered groups.*at most 3 sessions"):
        get_profile("l40s", stagger_groups=2)
    with pytest.raises(ValidationError, match="stagger_groups"):
        get_profile("a100-80gb", stagger_groups=3)
    assert runtime_settings(staggered)["DUPLEX_STAGGER_GROUPS"] == "2"
    assert "DUPLEX_STAGGER_GROUPS" not in runtime_settings(plain)


def test_cpu_and_unplanned_models_are_not_judged() -> None:
    """The planner models GPUs and the 7B presets only: the local (CPU, tiny) node keeps its 160 ms floor
    check alone and has no warnings."""
    assert PROFILES["local"].first_audio_warnings == []
    assert get_profile("local", limits={"first_audio_p99_target_ms": 161.0}).first_audio_warnings == []
    with pytest.raises(ValidationError, match="greater than 160"):
        get_profile("local", limits={"first_audio_p99_target_ms": 150.0})


def test_duplex_node_profiles_and_render_print_the_warnings(tmp_path) -> None:  # noqa: ANN001
    """The operator sees the planner's expectation where profiles are listed and bundles written."""
    from typer.testing import CliRunner

    from infra.node.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["profiles"])
    assert listed.exit_code == 0, listed.output
    text = " ".join(listed.output.split())
    assert "warning: l40s: limits.first_audio_p99_target_ms=180" in text and "195.6 ms" in text
    assert "warning: t4-int8" not in text and "warning: local" not in text
    rendered = runner.invoke(app, ["render", "a100-80gb", str(tmp_path / "bundle")])
    assert rendered.exit_code == 0, rendered.output
    assert "182.7 ms" in " ".join(rendered.output.split())
