"""Candidate enumeration on small make_fx graphs: DTensor's registry, own rules, padding, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel.mesh import fake_world
from autoparallel.planner import NoStrategyError
from autoparallel.planner.graph import tensor_args
from autoparallel.planner.strategies import (
    NO_STRATEGY,
    RANDOM_OP,
    StrategyEnumerator,
    is_dropout,
    is_undroppable_random,
    alias_candidates,
    placeholder_candidates,
    tensor_meta,
)

aten = torch.ops.aten
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)


def _graph(f, *shapes):
    return make_fx(f, tracing_mode="fake")(*[torch.empty(s) for s in shapes])


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def _all_placements(node, sizes):
    return [c.outs[0] for c in placeholder_candidates(tensor_meta(node.meta["val"]), sizes, padded_dim0=False)]


def test_cpu_sdpa_has_the_planners_rule_batch_and_heads_shard_sequence_does_not():
    gm = _graph(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (4, 8, 16, 32), (4, 8, 16, 32), (4, 8, 16, 32))
    sdpa = _node(gm, aten._scaled_dot_product_flash_attention_for_cpu.default)
    with fake_world("dp=2,tp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(sdpa, [_all_placements(a, en.sizes) for a in tensor_args(sdpa)])
    outs = {c.outs[0] for c in cands}
    assert (S0, S1) in outs and (S1, S0) in outs and (R, R) in outs and (S0, S0) in outs
    assert not any(S2 in pl for pl in outs)  # never the sequence dim
    for c in cands:
        assert c.ins == (c.outs[0],) * 3  # q, k, v shard alike


def test_an_op_with_no_strategy_takes_the_replicated_fallback_and_is_named():
    """aten.searchsorted has no DTensor strategy and no planner rule: its one candidate gathers
    every input to Replicate and replicates its output, and the enumerator says why."""
    gm = _graph(lambda s, v: torch.searchsorted(s, v), (4, 16), (4, 3))
    node = _node(gm, aten.searchsorted.Tensor)
    with fake_world("dp=2,tp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(node, [_all_placements(a, en.sizes) for a in tensor_args(node)])
    assert [(c.outs, c.ins) for c in cands] == [(((R, R),), ((R, R), (R, R)))]
    assert en.fallbacks == {"searchsorted": NO_STRATEGY}


def test_an_op_with_a_strategy_takes_no_fallback():
    gm = _graph(torch.mm, (8, 6), (6, 4))
    mm = _node(gm, aten.mm.default)
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        en.op_candidates(mm, [_all_placements(a, en.sizes) for a in tensor_args(mm)])
    assert en.fallbacks == {}


@pytest.mark.parametrize(("f", "target"), [
    (lambda x: x * torch.rand(x.shape[0], 1), aten.rand.default),  # a drop path's keep draw
    (lambda x: x * torch.bernoulli(torch.full_like(x, 0.5)), aten.bernoulli.default),  # DTensor has a strategy for it
])
def test_a_random_op_that_is_not_dropout_is_replicated_whatever_dtensor_offers(f, target):
    gm = _graph(f, (8, 4))
    node = _node(gm, target)
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(node, [_all_placements(a, en.sizes) for a in tensor_args(node)])
    assert [c.outs for c in cands] == [((R,),)] and all(i == (R,) for c in cands for i in c.ins)
    assert en.fallbacks == {node.name: RANDOM_OP}


def test_dropout_is_not_taken_for_a_random_op_that_must_be_replicated():
    gm = _graph(lambda x: aten.native_dropout.default(x, 0.5, True)[0], (8, 4))
    node = _node(gm, aten.native_dropout.default)
    assert is_dropout(node.target) and not is_undroppable_random(node.target)
    assert is_dropout(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert is_undroppable_random(aten.rand.default) and is_undroppable_random(aten.bernoulli.p)
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(node, [_all_placements(a, en.sizes) for a in tensor_args(node)])
    assert (S0,) in {c.outs[0] for c in cands}  # sharded like its input: DTensor's own strategy
    assert en.fallbacks == {}


def test_mm_candidates_come_from_dtensor_and_only_divide():
    gm = _graph(torch.mm, (8, 6), (6, 4))
    mm = _node(gm, aten.mm.default)
    with fake_world("dp=4") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(mm, [_all_placements(a, en.sizes) for a in tensor_args(mm)])
    got = {(c.outs[0], c.ins) for c in cands}
    assert ((S0,), ((S0,), (R,))) in got  # batch-shard the rows
    assert ((S1,), ((R,), (S1,))) in got  # 4 columns over 4 ranks
    assert all(c.ins[0] != (S1,) for c in cands)  # 6 inner rows do not divide by 4: no contraction sharding
    assert en.op_candidates(mm, [_all_placements(a, en.sizes) for a in tensor_args(mm)]) is cands  # cached


def test_partial_inputs_only_where_the_producer_can_be_partial():
    gm = _graph(lambda a, b: (a @ b).neg(), (8, 8), (8, 8))
    neg = _node(gm, aten.neg.default)
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        plain = en.op_candidates(neg, [[(R,), (S0,)]])
        assert all(not isinstance(c.ins[0][0], Partial) for c in plain)
        with_partial = en.op_candidates(neg, [[(R,), (S0,), (Partial(),)]])
        assert ((Partial(),), ((Partial(),),)) in {(c.outs[0], c.ins) for c in with_partial}


def test_parameters_get_padded_shard0_other_placeholders_do_not():
    meta = tensor_meta(torch.empty(10, 4, device="meta"))
    sizes = (4,)
    params = {c.outs[0] for c in placeholder_candidates(meta, sizes, padded_dim0=True)}
    inputs = {c.outs[0] for c in placeholder_candidates(meta, sizes, padded_dim0=False)}
    assert params == {(R,), (S0,), (S1,)}
    assert inputs == {(R,), (S1,)}  # 10 rows do not divide by 4
    assert (S0, S0) in {c.outs[0] for c in placeholder_candidates(meta, (2, 2), padded_dim0=True)}


def test_aliases_may_take_any_dividing_placement_and_the_producers_partials():
    meta = tensor_meta(torch.empty(8, 8, device="meta"))
    outs = [c.outs[0] for c in alias_candidates(meta, (2,), [(S0,), (Partial(),)])]
    assert outs == [(R,), (S0,), (S1,), (Partial(),)]


def test_a_factory_op_with_no_strategy_is_made_whole_on_every_rank():
    """aten.empty has no DTensor strategy and no decomposition: every rank makes all of it."""
    gm = make_fx(lambda x: x + torch.empty(4, 3), tracing_mode="fake")(torch.empty(4, 3))
    empty = _node(gm, aten.empty.memory_format)
    with fake_world("dp=2") as mesh:
        cands = StrategyEnumerator(mesh.device_mesh).op_candidates(empty, [])
    assert [(c.outs, c.ins) for c in cands] == [(((R,),), ())]


def test_an_op_whose_strategy_takes_a_list_of_tensors_gets_their_shapes():
    """aten.index's single-dim rule reads its indices, a list of tensors: indexing dim 0 of x shards
    the output like x's dim 1 or like the indices, never x's dim 0."""
    gm = make_fx(lambda x, i: x[i], tracing_mode="fake")(torch.empty(8, 4), torch.zeros(4, dtype=torch.long))
    index = _node(gm, aten.index.Tensor)
    assert isinstance(index.args[1], list)
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(index, [_all_placements(a, en.sizes) for a in tensor_args(index)])
    assert {(c.outs[0], c.ins) for c in cands} == {((R,), ((R,), (R,))), ((S1,), ((S1,), (R,))), ((S0,), ((R,), (S0,)))}


def test_a_runtime_strategy_that_is_not_an_op_strategy_is_named():
    gm = _graph(torch.mm, (8, 6), (6, 4))
    mm = _node(gm, aten.mm.default)
    metas_in = tuple(tensor_meta(a.meta["val"]) for a in tensor_args(mm))
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        with pytest.raises(NoStrategyError, match=r"^op aten\.mm\.default at node 'mm': DTensor's strategy failed: "
                           r"op aten\.mm\.default at node 'mm': DTensor returned str, not an OpStrategy$"):
            en._full_strategy(mm, lambda schema: "no strategy", [[(R,)], [(R,)]], (tensor_meta(mm.meta["val"]),), metas_in)


def test_an_index_with_a_dim_not_indexed_gets_its_index_metas():
    """x[:, i] is aten.index(x, [None, i]): the strategy gets None for the dim not indexed and a
    TensorMeta for the index (falcon's alibi slopes); it used to get the FX node, and DTensor's
    rule refused it ("Expected all index metas to be TensorMeta")."""
    gm = make_fx(lambda x, i: x[:, i], tracing_mode="fake")(torch.empty(4, 8), torch.zeros(4, dtype=torch.long))
    index = _node(gm, aten.index.Tensor)
    assert index.args[1][0] is None
    with fake_world("dp=2") as mesh:
        en = StrategyEnumerator(mesh.device_mesh)
        cands = en.op_candidates(index, [_all_placements(a, en.sizes) for a in tensor_args(index)])
    assert en.fallbacks == {}
    assert ((S0,), ((S0,), (R,))) in {(c.outs[0], c.ins) for c in cands}  # x's rows, not indexed, shard
