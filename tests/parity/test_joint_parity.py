"""The traced joint graph, run for real on gloo, computes exactly what the eager program does."""

import pytest
import torch

from verify.parity.compare import compare_tensors, compare_traces, merge_reports
from verify.parity.runs import (
    gather_full_grads,
    run_joint_parity,
    single_device_step,
    single_device_tolerance,
)
from verify.stages.scenario import Scenario

SCENARIOS = {
    "fsdp-dp2": Scenario(mesh="dp=2"),
    "fsdp_tp-dp2tp2": Scenario(plan="fsdp_tp", mesh="dp=2,tp=2"),
    "ddp-dp2": Scenario(plan="ddp", mesh="dp=2"),
    "fsdp-bf16-dp2": Scenario(mesh="dp=2", param_dtype="bf16", reduce_dtype="fp32"),
}


# The tests of one scenario share an xdist worker: its gloo run happens once. fsdp-dp2's world is
# tests/conftest.py's llama_fsdp_dp2_world, shared with test_compile_parity.py (same group).
@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.xdist_group(f"joint-parity-{n}")) for n in sorted(SCENARIOS)],
)
def parity_run(request):
    sc = SCENARIOS[request.param]
    if request.param == "fsdp-dp2":
        return request.param, sc, request.getfixturevalue("llama_fsdp_dp2_world")
    return request.param, sc, run_joint_parity(sc, steps=3)


def test_joint_graph_bitwise_equals_eager_for_three_steps(parity_run):
    _, _, ranks = parity_run
    reports = [compare_traces(r.traces["eager"], r.traces["joint"], a_name="eager", b_name="joint") for r in ranks]
    report = merge_reports(reports, [f"rank{i}" for i in range(len(ranks))])
    eager = ranks[0].traces["eager"]
    # loss, every gradient and every buffer (LLaMA's RoPE tables), per rank and step
    assert len(report.diffs) == len(ranks) * 3 * (1 + len(eager.grads[0]) + len(eager.buffers[0]))
    report.assert_bitwise()


def test_joint_graph_close_to_single_device(parity_run):
    name, sc, ranks = parity_run
    loss, grads = single_device_step(sc)
    full = gather_full_grads(sc, ranks, "joint")
    report = compare_tensors(grads, full, a_name="single-device", b_name="joint")
    print(report.summary())
    # the oracle's tolerance (reduction-order noise, by dtype): what the report's verdict uses too
    assert all(d.max_abs < single_device_tolerance(sc) for d in report.diffs), report.summary()
    rank_losses = torch.stack([r.traces["joint"].losses[0] for r in ranks])
    assert torch.allclose(rank_losses.mean(), loss, atol=1e-2 if "bf16" in name else 1e-5)


def test_optimizer_steps_change_the_loss(parity_run):
    """Guards the parity test itself: identical losses across steps would mean no update happened."""
    _, _, ranks = parity_run
    losses = ranks[0].traces["joint"].losses
    assert not torch.equal(losses[0], losses[1]) and not torch.equal(losses[1], losses[2])
