"""A model that reads a tensor's value into Python (`if mask.any():`) through every stage on a
gloo world: bitwise with eager, the guard in every stage's forward graph, the verdict naming the
read (patch value_guards)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from autoparallel.passes.value_guards import GUARD, GUARD_ROWS
from autoparallel.planner.strategies import DATA_DEPENDENT
from verify.check import check_model
from verify.model_case import ModelCase


class PaddedMean(nn.Module):
    """Masks padding out of its features only when the batch has padding (fsmt's `if not
    padding_mask.any():` fast path), then classifies."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, pad):
        h = torch.tanh(self.proj(x))
        if pad.any():
            h = h.masked_fill(pad.unsqueeze(-1), 0.0)
        return self.head(h.sum(1))


def _batch(n):
    pad = torch.rand(n, 5) < 0.3
    pad[:, -1] = True  # every example is padded: each rank's slice takes the masking branch
    return torch.randn(n, 5, 6), pad, torch.randint(0, 3, (n,))


CASE = ModelCase("padded_mean", PaddedMean, nn.functional.cross_entropy, _batch)
LINE = next(i for i, line in enumerate(inspect.getsource(PaddedMean.forward).splitlines())
            if "pad.any()" in line) + PaddedMean.forward.__code__.co_firstlineno


def test_a_value_read_is_guarded_and_bitwise_at_every_stage():
    result = check_model(CASE, plan="fsdp", mesh="dp=2", steps=2)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    assert result.specialised_reads() == (f"{__file__}:{LINE} (if pad.any():): traced with True",)
    for stage in result.run.results:
        graphs = stage.graphs if isinstance(stage.graphs, tuple) else (stage.graphs,)
        assert any(n.target is GUARD for n in graphs[0].graph.nodes), stage.name
    assert f"specialised read: {__file__}:{LINE} (if pad.any():): traced with True" in result.summary()


class ScaledLayerDrop(nn.Module):
    """A layer drop (``if torch.rand([]) < p``) whose draw also scales the input (the value as a
    tensor): every rank and every reference slice must take data-parallel rank 0's draw, or the
    ranks' branches, their collectives and the oracle's slices disagree (patch replicated_draws)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, pad):
        drop = torch.rand([])
        h = x.sum(1) * (1 + drop)
        if drop < 1.0:  # always taken: the test does not depend on the seeds' draws
            h = torch.tanh(self.first(h))
        return self.head(h)


DROP_CASE = ModelCase("scaled_layer_drop", ScaledLayerDrop, nn.functional.cross_entropy, _batch)


@pytest.mark.slow  # a second gloo world of this file (PaddedMean's stays in the tier)
def test_a_layer_drop_is_replicated_guarded_and_bitwise():
    result = check_model(DROP_CASE, plan="fsdp", mesh="dp=2", steps=2)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    (read,) = result.specialised_reads()
    assert "a random draw decides it: aten::rand" in read and read.endswith("traced with True")
    joint = result.run.stage("joint").graphs
    assert [n for n in joint.graph.nodes if "all_gather" in str(n.target) and n.meta["val"].numel() == 2], "no replicated draw"


class PickedPositions(nn.Module):
    """Picks each example's marked positions by a boolean mask and regroups them per example (blt's
    ``padded_indices[padded_mask].reshape(batch_size, seq_len)``: the reshape needs the count)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, marked):
        h = torch.tanh(self.proj(x))
        picked = h[marked].reshape(x.shape[0], -1, 6)
        return self.head(picked.sum(1))


def _two_marked(n):
    marked = torch.zeros(n, 5, dtype=torch.bool)
    marked[torch.arange(n).unsqueeze(1), torch.rand(n, 5).argsort(1)[:, :2]] = True  # two per example
    return torch.randn(n, 5, 6), marked, torch.randint(0, 3, (n,))


MASK_CASE = ModelCase("picked_positions", PickedPositions, nn.functional.cross_entropy, _two_marked)


@pytest.mark.slow  # a third gloo world of this file
def test_bool_mask_indexing_is_guarded_and_bitwise_at_every_stage():
    result = check_model(MASK_CASE, plan="fsdp", mesh="dp=2", steps=2)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    (read,) = result.specialised_reads()
    assert read.endswith("(picked = h[marked].reshape(x.shape[0], -1, 6)): nonzero traced with size 2")  # one example per rank
    for stage in result.run.results:
        graphs = stage.graphs if isinstance(stage.graphs, tuple) else (stage.graphs,)
        assert any(n.target is GUARD_ROWS for n in graphs[0].graph.nodes), stage.name


@pytest.mark.slow  # a dp=2,tp=2 gloo world (plan="auto": each rank plans, lowers and compiles)
def test_under_auto_a_read_is_guarded_replicated_and_bitwise_at_every_stage():
    """plan="auto": the planning trace reads the whole batch, the planner replicates the guard as a
    fallback; every stage bitwise, the oracle passing. (A mask's count under auto, and a batch
    that takes the other branch: tests/unit/autoparallel/planner/test_planned_value_guards.py.)"""
    guard = GUARD
    result = check_model(CASE, plan="auto", mesh="dp=2,tp=2", steps=2)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    (read,) = result.specialised_reads()
    assert read.endswith("traced with True")
    plan = result.run.planned.solution
    assert any(why == DATA_DEPENDENT and guard.name().split("::")[1] in key for key, why in plan.fallbacks.items())
    for stage in result.run.results[1:]:  # the plan stage has no graph
        graphs = stage.graphs if isinstance(stage.graphs, tuple) else (stage.graphs,)
        assert any(n.target is guard for n in graphs[0].graph.nodes), stage.name
