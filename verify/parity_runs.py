"""Parity runs built from a scenario: the same plan on a real gloo world, executor by executor.

* :func:`run_joint_parity`: the eager parallel program vs the traced joint graph, per rank;
* :func:`run_compile_parity`: the eager program vs the first partition's ``ParallelModule`` vs its
  ``torch.compile``'d version (``autoparallel_backend``), the graphs compiled once here through
  ``autoparallel.pipeline`` and inherited by the forked ranks;
* :func:`single_device_step` / :func:`gather_full_grads`: the unsharded reference and the ranks'
  shards reassembled, for the single-device comparison.

``verify.parity`` compares what these return (bitwise, with a diff report).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from autoparallel.compile import SECOND_COMPILE, autoparallel_backend
from autoparallel.mesh import build_mesh
from autoparallel.parallelize import ParallelProgram, cross_entropy_loss, split_batch
from autoparallel.parallelize.program import clean_fqn
from autoparallel.partition import STEP_FIRST_PARTITION, apply_placement
from autoparallel.pipeline import JOINT, PipelineOptions, run_pipeline
from autoparallel.runtime import run_on_world
from autoparallel.runtime.rebind import rebind_groups
from autoparallel.runtime.steps import (
    StepTrace,
    compiled_module_executor,
    eager_program_executor,
    joint_graph_executor,
    parallel_module_executor,
    train_steps,
)
from verify.scenario import Scenario

EAGER = "eager"  # the eager parallel program: the reference every executor is compared with


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
    return RankParity(tuple(coord[d] for d in spec.names), {EAGER: eager, JOINT: joint})


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
    model = scenario.model()
    tokens, labels = scenario.batches(1)[0]
    loss = cross_entropy_loss(model(tokens), labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# Single-device eager sums in another order than the ranks: the bound on the max |diff| of the
# gathered gradients, per parameter dtype. What the reduction-order noise measured on the tiny
# preset (fp32: ~1e-7, bf16 params: ~3e-3), with a margin of ~10x.
SINGLE_DEVICE_ATOL = {torch.float32: 2e-6, torch.bfloat16: 3e-2}


def single_device_tolerance(scenario: Scenario) -> float:
    """The oracle's tolerance for ``scenario``: by the dtype its plan computes in."""
    dtype = scenario.plan_obj().param_dtype or torch.float32
    if dtype not in SINGLE_DEVICE_ATOL:
        raise ValueError(f"no single-device tolerance for param dtype {dtype}; known: {sorted(map(str, SINGLE_DEVICE_ATOL))}")
    return SINGLE_DEVICE_ATOL[dtype]


def gather_full_grads(scenario: Scenario, ranks: list[RankParity], executor: str, step: int = 0) -> dict[str, torch.Tensor]:
    """Reassemble each parameter's full gradient from the ranks' shards."""
    shardings = scenario.plan_obj().resolve(scenario.model(device="meta"), scenario.mesh_spec)
    out = {}
    for fqn, sharding in shardings.items():
        pieces = {r.coord: r.traces[executor].grads[step][fqn] for r in ranks}
        out[fqn] = sharding.unshard(pieces, scenario.mesh_spec)
    return out


# --- compile stack: first partition and second compile ------------------------------------------

COMPILE_EXECUTORS = (EAGER, STEP_FIRST_PARTITION, SECOND_COMPILE)
_RANK_THREADS = 1


def _rank_compile_parity(rank, world_size, scenario: Scenario, batches, mod, compiled, traced_dims, enable_ac):
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
    traces = {EAGER: train_steps(eager_program_executor(program), program.local_parameters(), local_batches)}
    traces[STEP_FIRST_PARTITION] = train_steps(parallel_module_executor(mod), fresh(), local_batches)
    graphs_before = counters["stats"]["unique_graphs"]
    traces[SECOND_COMPILE] = train_steps(compiled_module_executor(mod, compiled), fresh(), local_batches)
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
    threads = torch.get_num_threads()
    # Dynamo guards on the thread count: compile with the ranks' (run_on_world's one thread).
    torch.set_num_threads(_RANK_THREADS)
    try:
        options = PipelineOptions(enable_ac=enable_ac, keep_compiled=True, snapshots=False)
        run = run_pipeline(*scenario.pipeline_inputs(), options, until=SECOND_COMPILE)
    finally:
        torch.set_num_threads(threads)
    try:
        return run_on_world(
            _rank_compile_parity,
            scenario.mesh_spec.world_size,
            args=(scenario, scenario.batches(steps), run.module, run.compiled, run.group_dims, enable_ac),
            timeout_s=timeout_s,
            num_threads=_RANK_THREADS,
        )
    finally:
        torch._dynamo.reset()
