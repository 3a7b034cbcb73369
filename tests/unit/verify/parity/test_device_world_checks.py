"""The checks of verify.parity.device_world that need no world: the tolerance Inductor is judged
by, the bitwise report over ranks, the cells and the runner's refusals."""

from __future__ import annotations

import pytest
import torch

from autoparallel.runtime import to_cpu
from autoparallel.runtime.steps import StepTrace
from verify.parity.device_world import (
    EAGER,
    INDUCTOR_RTOL,
    STAGED_KERNELS,
    DeviceCell,
    DeviceRank,
    bitwise_report,
    error_line,
    host_staged_collectives,
    run_device_parity,
    tolerance_checks,
    worst_ratio,
)


def _trace(loss: float, grads: dict[str, torch.Tensor]) -> StepTrace:
    t = StepTrace()
    t.losses, t.grads = [torch.tensor(loss)], [grads]
    return t


def _grads(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {"mlp.w": torch.tensor([1.0, -2.0]) * scale, "mlp.b": torch.tensor([1e-6, 0.0]) * scale, "head.w": torch.tensor([4.0])}


def test_a_run_equal_to_the_reference_passes_with_nothing_to_spare():
    checks = tolerance_checks(_trace(2.0, _grads()), _trace(2.0, _grads()))
    assert [c.name for c in checks] == ["step0/loss", "step0/grad:head.w", "step0/grad:mlp.b", "step0/grad:mlp.w"]
    assert all(c.passed for c in checks) and worst_ratio(checks) == 0.0


def test_a_gradient_is_judged_by_its_modules_largest_entry():
    """mlp.b's entries are ~1e-6: an error of 1e-7 is 10% of it, but 5e-8 of mlp's scale (2.0)."""
    got = _grads()
    got["mlp.b"] = got["mlp.b"] + 1e-7
    checks = {c.name: c for c in tolerance_checks(_trace(2.0, _grads()), _trace(2.0, got))}
    assert checks["step0/grad:mlp.b"].scale == 2.0 and checks["step0/grad:mlp.b"].passed


def test_an_error_beyond_the_bound_fails_and_is_named():
    got = _grads()
    got["mlp.w"] = got["mlp.w"] + torch.tensor([0.0, 3 * INDUCTOR_RTOL * 2.0])
    checks = tolerance_checks(_trace(2.0, _grads()), _trace(2.0, got))
    failed = [c.name for c in checks if not c.passed]
    assert failed == ["step0/grad:mlp.w"]
    assert worst_ratio(checks) == pytest.approx(3.0, rel=1e-3)


def test_a_loss_off_by_more_than_the_bound_fails():
    checks = tolerance_checks(_trace(2.0, _grads()), _trace(2.0 * (1 + 3 * INDUCTOR_RTOL), _grads()))
    assert [c.name for c in checks if not c.passed] == ["step0/loss"]


def test_a_missing_gradient_or_a_nan_never_passes():
    got = _grads()
    del got["head.w"]
    got["mlp.w"] = torch.tensor([float("nan"), -2.0])
    checks = {c.name: c for c in tolerance_checks(_trace(2.0, _grads()), _trace(2.0, got))}
    assert not checks["step0/grad:head.w"].passed and not checks["step0/grad:mlp.w"].passed
    assert worst_ratio(checks.values()) == float("inf")


def test_runs_of_other_lengths_are_refused():
    longer = _trace(2.0, _grads())
    longer.losses.append(torch.tensor(1.0))
    longer.grads.append(_grads())
    with pytest.raises(ValueError, match="ran 1 steps, the other run 2"):
        tolerance_checks(_trace(2.0, _grads()), longer)


def _rank(rank: int, traces: dict[str, StepTrace], errors: dict[str, str] | None = None) -> DeviceRank:
    return DeviceRank(rank, "gloo", "cpu", traces, errors=errors or {})


def test_the_bitwise_report_covers_every_rank_and_names_a_difference():
    ref = _trace(2.0, _grads())
    off = _trace(2.0, {**_grads(), "head.w": torch.tensor([4.0 + 2**-20])})
    report = bitwise_report([_rank(0, {EAGER: ref, "aot_eager": ref}), _rank(1, {EAGER: ref, "aot_eager": off})], "aot_eager")
    assert not report.bitwise
    assert [d.name for d in report.mismatches()] == ["rank1/step0/grad:head.w"]


def test_an_executor_that_did_not_run_is_an_error_that_quotes_its_failure():
    ref = _trace(2.0, _grads())
    ranks = [_rank(0, {EAGER: ref}, {"inductor": "Traceback ...\nRuntimeError: no Triton"}), _rank(1, {EAGER: ref})]
    with pytest.raises(AssertionError, match=r"inductor did not run on rank\(s\) \[0, 1\]: RuntimeError: no Triton; no error recorded"):
        bitwise_report(ranks, "inductor")


def test_a_trace_leaves_the_rank_on_the_cpu_with_every_field():
    t = _trace(2.0, _grads())
    t.buffers = [{"bn.mean": torch.ones(2)}]
    t.params = {"w": torch.zeros(1)}
    t.optimizer_state = {"w": {"exp_avg": torch.zeros(1)}}
    out = to_cpu(t)
    assert out.losses[0] is not t.losses[0] and torch.equal(out.losses[0], t.losses[0])
    assert out.grads[0].keys() == t.grads[0].keys() and out.buffers[0].keys() == {"bn.mean"}
    assert out.params.keys() == {"w"} and out.optimizer_state == {"w": {"exp_avg": torch.zeros(1)}}


def test_a_cell_names_a_preset_or_a_transformers_architecture():
    assert DeviceCell("tiny").scenario().model_case is None
    assert DeviceCell("tiny", mesh="dp=4").scenario().mesh_spec.world_size == 4
    assert DeviceCell("hf:gpt2").label == "hf:gpt2 fsdp dp=2"


def test_the_runner_refuses_unknown_compilers_devices_and_a_cuda_it_cannot_see():
    with pytest.raises(ValueError, match=r"unknown compilers \['tvm'\]"):
        run_device_parity(DeviceCell(), ("aot_eager", "tvm"), device="cpu")
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        run_device_parity(DeviceCell(), device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="sees no CUDA device"):
            run_device_parity(DeviceCell(), device="cuda")


def test_the_staged_kernels_are_the_cuda_ones_inside_the_scope_only():
    def cuda_kernels() -> list[str]:
        return [n for n in STAGED_KERNELS if torch._C._dispatch_has_kernel_for_dispatch_key(f"_c10d_functional::{n}", "CUDA")]

    before = cuda_kernels()
    with host_staged_collectives():
        assert cuda_kernels() == list(STAGED_KERNELS)
    assert cuda_kernels() == before


def test_the_error_line_is_the_exception_not_dynamos_advice_after_it():
    dynamo = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
              "torch._dynamo.exc.BackendCompilerFailed: backend='backend' raised:\nTypeError: f() got an unexpected keyword\n\n"
              "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    assert error_line(dynamo) == "TypeError: f() got an unexpected keyword"
    assert error_line("Traceback\nRuntimeError: no Triton\n") == "RuntimeError: no Triton"
    assert error_line("no exception named\nlast words") == "last words"
