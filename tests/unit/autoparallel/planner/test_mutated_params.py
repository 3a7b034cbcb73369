"""plan="auto" on a model that updates a parameter in place in forward (gemma3n's AltUp clamps its
``prediction_coefs.weight.data`` each training step): the graph returns the parameter's new value
(``mutated:<fqn>``), which AOTAutograd copies back into the rank's piece of the parameter, so the
planner places that output exactly as the parameter (``problem.py``), as it does a buffer's. A
small model of our own through the planned pipeline on a fake dp=2,tp=2 world."""

from __future__ import annotations

import pytest
import torch

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compile import SECOND_COMPILE
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.partition import STEP_FIRST_PARTITION
from autoparallel.pipeline import run_pipeline
from autoparallel.runtime.steps import loss_and_updates
from verify.zoo import ClampedCoefs
from verify.zoo import mse_loss as mse

FQN = "coefs.weight"


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    model = ClampedCoefs()
    with fake_world("dp=2,tp=2") as mesh:
        # the lowered graph, tagged: AOTAutograd's epilogue copies the new value into the rank's
        # piece at run time (gemma3n's second compile failed there: "size of tensor a (4) must
        # match ... (16)", then, with the placement fixed, "modified by an inplace operation")
        return run_pipeline(model, mse, (torch.randn(8, 16), torch.randn(8, 8)), ParallelPlan.auto(), mesh,
                            until=SECOND_COMPILE, trace=None)


def test_a_parameter_updated_in_place_gets_its_new_value_in_its_own_placement(run):
    plan = run.planned.solution
    assert plan.params[FQN] != {"dp": "R", "tp": "R"}  # sharded: another placement would not fit the piece
    out = plan.nodes[f"out:{roles.mutated(FQN)}"]
    assert out.out == [plan.params[FQN]] and out.ins == [plan.params[FQN]]


def test_the_lowered_graph_returns_the_new_value_shaped_as_the_rank_s_piece(run):
    joint = run.joint
    values = joint.gm.graph.output_node().args[0]
    (i,) = [k for k, r in enumerate(joint.output_roles) if r == roles.mutated(FQN)]
    (ph,) = [n for n, r in zip(joint.gm.graph.find_nodes(op="placeholder"), joint.input_roles) if r == roles.param(FQN)]
    assert values[i].meta["val"].shape == ph.meta["val"].shape


def test_the_gathers_of_a_parameter_updated_in_place_are_saved_not_recomputed(run):
    """A backward that gathered the parameter again would read it after the epilogue's update,
    which autograd refuses ("modified by an inplace operation"); the other parameters' gathers
    are recomputed as FSDP's reshard-after-forward asks."""
    report = run.stage("fsdp_tagging").report
    source = {}
    for ag in report.all_gathers:
        cur = ag.args[0]
        while cur.op != "placeholder":
            cur = cur.all_input_nodes[0]
        source[ag] = roles.name(cur.meta[M.ROLE])
    assert set(source.values()) >= {FQN, "head.weight"}
    recomputed = {source[ag] for ag in report.all_gathers if ag in report.recomputed}
    assert FQN not in recomputed and "head.weight" in recomputed
    assert report.saved


def test_the_second_compile_labels_each_tangent_by_what_it_is_the_tangent_of(run):
    """AOTAutograd gives the parameter's new value a tangent of its own, ahead of the loss's: the
    backward's tangents are labelled as the first partition's (from the joint graph's roles), the
    loss's the scalar one, the new value's shaped as the rank's piece. Labelled by position
    (``tangents_1`` the loss's), the collective-pass executor could not feed ``tangents_2``."""
    fw, bw = run.stage(SECOND_COMPILE).graphs
    first_bw = run.stage(STEP_FIRST_PARTITION).graphs[1]
    tangents = {ph.name: ph for ph in bw.graph.find_nodes(op="placeholder") if roles.is_aot_tangent_name(ph.name)}
    labels = {name: ph.meta.get(M.ROLE) for name, ph in tangents.items()}
    assert sorted(labels.values()) == sorted([roles.tangent(roles.LOSS), roles.tangent(roles.mutated(FQN))])
    assert labels == {ph.name: ph.meta[M.ROLE] for ph in first_bw.graph.find_nodes(op="placeholder") if ph.name in labels}
    by_role = {role: tangents[name].meta["val"] for name, role in labels.items()}
    (param,) = [ph for ph in fw.graph.find_nodes(op="placeholder") if ph.meta.get(M.ROLE) == roles.param(FQN)]
    assert by_role[roles.tangent(roles.LOSS)].dim() == 0
    assert by_role[roles.tangent(roles.mutated(FQN))].shape == param.meta["val"].shape


def test_a_step_copies_a_parameter_s_new_value_into_it_and_names_an_unknown_one():
    """Every executor reads the forward's outputs through ``loss_and_updates``: a parameter's new
    value lands in the parameter (a buffer's in the buffer), as the compiled module's epilogue does."""
    params, buffers = {FQN: torch.zeros(2)}, {"stats": torch.zeros(1)}
    outs = [torch.ones(2), torch.full((1,), 3.0), torch.tensor(5.0)]
    out_roles = [roles.mutated(FQN), roles.mutated("stats"), roles.LOSS]
    assert loss_and_updates(outs, out_roles, buffers, "step", params).item() == 5.0
    assert params[FQN].tolist() == [1.0, 1.0] and buffers["stats"].tolist() == [3.0]
    with pytest.raises(KeyError, match=r"step: output 'mutated:gone' updates 'gone', which is no buffer or parameter"):
        loss_and_updates([torch.ones(1), torch.tensor(1.0)], [roles.mutated("gone"), roles.LOSS], buffers, "step", params)
