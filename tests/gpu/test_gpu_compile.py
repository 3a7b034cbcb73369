"""The second compile on CUDA: a two-rank gloo world on one GPU (verify.parity.device_world).

For the tiny LLaMA preset and two transformers architectures at their library defaults (dropout
on): eager twice (the device's kernels are deterministic, or nothing could be bitwise), the
pipeline's second compile under aot_eager (bitwise with eager) and under Inductor, Triton kernels
(within ``INDUCTOR_RTOL`` of eager, random ops falling back to ATen's so that dropout draws eager's
masks). Both ranks bind the one GPU over gloo, which moves CUDA tensors through host memory (NCCL
refuses two ranks on one device), and report their own peak memory. Skipped without CUDA;
``.ci/gpu`` runs them. tests/parity/test_device_world.py runs the same code on the CPU.
"""

from __future__ import annotations

import pytest
import torch

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

CELLS = (DeviceCell("tiny"), DeviceCell("hf:gpt2"), DeviceCell("hf:bert"))


@pytest.fixture(scope="module", params=CELLS, ids=lambda c: c.model)
def cuda_world(request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cell = request.param
    ranks = run_device_parity(cell, device="cuda", steps=2, timeout_s=900)
    print("\n" + summary(cell, ranks))
    return cell, ranks


@pytest.mark.gpu
@pytest.mark.timeout(960)
def test_two_ranks_share_one_gpu_over_gloo(cuda_world):
    _, ranks = cuda_world
    assert [(r.backend, r.device) for r in ranks] == [("gloo", f"cuda:{torch.cuda.current_device()}")] * 2
    assert all(r.peaks[EAGER]["allocated"] > 0 for r in ranks), "each rank measures its own peak"
    assert ranks[0].traces[EAGER].losses[0] != ranks[1].traces[EAGER].losses[0], "the ranks saw the same data"


@pytest.mark.gpu
@pytest.mark.timeout(960)
def test_eager_is_reproducible_on_cuda(cuda_world):
    bitwise_report(cuda_world[1], EAGER_AGAIN).assert_bitwise()


@pytest.mark.gpu
@pytest.mark.timeout(960)
def test_the_aot_eager_second_compile_is_bitwise_on_cuda(cuda_world):
    bitwise_report(cuda_world[1], "aot_eager").assert_bitwise()


@pytest.mark.gpu
@pytest.mark.timeout(960)
def test_the_inductor_second_compile_is_within_tolerance_on_cuda(cuda_world):
    _, ranks = cuda_world
    report = bitwise_report(ranks, "inductor")  # raises, quoting the error, if Inductor failed
    assert not report.bitwise, "Triton kernels bitwise with eager: Inductor did not compile these graphs"
    for r in ranks:
        checks = tolerance_checks(r.traces[EAGER], r.traces["inductor"])
        assert worst_ratio(checks) <= 1.0, [c for c in checks if not c.passed][:5]
