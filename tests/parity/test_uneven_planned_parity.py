"""plan="auto" on models whose dims the mesh does not divide, trained on a dp=2,tp=2 gloo world.

Before ``autoparallel.planner.even_shards`` both aborted every rank in gloo ("Received data size
doesn't match expected size"): the planner padded the 3-entry head bias over 4 ranks, the ranks
lowered different graphs and the collective passes bucketed them differently. Now every stage
is bitwise the plan's eager placements and the oracle passes: an MLP whose head has 3 outputs
(and a hidden width of 6, which only one mesh dim divides), and a model that is not an MLP,
``transformers``' ``BertForTokenClassification`` with 3 labels (tiny config, dropout on).

In CI's slow step (the "planned-parity" group, as tests/parity/test_planned_parity.py): each rank
lowers, partitions and compiles for itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from verify.check import check_model
from verify.hf import KeywordInputs, hf_config, token_loss
from verify.model_case import ModelCase

pytestmark = pytest.mark.xdist_group("planned-parity")

LABELS = 3


class _Head3(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, LABELS)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp_batch(n):
    return torch.randn(n, 4, 8), torch.randint(0, LABELS, (n, 4))


def _token_loss(out, target):
    return F.cross_entropy(out.reshape(-1, LABELS), target.reshape(-1))


MLP3 = ModelCase("mlp-head3", _Head3, _token_loss, _mlp_batch, batch_per_rank=2)


def _bert_token3():
    transformers = pytest.importorskip("transformers")
    config = hf_config("bert", num_labels=LABELS)

    def model():
        return KeywordInputs(transformers.BertForTokenClassification(config), ("input_ids", "attention_mask"))

    def batch(n):
        return torch.randint(3, 64, (n, 8)), torch.ones(n, 8, dtype=torch.long), torch.randint(0, LABELS, (n, 8))

    return ModelCase("hf-bert-token3", model, token_loss, batch, batch_per_rank=1)


def _assert_passes(result, head_bias: str):
    result.assert_ok()
    assert set(result.parity) and all(rep.bitwise for rep in result.parity.values())
    assert result.oracle is not None and result.oracle.passed
    # The 3-entry bias cannot shard evenly over either mesh dim: replicated, not padded.
    assert result.run.planned.solution.params[head_bias] == {"dp": "R", "tp": "R"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_three_output_head_trains_bitwise_on_a_2x2_world():
    _assert_passes(check_model(MLP3, plan="auto", mesh="dp=2,tp=2", steps=2), "fc2.bias")


@pytest.mark.slow
@pytest.mark.slow_full  # CI keeps the class on our three-output head (above); this cell took 86 s of it
@pytest.mark.timeout(1500)
def test_a_token_classifier_with_three_labels_trains_bitwise_on_a_2x2_world():
    _assert_passes(check_model(_bert_token3(), plan="auto", mesh="dp=2,tp=2", steps=2), "model.classifier.bias")
