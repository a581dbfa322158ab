"""No module of the front end or of the node grows past 500 lines (issue 21): each stays one concept a
newcomer can read whole.

A file over the limit is split by concept, as ``protocol.py`` (the wire messages) and ``session_query.py``
(the ``/api/chat`` query and its limits) were; the table of modules is in docs/runtime.md. ``infra/node``
came under the check once its renderers were split (``prometheus.py`` into ``alert_rules.py``,
``alert_rule_tests.py``, ``promql.py``; ``grafana.py`` into ``grafana_panels.py`` and ``dashboard_*.py``;
``profile.py``, ``compose.py``, ``cloud_init.py`` and ``local.py`` each lost one concept to a module of its
own). Not yet under it, being over: ``runtime/engine/models.py``, ``batch.py``, ``runtime/tools/cli.py``,
``loadgen.py``, ``infra/components/onprem_node.py``, ``infra/k8s/base.py``.
``infra/stack_config`` came under it when ``keys.py`` (1044 lines) was split by concern (issue 33) into
``keys_common.py``, ``keys_gcp.py``, ``keys_node.py``, ``keys_regions.py`` and ``keys_multi_region.py``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "runtime" / "frontend"
NODE = ROOT / "infra" / "node"
STACK_CONFIG = ROOT / "infra" / "stack_config"
MAX_LINES = 500
"""Most lines (newline-terminated) of one ``runtime/frontend`` or ``infra/node`` file (issue 21)."""


def oversized(folder: Path, max_lines: int = MAX_LINES) -> list[str]:
    """``"<name>: <n> lines"`` for each ``.py`` file under ``folder`` longer than ``max_lines`` lines."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            found.append(f"{path.relative_to(folder)}: {lines} lines")
    return found


def test_no_frontend_module_over_500_lines() -> None:
    """Guards issue 21's limit: main had protocol.py (588), session_store.py (658) and tokens.py (561)."""
    assert list(FRONTEND.glob("*.py")), f"no modules found under {FRONTEND}"
    assert oversized(FRONTEND) == []


def test_no_node_module_over_500_lines() -> None:
    """The node's renderers: main had prometheus.py (755), grafana.py (652), local.py (542), cloud_init.py
    (535), profile.py (554) and compose.py (521)."""
    assert list(NODE.glob("*.py")), f"no modules found under {NODE}"
    assert oversized(NODE) == []


def test_no_stack_config_module_over_500_lines() -> None:
    """The stack's configuration keys: main had keys.py (1044 lines), one module for every topology's keys."""
    assert list(STACK_CONFIG.glob("*.py")), f"no modules found under {STACK_CONFIG}"
    assert oversized(STACK_CONFIG) == []


def test_oversized_names_each_long_file(tmp_path: Path) -> None:
    """The check itself: a 501-line file is reported with its length, a 500-line one is not."""
    (tmp_path / "long.py").write_text("x = 1\n" * 501, encoding="utf-8")
    (tmp_path / "fine.py").write_text("x = 1\n" * 500, encoding="utf-8")
    assert oversized(tmp_path) == ["long.py: 501 lines"]
