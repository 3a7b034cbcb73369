"""Dropout switched off on both sides of the oracle agree, on generated models: a stack of layers
with dropouts of random kinds (nn.Dropout, F.dropout positional or by keyword, torch.dropout,
SDPA's dropout_p) and probabilities, traced forward and backward as the joint trace sees them and
rewritten by ``graph_without_random_ops``, computes what the model computes under
``random_ops_disabled``, and that is bitwise what it computes with every probability written as 0.
Graph and eager are bitwise too, except through SDPA: traced with dropout, its graph takes the
math path, while eager at p=0 takes the fused CPU kernel (~1e-7 apart; the oracle's tolerance is
what covers that)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx

from verify.random_ops import graph_without_random_ops, random_nodes, random_ops_disabled

F = nn.functional
KINDS = ("module", "functional", "functional_kw", "torch", "sdpa")


class _Stack(nn.Module):
    def __init__(self, layers: list[tuple[str, float]], width: int, zero: bool = False):
        super().__init__()
        self.layers = layers
        self.zero = zero
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in layers)
        self.drops = nn.ModuleList(nn.Dropout(0.0 if zero else p) for _, p in layers)

    def forward(self, x):
        for (kind, p), lin, drop in zip(self.layers, self.lins, self.drops, strict=True):
            p = 0.0 if self.zero else p
            h = torch.tanh(lin(x))
            if kind == "module":
                h = drop(h)
            elif kind == "functional":
                h = F.dropout(h, p, True)
            elif kind == "functional_kw":
                h = F.dropout(h, p=p, training=True)
            elif kind == "torch":
                h = torch.dropout(h, p, True)
            else:
                q = h.view(1, 1, *h.shape)
                h = F.scaled_dot_product_attention(q, q, q, dropout_p=p).view(h.shape)
            x = x + h
        return x.sum()


# A make_fx trace per example: a fifth of the profile's examples (the tier's 25 -> 5, CI's deep 200 -> 40).
EXAMPLES = max(5, settings.default.max_examples // 5)
layers = st.lists(st.tuples(st.sampled_from(KINDS), st.floats(0.05, 0.9)), min_size=1, max_size=4)


@settings(max_examples=EXAMPLES)
@given(layers=layers, rows=st.integers(1, 5), width=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_both_sides_switch_dropout_off_alike(layers, rows, width, seed):
    torch.manual_seed(seed)
    model = _Stack(layers, width)
    zero = _Stack(layers, width, zero=True)
    zero.load_state_dict(model.state_dict())
    x = torch.randn(rows, width)
    params = dict(model.named_parameters())

    def step_of(module):
        def step(params, x):
            loss = torch.func.functional_call(module, params, (x,))
            return loss, torch.autograd.grad(loss, list(params.values()))
        return step

    step = step_of(model)
    with enable_python_dispatcher():
        gm = make_fx(step)(params, x)
    assert random_nodes(gm), "the trace draws random numbers"
    loss, grads = graph_without_random_ops(gm)(params, x)
    with random_ops_disabled():
        eager_loss, eager_grads = step(params, x)
    by_hand_loss, by_hand_grads = step_of(zero)(params, x)
    assert torch.equal(eager_loss, by_hand_loss)
    assert all(torch.equal(e, h) for e, h in zip(eager_grads, by_hand_grads, strict=True))
    if any(kind == "sdpa" for kind, _ in layers):  # math path vs fused kernel
        torch.testing.assert_close((loss, grads), (eager_loss, eager_grads), rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(loss, eager_loss)
        assert all(torch.equal(g, e) for g, e in zip(grads, eager_grads, strict=True))
