"""The compile stack computes exactly what the eager parallel program does, on a real gloo world.

Two ranks (dp=2, FSDP), three training steps with AdamW between: the eager program, the first
partition's ParallelModule and its torch.compile'd version (autoparallel_backend, aot_eager-style
compilers) give bitwise equal losses and gradients at every step.
"""

import pytest
import torch

from verify.parity.compare import compare_traces, merge_reports
from verify.parity.runs import COMPILE_EXECUTORS

STEPS = 3
# The world is tests/conftest.py's llama_fsdp_dp2_world (these executors and the joint graph's),
# shared with test_joint_parity.py's fsdp-dp2 tests: one worker runs both.
pytestmark = pytest.mark.xdist_group("joint-parity-fsdp-dp2")


@pytest.fixture(scope="module")
def compile_run(llama_fsdp_dp2_world):
    assert all(set(COMPILE_EXECUTORS) <= set(r.traces) for r in llama_fsdp_dp2_world)
    return llama_fsdp_dp2_world


@pytest.mark.parametrize("executor", COMPILE_EXECUTORS[1:])
def test_compiled_stage_bitwise_equals_eager_for_three_steps(compile_run, executor):
    ranks = compile_run
    reports = [compare_traces(r.traces["eager"], r.traces[executor], a_name="eager", b_name=executor) for r in ranks]
    report = merge_reports(reports, [f"rank{i}" for i in range(len(ranks))])
    n_grads, n_buffers = len(ranks[0].traces["eager"].grads[0]), len(ranks[0].traces["eager"].buffers[0])
    assert n_grads > 0 and len(report.diffs) == len(ranks) * STEPS * (1 + n_grads + n_buffers)
    report.assert_bitwise()


def test_compile_parity_run_trains(compile_run):
    """Guards the parity test itself: the ranks saw different data and the optimizer moved."""
    r0, r1 = compile_run
    assert r0.coord != r1.coord
    losses = r0.traces["second_compile"].losses
    assert not torch.equal(losses[0], losses[1]) and not torch.equal(losses[1], losses[2])
    assert not torch.equal(r0.traces["eager"].losses[0], r1.traces["eager"].losses[0])
