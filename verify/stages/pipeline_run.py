"""A scenario through ``autoparallel.pipeline``: what goldens, stats and the report show.

One function runs it so that the golden tests and ``python -m verify report`` can never describe
different pipelines; the stage list, the order and the second compile belong to
``autoparallel.pipeline``. Runs here keep a copy of every stage's graphs and also run each
collective pass alone on the second compile's graphs (``alternatives``: what one pass does by
itself, which the composed sequence hides once an earlier pass has changed the graph).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from autoparallel import pipeline as P
from autoparallel.defaults import BUCKET_CAP_MB, DEFAULT_LOWERING
from autoparallel.passes.collective import CollectivePassesConfig
from autoparallel.passes.pre_overlap_bucketing import PreOverlapConfig
from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from autoparallel.trace import StageTracer
from autoparallel.validate import DataDependentError
from verify.graphs.canon import canonicalize
from verify.graphs.stats import graph_stats, partition_stats
from verify.stages.scenario import Scenario

DEFAULT_BUCKET_CAP_MB = BUCKET_CAP_MB
T = TypeVar("T")


def pipeline_options(bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, topo_span=None, **kw) -> P.PipelineOptions:
    """Every collective pass on (overlap scheduling included), pre-overlap buckets of
    ``bucket_cap_mb``, topo-span bucketing with ``topo_span`` (a TopoSpanConfig; default its
    defaults), alternatives on; ``kw`` overrides other ``PipelineOptions`` fields."""
    collective = CollectivePassesConfig(
        pre_overlap=PreOverlapConfig(bucket_cap_mb=bucket_cap_mb),
        topo_span=topo_span if topo_span is not None else TopoSpanConfig(),
        schedule_overlap=True,
    )
    # reads_per_rank: a parity world traces a graph per rank where a model's reads differ (verify.parity.retrace)
    return P.PipelineOptions(**{"collective": collective, "alternatives": True, "reads_per_rank": True, **kw})


def params_summary(run: P.PipelineRun) -> dict:
    """How many parameters the plan resolved, and how many of them FSDP shards (plan="auto": how
    many the plan shards over some mesh dim); ``without_grad``: those whose gradient is None, each
    ``frozen`` (requires_grad=False) or ``unreached`` (the loss does not reach it);
    ``specialised_reads`` (when there are any): the values the model reads into Python, held as
    traced and guarded."""
    if run.planned is not None:
        params = run.planned.solution.params
        out = {"count": len(params), "fsdp_sharded": sum(1 for p in params.values() if any(v != "R" for v in p.values()))}
    else:
        shardings = run.joint.shardings
        out = {"count": len(shardings), "fsdp_sharded": sum(1 for s in shardings.values() if s.fsdp_dim is not None)}
    reads = list(run.joint.specialised_reads) if run.joint is not None else []
    return {**out, "without_grad": params_without_grad(run), **({"specialised_reads": reads} if reads else {})}


def params_without_grad(run: P.PipelineRun) -> dict[str, str]:
    """The parameters the traced joint graph gives no gradient, by FQN (sorted): ``"frozen"``
    (``requires_grad=False``) or ``"unreached"`` (the loss does not reach it); eager PyTorch
    leaves their ``.grad`` None and AdamW skips them, and so does every stage."""
    jg = run.joint
    if jg is None:
        return {}
    frozen = set(jg.frozen_params)
    return {fqn: "frozen" if fqn in frozen else "unreached" for fqn in sorted(jg.params_without_grad)}


def without_grad_lines(without_grad: dict[str, str]) -> list[str]:
    """One line per kind of parameter without a gradient (none: no line)."""
    lines = []
    for kind, why in (("frozen", "requires_grad=False"), ("unreached", "the loss does not reach them")):
        names = [fqn for fqn, k in without_grad.items() if k == kind]
        if names:
            lines.append(f"no gradient ({why}): {', '.join(names)}")
    return lines


def _canonical_text(gm) -> str:
    return canonicalize(gm, require_val=False)


def _stats_data(graphs) -> dict:
    return partition_stats(*graphs).to_dict() if isinstance(graphs, tuple) else graph_stats(graphs).to_dict()


def stage_tracer() -> StageTracer:
    """The structured-trace observer of verify's runs: each stage's canonical graph text (the
    goldens' form) and its stats table's data (``autoparallel.trace`` names the artifacts)."""
    return StageTracer(graph_text=_canonical_text, graph_stats=_stats_data)


@contextlib.contextmanager
def intra_op_threads(n: int = 1) -> Iterator[None]:
    """Run with ``torch.set_num_threads(n)``, restored on exit.

    On a small shared CI box (2 cores, 2 xdist workers) two intra-op threads per process spin
    against each other: one debug-preset step took 0.7-2.3 s with 2 threads and 0.13 s with 1.
    Results are bitwise the same either way. Dynamo guards on the thread count, so a module
    compiled here for a gloo world's ranks (one thread each) is compiled with one thread too.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


_shared_runs: dict | None = None  # while reuse_pipeline_runs() is entered: (scenario, cap, span, lowering) -> [(until, kept, alternatives, run)]


@contextlib.contextmanager
def reuse_pipeline_runs() -> Iterator[None]:
    """Within: ``run_scenario`` builds each (scenario, bucket cap, topo span) once and then
    returns the same ``PipelineRun`` (e.g. the golden tests and the report test of one pytest
    process); a whole run also serves a request that stops earlier (``until``). Callers must
    treat the run as read-only. Nests; the outermost exit drops the runs."""
    global _shared_runs
    outer = _shared_runs
    if outer is None:
        _shared_runs = {}
    try:
        yield
    finally:
        _shared_runs = outer


def _covers(names: list[str], ran_until: str | None, until: str | None) -> bool:
    """Whether a run that stopped after ``ran_until`` (None: every stage) has ``until``'s stages."""
    if ran_until is None:
        return True
    return until is not None and names.index(until) <= names.index(ran_until)


def _serves(names: list[str], shared: tuple, until: str | None, keep_compiled: bool, alternatives: bool) -> bool:
    """Whether a shared run ``(ran_until, kept, had_alternatives, run)`` answers this request."""
    ran_until, kept, had_alternatives, run = shared
    if not _covers(names, ran_until, until) or (alternatives and until is None and not had_alternatives):
        return False
    # A parity run consumes the compiled module (Dynamo's reset invalidates it).
    return not (keep_compiled and (not kept or run.compiled is None))


def on_meta_else_real(trace: Callable[[str], T], *, real: bool = False) -> T:
    """``trace("meta")`` (graphs only: no values needed), or ``trace("cpu")`` where ``real`` or where
    the model reads a tensor's value into Python (DataDependentError on meta): the trace then takes
    the value from a real run of the batch and guards it (patch value_guards), which a model on
    meta cannot make. The graphs are the same, with the read answered and guarded."""
    if real:
        return trace("cpu")
    try:
        return trace("meta")
    except DataDependentError:
        return trace("cpu")


def run_scenario(
    scenario: Scenario,
    *,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    topo_span=None,
    until: str | None = None,
    keep_compiled: bool = False,
    alternatives: bool = True,
    lowering: str = DEFAULT_LOWERING,
) -> P.PipelineRun:
    """Every stage of ``autoparallel.pipeline.STAGES`` for ``scenario`` on one fake world (graphs
    of rank 0: bucketing is rank-specific), plus the alternatives, each stage's graphs copied.
    ``bucket_cap_mb`` / ``topo_span``: see :func:`pipeline_options`. ``until``: stop after that
    stage, without the alternatives (a shared whole run is returned instead when there is one).
    ``keep_compiled``: the run also keeps the second compile's compiled module (a parity run can
    use it; it runs one forward on the fake world, so keep it off for models too large to run); a
    shared run that kept it also serves requests without, until a parity run consumed its
    compiled module. ``alternatives=False``: without them (``check_model`` reads only the
    stages; they cost about a fifth of a small model's run). ``lowering``: ``PipelineOptions.lowering``
    (part of the shared runs' key: a DTensor run never answers a replay request)."""
    names = [stage.name for stage in P.stages_for(scenario.plan_obj())]
    if until is not None and until not in names:
        raise ValueError(f"until={until!r} is no stage; stages: {names}")
    key = (scenario, bucket_cap_mb, topo_span, lowering)
    if _shared_runs is not None:
        for shared in _shared_runs.get(key, ()):
            if _serves(names, shared, until, keep_compiled, alternatives):
                return shared[-1]
    alternatives = alternatives and until is None
    options = pipeline_options(bucket_cap_mb, topo_span, keep_compiled=keep_compiled, alternatives=alternatives,
                               lowering=lowering)
    # A kept module is for gloo ranks with one intra-op thread each (Dynamo guards on it).
    with intra_op_threads(1) if keep_compiled else contextlib.nullcontext():
        # A kept module runs: its model is built with values (on meta it would run on memory
        # nobody wrote, e.g. the buffers a model computes in __init__).
        run = on_meta_else_real(lambda device: P.run_pipeline(*scenario.pipeline_inputs(device), options, until=until,
                                                              trace=stage_tracer), real=keep_compiled)
    if _shared_runs is not None:
        _shared_runs.setdefault(key, []).append((until, keep_compiled, alternatives, run))
    return run
