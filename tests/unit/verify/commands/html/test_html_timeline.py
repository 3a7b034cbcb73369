"""verify.commands.html.timeline: the overlap replay on hand-built graphs with round estimates: a
collective hides behind the compute issued before its wait, the rest is exposed, each process
group is its own stream."""

from __future__ import annotations

import torch
import torch.fx as fx

from verify.commands.html.timeline import overlap_timeline

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _graph(compute_before_wait: int, *, second_group: bool = False) -> fx.GraphModule:
    g = fx.Graph()
    w = g.placeholder("w")
    x = g.placeholder("x")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (w, 8, "1"))
    ar = g.call_function(c10d.all_reduce.default, (x, "sum", "3" if second_group else "1"))
    h = x
    for _ in range(compute_before_wait):
        h = g.call_function(aten.mm.default, (h, h))
    v = g.call_function(aten.view.default, (h, [-1]))  # free
    wag = g.call_function(c10d.wait_tensor.default, (ag,))
    war = g.call_function(c10d.wait_tensor.default, (ar,))
    out = g.call_function(aten.mm.default, (wag, war))
    g.output((out, v))
    return fx.GraphModule(torch.nn.Module(), g)


def _replay(gm, ag_ms=2.5):
    def compute_ms(node):
        return 1.0 if node.target is aten.mm.default else 0.0

    def collective_ms(node):
        return ag_ms if node.target is c10d.all_gather_into_tensor.default else 1.0

    return overlap_timeline(gm, compute_ms=compute_ms, collective_ms=collective_ms,
                            collective_bytes=lambda n: 4096, group_dims={"1": "dp", "3": "tp"})


def test_collective_hides_behind_compute_before_its_wait_and_the_rest_is_exposed():
    tl = _replay(_graph(2))
    ag, ar = tl.collectives
    assert (ag.name, ag.kind, ag.dim, ag.nbytes) == ("all_gather_into_tensor_0", "all_gather", "dp", 4096)
    assert (ag.start, ag.end, ag.waited_at, ag.exposed) == (0.0, 2.5, 2.0, 0.5)
    assert ag.hidden == [("mm_0", 1.0), ("mm_1", 1.0)] and ag.hidden_count == 2
    # same group: the all-reduce queues behind the all-gather on one stream
    assert (ar.issue, ar.start, ar.end) == (0.0, 2.5, 3.5)
    assert ar.exposed == 1.0 and ar.hidden == []  # nothing computes while it runs
    assert [(c.name, c.start, c.end) for c in tl.compute] == [
        ("mm_0", 0.0, 1.0), ("mm_1", 1.0, 2.0), ("mm_2", 3.5, 4.5)
    ]
    assert tl.total == 4.5 and tl.compute_total == 3.0 and tl.exposed == 1.5


def test_groups_are_separate_streams():
    ag, ar = _replay(_graph(2, second_group=True)).collectives
    assert ar.dim == "tp" and (ar.start, ar.end) == (0.0, 1.0)
    assert ar.exposed == 0.0 and ar.hidden == [("mm_0", 1.0)]


def test_wait_right_after_the_launch_exposes_all_of_it():
    tl = _replay(_graph(0))
    ag = tl.collectives[0]
    assert ag.exposed == 2.5 and ag.hidden == [] and ag.hidden_count == 0
    assert tl.dims == ["dp"]


def test_partial_overlaps_count_and_hidden_keeps_the_three_largest():
    ag = _replay(_graph(5)).collectives[0]
    assert ag.exposed == 0.0 and ag.hidden_count == 3  # mm_0, mm_1, half of mm_2
    assert ag.hidden == [("mm_0", 1.0), ("mm_1", 1.0), ("mm_2", 0.5)]
    ag = _replay(_graph(5), ag_ms=4.5).collectives[0]
    assert ag.hidden_count == 5 and ag.hidden == [("mm_0", 1.0), ("mm_1", 1.0), ("mm_2", 1.0)]
