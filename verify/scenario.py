"""Named configurations (preset, plan, mesh): what a golden header, a parity test and the report
all describe.

A ``Scenario`` is a plain value (frozen, hashable, comparable): it builds the model, the plan and
the batches, and hands them to ``autoparallel.pipeline.run_pipeline`` (:meth:`pipeline_inputs`),
so every consumer sees the same model seed, the same batches and the same plan options. The runs
built from scenarios live elsewhere: ``verify.pipeline`` (graphs), ``verify.parity_runs`` (gloo
parity runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoparallel.mesh import MeshSpec, fake_world
from autoparallel.models.llama3 import build_model, model_args
from autoparallel.parallelize import JointGraph, ParallelPlan, build_joint_graph
from autoparallel.parallelize.plan import AUTO

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class Scenario:
    preset: str = "tiny"
    plan: str = "fsdp"
    mesh: str = "dp=8"
    seed: int = 0
    batch_per_rank: int = 1
    seq_len: int | None = None  # default: the preset's max_seq_len
    n_layers: int | None = None  # default: the preset's
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True

    @property
    def mesh_spec(self) -> MeshSpec:
        return MeshSpec.parse(self.mesh)

    def plan_obj(self) -> ParallelPlan:
        kw = {"reshard_after_forward": self.reshard_after_forward}
        if self.param_dtype:
            kw["param_dtype"] = _dtype(self.param_dtype)
        if self.reduce_dtype:
            kw["reduce_dtype"] = _dtype(self.reduce_dtype)
        return ParallelPlan.preset(self.plan, **kw)

    def header(self) -> str:
        layers = f" layers={self.n_layers}" if self.n_layers else ""
        return f"preset={self.preset}{layers} plan={self.plan_obj().describe()} mesh={self.mesh_spec} seed={self.seed}"

    def model_args(self):
        return model_args(self.preset, **({"n_layers": self.n_layers} if self.n_layers else {}))

    def model(self, device: str = "cpu"):
        return build_model(self.model_args(), seed=self.seed, device=device)

    @property
    def is_auto(self) -> bool:
        return self.plan == AUTO

    def batches(self, steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic global batches (tokens, next-token labels): ``batch_per_rank`` rows per
        rank of the plan's data dims. plan="auto" has no data dims (the planner may split the
        batch over any mesh dim, or none): it gets the batch a hand plan on the same mesh splits
        over its data dim, the mesh's first (outermost) dim, so both see the same workload."""
        args = self.model_args()
        plan = self.plan_obj()
        ranks = self.mesh_spec.shape[0] if plan.is_auto else 1
        for d in plan.data_dims:
            ranks *= self.mesh_spec.size(d)
        seq = self.seq_len or args.max_seq_len
        g = torch.Generator().manual_seed(10_000 + self.seed)
        out = []
        for _ in range(steps):
            data = torch.randint(0, args.vocab_size, (ranks * self.batch_per_rank, seq + 1), generator=g)
            out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        return out

    def example_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches(1)[0]

    def pipeline_inputs(self) -> tuple:
        """``(model, loss_fn, example_inputs, plan, mesh spec)``: the leading arguments of
        ``autoparallel.pipeline.run_pipeline`` (model on ``meta``, the default token loss)."""
        return self.model(device="meta"), None, self.example_inputs(), self.plan_obj(), self.mesh_spec

    def trace(self, mesh=None) -> JointGraph:
        """The joint graph on a fake world (``mesh``: an already-entered fake world, if any)."""
        model = self.model(device="meta")
        if mesh is not None:
            return build_joint_graph(model, self.plan_obj(), mesh, self.example_inputs())
        with fake_world(self.mesh_spec) as m:
            return build_joint_graph(model, self.plan_obj(), m, self.example_inputs())


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(_DTYPES)}") from None


def check_flags(scenario: Scenario) -> None:
    """ValueError naming the command-line flags when the preset, plan and mesh do not fit
    together (a dim that does not divide, a plan dim the mesh lacks), before anything runs.
    plan="auto" has no hand placements to check (the planner only proposes what divides)."""
    if scenario.is_auto:
        return
    try:
        scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    except ValueError as e:
        raise ValueError(f"--plan {scenario.plan} --mesh {scenario.mesh_spec} --preset {scenario.preset}: {e}") from None


def parameter_count(scenario: Scenario) -> int:
    return sum(p.numel() for p in scenario.model(device="meta").parameters())
