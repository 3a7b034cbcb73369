"""verify.parity.device_world on the CPU: the code that .ci/gpu runs on one GPU (tests/gpu/
test_gpu_compile.py), run here on forked gloo ranks, so that CI without a GPU checks it.

In the tier: the tiny LLaMA preset under FSDP, eager twice and the aot_eager second compile, all
bitwise. In the slow step: the same graphs compiled by Inductor (C++ on the CPU), which must be
within the stated tolerance and, since Inductor reorders sums, not bitwise (were the pipeline's
``compiler`` option ignored, the run would be aot_eager's, and bitwise).
"""

from __future__ import annotations

import pytest

from verify.parity.device_world import (
    EAGER,
    EAGER_AGAIN,
    DeviceCell,
    bitwise_report,
    run_device_parity,
    summary,
    tolerance_checks,
    worst_ratio,
)

CELL = DeviceCell("tiny", "fsdp", "dp=2")


def test_on_cpu_eager_repeats_and_the_aot_eager_second_compile_are_bitwise():
    ranks = run_device_parity(CELL, ("aot_eager",), device="cpu", steps=2, timeout_s=180)
    print(summary(CELL, ranks))
    assert [(r.rank, r.backend, r.device) for r in ranks] == [(0, "gloo", "cpu"), (1, "gloo", "cpu")]
    assert not any(r.errors for r in ranks), [r.errors for r in ranks]
    assert ranks[0].traces[EAGER].losses[0] != ranks[1].traces[EAGER].losses[0], "the ranks saw the same data"
    for name in (EAGER_AGAIN, "aot_eager"):
        report = bitwise_report(ranks, name)
        eager = ranks[0].traces[EAGER]
        assert len(report.diffs) == 2 * 2 * (1 + len(eager.grads[0]) + len(eager.buffers[0]))  # ranks x steps x tensors
        report.assert_bitwise()
    assert "aot_eager: bitwise" in summary(CELL, ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_cpu_the_inductor_second_compile_is_within_tolerance_and_not_bitwise():
    ranks = run_device_parity(CELL, ("inductor",), device="cpu", steps=2, timeout_s=500)
    print(summary(CELL, ranks))
    assert not any(r.errors for r in ranks), [r.errors for r in ranks]
    for r in ranks:
        checks = tolerance_checks(r.traces[EAGER], r.traces["inductor"])
        assert worst_ratio(checks) <= 1.0, [c for c in checks if not c.passed][:5]
    assert not bitwise_report(ranks, "inductor").bitwise, "Inductor reorders sums: bitwise means it did not compile"
