"""The independent oracle catches lowering bugs that bitwise parity cannot see.

Bitwise parity compares each compiled stage with the eager *parallel* program; a bug in the
lowering itself is in both, so they stay bitwise equal. Each test here plants one such bug in the
parallel program (process-wide, before the world forks, so the eager program and the traced graph
share it), shows that bitwise parity still passes, and that the oracle (single-device eager within
the derived tolerance) fails, naming the tensors. The same tests without the bug are the zoo's
(tests/parity/test_zoo_parity.py: the oracle passes on every correct lowering).
"""

from __future__ import annotations

import pytest
import torch

from autoparallel import roles
from autoparallel.parallelize import program
from autoparallel.parallelize.program import ParallelProgram
from autoparallel.pipeline import JOINT
from verify import zoo
from verify.parity.runs import EAGER, compare_with_eager, oracle_check, run_stage_parity
from verify.stages.scenario import Scenario

_c10d = torch.ops._c10d_functional


def _bitwise_yet_oracle_fails(scenario: Scenario):
    ranks = run_stage_parity(scenario, 1, executors=(EAGER, JOINT))
    compare_with_eager(ranks, JOINT).assert_bitwise()  # the shared bug is invisible here
    report = oracle_check(scenario, ranks)
    print(report.summary())
    assert not report.passed
    return {c.name for c in report.failures()}


@pytest.mark.xdist_group("oracle-doubled-bias")
def test_a_rowwise_bias_added_on_every_tp_rank_fails_the_oracle(monkeypatch):
    """The lowering before the fix: a rowwise Linear's bias added by each TP rank before the
    region's all-reduce, so tp times (the issue measured loss 1.401332 vs 1.387354)."""
    monkeypatch.setattr(ParallelProgram, "_rowwise_biases_after_reduce", lambda self, region: [])
    failing = _bitwise_yet_oracle_fails(Scenario(case=zoo.ln_mlp, plan="fsdp_tp", mesh="dp=1,tp=2"))
    assert "loss" in failing
    assert {roles.grad("blocks.0.fc.bias"), roles.grad("head.weight")} <= failing


class _SumNotAvg(torch.autograd.Function):
    """DDPGradAllReduce with the reduce op a typo away: "sum" instead of "avg"."""

    @staticmethod
    def forward(ctx, param, group_name):
        ctx.group_name = group_name
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return _c10d.wait_tensor.default(_c10d.all_reduce.default(grad.contiguous(), "sum", ctx.group_name)), None


@pytest.mark.xdist_group("oracle-ddp-sum")
def test_ddp_gradients_summed_instead_of_averaged_fail_the_oracle(monkeypatch):
    """Every gradient doubles on two ranks; the loss of the first step is unchanged."""
    monkeypatch.setattr(program, "DDPGradAllReduce", _SumNotAvg)
    scenario = Scenario(case=zoo.ln_mlp, plan="ddp", mesh="dp=2")
    failing = _bitwise_yet_oracle_fails(scenario)
    grads = {roles.grad(n) for n, _ in scenario.model(device="meta").named_parameters()}
    assert failing == grads
