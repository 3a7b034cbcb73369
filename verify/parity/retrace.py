"""A graph per rank and per step for a model whose reads differ (an MoE router's token counts).

``build_joint_graph`` answers the values a model reads into Python (``.tolist()``, ``nonzero``,
``if t:``) with the ones a real run of one rank's slice gives, each guarded: the graph holds those
values only (docs/failure-classes.md sections 2 and 11b). An MoE router's counts per expert differ
between the ranks' slices of one batch and between steps. Under FSDP and DDP the collectives
depend on the parameters only, not on the counts, so a correct result exists: each rank runs a
graph traced with its own values, and a step whose values differ gets a new trace, as
``torch.compile`` recompiles when a guard fails. In a parity world (``verify.parity.runs``):

1. the eager program trains first; before each of its steps, every rank gathers the full
   parameters (every rank together), records the reads of its slice of the step's batch (one
   eager forward) and looks them up in its graph cache; where any rank misses, every rank runs
   the pipeline for that step together (the second compile runs one forward on the world), on a
   model holding the step's parameters (:class:`StepGraphs`);
2. every new run's collectives are compared with the other ranks' before any of them runs, and
   before the eager program's step (``agree_on_collectives``): where the collectives depend on the
   values it stops with ``CollectiveMismatchError`` naming the first differing collective, never
   a gloo abort. The program gathers a parameter where the model reads it, so an MoE that skips
   an expert no token reaches (switch_transformers' ``for expert_idx in expert_hit``) would
   gather that expert on some ranks only: the ranks exchange the parameters their slices read
   (:func:`params_read`), and those some read and others do not are gathered first on every rank,
   each passed a zero gradient (``autoparallel.parallelize.gathered_first``: FSDP2's
   ``set_reduce_scatter_unused_params``); the set is part of the cache key
   (docs/failure-classes.md section 11l);
3. a step whose values are in the cache reuses its graphs;
4. each executor runs step ``s`` with the graphs of step ``s`` (:func:`per_step`).

Where one graph must serve every rank (``build_joint_graph`` by default, ``plan="auto"``'s
planner), differing reads stay refused at trace time (``reads_agree``). A model with a read that a
replicated random draw decides (a layer drop: m2m_100, nllb-moe) keeps one graph for every rank as
before: the program gives every rank rank 0's draw, and a rank's own record of its reads (and the
second compile's warm-up forward) would draw its own; the traced values would need to be handed to
the pipeline and drawn replicated here first (not done).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from autoparallel.parallelize import split_batch
from autoparallel.parallelize.program import cast_forward_inputs
from autoparallel.parallelize.plan import ParamSharding
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.parallelize.traced_values import Read, record_reads
from autoparallel import patches
from autoparallel.kernel_strides import strides_as_kernels
from autoparallel.passes.value_guards import counts_as_guarded
from autoparallel.pipeline import PipelineRun
from autoparallel.runtime.steps import Executor, seeded, step_seed
from verify.parity.collective_check import agree_on_collectives
from verify.stages.registry import is_joint


def gathered_first(read: Sequence[str], order: Sequence[str]) -> tuple[str, ...]:
    """The parameters (in ``order``) that some ranks read and others do not, from this rank's
    ``read`` set and every other rank's (all ranks call it together): what every rank gathers
    first (``autoparallel.parallelize.gathered_first``)."""
    sets: list = [None] * dist.get_world_size()
    dist.all_gather_object(sets, sorted(read))
    union, common = set().union(*map(set, sets)), set.intersection(*map(set, sets))
    return tuple(fqn for fqn in order if fqn in union and fqn not in common)


def reads_key(reads: Sequence[Read]) -> tuple:
    """What a graph traced with ``reads`` holds: each read's site, kind and value."""
    return tuple((r.site, r.size, float(r.value)) for r in reads)


def full_params(local: Mapping[str, torch.Tensor], shardings: Mapping[str, ParamSharding], spec, coord: tuple) -> dict:
    """Every parameter whole, from every rank's ``local`` shards (all ranks call it together)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (coord, dict(local)))
    return {fqn: shardings[fqn].unshard({c: pieces[fqn] for c, pieces in gathered}, spec) for fqn in local}


def model_with(make_model: Callable[[], nn.Module], params: Mapping[str, torch.Tensor],
               buffers: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A fresh model holding ``params`` (by FQN; a tied parameter under each of its names) and
    this rank's ``buffers`` (those a forward updates: ibert's ranges, a norm's running stats)."""
    model = make_model()
    own = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(own))
    if missing:
        raise ValueError(f"the model has no parameters {missing[:3]} that the program trained")
    own_buffers = dict(model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for fqn, value in params.items():
            own[fqn].copy_(value)
        for fqn, value in (buffers or {}).items():
            if fqn in own_buffers and own_buffers[fqn].shape == value.shape:
                own_buffers[fqn].copy_(value)
    return model


def params_read(model: nn.Module, loss_fn: Callable, inputs: Sequence[torch.Tensor],
                param_dtype: torch.dtype | None = None) -> frozenset[str]:
    """The parameters (first FQN of each tensor, as the program holds tied ones) that
    ``loss_fn(model(*inputs[:-1]), inputs[-1])`` reads, on a copy of ``model``; RNG state restored."""
    replica = copy.deepcopy(model)
    if param_dtype is not None:
        replica = replica.to(param_dtype)
    holder: dict[int, str] = {}
    for fqn, p in replica.named_parameters(remove_duplicate=False):
        holder.setdefault(id(p), fqn)
    read: set[str] = set()
    for module in replica.modules():
        if module._parameters:
            _record_reads_of(module, holder, read)
    *model_inputs, target = inputs
    with torch.random.fork_rng(devices=[]):
        loss_fn(replica(*cast_forward_inputs(model_inputs, param_dtype)), target)
    return frozenset(read)


def _record_reads_of(module: nn.Module, holder: dict[int, str], read: set[str]) -> None:
    """``module`` (a replica's) records into ``read`` each parameter attribute it is asked for
    (a parameter is served by ``nn.Module.__getattr__``, the attribute the program parametrizes)."""
    cls = type(module)

    def __getattr__(self, name):
        value = cls.__getattr__(self, name)
        if isinstance(value, nn.Parameter) and id(value) in holder:
            read.add(holder[id(value)])
        return value

    module.__class__ = type(f"Reads{cls.__name__}", (cls,), {"__getattr__": __getattr__})



def on_every_rank(flag: bool) -> bool:
    """``flag`` holds on every rank of the world (all ranks call it together)."""
    t = torch.tensor([0 if flag else 1])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return not bool(t.item())


class StepGraphs:
    """The pipeline run whose graphs serve each step on this rank (see the module docstring),
    made ahead of the eager program's step (:meth:`ahead_of`), so that every rank's collectives
    for that step are compared before the eager program issues them too, and the eager
    ``program`` gathers first what the graphs do (:meth:`gathering`). ``run``: the run made
    before the world (rank 0's slice of the first batch); ``pipeline(model, batch, observers,
    gather_first)``: this rank's run on the world for that model, global batch and parameters
    gathered first; ``seed``: the rank's generator seed of ``train_steps`` (a read after a random draw, a
    router's jitter, reads the step's draws). ``runs``: one per step made so far; ``firsts``: the
    parameters gathered first at each."""

    def __init__(self, run: PipelineRun, scenario, mesh, batches: Sequence[tuple],
                 pipeline: Callable[..., PipelineRun], seed: int | None = None, program=None) -> None:
        self.run, self.scenario, self.mesh, self.batches, self.pipeline, self.seed = run, scenario, mesh, batches, pipeline, seed
        self.program = program
        # The run made before the world serves any rank whose values are the ones it holds (under
        # FSDP/DDP the graphs of two slices with the same reads are the same program).
        self.cache = {(reads_key(run.joint.traced_reads), ()): run}
        self.runs: list[PipelineRun] = []
        # Per step, the parameters every rank gathered first (read on some ranks only).
        self.firsts: list[tuple[str, ...]] = []
        # Per step, the full parameters and this rank's buffers its graphs were traced with: what
        # a differential run of this rank's graphs feeds them (verify.parity.rank_explain).
        self.values: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []

    def ahead_of(self, executor: Executor) -> Executor:
        """``executor`` (the eager program's) with this step's graphs made before each step."""

        def step(params, inputs):
            # The eager step draws from the step's seed as every other executor's does: building
            # the model (its init draws) and the second compile's warm-up forward draw nothing of it.
            with torch.random.fork_rng(devices=[]):
                self.make(params, executor.buffers)
            return self.gathering(executor, len(self.runs) - 1).step(params, inputs)

        return Executor(step, executor.buffers)

    def gathering(self, executor: Executor, at: int | None = None) -> Executor:
        """``executor`` (one over the eager ``program``) with step ``s`` run with the parameters
        every rank gathered first at step ``s`` (``at``: one step only, the next one made)."""
        calls = [0]

        def step(params, inputs):
            s = at if at is not None else calls[0]
            calls[0] += 1
            if s >= len(self.firsts):
                raise RuntimeError(f"retrace: step {s} was not made: run the eager program's steps first")
            if self.program is not None:
                self.program.gather_first = self.firsts[s]
            elif self.firsts[s]:
                raise RuntimeError("retrace: some ranks read parameters the others do not, and no program was given to gather them")
            return executor.step(params, inputs)

        return Executor(step, executor.buffers)

    def make(self, local: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor] | None = None) -> PipelineRun:
        """The run for the next step, whose local parameters are ``local`` and this rank's
        buffers ``buffers`` (every rank together)."""
        s, spec, plan = len(self.runs), self.scenario.mesh_spec, self.scenario.plan_obj()
        coord = self.mesh.coordinate()
        full = full_params(local, self.run.joint.shardings, spec, tuple(coord[d] for d in spec.names))
        model = model_with(self.scenario.model, full, buffers)
        mine = split_batch(self.batches[s], plan, spec, coord)
        step_draws = (lambda: seeded(step_seed(self.seed, s))) if self.seed is not None else contextlib.nullcontext
        with step_draws():
            reads = record_reads(model, self.scenario.loss_fn, mine, plan.param_dtype, patches.enabled(REPLICATED_DRAWS))
            read = params_read(model, self.scenario.loss_fn, mine, plan.param_dtype)
        first = gathered_first(read, self.run.joint.param_fqns)
        key = (reads_key(reads), first)
        if not on_every_rank(key in self.cache):
            print(f"retrace: step {s}: rank {dist.get_rank()} traces for its reads ({len(reads)} values"
                  f"{f', {len(first)} parameters gathered first' if first else ''})", file=sys.stderr, flush=True)
            # The joint graph's collectives are compared before the second compile's forward runs
            # any; every stage's after the run, before any step does.
            with step_draws():  # the warm-up forward draws the step's masks: its guards hold the step's reads
                new = self.pipeline(model, self.batches[s], [_joint_agrees], first)
            if reads_key(new.joint.traced_reads) != key[0]:
                raise RuntimeError(f"retrace: step {s}: the pipeline traced other reads than this rank's eager run made")
            agree_on_collectives([row for r in new.results for row in r.graph_rows()])
            self.cache[key] = new
        self.runs.append(self.cache[key])
        self.firsts.append(first)
        self.values.append((full, {k: b.detach().clone() for k, b in (buffers or {}).items()}))
        return self.runs[-1]


def _joint_agrees(result) -> None:
    """Pipeline observer: every rank's joint graph issues the same collectives (all ranks together)."""
    if is_joint(result.name):
        agree_on_collectives(result.graph_rows())


def per_step(executors: Sequence[Executor]) -> Executor:
    """One executor that runs step ``s`` with ``executors[s]``; the buffers the steps update
    carry from one to the next (the first one's dict holds them, as ``train_steps`` records)."""
    shared = executors[0].buffers
    calls = [0]

    def step(params, inputs):
        ex = executors[calls[0]]
        calls[0] += 1
        if ex.buffers is not shared:
            with torch.no_grad():
                for k, b in ex.buffers.items():
                    b.copy_(shared[k])
        # A later run's second compile reset Dynamo: a compiled module recompiles at its first
        # step with the same backend, under the contexts the second compile traced it in.
        with strides_as_kernels(), counts_as_guarded():
            out = ex.step(params, inputs)
        if ex.buffers is not shared:
            with torch.no_grad():
                for k, b in ex.buffers.items():
                    shared[k].copy_(b)
        return out

    return Executor(step, shared)


__all__ = ["StepGraphs", "full_params", "model_with", "on_every_rank", "per_step", "reads_key"]
