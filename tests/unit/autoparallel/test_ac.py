"""The one activation-checkpointing policy: the op rule, SDPA, the mm rule, modes, meta restore.

The model's eager op SAC, graph SAC and the joint AC pass all take their decisions from
``autoparallel.ac``; these tests pin the rule itself (the callers' tests check they use it).
"""

import contextlib

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import ac
from autoparallel.ac import OpSACState, op_sac_policy, restore_sac_meta
from autoparallel.passes.ac_joint import ac_joint_pass

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
MM = torch.ops.aten.mm.default
ADD = torch.ops.aten.add.Tensor
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

# The two lists this module replaced: the joint AC pass had the first four, the model all seven.
_OLD_SDPA_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_attention_math_for_mps",
)


def test_sdpa_rule_is_the_union_of_the_old_lists_and_excludes_backwards():
    present = [getattr(torch.ops.aten, n).default for n in _OLD_SDPA_NAMES if hasattr(torch.ops.aten, n)]
    assert len(present) >= 5, present  # this torch has most of them: the test checks something
    assert all(ac.is_sdpa_forward(op) for op in present)
    backwards = [getattr(torch.ops.aten, f"{n}_backward").default for n in _OLD_SDPA_NAMES if hasattr(torch.ops.aten, f"{n}_backward")]
    assert backwards and not any(ac.is_sdpa_forward(op) for op in backwards)
    assert not ac.is_sdpa_forward(torch.ops.aten.scaled_dot_product_attention.default)  # not a kernel
    assert not ac.is_sdpa_forward(MM) and not ac.is_sdpa_forward("_scaled_dot_product_flash_attention")


def test_saves_every_other_mm_from_the_first():
    assert [ac.saves_mm(i) for i in range(1, 6)] == [True, False, True, False, True]
    with pytest.raises(ValueError, match="1-based"):
        ac.saves_mm(0)


def test_op_sac_policy_pure_function():
    assert op_sac_policy(MM, mm_index=1) == SAVE
    assert op_sac_policy(MM, mm_index=2) == RECOMPUTE
    assert op_sac_policy(MM, mm_index=5) == SAVE
    with pytest.raises(ValueError):
        op_sac_policy(MM)
    assert op_sac_policy(ADD, residual_add_index=1) == SAVE
    assert op_sac_policy(ADD, residual_add_index=2) == RECOMPUTE
    assert op_sac_policy(ADD) == RECOMPUTE
    for op in (
        SDPA_CPU,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops.aten.max.default,
    ):
        assert op_sac_policy(op) == SAVE, op
    for op in (
        torch.ops.aten.silu.default,
        torch.ops.aten.mul.Tensor,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
    ):
        assert op_sac_policy(op) == RECOMPUTE, op
    state = OpSACState()
    x = torch.zeros(1)
    decisions = [state.decide(MM) for _ in range(4)]
    assert decisions == [SAVE, RECOMPUTE, SAVE, RECOMPUTE]
    assert state.decide(ADD, (x, 1e-5)) == RECOMPUTE  # x + eps is not residual
    assert [state.decide(ADD, (x, x)) for _ in range(2)] == [SAVE, RECOMPUTE]




def test_restore_sac_meta():
    cm = fx_traceback.current_meta
    cm["ac_graph_id"] = 41
    try:
        with contextlib.suppress(RuntimeError), restore_sac_meta():
            fx_traceback.current_meta["recompute"] = RECOMPUTE
            fx_traceback.current_meta["ac_graph_id"] = None
            raise RuntimeError("boom")
        assert fx_traceback.current_meta["ac_graph_id"] == 41
        assert "recompute" not in fx_traceback.current_meta
    finally:
        fx_traceback.current_meta.pop("ac_graph_id", None)


def test_parse_ac_mode():
    assert ac.parse_ac_mode("layer:3", 7) == ["full", None, None, "full", None, None, "full"]
    assert ac.parse_ac_mode(None, 2) == ac.parse_ac_mode("none", 2) == [None, None]
    assert ac.parse_ac_mode("op", 2) == ["op", "op"]
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'layer:0'; valid modes"):
        ac.parse_ac_mode("layer:0", 2)


def test_checkpoint_block_rejects_an_unknown_block_mode():
    with pytest.raises(ValueError, match="a block's AC mode must be None, 'full' or 'op', got 'layer:2'"):
        ac.checkpoint_block(lambda x: x, "layer:2", 0, torch.ones(1))
    assert ac.checkpoint_block(lambda x: x + 1, None, 0, torch.ones(1)).item() == 2.0


def test_joint_pass_and_op_sac_agree_on_mm_and_sdpa():
    """The joint AC pass decides mm and SDPA as op SAC does within one block."""
    g = fx.Graph()
    x = g.placeholder("primals_1")
    tan = g.placeholder("tangents_1")
    mms = []
    h = x
    for _ in range(4):
        h = g.call_function(MM, (h, x))
        mms.append(h)
    grads = g.call_function(torch.ops.aten.mul.Tensor, (tan, mms[0]))
    for m in mms[1:]:
        grads = g.call_function(torch.ops.aten.mul.Tensor, (grads, m))
    g.output((h, grads))
    for n in g.nodes:
        n.meta["val"] = torch.empty(2, 2)
    ac_joint_pass(fx.GraphModule(torch.nn.Module(), g))
    state = OpSACState()
    assert [m.meta["recompute"] for m in mms] == [state.decide(MM) for _ in mms]
