"""Graph trainer vs eager, bitwise, over 3 AdamW steps (debug preset).

* the traced step (no AC) vs eager ``loss.backward()``;
* the traced step with graph op SAC + remat vs eager ``apply_ac(model, "op")``;
* the traced step with tied embedding/output weights, whose single gradient must equal eager's
  (a doubled gradient would show up as a mismatch on ``tok_embeddings.weight`` at step 0);
* a conv net with BatchNorm (``verify.zoo.convnet``): running stats updated like eager's.
"""

from __future__ import annotations

import pytest
import torch

from autoparallel.runtime.steps import Executor, train_steps
from autoparallel.trainer import recompute_summary, run_traced, trace_train_step
from verify import zoo
from verify.parity.compare import compare_traces
from verify.parity.trainer import (
    eager_executor,
    make_batches,
    make_model,
    traced_executor,
    traced_sac_step,
    traced_step,
)

PRESET = "debug"
BATCH = 4  # the shape the memory tests use too: one trace serves both
STEPS = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def batches():
    return make_batches(PRESET, steps=STEPS, batch=BATCH)


def _train(executor_for, model, batches):
    params = dict(model.named_parameters())
    return train_steps(executor_for(model), params, batches, lr=1e-2)


CASES = {
    "plain": dict(tie=False, sac=False),
    "op-sac": dict(tie=False, sac=True),
    "tied": dict(tie=True, sac=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_traced_step_bitwise_equals_eager(case, batches):
    tie, sac = CASES[case]["tie"], CASES[case]["sac"]
    ac = "op" if sac else None
    eager_model = make_model(PRESET, tie_embeddings=tie, ac=ac, regions=False)
    traced_model = make_model(PRESET, tie_embeddings=tie)
    if sac:
        step = traced_sac_step(PRESET, tie_embeddings=tie, batch=BATCH, policy="op")
        assert recompute_summary(step.gm).get("recomputed", 0) > 0, "remat recomputed nothing"
    else:
        step = traced_step(PRESET, tie_embeddings=tie, batch=BATCH)

    eager = _train(eager_executor, eager_model, batches)
    traced = _train(lambda m: traced_executor(step, m), traced_model, batches)

    report = compare_traces(
        eager, traced, a_name=f"eager{'+apply_ac(op)' if sac else ''}", b_name=f"traced-{case}"
    )
    n_params = len(dict(eager_model.named_parameters()))
    assert len(report.diffs) == STEPS * (1 + n_params)
    report.assert_bitwise()
    # AdamW really moved the weights: the steps are not all the same computation.
    assert not torch.equal(eager.losses[0], eager.losses[-1])
    if tie:
        assert traced_model.output.weight is traced_model.tok_embeddings.weight
        assert "output.weight" not in traced.grads[0]
        for a, b in zip(eager_model.parameters(), traced_model.parameters(), strict=True):
            assert torch.equal(a, b)  # weights after 3 updates


def _executors(model, loss_fn, step=None) -> Executor:
    """loss.backward() (eager) or run_traced (step), with the model's live buffers."""

    def run(params, inputs):
        model.zero_grad(set_to_none=True)
        if step is None:
            loss = loss_fn(model(*inputs[:-1]), inputs[-1])
            loss.backward()
        else:
            loss = run_traced(step, model, inputs)
        return loss.detach(), {fqn: p.grad for fqn, p in model.named_parameters()}

    return Executor(run, dict(model.named_buffers()))


def test_traced_step_updates_batchnorm_buffers_like_eager():
    """A conv net with BatchNorm (running stats updated in place) and GroupNorm, and its own loss:
    losses, gradients and running stats bitwise over 3 AdamW steps."""
    case = zoo.convnet
    batches = case.batches(4, STEPS)
    eager_model, traced_model = case.build(), case.build()
    step = trace_train_step(traced_model, case.loss_fn, batches[0])
    eager = train_steps(_executors(eager_model, case.loss_fn), dict(eager_model.named_parameters()), batches)
    traced = train_steps(_executors(traced_model, case.loss_fn, step), dict(traced_model.named_parameters()), batches)
    report = compare_traces(eager, traced, a_name="eager", b_name="traced")
    assert len(report.diffs) == STEPS * (1 + len(eager.grads[0]) + 3)
    report.assert_bitwise()
    assert [int(b["bn.num_batches_tracked"]) for b in traced.buffers] == [1, 2, 3]
