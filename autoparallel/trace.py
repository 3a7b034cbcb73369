"""Every pipeline stage in PyTorch's structured trace (``TORCH_TRACE=dir`` + ``tlparse``).

:class:`StageTracer` is a pipeline observer (``run_pipeline`` attaches one per run): as each
stage ends it emits, through ``torch._logging.trace_structured``, artifacts named

    autoparallel_<position>_<stage>_<what>

``<position>`` is the stage's place in the run (``00``, ``01``, ...); a collective pass run
alone on the second compile's graphs (``options.alternatives``) branches off that stage and gets
its number plus a letter (``04a``, ``04b``, ...), so the names sort in pipeline order in tlparse's
index and on disk. ``<what>``:

* ``stage`` (JSON): label, input stage, seconds, node counts, the report's one-line summary;
* ``graph`` / ``forward_graph`` / ``backward_graph`` (text): the graph(s) the stage produced,
  as ``graph_text`` renders them (default: FX's readable code; ``verify`` passes its canonical text);
* ``stats`` (JSON): ``graph_stats(graphs)`` when given (``verify`` passes its stats table's data);
* ``report`` (JSON): the stage's report (a pass report, bucketing metrics, a planner's plan),
  whatever its type: ``to_json()`` / ``to_dict()``, dataclass fields, containers; FX nodes by
  name, graphs by size.

Payloads are built only when a trace handler listens (``trace_structured`` checks first), so a run
without ``TORCH_TRACE`` pays nothing for them. The records carry no compile id: tlparse lists them
under the top-level ``[-/-]`` entry, beside Inductor's own artifacts of the same passes.

Our log records go to loggers named after their modules (``autoparallel.pipeline`` ...), so
``TORCH_LOGS=autoparallel`` (INFO) or ``TORCH_LOGS=+autoparallel`` (DEBUG) shows them: torch
accepts any importable module name there.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx
from torch._logging import trace_structured

__all__ = ["ARTIFACT_PREFIX", "StageTracer", "artifact_name", "jsonable", "readable_graph", "structured_trace_listens"]

log = logging.getLogger(__name__)

ARTIFACT_PREFIX = "autoparallel"
_SLUG = re.compile(r"[^0-9A-Za-z]+")

GraphText = Callable[[fx.GraphModule], str]
GraphStats = Callable[[Any], Mapping[str, Any]]  # a GraphModule or an (fw, bw) pair -> JSON data


def structured_trace_listens() -> bool:
    """Whether ``trace_structured`` would write anywhere (what a structured-trace artifact costing
    real work is built for). PyTorch installs a lazy handler without a directory in every process;
    outside Meta's cluster it disables itself on its first record and writes nothing, so it does
    not count as a listener."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(not isinstance(h, LazyTraceHandler) or h.root_dir is not None for h in trace_log.handlers)


def artifact_name(position: str, label: str, what: str) -> str:
    """``autoparallel_<position>_<label as an identifier>_<what>``."""
    slug = _SLUG.sub("_", label).strip("_")
    return f"{ARTIFACT_PREFIX}_{position}_{slug}_{what}"


def readable_graph(gm: fx.GraphModule) -> str:
    """FX's Python code of ``gm`` (the default graph text when no canonical form is given)."""
    return gm.print_readable(print_output=False)


def jsonable(obj: Any, *, depth: int = 0) -> Any:
    """``obj`` as JSON data, whatever a stage reports: ``to_json()`` / ``to_dict()`` when it has
    one, dataclass fields (private ones left out), containers element-wise, FX nodes by name,
    graphs by their size, anything else by ``str``."""
    if depth > 32:
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, enum.Enum):
        return obj.name
    if isinstance(obj, fx.Node):
        return obj.name
    if isinstance(obj, fx.GraphModule):
        return {"graph_nodes": len(obj.graph.nodes)}
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    for method in ("to_json", "to_dict"):
        fn = getattr(obj, method, None)
        if callable(fn) and not isinstance(obj, type):
            return jsonable(fn(), depth=depth + 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: jsonable(getattr(obj, f.name), depth=depth + 1)
            for f in dataclasses.fields(obj)
            if not f.name.startswith("_")
        }
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v, depth=depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [jsonable(v, depth=depth + 1) for v in items]
    return str(obj)


def _guarded(name: str, payload: Callable[[], Any]) -> Any:
    """The payload, or the error that made it (logged): a trace must not end the run it records."""
    try:
        return payload()
    except Exception as e:
        log.warning("structured trace: artifact %s failed: %s: %s", name, type(e).__name__, e)
        return f"(artifact {name} failed: {type(e).__name__}: {e})"


def _summary(report: Any) -> str | None:
    fn = getattr(report, "summary", None)
    if not callable(fn):
        return None
    try:
        return str(fn())
    except Exception as e:  # a report whose summary fails must not end the run it describes
        return f"(summary failed: {type(e).__name__}: {e})"


class StageTracer:
    """A pipeline observer that puts each stage into the structured trace (see the module
    docstring). One instance per run: it numbers the stages it sees."""

    def __init__(self, graph_text: GraphText = readable_graph, graph_stats: GraphStats | None = None):
        self.graph_text = graph_text
        self.graph_stats = graph_stats
        self._stage = -1
        self._alone = 0

    def position(self, result) -> str:
        """The next position: ``NN`` for a stage, ``NN<letter>`` for an alternative after stage NN."""
        if not result.alternative:
            self._stage += 1
            self._alone = 0
            return f"{self._stage:02d}"
        letters = string.ascii_lowercase
        n, self._alone = self._alone, self._alone + 1
        suffix = letters[n] if n < len(letters) else f"z{n}"
        return f"{max(self._stage, 0):02d}{suffix}"

    def __call__(self, result) -> None:
        pos = self.position(result)
        label = result.label
        graphs = result.graph_rows()  # (row label, graph): "<label>" or "<label> fwd" / "<label> bwd"
        named = _graph_names(graphs, label)

        def emit(what: str, encoding: str, payload: Callable[[], Any]) -> None:
            name = artifact_name(pos, label, what)
            trace_structured(
                "artifact",
                metadata_fn=lambda: {"name": name, "encoding": encoding},
                payload_fn=lambda: _guarded(name, payload),
                expect_trace_id=False,  # no compile is current between stages
            )

        def stage_json() -> str:
            return json.dumps({
                "stage": result.name,
                "label": label,
                "position": pos,
                "input": result.input,
                "alternative": result.alternative,
                "seconds": round(result.seconds, 6),
                "nodes": {what: len(gm.graph.nodes) for what, gm in named},
                "report": type(result.report).__name__ if result.report is not None else None,
                "summary": _summary(result.report),
            }, indent=1)

        emit("stage", "json", stage_json)
        for what, gm in named:
            emit(what, "string", lambda gm=gm: self.graph_text(gm))
        if self.graph_stats is not None and result.graphs is not None:
            emit("stats", "json", lambda: json.dumps(jsonable(self.graph_stats(result.graphs)), indent=1))
        if result.report is not None:
            emit("report", "json", lambda: json.dumps(jsonable(result.report), indent=1))


def _graph_names(rows: list[tuple[str, fx.GraphModule]], label: str) -> list[tuple[str, fx.GraphModule]]:
    suffixes = {f"{label} fwd": "forward_graph", f"{label} bwd": "backward_graph", label: "graph"}
    return [(suffixes.get(row, "graph"), gm) for row, gm in rows]
