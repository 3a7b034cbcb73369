"""AOTAutograd's graph text only for a listener (patch ``aot_graph_text_only_when_logged``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch._logging._internal import trace_log

from autoparallel.aot_graph_text import aot_graph_text_only_when_logged
from autoparallel.compile import SECOND_COMPILE
from autoparallel.parallelize import ParallelPlan
from autoparallel.pipeline import PipelineOptions
from autoparallel.pipeline import run_pipeline as run_stages

AOT_GRAPHS = ("aot_joint_graph", "aot_forward_graph", "aot_backward_graph")


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _run_until_second_compile():
    torch.manual_seed(0)
    inputs = (torch.randn(4, 8), torch.randn(4, 4))
    return run_stages(_Mlp(), nn.functional.mse_loss, inputs, ParallelPlan.fsdp(), "dp=2",
                      PipelineOptions(alternatives=False), until=SECOND_COMPILE)


def test_no_graph_text_without_a_listener(monkeypatch):
    """Upstream prints the joint graph and both partitions on every AOT compile (first partition,
    second compile) and drops the text when nobody listens."""
    printed = []

    def print_readable(self, *args, **kwargs):
        printed.append(type(self).__name__)
        return ""

    monkeypatch.setattr(trace_log, "handlers", [])
    monkeypatch.setattr(torch.fx.GraphModule, "print_readable", print_readable)
    _run_until_second_compile()
    assert printed == []


def test_a_structured_trace_still_gets_aots_graphs(structured_trace):
    _run_until_second_compile()
    kinds = [k for m, _ in structured_trace.records for k in m if k in AOT_GRAPHS]
    # the first partition logs its joint graph and both partitions; the second compile (graphs
    # only) stops inside its partitioner, after its joint graph
    assert kinds == ["aot_joint_graph", "aot_forward_graph", "aot_backward_graph", "aot_joint_graph"], kinds
    texts = [p for m, p in structured_trace.records if "aot_forward_graph" in m or "aot_joint_graph" in m]
    assert all("def forward(" in t and "primals_1" in t and "all_gather" in t for t in texts), texts


@pytest.mark.parametrize("logger", ["aot_joint_log", "aot_graphs_log"])
def test_an_enabled_artifact_logger_still_gets_its_text(monkeypatch, logger):
    import torch._functorch._aot_autograd.graph_compile as graph_compile

    calls = []
    for name in ("_log_joint_graph", "_log_fw_bw_graphs"):
        upstream = getattr(graph_compile, name)
        monkeypatch.setattr(graph_compile, name, lambda *a, _n=name, _up=upstream: calls.append(_n) or _up(*a))
    monkeypatch.setattr(trace_log, "handlers", [])
    monkeypatch.setattr(getattr(graph_compile, logger), "isEnabledFor", lambda level: level >= logging.INFO)
    _run_until_second_compile()
    # each logger gets the text it logs; the other's stays unrendered
    assert calls == (["_log_joint_graph"] * 2 if logger == "aot_joint_log" else ["_log_fw_bw_graphs"])


def test_the_swap_is_scoped_and_restored_on_error():
    import torch._functorch._aot_autograd.graph_compile as graph_compile

    up = (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs)
    with pytest.raises(RuntimeError, match="boom"):
        with aot_graph_text_only_when_logged():
            assert graph_compile._log_joint_graph is not up[0] and graph_compile._log_fw_bw_graphs is not up[1]
            raise RuntimeError("boom")
    assert (graph_compile._log_joint_graph, graph_compile._log_fw_bw_graphs) == up
