"""eliminate_alias_round_trips on hand-built graphs and plans: the five cases of seed 000, the
plan's predicted communication after rewiring, graph outputs as consumers, bad input, and a
property test on generated alias fans.

Every graph is ``x -> neg (the producer X) -> alias A -> consumers``; the plan places X and A
(strings per mesh dim, ``dp``/``tp``) and says what each consumer wants for each input.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx

from autoparallel import meta as M
from autoparallel import patches
from autoparallel.planner.alias_round_trips import PATCH, eliminate_alias_round_trips
from autoparallel.planner.costs import Move, Redistribution
from autoparallel.planner.graph import ALIAS, insert_aliases
from autoparallel.planner.solution import NodePlacement, Solution

aten = torch.ops.aten
X_PL = {"dp": "S(0)", "tp": "S(1)"}  # the producer (the residual gradient of seed 000)
A_PL = {"dp": "S(0)", "tp": "R"}  # its alias, for the matmuls
THIRD = {"dp": "R", "tp": "R"}


class Built:
    """A graph x -> neg -> alias -> consumers, its keys and its plan."""

    def __init__(self, consumers, alias_pl=A_PL, output_wants=None):
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta[M.VAL] = torch.empty(4, 4)
        self.producer = g.call_function(aten.neg.default, (x,))
        self.alias = g.call_function(ALIAS, (self.producer,))
        for n in (self.producer, self.alias):
            n.meta[M.VAL] = torch.empty(4, 4)
        self.keys = {"x": "input:0", self.producer.name: "X", self.alias.name: "X/alias"}
        nodes = {
            "input:0": NodePlacement("placeholder", [X_PL], []),
            "X": NodePlacement("aten.neg.default", [X_PL], [X_PL]),
            "X/alias": NodePlacement("alias", [alias_pl], [alias_pl]),
        }
        self.consumers = []
        outs = []
        for i, (target, wants) in enumerate(consumers):
            node = g.call_function(target, tuple(self.alias for _ in wants))
            node.meta[M.VAL] = torch.empty(4, 4)
            key = f"C{i}"
            self.keys[node.name] = key
            moves = [["all_gather(tp)"] if w != alias_pl else [] for w in wants]
            nodes[key] = NodePlacement(str(target), [wants[0]], list(wants), moves if any(moves) else [])
            self.consumers.append(node)
            outs.append(node)
        self.output_roles = [f"output:{i}" for i in range(len(outs))]
        if output_wants is not None:
            outs.append(self.alias)
            self.output_roles.append("loss")
            nodes["out:loss"] = NodePlacement("output", [output_wants], [output_wants], [["all_gather(tp)"]] if output_wants != alias_pl else [])
        for i in range(len(self.consumers)):
            nodes[f"out:output:{i}"] = NodePlacement("output", [nodes[f"C{i}"].out[0]], [nodes[f"C{i}"].out[0]])
        g.output(tuple(outs))
        self.graph = g
        self.plan = Solution(
            model="hand", mesh=[("dp", 2), ("tp", 2)], profile="h100", memory_budget_bytes=None,
            param_memory_bytes=0, objective_us=100.0, compute_us=40.0, comm_us=60.0, lp_bound_us=None,
            proven_optimal=True, params={}, inputs={}, nodes=nodes, node_names={n: k for n, k in self.keys.items()},
            comm={"all_gather": {"tp": {"count": 10, "bytes": 1000}}},
        )

    def run(self, **kw):
        return eliminate_alias_round_trips(self.graph, self.keys, self.plan, output_roles=self.output_roles, **kw)


def one_gather(val, src, dst):
    """A stand-in cost model: every move is one 64-byte tp all-gather of 5 us."""
    return Redistribution(5.0, (Move("all_gather", "tp", 64, 5.0),))


def test_consumer_wanting_the_producer_placement_is_rewired():
    # mm reads the alias at its own placement; the skip-add wants the producer's: a round trip
    b = Built([(aten.mm.default, [A_PL, A_PL]), (aten.add.Tensor, [X_PL, A_PL])])
    report = b.run(redistribute=one_gather)
    mm, add = b.consumers
    assert mm.args == (b.alias, b.alias)  # wants the alias's placement: keeps reading it
    assert add.args == (b.producer, b.alias)  # position 0 wanted X's placement
    assert report.rewired == ["C1[0] <- X/alias"] and report.removed == 1 and report.erased == []
    assert b.alias in b.graph.nodes and "X/alias" in b.plan.nodes
    # the saved move leaves the prediction: the consumer's input moves nothing now
    assert b.plan.nodes["C1"].comm == []
    assert b.plan.comm == {"all_gather": {"tp": {"count": 9, "bytes": 936}}}
    assert (b.plan.comm_us, b.plan.objective_us, report.saved_us) == (55.0, 95.0, 5.0)
    b.graph.lint()


def test_alias_without_users_is_erased_from_graph_and_plan():
    b = Built([(aten.add.Tensor, [X_PL, X_PL])], output_wants=X_PL)
    report = b.run()
    (add,) = b.consumers
    assert add.args == (b.producer, b.producer)
    assert b.graph.output_node().args[0] == (add, b.producer)  # the graph output is a consumer too
    assert report.erased == ["X/alias"] and report.removed == 3
    assert b.alias not in b.graph.nodes
    assert "X/alias" not in b.plan.nodes and "X/alias" not in b.plan.node_names.values()
    assert b.plan.nodes["out:loss"].comm == []


def test_no_op_when_the_alias_is_placed_like_its_producer():
    b = Built([(aten.add.Tensor, [X_PL, X_PL])], alias_pl=X_PL)
    before = b.graph.python_code("self").src
    report = b.run(redistribute=one_gather)
    assert (report.aliases_checked, report.round_trips, report.rewired, report.erased) == (0, [], [], [])
    assert b.graph.python_code("self").src == before and b.plan.objective_us == 100.0


def test_consumer_wanting_a_third_placement_keeps_the_alias():
    # R R is reached from the alias's S(0)R by a dp gather: rewiring would change the move, not save it
    b = Built([(aten.neg.default, [THIRD])])
    report = b.run(redistribute=one_gather)
    assert b.consumers[0].args == (b.alias,)
    assert (report.aliases_checked, report.round_trips, report.rewired) == (1, [], [])
    assert b.plan.comm == {"all_gather": {"tp": {"count": 10, "bytes": 1000}}}


def test_repeated_input_is_rewired_by_position():
    # x + x: position 0 wants the producer's placement, position 1 the alias's
    b = Built([(aten.add.Tensor, [X_PL, A_PL]), (aten.mul.Tensor, [X_PL, X_PL])])
    report = b.run()
    add, mul = b.consumers
    assert add.args == (b.producer, b.alias)
    assert mul.args == (b.producer, b.producer)
    assert report.rewired == ["C0[0] <- X/alias", "C1[0] <- X/alias", "C1[1] <- X/alias"]
    assert b.alias in b.graph.nodes  # the add's second input still reads it


def test_disabled_finds_the_round_trips_and_changes_nothing():
    b = Built([(aten.add.Tensor, [X_PL, X_PL])])
    with patches.disabled(PATCH):
        report = b.run(redistribute=one_gather)
    assert report.round_trips == ["C0[0] <- X/alias", "C0[1] <- X/alias"] and report.rewired == []
    assert b.consumers[0].args == (b.alias, b.alias) and b.plan.objective_us == 100.0


def test_an_alias_the_plan_does_not_place_is_named():
    b = Built([(aten.add.Tensor, [X_PL, X_PL])])
    del b.plan.nodes["X/alias"]
    with pytest.raises(ValueError, match=r"alias 'alias_default' \(key 'X/alias'\).*has no placement in the plan"):
        b.run()


PLACEMENTS = [X_PL, A_PL, THIRD]


@settings(max_examples=60, deadline=None)
@given(
    alias_pl=st.sampled_from(PLACEMENTS),
    wants=st.lists(st.lists(st.sampled_from(PLACEMENTS), min_size=1, max_size=3), min_size=1, max_size=4),
)
def test_property_rewired_inputs_move_nothing_and_the_rest_is_untouched(alias_pl, wants):
    """On any fan of consumers: an input is rewired exactly when it wanted the producer's placement
    (and the alias is placed elsewhere); every input still reads X's value (X or its alias); the
    alias survives exactly when an input still reads it; the graph lints."""
    b = Built([(_op(len(w)), w) for w in wants], alias_pl=alias_pl)
    report = b.run(redistribute=one_gather)
    rewired = 0
    for node, w in zip(b.consumers, wants, strict=True):
        for arg, want in zip(node.args, w, strict=True):
            expect = b.producer if (want == X_PL and alias_pl != X_PL) else b.alias
            assert arg is expect
            rewired += arg is b.producer
    assert report.removed == rewired
    still_used = any(arg is b.alias for n in b.consumers for arg in n.args)
    assert (b.alias in b.graph.nodes) == still_used
    assert ("X/alias" in b.plan.nodes) == still_used
    assert b.plan.comm_us == 60.0 - 5.0 * rewired
    b.graph.lint()


def _op(n: int):
    return {1: aten.neg.default, 2: aten.add.Tensor, 3: aten.addcmul.default}[n]


def test_insert_aliases_puts_one_alias_after_each_tensor_with_several_users():
    """The planning graph's aliases (graph.insert_aliases) that this pass later removes: one per
    placeholder or op output read twice or more, placeholders' after the last placeholder."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    once = g.call_function(aten.neg.default, (y,))
    twice = g.call_function(aten.relu.default, (once,))
    a = g.call_function(aten.mul.Tensor, (x, twice))
    b = g.call_function(aten.add.Tensor, (x, twice))
    g.output((a, b))
    for n in (x, y, once, twice, a, b):
        n.meta[M.VAL] = torch.empty(2)
    blocks = {twice.name: "layers.0"}
    assert insert_aliases(g, blocks) == 2
    aliases = [n for n in g.nodes if n.target is ALIAS]
    assert [al.args[0] for al in aliases] == [x, twice]
    assert [n.name for n in g.nodes][:3] == ["x", "y", aliases[0].name]  # after the last placeholder
    assert aliases[1].prev is twice and blocks[aliases[1].name] == "layers.0"
    assert list(x.users) == [aliases[0]] and list(twice.users) == [aliases[1]] and list(once.users) == [twice]
    assert a.args == (aliases[0], aliases[1]) and b.args == (aliases[0], aliases[1])
    assert insert_aliases(g, blocks) == 0  # an alias is read twice, but never aliased again
