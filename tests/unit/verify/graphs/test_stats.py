"""verify.graphs.stats: collective counts/bytes per mesh dim, categories, RS spacing, static peak."""

from __future__ import annotations

import json
import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from verify.graphs.classify import node_category
from verify.graphs.liveness import saved_gathered_values, static_liveness, static_peak_bytes
from verify.graphs.stats import (
    CollectiveStat,
    GraphStats,
    PartitionStats,
    format_stats_table,
    graph_stats,
    human_bytes,
    partition_stats,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
GROUP_DIMS = {"1": "dp", "3": "tp", "5": "dp*tp"}


def _gm(g: fx.Graph, *inputs: torch.Tensor, group_dims=GROUP_DIMS) -> fx.GraphModule:
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = dict(group_dims)
    if inputs:
        FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm


def _collectives_graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")  # f32[4, 16] = 256 B
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "1"))  # out f32[32, 16]
    w_ag = g.call_function(c10d.wait_tensor.default, (ag,))
    xb = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.bfloat16})
    ag_bf16 = g.call_function(c10d.all_gather_into_tensor.default, (xb, 8, "1"))  # out bf16[32, 16]
    g.call_function(c10d.wait_tensor.default, (ag_bf16,))
    ag_tp = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "3"))  # out f32[8, 16]
    w_tp = g.call_function(c10d.wait_tensor.default, (ag_tp,))
    rs = g.call_function(
        c10d.reduce_scatter_tensor.default, (w_ag, "sum", 8, "1")
    )  # in f32[32, 16]
    w_rs = g.call_function(c10d.wait_tensor.default, (rs,))
    ar = g.call_function(c10d.all_reduce.default, (w_tp, "sum", "3"))  # in f32[8, 16]
    g.call_function(c10d.wait_tensor.default, (ar,))
    a2a = g.call_function(
        c10d.all_to_all_single.default, (w_rs, [2, 2], [2, 2], "5")
    )  # in f32[4, 16]
    g.call_function(c10d.wait_tensor.default, (a2a,))
    co = g.call_function(c10d.all_gather_into_tensor_coalesced.default, ([x, xb], 8, "1"))
    for i in range(2):
        g.call_function(c10d.wait_tensor.default, (g.call_function(operator.getitem, (co, i)),))
    g.output((w_rs,))
    return _gm(g, torch.randn(4, 16))


def test_collective_counts_and_bytes_per_mesh_dim():
    st = graph_stats(_collectives_graph())
    assert st.to_dict()["collectives"] == {
        # all-gather bytes: OUTPUT; f32[32, 16] = 2048, bf16 halves it, coalesced sums both
        "all_gather": {
            "dp": {"count": 3, "bytes": 2048 + 1024 + (2048 + 1024)},
            "tp": {"count": 1, "bytes": 8 * 16 * 4},
        },
        "all_reduce": {"tp": {"count": 1, "bytes": 8 * 16 * 4}},  # INPUT
        "all_to_all": {"dp*tp": {"count": 1, "bytes": 4 * 16 * 4}},  # INPUT
        "reduce_scatter": {"dp": {"count": 1, "bytes": 32 * 16 * 4}},  # INPUT (unsharded)
    }
    assert st.waits == 8
    assert st.collective_count("all_gather") == 4
    assert st.collective_bytes("all_gather", "tp") == 512
    cats = st.categories
    assert cats["collective"] == 7 and cats["wait"] == 8 and cats["placeholder"] == 1
    assert cats["compute"] == 1 and cats["other"] == 2 and cats["output"] == 1
    assert st.num_nodes == sum(cats.values())


def test_to_dict_is_plain_json_with_sorted_keys():
    d = graph_stats(_collectives_graph()).to_dict()
    text = json.dumps(d)
    assert text == json.dumps(d, sort_keys=True)
    assert json.loads(text) == d


def test_group_dims_argument_and_unknown_group():
    gm = _collectives_graph()
    st = graph_stats(gm, group_dims={"1": "fsdp", "3": "tp", "5": "flat"})
    assert sorted(st.collectives["all_gather"]) == ["fsdp", "tp"]
    gm.meta[M.GM_GROUP_DIMS] = {"1": "dp", "3": "tp"}
    with pytest.raises(ValueError, match=r"'5'.*all_to_all_single"):
        graph_stats(gm)


def test_missing_val_where_bytes_are_needed_names_the_node():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = FakeTensorMode().from_tensor(torch.randn(4, 16))
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "1"), name="gather_me")
    g.output(ag)
    gm = _gm(g)
    with pytest.raises(ValueError, match=r"'gather_me'.*meta\['val'\]"):
        graph_stats(gm)
    with pytest.raises(ValueError, match=r"'gather_me'.*meta\['val'\]"):
        static_peak_bytes(gm)


def test_max_consec_compute_between_reduce_scatters():
    """Counts FLOP compute nodes (mm, bmm, ...: the scheduler's and the seeds' definition)
    between reduce-scatter launches; pointwise ops, views, getitems, waits and other
    collectives neither count nor break the run."""
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.placeholder("w")
    before = g.call_function(aten.mm.default, (x, w))  # before the first RS: not counted
    rs1 = g.call_function(c10d.reduce_scatter_tensor.default, (before, "sum", 2, "1"))
    g.call_function(c10d.wait_tensor.default, (rs1,))
    a = g.call_function(aten.mm.default, (x, w))  # 1
    r = g.call_function(aten.relu.default, (a,))  # pointwise: not counted
    v = g.call_function(aten.view.default, (r, [1, 4, 8]))  # view: not counted
    b = g.call_function(aten.bmm.default, (v, g.call_function(aten.view.default, (w, [1, 8, 8]))))  # 2
    vm = g.call_function(aten.var_mean.correction, (x, [1]), {"keepdim": True})
    m = g.call_function(operator.getitem, (vm, 1))  # getitem: not counted
    ag = g.call_function(
        c10d.all_gather_into_tensor.default, (m, 2, "3")
    )  # collective: not counted
    g.call_function(c10d.wait_tensor.default, (ag,))
    c = g.call_function(aten.addmm.default, (m, x, w))  # 3
    d = g.call_function(aten.mm.default, (c, w))  # 4
    rs2 = g.call_function(c10d.reduce_scatter_tensor.default, (d, "sum", 2, "1"))
    e = g.call_function(aten.mm.default, (d, w))  # 1
    rs3 = g.call_function(c10d.reduce_scatter_tensor.default, (e, "sum", 2, "3"))
    f = g.call_function(aten.mm.default, (e, w))  # after the last RS: not counted
    g.call_function(aten.mm.default, (f, w))
    g.output((rs2, rs3, b))
    gm = _gm(g, torch.randn(4, 8), torch.randn(8, 8))
    st = graph_stats(gm)
    assert st.max_consec_compute_between_rs == 4
    assert node_category(v) == "view" and node_category(m) == "other"
    assert node_category(vm) == "compute" and node_category(rs1) == "collective"

    one = fx.Graph()
    y = one.placeholder("y")
    rs = one.call_function(c10d.reduce_scatter_tensor.default, (y, "sum", 2, "1"))
    one.call_function(aten.mm.default, (y, y))
    one.output(rs)
    assert graph_stats(_gm(one, torch.randn(8, 8))).max_consec_compute_between_rs == 0


def test_recompute_tags_are_counted_per_policy():
    gm = _collectives_graph()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[0].meta[M.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    nodes[1].meta[M.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    nodes[2].meta[M.RECOMPUTE] = CheckpointPolicy.PREFER_SAVE
    M.custom_meta(nodes[2])[M.AP_MUST_SAVE] = True
    st = graph_stats(gm)
    assert st.recompute == {"MUST_RECOMPUTE": 2, "PREFER_SAVE": 1}
    assert st.must_save == 1


def test_wait_aliases_its_input_in_static_peak():
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B, live throughout
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "1"))  # 2048 B
    w = g.call_function(c10d.wait_tensor.default, (ag,))  # same buffer as ag
    r = g.call_function(aten.relu.default, (w,))  # 2048 B
    g.output(r)
    # 256 + 2048 + 2048; counting the wait's fake storage separately would give 6400
    assert static_peak_bytes(_gm(g, torch.randn(4, 16))) == 4352


def test_an_out_variant_returns_its_out_buffer_in_static_peak():
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B, live throughout
    buf = g.call_function(aten.empty.memory_format, ([32, 16],), {"dtype": torch.float32})  # 2048 B
    ag = g.call_function(c10d.all_gather_into_tensor_out.default, (x, 8, "1"), {"out": buf})
    w = g.call_function(c10d.wait_tensor.default, (ag,))
    r = g.call_function(aten.relu.default, (w,))  # 2048 B
    g.output((r, g.call_function(aten.sum.default, (buf,))))  # buf read again after the relu
    gm = _gm(g, torch.randn(4, 16))
    from torch._guards import detect_fake_mode

    with detect_fake_mode([ag.meta[M.VAL]]):  # a re-trace gives the result a storage of its own
        ag.meta[M.VAL] = torch.empty(32, 16)
    assert static_peak_bytes(gm) == 256 + 2048 + 2048 + 4  # the out buffer counted once, not twice


def test_an_in_place_op_traced_onto_its_argument_s_storage_counts_it_once():
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B, live throughout
    buf = g.call_function(aten.mul.Tensor, (x, 2.0))  # 256 B
    r = g.call_function(aten.relu_.default, (buf,))  # FakeTensorProp: the same storage as buf
    g.output(g.call_function(aten.sum.default, (r,)))
    gm = _gm(g, torch.randn(4, 16))
    assert r.meta[M.VAL].untyped_storage()._cdata == buf.meta[M.VAL].untyped_storage()._cdata
    assert static_peak_bytes(gm) == 256 + 256 + 4


def _fw_bw(bw_names: tuple[str, str], fw_out_order: str = "cbx", tangent_role: bool = False):
    """A forward/backward pair with a hand-computed peak.

    fw: w f32[16,16] (1024 B), x f32[4,16] (256 B); a = mm(x, w) (256 B); av = view(a) (alias of
    a); b = relu(av) (256 B, saved); c = sum(b) (4 B, loss).
    bw: saved b, saved x, tangent f32[] (4 B); e = expand(tangent) (alias); g = mul(e, b) (256 B);
    gw = mm(t(x), g) (1024 B); gx = mul(g, b) (256 B, keeps b alive past gw).
    """
    fg = fx.Graph()
    w = fg.placeholder("primals_1")
    x = fg.placeholder("primals_2")
    a = fg.call_function(aten.mm.default, (x, w), name="a")
    av = fg.call_function(aten.view.default, (a, [64]), name="av")
    b = fg.call_function(aten.relu.default, (av,), name="b")
    c = fg.call_function(aten.sum.default, (b,), name="c")
    outs = {"c": c, "b": b, "x": x}
    fg.output(tuple(outs[k] for k in fw_out_order))
    fw = _gm(fg, torch.randn(16, 16), torch.randn(4, 16))

    bg = fx.Graph()
    sb = bg.placeholder(bw_names[0])
    sx = bg.placeholder(bw_names[1])
    tan = bg.placeholder("tangents_1" if not tangent_role else "grad_in")
    if tangent_role:
        tan.meta[M.ROLE] = "tangent:0"
    e = bg.call_function(aten.expand.default, (tan, [64]))
    gg = bg.call_function(aten.mul.Tensor, (e, sb))
    t = bg.call_function(aten.t.default, (sx,))
    v = bg.call_function(aten.view.default, (gg, [4, 16]))
    gw = bg.call_function(aten.mm.default, (t, v))
    gx = bg.call_function(aten.mul.Tensor, (gg, sb))
    bg.output((gw, gx))
    bw = _gm(bg, torch.randn(64), torch.randn(4, 16), torch.randn(()))
    return fw, bw


def test_static_peak_forward_only_counts_a_view_once():
    fw, _ = _fw_bw(("saved_b", "saved_x"))
    # w + x + a + b at relu (av aliases a); a double-counted would be 2048
    assert static_peak_bytes(fw) == 1024 + 256 + 256 + 256


def test_static_peak_keeps_saved_tensor_alive_into_backward():
    fw, bw = _fw_bw(("saved_b", "saved_x"))  # no name match: positional (last tensor outputs)
    # at gx: w 1024 + x 256 + saved b 256 + g 256 + gw 1024 + gx 256 (tangent freed after g)
    assert static_peak_bytes(fw, bw) == 3072


def test_static_peak_matches_saved_values_by_name():
    # Forward outputs ordered (c, x, b): position would pair placeholder "b" with x; names fix it.
    fw, bw = _fw_bw(("b", "primals_2"), fw_out_order="cxb", tangent_role=True)
    assert static_peak_bytes(fw, bw) == 3072


def test_a_backward_recompute_with_a_copied_val_is_a_new_storage():
    """Partitioners duplicate recomputed ops into the backward with the forward node's
    ``meta["val"]`` (same FakeTensor storage). The copy is a new buffer at run time: it must not
    keep the forward's buffer alive from the forward into the backward."""
    fg = fx.Graph()
    w = fg.placeholder("primals_1")  # f32[16, 16] 1024 B
    x = fg.placeholder("primals_2")  # f32[4, 16] 256 B
    big = fg.call_function(aten.mul.Tensor, (w, 2.0), name="big")  # 1024 B, recomputed later
    y = fg.call_function(aten.mm.default, (x, big), name="y")  # 256 B
    fg.output((fg.call_function(aten.sum.default, (y,), name="loss"), x, w))  # saves x and w
    fw = _gm(fg, torch.randn(16, 16), torch.randn(4, 16))
    bg = fx.Graph()
    sx = bg.placeholder("primals_2")  # the saved x
    w_b = bg.placeholder("primals_1")  # the saved w
    tan = bg.placeholder("tangents_1")
    big_b = bg.call_function(aten.mul.Tensor, (w_b, 2.0), name="big")  # the recompute
    e = bg.call_function(aten.expand.default, (tan, [4, 16]))
    gw = bg.call_function(aten.mm.default, (bg.call_function(aten.t.default, (sx,)), e))
    gx = bg.call_function(aten.mm.default, (e, big_b))
    bg.output((gw, gx))
    bw = _gm(bg, torch.randn(4, 16), torch.randn(16, 16), torch.randn(()))
    fw_big = next(n for n in fw.graph.nodes if n.name == "big")
    big_b.meta[M.VAL] = fw_big.meta[M.VAL]  # what the partitioner's copy carries
    liv = static_liveness(fw, bw)
    fw_steps = len(fw.graph.nodes)
    assert liv.live[fw_steps - 1] == 1024 + 256 + 4  # at the forward's return: w, x, loss
    # backward, at gx: w, x, big again (1024), gw (1024), gx (256); the tangent is freed at e's
    # last use, e (an alias of the tangent) too
    assert liv.peak_bytes == static_peak_bytes(fw, bw) == 1024 + 256 + 1024 + 1024 + 256 + 4
    assert (liv.names[liv.peak_step], liv.phases[liv.peak_step]) == ("mm_1", "backward")


def test_static_liveness_is_the_series_behind_the_peak():
    fw, bw = _fw_bw(("saved_b", "saved_x"))
    liv = static_liveness(fw, bw)
    assert liv.peak_bytes == static_peak_bytes(fw, bw) == max(liv.live) == 3072
    assert liv.phases == ["forward"] * 7 + ["backward"] * 10
    assert liv.names[:7] == ["arg_0", "arg_1", "mm_0", "view_0", "relu_0", "sum_0", "return"]
    # at the peak (gx): the canonical name of the node, in the backward
    assert (liv.names[liv.peak_step], liv.phases[liv.peak_step]) == ("mul_1", "backward")
    assert liv.live[:5] == [1280, 1280, 1536, 1536, 1792]  # w + x resident, a, then b (view free)
    assert liv.live[-1] == 1024 + 256 + 1024 + 256  # w, x and the two gradients stay
    contributors = [(c.name, c.phase, c.bytes) for c in liv.at_peak]
    assert contributors == [
        ("mm_0", "backward", 1024),  # gw
        ("arg_0", "forward", 1024),  # w
        ("mul_0", "backward", 256),  # g
        ("mul_1", "backward", 256),  # gx
        ("arg_1", "forward", 256),  # x
        ("relu_0", "forward", 256),  # b, saved for the backward
    ]
    assert sum(c.bytes for c in liv.at_peak) == liv.peak_bytes
    assert json.loads(json.dumps(liv.to_dict()))["peak_step"] == liv.peak_step


def test_static_liveness_of_one_graph_reads_backward_tags():
    fw, _ = _fw_bw(("saved_b", "saved_x"))
    for node in fw.graph.nodes:
        if node.name in ("b", "c"):
            node.meta[M.CUSTOM] = {M.PHASE: M.PHASE_BACKWARD}
        if node.name == "av":
            node.meta[M.PARTITIONER_TAG] = "is_backward"
    liv = static_liveness(fw)
    assert liv.phases == ["forward"] * 3 + ["backward"] * 3 + ["forward"]
    assert liv.peak_bytes == static_peak_bytes(fw)


def test_partition_stats_and_table():
    fw, bw = _fw_bw(("saved_b", "saved_x"))
    ps = partition_stats(fw, bw)
    assert (ps.saved_count, ps.saved_bytes, ps.static_peak_bytes) == (2, 512, 3072)
    assert ps.fw.categories["compute"] == 3 and ps.bw.categories["view"] == 3
    d = ps.to_dict()
    assert json.dumps(d) == json.dumps(d, sort_keys=True)
    table = format_stats_table(ps)
    assert table == format_stats_table(partition_stats(*_fw_bw(("saved_b", "saved_x"))))
    lines = table.splitlines()
    assert lines[0].split() == ["forward", "backward"]
    assert "saved for backward" in table and "512 (512 B)" in table
    assert any(ln.startswith("static peak") and ln.endswith("3072 (3.0 KiB)") for ln in lines)


def test_table_lists_collectives_per_kind_and_dim_in_fixed_order():
    st = graph_stats(_collectives_graph())
    table = format_stats_table(st)
    rows = [ln.split()[:2] for ln in table.splitlines()[2:6]]
    assert rows == [
        ["all_gather", "dp"],
        ["all_gather", "tp"],
        ["reduce_scatter", "dp"],
        ["all_reduce", "tp"],
    ]
    assert "6144 (6.0 KiB)" in table and "512 (512 B)" in table
    ag_tp = next(ln for ln in table.splitlines() if ln.split()[:2] == ["all_gather", "tp"])
    assert ag_tp.split()[2] == "1"
    assert "max_consec_compute_between_rs" in table and "wait_tensor" in table
    assert isinstance(st, GraphStats)


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(4096) == "4.0 KiB"
    assert human_bytes(int(2.62 * 2**30)) == "2.6 GiB"


def test_static_peak_counts_get_attr_constants_for_the_whole_run():
    root = torch.nn.Module()
    root.register_buffer("table", torch.ones(32, 16))  # 2048 B, never freed
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B
    big = g.call_function(aten.zeros.default, ([64, 64],))  # 16 KiB temporary, freed at once
    r = g.call_function(aten.relu.default, (x,))  # 256 B, freed after add
    t = g.get_attr("table")  # resident from the start, although its node comes late
    s = g.call_function(aten.sum.default, (t,))  # 4 B
    g.output(g.call_function(aten.add.Tensor, (r, s)))  # 256 B
    gm = fx.GraphModule(root, g)
    FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(
        torch.randn(4, 16)
    )
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            n.meta.pop(M.VAL, None)  # described from the attribute itself
    assert big.users == {}
    assert static_peak_bytes(gm) == 2048 + 256 + 64 * 64 * 4


# --- padding of uneven FSDP shards -------------------------------------------------------------------


def _padded_graph(narrow=(0, 0, 10), pad=(0, 0, 0, 2), value=0.0, extra_reader=False, pad_feeds_rs=True) -> fx.GraphModule:
    """A padded shard f32[3, 16] gathered by 4 ranks (12 rows), narrowed to the true 10; the
    gradient f32[10, 16] padded back to 12 rows and reduce-scattered: 2 rows of 64 B each way."""
    g = fx.Graph()
    shard = g.placeholder("shard")
    grad = g.placeholder("grad")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (shard, 4, "1"))
    wait = g.call_function(c10d.wait_tensor.default, (ag,))
    view = g.call_function(aten.view.default, (wait, [12, 16]))  # a view between: still the gathered rows
    dim, start, end = narrow
    full = g.call_function(aten.slice.Tensor, (view, dim, start, end))
    outs = [g.call_function(aten.relu.default, (full,))]
    if extra_reader:
        outs.append(g.call_function(aten.neg.default, (view,)))
    padded = g.call_function(aten.constant_pad_nd.default, (grad, list(pad), value))
    if pad_feeds_rs:
        rs = g.call_function(c10d.reduce_scatter_tensor.default, (padded, "avg", 4, "1"))
        outs.append(g.call_function(c10d.wait_tensor.default, (rs,)))
    else:
        outs.append(g.call_function(aten.relu.default, (padded,)))
    g.output(tuple(outs))
    return _gm(g, torch.randn(3, 16), torch.randn(10, 16))


def test_padding_bytes_of_a_narrowed_all_gather_and_a_padded_reduce_scatter():
    st = graph_stats(_padded_graph())
    assert st.padding["all_gather"]["dp"].to_dict() == {"bytes": 128, "count": 1}
    assert st.padding["reduce_scatter"]["dp"].to_dict() == {"bytes": 128, "count": 1}
    assert st.padding_bytes() == 256 and st.padding_bytes("all_gather", "tp") == 0
    assert st.collective_bytes("all_gather", "dp") == 12 * 16 * 4  # the wire carries the padded rows
    assert st.to_dict()["padding"] == {"all_gather": {"dp": {"bytes": 128, "count": 1}}, "reduce_scatter": {"dp": {"bytes": 128, "count": 1}}}
    rows = {tuple(ln.split()[:3]): ln.split()[3:] for ln in format_stats_table(st).splitlines()}
    assert rows[("all_gather", "padding", "dp")] == ["1", "128", "(128", "B)"]
    assert rows[("reduce_scatter", "padding", "dp")] == ["1", "128", "(128", "B)"]


@pytest.mark.parametrize(
    "kw",
    [
        {"narrow": (1, 0, 8)},  # a slice of dim 1 is no dim-0 padding
        {"narrow": (0, 2, 12)},  # dropping leading rows is not trailing padding
        {"extra_reader": True},  # the dropped rows are read elsewhere
    ],
)
def test_slices_that_are_not_a_padding_narrow_are_not_counted(kw):
    st = graph_stats(_padded_graph(**kw))
    assert "all_gather" not in st.padding and st.padding_bytes("reduce_scatter") == 128


@pytest.mark.parametrize(
    "kw",
    [
        {"pad": (0, 2, 0, 0), "narrow": (0, 0, 12)},  # pads dim 1 (and the narrow drops nothing)
        {"pad": (0, 0, 2, 0)},  # leading rows
        {"value": 1.0},  # not zeros
        {"pad_feeds_rs": False},  # padded, but not reduce-scattered
    ],
)
def test_pads_that_are_not_reduce_scattered_padding_are_not_counted(kw):
    st = graph_stats(_padded_graph(**kw))
    assert "reduce_scatter" not in st.padding


def test_even_graphs_have_no_padding_rows_or_keys():
    st = graph_stats(_collectives_graph())
    assert st.padding == {} and "padding" not in st.to_dict()
    assert "padding" not in format_stats_table(st)


def _saving_pair(save: str):
    """Forward: shard -> all_gather -> wait -> narrow -> t -> mm(x, .); it saves ``save``."""
    fw = fx.Graph()
    shard, x = fw.placeholder("shard"), fw.placeholder("x")
    ag = fw.call_function(c10d.all_gather_into_tensor.default, (shard, 4, "1"))
    wait = fw.call_function(c10d.wait_tensor.default, (ag,))
    narrow = fw.call_function(aten.slice.Tensor, (wait, 0, 0, 10))
    t = fw.call_function(aten.t.default, (narrow,))
    mm = fw.call_function(aten.mm.default, (x, t))
    nodes = {"x": x, "t": t, "mm": mm, "narrow": narrow, "wait": wait, "ag": ag}
    fw.output((mm, nodes[save]))
    fw_gm = _gm(fw, torch.randn(3, 16), torch.randn(2, 16))
    bw = fx.Graph()
    saved, tangent = bw.placeholder(nodes[save].name), bw.placeholder("tangents_1")  # AOT's naming
    bw.output((bw.call_function(aten.mul.Tensor, (saved, tangent)),))
    bw_gm = _gm(bw, nodes[save].meta[M.VAL], torch.randn(()))
    return fw_gm, bw_gm, nodes[save]


@pytest.mark.parametrize(
    "save, gathered", [("t", True), ("narrow", True), ("wait", True), ("ag", True), ("x", False), ("mm", False)]
)
def test_saved_gathered_values_finds_a_saved_gathered_weight(save, gathered):
    fw, bw, node = _saving_pair(save)
    assert saved_gathered_values(fw, bw) == ([node] if gathered else [])


# --- every field spelled out: dicts, tables, byte texts -----------------------------------------


def test_graph_stats_to_dict_spells_every_field():
    assert graph_stats(_padded_graph()).to_dict() == {
        "categories": {"collective": 2, "compute": 2, "other": 0, "output": 1, "placeholder": 2, "view": 2, "wait": 2},
        "collectives": {"all_gather": {"dp": {"bytes": 768, "count": 1}}, "reduce_scatter": {"dp": {"bytes": 768, "count": 1}}},
        "max_consec_compute_between_rs": 0,
        "must_save": 0,
        "num_nodes": 11,
        "recompute": {},
        "waits": 2,
        "padding": {"all_gather": {"dp": {"bytes": 128, "count": 1}}, "reduce_scatter": {"dp": {"bytes": 128, "count": 1}}},
    }


def test_partition_and_liveness_to_dict_spell_every_field():
    fw, bw = _fw_bw(("saved_b", "saved_x"))
    d = partition_stats(fw, bw).to_dict()
    assert d["fw"] == graph_stats(fw).to_dict() and d["bw"] == graph_stats(bw).to_dict()
    assert {k: v for k, v in d.items() if k not in ("fw", "bw")} == {
        "saved_bytes": 512, "saved_count": 2, "static_peak_bytes": 3072}
    # forward only: w + x resident, a (its view shares it), b, then the loss once a is dead
    assert static_liveness(fw).to_dict() == {
        "at_peak": [
            {"name": "arg_0", "phase": "forward", "bytes": 1024},
            {"name": "arg_1", "phase": "forward", "bytes": 256},
            {"name": "mm_0", "phase": "forward", "bytes": 256},
            {"name": "relu_0", "phase": "forward", "bytes": 256},
        ],
        "live": [1280, 1280, 1536, 1536, 1792, 1540, 1540],
        "names": ["arg_0", "arg_1", "mm_0", "view_0", "relu_0", "sum_0", "return"],
        "peak_bytes": 1792,
        "peak_step": 4,
        "phases": ["forward"] * 7,
    }


def test_backward_steps_carry_the_backward_names():
    liv = static_liveness(*_fw_bw(("saved_b", "saved_x")))
    assert liv.names[7:] == ["arg_0", "arg_1", "arg_2", "expand_0", "mul_0", "t_0", "view_0", "mm_0", "mul_1", "return"]


def test_an_empty_graph_has_no_peak():
    assert static_peak_bytes(fx.Graph()) == 0
    liv = static_liveness(fx.Graph())
    assert (liv.live, liv.peak_bytes, liv.peak_step, liv.at_peak) == ([], 0, 0, [])


def test_partition_stats_passes_group_dims_to_both_graphs():
    fw, bw = _fw_bw(("saved_b", "saved_x"))
    for gm, name in ((fw, "a"), (bw, "mul")):
        gm.meta[M.GM_GROUP_DIMS] = {}  # the graphs name no group: only the argument does
        node = next(n for n in gm.graph.nodes if n.name.startswith(name))
        with gm.graph.inserting_after(node):
            ar = gm.graph.call_function(c10d.all_reduce.default, (node, "sum", "7"))
        ar.meta[M.VAL] = node.meta[M.VAL]
    ps = partition_stats(fw, bw, group_dims={"7": "ep"})
    assert ps.fw.collective_count("all_reduce", "ep") == ps.bw.collective_count("all_reduce", "ep") == 1


def test_getitems_of_a_multi_output_op_share_its_storages():
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B, resident
    vm = g.call_function(aten.var_mean.correction, (x, [1]), {"keepdim": True})  # two f32[4, 1]: 16 B each
    v, m = (g.call_function(operator.getitem, (vm, i)) for i in range(2))
    g.output(g.call_function(aten.add.Tensor, (v, m)))  # 16 B
    assert static_peak_bytes(_gm(g, torch.randn(4, 16))) == 256 + 16 + 16 + 16


@pytest.mark.parametrize("wait_val", ["none", "missing"])
def test_a_wait_without_a_tensor_val_still_returns_the_gathered_buffer(wait_val):
    g = fx.Graph()
    x = g.placeholder("x")  # 256 B
    w = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_gather_into_tensor.default, (x, 8, "1")),))
    g.output(g.call_function(aten.relu.default, (w,)))  # 2048 B
    gm = _gm(g, torch.randn(4, 16))
    if wait_val == "none":
        w.meta[M.VAL] = None
    else:
        del w.meta[M.VAL]
    assert static_peak_bytes(gm) == 256 + 2048 + 2048  # the gathered buffer lives until the relu


def test_human_bytes_at_each_unit_boundary():
    assert [human_bytes(n) for n in (1023, 1024, 1536, 1024 * 1023, 2**20, 5 * 2**20, 2**30, 3 * 2**40, 2**50)] == [
        "1023 B", "1.0 KiB", "1.5 KiB", "1023.0 KiB", "1.0 MiB", "5.0 MiB", "1.0 GiB", "3.0 TiB", "1024.0 TiB"]
    assert human_bytes(-2048) == "-2.0 KiB"


def test_the_table_of_a_pair_spelled_out():
    """Every row and column of a forward/backward table: kinds in fixed order (then others by
    name), dims sorted, 0 where one graph lacks a kind, a dim or a recompute policy, padding rows
    after the collectives, the saved and peak lines under it."""
    fw = GraphStats(
        num_nodes=21,
        categories={"placeholder": 3, "output": 1, "collective": 4, "wait": 4, "view": 2, "compute": 5, "other": 2},
        collectives={"all_gather": {"tp": CollectiveStat(1, 512), "dp": CollectiveStat(2, 6144)},
                     "p2p": {"?": CollectiveStat(1, 64)}},
        waits=4, recompute={"MUST_RECOMPUTE": 2}, must_save=1,
        padding={"all_gather": {"tp": CollectiveStat(1, 64), "dp": CollectiveStat(2, 1024)}},
    )
    bw = GraphStats(
        num_nodes=9,
        categories={"placeholder": 2, "output": 1, "collective": 2, "wait": 2, "view": 0, "compute": 2, "other": 0},
        collectives={"all_gather": {"dp": CollectiveStat(1, 2048)}, "reduce_scatter": {"dp": CollectiveStat(1, 12 * 2**20)}},
        waits=2, recompute={"PREFER_SAVE": 1}, max_consec_compute_between_rs=3,
        padding={"reduce_scatter": {"dp": CollectiveStat(1, 128)}},
    )
    assert format_stats_table(PartitionStats(fw, bw, 3, 1536, 10 * 2**20)).splitlines() == [
        "                                               forward                     backward",
        "stat                           dim             count  bytes                count  bytes",
        "all_gather                     dp                  2  6144 (6.0 KiB)           1  2048 (2.0 KiB)",
        "all_gather                     tp                  1  512 (512 B)              0  0",
        "reduce_scatter                 dp                  0  0                        1  12582912 (12.0 MiB)",
        "p2p                            ?                   1  64 (64 B)                0  0",
        "all_gather padding             dp                  2  1024 (1.0 KiB)           0  0",
        "all_gather padding             tp                  1  64 (64 B)                0  0",
        "reduce_scatter padding         dp                  0  0                        1  128 (128 B)",
        "wait_tensor                                        4                           2",
        "recompute                      MUST_RECOMPUTE      2                           0",
        "recompute                      PREFER_SAVE         0                           1",
        "ap_must_save                                       1                           0",
        "max_consec_compute_between_rs                      0                           3",
        "nodes                                             21                           9",
        "nodes                          placeholder         3                           2",
        "nodes                          output              1                           1",
        "nodes                          collective          4                           2",
        "nodes                          wait                4                           2",
        "nodes                          view                2                           0",
        "nodes                          compute             5                           2",
        "nodes                          other               2                           0",
        "",
        "saved for backward      3  1536 (1.5 KiB)",
        "static peak                10485760 (10.0 MiB)",
    ]


def test_the_table_of_one_empty_graph_spelled_out():
    """No collectives: the bytes column is as wide as its header; no ap_must_save row."""
    assert format_stats_table(GraphStats()) == "\n".join([
        "                                            graph",
        "stat                           dim          count  bytes",
        "wait_tensor                                     0",
        "max_consec_compute_between_rs                   0",
        "nodes                                           0",
        "nodes                          placeholder      0",
        "nodes                          output           0",
        "nodes                          collective       0",
        "nodes                          wait             0",
        "nodes                          view             0",
        "nodes                          compute          0",
        "nodes                          other            0",
    ]) + "\n"


def test_the_table_refuses_other_objects():
    with pytest.raises(TypeError, match=r"^expected GraphStats or PartitionStats, got dict$"):
        format_stats_table(GraphStats().to_dict())


def test_a_saved_all_reduced_value_is_not_gathered():
    fw = fx.Graph()
    x = fw.placeholder("x")
    w = fw.call_function(c10d.wait_tensor.default, (fw.call_function(c10d.all_reduce.default, (x, "sum", "3")),))
    fw.output((fw.call_function(aten.sum.default, (w,)), w))
    fw_gm = _gm(fw, torch.randn(4, 16))
    bw = fx.Graph()
    saved, tangent = bw.placeholder(w.name), bw.placeholder("tangents_1")
    bw.output((bw.call_function(aten.mul.Tensor, (saved, tangent)),))
    assert saved_gathered_values(fw_gm, _gm(bw, torch.randn(4, 16), torch.randn(()))) == []
