"""The pieces of a rank's explanation of its own graphs (verify.parity.rank_explain); the runs
themselves are in tests/parity/test_moe_retrace.py (a gloo world)."""

from __future__ import annotations

import torch

from verify.parity.compare import ParityReport, diff_tensors
from verify.parity.rank_explain import TRACE, first_step, merge_rank_explanations, not_the_trace


def _report(*names_equal):
    rep = ParityReport("a", "b")
    for name, equal in names_equal:
        rep.diffs.append(diff_tensors(name, torch.zeros(2), torch.zeros(2) if equal else torch.ones(2)))
    return rep


def test_first_step_is_the_earliest_step_with_a_difference():
    assert first_step(_report(("step0/loss", True), ("step1/grad:w", False), ("step2/loss", False))) == 1
    assert first_step(_report(("step0/loss", True), ("final/param:w", False))) == 0  # only the final parameters
    assert first_step(_report(("step3/loss", False), ("step10/loss", False))) == 3


def test_ranks_that_say_the_same_merge_into_one_line_and_others_are_named():
    same = merge_rank_explanations([{"x": "why"}, {"x": "why"}], ["x"])
    assert same == {"x": "on every rank (2), why"}
    apart = merge_rank_explanations([{"x": "a"}, {"x": "b"}, {}], ["x", "y"])
    assert apart == {"x": "rank 0: a | rank 1: b"}  # a stage no rank explains gets no line
    one = merge_rank_explanations([{}, {"x": "a"}], ["x"])
    assert one == {"x": "rank 1: a"}  # only the rank whose own trace differs explains it


def test_a_difference_after_a_bitwise_stage_is_not_called_the_trace():
    """No pass differs on simulated ranks: where a stage before is bitwise with eager, the line
    says the trace is not the cause (switch_transformers' collective_passes, 11m); where none is,
    it stays the trace's."""
    why = f"every pass up to c computes what its input computes (2 simulated ranks), so {TRACE}"
    assert not_the_trace(why, "c", ["a", "b", "c"], {"c": 1}).count("b is bitwise with the eager program on this rank") == 1
    assert TRACE not in not_the_trace(why, "c", ["a", "b", "c"], {"c": 1})
    assert not_the_trace(why, "c", ["a", "b", "c"], {"a": 1, "b": 1, "c": 1}) == why  # every stage differs: the trace
    assert not_the_trace("pass x computes other values", "c", ["a", "c"], {"c": 1}) == "pass x computes other values"
