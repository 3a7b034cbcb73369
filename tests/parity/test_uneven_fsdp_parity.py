"""FSDP on parameters whose dim 0 does not divide the mesh dim: every pipeline stage trains
bitwise like the eager parallel program on gloo (2 and 4 ranks), close to single-device eager,
the padding stays exactly zero, and no gathered (padded or narrowed) weight is saved.

The model is a small ViT-like classifier with a mixture-of-experts layer: class token
``[1, 1, D]``, position embeddings ``[1, 17, D]``, a 3-way branch scale ``[3]``, a 5-wide MLP,
a 4-expert router ``[4, D]`` and a 10-class head ``[10, D]`` (D = 6). On dp=4 ranks 1-3 hold
only padding of the class token, and rank 3 holds only padding of the branch scale. The 4-rank
world also runs fsdp_tp (dp=2, tp=2) on a toy whose TP-local shards are uneven over dp.

The gloo worlds are in CI's slow step (tests/conftest.py SLOW_GROUPS); the quick tier keeps the
padding properties (tests/property/test_fsdp_padding_properties.py), the uneven FSDP unit tests
and one world on real tensors: the dp=2 joint graph on two simulated ranks
(``test_uneven_joint_graph_on_two_simulated_ranks_...``, no process group).

Each rank builds every stage's executor from its registry entry (``verify.stages.registry``) on
its ``RankContext`` (``verify.stages.rank_context``), as ``verify/parity/runs.py`` does, in a
``run_parity_world`` (reductions rank-ordered); each collective pass's stage is its input's graphs
with that pass applied, as the pipeline makes them (the registry's executor runs them composed).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compile import SECOND_COMPILE
from autoparallel.fx_utils import WAIT
from autoparallel.mesh import MeshSpec, build_mesh
from autoparallel.parallelize import ParallelPlan, ParallelProgram, build_joint_graph, split_batch
from autoparallel.passes.collective import COLLECTIVE_PASS_NAMES, bucket_fw_bw
from autoparallel.pipeline import JOINT, STAGE_NAMES, STAGES, PipelineOptions, run_pipeline
from autoparallel.runtime.steps import split_graph_executor
from verify.graphs.liveness import saved_gathered_values
from verify.graphs.stats import graph_stats
from verify.parity.compare import (
    check_within,
    compare_tensors,
    compare_traces,
    diff_tensors,
    merge_reports,
    module_scales,
    oracle_tolerance,
)
from verify.parity.differential import Feeds, run_program, simulated_world
from verify.parity.ordered_collectives import run_parity_world
from verify.stages.rank_context import RankContext
from verify.stages.registry import build_executor, verification

STEPS = 3
EAGER = "eager"
BATCH = 8  # global batch: 4 per rank on dp=2, 2 per rank on dp=4
MESHES = ("dp=2", "dp=4")
# Single-device eager reduces in another order: the bound is ~10x the noise measured (fp32).
SINGLE_DEVICE_ATOL = 1e-6
_RANK_THREADS = 1  # the ranks': Dynamo guards on the thread count the module compiled with


class TinyViT(nn.Module):
    """Patches [B, 16, 4] -> 10 class logits; parameters of dim 0 = 1, 3, 4, 5, 6 and 10, no biases
    (few parameters: each is two collectives per rank and step on the gloo worlds)."""

    def __init__(self, patch: int = 4, dim: int = 6, tokens: int = 16, hidden: int = 5, experts: int = 4, classes: int = 10):
        super().__init__()
        self.patch_embed = nn.Linear(patch, dim, bias=False)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.5)
        self.branch_scale = nn.Parameter(torch.tensor([1.0, 0.5, 2.0]))  # read three times
        self.fc1 = nn.Linear(dim, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, dim, bias=False)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) * 0.3)
        self.head = nn.Linear(dim, classes, bias=False)

    def forward(self, patches):
        h = self.patch_embed(patches)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1) + self.pos_embed
        h = h + self.branch_scale[0] * self.fc2(F.gelu(self.fc1(F.layer_norm(h, h.shape[-1:]))))
        gates = torch.softmax(self.router(h), dim=-1)
        h = h + self.branch_scale[1] * torch.einsum("bte,edf,btd->btf", gates, self.experts, h)
        return self.head(h[:, 0] * self.branch_scale[2])


def make_model() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT()


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def make_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(BATCH, 16, 4, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]


class TPToy(nn.Module):
    """fsdp_tp on dp=2, tp=2: TP splits first (evenly), then FSDP pads dim 0 of the TP-local
    piece. ``up`` [6, 8] colwise -> [3, 8] -> 2 rows per rank, 1 of padding; ``down`` [3, 6]
    rowwise -> [3, 3] -> 2 rows per rank, 1 of padding."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 6, bias=False)
        self.down = nn.Linear(6, 3, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


TP_MESH = "dp=2,tp=2"
# The whole toy is one TP region (root module ""): copy into it, all-reduce out of it.
TP_PLAN = ParallelPlan.fsdp_tp(tp_rules={"up.weight": "colwise", "down.weight": "rowwise"}, tp_regions=("",))


def make_tp_toy() -> TPToy:
    torch.manual_seed(1)
    return TPToy()


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def make_tp_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


# --- the run: every stage's executor from its registry entry, on each rank's RankContext ------------


def _rank_every_stage(rank, world_size, spec, run, batches, tp_run):
    """Eager, then each stage up to the second compile as its registry entry builds it from the
    rank's context; then each collective pass's stage, as the pipeline makes it: its input's
    graphs with that pass applied, here on the rank's rebound second-compile graphs (merged
    all-gathers bake the rank into the graph; the registry's executor runs the passes composed
    only). Then, where ``tp_run`` (the fsdp_tp toy's pipeline run, up to its joint graph) is
    given: eager and its joint graph."""
    mesh = build_mesh(spec)
    program = ParallelProgram(make_model(), ParallelPlan.fsdp(), mesh, class_loss)
    ctx = RankContext.for_program(program, mesh, batches, run=run)
    traces = {EAGER: ctx.train(ctx.eager())}
    for entry in verification(STAGES):
        if entry.stage.name not in COLLECTIVE_PASS_NAMES:
            traces[entry.stage.name] = ctx.train(entry.parity.executor(ctx))
    fw, bw = ctx.graphs(SECOND_COMPILE)
    for p in COLLECTIVE_PASS_NAMES:
        fw, bw, _ = bucket_fw_bw(fw, bw, PipelineOptions().collective, only=(p,))
        traces[p] = ctx.train(split_graph_executor(fw, bw, ctx.fresh_buffers()))
    return mesh.coordinate(), traces, (_rank_fsdp_tp(tp_run) if tp_run else None)


def _rank_fsdp_tp(tp_run):
    """A second mesh on the same world (no second world to start): eager vs the joint graph."""
    mesh = build_mesh(TP_MESH)
    ctx = RankContext.for_program(ParallelProgram(make_tp_toy(), TP_PLAN, mesh, mse), mesh, make_tp_batches(), run=tp_run)
    return mesh.coordinate(), {EAGER: ctx.train(ctx.eager()), JOINT: ctx.train(build_executor(JOINT, ctx))}


def _stage_parity_run(spec: str):
    """The pipeline on a fake world of ``spec`` (up to the second compile, compiled module kept),
    then every stage's graphs trained for ``STEPS`` steps on a gloo world of the same mesh."""
    threads = torch.get_num_threads()
    torch.set_num_threads(_RANK_THREADS)
    try:
        options = PipelineOptions(keep_compiled=True)
        run = run_pipeline(make_model(), class_loss, make_batches(1)[0], ParallelPlan.fsdp(), spec, options, until=SECOND_COMPILE)
    finally:
        torch.set_num_threads(threads)
    tp_run = None
    if MeshSpec.parse(spec).world_size == MeshSpec.parse(TP_MESH).world_size:
        tp_run = run_pipeline(make_tp_toy(), mse, make_tp_batches(1)[0], TP_PLAN, TP_MESH, PipelineOptions(), until=JOINT)
    try:
        ranks = run_parity_world(
            _rank_every_stage,
            MeshSpec.parse(spec).world_size,
            args=(MeshSpec.parse(spec), run, make_batches(), tp_run),
            num_threads=_RANK_THREADS,
        )
    finally:
        torch._dynamo.reset()
    return run, [r[:2] for r in ranks], [r[2] for r in ranks if r[2] is not None]


def _single_device(make=make_model, loss_fn=class_loss, batches=None):
    """Losses of each step, first-step gradients and final parameters of the unsharded model."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for i, (x, y) in enumerate(batches or make_batches()):
        loss = loss_fn(model(x), y)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _world(spec: str):
    """One gloo world per mesh, shared by this module's tests (they share its xdist worker)."""
    return _stage_parity_run(spec)


def _group(spec: str):
    return pytest.mark.xdist_group(f"uneven-fsdp-{spec}")


@pytest.fixture(scope="module", params=[pytest.param(s, marks=_group(s)) for s in MESHES])
def uneven(request):
    spec = MeshSpec.parse(request.param)
    run, ranks, _ = _world(request.param)
    shardings = ParallelPlan.fsdp().resolve(make_model(), spec)
    return spec, run, ranks, shardings


# --- the checks ------------------------------------------------------------------------------------


def test_the_model_is_uneven_and_some_ranks_hold_only_padding(uneven):
    """Guards the scenario: dims 0 of 1, 3, 5 and 10 do not divide, and on dp=4 whole shards are padding."""
    spec, _, _, shardings = uneven
    n = spec.size("dp")
    padded = {fqn for fqn, s in shardings.items() if s.padded}
    assert {"cls_token", "pos_embed", "branch_scale", "fc1.weight"} <= padded
    assert ("head.weight" in padded) == (n == 4) and ("patch_embed.weight" in padded) == (n == 4)
    only_padding = {fqn for fqn, s in shardings.items() for i in range(n) if s.real_rows({"dp": i}) == 0}
    assert {"cls_token", "pos_embed"} <= only_padding and ("branch_scale" in only_padding) == (n == 4)


def test_every_stage_trains_bitwise_like_the_eager_program(uneven):
    """dp=4 too, the reduce-scatter bucketing stages included: the world's reductions are
    rank-ordered (verify.parity.ordered_collectives), so a gradient's sum no longer depends on where a
    bucket puts it (gloo's own reduce-scatter differed in the last bit in 5 of 20 layouts at 4 ranks)."""
    _, _, ranks, shardings = uneven
    assert set(ranks[0][1]) == {EAGER, *STAGE_NAMES}  # every stage of the pipeline ran
    for stage in STAGE_NAMES:
        reports = [compare_traces(t[EAGER], t[stage], a_name=EAGER, b_name=stage) for _, t in ranks]
        report = merge_reports(reports, [f"rank{i}" for i in range(len(ranks))])
        assert len(report.diffs) == len(ranks) * STEPS * (1 + len(shardings)), stage
        report.assert_bitwise()
        for coord, t in ranks:  # and the parameters and AdamW moments they end with
            for fqn in shardings:
                for what, a, b in (
                    ("param", t[EAGER].params[fqn], t[stage].params[fqn]),
                    *((k, t[EAGER].optimizer_state[fqn][k], t[stage].optimizer_state[fqn][k]) for k in ("exp_avg", "exp_avg_sq")),
                ):
                    d = diff_tensors(f"{stage} rank {coord} {fqn} {what}", a, b)
                    assert d.equal, d


def test_padding_rows_stay_exactly_zero(uneven):
    """Zero-initialised padding, zero gradient rows after the reduce-scatter, and AdamW (weight decay
    scales the parameter; both moments of a zero gradient stay zero): after three steps the
    padding of parameters, gradients and optimizer state is +0.0 on every rank, for every stage."""
    _, _, ranks, shardings = uneven
    checked = 0
    for coord, traces in ranks:
        for stage, t in traces.items():
            for fqn, s in shardings.items():
                real = s.real_rows(coord)
                tensors = [t.params[fqn], *t.optimizer_state[fqn].values(), *(g[fqn] for g in t.grads)]
                assert len(tensors) == 3 + STEPS
                for x in tensors:
                    assert tuple(x.shape) == s.local_shape
                    pad = x[real:]
                    d = diff_tensors(f"{stage} {coord} {fqn} padding", pad, torch.zeros_like(pad))
                    assert d.equal, d
                    checked += pad.numel()
    assert checked > 0


def test_real_rows_reassemble_the_parameters_close_to_single_device(uneven):
    """A rank's checkpointable shard is its real rows: concatenated over the ranks they are the
    full parameter, close to single-device AdamW after three steps; step-0 gradients and
    every step's loss too."""
    spec, _, ranks, shardings = uneven
    losses, grads, params = _single_device()
    stage = STAGE_NAMES[-1]
    for fqn, s in shardings.items():
        by_rank = sorted(ranks, key=lambda r: r[0]["dp"])
        real = torch.cat([s.real_shard(t[stage].params[fqn], coord) for coord, t in by_rank])
        assert real.shape == params[fqn].shape
        pieces = {tuple(coord.values()): t[stage].params[fqn] for coord, t in ranks}
        assert torch.equal(s.unshard(pieces, spec), real)
    full = {fqn: s.unshard({tuple(c.values()): t[stage].grads[0][fqn] for c, t in ranks}, spec) for fqn, s in shardings.items()}
    final = {fqn: s.unshard({tuple(c.values()): t[stage].params[fqn] for c, t in ranks}, spec) for fqn, s in shardings.items()}
    for name, ref, got in (("grads", grads, full), ("params", params, final)):
        report = compare_tensors(ref, got, a_name="single-device", b_name=stage)
        assert report.diffs and all(d.max_abs < SINGLE_DEVICE_ATOL for d in report.diffs), f"{name}: {report.summary()}"
    for i, loss in enumerate(losses):
        rank_mean = torch.stack([t[stage].losses[i] for _, t in ranks]).mean()
        assert torch.allclose(rank_mean, loss, atol=SINGLE_DEVICE_ATOL), (i, rank_mean, loss)
    assert not torch.equal(losses[0], losses[1]) and not torch.equal(losses[1], losses[2])  # it trains


def test_gathered_padded_and_narrowed_weights_are_recomputed_not_saved(uneven):
    _, run, _, shardings = uneven
    for stage in ("first_partition", SECOND_COMPILE):
        assert not [n.name for n in saved_gathered_values(*run.stage(stage).graphs)], stage
    fw, _ = run.stage("first_partition").graphs
    narrows = [n for n in fw.graph.nodes if n.target is torch.ops.aten.slice.Tensor and n.args[0].target is WAIT]
    assert len(narrows) == sum(s.padded for s in shardings.values())
    assert all(n.meta.get(M.RECOMPUTE) is not None and n.meta[M.RECOMPUTE].name == "MUST_RECOMPUTE" for n in narrows)


def test_stats_count_the_padding_the_plan_adds(uneven):
    """Known answer: each padded parameter all-gathers (and reduce-scatters) its padding rows once.
    The program computes a parametrized value once per forward (``parametrize.cached``), so
    ``branch_scale``, read three times, is gathered once already in the traced joint graph."""
    spec, run, _, shardings = uneven
    want = sum(s.padding_rows * torch.Size(s.local_shape[1:]).numel() * 4 for s in shardings.values())
    st = graph_stats(run.stage("joint").graphs)
    n_padded = sum(1 for s in shardings.values() if s.padded)
    for kind in ("all_gather", "reduce_scatter"):
        assert st.padding[kind]["dp"].count == n_padded and st.padding_bytes(kind, "dp") == want


@_group("dp=4")
def test_fsdp_tp_pads_the_tp_local_shard_and_trains_bitwise_on_the_4_rank_world():
    *_, tp_ranks = _world("dp=4")
    spec = MeshSpec.parse(TP_MESH)
    shardings = TP_PLAN.resolve(make_tp_toy(), spec)
    assert {f: (s.fsdp_rows, s.local_shape) for f, s in shardings.items()} == {"up.weight": (3, (2, 8)), "down.weight": (3, (2, 3))}
    reports = [compare_traces(t[EAGER], t[JOINT], a_name=EAGER, b_name=JOINT) for _, t in tp_ranks]
    report = merge_reports(reports, [f"rank{i}" for i in range(len(tp_ranks))])
    assert len(report.diffs) == 4 * STEPS * 3
    report.assert_bitwise()
    for coord, t in tp_ranks:  # padding rows of every gradient and of the final parameters are zero
        for fqn, s in shardings.items():
            for x in [t[JOINT].params[fqn], *(g[fqn] for g in t[JOINT].grads)]:
                assert not x[s.real_rows(coord):].any() and s.real_rows(coord) >= 1
    _, grads, _ = _single_device(make_tp_toy, mse, make_tp_batches())
    full = {f: s.unshard({tuple(c.values()): t[JOINT].grads[0][f] for c, t in tp_ranks}, spec) for f, s in shardings.items()}
    report = compare_tensors(grads, full, a_name="single-device", b_name="fsdp_tp joint")
    assert all(d.max_abs < SINGLE_DEVICE_ATOL for d in report.diffs), report.summary()


def test_uneven_joint_graph_on_two_simulated_ranks_matches_single_device_with_zero_padding():
    """The quick tier's uneven-FSDP world (the gloo worlds above are in CI's slow step): the
    traced dp=2 joint graph of TinyViT, whose class token, position embeddings, branch scale and
    fc1 weight pad dim 0, run on two simulated ranks with the real model's zero-padded shards and
    batch slices (reduce-scatters and all-gathers by LocalTensorMode). The real rows of every
    gradient reassemble to single-device eager within the oracle's bound; every padding row of
    every gradient is exactly +0.0."""
    spec, plan = MeshSpec.parse("dp=2"), ParallelPlan.fsdp()
    model, batch = make_model(), make_batches(1)[0]
    shardings = plan.resolve(model, spec)
    assert {f for f, s in shardings.items() if s.padded} >= {"cls_token", "pos_embed", "branch_scale", "fc1.weight"}
    coords = [{"dp": r} for r in range(2)]
    given = {roles.param(f): tuple(shardings[f].shard(p.detach(), c, {"dp": 2}) for c in coords) for f, p in model.named_parameters()}
    slices = [split_batch(batch, plan, spec, c) for c in coords]
    given.update({roles.input_(i): tuple(sl[i] for sl in slices) for i in range(len(batch))})
    given[roles.tangent(roles.LOSS)] = (torch.ones(()), torch.ones(()))
    with simulated_world(spec) as world, build_joint_graph(make_model(), plan, world, batch, class_loss) as jg:
        result = run_program(jg.gm, Feeds(2, given=given)).result
    _, grads, _ = _single_device(batches=[batch])
    tolerance = oracle_tolerance(make_model(), slices[0][:-1], 2)
    scales = module_scales(grads)
    for fqn, s in shardings.items():
        pieces = result[roles.grad(fqn)]
        for c, g in zip(coords, pieces, strict=True):
            pad = g[s.real_rows(c):]
            assert diff_tensors(f"{fqn} padding", pad, torch.zeros_like(pad)).equal, fqn
        full = s.unshard({(c["dp"],): g for c, g in zip(coords, pieces, strict=True)}, spec)
        check = check_within(roles.grad(fqn), grads[fqn], full, tolerance.rtol, scales[fqn])
        assert check.passed, check
    loss = torch.stack(result[roles.LOSS]).mean()
    assert check_within("loss", _single_device(batches=[batch])[0][0], loss, tolerance.rtol).passed
