"""Patch ``unread_saves_dropped``: the replay partition saves no value only dead code of its
backward reads. A BatchNorm before a dropout was the case (efficientnet): the backward's
extraction copied the dead draw with the BatchNorm that feeds it, so the running stats, which the
forward updates in place, were saved and failed autograd's version check."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.nn.functional import mse_loss

from autoparallel import patches
from autoparallel.replay_partition import UNREAD_SAVES_PATCH, unread_saves
from verify.model_case import ModelCase
from verify.parity.runs import EAGER, compare_with_eager, run_stage_parity
from verify.stages.pipeline_run import run_scenario
from verify.stages.scenario import Scenario

aten = torch.ops.aten


class NormThenDropout(nn.Module):
    """Linear, BatchNorm (running stats updated in forward), dropout, Linear: the norm's output is
    read by the dropout only, so the backward does not save it."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.drop, self.head = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.25), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.drop(self.norm(self.a(x))))


def _batch(n: int):
    return torch.randn(n, 8), torch.randn(n, 4)


def _scenario(seed: int = 0) -> Scenario:
    return Scenario(case=ModelCase("norm_then_dropout", NormThenDropout, mse_loss, _batch, batch_per_rank=4),
                    plan="fsdp", mesh="dp=2", seed=seed)


def _saved_buffers(bw: fx.GraphModule, buffer_shapes: set[tuple[int, ...]]) -> list[str]:
    """The backward's inputs (saved values) shaped like a running stat and read by nothing."""
    return [n.name for n in bw.graph.find_nodes(op="placeholder")
            if not n.users and tuple(n.meta["val"].shape) in buffer_shapes]


def test_the_second_compile_saves_no_buffer_its_backward_does_not_read():
    _, bw = run_scenario(_scenario(), until="second_compile", alternatives=False).stage("second_compile").graphs
    assert not _saved_buffers(bw, {(16,)})


@pytest.mark.xdist_group("unread-saves")
def test_batchnorm_before_dropout_trains_bitwise_in_the_second_compile():
    ranks = run_stage_parity(_scenario(), 2, executors=(EAGER, "second_compile"))
    compare_with_eager(ranks, "second_compile").assert_bitwise()


def _backward(draw_live: bool) -> fx.GraphModule:
    """``stat`` feeds only a draw (through an add and ``empty_like``); the output reads ``x``, and
    the draw if ``draw_live``."""
    g = fx.Graph()
    stat, x = g.placeholder("stat"), g.placeholder("x")
    draw = g.call_function(aten.bernoulli.p, (g.call_function(aten.empty_like.default, (g.call_function(aten.add.Tensor, (x, stat)),)), 0.5))
    g.output((g.call_function(aten.mul.Tensor, (x, draw if draw_live else x)),))
    return fx.GraphModule(nn.Module(), g)


def test_unread_saves_names_placeholders_only_a_dead_draw_reads():
    assert unread_saves(_backward(draw_live=False)) == {"stat"}
    assert unread_saves(_backward(draw_live=True)) == set()


def test_disabled_the_second_compile_saves_a_buffer_nothing_reads():
    """The negative: with the patch off the running stats come back as unread saves (what made the
    backward fail). Another seed: a run shared in the session (``reuse_pipeline_runs``, keyed by
    the scenario, not by the patches in force) would be the patched one."""
    with patches.disabled(UNREAD_SAVES_PATCH):
        _, bw = run_scenario(_scenario(seed=1), until="second_compile", alternatives=False).stage("second_compile").graphs
    assert _saved_buffers(bw, {(16,)})
