"""verify.parity.sac_memory: eager and traced SAC put on a transformers model from outside (its
block list found, its blocks checkpointed), and their peak memory on the CPU. The CUDA figures
are tests/gpu/test_gpu_memory.py's."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from verify.graphs.memory import compare_peaks, peak_memory, ratio
from verify.hf import hf_case, token_loss
from verify.parity.sac_memory import (
    EAGER_SAC,
    TRACED_SAC,
    block_list,
    checkpoint_blocks,
    hf_sac_peaks,
)

if importlib.util.find_spec("transformers") is None:
    pytest.skip("needs transformers (the test extra)", allow_module_level=True)

pytestmark = pytest.mark.xdist_group("hf-tier")  # the one tier worker that imports transformers

MAX_SAC_PEAK_RATIO = 1.10  # as tests/unit/autoparallel/trainer/test_trainer_memory.py
# On the CPU, eager dropout draws its mask with bernoulli_ and scales it with div_ in place; op SAC
# saves the random op's output, so the in-place scale mutates a saved tensor and checkpoint refuses
# (test_on_cpu_eager_sac_refuses_the_dropout_mask_it_saved_then_scaled). CUDA's fused
# native_dropout has no such step: the GPU test keeps the library's dropout.
NO_DROPOUT = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)


def _gpt2(**overrides):
    return hf_case("gpt2", attention_mask=True, **overrides).build()  # _tokens gives tokens and their mask


def _tokens(n: int = 2, seq: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 64, (n, seq), generator=g), torch.ones(n, seq, dtype=torch.long), torch.randint(3, 64, (n, seq), generator=g)


def test_the_block_list_is_the_largest_list_of_one_class():
    parent, name = block_list(_gpt2())
    assert name == "h" and type(parent).__name__ == "GPT2Model"
    parent, name = block_list(hf_case("bert").build())
    assert name == "layer" and type(parent).__name__ == "BertEncoder"


def test_a_model_without_a_block_list_is_refused():
    mixed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]))
    with pytest.raises(ValueError, match="Sequential has no nn.ModuleList of blocks of one class"):
        block_list(mixed)


def _step(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = token_loss(model(*inputs[:2]), inputs[2])
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_checkpointed_blocks_compute_what_the_model_does_and_keep_less():
    inputs = _tokens(4, 32)
    plain, sac = _gpt2(**NO_DROPOUT, n_layer=4), checkpoint_blocks(_gpt2(**NO_DROPOUT, n_layer=4))
    loss, grads = _step(plain, inputs)
    sac_loss, sac_grads = _step(sac, inputs)
    assert torch.equal(loss, sac_loss)
    assert grads.keys() == sac_grads.keys() and all(torch.equal(grads[k], sac_grads[k]) for k in grads)
    # Checkpointed for real: the blocks' activations are recomputed, not kept.
    assert peak_memory(lambda: _step(sac, inputs), device="cpu").peak < peak_memory(lambda: _step(plain, inputs), device="cpu").peak


def test_on_cpu_eager_sac_refuses_the_dropout_mask_it_saved_then_scaled():
    sac = checkpoint_blocks(_gpt2(attn_pdrop=0.0, embd_pdrop=0.0))  # resid_pdrop: the library's 0.1
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
        _step(sac, _tokens())


@pytest.mark.slow
def test_gpt2_traced_sac_peak_within_limit_of_eager_sac_on_cpu():
    peaks, losses = hf_sac_peaks("gpt2", batch=4, seq=64, device="cpu", n_embd=128, n_layer=4, n_head=4, n_positions=64, **NO_DROPOUT)
    print("\n" + compare_peaks(peaks, reference=EAGER_SAC))
    assert torch.equal(losses[EAGER_SAC], losses[TRACED_SAC])
    assert ratio(peaks[TRACED_SAC], peaks[EAGER_SAC]) <= MAX_SAC_PEAK_RATIO, compare_peaks(peaks, reference=EAGER_SAC)


def test_only_token_tasks_are_measured():
    with pytest.raises(ValueError, match="'resnet' is not a causal or masked LM"):
        hf_sac_peaks("resnet")
