"""Check your own model: every pipeline stage, parity (bitwise and the oracle), stats and goldens.

::

    from verify.check import check_model

    result = check_model(MyNet, my_loss, my_batch, plan="fsdp", mesh="dp=2")
    result.assert_ok()        # every stage bitwise vs the eager parallel program, oracle within tolerance
    print(result.summary())   # stages, collectives, parity and oracle verdicts

``check_model`` takes a model factory (called under a fixed seed), its loss
(``loss_fn(model(*inputs[:-1]), inputs[-1])``) and a batch factory (``batch(n)`` -> the model
inputs then the target, ``n`` examples), or a :class:`~verify.model_case.ModelCase` holding all
three, and a plan: ``"fsdp"``, ``"ddp"``, ``"fsdp_tp"`` (with ``tp_rules`` / ``tp_regions`` by
FQN pattern) or a ``ParallelPlan`` over the mesh dims ``dp`` / ``tp``. It runs
``autoparallel.pipeline`` on a fake world of ``mesh`` (graphs of rank 0), then trains ``steps``
steps on a gloo world of the same mesh with every stage (``verify.parity.runs``), compares each
with the eager parallel program bitwise and the eager program with single-device eager within
the oracle's tolerance (``verify.parity.compare``). Dynamo's caches are reset when it returns.

From pytest, the plugin's ``model_check`` fixture runs it and fails the test with the summary
when something is off; ``golden=golden`` (the ``golden`` fixture) also compares each stage's
canonical graph text with its golden file (``python -m verify goldens --update`` writes them;
``check_model(..., goldens=True)`` keeps what those texts need). From the command line:
``python -m verify report --model package.module:name`` (a ``ModelCase``).

Inside a torchrun job (``torchrun --nproc-per-node N -m pytest ...``) every rank traces, and parity
runs on the launched world, whose size must be the mesh's (``autoparallel.runtime.launched``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from autoparallel.defaults import AUTO
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import STAGE_NAMES, PipelineRun
from autoparallel.runtime.launched import check_world_size, launched_world
from verify.parity.bisection import explain_not_bitwise
from verify.goldens.catalog import golden_result, header
from verify.goldens.text import graph_golden_text
from verify.graphs.stats import graph_stats
from verify.model_case import Batch, ModelCase, load_case
from verify.parity import ordered_collectives
from verify.parity.compare import OracleReport, ParityReport
from verify.parity.rank_explain import merge_rank_explanations
from verify.parity.planned import EAGER as PLANNED_EAGER
from verify.parity.planned import EXECUTORS as PLANNED_EXECUTORS
from verify.parity.planned import planned_case, planned_oracle, run_planned_parity
from verify.parity.runs import (
    AS_TRACED,
    EAGER,
    STAGE_EXECUTORS,
    compare_with_eager,
    oracle_check,
    rank_inputs,
    run_stage_parity,
)
from verify.stages.pipeline_run import params_without_grad, run_scenario, without_grad_lines
from verify.stages.scenario import Scenario, check_flags, dtype_name

__all__ = ["ModelCase", "ModelCheck", "check_model"]

_PRESET_DIMS = {"fsdp": ("dp", None, None), "fsdp_tp": ("dp", "tp", None), "ddp": (None, None, "dp")}


@dataclass
class ModelCheck:
    """What :func:`check_model` found: the pipeline run (every stage's graphs), parity of each
    stage against the eager parallel program, and the oracle."""

    scenario: Scenario
    run: PipelineRun
    parity: dict[str, ParityReport] = field(default_factory=dict)
    oracle: OracleReport | None = None
    # Per stage that is not bitwise: why (verify.parity.bisection.explain_not_bitwise: differential
    # execution's first differing pass and node, or the model's branch on is_compiling()).
    explanations: dict[str, str] = field(default_factory=dict)
    # Per stage: against the eager program run as traced (is_compiling() true), where ranks ran it.
    as_traced: dict[str, ParityReport] = field(default_factory=dict)

    def model_branch(self, stage: str) -> bool:
        """``stage`` differs from the eager program only because the model branches on
        ``torch.compiler.is_compiling()``: bitwise with the eager program run as traced."""
        rep = self.as_traced.get(stage)
        return not self.parity[stage].bitwise and rep is not None and rep.bitwise

    def failures(self) -> list[str]:
        """One line per problem: a stage that is not bitwise (with why), the oracle beyond
        tolerance. A stage bitwise with the eager program run as traced is no failure: the model
        itself computes another program when compiled (its summary line says so)."""
        out = []
        for stage, rep in self.parity.items():
            if rep.bitwise or self.model_branch(stage):
                continue
            why = self.explanations.get(stage)
            out.append(f"{stage}: {rep.summary(limit=3)}" + (f"\n  why: {why}" if why else ""))
        if self.oracle is not None and not self.oracle.passed:
            out.append(self.oracle.summary(limit=5))
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def assert_ok(self) -> None:
        if not self.ok:
            raise AssertionError(f"{self.scenario.header()}:\n" + "\n".join(self.failures()))

    def stats(self) -> dict[str, dict]:
        """Per graph row (``joint``, ``first_partition fwd`` ...): node count, collectives per
        kind and mesh dim, saved tensors, static peak (``verify.graphs.stats``)."""
        return {label: graph_stats(gm).to_dict() for r in self.run.results for label, gm in r.graph_rows()}

    def golden_texts(self) -> dict[str, str]:
        """Per stage: the canonical golden text (header, stats, graphs) a golden file holds."""
        if not self.run.alternatives:
            raise ValueError("golden texts need each collective pass run alone: check_model(..., goldens=True)")
        return {
            stage: graph_golden_text(
                f"{self.scenario.model_name} {stage}", header(self.scenario, stage), golden_result(self.run, stage).graphs
            )
            for stage in STAGE_NAMES
        }

    def params_without_grad(self) -> dict[str, str]:
        """The parameters that get no gradient, by FQN: ``"frozen"`` (``requires_grad=False``) or
        ``"unreached"`` (the loss does not reach them). Every stage and the oracle check that they
        get none and end the run unchanged, as in eager PyTorch."""
        return params_without_grad(self.run)

    def specialised_reads(self) -> tuple[str, ...]:
        """The values the model reads into Python (``.item()``, ``if t:``) that the graphs hold as
        traced, each ``"module file:line (source): traced with value"``; every one is guarded at run
        time (patch value_guards): another value raises, naming it."""
        return self.run.joint.specialised_reads if self.run.joint is not None else ()

    def summary(self) -> str:
        lines = [self.scenario.header()]
        lines.extend(f"  {line}" for line in without_grad_lines(self.params_without_grad()))
        lines.extend(f"  specialised read: {read}" for read in self.specialised_reads())
        cast = input_cast_line(self.scenario)
        if cast:
            lines.append(f"  {cast}")
        for label, st in self.stats().items():
            coll = ", ".join(f"{k}[{d}] {c['count']}" for k, per in st["collectives"].items() for d, c in per.items())
            lines.append(f"  {label:<28} {st['num_nodes']:>5} nodes  {coll or 'no collectives'}")
        for stage, rep in self.parity.items():
            verdict = "bitwise equal" if rep.bitwise else "NOT bitwise"
            if self.model_branch(stage):
                verdict = "NOT bitwise with eager; bitwise with eager as traced (the model's own branch)"
            lines.append(f"  parity {stage:<18} {verdict} ({len(rep.diffs)} tensors)")
            if stage in self.explanations:
                lines.append(f"    why: {self.explanations[stage]}")
        if self.oracle is not None:
            lines.append("  " + self.oracle.summary(limit=5).replace("\n", "\n  "))
        return "\n".join(lines)


def input_cast_line(scenario: Scenario) -> str | None:
    """The summary's line for floating model inputs a mixed-precision plan casts (None: none)."""
    dtype = scenario.plan_obj().param_dtype
    if dtype is None:
        return None
    from torch.utils import _pytree as pytree

    inputs = scenario.batches(1)[0][:-1]
    if not any(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype for t in pytree.tree_leaves(list(inputs))):
        return None
    return f"floating inputs cast to {str(dtype).removeprefix('torch.')} as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does"


def _explain(result: ModelCheck, ranks) -> None:
    """Fill ``result.as_traced`` and ``result.explanations`` for the stages that are not bitwise."""
    bad = [stage for stage, rep in result.parity.items() if not rep.bitwise]
    if not bad:
        return
    if AS_TRACED in ranks[0].traces:
        result.as_traced = {stage: compare_with_eager(ranks, stage, AS_TRACED) for stage in bad}
    own = [getattr(r, "explanations", {}) for r in ranks]  # planned ranks (plan="auto") trace no graph per rank
    if any(own):  # graphs traced per rank (verify.parity.retrace): each rank explained its own
        result.explanations = merge_rank_explanations(own, bad)
        return
    queries = result.run.joint.compiling_queries if result.run.joint is not None else ()
    given = None if result.scenario.plan == AUTO else rank_inputs(result.scenario)
    result.explanations, _ = explain_not_bitwise(result.run, result.scenario.mesh, bad, seed=result.scenario.seed,
                                                 as_traced=result.as_traced, compiling_queries=queries, given=given)


def _check_planned(scenario: Scenario, steps: int, *, parity: bool, native_collectives: bool, goldens: bool,
                   world_timeout_s: float | None) -> ModelCheck:
    """plan="auto": every stage of ``PLANNED_STAGES`` on a fake world (graphs, stats, goldens),
    then the planned parity world (``verify.parity.planned``: each rank lowers the solver's plan;
    the lowered joint graph, the first partition and the second compile against the plan's
    placements run eagerly, bitwise) and the oracle, all with the case's own loss."""
    run = run_scenario(scenario, alternatives=goldens)
    result = ModelCheck(scenario, run)
    if parity:
        case = planned_case(scenario)
        with ordered_collectives.native_collectives(native_collectives):
            world = {} if world_timeout_s is None else {"timeout_s": world_timeout_s}
            ((_, ranks),) = run_planned_parity(case, steps, **world)
        result.parity = {ex: compare_with_eager(ranks, ex) for ex in PLANNED_EXECUTORS if ex != PLANNED_EAGER}
        result.oracle = planned_oracle(case, ranks)
        _explain(result, ranks)
    return result


def _plan_fields(plan: str | ParallelPlan) -> dict:
    """Scenario fields of a plan name or a ParallelPlan over the preset mesh dims."""
    if isinstance(plan, str):
        return {"plan": plan}
    dims = (plan.fsdp_dim, plan.tp_dim, plan.ddp_dim)
    if _PRESET_DIMS.get(plan.name) != dims:
        raise ValueError(
            f"plan {plan.describe()!r}: check_model takes the fsdp / fsdp_tp / ddp plans over mesh dims 'dp' "
            f"and 'tp' (ParallelPlan.fsdp(), .fsdp_tp(), .ddp() with any rules and options), or plan='auto'"
        )
    return {
        "plan": plan.name,
        "param_dtype": dtype_name(plan.param_dtype),
        "reduce_dtype": dtype_name(plan.reduce_dtype),
        "reshard_after_forward": plan.reshard_after_forward,
        "tp_rules": dict(plan.tp_rules),
        "tp_regions": tuple(plan.tp_regions),
    }


def check_model(
    model: Callable[[], nn.Module] | ModelCase | str,
    loss_fn: Callable | None = None,
    batch: Batch | None = None,
    *,
    plan: str | ParallelPlan = "fsdp",
    mesh: str = "dp=2",
    tp_rules: Mapping | None = None,
    tp_regions: Sequence[str] | None = None,
    batch_per_rank: int = 1,
    steps: int = 3,
    seed: int = 0,
    name: str | None = None,
    parity: bool = True,
    native_collectives: bool = False,
    goldens: bool = False,
    world_timeout_s: float | None = None,
) -> ModelCheck:
    """Run the pipeline, parity and the oracle for a model; see the module docstring.

    ``tp_rules`` / ``tp_regions`` (parameter and module FQN patterns) are for ``fsdp_tp``;
    ``plan`` may be a ``ParallelPlan`` instead (its rules win over the case's). ``mesh``: the
    world the graphs are traced for and the gloo world parity runs on (keep it small: each rank
    is a process). ``parity=False``: graphs and stats only. The gloo world's reductions add the
    ranks' contributions in rank order (``verify.parity.ordered_collectives``: a verdict that does not
    depend on how buckets fall); ``native_collectives=True`` runs gloo's own. Bad input (a plan that does not fit
    the model, a loss that is not a scalar) raises ValueError naming it; a
    parameter without a gradient (frozen, or the loss does not reach it) trains as in eager
    PyTorch (:meth:`ModelCheck.params_without_grad`). ``goldens=True``: the run also keeps each collective pass run alone on
    the second compile's graphs, which the stage goldens of those passes show
    (:meth:`ModelCheck.golden_texts`); off, it skips them (about a fifth of a small model's run).
    ``world_timeout_s``: how long the gloo world of the parity run may take, on every plan (a sweep cell gives it its own budget: a slow model on a loaded machine is a timeout of
    the cell, not of a fixed world limit inside it); None: the world's default (180 s, 300 s under plan="auto")."""
    fields = _plan_fields(plan)
    if fields["plan"] == AUTO and (tp_rules or tp_regions):
        raise ValueError(
            "plan='auto' chooses every placement itself; tp_rules / tp_regions are for the fsdp_tp plan. "
            "To fix a parameter's placement under auto, pin it (ParallelPlan.auto(pins={'blocks.0.attn.qkv.weight': "
            "'dp:S(0),tp:S(0)'}), autoparallel.planner.PlannerConfig.pins); a ModelCase's own TP rules are not used by auto")
    if isinstance(model, str):  # what --model takes: "package.module:name" or a verify.zoo name
        model = load_case(model)
    if isinstance(model, ModelCase):
        case = model
    else:
        if loss_fn is None or batch is None:
            raise ValueError("check_model(model_factory, loss_fn, batch): give the loss and the batch factory, or a ModelCase")
        label = name or getattr(model, "__name__", type(model).__name__)
        case = ModelCase(label, model, loss_fn, batch, tp_rules or {}, tuple(tp_regions or ()), batch_per_rank)
    rules = fields.pop("tp_rules", None)
    regions = fields.pop("tp_regions", None)
    if rules is not None:
        case = ModelCase(case.name, case.factory, case.loss_fn, case.batch, rules, regions, case.batch_per_rank)
    scenario = Scenario(case=case, mesh=mesh, seed=seed, **fields)
    check_flags(scenario)
    world = launched_world()
    if parity and world is not None:  # under torchrun parity runs on the launched world: before the pipeline
        check_world_size(world, scenario.mesh_spec.world_size, f"check_model(mesh={mesh!r})")
    if scenario.plan == AUTO:
        return _check_planned(scenario, steps, parity=parity, native_collectives=native_collectives, goldens=goldens,
                              world_timeout_s=world_timeout_s)
    run = run_scenario(scenario, keep_compiled=parity, alternatives=goldens)
    result = ModelCheck(scenario, run)
    if parity:
        with ordered_collectives.native_collectives(native_collectives):
            world = {} if world_timeout_s is None else {"timeout_s": world_timeout_s}
            ranks = run_stage_parity(scenario, steps, run=run, **world)
        result.parity = {stage: compare_with_eager(ranks, stage) for stage in STAGE_EXECUTORS if stage != EAGER}
        result.oracle = oracle_check(scenario, ranks)
        _explain(result, ranks)
    return result
