"""One parity rank's context: what every executor of a parity world is built from and trained with.

Hand plans (``verify.parity.runs``), ``plan="auto"`` (``verify.parity.planned``), device worlds
(``verify.parity.device_world``) and the tests make one :class:`RankContext` per rank; each
stage's registry entry (``verify.stages.registry.ParityRun``) builds its executor from it with one
of the builders below, and :meth:`RankContext.train` runs every executor from the same initial
parameters, buffers, batches and generator seed. So a new way to run a world is one constructor,
and a new form of executor is one builder, each written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from autoparallel.fx_utils import copy_graph_module
from autoparallel.mesh import ParallelMesh
from autoparallel.parallelize import ParallelProgram, split_batch
from autoparallel.passes.collective import CollectivePassesConfig, bucket_fw_bw
from autoparallel.pipeline import PipelineRun
from autoparallel.runtime.rebind import rebind_groups
from autoparallel.runtime.steps import (
    Executor,
    StepTrace,
    compiled_module_executor,
    eager_program_executor,
    joint_graph_executor,
    parallel_module_executor,
    split_graph_executor,
    train_steps,
)


@dataclass
class RankContext:
    """One rank of a parity world: its mesh, initial local ``params`` and ``buffers`` (never
    trained: :meth:`train` copies them), its local ``batches`` (one per step), the reference
    executor's factory ``eager``, the generator ``seed`` of ``train_steps``, the pipeline ``run``
    whose stages' graphs and module the executors take, and the collective passes' configuration
    (the passes it switches on run composed). ``rebind``: the run's graphs were traced on a fake world; rebind their groups to
    this rank's (False: the run was made on this world). ``on_bucketed``: called with the (label,
    graph) rows of each pair :meth:`bucketed` makes, before any executor runs them: a world whose
    ranks bucket graphs of their own passes ``verify.parity.collective_check.agree_on_collectives``,
    so two ranks' merged collectives that carry other members are a named error, not a silent
    mix of gradients."""

    mesh: ParallelMesh
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    batches: list[tuple]
    eager: Callable[[], Executor]
    seed: int | None = None
    run: PipelineRun | None = None
    collective: CollectivePassesConfig = field(default_factory=CollectivePassesConfig)
    rebind: bool = True
    on_bucketed: Callable[[list[tuple[str, fx.GraphModule]]], object] | None = None
    _bucketed: dict[str, tuple[fx.GraphModule, fx.GraphModule]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def for_program(cls, program: ParallelProgram, mesh: ParallelMesh, batches: Sequence[tuple], **kw) -> RankContext:
        """A hand plan's rank: the program's local parameters and buffers, ``batches`` (global,
        on the rank's device) split to the rank's slice; the eager program is the reference."""
        coord = mesh.coordinate()
        init_buffers = {k: b.detach().clone() for k, b in eager_program_executor(program).buffers.items()}
        return cls(
            mesh=mesh,
            params={k: v.detach().clone() for k, v in program.local_parameters().items()},
            buffers=init_buffers,
            batches=[split_batch(b, program.plan, program.mesh_spec, coord) for b in batches],
            eager=lambda: eager_program_executor(program),
            **kw,
        )

    def fresh_buffers(self) -> dict[str, torch.Tensor]:
        return {k: b.clone() for k, b in self.buffers.items()}

    def graphs(self, stage: str):
        """A copy of ``stage``'s graphs (a joint graph or a (fw, bw) pair) for this rank's world."""
        graphs = self.run.stage(stage).graphs
        one = (lambda g: rebind_groups(g, self.mesh.group_dims)) if self.rebind else copy_graph_module
        return tuple(one(g) for g in graphs) if isinstance(graphs, tuple) else one(graphs)

    def bucketed(self, stage: str) -> tuple[fx.GraphModule, fx.GraphModule]:
        """``stage``'s (fw, bw) on this rank through the collective passes, composed (merged
        all-gathers are rank-specific: every rank runs them on its own graphs); made once."""
        if stage not in self._bucketed:
            fw, bw = self.graphs(stage)
            self._bucketed[stage] = bucket_fw_bw(fw, bw, self.collective)[:2]
            if self.on_bucketed is not None:
                self.on_bucketed([(f"{stage} bucketed {part}", g) for part, g in zip(("fwd", "bwd"), self._bucketed[stage], strict=True)])
        return self._bucketed[stage]

    def train(self, executor: Executor) -> StepTrace:
        """``executor`` trained on the rank's batches from the initial parameters and buffers."""
        with torch.no_grad():
            for k, b in executor.buffers.items():
                if k in self.buffers:
                    b.copy_(self.buffers[k])
        return train_steps(executor, {k: v.clone() for k, v in self.params.items()}, self.batches, seed=self.seed)


# --- the builders: a stage's executor from a rank's context and the stage whose graphs it takes -------


def joint_graph(ctx: RankContext, needs: str) -> Executor:
    """The joint graph ``needs`` left, forward and backward in one call."""
    return joint_graph_executor(ctx.graphs(needs), ctx.run.joint.input_roles, ctx.run.joint.output_roles, ctx.fresh_buffers())


def parallel_module(ctx: RankContext, needs: str) -> Executor:
    """The first partition's ``ParallelModule`` (autograd drives the backward)."""
    return parallel_module_executor(ctx.run.module)


def compiled_module(ctx: RankContext, needs: str) -> Executor:
    """The module the second compile compiled and the pipeline kept (``keep_compiled``)."""
    return compiled_module_executor(ctx.run.module, ctx.run.compiled)


def collective_passes(ctx: RankContext, needs: str) -> Executor:
    """``needs``' forward and backward through the collective passes (:meth:`RankContext.bucketed`)."""
    return split_graph_executor(*ctx.bucketed(needs), ctx.fresh_buffers())
