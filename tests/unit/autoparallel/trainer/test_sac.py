"""Graph SAC on a traced step: forward-only tagging, eager-equal op decisions, remat into backward."""

from __future__ import annotations

import operator
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel.fx_utils import copy_graph_module
from autoparallel.trainer import (
    SAC_POLICIES,
    apply_sac_pass,
    is_backward_node,
    is_forward_node,
    live_recomputable_values,
    recompute_summary,
    region_of,
    remat_pass,
    sac_stages,
    trace_train_step,
)
from verify.parity.trainer import sac_graphs, traced_step

PRESET = "tiny"
MM = torch.ops.aten.mm.default
DETACH = torch.ops.aten.detach.default


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def step():
    return traced_step(PRESET, batch=2, module_stack=True)  # shared with test_trainer_trace.py


@pytest.fixture(scope="module")
def op_stages(step):
    return sac_stages(step, "op")


def _decisions(gm, *, skip=()):
    """{region: [(op, policy), ...]} over tagged forward nodes, in graph order."""
    out = defaultdict(list)
    for n in gm.graph.nodes:
        if M.RECOMPUTE in n.meta and is_forward_node(n) and n.target not in skip:
            out[n.meta[M.AC_GRAPH_ID]].append((str(n.target), n.meta[M.RECOMPUTE]))
    return dict(out)


def test_sac_tags_forward_nodes_only(op_stages):
    """Guard of patch ``sac_skips_backward``: backward nodes never carry a recompute tag."""
    tagged, _ = op_stages
    backward_tagged = [
        n.name for n in tagged.graph.nodes if is_backward_node(n) and M.RECOMPUTE in n.meta
    ]
    assert not backward_tagged, (
        f"{len(backward_tagged)} backward nodes tagged, e.g. {backward_tagged[:3]}"
    )
    for n in tagged.graph.nodes:
        if n.op != "call_function" or not is_forward_node(n):
            continue
        if region_of(n) is None:
            assert M.RECOMPUTE not in n.meta, f"{n.name} is outside every block but tagged"
        else:
            assert n.meta[M.AC_GRAPH_ID] == region_of(n), n.name
            assert isinstance(n.meta[M.AC_GRAPH_ID], int)
            if n.target is operator.getitem:
                assert n.meta[M.RECOMPUTE] == n.args[0].meta[M.RECOMPUTE], n.name


def test_sac_pass_does_not_modify_the_traced_step(step, op_stages):
    assert not [n for n in step.gm.graph.nodes if M.RECOMPUTE in n.meta]
    assert op_stages[0] is not step.gm and op_stages[1] is not step.gm


def test_op_policy_matches_eager_apply_ac():
    """The graph pass and eager ``apply_ac(model, "op")`` save and recompute the same ops.

    Tracing the eagerly checkpointed model records eager SAC's decision on every op it saw; the
    only extra nodes there are the checkpoint's own ``detach`` calls.
    """
    plain = traced_step(PRESET, batch=2, module_stack=True)
    eager_sac = traced_step(PRESET, batch=2, ac="op", module_stack=True)
    graph = _decisions(apply_sac_pass(copy_graph_module(plain.gm), "op"), skip=(DETACH,))
    eager = _decisions(eager_sac.gm, skip=(DETACH,))
    assert sorted(graph) == sorted(eager) == [0, 1]
    for region in graph:
        assert graph[region] == eager[region], f"block {region} decisions differ"
        saved = [op for op, policy in graph[region] if policy == CheckpointPolicy.MUST_SAVE]
        # Odd mms (4 of 7), SDPA and the first residual add are saved.
        assert saved.count(str(MM)) == 4 and any("scaled_dot_product" in op for op in saved), saved


def test_full_policy_recomputes_every_block_op(step):
    tagged, remat = sac_stages(step, "full")
    saved = set()
    for n in tagged.graph.nodes:
        if M.RECOMPUTE not in n.meta:
            continue
        if n.meta[M.RECOMPUTE] == CheckpointPolicy.MUST_RECOMPUTE:
            continue
        saved.add(str((n.args[0] if n.target is operator.getitem else n).target))
    # Only ops tagged nondeterministic_seeded are saved (SDPA, which takes a dropout argument):
    # the remat pass refuses to replay random ops.
    assert saved == {"aten._scaled_dot_product_flash_attention_for_cpu.default"}
    # cleanup_recompute_tags saved the block outputs that feed the next block.
    op_recomputed = recompute_summary(sac_stages(step, "op")[1])["recomputed"]
    assert recompute_summary(remat)["recomputed"] > op_recomputed


def test_remat_duplicates_recomputed_ops_into_backward(op_stages):
    """Guard of patch ``phase_tagging``: without backward phase tags remat does nothing."""
    tagged, remat = op_stages
    remat.graph.lint()
    nodes = list(remat.graph.nodes)
    backward = [i for i, n in enumerate(nodes) if is_backward_node(n)]
    dups = [i for i, n in enumerate(nodes) if n.meta.get(M.AUTOGRAD_BACKWARD)]
    assert backward, "no backward node: the remat pass had no backward region to recompute into"
    assert dups, "the remat pass duplicated nothing"
    first_bwd = backward[0]
    assert min(dups) > first_bwd, "a recomputed op was placed before the backward"
    summary = recompute_summary(remat)
    assert summary["recomputed"] == len(dups)
    # Recomputed mms are exactly the even ones: forward mm count is unchanged, backward gains them.
    mm_before = sum(1 for n in tagged.graph.nodes if n.target is MM)
    mm_after = sum(1 for n in remat.graph.nodes if n.target is MM)
    recomputed_mm = [nodes[i] for i in dups if nodes[i].target is MM]
    tagged_by_name = {n.name: n for n in tagged.graph.nodes}
    for dup in recomputed_mm:
        original = tagged_by_name[dup.name.removesuffix("_recomputed")]
        assert original.meta[M.RECOMPUTE] == CheckpointPolicy.PREFER_RECOMPUTE, dup.name
    # Of the 3 recomputable (even) mms per block (wk, wo, w3), the backward needs wk's and w3's
    # outputs; wo's only feeds the residual add, whose backward needs no input.
    assert len(recomputed_mm) == 2 * 2
    assert mm_after == mm_before + len(recomputed_mm)
    # Every dup sits right before (in front of) its first backward user and has no forward user.
    position = {n: i for i, n in enumerate(nodes)}
    for i in dups:
        users = list(nodes[i].users)
        assert users and all(
            position[u] > i and not is_forward_node(u) or u.meta.get(M.AUTOGRAD_BACKWARD)
            for u in users
        )


def test_backward_nodes_carry_both_remat_markers(step):
    """torch 2.13's remat pass reads ``custom[PHASE]``, 2.11's only ``custom[REMAT_PASS_TAG]``
    (the GPU machines run 2.11): every backward node carries both, no forward node either."""
    backward = [n for n in step.gm.graph.nodes if is_backward_node(n)]
    assert backward
    for n in step.gm.graph.nodes:
        marker = n.meta.get(M.CUSTOM, {}).get(M.REMAT_PASS_TAG)
        assert marker == (M.REMAT_PASS_TAG_BACKWARD if is_backward_node(n) else None), n.name


def test_remat_leaves_no_recomputable_value_alive_into_backward(op_stages):
    tagged, remat = op_stages
    live = live_recomputable_values(tagged)
    # Before remat the backward reads recomputable activations (silu, rsqrt, views of mms).
    assert any(n.target is torch.ops.aten.silu.default for n in live), live
    assert live_recomputable_values(remat) == []


def test_remat_pass_raises_when_torch_rematerializes_nothing(op_stages, monkeypatch):
    """A remat pass that reads another backward marker returns the graph unchanged: that must
    be an error, not a silent peak-memory regression (seen on torch 2.11 on the GPU machine)."""
    import torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass as rp

    tagged, _ = op_stages
    monkeypatch.setattr(rp, "remat_using_tags_for_fwd_loss_bwd_graph", copy_graph_module)
    with pytest.raises(RuntimeError, match=r"value\(s\) tagged for recompute are still read by"):
        remat_pass(copy_graph_module(tagged))


def test_unknown_policy_is_rejected(step):
    with pytest.raises(
        ValueError, match=r"unknown SAC policy 'selective'; valid policies: \['op', 'full'\]"
    ):
        apply_sac_pass(copy_graph_module(step.gm), "selective")
    assert SAC_POLICIES == ("op", "full")


def test_sac_without_regions_is_rejected():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    mlp = trace_train_step(model, F.mse_loss, (x, y))
    with pytest.raises(
        ValueError, match=r"call annotate_ac_regions\(model\) before trace_train_step"
    ):
        apply_sac_pass(mlp.gm, "op")


def test_sac_graphs_for_goldens():
    before, after = sac_graphs("debug", batch=4)  # the parity/memory trace
    assert before.meta[M.GM_STAGE] == "trainer:sac-op"
    assert after.meta[M.GM_STAGE] == "trainer:sac-op+remat"
    assert recompute_summary(before).get("recomputed", 0) == 0
    assert recompute_summary(after)["recomputed"] > 0
    again, _ = sac_graphs("debug", batch=4)
    assert again is not before
    assert [n.name for n in again.graph.nodes] == [n.name for n in before.graph.nodes]


def test_wait_and_getitem_inherit_their_parents_tag():
    """A collective's wait is decided with the collective (here a saved reduce-scatter), not by
    the policy's verdict on ``wait_tensor`` itself (which would be recompute)."""
    c10d = torch.ops._c10d_functional
    g = torch.fx.Graph()
    x = g.placeholder("x")
    rs = g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0"))
    wait = g.call_function(c10d.wait_tensor.default, (rs,))
    out = g.call_function(torch.ops.aten.relu.default, (wait,))
    parts = g.call_function(torch.ops.aten.split.Tensor, (out, 2))
    first = g.call_function(operator.getitem, (parts, 0))
    g.output(first)
    for node in (rs, wait, out, parts, first):
        node.meta[M.CUSTOM] = {M.PHASE: M.PHASE_FORWARD, M.AC_REGION: 3}
    gm = apply_sac_pass(torch.fx.GraphModule(torch.nn.Module(), g), "op")
    assert rs.meta[M.RECOMPUTE] == wait.meta[M.RECOMPUTE] == CheckpointPolicy.MUST_SAVE
    assert out.meta[M.RECOMPUTE] == first.meta[M.RECOMPUTE] == CheckpointPolicy.PREFER_RECOMPUTE
    assert {n.meta[M.AC_GRAPH_ID] for n in (rs, wait, out, parts, first)} == {3}
    assert gm.graph is g
