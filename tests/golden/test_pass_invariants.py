"""What every pipeline stage must keep, as tests (a golden diff can be waved through; these cannot).

On the golden scenarios' pipeline runs (built once per xdist worker and shared with the golden
tests: ``shared_pipeline_runs`` and one xdist group per scenario) and on a model that is not
LLaMA (``TwoNormMLP``, tests/conftest.py, fsdp over dp=8, buckets small enough that both bucketing passes act):

* collectives: each stage's conservation law holds (``verify.stages.registry.CONSERVATION``: no
  collective lost or duplicated; fusion re-groups chains, bucketing merges);
* saved values: the second compile saves exactly what the first partition saved, per op,
  multi-output getitem index, shape and dtype (LayerNorm's mean and rstd among them);
* values: every stage computes bitwise what its input computes, on every rank of the mesh
  simulated in this process (``verify.commands.bisect`` over ``verify.parity.differential``);
* the pass fired: every pass stage reports how much it changed (``StageResult.acted``), and
  it is non-zero where the pass must act.
"""

from __future__ import annotations

import pytest

from autoparallel import patches
from autoparallel.fx_utils import copy_graph_module
from autoparallel.mesh import fake_world
from autoparallel.passes.collective import CollectivePassesConfig, bucket_fw_bw
from autoparallel.pipeline import JOINT, STAGE_NAMES, STAGES
from verify.commands.bisect import bisect_run
from verify.goldens.catalog import GOLDEN_SCENARIOS, golden_run
from verify.graphs.generators import GraphSpec, OpSpec, build_synthetic, mesh_groups
from verify.graphs.invariants import check_saved_equal, multi_output_saves
from verify.stages.registry import CONSERVATION, check_conservation

MLP_MESH = "dp=8"  # tests/conftest.py's mlp_pipeline_run


def _grouped(sids):
    return [pytest.param(sid, marks=pytest.mark.xdist_group(sid)) for sid in sorted(sids)]


def _conservation_problems(run) -> list[str]:
    return [
        p
        for r in [*run.results, *run.alternatives]
        if r.input is not None
        for p in check_conservation(r.name, run.stage(r.input).graphs, r.graphs)
    ]


# --- collectives ------------------------------------------------------------------------------------


def test_every_graph_stage_has_a_conservation_law():
    assert set(CONSERVATION) == set(STAGE_NAMES) - {JOINT}


@pytest.mark.parametrize("sid", _grouped(GOLDEN_SCENARIOS))
def test_every_stage_keeps_its_collectives(sid, shared_pipeline_runs):
    assert _conservation_problems(golden_run(sid)) == []


def test_non_llama_stages_keep_their_collectives(mlp_pipeline_run):
    assert _conservation_problems(mlp_pipeline_run) == []


# --- saved values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", _grouped(GOLDEN_SCENARIOS))
def test_second_compile_saves_what_the_first_saved(sid, shared_pipeline_runs):
    run = golden_run(sid)
    assert check_saved_equal(run.stage("first_partition").graphs, run.stage("second_compile").graphs) == []


def test_layernorm_mean_and_rstd_saved_in_both_compiles(mlp_pipeline_run):
    first = multi_output_saves(*mlp_pipeline_run.stage("first_partition").graphs)
    second = multi_output_saves(*mlp_pipeline_run.stage("second_compile").graphs)
    ln = "aten.native_layer_norm.default"
    assert first[f"{ln}[1]"] == first[f"{ln}[2]"] == 2, first  # mean, rstd of both LayerNorms
    assert second == first
    assert check_saved_equal(mlp_pipeline_run.stage("first_partition").graphs, mlp_pipeline_run.stage("second_compile").graphs) == []


# --- values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", _grouped(GOLDEN_SCENARIOS))
def test_every_stage_computes_what_its_input_computes(sid, shared_pipeline_runs):
    result = bisect_run(golden_run(sid), GOLDEN_SCENARIOS[sid].mesh_spec)
    assert result.first is None, result.summary()
    ran = [c for c in result.checks if not c.same_code]
    assert ran and all(c.report.diffs for c in ran)


def test_every_non_llama_stage_computes_what_its_input_computes(mlp_pipeline_run):
    result = bisect_run(mlp_pipeline_run, MLP_MESH)
    assert result.first is None, result.summary()
    assert [c.name for c in result.checks] == list(STAGE_NAMES[1:])


# --- the pass fired ---------------------------------------------------------------------------------


def test_every_pass_stage_reports_what_it_did():
    counted = {s.name for s in STAGES if s.acted is not None}
    assert counted == set(STAGE_NAMES) - {JOINT}


def _chain_graphs(mesh):
    """A forward and a backward with one dp -> tp all-gather chain each (no model has one)."""
    spec = GraphSpec(8, 2, (OpSpec("param_ag_chain", variant=1, rows=2), OpSpec("grad_rs", a=0, b=1)))
    return build_synthetic(spec, mesh_groups(mesh)).gm, build_synthetic(spec, mesh_groups(mesh)).gm


@pytest.mark.parametrize("stage", [s for s in STAGE_NAMES if s not in (JOINT, "fuse_chained_allgathers")])
def test_every_pass_fires_where_it_must_act(stage, mlp_pipeline_run):
    assert mlp_pipeline_run.stage(stage).acted > 0, f"{stage} did nothing on the LayerNorm MLP"


def test_fusion_fires_on_chains_and_reports_zero_when_it_does_nothing():
    with fake_world("dp=4,tp=2") as mesh:
        fw, bw = _chain_graphs(mesh)
        only = ("fuse_chained_allgathers",)
        *_, metrics = bucket_fw_bw(copy_graph_module(fw), copy_graph_module(bw), CollectivePassesConfig(), only=only)
        assert metrics.acted == 2
        with patches.disabled("fuse_chained_allgathers"):
            *_, metrics = bucket_fw_bw(fw, bw, CollectivePassesConfig(), only=only)
        assert metrics.acted == 0


def test_disabled_pre_overlap_bucketing_reports_zero(mlp_pipeline_run):
    fw, bw = (copy_graph_module(g) for g in mlp_pipeline_run.stage("second_compile").graphs)
    with fake_world(MLP_MESH), patches.disabled("pre_overlap_bucketing"):
        *_, metrics = bucket_fw_bw(fw, bw, CollectivePassesConfig(), only=("pre_overlap_bucketing",))
    assert metrics.acted == 0
