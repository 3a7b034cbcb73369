"""autoparallel.runtime.steps on hand-built graphs: the split-graph executor feeds inputs by role
label, the joint executor runs flat-codegen joint graphs, and train_steps keeps the final
parameters and AdamW moments."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.runtime import steps
from autoparallel.runtime.steps import (
    joint_graph_executor,
    seeded,
    split_graph_executor,
    train_steps,
)

aten = torch.ops.aten


def _labelled(g: fx.Graph, names_roles, outputs, out_roles) -> fx.GraphModule:
    for node, role in zip(g.find_nodes(op="placeholder"), names_roles, strict=True):
        node.meta[M.ROLE] = role
    out = g.output(tuple(outputs))
    out.meta[M.ROLE] = list(out_roles)
    return fx.GraphModule(torch.nn.Module(), g)


def _fw_bw():
    """loss = sum(w * x); the forward saves x under ``saved:0``; the backward also reads the
    primal ``param:w`` (as AOT backward graphs do) and returns grad:w = x * tangent (+ 0 * w)."""
    fw = fx.Graph()
    x, w = fw.placeholder("x"), fw.placeholder("w")  # inputs first: the order is the graph's own
    loss = fw.call_function(aten.sum.default, (fw.call_function(aten.mul.Tensor, (w, x)),))
    fw_gm = _labelled(fw, [roles.input_(0), roles.param("w")], [loss, x], [roles.LOSS, roles.saved(0)])
    bw = fx.Graph()
    t, w_, s = bw.placeholder("tangents_1"), bw.placeholder("w"), bw.placeholder("x")
    g = bw.call_function(aten.add.Tensor, (bw.call_function(aten.mul.Tensor, (s, t)), bw.call_function(aten.mul.Tensor, (w_, 0.0))))
    bw_gm = _labelled(bw, [roles.tangent(roles.LOSS), roles.param("w"), roles.saved(0)], [g, None], [roles.grad("w"), None])
    return fw_gm, bw_gm


def test_split_graph_executor_feeds_by_role_and_train_steps_keeps_final_state():
    fw, bw = _fw_bw()
    x = torch.tensor([1.0, 2.0, 3.0])
    trace = train_steps(split_graph_executor(fw, bw, {}), {"w": torch.ones(3)}, [(x,), (x,)])
    assert torch.equal(trace.losses[0], torch.tensor(6.0)) and torch.equal(trace.grads[0]["w"], x)
    assert set(trace.params) == {"w"} and not torch.equal(trace.params["w"], torch.ones(3))
    assert set(trace.optimizer_state["w"]) == {"exp_avg", "exp_avg_sq"}
    assert torch.all(trace.optimizer_state["w"]["exp_avg_sq"] > 0)


def test_split_graph_executor_names_an_unlabelled_placeholder():
    fw, bw = _fw_bw()
    del next(iter(bw.graph.find_nodes(op="placeholder"))).meta[M.ROLE]
    with pytest.raises(ValueError, match=r"placeholder 'tangents_1' has no role label"):
        split_graph_executor(fw, bw, {})


def test_joint_graph_executor_runs_a_flat_codegen_joint_graph():
    """After a placement step recompiles it, a joint graph takes flat arguments."""
    g = fx.Graph()
    w, x, t = g.placeholder("primals_1"), g.placeholder("primals_2"), g.placeholder("tangents_1")
    loss = g.call_function(aten.sum.default, (g.call_function(aten.mul.Tensor, (w, x)),))
    grad = g.call_function(aten.mul.Tensor, (x, t))
    g.output((loss, grad, None))
    gm = fx.GraphModule(torch.nn.Module(), g)
    in_roles = [roles.param("w"), roles.input_(0), roles.tangent(roles.LOSS)]
    run = joint_graph_executor(gm, in_roles, [roles.LOSS, roles.grad("w"), None], {})
    loss, grads = run({"w": torch.full((2,), 2.0)}, (torch.tensor([1.0, 3.0]),))
    assert torch.equal(loss, torch.tensor(8.0)) and torch.equal(grads["w"], torch.tensor([1.0, 3.0]))


def test_seeded_restores_the_cpu_generator_and_forks_the_cuda_ones_it_is_given(monkeypatch):
    before = torch.rand(1)
    state = torch.get_rng_state()
    with seeded(7):
        first = torch.rand(1)
    assert torch.equal(torch.get_rng_state(), state) and not torch.equal(first, before)
    with seeded(7):
        assert torch.equal(torch.rand(1), first)
    forked = []
    real = torch.random.fork_rng
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices, **kw: forked.append(devices) or real(devices=[]))
    with seeded(7, [torch.device("cuda", 1), "cpu", "cuda:0", torch.device("cuda", 1)]):
        pass
    assert forked == [[0, 1]]  # each CUDA device once: manual_seed reseeds them all


def test_train_steps_seeds_on_the_batches_devices(monkeypatch):
    """A device world's batches live on CUDA, where dropout draws: train_steps used to restore
    only the CPU generator and left the device's reseeded. It now hands ``seeded`` the devices
    its batches are on."""
    calls = []
    real = steps.seeded
    monkeypatch.setattr(steps, "seeded", lambda seed, devices=(): calls.append((seed, set(devices))) or real(seed, devices))

    def step(params, inputs):
        return (params["w"] * inputs[0]).sum(), {"w": inputs[0].clone()}

    train_steps(step, {"w": torch.ones(2)}, [(torch.ones(2),), (torch.ones(2),)], seed=3)
    assert calls == [(steps.step_seed(3, 0), {torch.device("cpu")}), (steps.step_seed(3, 1), {torch.device("cpu")})]


def _frozen_fw_bw():
    """loss = sum(w * x) + 0 * sum(f): ``f`` is a parameter the backward returns None for (frozen,
    or not reached); ``u`` is a parameter with no gradient output at all."""
    fw = fx.Graph()
    x, w, f, u = (fw.placeholder(n) for n in ("x", "w", "f", "u"))
    loss = fw.call_function(aten.sum.default, (fw.call_function(aten.mul.Tensor, (w, x)),))
    fw_gm = _labelled(fw, [roles.input_(0), roles.param("w"), roles.param("f"), roles.param("u")], [loss, x],
                      [roles.LOSS, roles.saved(0)])
    bw = fx.Graph()
    t, s = bw.placeholder("tangents_1"), bw.placeholder("x")
    g = bw.call_function(aten.mul.Tensor, (s, t))
    bw_gm = _labelled(bw, [roles.tangent(roles.LOSS), roles.saved(0)], [g, None], [roles.grad("w"), roles.grad("f")])
    return fw_gm, bw_gm


def test_a_parameter_without_a_gradient_gets_none_and_no_adamw_step():
    """Eager PyTorch leaves .grad None for such a parameter and AdamW skips it (no weight decay
    either). The executor used to raise on a None gradient output."""
    fw, bw = _frozen_fw_bw()
    x = torch.tensor([1.0, 2.0, 3.0])
    init = {"w": torch.ones(3), "f": torch.full((3,), 5.0), "u": torch.full((2,), 7.0)}
    trace = train_steps(split_graph_executor(fw, bw, {}), {k: v.clone() for k, v in init.items()}, [(x,), (x,)])
    assert [g["f"] for g in trace.grads] == [None, None] and [g["u"] for g in trace.grads] == [None, None]
    assert torch.equal(trace.params["f"], init["f"]) and torch.equal(trace.params["u"], init["u"])
    assert not torch.equal(trace.params["w"], init["w"])  # the trained one moved
    assert trace.optimizer_state["f"] == {} and set(trace.optimizer_state["w"]) == {"exp_avg", "exp_avg_sq"}


def test_train_steps_still_refuses_an_executor_that_forgets_a_parameter():
    def forgetful(params, inputs):
        return torch.tensor(1.0), {"w": torch.ones(1)}  # no entry for "v" at all (None would say: no gradient)

    with pytest.raises(RuntimeError, match=r"no gradient entry for \['v'\]"):
        train_steps(forgetful, {"w": torch.ones(1), "v": torch.ones(1)}, [()])
