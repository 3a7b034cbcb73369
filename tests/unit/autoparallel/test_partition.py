"""apply_placement, the first partition's save records, and the replay partitioner.

Pipeline tests run tiny and debug LLaMA-3 with fsdp(dp=8) and fsdp_tp(dp=4,tp=2) through
trace -> apply_placement -> torch.compile(autoparallel_backend()) on a fake world (graphs only),
through verify.stages.pipeline_run's shared runs: where the golden tests of the same worker have built a
golden scenario's whole run, that run serves (its stages up to the second compile do not depend
on the collective passes' settings). Replay-partitioner rules are checked on hand-built joint
graphs.
"""

import operator
from dataclasses import dataclass

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel import meta as M
from autoparallel.compile import SECOND_COMPILE
from autoparallel.fx_utils import ALL_GATHER
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan, ParallelProgram, split_batch
from autoparallel.partition import PLACEMENT_STEP_NAMES, STEP_FIRST_PARTITION
from autoparallel.replay_partition import ReplaySavesPartitioner
from autoparallel.pipeline import PipelineOptions, second_compile
from autoparallel.pipeline import run_pipeline as run_stages
from verify.goldens.catalog import run_group
from verify.graphs.liveness import saved_gathered_values
from verify.stages.pipeline_run import run_scenario
from verify.stages.scenario import Scenario

aten = torch.ops.aten

SCENARIOS = {
    "tiny-fsdp": Scenario(preset="tiny", plan="fsdp", mesh="dp=8"),
    "tiny-fsdp_tp": Scenario(preset="tiny", plan="fsdp_tp", mesh="dp=4,tp=2"),
    "debug-fsdp": Scenario(preset="debug", plan="fsdp", mesh="dp=8"),
    "debug-fsdp_tp": Scenario(preset="debug", plan="fsdp_tp", mesh="dp=4,tp=2"),
}


@dataclass
class Compiled:
    module: object  # ParallelModule
    first_partition: tuple  # (fw, bw)
    second_compile: tuple
    group_dims: dict


def _compile(sc: Scenario) -> Compiled:
    """The pipeline through the second compile (graphs only), on a fake world of the scenario."""
    run = run_scenario(sc, until=SECOND_COMPILE)
    return Compiled(run.module, run.stage(STEP_FIRST_PARTITION).graphs, run.stage(SECOND_COMPILE).graphs, run.group_dims)


@pytest.fixture(scope="module")
def pipelines(shared_pipeline_runs):
    """Compiled scenarios by name, built on first use and shared by the module's tests (and with
    the other tests of the scenario's xdist group: a golden scenario's whole run serves them)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _compile(SCENARIOS[name])
        return cache[name]

    return get


def _group(name: str):
    # Tests of one scenario share an xdist worker with the other tests of its pipeline run: the
    # run is built once (a golden scenario's by the golden tests, which come first in the group).
    return pytest.mark.xdist_group(run_group(SCENARIOS[name]))


@pytest.fixture(scope="module", params=[pytest.param(n, marks=_group(n)) for n in sorted(SCENARIOS)])
def stages(request, pipelines):
    return pipelines(request.param)


def _all_gathers(gm):
    return sum(1 for n in gm.graph.nodes if n.target is ALL_GATHER)


def _saved(fw, bw) -> list[fx.Node]:
    """The forward nodes whose values the backward receives (AOT names backward inputs after them)."""
    by_name = {n.name: n for n in fw.graph.nodes}
    return [
        by_name[ph.name]
        for ph in bw.graph.find_nodes(op="placeholder")
        if not str(ph.meta.get(M.ROLE, "")).startswith("tangent:")
    ]


_SAME_OP = {aten.reshape.default: aten.view.default}  # a re-traced reshape of a contiguous tensor is a view


def _identity(node: fx.Node) -> tuple:
    """Canonical identity of a saved value: what computes it, its shape and dtype."""
    if node.op == "placeholder":
        what = "input"
    elif node.target is operator.getitem:
        what = f"{node.args[0].target}[{node.args[1]}]"
    else:
        what = str(_SAME_OP.get(node.target, node.target))
    v = node.meta[M.VAL]
    return what, tuple(v.shape), v.dtype


# --- the pipeline ----------------------------------------------------------------------------------


def test_second_compile_forward_all_gather_count_equals_first(stages):
    fw1, bw1 = stages.first_partition
    fw2, bw2 = stages.second_compile
    n_params = len(stages.module.local_parameters())
    assert _all_gathers(fw1) == _all_gathers(fw2) == n_params
    assert _all_gathers(bw1) == _all_gathers(bw2)


def test_no_all_gather_output_or_wait_saved_for_backward(stages):
    for stage, (fw, bw) in (("first", stages.first_partition), ("second", stages.second_compile)):
        gathered = [n.name for n in saved_gathered_values(fw, bw)]
        assert not gathered, f"{stage} partition saves all-gathered values {gathered}"


def test_second_compile_saves_exactly_what_first_saved(stages):
    first = [_identity(n) for n in _saved(*stages.first_partition)]
    second = [_identity(n) for n in _saved(*stages.second_compile)]
    assert len(first) == len(stages.module.first_partition.saved)
    assert first == second


def test_first_partition_records_reach_the_second_compile(stages):
    fw1, _ = stages.first_partition
    fw2, _ = stages.second_compile
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    for fw in (fw1, fw2):
        parents = [n for n in fw.graph.nodes if n.target is sdpa]
        assert parents
        for n in parents:
            custom = n.meta[M.CUSTOM]
            assert custom[M.AP_MUST_SAVE] is True
            assert custom[M.AP_MUST_SAVE_GETITEM_INDICES] == [1]  # logsumexp; the output is saved via a view
    for n in fw1.graph.nodes:
        if n.target is operator.getitem:
            assert M.AP_MUST_SAVE not in (n.meta.get(M.CUSTOM) or {}), n.name
    recompute = [n for n in fw2.graph.nodes if n.meta.get(M.RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE]
    assert recompute and all(n.meta[M.AC_GRAPH_ID] == M.AP_AC_GRAPH_ID for n in recompute)


def test_placement_steps_in_order_and_their_effects(stages):
    mod = stages.module
    assert mod.steps == PLACEMENT_STEP_NAMES == ("cleanup", "fsdp_tagging", "first_partition")
    fw, bw = stages.first_partition
    # cleanup ran before the partition (no view ops left), tagging before the partition (the
    # partitioned graphs carry the tags, and the backward re-gathers).
    for gm in (fw, bw):
        assert not gm.graph.find_nodes(op="call_function", target=aten.view.default)
    assert any(n.meta.get(M.RECOMPUTE) == CheckpointPolicy.MUST_RECOMPUTE for n in fw.graph.nodes if n.target is ALL_GATHER)
    assert _all_gathers(bw) > 0


def test_stage_graphs_carry_group_dims_and_roles(stages):
    for fw, bw in (stages.first_partition, stages.second_compile):
        for gm in (fw, bw):
            assert gm.meta[M.GM_GROUP_DIMS] == stages.group_dims
        roles = [ph.meta.get(M.ROLE) for ph in fw.graph.find_nodes(op="placeholder")]
        assert roles[0] == "param:tok_embeddings.weight" and "input:0" in roles and "buffer:rope_cos" in roles
        assert fw.graph.output_node().meta[M.ROLE][0] == "loss"
        assert any(str(r).startswith("grad:") for r in bw.graph.output_node().meta[M.ROLE])


@_group("tiny-fsdp")
def test_ac_pass_in_second_compile_adds_no_save_and_no_all_gather(pipelines):
    """With the AC joint pass, stock min-cut recomputes (and re-gathers) differently; replay keeps
    the first partition's saves and all-gathers."""
    sc, first = SCENARIOS["tiny-fsdp"], pipelines("tiny-fsdp")
    with fake_world(sc.mesh_spec) as mesh:  # a fresh fake world names its groups as the first did
        local = split_batch(sc.example_inputs(), sc.plan_obj(), sc.mesh_spec, mesh.coordinate())
        out = second_compile(first.module, mesh, local, enable_ac=True)
    fw2, bw2 = out.fw, out.bw
    assert any(n.meta.get(M.RECOMPUTE) == CheckpointPolicy.PREFER_RECOMPUTE for n in fw2.graph.nodes)
    assert [_identity(n) for n in _saved(*first.first_partition)] == [_identity(n) for n in _saved(fw2, bw2)]
    assert _all_gathers(bw2) == _all_gathers(first.first_partition[1])


# --- replay partitioner rules on hand-built joint graphs ------------------------------------------


def _joint(build):
    """primals_1 [4] and tangents_1 [4]; ``build(g, x, tangent)`` returns (forward out, grad)."""
    g = fx.Graph()
    x = g.placeholder("primals_1")
    x.meta[M.VAL] = torch.randn(4)
    tan = g.placeholder("tangents_1")
    tan.meta[M.VAL] = torch.randn(4)
    fw_out, grad = build(g, x, tan)
    out = g.output((fw_out, grad))
    out.meta[M.DESC] = [None, None]
    return fx.GraphModule(torch.nn.Module(), g)


def _call(g, target, args, val, recompute=None, custom=None):
    n = g.call_function(target, args)
    n.meta[M.VAL] = val
    if recompute is not None:
        n.meta[M.RECOMPUTE] = recompute
        n.meta[M.AC_GRAPH_ID] = 1
    if custom is not None:
        n.meta[M.CUSTOM] = dict(custom)
    return n


def _replay_saved(gm) -> set[str]:
    fw, bw = ReplaySavesPartitioner()(gm, [torch.randn(4), torch.randn(4)], num_fwd_outputs=1)
    return {ph.name for ph in bw.graph.find_nodes(op="placeholder") if not ph.name.startswith("tangents")}


def _single(recompute=None, custom=None):
    def build(g, x, tan):
        a = _call(g, aten.sin.default, (x,), torch.randn(4), recompute, custom)
        a.name = "a"
        out = _call(g, aten.cos.default, (a,), torch.randn(4))
        return out, _call(g, aten.mul.Tensor, (a, tan), torch.randn(4))

    return _joint(build)


@pytest.mark.parametrize(
    "recompute, custom, saved",
    [
        (None, {M.AP_MUST_SAVE: True}, {"a"}),
        (CheckpointPolicy.PREFER_RECOMPUTE, {M.AP_MUST_SAVE: True}, {"a"}),  # ap_must_save beats PREFER
        (CheckpointPolicy.MUST_RECOMPUTE, {M.AP_MUST_SAVE: True}, {"primals_1"}),  # MUST_RECOMPUTE wins
        (CheckpointPolicy.PREFER_RECOMPUTE, None, {"primals_1"}),  # PREFER never adds a save
        (None, None, {"primals_1"}),  # untagged: recomputed, not saved
        (CheckpointPolicy.MUST_SAVE, None, {"a"}),
    ],
)
def test_replay_save_rules(recompute, custom, saved):
    assert _replay_saved(_single(recompute, custom)) == saved


def test_replay_ignores_ap_must_save_on_a_node_traced_in_the_backward():
    """AOT gives nodes it traces in the backward the custom meta of the forward op they
    differentiate; in the second compile that op is the whole first-partition forward, so a
    backward node can carry a leaked ap_must_save. A backward node that reads only forward values
    (GPT-2's t(t(gathered weight)) of every biased Linear) was then saved."""
    gm = _single(None, {M.AP_MUST_SAVE: True})
    a = next(n for n in gm.graph.nodes if n.name == "a")
    a.meta[M.PARTITIONER_TAG] = M.PARTITIONER_TAG_BACKWARD
    assert _replay_saved(gm) == {"primals_1"}


def _split(custom=None, recompute=None):
    def build(g, x, tan):
        halves = (torch.randn(2), torch.randn(2))
        s = _call(g, aten.split.Tensor, (x, 2), halves, recompute, custom)
        g0 = g.call_function(operator.getitem, (s, 0))
        g0.meta[M.VAL] = halves[0]
        g1 = g.call_function(operator.getitem, (s, 1))
        g1.meta[M.VAL] = halves[1]
        g0.name, g1.name = "half0", "half1"
        cat = _call(g, aten.cat.default, ([g1, g0],), torch.randn(4))
        return cat, _call(g, aten.mul.Tensor, (cat, tan), torch.randn(4))

    return _joint(build)


@pytest.mark.parametrize(
    "custom, recompute, saved",
    [
        ({M.AP_MUST_SAVE: True, M.AP_MUST_SAVE_GETITEM_INDICES: [1]}, None, {"half1", "primals_1"}),
        ({M.AP_MUST_SAVE: True, M.AP_MUST_SAVE_GETITEM_INDICES: [0, 1]}, None, {"half0", "half1"}),
        ({M.AP_MUST_SAVE: True}, None, {"half0", "half1"}),  # no index list: every child
        ({M.AP_MUST_SAVE: True, M.AP_MUST_SAVE_GETITEM_INDICES: [1]}, CheckpointPolicy.MUST_SAVE, {"half0", "half1"}),
        ({M.AP_MUST_SAVE: True}, CheckpointPolicy.MUST_RECOMPUTE, {"primals_1"}),
    ],
)
def test_replay_multi_output_getitem_indices(custom, recompute, saved):
    # The backward reads cat(half1, half0); half0 not saved means split is recomputed from x.
    assert _replay_saved(_split(custom, recompute)) == saved


@pytest.mark.parametrize("region, saved", [(None, {"b"}), (M.PARTITIONER_TAG_BACKWARD, {"primals_1"})])
def test_replay_honours_save_records_on_forward_nodes_only(region, saved):
    # A backward op that reads forward values only, carrying the record AOT copied onto it from
    # a forward node (DDP re-traces: 5 extra saves on tiny LLaMA-3 before this rule).
    def build(g, x, tan):
        b = _call(g, aten.sin.default, (x,), torch.randn(4), custom={M.AP_MUST_SAVE: True})
        b.name = "b"
        if region is not None:
            b.meta[M.PARTITIONER_TAG] = region
        return _call(g, aten.cos.default, (x,), torch.randn(4)), _call(g, aten.mul.Tensor, (b, tan), torch.randn(4))

    assert _replay_saved(_joint(build)) == saved


def test_replay_multi_output_tag_without_getitem_users_is_an_error():
    def build(g, x, tan):
        s = _call(g, aten.split.Tensor, (x, 2), (torch.randn(2), torch.randn(2)), custom={M.AP_MUST_SAVE: True})
        s.name = "sdpa_like"
        return s, _call(g, aten.mul.Tensor, (x, tan), torch.randn(4))

    with pytest.raises(ValueError, match=r"node 'sdpa_like' .* multi-output op but has no getitem users"):
        _replay_saved(_joint(build))


def test_replay_partitioner_disables_inductor_caching():
    assert ReplaySavesPartitioner().uuid() is None


# --- no stage computes on memory nobody wrote -------------------------------------------------------


class BufferedEmbedding(torch.nn.Module):
    """Like BERT: ``__init__`` computes buffers (position ids, a scale) the forward indexes and
    multiplies with; uninitialised memory there changes the loss or fails the lookup."""

    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(16, 8)
        self.pos = torch.nn.Embedding(6, 8)
        self.head = torch.nn.Linear(8, 4)
        self.register_buffer("position_ids", torch.arange(6).expand(1, -1), persistent=False)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 8))

    def forward(self, tokens):
        h = (self.tok(tokens) + self.pos(self.position_ids[:, : tokens.shape[1]])) * self.scale
        return self.head(h).mean(dim=1)


def _buffered_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 4, (4,), generator=g)


def test_the_compiled_module_runs_on_the_models_own_buffers_and_parameters():
    """Failed before the joint graph kept the rank's real values: the first partition allocated
    every parameter and buffer with torch.empty, and the second compile ran the compiled module on
    that memory (BertForMaskedLM: 'index ... is out of bounds')."""
    torch.manual_seed(0)
    model = BufferedEmbedding()
    loss_fn = torch.nn.functional.cross_entropy
    inputs = _buffered_inputs()
    run = run_stages(model, loss_fn, inputs, ParallelPlan.fsdp(), "dp=2",
                     PipelineOptions(keep_compiled=True, alternatives=False), until=SECOND_COMPILE)
    try:
        assert run.module.uninitialised == ()
        assert torch.equal(run.module.model.get_buffer("position_ids"), model.position_ids)
        assert torch.equal(run.module.model.get_buffer("scale"), model.scale)
        with fake_world("dp=2") as mesh:
            local = split_batch(inputs, ParallelPlan.fsdp(), mesh.spec, mesh.coordinate())
            expected = ParallelProgram(model, ParallelPlan.fsdp(), mesh, loss_fn)(*local)
            assert torch.equal(run.compiled(*local[:-1], local[-1]), expected)
    finally:
        torch._dynamo.reset()


def test_a_module_without_values_is_refused_where_it_would_run():
    """A model built on meta has no values: the graphs can still be made, but a second compile
    that runs the module says why it will not."""

    with torch.device("meta"):
        model = BufferedEmbedding()
    inputs = _buffered_inputs()
    graphs = run_stages(model, torch.nn.functional.cross_entropy, inputs, ParallelPlan.fsdp(), "dp=2",
                        PipelineOptions(alternatives=False), until=SECOND_COMPILE)
    assert graphs.module.uninitialised  # graphs only: fine
    with pytest.raises(ValueError, match=r"have no values \(e.g. '[a-z_.]+'; the model was built on meta\)"):
        run_stages(model, torch.nn.functional.cross_entropy, inputs, ParallelPlan.fsdp(), "dp=2",
                   PipelineOptions(keep_compiled=True, alternatives=False), until=SECOND_COMPILE)
