"""The oracle on a model whose first forward changes the model (docs/oracle-failures.md).

Hugging Face BigBird switches from block-sparse to full attention on its first short sequence:
it builds a new attention module per layer (whose constructor draws initial weights from torch's
generator, then keeps the old projections) before its dropout draws masks. Each rank runs its
first step on a fresh model, so every rank draws the constructor's numbers before its masks; a
single-device reference that called one model object slice after slice drew them on slice 0
only, and slice 1's masks differed from its rank's: the oracle failed on a correct program.

``SwitchesOnFirstCall`` is that class in a few lines. The reference gives each slice a fresh
model (as each rank has), and the oracle passes; fed the old reference (one object for every
slice) the oracle fails on the loss, so the model does reproduce the class.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verify.model_case import ModelCase
from verify.parity.runs import EAGER, oracle_check, run_stage_parity, single_device_reference
from verify.stages.scenario import Scenario
from verify.zoo import mse_loss

pytestmark = pytest.mark.xdist_group("oracle-first-call")


class Projection(nn.Module):
    """A wrapper built in forward: its own Linear draws initial weights from torch's generator and
    is then replaced by the model's trained one (BigBird's ``set_attention_type``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class SwitchesOnFirstCall(nn.Module):
    """The first forward swaps ``inner`` for a freshly built :class:`Projection` (drawing from the
    generator) and flips a mode; dropout then draws its mask. Parameters keep their names."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.inner = Projection(dim)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(dim, 4)
        self.mode = "sparse"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "sparse":
            self.mode = "full"
            fresh = Projection(x.shape[-1])
            fresh.proj = self.inner.proj
            self.inner = fresh
        return self.head(self.drop(self.inner(x)))


def _batch(n: int):
    return torch.randn(n, 16), torch.randn(n, 4)


SCENARIO = Scenario(case=ModelCase("switches_on_first_call", SwitchesOnFirstCall, mse_loss, _batch, batch_per_rank=2),
                    plan="fsdp", mesh="dp=2")


@pytest.fixture(scope="module")
def ranks():
    return run_stage_parity(SCENARIO, 1, executors=(EAGER,))


def test_the_oracle_passes_a_model_that_changes_itself_on_its_first_call(ranks):
    report = oracle_check(SCENARIO, ranks)
    print(report.summary())
    assert report.passed, report.summary()


def test_a_reference_that_reuses_one_model_across_slices_fails_the_oracle(ranks, monkeypatch):
    """The reference before the fix: slice 1 ran as the second call of slice 0's model object."""
    shared = SCENARIO.model()
    with monkeypatch.context() as m:
        m.setattr(Scenario, "model", lambda self, device="cpu": shared)
        stale = single_device_reference(SCENARIO)
    assert shared.mode == "full"  # the reference did run the switch
    report = oracle_check(SCENARIO, ranks, reference=stale)
    print(report.summary())
    assert not report.passed
    assert "loss" in {c.name for c in report.failures()}


def test_each_slice_of_the_reference_runs_on_a_fresh_model(monkeypatch):
    built = []
    original = Scenario.model

    def counting(self, device="cpu"):
        built.append(original(self, device))
        return built[-1]

    monkeypatch.setattr(Scenario, "model", counting)
    single_device_reference(SCENARIO)
    assert len(built) == 2 and built[0] is not built[1]
    assert all(m.mode == "full" for m in built)
