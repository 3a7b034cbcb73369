"""A selective-scan recurrence (Mamba's slow path in small): a Python loop over the sequence with
in-place indexed updates, under fsdp dp=2.

transformers' Mamba under fsdp dp=2 was "NOT bitwise" at every stage, the joint graph included,
with the oracle at 0 and no reason given. The cause is no pass and no aliasing: its
``mamba_selective_scan`` asks ``torch.compiler.is_compiling()`` and runs a parallel
``associative_scan`` when it is true (a prefix scan: products and sums associated in another
order) and the Python loop when it is false. The joint trace runs with the flag true (patch
``trace_as_compiling``), the eager program with it false: two programs. ``check_model`` now runs
the eager program as traced too (where the model asked the flag during the trace) and names the
branch. The loop itself, views written in place included, is bitwise at every stage.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from verify.check import check_model
from verify.model_case import ModelCase

pytestmark = pytest.mark.xdist_group("recurrence")


class SelectiveScan(nn.Module):
    """``state_t = decay_t * state_{t-1} + drive_t`` per step, decay and drive selected by the
    input, each state written into a preallocated buffer (an in-place update of a view).
    ``parallel_when_compiled``: under ``is_compiling()`` the states come from a prefix scan
    instead (cumulative products and sums: the same recurrence, another association order)."""

    def __init__(self, parallel_when_compiled: bool = False, dim: int = 8, state: int = 4):
        super().__init__()
        self.parallel_when_compiled = parallel_when_compiled
        self.inp = nn.Linear(dim, dim)
        self.decay = nn.Linear(dim, state)
        self.drive = nn.Linear(dim, state)
        self.out = nn.Linear(state, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        decay, drive = torch.sigmoid(self.decay(h)), self.drive(h)
        if self.parallel_when_compiled and torch.compiler.is_compiling():  # the branch transformers' Mamba takes
            prefix = torch.cumprod(decay, dim=1)
            states = prefix * torch.cumsum(drive / prefix, dim=1)
        else:
            states = torch.zeros_like(drive)
            state = drive.new_zeros(drive.shape[0], drive.shape[2])
            for t in range(x.shape[1]):
                state = decay[:, t] * state + drive[:, t]
                states[:, t] = state  # in place, into a view of the buffer
                states[:, t].mul_(1.0)
        return self.head(self.out(states).mean(1))


def _batch(n):
    return torch.randn(n, 6, 8), torch.randint(0, 4, (n,))


LOOP = ModelCase("selective_scan", SelectiveScan, nn.functional.cross_entropy, _batch, batch_per_rank=2)
BRANCHING = ModelCase("selective_scan_branching", lambda: SelectiveScan(parallel_when_compiled=True),
                      nn.functional.cross_entropy, _batch, batch_per_rank=2)
BRANCH_LINE = next(i for i, line in enumerate(inspect.getsource(SelectiveScan.forward).splitlines())
                   if "is_compiling()" in line) + SelectiveScan.forward.__code__.co_firstlineno


def test_a_python_loop_with_in_place_indexed_updates_is_bitwise_at_every_stage(model_check):
    result = model_check(LOOP, plan="fsdp", mesh="dp=2")
    assert all(rep.bitwise for rep in result.parity.values()) and not result.explanations
    assert not result.as_traced  # bitwise: nothing to explain


def test_a_model_branching_on_is_compiling_is_named_not_blamed_on_a_pass():
    """Mamba's class: every stage, the joint graph included, differs from eager, the oracle passes,
    and each stage is bitwise with the eager program run as traced; the explanation names the
    model's line that asked the flag. The verdict is no failure (another program), and says so."""
    result = check_model(BRANCHING, plan="fsdp", mesh="dp=2", steps=2)
    assert result.parity and not any(rep.bitwise for rep in result.parity.values()), "the two branches must differ"
    assert all(rep.bitwise for rep in result.as_traced.values()) and set(result.as_traced) == set(result.parity)
    assert result.oracle.passed and result.ok, result.failures()
    site = f"{__file__}:{BRANCH_LINE} (forward)"
    assert site in result.run.joint.compiling_queries
    for stage in result.parity:
        assert site in result.explanations[stage] and "another program, not a pass" in result.explanations[stage]
    assert "parity joint              NOT bitwise with eager; bitwise with eager as traced (the model's own branch)" in result.summary()
