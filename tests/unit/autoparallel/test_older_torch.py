"""What torch 2.11 (the CUDA build on the GPU machines .ci/gpu runs on) lacks of the 2.13 API the
stack uses, and what the code does without it. Each test takes the 2.13 name away for its scope
(monkeypatch) and checks the fallback computes what the 2.13 path does."""

from __future__ import annotations

import operator

import pytest
import torch
import torch._functorch.partitioners as partitioners
import torch.fx as fx
import torch.fx.experimental.symbolic_shapes as symbolic_shapes
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autoparallel import meta as M
from autoparallel.compiling_flag import tracing_as_compiling
from autoparallel.fx_utils import size_hint, tensor_bytes
from autoparallel.replay_partition import ReplaySavesPartitioner, _is_opaque, _only_asserted


def test_the_traces_set_is_compiling_without_a_compile_session_context(monkeypatch):
    monkeypatch.delattr(torch.compiler, "_compile_session_context")
    assert not torch.compiler.is_compiling()
    with tracing_as_compiling():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


def test_a_flag_set_before_is_restored_after_a_failing_trace(monkeypatch):
    monkeypatch.delattr(torch.compiler, "_compile_session_context")
    with pytest.raises(RuntimeError, match="boom"), tracing_as_compiling():
        raise RuntimeError("boom")
    assert not torch.compiler.is_compiling()


def _symint(hint: int) -> torch.SymInt:
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(hint, source=ConstantSource("n")), hint=hint)


def test_a_size_hint_without_optimization_hint_uses_hint_int(monkeypatch):
    s = _symint(6)
    assert size_hint(s) == 6 and size_hint(7) == 7
    asked = []

    def hint_int(x, fallback=None):
        asked.append(fallback)
        return 6

    monkeypatch.delattr(symbolic_shapes, "optimization_hint")
    monkeypatch.setattr(symbolic_shapes, "hint_int", hint_int, raising=False)
    assert size_hint(s) == 6 and size_hint(s, fallback=0) == 6 and asked == [None, 0]
    assert tensor_bytes(torch.empty(3, 2)) == 24  # a static size asks for no hint at all
    assert asked == [None, 0]


def _bool_node(users: str) -> fx.Node:
    env = ShapeEnv()
    s = env.create_unbacked_symint()
    g = fx.Graph()
    x = g.placeholder("x")
    cond = g.call_function(operator.gt, (x, 2))
    cond.meta["val"] = s > 2
    if users == "assert":
        g.call_function(torch.ops.aten._assert_scalar.default, (cond, "x > 2"))
    elif users == "other":
        g.call_function(operator.not_, (cond,))
    g.output(x)
    return cond


@pytest.mark.parametrize(("users", "only_asserted"), [("assert", True), ("other", False), ("none", False)])
def test_a_symbool_only_asserted_is_left_unsaved_as_upstream_leaves_it(users, only_asserted, monkeypatch):
    node = _bool_node(users)
    assert _only_asserted(node) is only_asserted  # upstream's rule
    monkeypatch.delattr(partitioners, "_is_assert_only_symbool", raising=False)
    assert _only_asserted(node) is only_asserted  # the fallback, as on torch 2.11


def test_a_node_is_never_opaque_on_a_torch_without_opaque_values(monkeypatch):
    g = fx.Graph()
    node = g.placeholder("x")
    node.meta["val"] = torch.empty(2)
    monkeypatch.delattr(partitioners, "is_opaque_node", raising=False)
    assert _is_opaque(node) is False


def test_the_replay_partitioner_runs_on_torch_2_11s_extract_without_opaque_values(monkeypatch):
    """2.11's ``_extract_fwd_bwd_modules`` takes no ``saved_opaque_nodes``: a graph with no
    opaque value must not pass it, and must split as it does on 2.13."""
    extract = partitioners._extract_fwd_bwd_modules

    def extract_2_11(joint_module, saved_values, saved_sym_nodes, *, num_fwd_outputs, static_lifetime_input_nodes=None):
        return extract(joint_module, saved_values, saved_sym_nodes, num_fwd_outputs=num_fwd_outputs,
                       static_lifetime_input_nodes=static_lifetime_input_nodes)

    def joint() -> fx.GraphModule:
        """primals_1 -> a = sin (recorded as saved) -> cos: the forward; a * tangents_1: the grad."""
        g = fx.Graph()
        x, tan = g.placeholder("primals_1"), g.placeholder("tangents_1")
        x.meta[M.VAL], tan.meta[M.VAL] = torch.randn(4), torch.randn(4)
        a = g.call_function(torch.ops.aten.sin.default, (x,))
        a.name, a.meta[M.VAL], a.meta[M.CUSTOM] = "a", torch.randn(4), {M.AP_MUST_SAVE: True}
        out = g.call_function(torch.ops.aten.cos.default, (a,))
        grad = g.call_function(torch.ops.aten.mul.Tensor, (a, tan))
        out.meta[M.VAL], grad.meta[M.VAL] = torch.randn(4), torch.randn(4)
        g.output((out, grad)).meta[M.DESC] = [None, None]
        return fx.GraphModule(torch.nn.Module(), g)

    def saved(gm) -> list[str]:
        _, bw = ReplaySavesPartitioner()(gm, [torch.randn(4), torch.randn(4)], num_fwd_outputs=1)
        return [ph.name for ph in bw.graph.find_nodes(op="placeholder")]

    expected = saved(joint())
    monkeypatch.setattr(partitioners, "_extract_fwd_bwd_modules", extract_2_11)
    assert saved(joint()) == expected == ["a", "tangents_1"]
