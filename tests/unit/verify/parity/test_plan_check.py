"""The independent plan checker (verify/parity/plan_check.py) on a 2-D mesh whose dims do not divide.

The model's dims (12, 20, 6) divide each mesh dim of dp=4,tp=2 alone but not their product 8, so
a strategy space that checks divisibility per mesh dim keeps placements no rank can hold. Every
constraint group is tampered with once (the multi-output LayerNorm's getitems included), and two
strategy bugs are planted in the planner itself: the checker, which never reads the planner's
candidate lists, must name each.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial
from torch.fx.experimental.proxy_tensor import make_fx

from autoparallel import meta as M
from autoparallel import roles
from autoparallel import pipeline as P
from autoparallel.fx_utils import copy_graph_module
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import Planner, PlannerConfig, Solution
from autoparallel.planner import problem as planner_problem
from autoparallel.planner import strategies as planner_strategies
from verify import zoo
from verify.parity import plan_check, plan_semantics
from verify.parity.plan_check import (
    can_move,
    check_plan,
    local_numel,
    placement,
    shard_counts,
    traced_graph,
)

MESH = "dp=4,tp=2"
PINS = {"input:0": "dp:S(0),tp:R", "input:1": "dp:S(0),tp:R"}


class Uneven(nn.Module):
    """12 -> 20 -> LayerNorm -> GELU -> 6: no dim divides by 8, each divides by 4 or 2."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(12, 20)
        self.norm = nn.LayerNorm(20)
        self.down = nn.Linear(20, 6, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.norm(self.up(x))))


def _inputs():
    return torch.empty(12, 12, device="meta"), torch.zeros(12, dtype=torch.long, device="meta")


@pytest.fixture(scope="module")
def traced():
    with torch.device("meta"):
        model = Uneven()
    with fake_world(MESH) as mesh:
        return Planner.trace(model, mesh, _inputs(), F.cross_entropy, description="uneven")


@pytest.fixture(scope="module")
def plan(traced):
    with fake_world(MESH) as mesh:
        return traced.plan(mesh, PlannerConfig(pins=PINS))


def _tampered(plan: Solution, edit) -> Solution:
    copy = Solution.from_json(json.loads(json.dumps(plan.to_json())))
    edit(copy)
    return copy


def _groups(plan, tampered, semantics=True) -> set[str]:
    return check_plan(tampered, *traced_graph(plan), semantics=semantics).groups()


def test_the_correct_plan_passes_and_every_op_ran(plan):
    result = plan_check.assert_plan_valid(plan)
    assert result.ran >= 20 and result.unchecked == {}
    assert plan.inputs["input:0"] == {"dp": "S(0)", "tp": "R"}


def _node(p, op, k=0, phase="fwd"):
    return p.nodes[f"-/{phase}/{op}#{k}"]


R2 = {"dp": "R", "tp": "R"}


def _structure(p):
    del p.nodes["-/fwd/aten.gelu.default#0"]


def _divides(p):  # the batch of 12 split 8 ways, consumers adjusted so that only this is wrong
    p.nodes["input:0"].out = [{"dp": "S(0)", "tp": "S(0)"}]
    p.inputs["input:0"] = {"dp": "S(0)", "tp": "S(0)"}


def _flow(p):  # addmm wants the transposed weight as a partial sum over dp; it is split over dp
    _node(p, "aten.addmm.default").ins[2] = {"dp": "P(sum)", "tp": "R"}


def _partial_into_gelu(p):  # a replicated value split into summands is legal; GELU of them is not
    _node(p, "aten.gelu.default").ins = [{"dp": "P(sum)", "tp": "R"}]


def _multi_output(p):  # LayerNorm's mean placed apart from the op that makes it
    p.nodes["-/fwd/getitem#1"].out = [{"dp": "S(0)", "tp": "R"}]


def _fwd_bwd(p):
    p.nodes["out:grad:down.weight"].out = [R2]
    p.nodes["out:grad:down.weight"].ins = [R2]


def _loss(p):
    p.nodes["out:loss"].out = [{"dp": "P(avg)", "tp": "R"}]
    p.nodes["out:loss"].ins = [{"dp": "P(avg)", "tp": "R"}]


def _memory(p):
    p.param_memory_bytes -= 4


def _budget(p):
    p.memory_budget_bytes = p.param_memory_bytes / 2


def _tables(p):
    p.params["up.weight"] = R2


def _semantics(p):  # a replicated matmul claimed split over tp: every structural rule still holds
    mm = _node(p, "aten.mm.default")
    mm.out = [{**mm.out[0], "tp": "S(1)"}]


def _semantics_partial(p):  # x @ w with x sharded on its rows claimed as a partial sum
    mm = _node(p, "aten.mm.default")
    mm.ins = [{"dp": "S(0)", "tp": "R"}, R2]
    mm.out = [{"dp": "P(sum)", "tp": "R"}]


TAMPERED = {
    "structure": (_structure, {"structure"}),
    "divides": (_divides, {"divides"}),
    "flow": (_flow, {"flow"}),
    "multi_output": (_multi_output, {"multi_output"}),
    "fwd_bwd": (_fwd_bwd, {"fwd_bwd"}),
    "fwd_bwd (loss)": (_loss, {"fwd_bwd"}),
    "param_memory": (_memory, {"param_memory"}),
    "param_memory (budget)": (_budget, {"param_memory"}),
    "tables": (_tables, {"tables"}),
    "semantics": (_semantics, {"semantics"}),
    "semantics (partial)": (_semantics_partial, {"semantics"}),
    "semantics (partial into gelu)": (_partial_into_gelu, {"semantics"}),
}


@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_each_tampered_group_is_named(plan, name):
    edit, groups = TAMPERED[name]
    got = check_plan(_tampered(plan, edit), *traced_graph(plan))
    assert got.groups() >= groups, [str(v) for v in got.violations]
    assert got.groups() <= groups | {"semantics"}, [str(v) for v in got.violations]


NORM = "-/fwd/aten.native_layer_norm.default#0"
GELU = "-/fwd/aten.gelu.default#0"
EXACT = {  # tampered plan -> every structural violation, word for word
    "divides": ["[divides] input:0: output 0: dim 0 of (12, 12) split 8 ways by dp:S(0) tp:S(0)"],
    "flow": ["[flow] -/fwd/aten.addmm.default#0 input 2 <- -/fwd/aten.t.default#0: no redistribution from dp:S(1) tp:R to dp:P(sum) tp:R"],
    "fwd_bwd": ["[fwd_bwd] out:grad:down.weight ~ param:down.weight: dp:R tp:R != dp:S(1) tp:S(0)"],
    "fwd_bwd (loss)": ["[fwd_bwd] out:loss ~ tangent:loss: dp:P(avg) tp:R != dp:R tp:R",
                       "[fwd_bwd] out:loss: the loss must be replicated, placed dp:P(avg) tp:R"],
    "multi_output": ["[multi_output] -/fwd/getitem#1: placed dp:S(0) tp:R, its producer's output 1 is dp:R tp:R"],
    "param_memory": ["[param_memory] params: parameters take 240 bytes per rank, the plan says 236"],
    "param_memory (budget)": ["[param_memory] params: 240 bytes per rank exceed the budget of 120.0"],
    "structure": [f"[structure] {GELU}: the plan does not place this node"],
    "tables": ["[tables] up.weight: parameter table says {'dp': 'R', 'tp': 'R'}, its node dp:S(0) tp:S(1)"],
}


def _drop_output(p):
    p.nodes[NORM].out.pop()


def _extra_input(p):
    p.nodes[GELU].ins.append(R2)


def _unreadable(p):
    p.nodes[GELU].ins = [{"dp": "S(x)", "tp": "R"}]


def _unplaced_output(p):
    p.nodes[NORM].out[1] = None


def _alias_moves(p):
    p.nodes["input:0/alias"].out = [{"dp": "S(0)", "tp": "R"}]


def _output_moves(p):
    p.nodes["out:loss"].ins = [{"dp": "S(0)", "tp": "R"}]


def _extra_param(p):
    p.params["extra.weight"] = R2


def _input_split_8_ways(p):
    p.nodes[GELU].ins = [{"dp": "S(0)", "tp": "S(0)"}]


def _shard_past_the_last_dim(p):
    p.nodes[GELU].out = [{"dp": "S(2)", "tp": "R"}]


def _unplaced_loss_and_a_gradient_that_moves(p):
    del p.nodes["out:loss"]
    p.nodes["out:grad:down.weight"].ins = [R2]


MORE = {
    "output count": (_drop_output, [f"[structure] {NORM}: 2 output placements for 3 outputs"]),
    "input count": (_extra_input, [f"[structure] {GELU}: 2 input placements for 1 tensor inputs"]),
    "unreadable": (_unreadable, [f"[structure] {GELU}: unreadable placement: bad placement 'S(x)': expected R, S(d), _S(d, split_factor), P(op) or MaskP(op, shape, dim)"]),
    "unplaced output": (_unplaced_output, [f"[structure] {NORM}: output 1: placement None for a tensor",
                                           f"[multi_output] -/fwd/getitem#1: reads output 1 of {NORM}, which has no placement"]),
    "alias moves": (_alias_moves, ["[flow] input:0/alias: an alias moves nothing: in dp:R tp:R, out dp:S(0) tp:R"]),
    "output moves": (_output_moves, ["[flow] out:loss: a graph output is what it receives: in [{'dp': 'S(0)', 'tp': 'R'}], out [{'dp': 'R', 'tp': 'R'}]"]),
    "parameter count": (_extra_param, ["[tables] params: the plan lists 6 parameters, the graph has 5"]),
    "input divides": (_input_split_8_ways, [f"[divides] {GELU}: input 0: dim 0 of (12, 20) split 8 ways by dp:S(0) tp:S(0)"]),
    "unplaced graph output": (_unplaced_loss_and_a_gradient_that_moves, [
        "[structure] out:loss: the plan does not place this graph output",
        "[flow] out:grad:down.weight: a graph output is what it receives: in [{'dp': 'R', 'tp': 'R'}], out [{'dp': 'S(1)', 'tp': 'S(0)'}]"]),
    "shard past the last dim": (_shard_past_the_last_dim, [f"[structure] {GELU}: output 0: S(2) on a 2-d tensor"]),
}


@pytest.mark.parametrize("name", sorted(EXACT) + sorted(MORE))
def test_each_violation_is_named_word_for_word(plan, name):
    edit, want = (TAMPERED[name][0], EXACT[name]) if name in EXACT else MORE[name]
    got = check_plan(_tampered(plan, edit), *traced_graph(plan), semantics=False)
    assert [str(v) for v in got.violations] == want


def test_a_valid_placement_the_planner_did_not_choose_passes(plan):
    """The bias gradient's view (1, 20) -> (20,) split over dp: it must run with this rank's size
    (5), not the global one, and reassemble; a checker that flags every change is no checker."""

    def split_view(p):
        view = _node(p, "aten.view.default", phase="bwd")
        view.ins = [{"dp": "S(1)", "tp": "R"}]
        view.out = [{"dp": "S(0)", "tp": "R"}]

    got = check_plan(_tampered(plan, split_view), *traced_graph(plan))
    assert got.violations == [] and got.ran >= 20


def test_an_op_that_fails_on_its_shards_is_named_with_its_error(plan):
    """The bias gradient's view (1, 20) -> (20,) given its input split over dp but claimed replicated:
    each rank views its 5 values as 20."""

    def unsplit_view(p):
        view = _node(p, "aten.view.default", phase="bwd")
        view.ins = [{"dp": "S(1)", "tp": "R"}]
        view.out = [R2]

    got = check_plan(_tampered(plan, unsplit_view), *traced_graph(plan))
    assert [str(v) for v in got.violations if v.group == "semantics"] == [
        "[semantics] -/bwd/aten.view.default#0: the op fails on its shards: RuntimeError: shape '[20]' is invalid for input of size 5"]


def test_pins_are_checked(plan):
    got = check_plan(plan, *traced_graph(plan), semantics=False, pins={"input:0": (Replicate(), Replicate())})
    assert [str(v) for v in got.violations] == ["[pins] input:0: pinned to (Replicate(), Replicate()), placed (Shard(dim=0), Replicate())"]
    assert check_plan(plan, *traced_graph(plan), semantics=False, pins={"input:0": (Shard(0), Replicate())}).violations == []


def test_a_cast_that_moves_before_a_mixed_precision_parameter_cast_is_named():
    with torch.device("meta"):
        model = Uneven()
    with fake_world(MESH) as mesh:
        plan = Planner.trace(model, mesh, _inputs(), F.cross_entropy, param_dtype=torch.bfloat16).plan(mesh)
    result = plan_check.assert_plan_valid(plan)
    # the fp32 input is cast to bf16 as the program casts it (FSDP2's cast_forward_inputs): the
    # traced graph runs on real tensors, so every semantic check ran (before the cast, fp32 inputs
    # met bf16 weights and the checker could only say the graph does not run)
    assert not result.unchecked, result.unchecked
    gm, _ = traced_graph(plan)
    # the parameters' narrowing casts (the input's cast to bf16 is no parameter's)
    casts = [plan.node_names[n.name] for n in gm.graph.nodes if plan_check._cast(n) is not None
             and roles.is_param(plan_check._through_alias(n.args[0]).meta.get(M.ROLE))]
    key = next(k for k in casts if plan.nodes[k].ins[0] != {"dp": "S(1)", "tp": "R"})

    def moved(p):
        p.nodes[key].ins = [{"dp": "S(1)", "tp": "R"}]

    got = check_plan(_tampered(plan, moved), *traced_graph(plan), semantics=False).violations
    assert [v.group for v in got] == ["grad_reduce_dtype"] and got[0].where == key
    assert got[0].detail.endswith("-> dp:S(1) tp:R across a mixed-precision cast")
    # a gradient's widening cast (bf16 -> fp32, straight into a graph output) moves nothing either
    widening = next(plan.node_names[n.name] for n in gm.graph.nodes
                    if (plan_check._cast(n) or (None, None))[1] == torch.float32 and any(u.op == "output" for u in n.users))

    def reduced_in_bf16(p):
        p.nodes[widening].ins = [{"dp": "P(sum)", "tp": "R"}]

    got = check_plan(_tampered(plan, reduced_in_bf16), *traced_graph(plan), semantics=False).violations
    assert [(v.group, v.where) for v in got] == [("grad_reduce_dtype", widening)]


# --- planted strategy bugs: the planner's own candidate space is wrong ------------------------------


def _divides_per_mesh_dim(placements, shape, sizes, *, pad_dim0=False):
    """The classic bug: each mesh dim checked alone (12 % 4 == 0 and 12 % 2 == 0, yet 12 % 8 != 0)."""
    for p, n in zip(placements, sizes, strict=True):
        if isinstance(p, Shard) and (not 0 <= p.dim < len(shape) or (shape[p.dim] % n and not (p.dim == 0 and pad_dim0))):
            return False
    return True


def _last_mesh_dim_wins(placements, sizes, ndim):
    """A wrong shard count: the last mesh dim sharding a tensor dim overwrites the count."""
    counts = [1] * ndim
    for p, n in zip(placements, sizes, strict=True):
        if isinstance(p, Shard):
            if not 0 <= p.dim < ndim:
                return None
            counts[p.dim] = n
    return counts


PLANTED = {
    "non-dividing candidate kept": ((planner_strategies, "divides", _divides_per_mesh_dim), (planner_problem, "divides", _divides_per_mesh_dim)),
    "wrong shard count": ((planner_strategies, "shard_counts", _last_mesh_dim_wins),),
}


def planted_plan(traced, bug: str, monkeypatch, *, even_shards: bool = False) -> Solution:
    """The plan a planner with ``bug`` makes (its non-dividing candidate chosen through a pin).
    ``even_shards=False``: the planner's even-shard filter (autoparallel.planner.even_shards, its
    own ``divides``) off, so the planted candidate reaches the plan and the checker must catch it."""
    for module, attr, fn in PLANTED[bug]:
        monkeypatch.setattr(module, attr, fn)
    try:
        with fake_world(MESH) as mesh:
            return Planner(traced.pg, "uneven").plan(mesh, PlannerConfig(pins={"input:0": "dp:S(1),tp:S(1)"}, even_shards=even_shards))
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_strategy_bugs_are_caught(traced, bug, monkeypatch):
    plan = planted_plan(traced, bug, monkeypatch)
    got = check_plan(plan, *traced_graph(plan))
    assert [str(v) for v in got.violations if v.group == "divides"] == [
        "[divides] input:0: output 0: dim 1 of (12, 12) split 8 ways by dp:S(1) tp:S(1)"
    ]
    with fake_world(MESH) as mesh, pytest.raises(ValueError, match="is not a candidate"):
        traced.plan(mesh, PlannerConfig(pins={"input:0": "dp:S(1),tp:S(1)"}))  # the real planner refuses it
    if bug == "non-dividing candidate kept":
        # The even-shard filter (on by default) bound strategies.divides on import, so the patch
        # misses it and it refuses the pin itself.
        # (A wrong shard_counts fools the filter too: it counts shards with the planner's helper.)
        with pytest.raises(ValueError, match=r"pin of input:0: its placement does not divide \(12, 12\) evenly"):
            planted_plan(traced, bug, monkeypatch, even_shards=True)


class Attention(nn.Module):
    """One causal attention layer (the CPU SDPA op, which has the planner's own rule)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48, bias=False)
        self.out = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, 2, 8).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, 16)).mean(1)


def test_a_planted_op_rule_that_shards_attention_over_the_sequence_is_caught_by_running_it(monkeypatch):
    """The planner's SDPA rule with a sequence split added (wrong without context parallelism):
    every shape divides and every move exists, so only running the op on the shards sees it."""
    sdpa = planner_strategies.aten._scaled_dot_product_flash_attention_for_cpu
    rule = planner_strategies.PLANNER_RULES[sdpa.default]

    def with_sequence(node, num_outs, num_ins):
        return [*rule(node, num_outs, num_ins), [Shard(2)] * (num_outs + num_ins)]

    with torch.device("meta"):
        model = Attention()
    inputs = (torch.empty(4, 8, 16, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
    key = "-/fwd/aten._scaled_dot_product_flash_attention_for_cpu.default#0"
    with fake_world(MESH) as mesh:
        traced = Planner.trace(model, mesh, inputs, F.cross_entropy)
        # the batch split over dp: views and reshapes run with this rank's sizes, not the global ones
        correct = plan_check.assert_plan_valid(traced.plan(mesh, PlannerConfig(pins={"input:0": "dp:S(0),tp:R"})))
        assert correct.unchecked == {} and correct.ran >= 20
        for op in (sdpa.default, planner_strategies.aten._scaled_dot_product_flash_attention_for_cpu_backward.default):
            monkeypatch.setitem(planner_strategies.PLANNER_RULES, op, with_sequence)
        plan = Planner(traced.pg, "attention").plan(mesh, PlannerConfig(pins={key: "dp:S(2),tp:R"}))
    got = check_plan(plan, *traced_graph(plan))
    assert got.groups() == {"semantics"} and got.violations[0].where == key, [str(v) for v in got.violations]


def test_the_checker_reads_nothing_of_the_planner_but_the_plan_format():
    """No candidate table, strategy, cost model or problem: only the plan's file format."""
    trees = [ast.parse(Path(m.__file__).read_text()) for m in (plan_check, plan_semantics)]
    imported = {n.module for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("autoparallel.planner")} == {"autoparallel.planner.solution"}, imported


# --- the pieces ------------------------------------------------------------------------------------


def test_placements_parse_and_moves_into_partials_need_replicate_or_the_same_partial():
    assert [placement(t) for t in ("R", "S(1)", "P(sum)")] == [Replicate(), Shard(1), Partial("sum")]
    mask = placement("MaskP(sum, (12, 4), 0)")
    assert isinstance(mask, _MaskPartial) and (mask.reduce_op, tuple(mask.offset_shape), mask.offset_dim) == ("sum", (12, 4), 0)
    with pytest.raises(ValueError, match="bad placement"):
        placement("S(x)")
    assert can_move((Shard(0), Partial("sum")), (Replicate(), Shard(1)))
    assert can_move((Replicate(), Partial("sum")), (Partial("avg"), Partial("sum")))
    assert not can_move((Shard(0), Replicate()), (Partial("sum"), Replicate()))
    assert not can_move((Partial("avg"), Replicate()), (Partial("sum"), Replicate()))
    assert shard_counts((Shard(1), Shard(1)), (4, 2), 2) == [1, 8]
    assert shard_counts((Shard(0), Replicate()), (4, 2), 3) == [4, 1, 1]
    assert local_numel((10, 12), (Shard(0), Shard(1)), (4, 2)) == 3 * 6  # padded rows rounded up


@pytest.mark.parametrize(
    "pl",
    [(Shard(0), Shard(1)), (Shard(1), Shard(1)), (Partial("sum"), Shard(0)), (Replicate(), Partial("avg")),
     (Partial("max"), Replicate()), (Partial("min"), Partial("sum"))],
    ids=str,
)
def test_split_then_combine_gives_back_the_tensor(pl):
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    coords = [(i, j) for i in range(4) for j in range(2)]
    pieces, masks = plan_semantics._split(full, pl, (4, 2), coords, torch.Generator().manual_seed(1))
    if any(isinstance(p, Partial) for p in pl):
        assert not torch.allclose(pieces[0], pieces[1]) or not torch.allclose(pieces[0], pieces[-1])
    assert plan_semantics._differs(plan_semantics._combine(pieces, pl, (4, 2), coords, masks), full) is None


def test_a_replicated_claim_on_disagreeing_ranks_is_named():
    coords = [(0,), (1,)]
    with pytest.raises(plan_semantics._Disagree, match="disagree on a replicated value"):
        plan_semantics._combine([torch.ones(3), torch.zeros(3)], (Replicate(),), (2,), coords, [None, None])


def test_masked_rows_of_a_vocab_split_lookup_are_dropped():
    table = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 7, 3, 4])
    coords = [(0,), (1,)]
    mask_p = _MaskPartial(offset_shape=(8, 3), offset_dim=0, reduce_op="sum")
    local_ids, masks = plan_semantics._split(ids, (mask_p,), (2,), coords, torch.Generator())
    tables, _ = plan_semantics._split(table, (Shard(0),), (2,), coords, torch.Generator())
    outs = [F.embedding(i, t) for i, t in zip(local_ids, tables, strict=True)]
    assert plan_semantics._differs(plan_semantics._combine(outs, (mask_p,), (2,), coords, masks), F.embedding(ids, table)) is None
    assert plan_semantics._differs(plan_semantics._combine(outs, (Partial("sum"),), (2,), coords, masks), F.embedding(ids, table))


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return F.dropout(self.fc(x), p=0.5)


def test_random_ops_and_graphs_too_big_to_run_are_listed_as_unchecked():
    with torch.device("meta"):
        model = Dropout()
    inputs = (torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
    with fake_world("dp=2") as mesh:
        plan = Planner.trace(model, mesh, inputs, F.cross_entropy).plan(mesh)
    result = plan_check.assert_plan_valid(plan)
    assert set(result.unchecked.values()) == {"random op"} and result.ran >= 5
    assert any("native_dropout" in k for k in result.unchecked)
    small = check_plan(plan, *traced_graph(plan), max_numel=31)
    assert small.ran == 0 and small.unchecked == {"*": "a tensor of 32 elements exceeds max_numel=31: the graph is not run"}


def test_differs_judges_at_the_tensors_scale():
    a = torch.tensor([1000.0, 1.0])
    assert plan_semantics._differs(a + 0.5, a) is None  # 5e-4 of the scale
    assert "max |diff|" in plan_semantics._differs(a + 2.0, a)
    assert "shape/dtype" in plan_semantics._differs(a[:1], a)
    assert plan_semantics._differs(torch.tensor([1, 2]), torch.tensor([1, 3])) == "1 of 2 elements differ"
    assert plan_semantics._differs(torch.tensor([float("nan")]), torch.tensor([0.0])) == "NaN on one side"
    assert plan_semantics._differs(torch.empty(0, 3), torch.empty(0, 3)) is None
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert plan_semantics._differs(z, z.clone()) is None and "max |diff|" in plan_semantics._differs(z * 1j, z)


def test_every_constraint_group_has_a_negative_test():
    tampered = {g for _, groups in TAMPERED.values() for g in groups}
    assert tampered | {"pins", "grad_reduce_dtype"} == set(plan_check.GROUPS)  # those two: their own tests above


def test_a_buffers_new_value_placed_apart_from_the_buffer_is_named():
    """The convnet updates BatchNorm's running stats in place: the module copies each new value
    into the buffer's local piece, so the two are placed alike (fwd_bwd); pinned sharded here."""
    case = zoo.convnet
    with torch.device("meta"):
        model = case.factory()
    with fake_world("dp=2,tp=2") as mesh:
        run = P.run_pipeline(model, case.loss_fn, case.batch(4),
                             ParallelPlan.auto(pins={"buffer:bn.running_mean": "dp:R,tp:S(0)"}), mesh, until=P.PLAN)
    good = run.planned.solution
    assert "fwd_bwd" not in check_plan(good, *traced_graph(good), semantics=False).groups()

    def apart(p):
        p.nodes["out:mutated:bn.running_mean"].out = [R2]
        p.nodes["out:mutated:bn.running_mean"].ins = [R2]

    result = check_plan(_tampered(good, apart), *traced_graph(good), semantics=False)
    assert [str(v) for v in result.violations if v.group == "fwd_bwd"] == [
        "[fwd_bwd] out:mutated:bn.running_mean ~ buffer:bn.running_mean: dp:R tp:R != dp:R tp:S(0)"]


def test_ops_with_missing_outputs_run_on_simulated_ranks():
    """The convnet's first convolution has no input gradient and its last no bias gradient:
    convolution_backward returns None there, which has neither a placement nor a shape to run with."""
    case = zoo.convnet
    with torch.device("meta"):
        model = case.factory()
    with fake_world("dp=2") as mesh:
        plan = P.run_pipeline(model, case.loss_fn, case.batch(4), "auto", mesh, until=P.PLAN).planned.solution
    gm, _ = traced_graph(plan)
    missing = {n.name: [m is None for m in plan_semantics.tensor_metas(n)] for n in gm.graph.nodes if n.op == "call_function"
               and any(m is None for m in plan_semantics.tensor_metas(n))}
    assert missing == {"convolution_backward": [False, False, True], "convolution_backward_1": [True, False, False]}
    result = plan_check.assert_plan_valid(plan)
    assert result.unchecked == {} and result.ran >= 40


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc = nn.Linear(8, 4, bias=False)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(1)


def test_a_vocab_split_lookup_placed_by_hand_runs_with_its_masked_rows():
    """The planner offers no MaskPartial, but a plan may carry one (the plan format parses it): a
    lookup whose table is split by rows, its ids MaskPartial, its output MaskPartial passes; the
    same output claimed a plain Partial sum, or MaskPartial ids over both mesh dims (not simulated),
    are named."""
    with torch.device("meta"):
        model = Lookup()
    inputs = (torch.zeros(4, 6, dtype=torch.long, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
    with fake_world("dp=2,tp=2") as mesh:
        traced = Planner.trace(model, mesh, inputs, F.cross_entropy)
        plan = traced.plan(mesh, PlannerConfig(pins={"emb.weight": "dp:S(0),tp:R"}, memory_budget=float("inf")))
    key = "-/fwd/aten.embedding.default#0"
    mask = "MaskP(sum, (16, 8), 0)"

    def vocab_split(out: str, ids_tp: str = "R"):
        def edit(p):
            node = p.nodes[key]
            node.out[0], node.ins[0], node.ins[1] = {"dp": out, "tp": "R"}, {"dp": "S(0)", "tp": "R"}, {"dp": mask, "tp": ids_tp}
        return _tampered(plan, edit)

    ok = check_plan(vocab_split(mask), *traced_graph(plan))
    assert ok.violations == [] and ok.unchecked == {} and ok.ran >= 20
    summed = check_plan(vocab_split("P(sum)"), *traced_graph(plan))
    assert summed.groups() == {"semantics"} and [v.where for v in summed.violations] == [key]
    both = check_plan(vocab_split(mask, ids_tp=mask), *traced_graph(plan))
    assert both.unchecked == {key: "MaskPartial over several mesh dims"}


def test_only_a_copy_that_changes_the_dtype_and_keeps_the_shape_is_a_cast():
    gm = make_fx(lambda x: (torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16),
                            torch.ops.aten._to_copy.default(x, dtype=torch.float32),
                            torch.ops.prims.convert_element_type.default(x, torch.bfloat16)))(torch.randn(4, 2))
    casts = [plan_check._cast(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert casts == [(torch.float32, torch.bfloat16), None, (torch.float32, torch.bfloat16)]


def test_an_unplaced_placeholder_leaves_the_others_counted(plan):
    """The first placeholder without a placement is a structure violation; memory, tables and pins
    still read every placeholder after it."""
    gm, roles_ = traced_graph(plan)
    first = plan.node_names[next(iter(gm.graph.find_nodes(op="placeholder"))).name]

    def unplace(p):
        del p.nodes[first]

    got = check_plan(_tampered(plan, unplace), gm, roles_, semantics=False)
    assert first == "param:up.weight"
    assert [str(v) for v in got.violations] == ["[structure] param:up.weight: the plan does not place this node",
                                                "[tables] params: the plan lists 5 parameters, the graph has 4"]


def _cast_plan(model_dtype, param_dtype):
    with torch.device("meta"):
        model = Uneven().to(model_dtype)
    x, target = _inputs()
    with fake_world(MESH) as mesh:
        plan = Planner.trace(model, mesh, (x.to(model_dtype), target), F.cross_entropy, param_dtype=param_dtype).plan(mesh)
    gm, roles_ = traced_graph(plan)
    return plan, gm, roles_


def test_a_move_across_a_cast_of_equal_width_is_no_mixed_precision_move():
    """bf16 parameters cast to fp16 neither narrow nor widen: a placement may change across them
    (only a narrowing parameter cast, or a widening cast into a graph output, locks one)."""
    plan, gm, roles_ = _cast_plan(torch.bfloat16, torch.float16)
    casts = [n for n in gm.graph.nodes if plan_check._cast(n) == (torch.bfloat16, torch.float16)]
    assert casts, "the parameters are cast bf16 -> fp16"
    key = next(plan.node_names[n.name] for n in casts if plan.nodes[plan.node_names[n.name]].ins[0] != {"dp": "S(1)", "tp": "R"})

    def moved(p):
        p.nodes[key].ins = [{"dp": "S(1)", "tp": "R"}]

    assert "grad_reduce_dtype" not in check_plan(_tampered(plan, moved), gm, roles_, semantics=False).groups()


def test_a_narrowing_cast_into_a_graph_output_is_no_widening_gradient_cast():
    """fp32 -> bf16 straight into a graph output (a gradient of a bf16 model's fp32 master
    parameter would be one) does not lock its placement: it narrows, and its input is no parameter."""
    plan, gm, roles_ = _cast_plan(torch.float32, torch.bfloat16)
    narrowing_out = [n for n in gm.graph.nodes if (plan_check._cast(n) or (None, None))[0] == torch.bfloat16
                     and any(u.op == "output" for u in n.users)]
    widening = {plan.node_names[n.name] for n in narrowing_out}
    assert widening, "bf16 gradients are widened into the outputs"
    gm2 = copy_graph_module(gm)
    # the same graph with every such cast made narrowing (fp32 -> bf16 into the output)
    for n in gm2.graph.nodes:
        if plan.node_names.get(n.name) in widening:
            src = plan_check.tensor_inputs(n)[0]
            src.meta[M.VAL] = src.meta[M.VAL].to(torch.float32)
            n.meta[M.VAL] = n.meta[M.VAL].to(torch.bfloat16)
    key = sorted(widening)[0]

    def reduced(p):
        p.nodes[key].ins = [{"dp": "P(sum)", "tp": "R"}]

    assert "grad_reduce_dtype" in check_plan(_tampered(plan, reduced), gm, roles_, semantics=False).groups()
    assert "grad_reduce_dtype" not in check_plan(_tampered(plan, reduced), gm2, roles_, semantics=False).groups()


class _SelfCast(nn.Module):
    """A parameter read in fp32 and, through the alias its two reads get, cast to bf16."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 12))
        self.head = nn.Linear(12, 6, bias=False)

    def forward(self, x):
        a = F.linear(x, self.w)
        return self.head(F.linear(a.to(torch.bfloat16), self.w.to(torch.bfloat16)).float())


def test_a_move_between_a_parameter_and_the_alias_its_cast_reads_is_named():
    with torch.device("meta"):
        model = _SelfCast()
    with fake_world(MESH) as mesh:
        plan = Planner.trace(model, mesh, _inputs(), F.cross_entropy).plan(mesh)
    gm, roles_ = traced_graph(plan)
    (cast,) = [n for n in gm.graph.nodes if plan_check._cast(n) is not None
               and plan_check.tensor_inputs(n)[0] is not plan_check._through_alias(plan_check.tensor_inputs(n)[0])]
    alias = plan.node_names[plan_check.tensor_inputs(cast)[0].name]
    assert alias == "param:w/alias"
    assert "grad_reduce_dtype" not in check_plan(plan, gm, roles_, semantics=False).groups()
    other = {"dp": "R", "tp": "S(0)"}
    assert plan.nodes["param:w"].out != [other]

    def moved(p):
        p.nodes[alias].ins = [other]

    got = [v for v in check_plan(_tampered(plan, moved), gm, roles_, semantics=False).violations if v.group == "grad_reduce_dtype"]
    assert [v.where for v in got] == [alias]
    assert got[0].detail.endswith("-> dp:R tp:S(0) across a mixed-precision cast")
