"""verify.canon: canonical text of FX graphs (names, groups, shapes, tags, determinism)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autoparallel import meta as M
from verify.canon import canonical_names, canonicalize, canonicalize_pair

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _propagate(gm: fx.GraphModule, *inputs: torch.Tensor) -> fx.GraphModule:
    FakeTensorProp(gm, mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    return gm


def _fsdp_like(names: dict[str, str], dp: str, tp: str) -> fx.GraphModule:
    """x @ all_gather(w).T, reduce-scattered over tp; node names and group names are parameters."""
    g = fx.Graph()
    x = g.placeholder(names.get("x", "x"))
    x.meta[M.ROLE] = "input:0"
    w = g.placeholder(names.get("w", "w"))
    w.meta[M.ROLE] = "param:layers.0.wq.weight"
    ag = g.call_function(c10d.all_gather_into_tensor.default, (w, 8, dp), name=names.get("ag"))
    wt = g.call_function(c10d.wait_tensor.default, (ag,), name=names.get("wt"))
    t = g.call_function(aten.t.default, (wt,), name=names.get("t"))
    mm = g.call_function(aten.mm.default, (x, t), name=names.get("mm"))
    mm2 = g.call_function(aten.mm.default, (mm, wt), name=names.get("mm2"))
    rs = g.call_function(
        c10d.reduce_scatter_tensor.default, (mm2, "sum", 2, tp), name=names.get("rs")
    )
    wr = g.call_function(c10d.wait_tensor.default, (rs,), name=names.get("wr"))
    s = g.call_function(aten.sum.default, (mm,), name=names.get("s"))
    out = g.output((s, wr))
    out.meta[M.ROLE] = ["loss", "grad:layers.0.wq.weight"]
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {dp: "dp", tp: "tp"}
    return _propagate(gm, torch.randn(8, 16), torch.randn(4, 16))


FSDP_LIKE_TEXT = """\
# fsdp-like
input:0: f32[8, 16]
param:layers.0.wq.weight: f32[4, 16]
all_gather_into_tensor_0: f32[32, 16] = _c10d_functional.all_gather_into_tensor.default(param:layers.0.wq.weight, 8, dp)
wait_tensor_0: f32[32, 16] = _c10d_functional.wait_tensor.default(all_gather_into_tensor_0)
t_0: f32[16, 32] = aten.t.default(wait_tensor_0)
mm_0: f32[8, 32] = aten.mm.default(input:0, t_0)
mm_1: f32[8, 16] = aten.mm.default(mm_0, wait_tensor_0)
reduce_scatter_tensor_0: f32[4, 16] = _c10d_functional.reduce_scatter_tensor.default(mm_1, 'sum', 2, tp)
wait_tensor_1: f32[4, 16] = _c10d_functional.wait_tensor.default(reduce_scatter_tensor_0)
sum_0: f32[] = aten.sum.default(mm_0)
return:
  loss = sum_0
  grad:layers.0.wq.weight = wait_tensor_1
"""


def test_exact_text_renames_per_op_in_graph_order():
    gm = _fsdp_like({}, "1", "3")
    assert canonicalize(gm, title="fsdp-like") == FSDP_LIKE_TEXT


def test_canonical_names_are_the_names_the_text_prints():
    gm = _fsdp_like({"mm": "zz_mm"}, "1", "3")
    names = canonical_names(gm)
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    expected = [
        "input:0", "param:layers.0.wq.weight", "all_gather_into_tensor_0", "wait_tensor_0",
        "t_0", "mm_0", "mm_1", "reduce_scatter_tensor_0", "wait_tensor_1", "sum_0",
    ]  # fmt: skip
    assert [names[n] for n in nodes] == expected and len(names) == len(nodes)
    lines = canonicalize(gm).splitlines()
    assert all(line.startswith(f"{name}: ") for name, line in zip(expected, lines, strict=False))


def test_original_node_and_group_names_do_not_matter():
    a = _fsdp_like({}, "1", "3")
    odd = {
        n: f"zz_{n}_{i}"
        for i, n in enumerate(["x", "w", "ag", "wt", "t", "mm", "mm2", "rs", "wr", "s"])
    }
    b = _fsdp_like(odd, "12", "7")
    assert [n.name for n in a.graph.nodes] != [n.name for n in b.graph.nodes]
    assert canonicalize(a) == canonicalize(b)
    assert "zz_" not in canonicalize(b)


def test_group_dims_argument_overrides_graph_map_and_flat_mesh_label():
    gm = _fsdp_like({}, "1", "3")
    text = canonicalize(gm, group_dims={"1": "dp*tp", "3": "tp"})
    assert "all_gather_into_tensor.default(param:layers.0.wq.weight, 8, dp*tp)" in text


def test_unknown_group_names_the_node():
    gm = _fsdp_like({"rs": "my_reduce_scatter"}, "1", "3")
    gm.meta[M.GM_GROUP_DIMS] = {"1": "dp"}
    with pytest.raises(ValueError, match=r"'3'.*my_reduce_scatter.*group_dims"):
        canonicalize(gm)


def test_group_passed_as_kwarg_is_named():
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(c10d.all_reduce.default, (x, "sum"), {"group_name": "5"})
    g.output(ar)
    gm = _propagate(fx.GraphModule(torch.nn.Module(), g), torch.randn(2))
    text = canonicalize(gm, group_dims={"5": "tp"})
    assert "_c10d_functional.all_reduce.default(arg_0, 'sum', group_name=tp)" in text
    assert text.endswith("return: all_reduce_0\n")


def test_placeholders_fall_back_to_positions_and_outputs_without_roles():
    g = fx.Graph()
    a = g.placeholder("primals_1")
    b = g.placeholder("tangents_1")
    b.meta[M.ROLE] = "tangent:0"
    c = g.placeholder("primals_2")
    add = g.call_function(aten.add.Tensor, (a, b))
    mul = g.call_function(aten.mul.Tensor, (add, c))
    g.output((mul, None, add))
    gm = _propagate(
        fx.GraphModule(torch.nn.Module(), g), torch.randn(3), torch.randn(3), torch.randn(3)
    )
    lines = canonicalize(gm).splitlines()
    assert lines[:3] == ["arg_0: f32[3]", "tangent:0: f32[3]", "arg_2: f32[3]"]
    assert lines[3] == "add_0: f32[3] = aten.add.Tensor(arg_0, tangent:0)"
    assert lines[-4:] == ["return:", "  mul_0", "  None", "  add_0"]


def test_multi_output_ops_and_getitem():
    def f(x):
        var, mean = torch.var_mean(x, dim=1, keepdim=True)
        a, b = torch.split(x, [2, 4], dim=1)
        return var + mean, a.sum() + b.sum()

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 6))
    text = canonicalize(gm)
    assert re.search(
        r"^var_mean_0: \(f32\[4, 1\], f32\[4, 1\]\) = aten\.var_mean\.correction\(arg_0, \[1\], "
        r"correction=1, keepdim=True\)$",
        text,
        re.M,
    ), text
    assert "getitem_0: f32[4, 1] = operator.getitem(var_mean_0, 0)" in text
    assert "getitem_1: f32[4, 1] = operator.getitem(var_mean_0, 1)" in text
    assert re.search(r"^split_with_sizes_0: \[f32\[4, 2\], f32\[4, 4\]\] = ", text, re.M), text
    assert "getitem_3: f32[4, 4] = operator.getitem(split_with_sizes_0, 1)" in text


def test_symbolic_shapes_print_renamed_symbols_deterministically():
    def f(x, y):
        z = torch.cat([x, x], dim=0)
        return (z @ y).relu(), x.shape[0] * 4

    texts = [
        canonicalize(make_fx(f, tracing_mode="symbolic")(torch.randn(6, 4), torch.randn(4, 3)))
        for _ in range(2)
    ]
    assert texts[0] == texts[1]
    text = texts[0]
    assert text.splitlines()[:2] == ["arg_0: f32[s0, s1]", "arg_1: f32[s1, s2]"]
    assert "cat_0: f32[2*s0, s1] = aten.cat.default([arg_0, arg_0])" in text
    assert re.search(r"^mul_0: 4\*s0 = operator\.mul\(sym_size_0, 4\)$", text, re.M), text
    assert set(re.findall(r"\b[su]\d+\b", text)) == {"s0", "s1", "s2"}


def test_missing_val_is_a_clear_error_unless_not_required():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.VAL] = FakeTensorMode().from_tensor(torch.randn(2, 3))
    r = g.call_function(aten.relu.default, (x,), name="the_relu")
    g.output(r)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(ValueError, match=r"'the_relu'.*meta\['val'\].*FakeTensorProp"):
        canonicalize(gm)
    text = canonicalize(gm, require_val=False)
    assert text == "arg_0: f32[2, 3]\nrelu_0 = aten.relu.default(arg_0)\nreturn: relu_0\n"


# Built from source so two fresh interpreters (different PYTHONHASHSEED) can build the same
# graph without importing this test module. Exec'd under the module name ``seeded_graph``.
TAGGED_GRAPH_SRC = """
import operator
import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy
from autoparallel import meta as M

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _kwarg_sink(x, *, opts, names):  # never called, only a target with dict/set kwargs
    return x


def build():
    g = fx.Graph()
    x = g.placeholder("x")
    ag = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    ag.meta[M.RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
    ag.meta[M.AC_GRAPH_ID] = M.AP_AC_GRAPH_ID
    M.set_bucket_tag(ag, "fsdp_ag")
    wt = g.call_function(c10d.wait_tensor.default, (ag,))
    wt.meta[M.RECOMPUTE] = CheckpointPolicy.PREFER_SAVE
    wt.meta[M.AC_GRAPH_ID] = 3
    M.custom_meta(wt)[M.PHASE] = M.PHASE_BACKWARD
    vm = g.call_function(aten.var_mean.correction, (wt, [1]), {"correction": 0, "keepdim": True})
    M.custom_meta(vm)[M.AP_MUST_SAVE] = True
    M.custom_meta(vm)[M.AP_MUST_SAVE_GETITEM_INDICES] = [1, 0]
    M.custom_meta(vm)[M.PHASE] = M.PHASE_FORWARD
    g0 = g.call_function(operator.getitem, (vm, 0))
    M.custom_meta(g0)[M.AP_MUST_SAVE] = False
    cl = g.call_function(aten.clone.default, (g0,), {"memory_format": torch.contiguous_format})
    opts = {"zeta": 1.5e-5, "alpha": torch.float16, "mid": "s", "beta": float("inf")}
    names = {"q", "b", "k", "a", "zz", "c"}
    sink = g.call_function(_kwarg_sink, (cl,), {"opts": opts, "names": names})
    g.output((sink,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    gm.meta[M.GM_GROUP_DIMS] = {"0": "dp"}
    # meta-device tensors as vals: no FakeTensorMode, so a fresh interpreter stays cheap
    x.meta[M.VAL] = torch.empty(2, 4, device="meta")
    ag.meta[M.VAL] = torch.empty(4, 4, device="meta")
    wt.meta[M.VAL] = torch.empty(4, 4, device="meta")
    vm.meta[M.VAL] = (torch.empty(4, 1, device="meta"), torch.empty(4, 1, device="meta"))
    g0.meta[M.VAL] = vm.meta[M.VAL][0]
    cl.meta[M.VAL] = torch.empty(4, 1, device="meta")
    sink.meta[M.VAL] = torch.empty(4, 1, dtype=torch.bfloat16, device="meta")
    return gm
"""


def _tagged_graph() -> fx.GraphModule:
    ns = {"__name__": "seeded_graph"}
    exec(compile(TAGGED_GRAPH_SRC, "<seeded_graph>", "exec"), ns)
    return ns["build"]()


TAGGED_TEXT = """\
arg_0: f32[2, 4]
all_gather_into_tensor_0: f32[4, 4] = _c10d_functional.all_gather_into_tensor.default(arg_0, 2, dp)  {recompute=MUST_RECOMPUTE ac=ap bucket=fsdp_ag}
bw/wait_tensor_0: f32[4, 4] = _c10d_functional.wait_tensor.default(all_gather_into_tensor_0)  {recompute=PREFER_SAVE ac=3 phase=backward}
var_mean_0: (f32[4, 1], f32[4, 1]) = aten.var_mean.correction(bw/wait_tensor_0, [1], correction=0, keepdim=True)  {must_save[0,1] phase=forward}
getitem_0: f32[4, 1] = operator.getitem(var_mean_0, 0)  {must_save=False}
clone_0: f32[4, 1] = aten.clone.default(getitem_0, memory_format=torch.contiguous_format)
_kwarg_sink_0: bf16[4, 1] = seeded_graph._kwarg_sink(clone_0, names={'a', 'b', 'c', 'k', 'q', 'zz'}, opts={'alpha': torch.float16, 'beta': inf, 'mid': 's', 'zeta': 1.5e-05})
return:
  _kwarg_sink_0
"""


def test_tags_shown_in_fixed_order_and_constants_sorted():
    assert canonicalize(_tagged_graph()) == TAGGED_TEXT


def test_output_independent_of_pythonhashseed():
    """A fresh interpreter with another hash seed prints the same bytes as this process."""
    own = os.environ.get("PYTHONHASHSEED")
    seed = "4242" if own != "4242" else "17"
    script = (
        "import sys\n"
        "from verify.canon import canonicalize\n"
        "ns = {'__name__': 'seeded_graph'}\n"
        "exec(compile(sys.stdin.read(), '<seeded_graph>', 'exec'), ns)\n"
        "sys.stdout.write(canonicalize(ns['build'](), title='seeded'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONHASHSEED=seed),
        input=TAGGED_GRAPH_SRC,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == canonicalize(_tagged_graph(), title="seeded")


def test_empty_graph_title_and_graph_input():
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    assert canonicalize(gm) == "(empty graph)\n"
    assert canonicalize(gm, title="nothing") == "# nothing\n(empty graph)\n"
    g = fx.Graph()
    g.output(())
    assert canonicalize(g) == "return: ()\n"


def test_constants_print_deterministically():
    def f(x):
        y = torch.full((2,), 0.1, dtype=torch.float64, device="cpu")
        return x.to(torch.bfloat16) * 1e-05, y, x.new_zeros(3, dtype=torch.int64)

    text = canonicalize(make_fx(f, tracing_mode="fake")(torch.randn(2)))
    assert (
        "aten.full.default([2], 0.1, device=device('cpu'), dtype=torch.float64, pin_memory=False)"
        in text
    )
    assert "aten.mul.Tensor(_to_copy_0, 1e-05)" in text
    assert "0x" not in text and "File" not in text


def test_canonicalize_pair_sections_share_symbols():
    fw = _fsdp_like({}, "1", "3")
    bw = _fsdp_like({}, "5", "6")
    text = canonicalize_pair(fw, bw, title="pair")
    assert text.startswith("# pair\n== forward ==\ninput:0: f32[8, 16]\n")
    fw_part, bw_part = text.split("\n== backward ==\n")
    assert fw_part.endswith("wait_tensor_1\n")
    assert bw_part == canonicalize(bw)


def test_get_attr_constant_without_val_is_described_from_the_attribute():
    root = torch.nn.Module()
    root.register_buffer("scale", torch.ones(3, dtype=torch.float16))
    g = fx.Graph()
    x = g.placeholder("x")
    c = g.get_attr("scale")
    g.output(g.call_function(aten.mul.Tensor, (x, c)))
    gm = fx.GraphModule(root, g)
    x.meta[M.VAL] = torch.empty(3, device="meta")
    next(n for n in gm.graph.nodes if n.op == "call_function").meta[M.VAL] = torch.empty(
        3, device="meta"
    )
    assert canonicalize(gm).splitlines()[1] == "get_attr_0: f16[3] = get_attr('scale')"
