"""The import graph of ``runtime/`` and ``infra/``: no loops, and no import that runs up the layers.

Read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ... import``, at module
level or inside a function, relative ones resolved, counted as an edge between two project modules
(``from infra.k8s import workload`` is an edge to ``infra.k8s.workload``). The layers, bottom first, are
``LAYERS``; a module belongs to the layer of the longest prefix that names it, and may import its own
part and the layers below, never a layer above nor another part of its own layer. README, "Layout".
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "infra")

LAYERS: tuple[tuple[str, ...], ...] = (
    # The batched runtime, which knows nothing of the deployment. Inside it, the engine side (the model and
    # the tick) imports nothing of the front end or the tools (docs/runtime.md).
    ("runtime.metrics", "runtime.ipc", "runtime.child_process", "runtime.gc_policy", "runtime.heap_trim"),
    # what the runtime tells the fleet it runs in (its pod's deletion cost): below the engine, which reports
    ("runtime.fleet",),
    ("runtime.engine",),
    # what the settings check without the front end: signing keys, TURN URLs and secret, the regional routes
    ("runtime.signing_keys", "runtime.turn_urls", "runtime.region_routes"),
    ("runtime.config",),
    # The front end, bottom first (docs/runtime.md, "Module map"): wire formats; who may enter and what is
    # kept; the conversation; the transports; the service (HTTP routes, server, workers, engine client).
    ("runtime.frontend.codecs",),
    ("runtime.frontend.gate", "runtime.frontend.store"),
    ("runtime.frontend.session",),
    ("runtime.frontend.transports",),
    ("runtime.frontend",),
    ("runtime.multiproc",),  # the supervisor: starts the engine process and the workers
    ("runtime.tools",),
    # The capacity planner; which Google API each resource needs; GCP naming rules; YAML text helpers.
    (
        "infra.capacity",
        "infra.deploy_timeouts",
        "infra.gcp_apis",
        "infra.images",
        "infra.names",
        "infra.yaml_text",
    ),
    # The node (docs/node.md, "Module map"): its profile, which imports nothing else of the node; the
    # renderers of its bundle and its monitoring (they use each other: one part); the local node and its
    # checks, which run the bundle; ``duplex node``'s commands.
    ("infra.node.profile",),
    ("infra.node",),
    ("infra.node.local",),
    ("infra.node.cli",),
    # One region's Kubernetes objects.
    ("infra.k8s",),
    # The stack's configuration (Pulumi config, validated).
    ("infra.stack_config",),
    # What a stack needs from the project before its first ``up`` (GPU quotas: ``duplex preflight``).
    ("infra.preflight",),
    # Pulumi components; the policy pack (a program of its own, beside them).
    ("infra.components", "infra.policy"),
    # What the topologies share.
    ("infra.program.shared", "infra.program.dns"),
    # One module per topology, independent of each other.
    ("infra.program.gce", "infra.program.onprem", "infra.program.multi_region"),
    # The program: picks the stack's topology.
    ("infra.program",),
    # Entry points: Pulumi's (``infra/__main__.py``), the whole ``duplex`` CLI, the bootstrap project.
    ("infra.__main__", "infra.cli", "infra.bootstrap"),
)
"""Parts of the code, bottom layer first: a module may import its own part and any part of a lower layer."""

_IGNORED = frozenset({"infra", "runtime"})
"""Package roots with no code of their own (``infra/__init__.py``, ``runtime/__init__.py``), in no layer."""


@dataclass(frozen=True)
class Import:
    """One import of a project module by another: ``source`` imports ``target`` at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int


def project_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``packages`` (``pkg/__init__.py`` is
    ``pkg``)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest project module that ``name`` is or lies in, or None (a third-party module)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path], root: Path = ROOT) -> list[Import]:
    """The project modules that ``module`` (in ``path``) imports, wherever the import statement stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    where = str(path.relative_to(root))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
        for name in targets:
            target = _resolve(name, modules)
            if target is not None and target != module:
                found.append(Import(module, target, where, node.lineno))
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> list[Import]:
    """Every import between two project modules."""
    modules = project_modules(root, packages)
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules, root)]


def cycles(edges: Iterable[Import]) -> list[list[str]]:
    """The import loops: strongly connected components of two modules or more (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def part_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str] | None:
    """``(layer index, part)`` of ``module``: the longest part that is the module or a package holding it;
    None when no part names it."""
    best: tuple[int, str] | None = None
    for level, parts in enumerate(layers):
        for part in parts:
            if (module == part or module.startswith(part + ".")) and (
                best is None or len(part) > len(best[1])
            ):
                best = (level, part)
    return best


def layer_violations(edges: Iterable[Import], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """One line per import that runs upward or sideways between two parts of one layer."""
    problems = []
    for edge in edges:
        source, target = part_of(edge.source, layers), part_of(edge.target, layers)
        if source is None or target is None or source[1] == target[1] or target[0] < source[0]:
            continue
        how = "up" if target[0] > source[0] else "sideways, within one layer,"
        problems.append(
            f"{edge.path}:{edge.line}: {edge.source} imports {edge.target}: {how} from {source[1]} "
            f"(layer {source[0]}) to {target[1]} (layer {target[0]}); allowed: its own part and layers "
            f"below (tests/test_import_graph.py LAYERS)"
        )
    return sorted(problems)


# --- the project -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return import_graph()


def test_no_import_loops(edges: list[Import]) -> None:
    loops = cycles(edges)
    described = []
    for loop in loops:
        members = set(loop)
        ties = sorted(
            {f"{e.path}:{e.line} {e.source} -> {e.target}" for e in edges if {e.source, e.target} <= members}
        )
        described.append(" <-> ".join(loop) + "\n  " + "\n  ".join(ties))
    assert not loops, "import loops:\n" + "\n".join(described)


def test_no_import_runs_up_the_layers(edges: list[Import]) -> None:
    problems = layer_violations(edges)
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer() -> None:
    lost = [m for m in project_modules() if m not in _IGNORED and part_of(m) is None]
    assert not lost, f"modules in no layer (add them to LAYERS in tests/test_import_graph.py): {lost}"


def test_the_graph_is_read(edges: list[Import]) -> None:
    """The reader sees imports of each kind: absolute, from-package, relative, inside a function."""
    pairs = {(e.source, e.target) for e in edges}
    assert ("infra.k8s.region", "infra.k8s.workload") in pairs
    assert ("infra.capacity.cli", "infra.capacity.plan") in pairs  # from .plan import ...
    assert ("infra.cli", "runtime.tools.cli") in pairs
    assert ("runtime.tools.cli", "runtime.frontend.server") in pairs  # inside a command


# --- the checks themselves can fail --------------------------------------------------------------------


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_loop_is_found_even_through_a_lazy_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import thing\n",
            "pkg/b.py": "def thing():\n    from pkg import c\n",
            "pkg/c.py": "from . import a\n",
            "pkg/d.py": "import pkg.a\n",
        },
    )
    assert cycles(import_graph(tmp_path, ["pkg"])) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_an_upward_or_sideways_import_is_reported(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low.py": "import json\n",
            "pkg/mid/__init__.py": "from pkg.mid import one\n",
            "pkg/mid/one.py": "from pkg.low import x\n",
            "pkg/side.py": "from pkg.low import y\n",
            "pkg/high.py": "from pkg import mid, low\n",
        },
    )
    layers = (("pkg.low",), ("pkg.mid", "pkg.side"), ("pkg.high",))
    assert layer_violations(import_graph(tmp_path, ["pkg"]), layers) == []
    _write(
        tmp_path,
        {
            "pkg/low.py": "def late():\n    from pkg.high import z\n",
            "pkg/side.py": "from pkg.mid.one import y\n",
        },
    )
    [up, sideways] = layer_violations(import_graph(tmp_path, ["pkg"]), layers)
    assert up.startswith("pkg/low.py:2: pkg.low imports pkg.high: up from pkg.low (layer 0)")
    assert sideways.startswith("pkg/side.py:1: pkg.side imports pkg.mid.one: sideways")


def test_the_engine_side_may_not_import_the_front_end() -> None:
    """The split the runtime's folders show: an engine module importing a front-end one is refused (as the
    persona's prompt limits once did, before they moved to ``runtime.engine.persona_limits``)."""
    upward = Import(
        "runtime.engine.persona", "runtime.frontend.codecs.protocol", "runtime/engine/persona.py", 1
    )
    [problem] = layer_violations([upward])
    assert "runtime.engine.persona imports runtime.frontend.codecs.protocol: up" in problem
    downward = Import("runtime.frontend.codecs.protocol", "runtime.engine.persona_limits", "x.py", 1)
    assert layer_violations([downward]) == []
