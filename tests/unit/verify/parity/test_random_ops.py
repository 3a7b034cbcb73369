"""verify.parity.random_ops: dropout switched off on both sides of the oracle, and every other random op
named. The two sides are independent (a graph rewrite of aten ops; a torch-function mode over
the model's Python calls), so each is checked against the other and against p=0 written by hand."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from verify.parity.random_ops import (
    RandomOpError,
    graph_without_random_ops,
    random_nodes,
    random_ops_disabled,
)

aten = torch.ops.aten


def _dropout_graph() -> fx.GraphModule:
    """x -> native_dropout(x, 0.5) -> *3, and its backward, built by hand."""
    g = fx.Graph()
    x, grad = g.placeholder("x"), g.placeholder("grad")
    drop = g.call_function(aten.native_dropout.default, (x, 0.5, True))
    out, mask = g.call_function(lambda t, i: t[i], (drop, 0)), g.call_function(lambda t, i: t[i], (drop, 1))
    y = g.call_function(aten.mul.Tensor, (out, 3.0))
    gx = g.call_function(aten.native_dropout_backward.default, (grad, mask, 2.0))
    g.output((y, gx))
    return fx.GraphModule({}, g)


def test_the_graph_side_sets_p_to_zero_and_the_backwards_scale_to_one():
    gm = _dropout_graph()
    off = graph_without_random_ops(gm)
    drop = next(n for n in off.graph.nodes if n.target is aten.native_dropout.default)
    back = next(n for n in off.graph.nodes if n.target is aten.native_dropout_backward.default)
    assert drop.args[1] == 0.0 and back.args[2] == 1.0
    assert [n.name for n in off.graph.nodes] == [n.name for n in gm.graph.nodes], "node names kept (placements by name)"
    assert next(n for n in gm.graph.nodes if n.target is aten.native_dropout.default).args[1] == 0.5, "the input is untouched"
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    y, gx = off(x, grad)
    assert torch.equal(y, x * 3.0) and torch.equal(gx, grad), "dropout at p=0: the identity, both ways"
    y_on, _ = gm(x, grad)
    assert not torch.equal(y_on, x * 3.0), "the original still drops"


def test_a_random_op_that_is_not_a_dropout_is_named():
    def f(x):
        return x + torch.rand_like(x)

    gm = make_fx(f)(torch.randn(3))
    assert [n.target for n in random_nodes(gm)] == [aten.rand_like.default]
    with pytest.raises(RandomOpError, match=r"random op aten\.rand_like\.default \(node rand_like.*is not a dropout"):
        graph_without_random_ops(gm)


def test_an_attention_kernel_called_without_dropout_is_not_random_and_with_dropout_is_switched_off():
    q = torch.randn(1, 2, 4, 8)
    with random_ops_disabled():  # SDPA's CPU kernel is tagged random whatever its dropout_p
        plain = nn.functional.scaled_dot_product_attention(q, q, q)
        dropped = nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.3)
        positional = nn.functional.scaled_dot_product_attention(q, q, q, None, 0.3)
    assert torch.equal(plain, dropped) and torch.equal(plain, positional)
    assert torch.equal(plain, nn.functional.scaled_dot_product_attention(q, q, q))


class _Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.4)

    def forward(self, x):
        h = self.drop(self.lin(x))
        return nn.functional.dropout(h, 0.3, True) + torch.dropout(h, 0.2, True)


def test_the_eager_side_is_the_model_at_p_zero_bitwise_forward_and_backward():
    torch.manual_seed(0)
    model, x = _Dropping(), torch.randn(4, 8)
    with random_ops_disabled():
        off = model(x)
        off.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    h = model.lin(x)  # by hand: every dropout the identity
    want = h + h
    want.sum().backward()
    assert torch.equal(off, want)
    assert all(torch.equal(grads[k], p.grad) for k, p in model.named_parameters())
    assert not torch.equal(model(x), want), "outside the context dropout draws again (nothing left behind)"


def test_the_eager_side_names_a_random_op_it_cannot_switch_off():
    with random_ops_disabled(), pytest.raises(RandomOpError, match=r"aten\.(bernoulli|rand)"):
        torch.bernoulli(torch.full((3,), 0.5))
    torch.bernoulli(torch.full((3,), 0.5))  # and the check is gone after


def test_both_sides_agree_on_a_traced_model():
    """The graph side (make_fx of the model's forward and backward, rewritten) and the eager side
    (the model under random_ops_disabled) compute bitwise the same."""
    torch.manual_seed(0)
    model, x = _Dropping(), torch.randn(4, 8)
    params = dict(model.named_parameters())

    def step(params, x):
        out = torch.func.functional_call(model, params, (x,))
        return out, torch.autograd.grad(out.sum(), list(params.values()))

    # As the joint trace sees it (Python dispatcher: aten.dropout -> native_dropout, not CPU's bernoulli_).
    with enable_python_dispatcher():
        gm = make_fx(step)(params, x)
    assert [n.target for n in random_nodes(gm)] == [aten.native_dropout.default] * 3
    out, grads = graph_without_random_ops(gm)(params, x)
    with random_ops_disabled():
        want, want_grads = step(params, x)
    assert torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))


def test_the_graph_sides_dropout_draws_nothing_so_a_later_draw_is_the_single_device_ones():
    """native_dropout at p=0 in training still draws a mask (F.dropout at p=0 does not): the
    rewritten graph runs it with train=False, so a random op after it draws what the model at p=0
    draws from the same seed."""
    def f(x):
        return aten.native_dropout.default(x, 0.5, True)[0] + torch.rand(4, 8)

    gm = make_fx(f)(torch.randn(4, 8))
    off = graph_without_random_ops(gm, keep_others=True)
    drop = next(n for n in off.graph.nodes if n.target is aten.native_dropout.default)
    assert drop.args[1:] == (0.0, False)
    x = torch.randn(4, 8)
    torch.manual_seed(7)
    got = off(x)
    torch.manual_seed(7)
    with random_ops_disabled(keep_others=True):
        want = nn.functional.dropout(x, 0.5, True) + torch.rand(4, 8)
    assert torch.equal(got, want)


def test_random_ops_kept_on_both_sides_only_when_asked():
    gm = make_fx(lambda x: x + torch.rand_like(x))(torch.randn(3))
    with pytest.raises(RandomOpError):
        graph_without_random_ops(gm)
    kept = graph_without_random_ops(gm, keep_others=True)
    assert [n.target for n in random_nodes(kept)] == [aten.rand_like.default]
    with random_ops_disabled(keep_others=True):
        torch.bernoulli(torch.full((3,), 0.5))  # draws: not an error
