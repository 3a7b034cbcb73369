"""The AC joint pass on a hand-built joint graph: what it tags, what it leaves alone."""

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel.fx_utils import ALL_GATHER, WAIT
from autoparallel.passes.ac_joint import ac_joint_pass

aten = torch.ops.aten


def _joint_for_ac():
    """fwd: ag(w)->wait->t ; mm(x, t) ; mm(., t2) ; sdpa-free ; bwd: uses every forward value."""
    g = fx.Graph()

    def ph(name, *shape):
        n = g.placeholder(name)
        n.meta[M.VAL] = torch.empty(*shape, device="meta")
        return n

    def op(target, args, *shape):
        n = g.call_function(target, args)
        n.meta[M.VAL] = torch.empty(*shape, device="meta")
        return n

    w, x, tan = ph("primals_1", 2, 4), ph("primals_2", 3, 4), ph("tangents_1", 3, 4)
    ag = op(ALL_GATHER, (w, 2, "dp"), 4, 4)
    ag.meta[M.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    ag.meta[M.AC_GRAPH_ID] = M.AP_AC_GRAPH_ID
    wait = op(WAIT, (ag,), 4, 4)
    t = op(aten.t.default, (wait,), 4, 4)
    mm1 = op(aten.mm.default, (x, t), 3, 4)
    act = op(aten.relu.default, (mm1,), 3, 4)
    mm2 = op(aten.mm.default, (act, t), 3, 4)
    mm3 = op(aten.mm.default, (mm2, t), 3, 4)
    bw = op(aten.mul.Tensor, (tan, mm3), 3, 4)
    bw2 = op(aten.mul.Tensor, (bw, act), 3, 4)
    bw3 = op(aten.mul.Tensor, (bw2, mm2), 3, 4)
    g.output((mm3, bw3))
    return fx.GraphModule(nn.Module(), g), dict(ag=ag, wait=wait, t=t, mm1=mm1, act=act, mm2=mm2, mm3=mm3, bw=bw)


def test_ac_joint_pass_policy():
    gm, n = _joint_for_ac()
    ac_joint_pass(gm)
    policy = {k: v.meta.get(M.RECOMPUTE) for k, v in n.items()}
    assert policy["ag"] is CheckpointPolicy.MUST_RECOMPUTE  # pre-existing tags are kept
    assert policy["wait"] is None  # collectives are never AC candidates
    assert policy["mm1"] is CheckpointPolicy.MUST_SAVE and policy["mm3"] is CheckpointPolicy.MUST_SAVE
    assert policy["mm2"] is CheckpointPolicy.PREFER_RECOMPUTE  # every other mm is recomputed
    assert policy["act"] is CheckpointPolicy.PREFER_RECOMPUTE and policy["t"] is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy["bw"] is None  # backward nodes are never tagged
    assert all(v.meta[M.AC_GRAPH_ID] == M.AP_AC_GRAPH_ID for k, v in n.items() if v.meta.get(M.RECOMPUTE) and k != "ag")
