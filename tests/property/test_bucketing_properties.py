"""Properties of the bucketing passes on generated FSDP/TP-style FX graphs (verify.graphs.generators).

* planned buckets respect the byte cap and the span cap, hold no ancestor/descendant pair, and
  contract to an acyclic graph all together (checked by independent brute-force code);
* after merging (topo-span buckets with PyTorch's merge functions, or the pre-overlap pass) the
  graph lints and every original collective's consumers read, through views and splits only,
  from one merged collective of the same kind and group that depends on the original's input,
  one merged collective per bucket;
* on a real gloo world, a few generated graphs compute bitwise the same values bucketed.

The given-decorated bodies run inside the test, within a fake world whose group names the graphs
use (a world may not outlive a test).
"""

from __future__ import annotations

import operator
from collections import deque

import pytest
import torch
import torch._inductor.fx_passes.bucketing as B
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import fx
from torch._inductor.pattern_matcher import stable_topological_sort

from autoparallel import meta as M
from autoparallel.fx_utils import (
    ALL_GATHER,
    ALL_GATHER_OUT,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    collective_bytes,
    group_of,
)
from autoparallel.mesh import build_mesh, fake_world
from autoparallel.passes.pre_overlap_bucketing import (
    PreOverlapConfig,
    bucket_tagged_collectives,
    collective_counts,
    tag_collectives_for_bucketing,
)
from autoparallel.passes.topo_span_bucketing import greedy_bucket_collective_by_mb
from verify.graphs.generators import (
    GraphSpec,
    OpSpec,
    build_synthetic,
    example_inputs,
    graph_specs,
    mesh_groups,
    synthetic_graphs,
)
from verify.parity.ordered_collectives import run_parity_world

aten = torch.ops.aten
MESH = "dp=4,tp=2"
KIND_TARGETS = {
    "all_gather": ALL_GATHER,
    "reduce_scatter": REDUCE_SCATTER,
    "all_reduce": ALL_REDUCE,
}
MERGE = {
    "all_gather": B.merge_all_gather_bucket,
    "reduce_scatter": B.merge_reduce_scatter_bucket,
    "all_reduce": B.merge_all_reduce_bucket,
}
# Hypothesis draws the first element most: start with the cap that merges everything.
caps_mb = st.sampled_from((2**20, 8192, 2048, 512, 128)).map(lambda b: b / 2**20)
spans = st.none() | st.integers(0, 150)
# Which collective kinds to bucket and merge, in order (merging is the expensive part).
kinds = st.sampled_from(sorted(KIND_TARGETS)).map(lambda k: [k]) | st.permutations(
    sorted(KIND_TARGETS)
)


def _key(n: fx.Node):
    return (group_of(n), n.args[1] if n.target is not ALL_GATHER else None, n.meta[M.VAL].dtype)


def _greedy(gm, kind, cap_mb, span):
    target = KIND_TARGETS[kind]
    return greedy_bucket_collective_by_mb(
        gm,
        lambda _i: cap_mb,
        lambda n: n.op == "call_function" and n.target is target,
        _key,
        max_topo_span=span,
    )


# --- independent checkers -------------------------------------------------------------------------


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _contracted_is_acyclic(graph: fx.Graph, buckets) -> bool:
    """Whether the graph stays a DAG with every bucket contracted into one node."""
    rep = {n: ("bucket", i) for i, b in enumerate(buckets) for n in b}

    def q(n):
        return rep.get(n, n)

    succ: dict = {}
    indeg: dict = {}
    for node in graph.nodes:
        indeg.setdefault(q(node), 0)
        for inp in node.all_input_nodes:
            a, b = q(inp), q(node)
            if a != b and b not in succ.setdefault(a, set()):
                succ[a].add(b)
                indeg[b] = indeg.get(b, 0) + 1
    ready = deque(k for k, d in indeg.items() if d == 0)
    done = 0
    while ready:
        k = ready.popleft()
        done += 1
        for s in succ.get(k, ()):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return done == len(indeg)


_SELECT = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.clone.default,
    aten.split_with_sizes.default,
    aten.split.Tensor,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.view.dtype,
    operator.getitem,
    torch.ops.prims.convert_element_type.default,
}
_MERGED = {
    "all_gather": (ALL_GATHER, ALL_GATHER_OUT),
    "reduce_scatter": (REDUCE_SCATTER,),
    "all_reduce": (ALL_REDUCE,),
}


def _source_collective(v: fx.Node) -> fx.Node | None:
    """Walk back from a consumer's argument through views/splits to the collective it reads."""
    while v.op == "call_function" and v.target in _SELECT:
        v = v.args[0]
    if v.op == "call_function" and v.target is WAIT:
        return v.args[0]
    return None


def _extended_ancestors(node: fx.Node) -> set[fx.Node]:
    """Ancestors, also through in-place copies into an ancestor (the merged all-gather copies its
    inputs into a slice of its output buffer)."""
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
        for u in n.users:
            if u.target in (aten.copy_.default, aten._foreach_copy_.default):
                stack.extend(u.all_input_nodes)
    return seen


class _Replacements:
    """Which node took over each node a merge replaced, from FX's replace hook (old node -> the
    new node's name). A collective's recorded input can be the wait of another collective that
    a later merge erases (a dp all-reduce feeding a tp all-reduce): the data then lives in the
    node that replaced the wait, and the record must be read through it."""

    def __init__(self) -> None:
        self.by: dict[fx.Node, fx.Node] = {}

    def __call__(self, old: fx.Node, new: str, user: fx.Node) -> None:
        # Called before ``user`` is rewired, while the new node is in the graph.
        self.by[old] = next(n for n in old.graph.nodes if n.name == new)

    def resolve(self, node: fx.Node, alive: set[fx.Node]) -> fx.Node | None:
        """The live node that holds ``node``'s data now (None if ``node`` was erased unreplaced,
        e.g. a cast folded into a merge)."""
        seen = set()
        while node not in alive:
            if node in seen or node not in self.by:
                return None
            seen.add(node)
            node = self.by[node]
        return node


def _record(coll: fx.Node, kind: str) -> dict:
    wait = next(iter(coll.users))
    src = coll.args[0]
    sources = {src}
    if src.op == "call_function" and src.target in (
        torch.ops.prims.convert_element_type.default,
        aten._to_copy.default,
    ):
        sources.add(src.args[0])  # the merge folds a single-use cast into the bucket
    uses = [(u, i) for u in wait.users for i, a in enumerate(u.args) if a is wait]
    val = wait.meta[M.VAL]
    return {
        "kind": kind,
        "group": group_of(coll),
        "sources": sources,
        "uses": uses,
        "shape": tuple(val.shape),
        "dtype": val.dtype,
        "bytes": collective_bytes(coll),
    }


def _check_consumers(
    graph: fx.Graph, records: dict[fx.Node, dict], replaced: _Replacements
) -> dict[fx.Node, list[fx.Node]]:
    """Each original collective's consumers read from one collective of the same kind and group
    that depends on its input (or on what replaced it); returns {collective read: originals
    mapped to it}."""
    alive = set(graph.nodes)
    mapping: dict[fx.Node, list[fx.Node]] = {}
    for coll, rec in records.items():
        targets = set()
        for user, i in rec["uses"]:
            if user not in alive:
                continue  # a cast folded into another bucket's merge
            v = user.args[i]
            assert (tuple(v.meta[M.VAL].shape), v.meta[M.VAL].dtype) == (
                rec["shape"],
                rec["dtype"],
            ), f"{user.name} reads {v.name} of another shape/dtype than {coll.name}'s result"
            src = _source_collective(v)
            assert src is not None, (
                f"{user.name} no longer reads a collective result ({v.format_node()})"
            )
            assert src.target in _MERGED[rec["kind"]] and group_of(src) == rec["group"], (
                src.format_node()
            )
            sources = {r for n in rec["sources"] if (r := replaced.resolve(n, alive)) is not None}
            assert sources, f"the input of {coll.name} was erased and nothing replaced it"
            assert sources & _extended_ancestors(src), (
                f"{src.name} does not depend on {coll.name}'s input ({sorted_names(sources)})"
            )
            targets.add(src)
        assert len(targets) <= 1, (
            f"consumers of {coll.name} read from several collectives {targets}"
        )
        for t in targets:
            mapping.setdefault(t, []).append(coll)
    return mapping


# --- properties ---------------------------------------------------------------------------------


def test_planned_buckets_respect_caps_and_dependencies():
    with fake_world(MESH) as mesh:

        @given(synthetic_graphs(mesh, min_ops=4), caps_mb, spans)
        def prop(sg, cap_mb, span):
            gm = sg.gm
            ranks = {n: i for i, n in enumerate(gm.graph.nodes)}
            for kind in KIND_TARGETS:
                buckets = _greedy(gm, kind, cap_mb, span)
                seen = set()
                for bucket in buckets:
                    assert len(bucket) >= 2 and not (set(bucket) & seen)
                    seen |= set(bucket)
                    assert sum(collective_bytes(n) for n in bucket) <= int(cap_mb * 2**20)
                    if span is not None:
                        assert max(ranks[n] for n in bucket) - min(ranks[n] for n in bucket) <= span
                    assert len({_key(n) for n in bucket}) == 1
                    for n in bucket:
                        assert not (_ancestors(n) & set(bucket)), f"{n.name} depends on its bucket"
                assert _contracted_is_acyclic(gm.graph, buckets), (
                    "merging these buckets closes a cycle"
                )
                m = buckets.metrics
                assert (m.num_buckets, m.num_bucketed) == (len(buckets), len(seen))

        prop()


def test_merging_keeps_graph_valid_and_consumers_reading_the_same_data():
    """Either pass, on the same generated graphs: topo-span buckets merged with PyTorch's merge
    functions (a random subset/order of kinds), or the whole pre-overlap pass."""
    with fake_world(MESH) as mesh:

        @given(synthetic_graphs(mesh, min_ops=4, max_ops=14), caps_mb, spans, kinds, st.booleans())
        def prop(sg, cap_mb, span, kind_list, pre_overlap):
            if pre_overlap:
                _check_pre_overlap_pass(sg.gm, cap_mb)
            else:
                _check_topo_span_merges(sg.gm, cap_mb, span, kind_list)

        prop()


def _check_topo_span_merges(gm, cap_mb, span, kind_list):
    for kind in kind_list:
        buckets = _greedy(gm, kind, cap_mb, span)
        records = {c: _record(c, kind) for b in buckets for c in b}
        replaced = _Replacements()
        with gm._set_replace_hook(replaced):
            for bucket in buckets:
                MERGE[kind](gm.graph, bucket)
        stable_topological_sort(gm.graph)
        gm.graph.lint()
        mapping = _check_consumers(gm.graph, records, replaced)
        # One merged collective per bucket (members whose result nobody reads are exempt).
        read = {c for cs in mapping.values() for c in cs}
        expected = [set(b) & read for b in buckets]
        got = sorted(map(set, mapping.values()), key=sorted_names)
        assert got == sorted((e for e in expected if e), key=sorted_names)
    gm.recompile()


def _check_pre_overlap_pass(gm, cap_mb):
    tag_collectives_for_bucketing(gm)
    records = {
        n: _record(n, kind)
        for kind, t in KIND_TARGETS.items()
        for n in gm.graph.nodes
        if n.target is t and M.bucket_tag(n) is not None
    }
    before = collective_counts(gm)
    replaced = _Replacements()
    with gm._set_replace_hook(replaced):
        res = bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=cap_mb))
    gm.graph.lint()
    mapping = _check_consumers(gm.graph, records, replaced)
    for originals in mapping.values():
        if len(originals) > 1:  # a merged bucket (one collective alone may exceed the cap)
            assert sum(records[o]["bytes"] for o in originals) <= int(cap_mb * 2**20)
    merged = sum(m.num_bucketed - m.num_buckets for m in res.metrics.values())
    assert sum(before.values()) - sum(res.after.values()) == merged


def sorted_names(nodes):
    return sorted(n.name for n in nodes)


# dp all-reduce -> tp all-reduce, twice, every result read by compute: merging the dp bucket
# erases the waits the tp all-reduces read (the shape a random run found with
# --hypothesis-seed=217354428517753943996502434058705235289).
_CHAINED_ALL_REDUCES = GraphSpec(
    hidden=8,
    batch=2,
    ops=(
        OpSpec("act_all_reduce", a=0, label="dp"),  # x -> w0
        OpSpec("act_all_reduce", a=0, label="tp"),  # w0 -> w1
        OpSpec("act_all_reduce", a=2, label="dp"),  # x -> w2
        OpSpec("act_all_reduce", a=0, label="tp"),  # w2 -> w3
        OpSpec("binary", a=3, b=1),  # w0 + w2
        OpSpec("binary", a=3, b=1),  # w1 + w3
    ),
)


def test_oracle_follows_inputs_that_another_buckets_merge_replaced():
    with fake_world(MESH) as mesh:
        gm = build_synthetic(_CHAINED_ALL_REDUCES, mesh_groups(mesh)).gm
        buckets = _greedy(gm, "all_reduce", 1.0, None)
        assert sorted(len(b) for b in buckets) == [2, 2]
        records = {c: _record(c, "all_reduce") for b in buckets for c in b}
        replaced = _Replacements()
        with gm._set_replace_hook(replaced):
            for bucket in buckets:
                MERGE["all_reduce"](gm.graph, bucket)
        stable_topological_sort(gm.graph)
        gm.graph.lint()
        stale = [c for c, r in records.items() if not r["sources"] <= set(gm.graph.nodes)]
        assert len(stale) == 2, "the tp all-reduces' recorded inputs (dp waits) must be gone"
        mapping = _check_consumers(gm.graph, records, replaced)
        assert sorted(map(len, mapping.values())) == [2, 2], "every original is read and checked"
        # Without the replacements the record is stale: the oracle says so instead of passing.
        with pytest.raises(AssertionError, match="was erased and nothing replaced it"):
            _check_consumers(gm.graph, records, _Replacements())


def test_oracle_rejects_a_merged_collective_that_reads_the_wrong_input():
    """Negative test: a merge that feeds the bucket something else is caught."""
    with fake_world(MESH) as mesh:
        gm = build_synthetic(_CHAINED_ALL_REDUCES, mesh_groups(mesh)).gm
        buckets = _greedy(gm, "all_reduce", 1.0, None)
        records = {c: _record(c, "all_reduce") for b in buckets for c in b}
        replaced = _Replacements()
        with gm._set_replace_hook(replaced):
            for bucket in buckets:
                MERGE["all_reduce"](gm.graph, bucket)
        # As if the merge had fed the tp bucket a value computed after it (w0 + w2).
        later = [n for n in gm.graph.nodes if n.target is aten.add.Tensor][0]
        for old in list(replaced.by):
            replaced.by[old] = later
        with pytest.raises(AssertionError, match="does not depend on"):
            _check_consumers(gm.graph, records, replaced)


# --- numerics on gloo -----------------------------------------------------------------------------


def _rank_run_specs(rank, world_size, specs):
    mesh = build_mesh("dp=2")
    groups = mesh_groups(mesh)
    out = []
    for i, spec in enumerate(specs):
        results = {}
        for how in ("plain", "pre_overlap", "topo_span"):
            gm = build_synthetic(spec, groups).gm
            if how == "pre_overlap":
                tag_collectives_for_bucketing(gm)
                bucket_tagged_collectives(gm, PreOverlapConfig(bucket_cap_mb=1.0))
            elif how == "topo_span":
                for kind in KIND_TARGETS:
                    for bucket in _greedy(gm, kind, 1.0, None):
                        MERGE[kind](gm.graph, bucket)
                    stable_topological_sort(gm.graph)
                gm.recompile()
            inputs = example_inputs(gm, seed=100 * i + rank)
            with torch.no_grad():
                results[how] = ([t.clone() for t in gm(*inputs)], collective_counts(gm))
        out.append(results)
    return out


GLOO_KINDS = (
    "param_ag",
    "param_ag",
    "param_ag_padded",
    "grad_rs",
    "grad_rs_padded",
    "grad_ar",
    "unary",
    "binary",
    "view_chain",
    "act_all_reduce",
)


def test_bucketed_graphs_compute_the_same_values_on_gloo():
    """A few generated graphs, run for real on 2 ranks: bucketing changes no bit of any output."""
    merged = []

    @settings(max_examples=2)
    @given(
        st.lists(
            graph_specs(["dp"], min_ops=6, max_ops=16, kinds=GLOO_KINDS), min_size=3, max_size=3
        )
    )
    def prop(specs):
        ranks = run_parity_world(_rank_run_specs, 2, args=(specs,))
        for rank, per_spec in enumerate(ranks):
            for i, results in enumerate(per_spec):
                plain, plain_counts = results["plain"]
                for how in ("pre_overlap", "topo_span"):
                    outs, counts = results[how]
                    for j, (a, b) in enumerate(zip(plain, outs, strict=True)):
                        assert torch.equal(a, b), (
                            f"rank {rank} graph {i} output {j} differs after {how}"
                        )
                    merged.append(sum(plain_counts.values()) - sum(counts.values()))

    prop()
    assert sum(merged) > 0, "no generated graph had anything to bucket: the sample tests nothing"
