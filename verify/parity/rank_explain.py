"""Differential execution of one rank's own graphs, for a model traced per rank (an MoE's routing).

``check_model`` explains a stage that is not bitwise by running every pass's output against its
input on simulated ranks (:func:`verify.parity.bisection.explain_not_bitwise`), in its own process,
on the graphs it traced (rank 0's slice) with random parameters. A model whose values read into
Python differ per rank and step (``verify.parity.retrace``) cannot be explained that way: its graphs
hold the values one slice read, each guarded (an expert's token count), so random parameters, or
another rank's slice, fail a guard, and the graphs that ran are the ranks' own, made in the rank.

So each rank of such a world explains its own graphs, where they ran: after training, it compares
every stage's trace with the eager program's (as ``compare_with_eager`` does, its own rank only);
for a stage that is not bitwise it takes the first step that differs and runs that step's pipeline
run pass by pass on N simulated ranks fed what the rank's graphs were traced with:

* ``param:<fqn>``: simulated rank k gets coordinate k's shard of the step's full parameters (the
  gathered parameters are the real ones);
* ``input:<i>``: this rank's slice of the step's batch on every simulated rank, and this rank's
  buffers, so every simulated rank reads what the guards hold;
* the step's draws (``train_steps``' seed for the step) on every simulated rank, each from its own
  generator (``Feeds.draw_seed``): a dropout before a router decides the routing the guards hold;
* everything else (the loss's tangent) random, as ``Feeds`` makes it.

The collectives run on LocalTensors over the rank's own process groups (their rank lists only:
nothing communicates). The result, one line per stage, travels back in ``RankParity.explanations``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from autoparallel import roles
from autoparallel.mesh import MeshSpec, ParallelMesh
from autoparallel.parallelize import split_batch
from autoparallel.pipeline import PipelineRun
from autoparallel.runtime.steps import StepTrace, step_seed
from verify.parity.bisection import explain_not_bitwise
from verify.parity.compare import ParityReport, compare_traces


def first_step(report: ParityReport) -> int:
    """The first step whose values differ in ``report`` (a trace comparison; 0 when only the final
    parameters do)."""
    steps = [int(m.group(1)) for d in report.mismatches() if (m := re.match(r"step(\d+)/", d.name))]
    return min(steps, default=0)


def rank_inputs_for(run: PipelineRun, spec: MeshSpec, full: Mapping[str, torch.Tensor], mine: Sequence,
                    buffers: Mapping[str, torch.Tensor]) -> dict[str, tuple]:
    """Per input key, one tensor per simulated rank (see the module docstring)."""
    sizes = {d: spec.size(d) for d in spec.names}
    coords = [spec.coordinate(r) for r in range(spec.world_size)]
    given: dict[str, tuple] = {}
    with torch.no_grad():  # values only: LocalTensorMode refuses tensors that carry an autograd graph
        for fqn, sharding in run.joint.shardings.items():
            if fqn in full:
                given[roles.param(fqn)] = tuple(sharding.shard(full[fqn].detach(), c, sizes) for c in coords)
        for i, t in enumerate(mine):
            if isinstance(t, torch.Tensor):
                given[roles.input_(i)] = (t.detach(),) * spec.world_size
        for fqn, b in buffers.items():
            given[roles.buffer(fqn)] = (b.detach(),) * spec.world_size
    return given


def explain_own_graphs(traces: Mapping[str, StepTrace], stages: Sequence[str], reference: str, *, runs: Sequence[PipelineRun],
                       values: Sequence[tuple[Mapping, Mapping]], scenario, mesh: ParallelMesh, batches: Sequence,
                       as_traced: str | None = None, seed: int | None = None) -> dict[str, str]:
    """Why each of ``stages`` whose trace is not bitwise with ``reference``'s (the eager program's)
    on this rank differs, from this rank's own graphs (see the module docstring); ``runs[s]`` /
    ``values[s]`` (full parameters, buffers): step ``s``'s pipeline run and what it was traced
    with; ``as_traced``: the executor of the eager program run as traced, where the rank ran it;
    ``seed``: the rank's ``train_steps`` seed (every simulated rank draws step ``s``'s draws).
    Never raises: a run that cannot run says why in its line."""
    spec, plan = scenario.mesh_spec, scenario.plan_obj()
    bad = {s: compare_traces(traces[reference], traces[s], a_name=reference, b_name=s) for s in stages}
    bad = {s: rep for s, rep in bad.items() if not rep.bitwise}
    out: dict[str, str] = {}
    by_step: dict[int, list[str]] = {}
    for s, rep in bad.items():
        by_step.setdefault(first_step(rep), []).append(s)
    traced = {s: compare_traces(traces[as_traced], traces[s], a_name=as_traced, b_name=s) for s in bad} if as_traced else {}
    coord = mesh.coordinate()
    for step, names in sorted(by_step.items()):
        run = runs[step]
        full, buffers = values[step]
        try:
            given = rank_inputs_for(run, spec, full, split_batch(batches[step], plan, spec, coord), buffers)
            queries = run.joint.compiling_queries if run.joint is not None else ()
            why, _ = explain_not_bitwise(run, spec, names, seed=scenario.seed, as_traced=traced, compiling_queries=queries,
                                         given=given, world=mesh, draw_seed=None if seed is None else step_seed(seed, step))
        except Exception as e:  # an explanation never fails the check it explains
            why = {n: f"differential execution could not run: {type(e).__name__}: {e}" for n in names}
        out.update({n: f"step {step}, this rank's own graphs: {not_the_trace(why[n], n, stages, bad)}" for n in names})
    return out


TRACE = "the difference is in the trace (eager program -> joint graph)"


def not_the_trace(why: str, stage: str, stages: Sequence[str], bad: Mapping) -> str:
    """``why`` for ``stage``, where no pass computes other values on simulated ranks: when a stage
    before it (``stages`` in pipeline order; ``bad``: those not bitwise) is bitwise with the eager
    program, the trace is not the cause either; the stage differs only as it ran on the real world."""
    before = [s for s in stages[: stages.index(stage)] if s not in bad] if stage in stages else []
    if TRACE not in why or not before:
        return why
    return why.replace(TRACE, (
        f"the difference is not the trace's either: {before[-1]} is bitwise with the eager program on this rank. So "
        f"{stage} differs only as it ran on the real world, which simulated ranks cannot show: an asynchronous "
        "collective whose output is read before its wait, or whose buffer is written while it is in flight, "
        "or the executor's graphs are not the pipeline stage's"))


def merge_rank_explanations(per_rank: Sequence[Mapping[str, str]], stages: Sequence[str]) -> dict[str, str]:
    """One line per stage from every rank's own explanation (``rank <i>: ...``; one line where
    every rank that explains it says the same)."""
    out: dict[str, str] = {}
    for stage in stages:
        lines = [(i, r[stage]) for i, r in enumerate(per_rank) if stage in r]
        if not lines:
            continue
        texts = {t for _, t in lines}
        if len(texts) == 1 and len(lines) == len(per_rank):
            out[stage] = f"on every rank ({len(lines)}), {lines[0][1]}"
        else:
            out[stage] = " | ".join(f"rank {i}: {t}" for i, t in lines)
    return out


__all__ = ["explain_own_graphs", "first_step", "merge_rank_explanations", "not_the_trace", "rank_inputs_for"]
