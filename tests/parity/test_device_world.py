"""verify.parity.device_world on the CPU: the code that .ci/gpu runs on one GPU (tests/gpu/
test_gpu_compile.py), run here on forked gloo ranks, so that CI without a GPU checks it.

In the tier: the host-staged collectives' kernels (what a one-GPU world runs instead of gloo's
CUDA collectives), called on CPU tensors against gloo's own. In the slow step (the tier has the
second compile's parity on the same world: test_compile_parity.py): the tiny LLaMA preset under
FSDP, eager twice and the aot_eager second compile, all bitwise. Outside CI (``slow_full``): the
same graphs compiled by Inductor (C++ on the CPU), which must be within the stated tolerance and,
since Inductor reorders sums, not bitwise (were the pipeline's ``compiler`` option ignored, the run
would be aot_eager's, and bitwise).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autoparallel.runtime import run_on_world
from verify.parity import device_world
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


def _staged_against_gloo(rank: int, world_size: int) -> dict[str, bool]:
    g, c = dist.group.WORLD.group_name, torch.ops._c10d_functional
    x = torch.arange(4.0) + 10 * rank
    gathered = c.wait_tensor(c.all_gather_into_tensor(x, 2, g))
    out = torch.empty(8)
    device_world._all_gather_out(x, 2, g, out=out)
    bc = x.clone()
    device_world._broadcast_inplace(bc, 1, g)
    return {
        "all_gather": torch.equal(device_world._all_gather(x, 2, g), gathered),
        "all_gather out": torch.equal(out, gathered),
        "all_gather coalesced": all(torch.equal(a, c.wait_tensor(b)) for a, b in zip(
            device_world._all_gather_coalesced([x, 2 * x], 2, g), c.all_gather_into_tensor_coalesced([x, 2 * x], 2, g), strict=True)),
        "all_to_all": torch.equal(device_world._all_to_all(x, [2, 2], [2, 2], g), c.wait_tensor(c.all_to_all_single(x, [2, 2], [2, 2], g))),
        "broadcast": torch.equal(device_world._broadcast(x, 0, g), torch.arange(4.0)),
        "broadcast in place": torch.equal(bc, torch.arange(4.0) + 10),
        "gathered the ranks": torch.equal(gathered, torch.cat([torch.arange(4.0), torch.arange(4.0) + 10])),
    }


def test_the_host_staged_kernels_compute_what_gloo_does():
    for rank, checks in enumerate(run_on_world(_staged_against_gloo, 2, timeout_s=60)):
        assert all(checks.values()), (rank, checks)
    assert set(device_world.STAGED_KERNELS) == {"all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
                                                "all_to_all_single", "broadcast", "broadcast_"}


@pytest.mark.slow
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
@pytest.mark.slow_full  # 85 s of cold compiles; CI keeps this world's aot_eager run (above) and Inductor
# through the pipeline's backend (tests/unit/autoparallel/test_compile.py's smoke test)
@pytest.mark.timeout(600)
def test_on_cpu_the_inductor_second_compile_is_within_tolerance_and_not_bitwise():
    ranks = run_device_parity(CELL, ("inductor",), device="cpu", steps=2, timeout_s=500)
    print(summary(CELL, ranks))
    assert not any(r.errors for r in ranks), [r.errors for r in ranks]
    for r in ranks:
        checks = tolerance_checks(r.traces[EAGER], r.traces["inductor"])
        assert worst_ratio(checks) <= 1.0, [c for c in checks if not c.passed][:5]
    assert not bitwise_report(ranks, "inductor").bitwise, "Inductor reorders sums: bitwise means it did not compile"
