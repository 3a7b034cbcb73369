"""A model that reads a tensor's value into Python (`if mask.any():`) through every stage on a
gloo world: bitwise with eager, the guard in every stage's forward graph, the verdict naming the
read (patch value_guards)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from autoparallel.passes.value_guards import GUARD
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
