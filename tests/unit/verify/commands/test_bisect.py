"""verify.commands.bisect, scored on deliberately broken passes: it must name the broken pass every time.

Each bug is planted inside one pass (later passes then run on its broken output, as in the
pipeline) on the LayerNorm MLP's pipeline run (fsdp over dp=8: 8 simulated ranks) or, for
chained all-gather fusion, which no model here produces chains for, on a generated graph with
chains over dp=8 x tp=2 (16 simulated ranks):

* ``cleanup`` flips an op (the first ``add`` becomes ``sub``): the full pipeline runs on it;
* ``second_compile`` hands the backward LayerNorm's rstd where it reads the mean (two saved
  values of one shape swapped: an off-by-one in the saved list);
* ``pre_overlap_bucketing`` splits a merged all-gather at the wrong offset (two equal-sized
  members read each other's slice);
* ``fuse_chained_allgathers`` reshuffles a column-major chain in the wrong rank order (the
  outer and inner group sizes swapped).

Each answer must name the pass, its first differing output and node, with both values. The
command line is checked on the same runs (its pipeline swapped for them).
"""

from __future__ import annotations

import dataclasses
import json
import operator

import pytest
import torch

from autoparallel import meta as M
from autoparallel import partition, roles
from autoparallel.fx_utils import ALL_GATHER_OUT, WAIT, copy_graph_module
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.passes import fuse_chained_allgathers as fusion
from autoparallel.passes.collective import (
    COLLECTIVE_PASS_NAMES,
    COLLECTIVE_PASSES,
    GraphPassMetrics,
    bucket_fw_bw,
)
from autoparallel.passes.pre_overlap_bucketing import tag_collectives_for_bucketing
from autoparallel.pipeline import run_pipeline
from verify import zoo
from verify.__main__ import main as verify_main
from verify.check import check_model
from verify.commands import bisect as B
from verify.graphs.canon import own_scope
from verify.graphs.generators import GraphSpec, OpSpec, build_synthetic, mesh_groups
from verify.stages.pipeline_run import pipeline_options

aten = torch.ops.aten
MESH = "dp=8"  # tests/conftest.py's mlp_pipeline_run
CONFIG = pipeline_options(0.001).collective


# --- planting bugs --------------------------------------------------------------------------------


def _graphs_of(graphs):
    return graphs if isinstance(graphs, tuple) else (graphs,)


def _copy(graphs):
    return tuple(copy_graph_module(g) for g in graphs) if isinstance(graphs, tuple) else copy_graph_module(graphs)


def broken_steps(run, stage: str, plant):
    """The run's steps with ``plant`` applied to ``stage``'s output (a copy); the collective passes
    after it run again on the broken graphs, as the pipeline would run them."""
    steps, broken = [], None
    for name, before, after in B.run_steps(run):
        if broken is not None:
            before = broken
            with fake_world(MESH):
                fw, bw, _ = bucket_fw_bw(*_copy(before), CONFIG, only=(name,))
            after = broken = (fw, bw)
        elif name == stage:
            assert all(later in COLLECTIVE_PASS_NAMES for later in _after(run, stage)), "only collective passes rerun"
            after = broken = _copy(after)
            where = plant(after)
            assert where, f"the bug planted in {stage} found no place to act"
        steps.append((name, before, after))
    assert broken is not None, f"no stage {stage!r} in the run"
    return steps


def _after(run, stage: str) -> list[str]:
    return run.names[run.names.index(stage) + 1 :]


def flip_first_add(gm) -> str:
    node = next(n for n in gm.graph.nodes if n.target is aten.add.Tensor)
    node.target = aten.sub.Tensor
    gm.recompile()
    return node.name


def swap_layernorm_mean_and_rstd(pair) -> str:
    """In the backward, the placeholders of one LayerNorm's mean (getitem 1) and rstd (getitem 2)
    swap roles: the backward reads each where the other belongs."""
    fw, bw = pair
    saved = {n.name: n for n in fw.graph.nodes}
    by_parent: dict = {}
    for ph in bw.graph.find_nodes(op="placeholder"):
        src = saved.get(ph.name)
        if src is not None and src.target is operator.getitem and src.args[0].target is aten.native_layer_norm.default:
            by_parent.setdefault(src.args[0], {})[src.args[1]] = ph
    mean, rstd = next(iter(by_parent.values()))[1], next(iter(by_parent.values()))[2]
    mean.meta[M.ROLE], rstd.meta[M.ROLE] = rstd.meta[M.ROLE], mean.meta[M.ROLE]
    return f"{mean.name}<->{rstd.name}"


def split_bucket_at_wrong_offset(pair) -> str:
    """In the forward, a merged all-gather's two equal-sized neighbours read each other's slice."""
    fw, _ = pair
    for split in fw.graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
        src = split.args[0]
        while src.op == "call_function" and src.target in (aten.view.default, aten.reshape.default):
            src = src.args[0]
        if not (src.target is WAIT and src.args[0].target is ALL_GATHER_OUT):
            continue
        sizes = list(split.args[1])
        getters = {u.args[1]: u for u in split.users if u.target is operator.getitem}
        for i in range(len(sizes) - 1):
            if sizes[i] == sizes[i + 1] and {i, i + 1} <= set(getters):
                getters[i].args = (split, i + 1)
                getters[i + 1].args = (split, i)
                fw.recompile()
                return f"{getters[i].name}<->{getters[i + 1].name}"
    return ""


@pytest.fixture(scope="module")
def flipped_run(two_norm_mlp):
    """The whole pipeline with the flipped op planted in cleanup (patched only while it runs)."""
    real = partition.cleanup_graph

    def buggy_cleanup(gm):
        report = real(gm)
        flip_first_add(gm)
        return report

    model, loss, batch = two_norm_mlp
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(partition, "cleanup_graph", buggy_cleanup)
        return run_pipeline(model, loss, batch, ParallelPlan.fsdp(), MESH, pipeline_options(0.001, alternatives=False))


def _assert_named(result, stage: str, graph: str | None = None):
    first = result.first
    assert first is not None and first.name == stage, result.summary()
    out = first.first_output()
    assert out is not None and "first at" in out.note and " vs " in out.note, out
    assert first.first_node is not None, result.summary()
    assert " vs " in first.first_node.note
    if graph is not None:
        assert first.first_node.graph == graph, first.first_node
    assert all(c.equal for c in result.checks[: result.checks.index(first)]), "an earlier pass was blamed"
    return first


# --- the scoring ------------------------------------------------------------------------------------


def test_names_cleanup_for_a_flipped_op(flipped_run):
    first = _assert_named(B.bisect_run(flipped_run, MESH), "cleanup")
    assert first.first_node.op == "aten.add -> aten.sub"


def test_names_the_second_compile_for_swapped_saved_values(mlp_pipeline_run):
    steps = broken_steps(mlp_pipeline_run, "second_compile", swap_layernorm_mean_and_rstd)
    _assert_named(B.bisect_steps(steps, MESH), "second_compile", graph="bw")


def test_names_pre_overlap_bucketing_for_a_wrong_split_offset(mlp_pipeline_run):
    steps = broken_steps(mlp_pipeline_run, "pre_overlap_bucketing", split_bucket_at_wrong_offset)
    _assert_named(B.bisect_steps(steps, MESH), "pre_overlap_bucketing", graph="fw")


# Chains gathering over dp first (column-major: fusion must reshuffle), one through views.
CHAINS = GraphSpec(16, 2, (
    OpSpec("param_ag_chain", variant=0, rows=2), OpSpec("param_ag_chain", variant=2, rows=1),
    OpSpec("param_ag", a=0, rows=4), OpSpec("grad_rs", a=0, b=1), OpSpec("grad_rs", a=1, b=2),
))


def test_names_fusion_for_a_reshuffle_in_the_wrong_rank_order(monkeypatch):
    real = fusion._match

    def swapped_sizes(*args, **kwargs):
        chain = real(*args, **kwargs)
        if chain is not None and chain.column_major:
            chain = dataclasses.replace(chain, sizes=chain.sizes[::-1])  # (outer, inner) mixed up
        return chain

    monkeypatch.setattr(fusion, "_match", swapped_sizes)
    with fake_world("dp=8,tp=2") as mesh:
        graph = build_synthetic(CHAINS, mesh_groups(mesh)).gm
        tag_collectives_for_bucketing(graph)
        steps = []
        for p in COLLECTIVE_PASSES:
            after = p.run(copy_graph_module(graph), CONFIG, GraphPassMetrics(before={}))
            steps.append((p.name, graph, after))
            graph = after
    first = _assert_named(B.bisect_steps(steps, "dp=8,tp=2"), "fuse_chained_allgathers")
    assert B.bisect_steps(steps, "dp=8,tp=2").ranks == 16 and first.first_output().name.startswith(roles.LOSS)


def test_two_configurations_differ_first_where_the_bug_is(mlp_pipeline_run, flipped_run):
    result = B.bisect_runs(mlp_pipeline_run, flipped_run, MESH, a="clean", b="flipped")
    assert result.mode == B.TWO_RUNS
    _assert_named(result, "cleanup")
    same = B.bisect_runs(mlp_pipeline_run, mlp_pipeline_run, MESH)
    assert same.first is None and all(c.same_code for c in same.checks)


def test_a_disabled_pass_changes_graphs_but_not_values(mlp_pipeline_run):
    """A: pre-overlap bucketing off (its stage hands on the second compile's graphs; topo-span
    bucketing runs on those); B: as configured. Other graphs from that stage on, same values."""
    sc = mlp_pipeline_run.stage("second_compile").graphs
    with fake_world(MESH):
        topo_alone = bucket_fw_bw(*_copy(sc), CONFIG, only=("topo_span_bucketing",))[:2]
    a = {name: after for name, _, after in B.run_steps(mlp_pipeline_run)}
    a.update(pre_overlap_bucketing=sc, topo_span_bucketing=topo_alone)
    steps = [(name, a[name], after) for name, _, after in B.run_steps(mlp_pipeline_run)]
    result = B.bisect_steps(steps, MESH, mode=B.TWO_RUNS, a="A", b="B")
    assert result.first is None, result.summary()
    assert [c.name for c in result.checks if not c.same_code] == ["pre_overlap_bucketing", "topo_span_bucketing"]


# --- the command line -------------------------------------------------------------------------------


@pytest.fixture
def runs_for_the_command(monkeypatch):
    """``verify bisect``'s pipeline swapped for prepared runs (handed out in call order)."""
    queue = []
    monkeypatch.setattr(B, "_pipeline", lambda scenario, cap: queue.pop(0))
    return queue


def test_command_names_the_broken_pass_with_progress_on_stderr(runs_for_the_command, flipped_run, capsys):
    runs_for_the_command.append(flipped_run)
    assert verify_main(["bisect", "--json"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["first"] == "cleanup" and report["ranks"] == 8
    assert report["stages"][0]["first_node"]["op"] == "aten.add -> aten.sub"
    assert "[bisect] checking every pass against its input on 8 simulated ranks" in err
    assert "[bisect] cleanup: DIFFER" in err


def test_command_compares_a_disabled_patch_against_as_configured(runs_for_the_command, mlp_pipeline_run,
                                                                   flipped_run, capsys):
    runs_for_the_command.extend([mlp_pipeline_run, flipped_run])  # B first, then A (disabled)
    assert verify_main(["bisect", "--disable", "pre_overlap_bucketing"]) == 1
    out, err = capsys.readouterr()
    assert "configuration A vs B: disabled pre_overlap_bucketing vs as configured" in out
    assert out.strip().endswith("first stage that differs: cleanup")
    assert "running it again with disabled pre_overlap_bucketing" in err
    runs_for_the_command.extend([mlp_pipeline_run, mlp_pipeline_run])
    assert verify_main(["bisect", "--disable", "fuse_chained_allgathers,topo_span_bucketing"]) == 0
    assert "A and B compute the same values at every stage" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--disable", "nope"], "argument --disable: takes registered patch names"),
    (["--disable", ","], "argument --disable: takes registered patch names"),
    (["--seed", "-1"], "argument --seed: takes an int >= 0, got '-1'"),
    (["--bucket-cap-mb", "0"], "argument --bucket-cap-mb: takes a positive float, got '0'"),
    (["--mesh", "dp"], "argument --mesh: bad mesh 'dp'"),
    (["--param-dtype", "fp8"], "argument --param-dtype: unknown dtype 'fp8'"),
])
def test_bad_flags_are_named_where_parsed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        verify_main(["bisect", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_flags_that_do_not_fit_together_are_one_line(capsys):
    # (dp=3 fits since FSDP pads uneven shards; TP does not pad: 64 rows do not split 3 ways)
    assert verify_main(["bisect", "--plan", "fsdp_tp", "--mesh", "dp=2,tp=3"]) == 2
    assert capsys.readouterr().err.startswith("error: --plan fsdp_tp --mesh dp=2,tp=3 --preset tiny:")


def test_check_model_explains_a_planted_node(monkeypatch):
    """A stage corrupted on purpose (fsdp_tagging turns block 1's GELU into a ReLU): check_model's
    verdict names, by itself, the pass, the node, its op (both ops: a flipped one), its module path
    and the size of the difference, for that stage and every later stage; earlier stages stay
    bitwise and get no explanation."""
    real, planted = partition.mark_fsdp_all_gather_recomputation, []

    def tagging(graph, *args):
        report = real(graph, *args)
        node = next(n for n in graph.nodes if n.target is aten.gelu.default and own_scope(n) == "blocks.1")
        node.target, node.args, node.kwargs = aten.relu.default, node.args[:1], {}
        planted.append(node.name)
        return report

    monkeypatch.setattr(partition, "mark_fsdp_all_gather_recomputation", tagging)
    result = check_model(zoo.ln_mlp, plan="fsdp", mesh="dp=2", steps=1)
    assert [s for s, rep in result.parity.items() if rep.bitwise] == ["joint", "cleanup"]
    assert set(result.explanations) == {"fsdp_tagging", "first_partition", "second_compile", "collective_passes"}
    why = result.explanations["fsdp_tagging"]
    assert (f"pass fsdp_tagging computes other values than its input; first differing node: node '{planted[0]}' "
            "(aten.gelu -> aten.relu) in module 'blocks.1' on rank 0, max |diff| ") in why, why
    assert all(result.explanations[s] == why for s in result.explanations)
    assert sum(f"why: {why}" in f for f in result.failures()) == 4
