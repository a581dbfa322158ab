"""Whether moshi's CUDA graphs were captured and replayed in a running :class:`BatchEngine`.

moshi 0.2.13 wraps its hot calls in ``moshi.utils.compile.CUDAGraphed`` on its own, on CUDA only: the LM's
temporal step (``graphed_main``: ``LMModel.forward_text``) and depformer loop (``graphed_depth``), and Mimi's
encoder, decoder and their transformers (``graphed_encoder``, ``graphed_decoder``, ``graphed_tr_enc``,
``graphed_tr_dec``). Each makes one eager warm-up call, captures on the next (its ``_graph`` is then set)
and replays from then on; it runs eagerly where it was built ``disable``d (not CUDA), under
``NO_CUDA_GRAPH=1`` (read at every call) or inside ``moshi.utils.compile.no_cuda_graph()``.

:func:`engine_graphs` finds them in an engine's streaming state; :class:`GraphCounter` counts, per graph,
eager calls, captures and replays while it is active (it wraps ``CUDAGraphed.__call__``), so a report
says what really ran rather than what was configured. Used by ``duplex bench`` and the GPU check
(``runtime.tools.gpu_check``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from moshi.utils import compile as moshi_compile
from moshi.utils.compile import CUDAGraphed

from runtime.engine.batch import BatchEngine


def engine_graphs(engine: BatchEngine) -> dict[str, CUDAGraphed]:
    """``{"lm.graphed_main": graph, "mimi.graphed_encoder": graph, ...}``: every ``CUDAGraphed`` held by
    the engine's ``LMGen`` and Mimi streaming states (attributes of those dataclasses; empty when the
    engine is not streaming)."""
    found: dict[str, CUDAGraphed] = {}
    for prefix, module in (("lm", engine.lm_gen), ("mimi", engine.bundle.mimi)):
        state = getattr(module, "_streaming_state", None)
        for name, value in sorted(vars(state).items()) if state is not None else []:
            if isinstance(value, CUDAGraphed):
                found[f"{prefix}.{name}"] = value
    return found


def cuda_graphs_enabled() -> bool:
    """moshi's own switch as its ``CUDAGraphed`` reads it at each call: False under ``NO_CUDA_GRAPH``
    (any value but ``0``/``no``/``n``/empty) or inside ``no_cuda_graph()``."""
    return moshi_compile._is_cuda_graph_enabled()


@dataclass
class GraphStats:
    """Calls of one ``CUDAGraphed`` while a :class:`GraphCounter` was active.

    Attributes:
        disabled: built with ``disable=True`` (moshi does so off CUDA).
        eager_calls: calls that ran the function itself (disabled, graphs switched off, or warm-up).
        captures: calls that captured a graph (normally 1, then ``captured`` stays True).
        replays: calls that replayed a captured graph.
        captured: a graph is held at the end (``_graph`` set).
    """

    disabled: bool = False
    eager_calls: int = 0
    captures: int = 0
    replays: int = 0
    captured: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class GraphCounter:
    """Count eager calls, captures and replays of every ``CUDAGraphed`` while active (a context manager).

    ``stats`` is keyed by the graph object's id; :meth:`report` names them with :func:`engine_graphs`.
    Only one counter may be active at a time.

    Raises:
        RuntimeError: entered while another counter is active.
    """

    _active: GraphCounter | None = None

    def __init__(self) -> None:
        self.stats: dict[int, GraphStats] = {}
        self._original: Any = None

    def __enter__(self) -> GraphCounter:
        if GraphCounter._active is not None:
            raise RuntimeError("a GraphCounter is already counting; nest none")
        GraphCounter._active = self
        original = CUDAGraphed.__call__
        counter = self

        def counted(graph: CUDAGraphed, *args: Any, **kwargs: Any) -> Any:
            stats = counter.stats.setdefault(id(graph), GraphStats())
            stats.disabled = graph.disable
            inside = moshi_compile.in_cuda_graph()
            graphing = not graph.disable and cuda_graphs_enabled() and not inside
            had_graph = graph._graph is not None
            result = original(graph, *args, **kwargs)
            if not graphing or (not had_graph and graph._graph is None):
                stats.eager_calls += 1
            elif had_graph:
                stats.replays += 1
            else:
                stats.captures += 1
            stats.captured = graph._graph is not None
            return result

        self._original = original
        CUDAGraphed.__call__ = counted  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        CUDAGraphed.__call__ = self._original  # type: ignore[method-assign]
        GraphCounter._active = None

    def report(self, engine: BatchEngine) -> dict[str, dict[str, Any]]:
        """``{name: GraphStats as a dict}`` for every graph of ``engine`` (zero calls where it was not
        called while counting)."""
        out = {}
        for name, graph in engine_graphs(engine).items():
            stats = self.stats.get(id(graph), GraphStats(disabled=graph.disable))
            stats.captured = graph._graph is not None
            out[name] = stats.as_dict()
        return out


def graph_summary(report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One line of a :meth:`GraphCounter.report`: ``all_replayed`` (every graph that was called captured
    and replayed at least once), the names captured, the names that ran eagerly only, and
    ``NO_CUDA_GRAPH`` as set in this process."""
    called = {n: s for n, s in report.items() if s["eager_calls"] + s["captures"] + s["replays"]}
    return {
        "all_replayed": bool(called) and all(s["replays"] > 0 for s in called.values()),
        "captured": sorted(n for n, s in report.items() if s["captured"]),
        "eager_only": sorted(n for n, s in called.items() if not s["captures"] and not s["replays"]),
        "no_cuda_graph_env": os.environ.get("NO_CUDA_GRAPH", ""),
    }
