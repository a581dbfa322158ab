"""The module maps are the tree: docs/runtime.md's table names every module under ``runtime/`` once, and
docs/node.md's every module under ``infra/node/`` (issue 33: the node's folder regrouped by concept), and
every file a table names exists (issue 31: the map had missed 6 modules and named files that had moved)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "runtime.md"
MAPS = (
    pytest.param(MAP, ROOT / "runtime", id="runtime"),
    pytest.param(ROOT / "docs" / "node.md", ROOT / "infra" / "node", id="infra-node"),
)
"""Each module map (its doc's "Module map" section) and the folder its first column's paths start from."""


def _table_rows(text: str) -> list[str]:
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def named_modules(text: str) -> list[str]:
    """The module paths (relative to the map's folder) in the first column of the module map's table."""
    named = []
    for row in _table_rows(text):
        first = row.split(" | ", 1)[0]
        named.extend(re.findall(r"`([a-z_/]+\.py)`", first))
    return named


def tree_modules(root: Path = ROOT / "runtime") -> list[str]:
    """Every ``.py`` file under ``root`` but the packages' ``__init__.py``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize(("doc", "root"), MAPS)
def test_every_module_is_on_the_map_once(doc: Path, root: Path) -> None:
    named = named_modules(doc.read_text())
    missing = sorted(set(tree_modules(root)) - set(named))
    assert not missing, f"modules not in {doc.relative_to(ROOT)}'s module map: {missing}"
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"named twice in the module map: {twice}"


@pytest.mark.parametrize(("doc", "root"), MAPS)
def test_the_map_names_no_file_that_is_not_there(doc: Path, root: Path) -> None:
    stale = sorted(set(named_modules(doc.read_text())) - set(tree_modules(root)))
    assert not stale, f"{doc.relative_to(ROOT)}'s module map names files that do not exist: {stale}"


def test_the_check_sees_a_missing_and_a_stale_row() -> None:
    text = "intro\n## Module map\n\n| module | role |\n| --- | --- |\n| `config.py`, `gone.py` | x |\n"
    assert named_modules(text) == ["config.py", "gone.py"]
    assert "metrics.py" not in named_modules(text)
