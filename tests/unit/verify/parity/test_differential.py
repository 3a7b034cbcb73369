"""verify.parity.differential: programs run on N simulated ranks (LocalTensorMode collectives), compared bitwise.

Hand-built graphs only (the pipeline's graphs: tests/golden/test_pass_invariants.py; generated
graphs: tests/property/test_differential_properties.py). Every check is also fed what it must
reject: an op changed, an output missing, inputs that do not match, ranks whose graphs differ.
"""

from __future__ import annotations

import pytest
import torch

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.fx_utils import ALL_GATHER_OUT, group_of
from autoparallel.mesh import fake_world
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    tag_collectives_for_bucketing,
)
from autoparallel.runtime.rebind import rebind_groups
from verify.graphs.generators import GraphBuilder, GraphSpec, OpSpec, build_synthetic, mesh_groups
from verify.parity import differential as D

aten = torch.ops.aten
MESH = "dp=8,tp=2"  # 16 simulated ranks


def _collectives_graph(groups):
    """x -> all-gather, reduce-scatter, all-reduce on every group; outputs labelled by group."""
    b = GraphBuilder(groups)
    x = b.placeholder("x", (2, 4), role=roles.input_(0))
    outs, labels = [], []
    for label, (_, size) in sorted(groups.items()):
        outs += [b.all_gather(x, label), b.reduce_scatter(b.call(aten.cat.default, [x] * size), label),
                 b.all_reduce(x, label)]
        labels += [f"ag {label}", f"rs {label}", f"ar {label}"]
    return b.output(outs, labels)


def test_collectives_of_every_group_compute_what_their_definitions_say():
    with D.simulated_world(MESH) as world:
        feeds = D.Feeds(16)
        out = D.run_graph(_collectives_graph(mesh_groups(world)), feeds)
        x = feeds._made[roles.input_(0)]
    dp = [[t + 2 * i for i in range(8)] for t in range(2)]  # rank = dp * 2 + tp: a dp group is one tp column
    tp = [[2 * d, 2 * d + 1] for d in range(8)]
    for r in range(16):
        col = dp[r % 2]
        assert torch.equal(out["ag dp"][r], torch.cat([x[i] for i in col]))
        assert torch.equal(out["ag tp"][r], torch.cat([x[i] for i in tp[r // 2]]))
        assert torch.equal(out["ag dp*tp"][r], torch.cat([x[i] for i in range(16)]))
        summed = x[col[0]]
        for i in col[1:]:  # LocalTensor reduces in rank order
            summed = summed + x[i]
        assert torch.equal(out["ar dp"][r], summed)
        assert torch.equal(out["rs dp"][r], summed)  # cat([x] * 8) scattered: every rank gets sum(x)


def test_lockstep_engine_matches_the_whole_graph_under_local_tensor_mode():
    spec = GraphSpec(8, 2, tuple(OpSpec(k, a=i % 3, b=1, label=lab, variant=i % 4) for i, (k, lab) in enumerate(
        [("param_ag", "dp"), ("grad_rs", "dp"), ("act_all_reduce", "tp"), ("param_ag_chain", "dp"),
         ("unary", "dp"), ("grad_ar", "tp")])))
    with D.simulated_world("dp=4,tp=2") as world:
        gm = build_synthetic(spec, mesh_groups(world)).gm
        lockstep = D.run_graph(gm, D.Feeds(8, seed=3))
        whole = D.run_graph(gm, D.Feeds(8, seed=3), engine=D.LOCAL_TENSOR)
    assert set(lockstep) == set(whole)
    for key in lockstep:
        for r in range(8):
            assert torch.equal(lockstep[key][r], whole[key][r]), f"{key} rank {r}"


def _add_graph(op=aten.add.Tensor):
    b = GraphBuilder({})
    x = b.placeholder("x", (3,), role=roles.input_(0))
    y = b.placeholder("y", (3,), role=roles.input_(1))
    s = b.call(op, x, y)
    s.name = "combine"
    return b.output([b.call(aten.mul.Tensor, s, x)], [roles.LOSS])


def test_a_changed_op_is_found_with_its_node_and_both_values():
    with D.simulated_world("dp=2"):
        check = D.compare_programs("flip", _add_graph(), _add_graph(aten.sub.Tensor), D.Feeds(2))
    assert not check.equal
    assert check.first_output().name == "loss@rank0"
    assert (check.first_node.node, check.first_node.op, check.first_node.rank) == ("combine", "aten.add -> aten.sub", 0)
    assert " vs " in check.first_node.note and "first at" in check.first_node.note
    assert "VALUES DIFFER" in check.summary() and "combine" in check.summary()


def test_equal_programs_compare_every_output_on_every_rank():
    with D.simulated_world("dp=4"):
        check = D.compare_programs("same", _add_graph(), _add_graph(), D.Feeds(4))
    assert check.equal and len(check.report.diffs) == 4 and check.first_node is None


def test_an_output_missing_on_one_side_is_a_mismatch():
    b = GraphBuilder({})
    x = b.placeholder("x", (3,), role=roles.input_(0))
    less = b.output([b.call(aten.neg.default, x)], ["output:0"])
    with D.simulated_world("dp=2"):
        check = D.compare_programs("drop", _add_graph(), less, D.Feeds(2), locate=False)
    assert not check.equal
    notes = {d.name: d.note for d in check.report.mismatches()}
    assert notes["loss"] == "missing in after" and notes["output:0"] == "missing in before"


def test_one_input_read_with_two_shapes_is_an_error_naming_it():
    b = GraphBuilder({})
    other = b.output([b.call(aten.neg.default, b.placeholder("z", (4,), role=roles.input_(0)))], [roles.LOSS])
    with D.simulated_world("dp=2"), pytest.raises(ValueError, match=r"placeholder 'z' reads 'input:0'"):
        D.compare_programs("bad", _add_graph(), other, D.Feeds(2))


def test_integer_inputs_stay_in_the_range_their_uses_allow():
    b = GraphBuilder({})
    w = b.placeholder("w", (5, 3), role=roles.param("emb"))
    idx = b.placeholder("idx", (64,), dtype=torch.int64, role=roles.input_(0))
    gm = b.output([b.call(aten.embedding.default, w, b.call(aten.view.default, idx, [8, 8]))], ["output:0"])
    feeds = D.Feeds(3)
    with D.simulated_world("dp=3"):
        D.run_graph(gm, feeds)
    values = torch.stack(feeds._made[roles.input_(0)])
    assert values.min() >= 0 and values.max() == 4  # 3 x 64 draws reach the last row

    b = GraphBuilder({})
    loose = b.output([b.call(aten.neg.default, b.placeholder("n", (4,), dtype=torch.int64, role=roles.input_(1)))], ["output:0"])
    with D.simulated_world("dp=2"), pytest.raises(ValueError, match=r"integer input 'input:1': cannot tell the range"):
        D.run_graph(loose, D.Feeds(2))


def test_a_pair_runs_its_backward_on_what_its_forward_saved():
    """fw: loss = sum(x * w), saves x; bw: grad = saved * tangent. Same values as the joint."""

    def graph(pieces):
        b = GraphBuilder({})
        w = b.placeholder("w", (4,), role=roles.param("w"))
        x = b.placeholder("x", (4,), role=roles.input_(0))
        t = b.placeholder("t", (), role=roles.tangent(roles.LOSS))
        return b, w, x, t, pieces

    b, w, x, t, _ = graph(None)
    loss = b.call(aten.sum.default, b.call(aten.mul.Tensor, x, w))
    joint = b.output([loss, b.call(aten.mul.Tensor, x, t)], [roles.LOSS, roles.grad("w")])
    fb = GraphBuilder({})
    fw_w, fw_x = fb.placeholder("w", (4,), role=roles.param("w")), fb.placeholder("x", (4,), role=roles.input_(0))
    fw = fb.output([fb.call(aten.sum.default, fb.call(aten.mul.Tensor, fw_x, fw_w)), fw_x], [roles.LOSS, roles.saved(0)])
    bb = GraphBuilder({})
    s, tan = bb.placeholder("x", (4,), role=roles.saved(0)), bb.placeholder("t", (), role=roles.tangent(roles.LOSS))
    bw = bb.output([bb.call(aten.mul.Tensor, s, tan)], [roles.grad("w")])
    with D.simulated_world("dp=2"):
        check = D.compare_programs("partition", joint, (fw, bw), D.Feeds(2))
    assert check.equal, check.summary()
    assert "saved values differ in signature (0 vs 1)" in check.note


def test_ranks_whose_graphs_do_not_line_up_are_an_error():
    with D.simulated_world("dp=2"), pytest.raises(ValueError, match=r"rank 1's node 'combine' .* does not line up"):
        D.run_graph([_add_graph(), _add_graph(aten.sub.Tensor)], D.Feeds(2))
    with D.simulated_world("dp=2"), pytest.raises(ValueError, match="2 graphs for 3 ranks"):
        D.run_graph([_add_graph(), _add_graph()], D.Feeds(3))


def test_collective_arguments_that_differ_between_ranks_are_an_error():
    with D.simulated_world("dp=2") as world:
        groups = mesh_groups(world)
        graphs = []
        for size in (2, 3):  # a group size baked in differently on each rank
            b = GraphBuilder(groups)
            x = b.placeholder("x", (2,), role=roles.input_(0))
            node = b.graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", groups["dp"][0]))
            node.meta[M.VAL] = x.meta[M.VAL]
            node.args = (x, "sum" if size == 2 else "avg", groups["dp"][0])
            graphs.append(b.output([node], ["output:0"]))
        with pytest.raises(ValueError, match=r"collective 'all_reduce_default': argument 1 differs between ranks \(\['sum', 'avg'\]\)"):
            D.run_graph(graphs, D.Feeds(2))


def test_unknown_engine_is_named():
    with D.simulated_world("dp=2"), pytest.raises(ValueError, match=r"unknown engine 'gloo'; engines: \['lockstep', 'local_tensor'\]"):
        D.run_graph(_add_graph(), D.Feeds(2), engine="gloo")


# --- rank-specific graphs: what LocalTensorMode alone cannot run ------------------------------------

GATHERS = GraphSpec(8, 2, tuple(OpSpec("param_ag", a=0, rows=r) for r in (1, 2, 1)) + (OpSpec("grad_rs", a=0, b=1),))


def _bucketed_for_rank(rank: int):
    """The generated graph bucketed on rank ``rank`` of a fake dp=4 world (merged all-gathers bake
    the rank's copy-in offset into the graph)."""
    with fake_world("dp=4", rank=rank) as mesh:
        gm = build_synthetic(GATHERS, mesh_groups(mesh)).gm
        tag_collectives_for_bucketing(gm)
        bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=1.0))
        return gm, mesh.group_name("dp")


def test_rank_specific_bucketed_graphs_run_per_rank_and_match_the_unbucketed_graph():
    per_rank = [_bucketed_for_rank(r)[0] for r in range(4)]
    assert all(len(gm.graph.find_nodes(op="call_function", target=ALL_GATHER_OUT)) == 1 for gm in per_rank)
    assert per_rank[0].code != per_rank[3].code  # the offset differs: not one SPMD program
    with D.simulated_world("dp=4") as world:
        plain = build_synthetic(GATHERS, mesh_groups(world)).gm
        feeds = D.Feeds(4)
        want = D.run_graph(plain, feeds)
        got = D.run_graph(per_rank, feeds)
    assert D.compare_results(want, got, "plain", "bucketed per rank").bitwise


def test_copy_in_offsets_are_checked_per_rank():
    for rank in range(4):
        gm, dp = _bucketed_for_rank(rank)
        assert D.check_copy_in_offsets(gm, {dp: rank}) == []
    gm, dp = _bucketed_for_rank(0)
    ((_, offset, numel),) = D.copy_in_offsets(gm)
    assert (offset, numel) == (0, 32)  # 1 + 2 + 1 rows of 8
    (problem,) = D.check_copy_in_offsets(gm, {dp: 3})  # rank 0's graph is wrong on rank 3
    assert problem == f"all_gather_into_tensor_out: copies in at element 0, rank 3 of group {dp} must at 96"


def test_bind_renames_groups_to_the_running_world():
    with D.simulated_world("dp=2") as world:
        same = _collectives_graph(mesh_groups(world))
        assert D.bind(same, world) is same
        other = rebind_groups(same, {f"x{name}": label for name, label in world.group_dims.items()})
        assert {group_of(n) for n in other.graph.nodes} - {None} == {f"x{n}" for n in world.group_dims}
        bound = D.bind((other, other), world)
        assert {group_of(n) for n in bound[0].graph.nodes} - {None} == set(world.group_dims)
        assert D.compare_programs("bound", same, bound[0], D.Feeds(2)).equal


def _dropout_graph():
    b = GraphBuilder({})
    x = b.placeholder("x", (64,), role=roles.input_(0))
    mask = b.call(aten.bernoulli.p, x, 0.5)
    return b.output([b.call(aten.mul.Tensor, x, mask)], [roles.user_output(0)])


def test_a_draw_seed_gives_every_simulated_rank_the_draws_of_one_rank_seeded_so():
    """Feeds.draw_seed: each simulated rank draws from its own generator, so each draws what one
    rank whose generator is seeded ``draw_seed`` draws (a rank's graphs traced per rank hold the
    routing its own draws give); without it the ranks share one generator and rank 1 draws on."""
    x = torch.ones(64)
    torch.manual_seed(7)
    want = x * torch.bernoulli(x, 0.5)
    with D.simulated_world("dp=2"):
        own = D.run_program(_dropout_graph(), D.Feeds(2, given={roles.input_(0): (x, x)}, draw_seed=7)).result
        shared = D.run_program(_dropout_graph(), D.Feeds(2, seed=7, given={roles.input_(0): (x, x)})).result
    (out,) = own.values()
    assert torch.equal(out[0], want) and torch.equal(out[1], want)
    (out,) = shared.values()
    assert torch.equal(out[0], want) and not torch.equal(out[1], want)
