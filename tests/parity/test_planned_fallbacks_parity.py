"""plan="auto" on what users' models make, trained on a dp=2,tp=2 gloo world: a mask built in
forward from Python data (a lifted constant), an op with no DTensor strategy (the replicated
fallback), drop paths (random ops that are not dropout, which the plan replicates so every rank
draws the single-device numbers), a convolution with the batch split over both mesh dims
(which DTensor's convolution handler refuses: the lowering runs the local op), and Hugging Face
LLaMA and falcon called with tokens only.

Every stage bitwise against the plan's placements run eagerly, and the oracle passing; for the
random ops the oracle compares with them drawing on both sides (dropout off on both), and fails
when the single-device side draws other numbers. CI's slow step ("planned-parity": each rank
plans, lowers and compiles).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from torch import nn

import verify.parity.planned as planned_parity
from autoparallel.planner.strategies import NO_STRATEGY, RANDOM_OP
from verify.hf import ARCHS, SEQ, VOCAB, KeywordInputs, hf_config, token_loss
from verify.model_case import ModelCase
from verify.parity.planned import EXECUTORS, planned_case, planned_oracle, run_planned_parity, single_device_replay
from verify.parity.random_ops import DROPOUT_OFF
from verify.parity.runs import compare_with_eager, oracle_executor
from verify.stages.scenario import Scenario
from verify.zoo import HYBRID_BATCH_PINS, DropPath, LogSigmoidGate, MaskFromPythonData, Prototypes, StridedDepthwiseConv, conv_batch, label_smoothing_loss
from verify.zoo import mse_loss as mse

MESH = "dp=2,tp=2"
pytestmark = [pytest.mark.xdist_group("planned-parity"), pytest.mark.timeout(900)]


def _batch(out: int):
    def batch(n):
        return torch.randn(n, 16), torch.randn(n, out)

    return batch


def test_a_mask_made_from_python_data_in_forward(model_check):
    result = model_check(ModelCase("mask_from_python_data", MaskFromPythonData, mse, _batch(16), batch_per_rank=2),
                         plan="auto", mesh=MESH)
    plan = result.run.planned.solution
    assert list(plan.constants.values()) == ["_tensor_constant0"]


def test_an_op_with_no_strategy_takes_the_replicated_fallback(model_check):
    result = model_check(ModelCase("prototypes", Prototypes, mse, _batch(8), batch_per_rank=2), plan="auto", mesh=MESH)
    fallbacks = result.run.planned.solution.fallbacks
    assert fallbacks["-/fwd/aten._cdist_forward.default#0"] == NO_STRATEGY
    assert fallbacks["-/bwd/aten._cdist_backward.default#0"] == NO_STRATEGY


class RandDropPath(nn.Module):
    """timm's drop path through ``torch.rand``: keep = floor(rand + keep_prob)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        keep = (torch.rand(x.shape[0], 1, dtype=x.dtype) + (1 - self.p)).floor()
        return x * keep / (1 - self.p)


class DropPathBlocks(nn.Module):
    """Two residual branches with drop paths (``bernoulli`` of a made tensor, ``torch.rand``), and a
    dropout between them: the dropout draws on a shard of its activation, the drop paths whole."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, 16)
        self.drop, self.path1, self.path2 = nn.Dropout(0.1), DropPath(0.5), RandDropPath(0.5)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        x = x + self.path1(self.fc2(self.drop(torch.relu(self.fc1(x)))))
        x = x + self.path2(self.fc3(x))
        return self.head(x)


DROP_PATHS = ModelCase("drop_paths", DropPathBlocks, mse, _batch(8), batch_per_rank=2)


def test_drop_paths_draw_the_single_device_numbers_and_the_oracle_sees_them():
    """Bitwise at every stage; the oracle compares with the drop paths drawing on both sides
    (dropout off on both) and passes; a single-device side seeded otherwise (other keep masks)
    fails it, so the draws are compared, not switched off."""
    case = planned_case(Scenario(case=DROP_PATHS, plan="auto", mesh=MESH))
    ((plan, ranks),) = run_planned_parity(case, 3)
    assert sorted(why for why in plan.fallbacks.values() if why == RANDOM_OP) == [RANDOM_OP] * 2
    for executor in EXECUTORS[1:]:
        compare_with_eager(ranks, executor).assert_bitwise()
    assert oracle_executor(ranks) == DROPOUT_OFF
    report = planned_oracle(case, ranks)
    assert report.passed, report.summary()
    seed = planned_parity.PLANNED_RNG_SEED
    try:
        planned_parity.PLANNED_RNG_SEED = seed + 1
        other = planned_oracle(case, ranks, single_device_replay(case, ranks))
    finally:
        planned_parity.PLANNED_RNG_SEED = seed
    assert not other.passed, other.summary()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the hf extra")
@pytest.mark.parametrize(("arch", "makes_constants"), [
    # llama outside CI's slow step (slow_full): falcon is the one that lifts constants.
    pytest.param("llama", False, marks=pytest.mark.slow_full), ("falcon", True)])
def test_a_hugging_face_model_called_with_tokens_only(arch, makes_constants, model_check):
    """transformers builds the mask itself when the model gets no attention mask: LLaMA (5.24)
    from ops alone, falcon with tensors made from Python data in forward (lifted constants)."""
    import transformers

    def tokens(n):
        return torch.randint(3, VOCAB, (n, SEQ))

    config, cls = hf_config(arch), getattr(transformers, ARCHS[arch].model)
    case = ModelCase(f"hf-{arch}-tokens-only", lambda: KeywordInputs(cls(config), ("input_ids",)), token_loss,
                     lambda n: (tokens(n), tokens(n)), batch_per_rank=2)
    result = model_check(case, plan="auto", mesh=MESH)
    assert bool(result.run.planned.solution.constants) == makes_constants


def test_an_op_planned_by_its_decomposition_runs_on_the_local_pieces(model_check):
    """Placed by DTensor's decomposition strategy, run by the lowering on the rank's pieces
    (``strategies.planned_by_decomposition``); bitwise at every stage, the oracle passing."""
    result = model_check(ModelCase("log_sigmoid_gate", LogSigmoidGate, mse, _batch(8), batch_per_rank=2), plan="auto", mesh=MESH)
    pg = result.run.planned.pg
    (node,) = pg.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.log_sigmoid_forward.default)
    assert pg.keys[node.name] not in result.run.planned.solution.fallbacks


def test_a_convolution_with_the_batch_on_both_mesh_dims_trains():
    """The depthwise convolution's forward and backward pinned to ``[S(0), S(0)]`` (pins: check_model
    takes no pinned plan, so its planned path is spelled out): REFUSED before patch
    batch_local_convolution (DTensor's handler: "hybrid sharding strategies"); now each rank
    convolves its quarter of the batch, every stage bitwise, the oracle passing."""
    conv = ModelCase("strided_depthwise_conv", StridedDepthwiseConv, label_smoothing_loss, conv_batch, batch_per_rank=2)
    case = replace(planned_case(Scenario(case=conv, plan="auto", mesh=MESH)), planner={"pins": HYBRID_BATCH_PINS})
    ((plan, ranks),) = run_planned_parity(case, 3)
    for key in HYBRID_BATCH_PINS:
        assert plan.nodes[key].ins[0] == {"dp": "S(0)", "tp": "S(0)"}, key
    for executor in EXECUTORS[1:]:
        compare_with_eager(ranks, executor).assert_bitwise()
    report = planned_oracle(case, ranks)
    assert report.passed, report.summary()
