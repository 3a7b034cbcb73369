"""Moved pieces left in their collective's layout where nothing reads it
(autoparallel/planner/layout_reads.py, patch ``layout_blind_moves``).

A hand-built graph with the shape of a planned weight gradient: a value whose traced layout is
transposed (``t`` of a kernel's output) is reduce-scattered, then ``t`` and a dtype cast take
it to the graph's output. It is lowered per rank of a fake dp=2 world and run on simulated
ranks, against the single-device values; the property test feeds generated chains of ops
to both layouts of one piece.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import fx
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.mesh import MeshSpec, attach_group_dims, fake_world
from autoparallel.planner.layout_reads import LAYOUT_BLIND, MAX_DEPTH, PATCH, reads_layout
from autoparallel.planner.lower import NodePlacements, PlacedInterpreter
from verify.parity.differential import bind, run_ranks, simulated_world

aten = torch.ops.aten
SPEC = MeshSpec.parse("dp=2")
P, S0, S1 = (Partial(),), (Shard(0),), (Shard(1),)


def _graph(tail):
    """``a`` [4, 8] -> t -> (moved here: P -> S(0)) ``tail`` -> output, traced with vals."""
    return make_fx(lambda a: [tail(aten.t.default(a))])(torch.empty(4, 8))


def _grad_tail(b):
    return aten._to_copy.default(aten.t.default(b), dtype=torch.float64)


def _view_tail(b):
    return aten.view.default(aten.t.default(b), [32])


def _placed(gm: fx.GraphModule, moved_at: str, out: tuple) -> dict:
    """a and t(a) Partial; the op named ``moved_at`` takes t(a) as S(0) (a reduce-scatter); every
    later op and the output keep ``out``'s placement as t and the cast carry it."""
    placed, after = {}, False
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            placed[n] = NodePlacements([P], [])
        elif n.op == "output":
            placed[n] = NodePlacements([out], [])
        elif n.name == moved_at:
            placed[n] = NodePlacements([out], [S0])
            after = True
        else:
            placed[n] = NodePlacements([out if after else P], [out if after else P])
    return placed


def _lowered(gm, placed):
    """Per rank of a fake dp=2 world: the lowered graph and its report."""
    out = []
    for rank in range(2):
        with fake_world(SPEC, rank=rank) as mesh:
            interp = PlacedInterpreter(gm, placed, mesh, {}, replay=True)
            lowered = make_fx(lambda a: interp.run(a))(torch.empty(4, 8))
            attach_group_dims(lowered, mesh.group_dims)
        out.append((lowered, interp.report))
    return out


def _targets(lowered) -> list:
    return [n.target for n in lowered.graph.nodes if n.op == "call_function"]


def _run(lowereds, addends):
    with simulated_world(SPEC) as world:
        (outs,) = run_ranks([bind(gm, world) for gm, _ in lowereds], [tuple(addends)])
    return outs


def _addends():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-8, 8, (4, 8), generator=g).float() for _ in range(2)]


def _grad_case():
    gm = _graph(_grad_tail)
    moved_at = next(n.name for n in gm.graph.nodes if n.op == "call_function" and n.args[0].op == "call_function")  # the second t
    return gm, _placed(gm, moved_at, S1)


def test_a_gradient_scattered_before_its_t_and_cast_is_not_copied():
    gm, placed = _grad_case()
    addends = _addends()
    want = (addends[0] + addends[1]).to(torch.float64)  # t(t(sum)) cast; each rank holds its S(1) half
    for patch_on in (True, False):
        with patches.disabled(*(() if patch_on else (PATCH,))):
            lowereds = _lowered(gm, placed)
        outs = _run(lowereds, addends)
        for rank, ((lowered, report), got) in enumerate(zip(lowereds, outs, strict=True)):
            assert torch.equal(got[0] if isinstance(got, list | tuple) else got, want[:, 4 * rank:4 * rank + 4]), (patch_on, rank)
            targets = _targets(lowered)
            assert torch.ops._c10d_functional.reduce_scatter_tensor.default in targets
            if patch_on:
                assert aten.permute.default not in targets, "the piece was copied into the traced layout"
                assert report.layout_blind == 1 and "1 moved pieces left in their collective's layout" in report.summary()
            else:
                assert targets.count(aten.permute.default) == 2 and report.layout_blind == 0


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def test_only_blind_ops_up_to_the_output_skip_the_copy():
    grad = _graph(_grad_tail)
    t2 = [n for n in grad.graph.nodes if n.target is aten.t.default][1]
    assert not reads_layout(t2) and not reads_layout(grad.graph.output_node())
    with patches.disabled(PATCH):
        assert reads_layout(t2), "disabled, every move takes the traced layout"
    for tail in (_view_tail, lambda b: aten.mm.default(aten.t.default(b), b), lambda b: aten.sum.dim_IntList(aten.t.default(b), [0])):
        gm = _graph(tail)
        second_t = [n for n in gm.graph.nodes if n.target is aten.t.default][1]
        assert reads_layout(second_t), tail
    # a blind op with one reading user among blind ones reads
    def shared(a):
        b = aten.t.default(a)
        return [aten.t.default(b), aten.view.default(aten.t.default(b), [32])]

    gm = make_fx(shared)(torch.empty(4, 8))
    first = next(n for n in gm.graph.nodes if n.target is aten.t.default)
    assert len(first.users) == 2 and reads_layout(first)


def test_a_chain_longer_than_followed_counts_as_reading():
    def chain(a, k):
        for _ in range(k):
            a = aten.t.default(a)
        return a
    short = make_fx(lambda a: chain(a, MAX_DEPTH - 1))(torch.empty(4, 8))
    long = make_fx(lambda a: chain(a, MAX_DEPTH + 1))(torch.empty(4, 8))
    first = lambda gm: next(n for n in gm.graph.nodes if n.target is aten.t.default)  # noqa: E731
    assert not reads_layout(first(short)) and reads_layout(first(long))


# --- property: what reads_layout calls blind gives the same values on either layout ----------

_BLIND_STEPS = {
    "t": lambda x: aten.t.default(x) if x.dim() <= 2 else aten.transpose.int(x, 0, 1),
    "transpose": lambda x: aten.transpose.int(x, 0, x.dim() - 1),
    "permute": lambda x: aten.permute.default(x, list(range(x.dim()))[::-1]),
    "detach": aten.detach.default,
    "cast": lambda x: aten._to_copy.default(x, dtype=torch.float64),
}
_READING_STEPS = {
    "view": lambda x: aten.view.default(x, [-1]),
    "sum": lambda x: aten.sum.dim_IntList(x, [0], True),
}


def _same_on_any_layout(steps, shape, seed) -> bool:
    """Where ``reads_layout`` calls the chain ``steps`` blind, it gives bitwise the same values on a
    contiguous piece and on the same values in a permuted layout, and fails on neither. Returns
    whether it called the chain blind."""
    ops = {**_BLIND_STEPS, **_READING_STEPS}

    def chain(x):
        for s in steps:
            x = ops[s](x)
        return x

    try:
        gm = make_fx(chain)(torch.empty(shape))
    except RuntimeError:  # a chain the traced (contiguous) program cannot run: no program to lower
        assume(False)
    first = next(n for n in gm.graph.nodes if n.op == "call_function")
    if reads_layout(first):
        return False
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=g)
    order = list(range(len(shape)))[::-1]
    other = dense.permute(order).contiguous().permute(sorted(range(len(order)), key=order.__getitem__))
    assert torch.equal(other, dense) and other.stride() != dense.stride()
    a, b = chain(dense), chain(other)
    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return True


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.sampled_from(sorted(_BLIND_STEPS) + sorted(_READING_STEPS)), min_size=1, max_size=5),
       shape=st.sampled_from([(4, 6), (2, 3, 4), (3, 5)]), seed=st.integers(0, 2**16))
def test_blind_chains_give_the_same_values_on_any_layout(steps, shape, seed):
    assert _same_on_any_layout(steps, shape, seed) == all(s in _BLIND_STEPS for s in steps)


def test_a_view_called_blind_fails_the_property(monkeypatch):
    """The negative: were ``view`` among the blind ops, a piece in another layout breaks the chain."""
    monkeypatch.setattr("autoparallel.planner.layout_reads.LAYOUT_BLIND", LAYOUT_BLIND | {aten.view.default})
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        _same_on_any_layout(["view"], (4, 6), 0)


def test_the_blind_ops_are_the_ones_the_property_draws():
    drawn = {aten.t.default, aten.transpose.int, aten.permute.default, aten.detach.default, aten._to_copy.default}
    assert LAYOUT_BLIND == drawn


def test_the_lowered_graph_has_vals_with_the_scattered_layout():
    """What the later stages read: the lowered graph's vals describe the piece as left (contiguous
    after the reduce-scatter), so the second compile traces the same strides it runs."""
    gm, placed = _grad_case()
    lowered, _ = _lowered(gm, placed)[0]
    wait = _node(lowered, torch.ops._c10d_functional.wait_tensor.default)
    assert wait.meta[M.VAL].is_contiguous()
