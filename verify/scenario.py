"""Named configurations (preset, plan, mesh) and the runs built from them.

A ``Scenario`` is what a golden header, a parity test and the report all describe, so they are
built in one place: the same model seed, the same batches, the same plan options everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoparallel.mesh import MeshSpec, build_mesh, fake_world
from autoparallel.models.llama3 import build_model, model_args
from autoparallel.parallelize import (
    JointGraph,
    ParallelPlan,
    ParallelProgram,
    build_joint_graph,
    split_batch,
)
from autoparallel.parallelize.program import clean_fqn
from autoparallel.runtime import run_on_world
from autoparallel.runtime.rebind import rebind_groups
from autoparallel.runtime.steps import (
    StepTrace,
    eager_program_executor,
    joint_graph_executor,
    train_steps,
)

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

    def batches(self, steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Deterministic global batches (tokens, next-token labels)."""
        args = self.model_args()
        plan = self.plan_obj()
        ranks = 1
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
    together (a dim that does not divide, a plan dim the mesh lacks), before anything runs."""
    try:
        scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    except ValueError as e:
        raise ValueError(f"--plan {scenario.plan} --mesh {scenario.mesh_spec} --preset {scenario.preset}: {e}") from None


def parameter_count(scenario: Scenario) -> int:
    return sum(p.numel() for p in scenario.model(device="meta").parameters())


@dataclass
class RankParity:
    """What one rank computed with each executor, plus its mesh coordinate."""

    coord: tuple[int, ...]
    traces: dict[str, StepTrace]


def _rank_joint_vs_eager(rank, world_size, scenario: Scenario, gm, input_roles, output_roles, batches):
    spec = scenario.mesh_spec
    mesh = build_mesh(spec)
    plan = scenario.plan_obj()
    model = scenario.model()
    program = ParallelProgram(model, plan, mesh)
    coord = mesh.coordinate()
    local_batches = [split_batch(b, plan, spec, coord) for b in batches]
    init = {k: v.detach().clone() for k, v in program.local_parameters().items()}
    buffers = {clean_fqn(n): b for n, b in program.named_buffers()}
    eager = train_steps(eager_program_executor(program), program.local_parameters(), local_batches)
    joint = train_steps(joint_graph_executor(rebind_groups(gm, mesh.group_dims), input_roles, output_roles, buffers), init, local_batches)
    return RankParity(tuple(coord[d] for d in spec.names), {"eager": eager, "joint": joint})


def run_joint_parity(scenario: Scenario, steps: int = 1, timeout_s: float = 120.0) -> list[RankParity]:
    """Trace on a fake world, then run eager and the joint graph on a gloo world of the same mesh."""
    with scenario.trace() as jg:
        gm, in_roles, out_roles = jg.gm, jg.input_roles, jg.output_roles
    batches = scenario.batches(steps)
    return run_on_world(
        _rank_joint_vs_eager,
        scenario.mesh_spec.world_size,
        args=(scenario, gm, in_roles, out_roles, batches),
        timeout_s=timeout_s,
    )


def single_device_step(scenario: Scenario) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and full gradients of the unsharded model on the whole first batch."""
    from autoparallel.parallelize.program import cross_entropy_loss

    model = scenario.model()
    tokens, labels = scenario.batches(1)[0]
    loss = cross_entropy_loss(model(tokens), labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def gather_full_grads(scenario: Scenario, ranks: list[RankParity], executor: str, step: int = 0) -> dict[str, torch.Tensor]:
    """Reassemble each parameter's full gradient from the ranks' shards."""
    shardings = scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    out = {}
    for fqn, sharding in shardings.items():
        pieces = {r.coord: r.traces[executor].grads[step][fqn] for r in ranks}
        out[fqn] = sharding.unshard(pieces, scenario.mesh_spec)
    return out


# --- compile stack: first partition and second compile ------------------------------------------

COMPILE_EXECUTORS = ("eager", "first_partition", "second_compile")
_RANK_THREADS = 1


def _rank_compile_parity(rank, world_size, scenario: Scenario, batches, mod, compiled, traced_dims, enable_ac):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from autoparallel.compile import autoparallel_backend
    from autoparallel.partition import apply_placement
    from autoparallel.runtime.steps import compiled_module_executor, parallel_module_executor

    spec = scenario.mesh_spec
    mesh = build_mesh(spec)
    plan = scenario.plan_obj()
    program = ParallelProgram(scenario.model(), plan, mesh)
    coord = mesh.coordinate()
    local_batches = [split_batch(b, plan, spec, coord) for b in batches]
    init = {k: v.detach().clone() for k, v in program.local_parameters().items()}
    buffers = {clean_fqn(n): b for n, b in program.named_buffers()}
    fresh = lambda: {k: v.clone() for k, v in init.items()}  # noqa: E731
    inherited = mesh.group_dims == traced_dims
    if not inherited:
        # Sub-mesh groups get rank-dependent names on a real world (every rank numbers only the
        # groups it belongs to), so the inherited graphs name other groups: build them here.
        # Tracing runs on fake tensors and does not communicate.
        torch._dynamo.reset()
        params = fresh()  # before tracing: the trace keeps its fake mode entered until apply_placement
        mod = apply_placement(scenario.trace(mesh), params, buffers)
        compiled = torch.compile(mod, backend=autoparallel_backend(enable_ac=enable_ac))
    else:
        for fqn, b in buffers.items():
            mod.model.get_buffer(fqn).copy_(b)
    traces = {"eager": train_steps(eager_program_executor(program), program.local_parameters(), local_batches)}
    traces["first_partition"] = train_steps(parallel_module_executor(mod), fresh(), local_batches)
    graphs_before = counters["stats"]["unique_graphs"]
    traces["second_compile"] = train_steps(compiled_module_executor(mod, compiled), fresh(), local_batches)
    if inherited and counters["stats"]["unique_graphs"] != graphs_before:
        raise RuntimeError(
            "torch.compile recompiled the module in the rank: the parity run would not test the "
            "graphs compiled (and captured) on the fake world; check Dynamo's recompile reasons"
        )
    return RankParity(tuple(coord[d] for d in spec.names), traces)


def run_compile_parity(
    scenario: Scenario, steps: int = 1, *, enable_ac: bool = False, timeout_s: float = 180.0
) -> list[RankParity]:
    """Train ``steps`` steps (AdamW between) on a gloo world of the scenario's mesh with the eager
    parallel program, the first partition's ParallelModule and its torch.compile'd version
    (aot_eager-style autoparallel_backend); per-rank traces keyed by ``COMPILE_EXECUTORS``.

    The graphs are traced, partitioned and compiled once, in this process on a fake world of the
    same mesh (graphs are rank-agnostic; compiling on fake tensors does not communicate, and the
    first forward there only triggers the compile); the forked ranks inherit the module and the
    compiled code, load their own shards and run. That needs the gloo world to name its groups
    as the fake world did, which holds for 1-D meshes; a rank whose groups are named otherwise
    (sub-meshes of an N-D mesh) traces and compiles for itself.
    """
    import torch._dynamo

    threads = torch.get_num_threads()
    # Dynamo guards on the thread count: compile with the ranks' (run_on_world's one thread).
    torch.set_num_threads(_RANK_THREADS)
    try:
        cs = compile_pipeline(scenario, enable_ac=enable_ac, keep_compiled=True)
    finally:
        torch.set_num_threads(threads)
    try:
        return run_on_world(
            _rank_compile_parity,
            scenario.mesh_spec.world_size,
            args=(scenario, scenario.batches(steps), cs.module, cs.compiled, cs.group_dims, enable_ac),
            timeout_s=timeout_s,
            num_threads=_RANK_THREADS,
        )
    finally:
        torch._dynamo.reset()


@dataclass
class CompiledScenario:
    """A scenario through the compile stack on a fake world (graphs only; values meaningless)."""

    module: object  # autoparallel.runtime.parallel_module.ParallelModule
    first_partition: tuple  # (fw GraphModule, bw GraphModule)
    second_compile: tuple  # (fw GraphModule, bw GraphModule)
    group_dims: dict
    compiled: object = None  # the torch.compile'd module (keep_compiled=True only)
    collective_metrics: object = None  # PipelineMetrics when collective_passes were run


class _StopAfterPartition(Exception):
    """Raised by the partition hook to end a graphs-only compile before anything executes."""


def _caused_by(exc: BaseException | None, kind: type) -> bool:
    while exc is not None:
        if isinstance(exc, kind):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def compile_pipeline(
    scenario: Scenario,
    *,
    enable_ac: bool = False,
    mesh=None,
    keep_compiled: bool = False,
    module=None,
    collective_passes=None,
) -> CompiledScenario:
    """Trace, apply_placement and torch.compile (forward once, which partitions) on a fake world
    (``mesh``: an already-entered one). Both stages' graphs carry ``gm.meta[GM_GROUP_DIMS]`` and
    placeholder roles. ``module``: a ParallelModule of this scenario from an earlier call, to
    compile again (e.g. with another backend setting) without re-tracing; a fresh fake world
    names its groups as the one it was traced on did. ``collective_passes`` (a
    CollectivePassesConfig): the second compile also runs the collective passes, and
    ``second_compile`` holds their output graphs. With ``keep_compiled`` the compiled module
    is returned and Dynamo's cache is left for the caller to reset (``torch._dynamo.reset()``)."""
    import torch._dynamo

    from autoparallel.compile import autoparallel_backend
    from autoparallel.mesh import attach_group_dims
    from autoparallel.partition import apply_placement

    if mesh is None:
        with fake_world(scenario.mesh_spec) as m:
            return compile_pipeline(
                scenario,
                enable_ac=enable_ac,
                mesh=m,
                keep_compiled=keep_compiled,
                module=module,
                collective_passes=collective_passes,
            )
    mod = module if module is not None else apply_placement(scenario.trace(mesh))
    if mod.group_dims != mesh.group_dims:
        raise ValueError(f"module was traced with groups {mod.group_dims}, this world has {mesh.group_dims}")
    captured: dict = {}

    def stop_if_graphs_only():
        if not keep_compiled:
            # Graphs are all we want: do not run the compiled forward (at 8B shapes that would
            # compute real activations and logits on this CPU).
            raise _StopAfterPartition

    def on_partition(fw, bw):
        captured.update(fw=fw, bw=bw)
        if collective_passes is None:
            stop_if_graphs_only()

    def on_collective_passes(fw, bw, metrics):
        captured.update(fw=fw, bw=bw, metrics=metrics)
        stop_if_graphs_only()

    backend = autoparallel_backend(
        enable_ac=enable_ac,
        on_partition=on_partition,
        collective_passes=collective_passes,
        on_collective_passes=on_collective_passes,
        group_dims=mesh.group_dims,
    )
    local = split_batch(scenario.example_inputs(), scenario.plan_obj(), scenario.mesh_spec, mesh.coordinate())
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend=backend)
    try:
        compiled(*local)
    except Exception as e:
        if not _caused_by(e, _StopAfterPartition):
            raise
    finally:
        if not keep_compiled:
            torch._dynamo.reset()
    for gm in (captured["fw"], captured["bw"]):
        attach_group_dims(gm, mesh.group_dims)
    fp = mod.first_partition
    return CompiledScenario(
        mod,
        (fp.fw, fp.bw),
        (captured["fw"], captured["bw"]),
        dict(mesh.group_dims),
        compiled if keep_compiled else None,
        captured.get("metrics"),
    )


def compile_stages(scenario: Scenario, *, enable_ac: bool = False) -> dict[str, tuple]:
    """``{"first_partition": (fw, bw), "second_compile": (fw, bw)}`` GraphModules of a scenario,
    for goldens and the report."""
    cs = compile_pipeline(scenario, enable_ac=enable_ac)
    return {"first_partition": cs.first_partition, "second_compile": cs.second_compile}
