"""The session store's Redis key layout lives in one module, ``runtime.frontend.store.keys`` (issue 31): no
other module of ``runtime/`` builds one of its keys, whether as an f-string (``f"{prefix}:session:{id}"``) or
a literal (``"duplex:events"``). Read from the source with ``ast``: docstrings and comments may name keys."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from runtime.frontend.store import keys

ROOT = Path(__file__).resolve().parents[1]
KEYS_MODULE = ROOT / "runtime" / "frontend" / "store" / "keys.py"
FRAGMENT = re.compile(r":(session|transcript|lines|events|sessions|node|writer)\b")
LITERAL = re.compile(r"^duplex:(session|transcript|lines|events|sessions|node)\b")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
        # attribute docstrings: a string expression statement after an assignment
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            found.add(id(node.value))
    return found


def _key_builders(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = [p.value for p in node.values if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            if any(FRAGMENT.match(part) for part in parts):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found.extend(f"{name}:{node.lineno}: {node.value!r}" for _ in LITERAL.findall(node.value)[:1])
    return found


def test_no_module_but_keys_builds_a_store_key() -> None:
    offenders = [
        hit
        for path in sorted((ROOT / "runtime").rglob("*.py"))
        if path != KEYS_MODULE
        for hit in _key_builders(path)
    ]
    assert offenders == [], "build store keys with runtime.frontend.store.keys:\n" + "\n".join(offenders)


def test_the_scan_sees_a_key_built_elsewhere(tmp_path: Path) -> None:
    """The check itself: both shapes are caught, docstrings are not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        'def f(p, i):\n    """``{p}:session:{i}``"""\n    return f"{p}:session:{i}", "duplex:events"\n'
    )
    assert len(_key_builders(probe)) == 2


def test_the_keys() -> None:
    sid = "ab" * 16
    assert keys.session_key("duplex", sid) == f"duplex:session:{sid}"
    assert keys.session_events_key("p", sid) == f"p:events:{sid}"
    assert keys.state_index_key("p", "active") == "p:sessions:active"
    assert (
        keys.writer_key("p", "n", "w1") == "p:node:n:writer:w1"
        and keys.writer_key("p", "n") == "p:node:n:writer"
    )
    try:
        keys.state_index_key("p", "gone")
    except ValueError as exc:
        assert "'gone'" in str(exc) and "active, ended" in str(exc)
    else:
        raise AssertionError("an unknown state was accepted")
