"""Where model code asks ``torch.compiler.is_compiling()`` during a trace (``compiling_queries``)."""

from __future__ import annotations

import inspect
import os
import types

import torch

from autoparallel.compiling_flag import _caller_site, compiling_queries, tracing_as_compiling


def _branching_forward():
    return "scan" if torch.compiler.is_compiling() else "loop"


def is_model_compiling():  # a predicate wrapping the flag, as transformers' is_torchdynamo_compiling
    return torch.compiler.is_compiling()


def _asks_through_a_predicate():
    return is_model_compiling()


def _line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_model_sites_are_recorded_once_in_call_order_and_the_flag_restored():
    original = torch.compiler.is_compiling
    with tracing_as_compiling(), compiling_queries() as sites:
        assert _branching_forward() == "scan"
        _branching_forward()
        assert _asks_through_a_predicate()
    assert torch.compiler.is_compiling is original and _branching_forward() == "loop"
    assert sites == [
        f"{__file__}:{_line_of(_branching_forward, 'is_compiling')} (_branching_forward)",
        f"{__file__}:{_line_of(_asks_through_a_predicate, 'is_model_compiling')} (_asks_through_a_predicate)",
    ]


def test_pytorchs_own_calls_are_not_model_sites():
    torch_file = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "module.py")
    frame = types.SimpleNamespace(f_code=types.SimpleNamespace(co_name="_call_impl", co_filename=torch_file), f_lineno=1, f_back=None)
    assert _caller_site(frame) is None
    with compiling_queries() as sites:
        torch.nn.Linear(2, 2)(torch.randn(1, 2))
    assert sites == []
