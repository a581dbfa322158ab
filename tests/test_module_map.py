"""docs/runtime.md's module map is the tree: every module under ``runtime/`` is named in its table once, and
every file the table names exists (issue 31: the map had missed 6 modules and named files that had moved)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "runtime.md"


def _table_rows(text: str) -> list[str]:
    section = text.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def named_modules(text: str) -> list[str]:
    """The module paths (relative to ``runtime/``) in the first column of the module map's table."""
    named = []
    for row in _table_rows(text):
        first = row.split(" | ", 1)[0]
        named.extend(re.findall(r"`([a-z_/]+\.py)`", first))
    return named


def tree_modules(root: Path = ROOT / "runtime") -> list[str]:
    """Every ``.py`` file under ``runtime/`` but the packages' ``__init__.py``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py")


def test_every_module_is_on_the_map_once() -> None:
    named = named_modules(MAP.read_text())
    missing = sorted(set(tree_modules()) - set(named))
    assert not missing, f"modules not in docs/runtime.md's module map: {missing}"
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"named twice in the module map: {twice}"


def test_the_map_names_no_file_that_is_not_there() -> None:
    stale = sorted(set(named_modules(MAP.read_text())) - set(tree_modules()))
    assert not stale, f"docs/runtime.md's module map names files that do not exist: {stale}"


def test_the_check_sees_a_missing_and_a_stale_row() -> None:
    text = "intro\n## Module map\n\n| module | role |\n| --- | --- |\n| `config.py`, `gone.py` | x |\n"
    assert named_modules(text) == ["config.py", "gone.py"]
    assert "metrics.py" not in named_modules(text)
