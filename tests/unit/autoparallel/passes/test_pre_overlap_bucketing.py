"""Pre-overlap bucketing: tags written on the joint graph, carried through the fw/bw split by node
meta, merged on the split graphs with PyTorch's merge functions (hand-built and traced graphs).

The split graphs come from upstream ``default_partition`` (the project's own partitioner is
built separately); what matters here is that the partitioner copies node meta.
"""

from __future__ import annotations

import pytest
import torch
from torch._functorch.partitioners import default_partition

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.fx_utils import ALL_GATHER, REDUCE_SCATTER, copy_graph_module
from autoparallel.mesh import attach_group_dims, fake_world
from autoparallel.partition import apply_placement
from autoparallel.passes.pre_overlap_bucketing import (
    TAG_FSDP_AG,
    TAG_GRAD_AR,
    TAG_GRAD_RS,
    PreOverlapConfig,
    bucket_tagged_collectives,
    collective_counts,
    gradient_terminal_nodes,
    param_derived_nodes,
    tag_collectives_for_bucketing,
)
from autoparallel.runtime.rebind import rebind_groups
from verify.goldens.catalog import GOLDEN_SCENARIOS, golden_run
from verify.graphs.generators import GraphBuilder, mesh_groups
from verify.stages.scenario import Scenario

aten = torch.ops.aten
H = 64

SCENARIOS = {
    "fsdp-dp8": Scenario(mesh="dp=8"),
    "fsdp_tp-dp4tp2": Scenario(plan="fsdp_tp", mesh="dp=4,tp=2"),
    "ddp-dp2": Scenario(plan="ddp", mesh="dp=2"),
}


# The two FSDP scenarios are golden scenarios of the tier: their joint graphs come from the shared
# golden runs (copied: the tests tag them), on the worker that builds those runs (xdist_group).
GOLDEN_RUN_OF = {"fsdp-dp8": "tiny-fsdp-dp8", "fsdp_tp-dp4tp2": "tiny-fsdp_tp-dp4tp2"}


def _on_its_run(name: str):
    """``name`` as a parameter on the xdist group of the golden run that holds its joint graph."""
    marks = [pytest.mark.xdist_group(GOLDEN_RUN_OF[name])] if name in GOLDEN_RUN_OF else []
    return pytest.param(name, marks=marks)


@pytest.fixture(scope="module")
def _ddp_trace():
    """The DDP scenario (no golden run of it in the tier) traced once per module."""
    with SCENARIOS["ddp-dp2"].trace() as jg:
        return jg.gm, jg.num_fwd_outputs


@pytest.fixture
def traced(request, shared_pipeline_runs):
    """``traced(name) -> (scenario, joint graph, num_fwd_outputs)``: a copy the test may tag."""
    def get(name):
        sc = SCENARIOS[name]
        if name not in GOLDEN_RUN_OF:
            gm, nfwd = request.getfixturevalue("_ddp_trace")
            return sc, copy_graph_module(gm), nfwd
        sid = GOLDEN_RUN_OF[name]
        assert GOLDEN_SCENARIOS[sid] == sc, f"{name} is no longer golden scenario {sid}"
        run = golden_run(sid)
        return sc, copy_graph_module(run.stage("joint").graphs), run.joint.num_fwd_outputs

    return get


def _split(gm, num_fwd_outputs):
    ph = gm.graph.find_nodes(op="placeholder")
    fw, bw = default_partition(gm, [p.meta[M.VAL] for p in ph], num_fwd_outputs=num_fwd_outputs)
    for g in (fw, bw):
        attach_group_dims(g, gm.meta[M.GM_GROUP_DIMS])
    return fw, bw


def _tags(gm):
    out = {}
    for n in gm.graph.nodes:
        if M.bucket_tag(n) is not None:
            out[M.bucket_tag(n)] = out.get(M.bucket_tag(n), 0) + 1
    return out


# --- tagging ------------------------------------------------------------------------------------


EXPECTED_TAGS = {
    "fsdp-dp8": ({TAG_FSDP_AG: 21, TAG_GRAD_RS: 21}, 0),
    # TP all-reduces (activations and their gradients) feed compute: never tagged.
    "fsdp_tp-dp4tp2": ({TAG_FSDP_AG: 21, TAG_GRAD_RS: 21}, 8),
    "ddp-dp2": ({TAG_GRAD_AR: 21}, 0),
}


@pytest.mark.parametrize("name", [_on_its_run(n) for n in EXPECTED_TAGS])
def test_tags_eligible_collectives_on_joint_graph(traced, name):
    expected, untagged = EXPECTED_TAGS[name]
    _, gm, _ = traced(name)
    counts = tag_collectives_for_bucketing(gm)
    assert {k: v for k, v in counts.tagged.items() if v} == expected
    assert counts.untagged == untagged
    assert _tags(gm) == expected


@pytest.mark.xdist_group(GOLDEN_RUN_OF["fsdp-dp8"])
def test_tags_survive_the_fw_bw_split(traced):
    sc, gm, nfwd = traced("fsdp-dp8")
    tag_collectives_for_bucketing(gm)
    fw, bw = _split(gm, nfwd)
    assert _tags(fw) == {TAG_FSDP_AG: 21}
    assert _tags(bw) == {TAG_GRAD_RS: 21}
    for n in fw.graph.nodes:
        if n.target is ALL_GATHER:
            assert M.bucket_tag(n) == TAG_FSDP_AG


# --- bucketing ----------------------------------------------------------------------------------


def _hand_graph(mesh):
    """4 parameter all-gathers, an activation all-gather (not parameter-derived) on the same
    group between them, 3 gradient reduce-scatters and a TP-style activation all-reduce."""
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (8, H), role="input:0")
    acc = x
    for i in range(4):
        w = b.all_gather(b.param((2, H)), "dp")  # [8, 64]
        acc = b.call(aten.mm.default, b.call(aten.mm.default, acc, b.call(aten.t.default, w)), w)
        if i == 1:
            g = b.all_gather(acc, "dp")  # [32, 64], depends on the first two weights
            acc = b.call(aten.sum.dim_IntList, b.call(aten.view.default, g, [4, 8, H]), [0])
    acc = b.all_reduce(acc, "tp")
    grads = [
        b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, acc), acc), "dp")
        for _ in range(3)
    ]
    roles = ["loss"] + [f"grad:g{i}" for i in range(3)]
    return b.output([b.call(aten.sum.default, acc), *grads], roles)


def test_merges_tagged_collectives_on_hand_graph():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        counts = tag_collectives_for_bucketing(gm)
        assert (
            counts.tagged == {TAG_FSDP_AG: 4, TAG_GRAD_RS: 3, TAG_GRAD_AR: 0}
            and counts.untagged == 2
        )
        res = bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=1.0))
        assert res.enabled
        assert res.before == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 1}
        # 4 parameter all-gathers -> 1 bucket; the activation all-gather stays alone.
        assert res.after == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}
        assert res.metrics["all_gather"].num_bucketed == 4
        gm.graph.lint()
        assert [n for n in gm.graph.nodes if n.target is ALL_GATHER][0].args[0].op != "placeholder"


def test_bucket_cap_bounds_each_bucket():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        cap = 2 * 8 * H * 4 / 2**20  # two gathered weights
        res = bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=cap))
        assert res.after["all_gather"] == 3  # 2 buckets of 2 + the activation all-gather
        assert res.metrics["all_gather"].closed_by_bytes == 1
        gm.graph.lint()


def test_pass_is_idempotent():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        first = bucket_tagged_collectives(gm)
        second = bucket_tagged_collectives(gm)
        assert second.before == second.after == first.after


@pytest.mark.xdist_group(GOLDEN_RUN_OF["fsdp-dp8"])
def test_split_fw_bw_graphs_are_bucketed(traced):
    sc, gm, nfwd = traced("fsdp-dp8")
    with fake_world(sc.mesh_spec) as mesh:
        gm = rebind_groups(gm, mesh.group_dims)
        tag_collectives_for_bucketing(gm)
        fw, bw = _split(gm, nfwd)
        small = PreOverlapConfig(bucket_cap_mb=0.05)
        rf = bucket_tagged_collectives(fw, small)
        rb = bucket_tagged_collectives(bw, small)
        assert (rf.before["all_gather"], rf.after["all_gather"]) == (21, 11)
        assert (rb.before["reduce_scatter"], rb.after["reduce_scatter"]) == (21, 11)
        fw.graph.lint()
        bw.graph.lint()
        fw2, bw2 = _split(gm, nfwd)
        assert bucket_tagged_collectives(fw2).after["all_gather"] == 1  # default cap: 25 MB
        assert bucket_tagged_collectives(bw2).after["reduce_scatter"] == 1


def test_disabled_patch_leaves_graph_alone():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        with patches.disabled("pre_overlap_bucketing"):
            res = bucket_tagged_collectives(gm)
        assert not res.enabled and res.after == res.before == collective_counts(gm)


# --- bad input ----------------------------------------------------------------------------------


def test_unknown_process_group_names_the_node():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        rs = [n for n in gm.graph.nodes if n.target is REDUCE_SCATTER][1]
        rs.args = (*rs.args[:3], "nope")
        with pytest.raises(
            ValueError, match=rf"node '{rs.name}' uses unknown process group 'nope'"
        ):
            bucket_tagged_collectives(gm)


@pytest.mark.parametrize("cap", [0, -2.5])
def test_bucket_cap_must_be_positive(cap):
    with pytest.raises(ValueError, match=rf"bucket_cap_mb must be a number of MB > 0, got {cap}"):
        PreOverlapConfig(bucket_cap_mb=cap)


def test_negative_span_is_rejected():
    with pytest.raises(ValueError, match="max_topo_span must be None or an int >= 0, got -3"):
        PreOverlapConfig(max_topo_span=-3)


def test_tagging_needs_output_roles():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        del gm.graph.output_node().meta[M.ROLE]
        with pytest.raises(ValueError, match=r"output node 'output' has no meta\['ap_role'\]"):
            tag_collectives_for_bucketing(gm)


def test_tags_reach_the_first_partitions_recomputed_all_gathers():
    """Through compile stack I's first partition: the backward's recomputed all-gathers are
    node copies of the tagged forward ones, so they carry the tag too."""
    sc = SCENARIOS["fsdp-dp8"]
    with fake_world(sc.mesh_spec) as mesh:
        jg = sc.trace(mesh)
        tag_collectives_for_bucketing(jg.gm)
        first = apply_placement(jg).first_partition
        assert _tags(first.fw) == {TAG_FSDP_AG: 21}
        assert _tags(first.bw) == {TAG_FSDP_AG: 20, TAG_GRAD_RS: 21}  # the last layer's stays saved
        res = bucket_tagged_collectives(first.bw)
        assert (res.after["all_gather"], res.after["reduce_scatter"]) == (1, 1)
        first.bw.graph.lint()


# --- tagging rules on small hand-built graphs ---------------------------------------------------


def test_param_derived_nodes(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (1, H), role="input:0")
    p = b.param((1, H))
    q = b.placeholder("q", (1, H), role="buffer:q")  # not a parameter
    cast = b.call(aten.relu.default, p)
    both = b.call(aten.add.Tensor, cast, p)
    mixed = b.call(aten.add.Tensor, p, x)
    from_x = b.call(aten.relu.default, x)
    gm = b.output([both, mixed, from_x, q], ["loss", "o1", "o2", "o3"])
    assert param_derived_nodes(gm.graph) == {p, cast, both}


def test_param_derived_all_gathers_are_tagged(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (1, H), role="input:0")
    p = b.param((1, H))
    via_relu = b.all_gather(b.call(aten.relu.default, p), "dp")
    of_input = b.all_gather(b.call(aten.relu.default, x), "dp")
    mixed = b.all_gather(b.call(aten.add.Tensor, p, x), "dp")
    gm = b.output([via_relu, of_input, mixed], ["loss", "o1", "o2"])
    counts = tag_collectives_for_bucketing(gm)
    tags = [M.bucket_tag(n) for n in gm.graph.nodes if n.target is ALL_GATHER]
    assert tags == [TAG_FSDP_AG, None, None]
    assert counts.tagged[TAG_FSDP_AG] == 1 and counts.untagged == 2


def test_retagging_clears_stale_tags(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    x = b.placeholder("x", (1, H), role="input:0")
    gm = b.output([b.all_gather(x, "dp")], ["loss"])
    (ag,) = [n for n in gm.graph.nodes if n.target is ALL_GATHER]
    M.set_bucket_tag(ag, TAG_FSDP_AG)
    assert tag_collectives_for_bucketing(gm).untagged == 1
    assert M.bucket_tag(ag) is None


def _grad_graph(mesh, roles, *, shared=False):
    """``g = mm(a.t(), a)``; ``rs = reduce_scatter(g)`` is output with ``roles`` (one role per
    output, the same wait listed len(roles) times). ``shared``: ``g`` also feeds a loss."""
    b = GraphBuilder(mesh_groups(mesh))
    a = b.placeholder("a", (8, H), role="input:0")
    g = b.call(aten.mm.default, b.call(aten.t.default, a), a)
    w = b.reduce_scatter(g, "dp")
    outs = [w] * len(roles)
    if shared:
        outs.append(b.call(aten.sum.default, b.call(aten.relu.default, g)))
        roles = [*roles, "loss"]
    return b.output(outs, roles), a, g, w


def _rs(gm):
    return next(n for n in gm.graph.nodes if n.target is REDUCE_SCATTER)


def test_gradient_terminal_nodes(mesh):
    gm, a, g, w = _grad_graph(mesh, ["grad:p0"])
    rs = _rs(gm)
    # the wait, the reduce-scatter and the mm reach only the gradient through single-input ops;
    # t(a) feeds the two-input mm and the placeholder is never terminal
    assert gradient_terminal_nodes(gm.graph) == {w, rs, g}
    b = GraphBuilder(mesh_groups(mesh))
    dead = b.call(aten.relu.default, b.placeholder("y", (2,), role="input:0"))
    z = b.placeholder("z", (2,), role="input:1")
    gm2 = b.output([b.call(aten.neg.default, z), z], ["grad:p0", "grad:p1"])
    assert dead.users == {}
    assert gradient_terminal_nodes(gm2.graph) == {gm2.graph.output_node().args[0][0]}


@pytest.mark.parametrize(
    "roles",
    [["loss"], ["output:0"], ["grad:p0", "output:1"], ["output:0", "grad:p0"], [None]],
)
def test_collectives_reaching_non_gradients_are_not_tagged(mesh, roles):
    gm, *_ = _grad_graph(mesh, roles)
    counts = tag_collectives_for_bucketing(gm)
    assert counts.tagged[TAG_GRAD_RS] == 0 and counts.untagged == 1
    assert M.bucket_tag(_rs(gm)) is None


def test_node_with_a_gradient_user_and_another_user_is_not_terminal(mesh):
    gm, a, g, w = _grad_graph(mesh, ["grad:p0"], shared=True)
    assert list(g.users)[0].target is REDUCE_SCATTER  # the gradient user comes first
    assert gradient_terminal_nodes(gm.graph) == {w, _rs(gm)}


def test_output_roles_must_match_the_outputs(mesh):
    gm, *_ = _grad_graph(mesh, ["grad:p0", "grad:p1"])
    gm.graph.output_node().meta[M.ROLE] = ["grad:p0", "grad:p1", "loss"]
    with pytest.raises(
        ValueError,
        match=r"^output node 'output': 2 outputs but 3 roles in meta\['ap_role'\]; the labels "
        "do not describe this graph$",
    ):
        gradient_terminal_nodes(gm.graph)
    del gm.graph.output_node().meta[M.ROLE]
    with pytest.raises(
        ValueError,
        match=r"^output node 'output' has no meta\['ap_role'\]: tag on the joint graph from "
        r"autoparallel\.parallelize\.build_joint_graph \(it labels outputs loss / grad:<fqn>\)$",
    ):
        gradient_terminal_nodes(gm.graph)


# --- bucketing details --------------------------------------------------------------------------


def test_result_metrics_per_kind_and_disabled_flag():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        res = bucket_tagged_collectives(gm)
        assert list(res.metrics) == ["all_gather", "reduce_scatter", "all_reduce"]
        assert res.metrics["reduce_scatter"].num_bucketed == 3
        assert res.summary() == "all_gather 5->2, reduce_scatter 3->1, all_reduce 1->1"
        with patches.disabled("pre_overlap_bucketing"):
            off = bucket_tagged_collectives(_hand_graph(mesh))
        assert off.enabled is False and off.metrics == {}
        assert off.summary().endswith(" (patch disabled)")


def test_topo_span_is_passed_to_the_planner():
    with fake_world("dp=4,tp=2") as mesh:
        gm = _hand_graph(mesh)
        tag_collectives_for_bucketing(gm)
        res = bucket_tagged_collectives(gm, PreOverlapConfig(max_topo_span=0))
        assert res.after == res.before
        assert res.metrics["all_gather"].max_topo_span == 0
        assert res.metrics["all_gather"].closed_by_span == 3


@pytest.mark.parametrize("span", [0, 5, None])
def test_valid_spans_are_accepted(span):
    assert PreOverlapConfig(max_topo_span=span).max_topo_span == span


@pytest.mark.parametrize("bad", [True, "3", 2.0])
def test_non_int_spans_are_rejected(bad):
    with pytest.raises(
        ValueError, match=rf"max_topo_span must be None or an int >= 0, got {bad!r}"
    ):
        PreOverlapConfig(max_topo_span=bad)


def test_tagged_collective_needs_a_single_wait(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    name, size = b.group("dp")
    g = b.placeholder("g", (8, H), role="input:0")
    rs = b.call(REDUCE_SCATTER, g, "sum", size, name)
    w1 = b.call(torch.ops._c10d_functional.wait_tensor.default, rs)
    r2 = b.call(aten.relu.default, rs)
    gm = b.output([w1, r2], ["grad:p0", "grad:p1"])
    M.set_bucket_tag(rs, TAG_GRAD_RS)
    with pytest.raises(
        ValueError,
        match=rf"^tagged collective '{rs.name}' must have exactly one user, a wait_tensor; "
        rf"it has \['{w1.name}', '{r2.name}'\]$",
    ):
        bucket_tagged_collectives(gm)


def test_tagged_collective_needs_a_val(mesh):
    gm = _hand_graph(mesh)
    tag_collectives_for_bucketing(gm)
    rs = _rs(gm)
    del rs.meta["val"]
    with pytest.raises(ValueError, match=rf"node '{rs.name}' .*needed for bucketing;"):
        bucket_tagged_collectives(gm)


def test_gradient_all_reduces_are_tagged_and_merged(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    a = b.placeholder("a", (8, H), role="input:0")
    grads = [
        b.all_reduce(b.call(aten.mm.default, b.call(aten.t.default, a), a), "dp") for _ in "xy"
    ]
    gm = b.output(grads, ["grad:x", "grad:y"])
    counts = tag_collectives_for_bucketing(gm)
    assert counts.tagged == {TAG_FSDP_AG: 0, TAG_GRAD_RS: 0, TAG_GRAD_AR: 2}
    res = bucket_tagged_collectives(gm)
    assert (res.before["all_reduce"], res.after["all_reduce"]) == (2, 1)


def test_reduce_ops_are_never_mixed_in_a_bucket(mesh):
    b = GraphBuilder(mesh_groups(mesh))
    a = b.placeholder("a", (8, H), role="input:0")
    grads = [
        b.reduce_scatter(b.call(aten.mm.default, b.call(aten.t.default, a), a), "dp", op)
        for op in ("sum", "avg", "sum")
    ]
    gm = b.output(grads, ["grad:x", "grad:y", "grad:z"])
    tag_collectives_for_bucketing(gm)
    res = bucket_tagged_collectives(gm)
    assert (res.before["reduce_scatter"], res.after["reduce_scatter"]) == (3, 2)
    assert res.metrics["reduce_scatter"].num_bucketed == 2  # the two sums
