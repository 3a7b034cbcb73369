"""Random ops keep their drawing order through the collective passes (patch ``random_op_order``).

The hand-built forward has T5's and BART's shape. One gathered embedding is read by an encoder
branch (dropout, a second gathered weight, dropout) and by a decoder branch (dropout), and a
head reads a third gathered weight. Upstream merges the bucket at its last all-gather (the
head's), so every reader of a gathered weight comes after it. The topological sort then
releases both readers of the embedding together, and the decoder's dropout draws before the
encoder's second one.
"""

from __future__ import annotations

import operator

import pytest
import torch

from autoparallel import patches, roles
from autoparallel.mesh import fake_world
from autoparallel.passes.collective import CollectivePassesConfig, bucket_fw_bw
from autoparallel.passes.pre_overlap_bucketing import tag_collectives_for_bucketing
from autoparallel.passes.random_order import (
    PATCH,
    RandomOrderError,
    random_ops,
    restore_random_order,
    run_keeping_random_order,
)
from verify.strategies import GraphBuilder, mesh_groups

aten = torch.ops.aten
H = 16


def _dropout(b: GraphBuilder, x):
    return b.call(operator.getitem, b.call(aten.native_dropout.default, x, 0.1, True), 0)


def _encoder_decoder(mesh):
    """The forward (loss only) and a backward without nodes; eager draws enc0, enc1, dec0. The
    head's all-gather comes last: the bucket merged there makes everything before it wait."""
    b = GraphBuilder(mesh_groups(mesh))
    src = b.placeholder("src", (4, H), role=roles.input_(0))
    tgt = b.placeholder("tgt", (4, H), role=roles.input_(1))
    embed = b.all_gather(b.param((H // 2, H)), "dp")
    enc = _dropout(b, b.call(aten.mm.default, src, embed))
    enc = _dropout(b, b.call(aten.mm.default, enc, b.all_gather(b.param((H // 2, H)), "dp")))
    dec = _dropout(b, b.call(aten.mm.default, tgt, embed))
    logits = b.call(aten.mm.default, b.call(aten.add.Tensor, enc, dec), b.all_gather(b.param((H // 2, H)), "dp"))
    fw = b.output([b.call(aten.sum.default, logits)], [roles.LOSS])
    tag_collectives_for_bucketing(fw)
    e = GraphBuilder(mesh_groups(mesh))
    bw = e.output([e.placeholder("tangent", (), role=roles.tangent(roles.LOSS))], [None])
    return fw, bw


def _draws(gm) -> list[str]:
    return [n.name for n in random_ops(gm.graph)]


@pytest.mark.parametrize("passes", [("pre_overlap_bucketing",), ("topo_span_bucketing",), None])
def test_bucketing_a_weight_two_branches_read_keeps_their_dropouts_in_order(passes):
    config = CollectivePassesConfig(schedule_overlap=True)
    with fake_world("dp=2") as mesh:
        fw, bw = _encoder_decoder(mesh)
        eager = _draws(fw)
        with patches.disabled(PATCH):  # upstream: the decoder's dropout moves ahead
            upstream, _, _ = bucket_fw_bw(*_encoder_decoder(mesh), config, only=passes)
        fw, _, metrics = bucket_fw_bw(fw, bw, config, only=passes)
    assert metrics.acted  # the collectives were bucketed
    assert _draws(upstream) != eager
    assert _draws(fw) == eager


def test_an_order_the_pass_kept_moves_nothing():
    with fake_world("dp=2") as mesh:
        fw, _ = _encoder_decoder(mesh)
    code = fw.code
    report = restore_random_order(fw, _draws(fw))
    assert (report.random_ops, report.moved) == (3, 0)
    assert fw.code == code


def test_a_swapped_pair_is_put_back_and_only_their_consumers_move():
    with fake_world("dp=2") as mesh:
        fw, _ = _encoder_decoder(mesh)
    eager = _draws(fw)
    dec = next(n for n in fw.graph.nodes if n.name == eager[2])
    enc1 = next(n for n in fw.graph.nodes if n.name == eager[1])
    enc1.prepend(dec.args[0])  # the decoder's mm and dropout ahead of the encoder's second dropout
    enc1.prepend(dec)
    fw.graph.lint()
    assert _draws(fw) == [eager[0], eager[2], eager[1]]
    report = restore_random_order(fw, eager)
    assert _draws(fw) == eager
    assert 0 < report.moved <= 3


def test_a_pass_that_makes_a_random_op_depend_on_a_later_one_is_named():
    with fake_world("dp=2") as mesh:
        fw, _ = _encoder_decoder(mesh)
    eager = _draws(fw)
    first, _, last = random_ops(fw.graph)
    # The decoder's dropout (and its mm) moved to the front, its output fed into the first one.
    first.prepend(last.args[0])
    first.prepend(last)
    with fw.graph.inserting_before(first):
        mixed = fw.graph.call_function(aten.add.Tensor, (first.args[0], fw.graph.call_function(operator.getitem, (last, 0))))
    first.replace_input_with(first.args[0], mixed)
    fw.graph.lint()
    with pytest.raises(RandomOrderError, match=r"random ops \['native_dropout_default', 'native_dropout_default_1', 'native_dropout_default_2'\] "
                       r"cannot draw in their order before the pass.*an earlier random op depend on a later one"):
        restore_random_order(fw, eager)


def test_a_pass_that_adds_or_drops_a_random_op_is_named():
    with fake_world("dp=2") as mesh:
        fw, _ = _encoder_decoder(mesh)

    def replay_a_dropout(gm):  # a recompute: one more draw
        first = random_ops(gm.graph)[0]
        with gm.graph.inserting_after(first):
            gm.graph.node_copy(first)
        return gm

    with pytest.raises(RandomOrderError, match=r"replay changed the random ops of the graph \(added \['native_dropout_default_3'\], dropped \[\]\)"):
        run_keeping_random_order(fw, replay_a_dropout, "replay")
