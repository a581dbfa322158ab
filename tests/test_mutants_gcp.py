"""Tests that kill mutants of infra/capacity/gcp.py (the catalog behind the stack configuration's GCP rules)
that the capacity and stack configuration tests let survive (``make mutation MODULE=infra/capacity/gcp.py``;
docs/mutation.md). Each docstring names its mutants.

``MACHINE_TYPES`` is built when the module is imported, before mutmut switches a mutant on, so
``MachineType.__post_init__`` and ``default_sold_as`` are only reached by building a type here."""

from __future__ import annotations

import pytest

from infra.capacity.gcp import (
    MACHINE_TYPES,
    MachineType,
    default_sold_as,
    provisioning_problem,
)


def test_flex_start_is_sold_for_accelerator_optimized_families_only():
    """Kills ``default_sold_as``: the condition ``and False`` / ``or True`` / ``not in``, and every changed
    model name."""
    assert default_sold_as("A3") == ("standard", "spot", "flex-start")
    assert default_sold_as("G2") == ("standard", "spot", "flex-start")
    assert default_sold_as("N1") == ("standard", "spot")


def test_a_type_without_sold_as_takes_its_familys_default():
    """Kills ``MachineType.__post_init__``: ``not self.sold_as`` -> ``self.sold_as``, and each changed
    argument of ``object.__setattr__(self, "sold_as", default_sold_as(self.family))``."""
    plain = MachineType("x-standard-8", "G2", 8, 32.0, "l4", (1,), True, None)
    assert plain.sold_as == ("standard", "spot", "flex-start")
    given = MachineType("y-standard-8", "G2", 8, 32.0, "l4", (1,), True, None, sold_as=("spot",))
    assert given.sold_as == ("spot",)


def test_provisioning_problem_texts():
    """Kills ``provisioning_problem``: ``check_choice("provisioning_model", ...)`` with the name -> ``None``
    or changed, and ``' or '.join(mt.sold_as)`` -> ``join(None)``, ``'XX or XX'`` and ``' OR '``."""
    with pytest.raises(ValueError) as info:
        provisioning_problem("g2-standard-8", "reserved")
    assert str(info.value).startswith("provisioning_model: unknown value 'reserved'")
    spot_only = next(m for m in MACHINE_TYPES.values() if len(m.sold_as) >= 2 and "standard" not in m.sold_as)
    assert provisioning_problem(spot_only.name, "standard") == (
        f"{spot_only.name} is sold only as {' or '.join(spot_only.sold_as)}, not standard"
    )
