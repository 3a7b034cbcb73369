"""An MoE whose token counts per expert differ between the ranks' slices and between steps, through
every stage on a gloo world: each rank traces its own graph, a step with other counts re-traces,
and every rank's collectives are compared before any runs (verify.parity.retrace)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoparallel import partition
from autoparallel.passes import bucket_plan
from autoparallel.fx_utils import copy_graph_module
from autoparallel.parallelize.traced_values import Read
from autoparallel.runtime.steps import Executor
from verify.check import check_model
from verify.graphs.canon import own_scope
from verify.model_case import ModelCase
from verify.parity import retrace, runs


class TinyMoE(nn.Module):
    """Top-1 MoE as jetmoe routes it: rows sorted by expert, split by counts read with
    ``.tolist()``, each expert applied to its rows (the router is trained: counts move with it)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(4, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        sizes = torch.stack([(expert == e).sum() for e in range(2)]).tolist()
        parts = x.index_select(0, order).split(sizes)
        out = torch.cat([e(p) for e, p in zip(self.experts, parts, strict=True)])
        return torch.empty_like(out).index_copy(0, order, out) * gate.unsqueeze(-1)


def _batch(n):
    return torch.randn(n, 4), torch.randn(n, 4)


CASE = ModelCase("tiny_moe", TinyMoE, F.mse_loss, _batch, batch_per_rank=8)


@pytest.mark.slow
def test_slices_and_steps_that_route_differently_pass_bitwise(capfd):
    result = check_model(CASE, plan="fsdp", mesh="dp=2", steps=2)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    err = capfd.readouterr().err
    assert "retrace: step 0" in err  # rank 1's slice routes otherwise than rank 0's: it traced its own
    assert "retrace: step 1" in err  # a later batch (and a trained router) routes otherwise: a new trace


@pytest.mark.slow
def test_without_a_retrace_a_later_step_fails_its_guard(monkeypatch):
    """What the re-trace answers: every step run with the graphs traced for the first batch
    (rank 0's slice) fails a guard, named, on a rank whose counts differ."""
    monkeypatch.setattr(retrace.StepGraphs, "make",
                        lambda self, local, buffers=None: (self.runs.append(self.run), self.firsts.append(())))
    with pytest.raises(Exception, match=r"ValueGuardError: value guard: .*tolist\(\)\): traced with \d+; this batch gives \d+"):
        check_model(CASE, plan="fsdp", mesh="dp=2", steps=2, world_timeout_s=300)


@pytest.mark.slow
def test_a_collective_that_differs_between_ranks_is_caught_before_any_run(monkeypatch):
    """Planted: one rank's retraced graph gets an extra collective; every rank raises naming it."""
    real = retrace.agree_on_collectives

    def planted(graphs, group=None):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            label, gm = graphs[0]
            gm = _with_extra_all_reduce(gm)
            graphs = [(label, gm), *graphs[1:]]
        return real(graphs, group)

    monkeypatch.setattr(retrace, "agree_on_collectives", planted)
    with pytest.raises(Exception, match=r"CollectiveMismatchError: the ranks' graphs issue different collectives.*graph 'joint', collective #0"):
        check_model(CASE, plan="fsdp", mesh="dp=2", steps=1, world_timeout_s=300)


class SkippingMoE(TinyMoE):
    """Runs only the experts some token reaches (switch_transformers' ``for expert_idx in
    expert_hit``): an expert no token of a rank's slice reaches is not read there, so the program
    gathers its parameters on the other rank only."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.router.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]))

    def forward(self, x):
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        sizes = torch.stack([(expert == e).sum() for e in range(2)]).tolist()
        parts = x.index_select(0, order).split(sizes)
        out = torch.cat([e(p) if n else p for e, p, n in zip(self.experts, parts, sizes, strict=True)])
        return torch.empty_like(out).index_copy(0, order, out) * gate.unsqueeze(-1)


def _skewed_batch(n):
    """The first half of the rows (data-parallel slice 0) all go to expert 0; the rest to either."""
    x = torch.randn(n, 4)
    x[: n // 2, 0] = x[: n // 2, 0].abs() + 0.1
    x[n // 2:, 0] = torch.tensor([1.0, -1.0]).repeat(n // 4)
    return x, torch.randn(n, 4)


SKIPPING = ModelCase("skipping_moe", SkippingMoE, F.mse_loss, _skewed_batch, batch_per_rank=4)


@pytest.mark.slow
def test_an_expert_one_rank_skips_is_gathered_by_every_rank_and_passes_bitwise(capfd):
    """Rank 0's slice reaches expert 0 only, rank 1's both: as FSDP2 gathers a unit whether or
    not the step reads each parameter (and reduce-scatters zeros for the unread), every rank
    gathers expert 1 first and passes it a zero gradient; every stage bitwise, the oracle (single
    device: expert 1's gradient from rank 1's rows alone) passes."""
    result = check_model(SKIPPING, plan="fsdp", mesh="dp=2", steps=2, world_timeout_s=300)
    assert result.ok, result.failures()
    assert result.parity and all(rep.bitwise for rep in result.parity.values())
    assert "2 parameters gathered first" in capfd.readouterr().err  # experts.1.weight and .bias


@pytest.mark.slow
def test_without_gathering_first_an_expert_one_rank_skips_is_a_named_collective_mismatch(monkeypatch):
    """Planted: no parameter gathered first. The collectives then depend on the values (expert
    1's parameters gathered on rank 1 only): named, before any of them runs, on every rank."""
    monkeypatch.setattr(retrace, "gathered_first", lambda read, order: ())
    with pytest.raises(Exception, match=r"(?s)CollectiveMismatchError: the ranks' graphs issue different collectives.*graph 'joint'.*experts\.1.*a parameter the model reads on some ranks' data only"):
        check_model(SKIPPING, plan="fsdp", mesh="dp=2", steps=1, world_timeout_s=300)


@pytest.mark.slow
def test_a_bucket_laid_out_otherwise_on_one_rank_is_a_named_mismatch(monkeypatch):
    """Planted: rank 1 lists its buckets' members backwards, as graph order did where the ranks'
    graphs differ (switch_transformers, docs/failure-classes.md 11m: same sizes, so nothing
    aborted and the gradients mixed). The ranks compare the graphs they bucketed themselves before
    any runs (RankContext.on_bucketed): a named error on every rank, the members shown."""
    import torch.distributed as dist

    real = bucket_plan.ordered_members

    def planted(bucket, keys):
        out = real(bucket, keys)
        return out[::-1] if dist.is_initialized() and dist.get_rank() == 1 else out

    monkeypatch.setattr(bucket_plan, "ordered_members", planted)
    with pytest.raises(Exception, match=r"(?s)CollectiveMismatchError.*bucketed (fwd|bwd).*the same sizes, other members"):
        check_model(CASE, plan="fsdp", mesh="dp=2", steps=1, world_timeout_s=300)


def _with_extra_all_reduce(gm):
    gm = copy_graph_module(gm)
    g = gm.graph
    x = next(n for n in g.nodes if n.op == "placeholder")
    group = next(n.args for n in g.nodes if n.op == "call_function" and "all_gather" in str(n.target))
    with g.inserting_after(x):
        g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group[-1]))
    gm.recompile()
    return gm


def test_per_step_runs_each_step_with_its_executor_and_carries_buffers():
    calls = []

    def make(i):
        buf = {"b": torch.zeros(1)}

        def step(params, inputs):
            calls.append((i, float(buf["b"])))
            buf["b"] += 1
            return torch.zeros(()), {}

        return Executor(step, buf)

    a, b = make(0), make(1)
    run = retrace.per_step([a, b, a])
    for _ in range(3):
        run({}, ())
    assert calls == [(0, 0.0), (1, 1.0), (0, 2.0)]
    assert float(run.buffers["b"]) == 3.0


def test_reads_key_tells_values_apart():
    assert retrace.reads_key([Read("m.py:1", 2)]) == retrace.reads_key([Read("m.py:1", 2)])
    assert retrace.reads_key([Read("m.py:1", 2)]) != retrace.reads_key([Read("m.py:1", 3)])
    assert retrace.reads_key([Read("m.py:1", 2)]) != retrace.reads_key([Read("m.py:1", 2, size=True)])


def test_params_read_names_the_parameters_a_slice_reads_a_tied_one_by_its_first_name():
    x, y = _skewed_batch(8)
    model = SkippingMoE()
    assert retrace.params_read(model, F.mse_loss, (x[:4], y[:4])) == {"router.weight", "experts.0.weight", "experts.0.bias"}
    assert retrace.params_read(model, F.mse_loss, (x, y)) == {fqn for fqn, _ in model.named_parameters()}
    model.experts[1].weight = model.experts[0].weight  # tied: read through either name, held by the first
    assert "experts.1.weight" not in retrace.params_read(model, F.mse_loss, (x, y))
    assert type(model.experts[0]) is nn.Linear  # the user's model untouched (a copy records)


# --- a stage that is not bitwise on graphs traced per rank: each rank explains its own graphs ---------


def _planted_expert_bias(monkeypatch) -> list[str]:
    """fsdp_tagging doubles expert 1's bias in its ``addmm`` (``beta=2``): a wrong pass whose
    node is downstream of the routing, so every guard still holds; its name per trace."""
    real, planted = partition.mark_fsdp_all_gather_recomputation, []

    def tagging(graph, *args):
        report = real(graph, *args)
        node = next(n for n in graph.nodes if n.target is torch.ops.aten.addmm.default and own_scope(n) == "experts.1")
        node.kwargs = {**node.kwargs, "beta": 2.0}
        planted.append(node.name)
        return report

    monkeypatch.setattr(partition, "mark_fsdp_all_gather_recomputation", tagging)
    return planted


@pytest.mark.slow
def test_a_wrong_pass_on_graphs_traced_per_rank_is_named_by_every_rank(monkeypatch):
    """Each rank traces its own graph (the slices route otherwise), so check_model's random-input
    differential run cannot feed them (a guard would fail): every rank runs its own graphs pass by
    pass on its step's real parameter shards and its slice (verify.parity.rank_explain), and names
    the planted pass, node, op, module path and size of the difference, for that stage and every
    later one; the stages before stay bitwise and get no explanation."""
    planted = _planted_expert_bias(monkeypatch)
    result = check_model(CASE, plan="fsdp", mesh="dp=2", steps=1)
    assert [s for s, rep in result.parity.items() if rep.bitwise] == ["joint", "cleanup"]
    assert set(result.explanations) == {"fsdp_tagging", "first_partition", "second_compile", "collective_passes"}
    why = result.explanations["fsdp_tagging"]
    for rank in (0, 1):
        assert f"rank {rank}: step 0, this rank's own graphs: differential execution (2 simulated ranks)" in why, why
    assert why.count("pass fsdp_tagging computes other values than its input; first differing node: node "
                     f"'{planted[0]}' (aten.addmm) in module 'experts.1' on rank 0, max |diff| ") == 2, why
    assert "could not run" not in why
    assert all(result.explanations[s] == why for s in result.explanations)
    assert sum(f"why: {why}" in f for f in result.failures()) == 4


@pytest.mark.slow
def test_graphs_traced_per_rank_that_compute_alike_name_no_node(monkeypatch):
    """The negative side: the pipeline is correct and one stage's trace is made to differ after
    the run (its loss + 1), so the ranks' differential runs find no pass that differs and name no
    node; the stage before is bitwise, so the line says the trace is not the cause either."""
    real = runs.explain_own_graphs

    def perturbed(traces, stages, reference, **kw):
        traces["collective_passes"].losses[0] = traces["collective_passes"].losses[0] + 1
        return real(traces, stages, reference, **kw)

    monkeypatch.setattr(runs, "explain_own_graphs", perturbed)
    result = check_model(CASE, plan="fsdp", mesh="dp=2", steps=1)
    assert [s for s, rep in result.parity.items() if not rep.bitwise] == ["collective_passes"]
    why = result.explanations["collective_passes"]
    assert why.startswith("on every rank (2), step 0, this rank's own graphs: every pass up to collective_passes computes "
                          "what its input computes (2 simulated ranks)"), why
    assert "first differing node" not in why
    assert "the difference is not the trace's either: second_compile is bitwise with the eager program on this rank" in why
