"""Graph trainer peak memory on CUDA, from the caching allocator (reserved and active peaks).

The same comparisons as tests/unit/autoparallel/trainer/test_trainer_memory.py (which measures on CPU everywhere):
traced op SAC + remat vs eager ``apply_ac(model, "op")`` within 1.10x, grad-mode-on execution
clearly higher, remat lower than the same tagged graph without remat. Plus a per-rank
comparison on a 2-GPU NCCL world through the same entry point the CPU gloo test uses.
Skipped (with a reason) without CUDA; ``--ap-require-gpu`` turns the skips into failures, and
``.ci/gpu`` runs them (a skip there fails the run).
"""

from __future__ import annotations

import pytest
import torch

from autoparallel.patches import disabled
from autoparallel.trainer import run_traced
from verify.graphs.memory import compare_peaks, peak_memory, ratio
from verify.parity.launch import run_gated
from verify.parity.sac_memory import EAGER_SAC, TRACED_SAC, hf_sac_peaks
from verify.parity.trainer import (
    cross_entropy_loss,
    make_batches,
    make_model,
    rank_sac_memory,
    traced_sac_step,
)

PRESET = "debug"
BATCH = 8
MAX_SAC_PEAK_RATIO = 1.10
MIN_GRAD_MODE_RATIO = 1.3
MAX_REMAT_RATIO = 0.85


@pytest.fixture(scope="module")
def cuda_peaks():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = "cuda:0"
    tokens, targets = make_batches(PRESET, steps=1, batch=BATCH, device=device)[0]
    eager = make_model(PRESET, ac="op", regions=False, device=device)
    traced = make_model(PRESET, device=device)
    sac = traced_sac_step(PRESET, batch=BATCH, device=device)
    tagged_only = traced_sac_step(PRESET, batch=BATCH, device=device, remat=False)
    losses = {}

    def eager_step():
        eager.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(eager(tokens), targets)
        loss.backward()
        losses["eager SAC"] = loss.detach()

    def traced_step(step, name):
        def run():
            traced.zero_grad(set_to_none=True)
            losses[name] = run_traced(step, traced, (tokens, targets))

        return run

    out = {
        "eager SAC": peak_memory(eager_step, device=device),
        "traced SAC+remat": peak_memory(traced_step(sac, "traced SAC+remat"), device=device),
        "traced SAC, no remat": peak_memory(traced_step(tagged_only, "no remat"), device=device),
    }
    with disabled("traced_no_grad"):
        out["traced SAC+remat, grad mode on"] = peak_memory(
            traced_step(sac, "grad mode on"), device=device
        )
    print("\n" + compare_peaks(out, reference="eager SAC"))
    for name, loss in losses.items():
        assert torch.equal(loss, losses["eager SAC"]), name
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["reserved", "active"])
def test_cuda_traced_sac_peak_within_limit_of_eager_sac(cuda_peaks, metric):
    r = ratio(cuda_peaks["traced SAC+remat"], cuda_peaks["eager SAC"], metric)
    print(f"traced SAC / eager SAC {metric} peak on CUDA: {r:.3f} (limit {MAX_SAC_PEAK_RATIO})")
    assert r <= MAX_SAC_PEAK_RATIO, compare_peaks(cuda_peaks, reference="eager SAC")


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["peak", "active"])
def test_cuda_no_grad_execution_lowers_peak(cuda_peaks, metric):
    r = ratio(cuda_peaks["traced SAC+remat, grad mode on"], cuda_peaks["traced SAC+remat"], metric)
    assert r >= MIN_GRAD_MODE_RATIO, compare_peaks(cuda_peaks, reference="traced SAC+remat")


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["peak", "active"])
def test_cuda_remat_lowers_traced_peak(cuda_peaks, metric):
    r = ratio(cuda_peaks["traced SAC+remat"], cuda_peaks["traced SAC, no remat"], metric)
    assert r <= MAX_REMAT_RATIO, compare_peaks(cuda_peaks, reference="traced SAC, no remat")


@pytest.fixture(scope="module")
def gpt2_cuda_peaks():
    """GPT-2 from transformers at its library defaults (dropout on), 4 layers of 256, 256 tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    peaks, losses = hf_sac_peaks("gpt2", batch=8, seq=256, device="cuda:0", n_embd=256, n_layer=4, n_head=4, n_positions=256)
    print("\n" + compare_peaks(peaks, reference=EAGER_SAC))
    assert torch.equal(losses[EAGER_SAC], losses[TRACED_SAC]), losses
    return peaks


@pytest.mark.gpu
@pytest.mark.parametrize("metric", ["reserved", "active"])
def test_cuda_gpt2_traced_sac_peak_within_limit_of_eager_sac(gpt2_cuda_peaks, metric):
    r = ratio(gpt2_cuda_peaks[TRACED_SAC], gpt2_cuda_peaks[EAGER_SAC], metric)
    print(f"GPT-2 traced SAC / eager SAC {metric} peak on CUDA: {r:.3f} (limit {MAX_SAC_PEAK_RATIO})")
    assert r <= MAX_SAC_PEAK_RATIO, compare_peaks(gpt2_cuda_peaks, reference=EAGER_SAC)


@pytest.mark.multigpu(2)
@pytest.mark.timeout(420)  # above run_gated's own 300 s limit, which names the ranks still running
def test_per_rank_sac_peak_on_nccl():
    """Each rank: traced SAC vs eager SAC peak (reserved and active) after an NCCL all-reduce."""
    results = run_gated(rank_sac_memory, 2, args=(PRESET, BATCH), require_gpu=True, timeout_s=300)
    for res in results:
        print(
            f"rank {res['rank']} ({res['device']}): traced/eager SAC reserved "
            f"{res['ratio_reserved']:.3f}, active {res['ratio_active']:.3f}, "
            f"max |grad diff| {res['max_grad_diff']:.2e}"
        )
        assert res["device"] == f"cuda:{res['rank']}"
        assert res["loss_equal"], f"rank {res['rank']}: losses differ"
        assert res["max_grad_diff"] < 1e-5
        assert res["ratio_reserved"] <= MAX_SAC_PEAK_RATIO
        assert res["ratio_active"] <= MAX_SAC_PEAK_RATIO
