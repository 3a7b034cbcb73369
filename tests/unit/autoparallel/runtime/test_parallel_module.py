"""ParallelModule's forward: the primals in the joint graph's order, read from the local module tree
without name lookups (Dynamo runs forward bytecode by bytecode in the second compile), under the
sources the second compile's roles come from."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn

from autoparallel.compile import dynamo_input_roles
from autoparallel.runtime.parallel_module import ParallelModule

ROLES = ["param:blocks.0.attn.w", "buffer:blocks.0.norm.mean", "input:1", "param:head", "input:0", "tangent:loss"]


def _module(recorded: list | None = None) -> ParallelModule:
    def compiled(*args):
        if recorded is not None:
            recorded.append(args)
        return sum(a.sum() for a in args)

    params = {"blocks.0.attn.w": torch.ones(2, 3), "head": torch.full((3,), 2.0)}
    buffers = {"blocks.0.norm.mean": torch.zeros(3)}
    return ParallelModule(compiled, ROLES, params, buffers)


def test_forward_passes_the_primals_in_the_joint_graphs_order():
    seen = []
    mod = _module(seen)
    x0, x1 = torch.randn(2), torch.randn(4)
    mod(x0, x1)
    (args,) = seen
    want = [mod.model.get_parameter("blocks.0.attn.w"), mod.model.get_buffer("blocks.0.norm.mean"), x1,
            mod.model.get_parameter("head"), x0]
    assert len(args) == len(want) and all(a is w for a, w in zip(args, want, strict=True))


def test_a_parameter_replaced_after_construction_is_the_one_passed():
    seen = []
    mod = _module(seen)
    new = nn.Parameter(torch.zeros(2, 3))
    mod.model.blocks.get_submodule("0.attn").w = new
    mod(torch.randn(2), torch.randn(4))
    assert seen[0][0] is new


def test_forward_looks_up_no_names(monkeypatch):
    """get_parameter / get_buffer split and check the name on every call: under torch.compile
    that was half of Dynamo's steps on a small model."""
    mod = _module()

    def refused(self, target):
        raise AssertionError(f"forward looked up {target!r} by name")

    for lookup in ("get_parameter", "get_buffer", "get_submodule"):
        monkeypatch.setattr(nn.Module, lookup, refused)
    assert mod(torch.zeros(2), torch.zeros(4)).item() == 6 + 0 + 6  # ones(2, 3), zeros(3), full(3, 2.0)


def test_the_compiled_graph_names_its_inputs_by_the_users_fqns():
    mod = _module()
    seen = []

    def backend(gm, example_inputs):
        seen.append(dynamo_input_roles(gm))  # while Dynamo's graph args are alive
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(mod, backend=backend, fullgraph=True)(torch.randn(2), torch.randn(4))
    finally:
        torch._dynamo.reset()
    (found,) = seen
    assert sorted(found) == sorted(r for r in ROLES if not r.startswith("tangent"))


def test_the_number_of_inputs_is_checked():
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        _module()(torch.randn(2))


def test_frozen_parameters_are_held_without_requires_grad_and_share_the_given_storage():
    """Without ``frozen`` every local parameter required grad, so a frozen one would get a
    gradient from the compiled module and an AdamW update."""
    params = {"blocks.0.attn.w": torch.ones(2, 3), "head": torch.full((3,), 2.0)}
    given = nn.Parameter(torch.ones(2, 3))  # a caller's trainable Parameter, frozen in the model
    mod = ParallelModule(lambda *a: sum(t.sum() for t in a), ROLES, {**params, "blocks.0.attn.w": given},
                         {"blocks.0.norm.mean": torch.zeros(3)}, frozen=["blocks.0.attn.w"])
    local = mod.local_parameters()
    assert not local["blocks.0.attn.w"].requires_grad and local["head"].requires_grad
    assert local["blocks.0.attn.w"].data_ptr() == given.data_ptr() and given.requires_grad  # the caller's is untouched
    mod(torch.randn(2), torch.randn(4)).backward()
    assert local["blocks.0.attn.w"].grad is None and local["head"].grad is not None
