"""Tests that kill mutants of infra/capacity/memory.py that the capacity tests let survive
(``make mutation MODULE=infra/capacity/memory.py``; docs/mutation.md). Each docstring names its mutants."""

from __future__ import annotations

import dataclasses

from infra.capacity.memory import activation_bytes_per_slot
from infra.capacity.models import get_model

DEFAULTED = ("hidden_scale", "depformer_dim", "depformer_dim_feedforward")


def with_lm(name: str, **lm: object):
    """Preset ``name`` with its LM config changed (a key set to None is removed)."""
    model = get_model(name)
    merged = {**model.lm, **lm}
    return dataclasses.replace(model, lm={k: v for k, v in merged.items() if v is not None})


def test_a_config_without_widths_takes_moshis_defaults():
    """Kills ``activation_bytes_per_slot``: the defaults ``hidden_scale`` 4 (-> None, left out, 5),
    ``depformer_dim`` 256 (-> None, left out, 257), and the feed-forward width's fallback
    ``lm.get("depformer_dim_feedforward") or int(hidden_scale * d)`` (``get(None)``, the key's name changed,
    ``int(None)``, ``/ d``, ``get(None, 4)``, ``get("hidden_scale", None)``, ``get(4)``): every preset sets
    these keys, so only a config without them reaches the defaults."""
    bare = with_lm("tiny", **dict.fromkeys(DEFAULTED))
    explicit = with_lm("tiny", hidden_scale=4, depformer_dim=256, depformer_dim_feedforward=4 * 256)
    assert activation_bytes_per_slot(bare, 2) == activation_bytes_per_slot(explicit, 2)


def test_the_configured_depformer_feedforward_width_counts():
    """Kills ``activation_bytes_per_slot``: ``depformer_dim_feedforward or ...`` -> ``and`` (the configured
    width would be replaced by ``hidden_scale x depformer_dim``)."""
    narrow = with_lm("tiny", depformer_dim_feedforward=128)
    wide = with_lm("tiny", depformer_dim_feedforward=1024)
    assert activation_bytes_per_slot(wide, 2) > activation_bytes_per_slot(narrow, 2)
