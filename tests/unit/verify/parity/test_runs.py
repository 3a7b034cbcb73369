"""verify.parity.runs: what the parity runners share."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from verify.parity.runs import no_recompile


def test_a_compiled_module_that_recompiles_inside_is_refused():
    """Both parity runners run the module their pipeline compiled; a compile inside the scope
    means the run tests other graphs than those, and must say so."""
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    torch._dynamo.reset()
    try:
        f(torch.ones(3))  # compiled outside: nothing new inside
        with no_recompile("the kept graphs"):
            f(torch.ones(3))
        with pytest.raises(RuntimeError, match="recompiled the module in the rank: the parity run would not test the kept graphs"):
            with no_recompile("the kept graphs"):
                f(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: a new graph
    finally:
        torch._dynamo.reset()
