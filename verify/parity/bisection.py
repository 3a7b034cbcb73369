"""Differential bisection: name the first pass whose graphs compute other values.

The engine of ``python -m verify bisect`` (its command line: :mod:`verify.commands.bisect`) and
of the explanation ``check_model`` and the report print under a stage that is not bitwise
(:func:`explain_not_bitwise`). It lives with the other runs of graphs for real
(:mod:`verify.parity.differential`), below ``verify.check`` and ``verify.commands``, which both
read it. See the command's docstring for the two questions it answers.
"""


from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from autoparallel import pipeline as P
from autoparallel.mesh import MeshSpec, ParallelMesh
from verify.parity import differential as D
from verify.parity.compare import ParityReport
from verify.stages.registry import WITHOUT_GRAPH_INPUT

Graphs = fx.GraphModule | tuple[fx.GraphModule, fx.GraphModule]
StagePair = tuple[str, Graphs, Graphs]  # (stage name, what it compares first, what second)

ONE_RUN = "pass input vs output"
TWO_RUNS = "configuration A vs B"


@dataclass
class BisectResult:
    """Every stage compared, in order; ``first``: the first that differs (None: none does)."""

    mode: str
    a: str
    b: str
    checks: list[D.PassCheck] = field(default_factory=list)
    ranks: int = 0

    @property
    def first(self) -> D.PassCheck | None:
        return next((c for c in self.checks if not c.equal), None)

    def summary(self) -> str:
        lines = [f"bisect ({self.mode}: {self.a} vs {self.b}), {self.ranks} simulated ranks:"]
        lines += ["  " + c.summary().replace("\n", "\n  ") for c in self.checks]
        first = self.first
        if first is None:
            lines.append("no stage changes values" if self.mode == ONE_RUN else "A and B compute the same values at every stage")
        else:
            lines.append(f"first stage that differs: {first.name}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        def check(c: D.PassCheck) -> dict[str, Any]:
            out = c.first_output()
            return {
                "stage": c.name,
                "equal": c.equal,
                "tensors": len(c.report.diffs),
                "differing": len(c.report.mismatches()),
                "note": c.note,
                "same_code": c.same_code,
                "first_output": None if out is None else {"name": out.name, "note": out.note},
                "first_node": None if c.first_node is None else vars(c.first_node),
            }

        first = self.first
        return {"mode": self.mode, "a": self.a, "b": self.b, "ranks": self.ranks,
                "first": None if first is None else first.name, "stages": [check(c) for c in self.checks]}


def _graphs(g: Graphs) -> list[fx.GraphModule]:
    return list(g) if isinstance(g, tuple) else [g]


def same_code(a: Graphs, b: Graphs) -> bool:
    """Whether two programs are the same code (so equal by construction): same shape, the same
    generated Python for every graph, and no attribute (constant) they could differ in."""
    ga, gb = _graphs(a), _graphs(b)
    if len(ga) != len(gb):
        return False
    for x, y in zip(ga, gb, strict=True):
        if x.graph.find_nodes(op="get_attr") or y.graph.find_nodes(op="get_attr"):
            return False
        if x.code != y.code or D.output_keys(x) != D.output_keys(y):
            return False
        if [D.input_key(p) for p in x.graph.find_nodes(op="placeholder")] != [
            D.input_key(p) for p in y.graph.find_nodes(op="placeholder")
        ]:
            return False
    return True


def bisect_steps(steps: Iterable[StagePair], mesh: MeshSpec | str, *, mode: str = ONE_RUN, a: str = "before",
                 b: str = "after", seed: int = 0, progress: Callable[[str], None] = lambda msg: None,
                 given: Mapping[str, tuple] | None = None, world: ParallelMesh | None = None,
                 draw_seed: int | None = None) -> BisectResult:
    """Compare each step's two programs on N = mesh size simulated ranks, in order. ``given``:
    per input key (``input:0``, ``param:<fqn>``), one tensor per rank; other inputs random.
    ``world``: a running world's mesh whose groups the graphs name (in a rank of a gloo world);
    ``draw_seed``: every simulated rank draws from its own generator seeded so (``Feeds.draw_seed``)."""
    spec = MeshSpec.parse(mesh)
    result = BisectResult(mode, a, b, ranks=spec.world_size)
    with D.simulated_world(spec, world) as world:
        feeds = D.Feeds(spec.world_size, seed, given=dict(given or {}), draw_seed=draw_seed)
        cache: dict = {}
        for name, before, after in steps:
            t0 = time.perf_counter()
            if same_code(before, after):
                check = D.PassCheck(name, a, b, ParityReport(a, b), same_code=True)
            else:
                check = D.compare_programs(name, D.bind(before, world), D.bind(after, world), feeds, a_name=a,
                                           b_name=b, cache=cache)
            result.checks.append(check)
            verdict = "equal" if check.equal else "DIFFER"
            progress(f"{name}: {verdict} ({time.perf_counter() - t0:.1f}s)")
    return result


def run_steps(run: P.PipelineRun) -> list[StagePair]:
    """Each stage that has an input stage: (name, its input's graphs, its graphs)."""
    return [(r.name, run.stage(r.input).graphs, r.graphs) for r in run.results if r.input is not None and r.graphs is not None]


def bisect_run(run: P.PipelineRun, mesh: MeshSpec | str, *, seed: int = 0,
               progress: Callable[[str], None] = lambda msg: None) -> BisectResult:
    """One configuration: each pass's output against its input."""
    return bisect_steps(run_steps(run), mesh, seed=seed, progress=progress)


def bisect_runs(run_a: P.PipelineRun, run_b: P.PipelineRun, mesh: MeshSpec | str, *, a: str = "A", b: str = "B",
                seed: int = 0, progress: Callable[[str], None] = lambda msg: None) -> BisectResult:
    """Two configurations: stage by stage, A's graphs against B's (stages both ran, in B's order)."""
    in_a = {r.name: r for r in run_a.results if r.graphs is not None}
    missing = [r.name for r in run_b.results if r.graphs is not None and r.name not in in_a]
    if missing:
        progress(f"stages only B ran (not compared): {missing}")
    steps = [(r.name, in_a[r.name].graphs, r.graphs) for r in run_b.results if r.graphs is not None and r.name in in_a]
    return bisect_steps(steps, mesh, mode=TWO_RUNS, a=a, b=b, seed=seed, progress=progress)


# --- explaining a parity verdict ------------------------------------------------------------------


def explain_not_bitwise(run: P.PipelineRun, mesh: MeshSpec | str, stages: Iterable[str], *, seed: int = 0,
                        as_traced: dict[str, ParityReport] | None = None, compiling_queries: tuple[str, ...] = (),
                        given: Mapping[str, tuple] | None = None,
                        world: ParallelMesh | None = None, draw_seed: int | None = None) -> tuple[dict[str, str], BisectResult | None]:
    """Why each of ``stages`` (parity verdicts: the joint graph, a pass's stage, ``collective_passes``)
    is not bitwise with the eager parallel program, one line each, and the differential run.

    A stage bitwise with the eager program run as traced (``as_traced``: ``torch.compiler.is_compiling()``
    true) differs because the model branches on that flag (``compiling_queries`` names where): another
    program, not a pass. Otherwise every pass up to the stage runs against its input on the mesh's
    ranks, simulated (:func:`bisect_run`); the first that computes other values is named with its first
    differing node (op, module path, size of the difference) and output. No pass differing: the
    difference is in the trace (eager program -> joint graph), which no graph-vs-graph run can see.
    ``given``: the ranks' inputs by key (token ids and masks whose range no use tells; a graph
    traced per rank: the real parameter shards too, :mod:`verify.parity.rank_explain`); ``world``:
    ``draw_seed``: see :func:`bisect_steps`. A differential run that cannot run says why in each line instead of
    failing the check."""
    as_traced = as_traced or {}
    out: dict[str, str] = {}
    for stage in stages:
        rep = as_traced.get(stage)
        if rep is not None and rep.bitwise:
            sites = ", ".join(compiling_queries[:3]) + (f" and {len(compiling_queries) - 3} more" if len(compiling_queries) > 3 else "")
            out[stage] = ("bitwise with the eager program run as traced (torch.compiler.is_compiling() true, patch "
                          f"trace_as_compiling): the model branches on that flag ({sites}), so the trace recorded the "
                          "compiled branch and the eager program ran the other; another program, not a pass")
    rest = [s for s in stages if s not in out]
    if not rest:
        return out, None
    # the passes only: under plan="auto" the joint stage's input is the plan stage's unsharded trace
    try:
        result = bisect_steps([step for step in run_steps(run) if step[0] not in WITHOUT_GRAPH_INPUT], mesh, seed=seed,
                              given=given, world=world, draw_seed=draw_seed)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        out.update({s: f"differential execution could not run: {type(e).__name__}: {e}" for s in rest})
        return out, None
    order = [c.name for c in result.checks]
    for stage in rest:
        upto = order[: order.index(stage) + 1] if stage in order else order if stage not in WITHOUT_GRAPH_INPUT else []
        first = next((c for c in result.checks if c.name in upto and not c.equal), None)
        if first is not None:
            node = first.first_node.describe() if first.first_node is not None else "none located"
            bad = first.first_output()
            out[stage] = (f"differential execution ({result.ranks} simulated ranks): pass {first.name} computes other "
                          f"values than its input; first differing node: {node}; first differing output: "
                          f"{bad.name}: {bad.note}")
            continue
        traced = as_traced.get(stage)
        tail = "" if traced is None else f" (and not bitwise with the eager program run as traced either: {traced.summary(limit=0).splitlines()[0]})"
        passes = f"every pass up to {stage} computes what its input computes ({result.ranks} simulated ranks), so " if upto else ""
        out[stage] = f"{passes}the difference is in the trace (eager program -> joint graph){tail}"
    return out, result


__all__ = [
    "BisectResult",
    "ONE_RUN",
    "TWO_RUNS",
    "bisect_run",
    "bisect_runs",
    "bisect_steps",
    "explain_not_bitwise",
    "run_steps",
    "same_code",
]
