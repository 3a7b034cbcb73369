"""A buffer's oracle bound scales with its module's input (``verify.parity.buffer_scales``).

mobilevit's fsdp cell failed the oracle on a batch-norm running mean that is exactly 0 in the
reference (the batch mean of a zero-mean map) and 1.5e-12 in the parallel run: its bound,
relative to its own value, was 0. These tests pin the rule (the scale is the larger of the
buffer's own entries and its module's largest input entry), and, on a model of our own whose
batch norm averages a zero-mean map, that a correct program passes while a planted error in that
running mean (1e-3 of the input scale) still fails, calibration included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoparallel import roles
from verify.model_case import ModelCase
from verify.parity import calibration, runs
from verify.parity.buffer_scales import buffer_scales, owner_input_scales
from verify.parity.compare import OracleTolerance, check_within
from verify.parity.runs import EAGER, oracle_check, run_stage_parity, single_device_reference
from verify.stages.scenario import Scenario
from verify.zoo import mse_loss


class CenteredNorm(nn.Module):
    """A batch norm over a map centred on the batch: its running mean is 0 in exact arithmetic."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc(x)
        return self.head(torch.tanh(self.bn(h - h.mean(0, keepdim=True))))


def _batch(n: int):
    return 3.0 * torch.randn(n, 16), torch.randn(n, 4)


SCENARIO = Scenario(case=ModelCase("centered_norm", CenteredNorm, mse_loss, _batch, batch_per_rank=4),
                    plan="fsdp", mesh="dp=2")
MEAN = roles.buffer("bn.running_mean")


def test_a_buffer_scale_is_the_larger_of_its_own_entries_and_its_module_input():
    scales = buffer_scales(
        {"bn.running_mean": torch.zeros(3), "bn.running_var": torch.tensor([9.0, 1.0]),
         "bn.num_batches_tracked": torch.tensor(1), "emb.position_ids": torch.arange(4.0)},
        {"bn": 2.5})
    assert scales == {"bn.running_mean": 2.5, "bn.running_var": 9.0, "emb.position_ids": 3.0}


def test_the_rule_turns_a_rounding_level_difference_of_a_zero_buffer_from_fail_to_pass():
    rtol = OracleTolerance(torch.float32, 2, 10).rtol
    zero, rounded = torch.zeros(4), torch.full((4,), 1.5e-12)
    assert not check_within("b", zero, rounded, rtol).passed  # own scale 0: bound 0
    scale = buffer_scales({"bn.running_mean": zero}, {"bn": 3.0})["bn.running_mean"]
    assert check_within("b", zero, rounded, rtol, scale).passed
    assert not check_within("b", zero, torch.full((4,), 1e-3), rtol, scale).passed


def test_owner_input_scales_records_inputs_of_modules_owning_buffers_only_and_removes_its_hooks():
    model, scales = CenteredNorm().train(), {}
    x = torch.randn(4, 16)
    with owner_input_scales(model, scales), torch.no_grad():
        h = model.fc(x)
        model(x)
    assert set(scales) == {"bn"}
    assert scales["bn"] == pytest.approx(float((h - h.mean(0)).abs().max()))
    with torch.no_grad():
        model(100 * x)
    assert scales["bn"] < 100 and not model.bn._forward_pre_hooks


@pytest.fixture(scope="module")
def ranks():
    return run_stage_parity(SCENARIO, 1, executors=(EAGER,))


@pytest.mark.xdist_group("oracle-calibration")
def test_a_zero_mean_running_statistic_is_bounded_by_its_module_input(ranks):
    """On the analytic bound, not the calibrated one: relative to its own value (~1e-9) the
    running mean needed the calibration here, and where the reference is exactly 0 (mobilevit)
    the calibration cannot help (a bound of 0 stays 0)."""
    report = oracle_check(SCENARIO, ranks)
    assert report.passed, report.summary()
    ref = single_device_reference(SCENARIO)
    assert float(ref.buffers[(0,)]["bn.running_mean"].abs().max()) < 1e-6  # zero-mean in the reference
    checks = [c for c in report.checks if c.name.endswith(MEAN)]
    assert ref.input_scales["bn"] > 0.1
    assert len(checks) == 2 and all(c.scale == pytest.approx(ref.input_scales["bn"]) for c in checks)
    assert not any(calibration.NOTE in c.note for c in checks), report.summary()


@pytest.mark.xdist_group("oracle-calibration")
def test_a_planted_error_in_a_zero_mean_running_statistic_still_fails(ranks, monkeypatch):
    """1e-3 of the input scale added to rank 0's running mean: the oracle fails on it, also after
    the calibration (forced here by a 1e6-fold stricter analytic bound, as in
    test_oracle_calibration), which must not cover it."""
    original = runs.oracle_tolerance

    def strict(*args, **kwargs):
        t = original(*args, **kwargs)
        return OracleTolerance(t.dtype, t.layers, t.width, safety=t.safety * 1e-6)

    buffers = ranks[0].traces[EAGER].buffers[0]
    kept = buffers["bn.running_mean"]
    scale = single_device_reference(SCENARIO).input_scales["bn"]
    buffers["bn.running_mean"] = kept + 1e-3 * scale
    try:
        plain = oracle_check(SCENARIO, ranks)
        monkeypatch.setattr(runs, "oracle_tolerance", strict)
        calibrated = oracle_check(SCENARIO, ranks)
    finally:
        buffers["bn.running_mean"] = kept
    assert {c.name for c in plain.failures()} == {f"rank0/{MEAN}"}, plain.summary()
    assert calibrated.calibration.startswith("calibrated:")
    assert f"rank0/{MEAN}" in {c.name for c in calibrated.failures()}, calibrated.summary()


def test_a_buffer_the_step_leaves_unchanged_keeps_its_own_scale():
    """Only an updated buffer accumulates rounding; a constant one gets no wider bound than its own."""
    buffers = {"bn.running_mean": torch.zeros(3), "bn.gain": torch.full((3,), 0.5)}
    assert buffer_scales(buffers, {"bn": 50.0}, {"bn.running_mean"}) == {"bn.running_mean": 50.0, "bn.gain": 0.5}
    assert buffer_scales(buffers, {"bn": 50.0}) == {"bn.running_mean": 50.0, "bn.gain": 50.0}  # None: every one updated


class GainedCenteredNorm(CenteredNorm):
    """CenteredNorm with a constant buffer on the root module (whose input, x, is large): a gain
    the forward reads and never writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.full((4,), 0.5))

    def forward(self, x):
        return super().forward(x) * self.gain


GAINED = Scenario(case=ModelCase("gained_centered_norm", GainedCenteredNorm, mse_loss, _batch, batch_per_rank=4),
                  plan="fsdp", mesh="dp=2")


@pytest.mark.xdist_group("oracle-calibration")
def test_a_planted_error_in_a_constant_buffer_fails_though_its_module_input_is_large():
    """The negative of the rule's guard: 5x the buffer's own bound planted in the constant gain
    fails the oracle; the module-input scale (the root's input, ~20x the gain) would have passed it."""
    ranks = run_stage_parity(GAINED, 1, executors=(EAGER,))
    ref = single_device_reference(GAINED)
    assert "gain" not in ref.updated and "bn.running_mean" in ref.updated
    assert ref.input_scales[""] > 5 * 0.5
    buffers = ranks[0].traces[EAGER].buffers[0]
    report = oracle_check(GAINED, ranks)
    assert report.passed, report.summary()
    bound = next(c for c in report.checks if c.name == f"rank0/{roles.buffer('gain')}")
    assert bound.scale == pytest.approx(0.5)
    planted = buffers["gain"] + 5 * bound.bound
    kept = buffers["gain"]
    buffers["gain"] = planted
    try:
        failed = oracle_check(GAINED, ranks)
    finally:
        buffers["gain"] = kept
    assert f"rank0/{roles.buffer('gain')}" in {c.name for c in failed.failures()}, failed.summary()
    wide = buffer_scales(ref.buffers[(0,)], ref.input_scales)["gain"]
    assert check_within("gain", ref.buffers[(0,)]["gain"], planted, bound.bound / bound.scale, wide).passed


class ZeroMeanNorm(CenteredNorm):
    """The batch norm sees an exactly zero map: its running mean is written and stays 0.0."""

    def forward(self, x):
        h = self.fc(x)
        return self.head(torch.tanh(self.bn(h - h)))


def test_a_buffer_written_with_its_own_value_counts_as_updated():
    """Written means written (a version bump), not changed: mobilevit's running mean is exactly 0.0
    before and after, and on its own scale (0) its rounding-level difference would fail at ratio inf."""
    scenario = Scenario(case=ModelCase("zero_mean_norm", ZeroMeanNorm, mse_loss, _batch, batch_per_rank=4), plan="fsdp", mesh="dp=2")
    ref = single_device_reference(scenario)
    assert not ref.buffers[(0,)]["bn.running_mean"].any()
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= ref.updated
