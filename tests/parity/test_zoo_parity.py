"""The zoo (``verify.zoo``) through every stage on gloo.

GPT-2 style (tied embedding/head, LayerNorm, biases, GELU, learned positions, a fused qkv split by
TP as 3 chunks), a conv net with BatchNorm (running stats updated in place) and GroupNorm and a
hand-written loss, and pre-norm MLP blocks with user TP rules over the region pattern ``blocks.*``,
under the plans that apply. Per (model, plan), one pipeline run and one gloo world of two ranks
(``verify.parity.runs.run_stage_parity``) serve every test:

* every stage (joint, cleanup, fsdp_tagging, first partition, second compile and, where listed,
  the composed collective passes) trains 3 AdamW steps bitwise like the eager parallel program,
  losses, gradients and buffers;
* the eager program is within the oracle's tolerance of single-device eager (the check that
  catches a lowering bug the eager program shares: tests/parity/test_oracle.py);
* LayerNorm's two saved outputs (mean, rstd) are saved by the second compile as by the first.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compile import SECOND_COMPILE
from autoparallel.partition import STEP_FIRST_PARTITION
from autoparallel.pipeline import JOINT, PipelineRun
from verify import zoo
from verify.graphs.liveness import saved_gathered_values
from verify.parity.runs import (
    COLLECTIVE,
    EAGER,
    STAGE_EXECUTORS,
    RankParity,
    compare_with_eager,
    oracle_check,
    parity_pipeline,
    run_stage_parity,
)
from verify.stages.scenario import Scenario

aten = torch.ops.aten
STEPS = 3
WITHOUT_COLLECTIVE = tuple(e for e in STAGE_EXECUTORS if e != COLLECTIVE)

# The collective passes run on each rank (bucketing is rank-specific) and cost seconds per rank
# even on tiny graphs: they run where they meet something new (a tied weight's single gather,
# chunked TP shards with rowwise biases, buffer updates in the bucketed graphs); the LLaMA
# scenarios of test_bucketing_parity.py cover them under every plan.
CASES: dict[str, tuple[Scenario, tuple[str, ...]]] = {
    "gpt2-fsdp-dp2": (Scenario(case=zoo.gpt2, plan="fsdp", mesh="dp=2"), STAGE_EXECUTORS),
    "gpt2-ddp-dp2": (Scenario(case=zoo.gpt2, plan="ddp", mesh="dp=2"), WITHOUT_COLLECTIVE),
    # a size-1 mesh dim: used to fail with "unknown mesh dim 'tp'"
    "gpt2-fsdp_tp-dp1tp2": (Scenario(case=zoo.gpt2, plan="fsdp_tp", mesh="dp=1,tp=2"), STAGE_EXECUTORS),
    "convnet-ddp-dp2": (Scenario(case=zoo.convnet, plan="ddp", mesh="dp=2"), STAGE_EXECUTORS),
    "convnet-fsdp-dp2": (Scenario(case=zoo.convnet, plan="fsdp", mesh="dp=2"), WITHOUT_COLLECTIVE),
    "ln_mlp-fsdp_tp-dp1tp2": (Scenario(case=zoo.ln_mlp, plan="fsdp_tp", mesh="dp=1,tp=2"), WITHOUT_COLLECTIVE),
}


@dataclass
class ZooRun:
    name: str
    scenario: Scenario
    run: PipelineRun
    ranks: list[RankParity]
    executors: tuple[str, ...]


# In CI's slow step only (.ci/run: pytest -m slow --ap-run-slow), ~20 CPU-s: gpt2 under DDP (the
# DDP path is the convnet's in the tier, gpt2's tied weight is gpt2-fsdp's) and the LayerNorm MLP
# under fsdp_tp on dp=1,tp=2 (gpt2-fsdp_tp-dp1tp2 runs the same TP path with a size-1 dim).
SLOW_CASES = ("gpt2-ddp-dp2", "ln_mlp-fsdp_tp-dp1tp2")


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(n, marks=[pytest.mark.xdist_group(f"zoo-{n}"), *([pytest.mark.slow] if n in SLOW_CASES else [])])
        for n in CASES
    ],
)
def zoo_run(request) -> ZooRun:
    scenario, executors = CASES[request.param]
    run = parity_pipeline(scenario, executors)
    ranks = run_stage_parity(scenario, STEPS, executors=executors, run=run)
    return ZooRun(request.param, scenario, run, ranks, executors)


def test_every_stage_trains_bitwise_like_the_eager_program(zoo_run):
    eager = zoo_run.ranks[0].traces[EAGER]
    per_step = 1 + len(eager.grads[0]) + len(eager.buffers[0]) if eager.buffers else 1 + len(eager.grads[0])
    for executor in zoo_run.executors[1:]:
        report = compare_with_eager(zoo_run.ranks, executor)
        assert len(report.diffs) == len(zoo_run.ranks) * STEPS * per_step, executor
        report.assert_bitwise()


def test_the_eager_program_is_within_the_oracle_tolerance_of_single_device(zoo_run):
    report = oracle_check(zoo_run.scenario, zoo_run.ranks)
    print(report.summary())
    report.assert_passed()
    assert report.worst_ratio < 0.5, "a correct lowering sits far inside the bound (see verify/parity/compare.py)"


def test_the_runs_train_and_update_buffers(zoo_run):
    """Guards the tests above: the optimizer moved, and BatchNorm's running stats (compared
    bitwise above) were updated once per step by every executor, not left alone by all."""
    for executor in zoo_run.executors:
        trace = zoo_run.ranks[0].traces[executor]
        assert not torch.equal(trace.losses[0], trace.losses[1]) and not torch.equal(trace.losses[1], trace.losses[2])
        if zoo_run.scenario.model_case is zoo.convnet:
            assert [int(b["bn.num_batches_tracked"]) for b in trace.buffers] == [1, 2, 3], executor
            assert not torch.equal(trace.buffers[0]["bn.running_mean"], trace.buffers[1]["bn.running_mean"])


_SAME_OP = {str(aten.reshape.default): str(aten.view.default)}  # a re-traced reshape is a view


def _saved(fw) -> list:
    """The forward nodes whose values the forward hands to the backward (outputs ``saved:<k>``)."""
    out = fw.graph.output_node()
    return [v for v, r in zip(out.args[0], out.meta[M.ROLE], strict=True) if roles.is_saved(r)]


def _saved_ops(fw) -> Counter:
    """(op, output index) of every computed value the forward saves."""
    ops = Counter()
    for v in _saved(fw):
        if v.op == "call_function" and v.target is operator.getitem:
            ops[(str(v.args[0].target), v.args[1])] += 1
        elif v.op == "call_function":
            ops[(_SAME_OP.get(str(v.target), str(v.target)), None)] += 1
    return ops


def test_the_second_compile_saves_what_the_first_saved_multi_output_norms_included(zoo_run):
    """LayerNorm saves two of its three outputs (mean, rstd) for the backward: the replay
    partitioner must keep both, not only the first getitem it meets."""
    first = _saved_ops(zoo_run.run.stage(STEP_FIRST_PARTITION).graphs[0])
    second = _saved_ops(zoo_run.run.stage(SECOND_COMPILE).graphs[0])
    norms = sum(isinstance(m, nn.LayerNorm) for m in zoo_run.scenario.model(device="meta").modules())
    layer_norm = str(aten.native_layer_norm.default)
    assert first[(layer_norm, 1)] == first[(layer_norm, 2)] == norms
    assert sum(first.values()) > 0 and first == second


def test_no_partition_saves_a_gathered_parameter(zoo_run):
    """reshard_after_forward: the backward gathers again. GPT-2's tied weight (its gather has two
    uses) and the second compile's t(t(w)) of every biased Linear used to be saved."""
    for stage in (STEP_FIRST_PARTITION, SECOND_COMPILE):
        assert [v.name for v in saved_gathered_values(*zoo_run.run.stage(stage).graphs)] == [], stage


def test_every_parameter_is_one_input_with_one_gradient(zoo_run):
    """A tied weight (GPT-2's head is its embedding) is held once, by its first name."""
    joint = zoo_run.run.joint
    params = roles.names_of(joint.input_roles, roles.PARAM)
    assert params == [n for n, _ in zoo_run.scenario.model(device="meta").named_parameters()]
    assert roles.names_of(joint.output_roles, roles.GRAD) == params
    assert list(zoo_run.ranks[0].traces[JOINT].grads[0]) == params
    if zoo_run.scenario.model_case is zoo.gpt2:
        assert "head.weight" not in params
