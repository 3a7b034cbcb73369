"""Named configurations (model, plan, mesh): what a golden header, a parity test and the report
all describe.

A ``Scenario`` is a plain value (frozen, hashable, comparable): it builds the model, the plan and
the batches, and hands them to ``autoparallel.pipeline.run_pipeline`` (:meth:`pipeline_inputs`),
so every consumer sees the same model seed, the same batches and the same plan options. The model
is a LLaMA-3 preset (``preset``, token cross-entropy) unless ``case`` names a
:class:`verify.model_case.ModelCase` (an object, ``"package.module:name"``, or a ``verify.zoo``
name), which brings its own loss, batches and TP rules. The runs built from scenarios live
elsewhere: ``verify.stages.pipeline_run`` (graphs), ``verify.parity.runs`` (gloo parity runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoparallel.defaults import AUTO
from autoparallel.mesh import MeshSpec, fake_world
from autoparallel.models.llama3 import build_model, model_args
from autoparallel.parallelize import JointGraph, ParallelPlan, build_joint_graph, cross_entropy_loss
from autoparallel.parallelize.program import LossFn
from verify.model_case import ModelCase, load_case
from verify.stages import defaults

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class Scenario:
    preset: str = defaults.PRESET
    plan: str = defaults.PLAN
    mesh: str = defaults.MESH
    seed: int = 0
    batch_per_rank: int | None = None  # default: 1 for a preset, the case's own for a model
    seq_len: int | None = None  # default: the preset's max_seq_len
    n_layers: int | None = None  # default: the preset's
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    case: str | ModelCase | None = None  # a ModelCase (or a reference to one); None: the preset

    def __post_init__(self):
        if self.case is not None:  # a reference is loaded once, so equal cases make equal scenarios
            object.__setattr__(self, "case", load_case(self.case))

    @property
    def mesh_spec(self) -> MeshSpec:
        return MeshSpec.parse(self.mesh)

    @property
    def model_case(self) -> ModelCase | None:
        """The model case, None for a LLaMA preset."""
        return self.case

    @property
    def model_name(self) -> str:
        case = self.model_case
        return self.preset if case is None else case.name

    @property
    def loss_fn(self) -> LossFn:
        case = self.model_case
        return cross_entropy_loss if case is None else case.loss_fn

    def plan_obj(self) -> ParallelPlan:
        kw = {"reshard_after_forward": self.reshard_after_forward}
        if self.param_dtype:
            kw["param_dtype"] = parse_dtype(self.param_dtype)
        if self.reduce_dtype:
            kw["reduce_dtype"] = parse_dtype(self.reduce_dtype)
        case = self.model_case
        if case is not None and self.plan != AUTO:  # the case's TP rules are for fsdp_tp; auto decides
            kw.update(tp_rules=dict(case.tp_rules), tp_regions=case.tp_regions)
        return ParallelPlan.preset(self.plan, **kw)

    def header(self) -> str:
        if self.model_case is not None:
            return f"model={self.model_name} plan={self.plan_obj().describe()} mesh={self.mesh_spec} seed={self.seed}"
        layers = f" layers={self.n_layers}" if self.n_layers else ""
        return f"preset={self.preset}{layers} plan={self.plan_obj().describe()} mesh={self.mesh_spec} seed={self.seed}"

    def model_args(self):
        return model_args(self.preset, **({"n_layers": self.n_layers} if self.n_layers else {}))

    def model(self, device: str = "cpu"):
        case = self.model_case
        if case is not None:
            return case.build(self.seed, device)
        return build_model(self.model_args(), seed=self.seed, device=device)

    @property
    def is_auto(self) -> bool:
        return self.plan == AUTO

    def data_parallel_ranks(self) -> int:
        """How many slices the global batch is split into. plan="auto" has no data dims (the
        planner may split the batch over any mesh dim, or none): it gets the batch a hand plan on
        the same mesh splits over its data dim, the mesh's first (outermost) dim, so both see the
        same workload."""
        plan = self.plan_obj()
        ranks = self.mesh_spec.shape[0] if plan.is_auto else 1
        for d in plan.data_dims:
            ranks *= self.mesh_spec.size(d)
        return ranks

    def batches(self, steps: int = 1) -> list[tuple[torch.Tensor, ...]]:
        """Deterministic global batches: (tokens, next-token labels) for a preset, the case's
        batch factory otherwise."""
        ranks = self.data_parallel_ranks()
        case = self.model_case
        if case is not None:
            return case.batches(ranks * (self.batch_per_rank or case.batch_per_rank), steps, self.seed)
        args = self.model_args()
        seq = self.seq_len or args.max_seq_len
        g = torch.Generator().manual_seed(10_000 + self.seed)
        out = []
        for _ in range(steps):
            data = torch.randint(0, args.vocab_size, (ranks * (self.batch_per_rank or 1), seq + 1), generator=g)
            out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
        return out

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.batches(1)[0]

    def pipeline_inputs(self, device: str = "meta") -> tuple:
        """``(model, loss_fn, example_inputs, plan, mesh spec)``: the leading arguments of
        ``autoparallel.pipeline.run_pipeline`` (model on ``device``: ``meta`` for graphs only, a
        real device where the run executes the module; None: the default token loss)."""
        loss_fn = None if self.model_case is None else self.loss_fn
        return self.model(device=device), loss_fn, self.example_inputs(), self.plan_obj(), self.mesh_spec

    def trace(self, mesh=None) -> JointGraph:
        """The joint graph on a fake world (``mesh``: an already-entered fake world, if any)."""
        model, loss_fn, inputs, plan, spec = self.pipeline_inputs()
        if mesh is not None:
            return build_joint_graph(model, plan, mesh, inputs, loss_fn)
        with fake_world(spec) as m:
            return build_joint_graph(model, plan, m, inputs, loss_fn)


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """The scenario spelling of a dtype (``torch.bfloat16`` -> ``"bf16"``), None for None."""
    if dtype is None:
        return None
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} has no scenario name; valid: {sorted(set(_DTYPES.values()), key=str)}")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a scenario or flag names (bf16, fp32, ...); ValueError naming the valid ones."""
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
    model = f"--preset {scenario.preset}" if scenario.model_case is None else f"--model {scenario.model_name}"
    try:
        scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    except ValueError as e:
        raise ValueError(f"--plan {scenario.plan} --mesh {scenario.mesh_spec} {model}: {e}") from None


def parameter_count(scenario: Scenario) -> int:
    return sum(p.numel() for p in scenario.model(device="meta").parameters())
