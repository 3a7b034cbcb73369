"""Collective passes on real gloo worlds: bucketed fw/bw graphs train bitwise like unbucketed ones,
and fused chained all-gathers give the same values as the chains they replace.

The fw/bw graphs are the first partition of ``autoparallel.partition.apply_placement`` (FSDP
all-gathers recomputed in the backward), with the pre-overlap tags written on the joint graph
before it. Bucketing runs inside each rank, after the graphs are rebound to that rank's groups:
PyTorch's all-gather merge bakes the rank into the graph.
"""

from __future__ import annotations

import pytest
import torch

from autoparallel.mesh import build_mesh, fake_world
from autoparallel.parallelize import ParallelProgram, split_batch
from autoparallel.parallelize.program import clean_fqn
from autoparallel.partition import apply_placement
from autoparallel.passes.collective import bucket_fw_bw, tag_joint
from autoparallel.passes.fuse_chained_allgathers import fuse_chained_allgathers
from autoparallel.runtime.rebind import rebind_groups
from autoparallel.runtime.steps import primals_by_role, train_steps
from verify.graphs.generators import GraphBuilder, mesh_groups
from verify.parity.compare import compare_traces, merge_reports
from verify.parity.ordered_collectives import run_parity_world
from verify.stages.scenario import Scenario

SCENARIOS = {
    "fsdp-dp2": Scenario(mesh="dp=2"),
    "ddp-dp2": Scenario(plan="ddp", mesh="dp=2"),
    "fsdp-bf16-dp2": Scenario(mesh="dp=2", param_dtype="bf16", reduce_dtype="fp32"),
}
STEPS = 3


def split_graph_executor(fw, bw, input_roles, output_roles, buffers, num_fwd):
    """Runs the forward graph, then the backward graph on its saved values (one training step)."""
    n_tangents = sum(1 for r in input_roles if r.startswith("tangent:"))
    grad_roles = [r for r in output_roles if r is not None and r.startswith("grad:")]

    def run(params, inputs):
        primals = primals_by_role(input_roles, params, buffers, inputs)
        with torch.no_grad():
            outs = fw(*primals)
            grads = bw(*outs[num_fwd:], *([torch.ones((), dtype=torch.float32)] * n_tangents))
        named = dict(
            zip(
                (r.partition(":")[2] for r in grad_roles),
                [g for g in grads if g is not None],
                strict=True,
            )
        )
        return outs[0].detach(), named

    return run


def _rank_bucketed_vs_plain(rank, world_size, sc, fw, bw, in_roles, out_roles, num_fwd, batches):
    mesh = build_mesh(sc.mesh_spec)
    plan = sc.plan_obj()
    program = ParallelProgram(sc.model(), plan, mesh)
    local = [split_batch(b, plan, sc.mesh_spec, mesh.coordinate()) for b in batches]
    init = {k: v.detach().clone() for k, v in program.local_parameters().items()}
    buffers = {clean_fqn(n): b for n, b in program.named_buffers()}
    traces = {}
    for name in ("plain", "bucketed"):
        f, b = rebind_groups(fw, mesh.group_dims), rebind_groups(bw, mesh.group_dims)
        counts = None
        if name == "bucketed":
            f, b, metrics = bucket_fw_bw(f, b)
            counts = metrics.counts
        params = {k: v.clone() for k, v in init.items()}
        traces[name] = train_steps(
            split_graph_executor(f, b, in_roles, out_roles, buffers, num_fwd), params, local
        )
    return traces, counts


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xdist_group(f"bucketing-parity-{n}")) for n in sorted(SCENARIOS)]
)
def test_bucketed_fw_bw_bitwise_equal_unbucketed_for_three_steps(name):
    sc = SCENARIOS[name]
    with fake_world(sc.mesh_spec) as mesh:
        jg = sc.trace(mesh)
        tag_joint(jg.gm)
        roles = (jg.input_roles, jg.output_roles)
        first = apply_placement(jg).first_partition  # consumes jg
        args = (sc, first.fw, first.bw, *roles, first.num_fwd_outputs)
    ranks = run_parity_world(
        _rank_bucketed_vs_plain, sc.mesh_spec.world_size, args=(*args, sc.batches(STEPS))
    )
    for _, counts in ranks:  # the pass really bucketed (the backward recomputes the all-gathers)
        if sc.plan == "ddp":
            assert counts["bw"]["all_reduce"] == (21, 1), counts
        else:
            assert counts["fw"]["all_gather"] == (21, 1), counts
            assert counts["bw"]["all_gather"] == (20, 1) and counts["bw"]["reduce_scatter"] == (
                21,
                1,
            ), counts
    reports = [
        compare_traces(t["plain"], t["bucketed"], a_name="unbucketed", b_name="bucketed")
        for t, _ in ranks
    ]
    report = merge_reports(reports, [f"rank{i}" for i in range(len(ranks))])
    assert len(report.diffs) == len(ranks) * STEPS * 22  # loss + 21 grads per step
    report.assert_bitwise()


# --- chained all-gather fusion on a 2x2 world ------------------------------------------------------


def _chains(b):
    """dp -> tp (direct), tp -> dp (direct), dp -> tp through t().t(): the three chain shapes."""

    def chain(first, second, tt=False):
        v = b.all_gather(b.param((3, 5)), first)
        if tt:
            v = b.call(torch.ops.aten.t.default, b.call(torch.ops.aten.t.default, v))
        return b.all_gather(v, second)

    return [chain("dp", "tp"), chain("tp", "dp"), chain("dp", "tp", tt=True)]


def _rank_fused_vs_chained(rank, world_size):
    mesh = build_mesh("dp=2,tp=2")
    results = {}
    for name in ("chained", "fused"):
        b = GraphBuilder(mesh_groups(mesh))
        outs = _chains(b)
        gm = b.output(outs, [f"output:{i}" for i in range(len(outs))])
        fused = fuse_chained_allgathers(gm, mesh.group_dims) if name == "fused" else 0
        g = torch.Generator().manual_seed(1000 + rank)
        shards = [torch.randn(3, 5, generator=g) for _ in range(3)]
        results[name] = (fused, [t.clone() for t in gm(*shards)], shards)
    return results


def test_fused_chained_allgathers_equal_unfused_on_2x2_gloo():
    ranks = run_parity_world(_rank_fused_vs_chained, 4)
    all_shards = [r["chained"][2] for r in ranks]
    for rank, r in enumerate(ranks):
        assert r["fused"][0] == 3 and r["chained"][0] == 0
        for i, (a, b) in enumerate(zip(r["chained"][1], r["fused"][1], strict=True)):
            assert torch.equal(a, b), f"rank {rank} output {i} differs after fusion"
        # And both are what the chain means: dp -> tp is cat over tp of cat over dp.
        dp, tp = divmod(rank, 2)
        expect0 = torch.cat(
            [torch.cat([all_shards[d * 2 + t][0] for d in range(2)]) for t in range(2)]
        )
        expect1 = torch.cat([all_shards[k][1] for k in range(4)])  # tp -> dp: row-major ranks
        assert torch.equal(r["fused"][1][0], expect0) and torch.equal(r["fused"][1][1], expect1)
