"""autoparallel.runtime.steps on hand-built graphs: the split-graph executor feeds inputs by role
label, the joint executor runs flat-codegen joint graphs, and train_steps keeps the final
parameters and AdamW moments."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx

from autoparallel import meta as M
from autoparallel import patches, roles
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


def _clamped_fw_bw():
    """A parameter clamped in place in forward (gemma3n's ``weight.data.clamp_``), as AOT splits it:
    the forward returns w's new value (``mutated:w``) and loss = sum(clamp(w) * x); the backward takes
    the new value's tangent before the loss's and returns grad:w = x * t_loss + t_new."""
    fw = fx.Graph()
    w, x = fw.placeholder("w"), fw.placeholder("x")
    new = fw.call_function(aten.clamp.default, (w, -0.1, 0.1))
    loss = fw.call_function(aten.sum.default, (fw.call_function(aten.mul.Tensor, (new, x)),))
    fw_gm = _labelled(fw, [roles.param("w"), roles.input_(0)], [new, loss, x], [roles.mutated("w"), roles.LOSS, roles.saved(0)])
    bw = fx.Graph()
    t_new, t_loss, s = bw.placeholder("tangents_1"), bw.placeholder("tangents_2"), bw.placeholder("x")
    t_new.meta[M.VAL], t_loss.meta[M.VAL] = torch.empty(3), torch.empty(())
    g = bw.call_function(aten.add.Tensor, (bw.call_function(aten.mul.Tensor, (s, t_loss)), t_new))
    bw_roles = [roles.tangent(roles.mutated("w")), roles.tangent(roles.LOSS), roles.saved(0)]
    return fw_gm, _labelled(bw, bw_roles, [g], [roles.grad("w")])


def test_only_the_loss_s_tangent_is_a_one():
    """The step differentiates the loss alone: the new value's tangent gets zeros (what autograd
    materializes for an output nothing reads, in the compiled module), so grad:w = x. With a 1 for
    every tangent (patch zero_tangents off), grad:w = x + 1."""
    fw, bw = _clamped_fw_bw()
    x = torch.tensor([1.0, 2.0, 3.0])
    loss, grads = split_graph_executor(fw, bw, {})({"w": torch.full((3,), 0.5)}, (x,))
    assert torch.equal(loss, torch.tensor(0.6)) and torch.equal(grads["w"], x)
    with patches.disabled(steps.ZERO_TANGENTS):
        _, grads = split_graph_executor(fw, bw, {})({"w": torch.full((3,), 0.5)}, (x,))
    assert torch.equal(grads["w"], x + 1)


def test_the_joint_executor_feeds_the_same_tangents():
    g = fx.Graph()
    w, x, t_new, t_loss = (g.placeholder(n) for n in ("primals_1", "primals_2", "tangents_1", "tangents_2"))
    for ph, val in zip((w, x, t_new, t_loss), (torch.empty(3), torch.empty(3), torch.empty(3), torch.empty(())), strict=True):
        ph.meta[M.VAL] = val
    new = g.call_function(aten.clamp.default, (w, -0.1, 0.1))
    loss = g.call_function(aten.sum.default, (g.call_function(aten.mul.Tensor, (new, x)),))
    grad = g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (x, t_loss)), t_new))
    g.output((new, loss, grad))
    in_roles = [roles.param("w"), roles.input_(0), roles.tangent(roles.mutated("w")), roles.tangent(roles.LOSS)]
    run = joint_graph_executor(fx.GraphModule(torch.nn.Module(), g), in_roles, [roles.mutated("w"), roles.LOSS, roles.grad("w")], {})
    x_ = torch.tensor([1.0, 2.0, 3.0])
    params = {"w": torch.full((3,), 0.5)}
    _, grads = run(params, (x_,))
    assert torch.equal(grads["w"], x_) and torch.equal(params["w"], torch.full((3,), 0.1))  # the new value applied


def test_another_output_s_tangent_without_a_traced_value_is_refused_by_name():
    fw, bw = _clamped_fw_bw()
    del next(iter(bw.graph.find_nodes(op="placeholder"))).meta[M.VAL]
    with pytest.raises(ValueError, match=re.escape(f"tangent {roles.tangent(roles.mutated('w'))!r} has no traced value")):
        split_graph_executor(fw, bw, {})


class _ClampingModule(torch.nn.Module):
    """A module with its own parameters (as a ParallelModule) that clamps one in place in forward."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Linear(3, 1, bias=False)

    def local_parameters(self):
        return {"w": self.model.weight}

    def forward(self, x):
        self.model.weight.data.clamp_(-0.1, 0.1)
        return self.model(x).sum()


def test_a_module_s_in_place_update_of_a_parameter_reaches_the_step_s_parameters():
    """The optimizer steps the clamped value, as in eager (the module executors used to leave the
    step's copy unclamped, so plan="auto" of such a model differed from step 1 on)."""
    params = {"w": torch.ones(1, 3)}
    loss, grads = steps.parallel_module_executor(_ClampingModule())(params, (torch.tensor([[1.0, 2.0, 3.0]]),))
    assert torch.equal(params["w"], torch.full((1, 3), 0.1)) and torch.equal(grads["w"], torch.tensor([[1.0, 2.0, 3.0]]))
