"""Randomness in training is bitwise: dropout through every stage on gloo.

Every executor of a rank trains with the CPU generator seeded per step (``train_steps(seed=)``,
``verify.parity_runs.rank_seed``: one seed per data-parallel slice), so the eager parallel
program and each stage's graphs draw the same masks in the same order; the single-device oracle
draws each slice's masks with that slice's seed. Random ops are saved, never recomputed
(``autoparallel.ac.is_random``): a replay on CPU would draw another mask for the backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoparallel import ac
from verify import parity_runs
from verify.model_case import ModelCase
from verify.parity_runs import COMPILE_EXECUTORS, EAGER, oracle_executor, run_compile_parity
from verify.planned_parity import EXECUTORS as PLANNED_EXECUTORS
from verify.planned_parity import (
    planned_case,
    planned_oracle,
    run_planned_parity,
    single_device_replay,
)
from verify.random_ops import DROPOUT_OFF
from verify.scenario import Scenario

aten = torch.ops.aten


class DropoutMLP(nn.Module):
    """Not LLaMA: LayerNorm, biased Linears, GELU, an nn.Dropout module and a functional dropout."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = x + self.down(self.drop(nn.functional.gelu(self.up(self.norm(x)))))
        return self.head(nn.functional.dropout(h, p=0.2, training=self.training))


def _batch(n):
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


CASE = ModelCase("dropout_mlp", DropoutMLP, nn.functional.cross_entropy, _batch, batch_per_rank=2)


class SharedEmbeddingEncoderDecoder(nn.Module):
    """T5's and BART's shape in small: an encoder and a decoder read one embedding, with dropout
    on both branches. Bucketing the all-gathers used to move the decoder's embedding dropout
    ahead of the encoder's second one (patch ``random_op_order``)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.enc = nn.Linear(16, 16)
        self.dec = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)

    def forward(self, src, tgt):
        memory = self.drop(self.enc(self.drop(self.embed(src))))
        h = self.dec(self.drop(self.embed(tgt)) + memory.mean(1, keepdim=True))
        return self.head(self.drop(h))


def _token_loss(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _seq2seq_batch(n):
    return torch.randint(0, 32, (n, 8)), torch.randint(0, 32, (n, 8)), torch.randint(0, 32, (n, 8))


SEQ2SEQ = ModelCase("seq2seq_dropout", SharedEmbeddingEncoderDecoder, _token_loss, _seq2seq_batch, batch_per_rank=2)

pytestmark = pytest.mark.xdist_group("random-ops")


def test_dropout_is_bitwise_at_every_stage_and_matches_the_oracle(model_check):
    result = model_check(CASE, plan="fsdp", mesh="dp=2")
    assert set(result.parity) == {"joint", "cleanup", "fsdp_tagging", "first_partition", "second_compile",
                                  "collective_passes"}
    # dropout really ran: the joint graph draws masks
    assert any(n.target is aten.native_dropout.default for n in result.run.stage("joint").graphs.graph.nodes)


@pytest.mark.slow  # 9 s; in the tier, test_random_order.py guards the pass on a hand-built graph
def test_an_encoder_and_a_decoder_reading_one_embedding_are_bitwise_at_every_stage(model_check):
    """Failed before the collective passes kept the random ops' order: 'second_compile' and
    'collective_passes' trained differently (T5 and BART under fsdp dp=2: loss off by 0.3)."""
    model_check(SEQ2SEQ, plan="fsdp", mesh="dp=2")


def test_without_seeding_the_stages_differ(monkeypatch):
    """The negative side: every executor drawing from wherever the generator stood (as before)."""
    unseeded = parity_runs.train_steps

    def train_steps(*args, seed=None, **kwargs):
        return unseeded(*args, **kwargs)

    monkeypatch.setattr(parity_runs, "train_steps", train_steps)
    ranks = run_compile_parity(Scenario(case=CASE, plan="fsdp", mesh="dp=2"))
    assert not parity_runs.compare_with_eager(ranks, "first_partition").bitwise


def test_a_rank_with_another_seed_fails_the_oracle(monkeypatch):
    """Rank 1 draws other masks than the single-device reference draws for its slice: the stages
    still agree with each other (they share the rank's seed), the oracle does not."""
    seed_of = parity_runs.rank_seed

    def rank_seed(scenario, coord):
        other = dist.is_initialized() and dist.get_rank() == 1
        return seed_of(scenario, coord) + (1 if other else 0)

    monkeypatch.setattr(parity_runs, "rank_seed", rank_seed)
    scenario = Scenario(case=CASE, plan="fsdp", mesh="dp=2")
    ranks = parity_runs.run_stage_parity(scenario, 1, executors=COMPILE_EXECUTORS)
    assert parity_runs.compare_with_eager(ranks, "second_compile").bitwise
    oracle = parity_runs.oracle_check(scenario, ranks)
    assert not oracle.passed, oracle.summary()


def test_joint_ac_saves_random_ops_and_stays_bitwise():
    """The joint AC policy says MUST_SAVE for random ops (a recompute on CPU draws a new mask);
    AOT's partitioners also refuse to recompute them, so the parity half holds either way: it
    shows the AC pass keeps dropout bitwise, the policy assertion guards the rule."""
    assert ac.op_sac_policy(aten.native_dropout.default) is torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    assert ac.is_random(aten.bernoulli.p) and not ac.is_random(aten.mm.default)
    ranks = run_compile_parity(Scenario(case=CASE, plan="fsdp", mesh="dp=2"), enable_ac=True)
    for executor in COMPILE_EXECUTORS:
        if executor != EAGER:
            parity_runs.compare_with_eager(ranks, executor).assert_bitwise()


@pytest.mark.slow  # a planned parity world (each rank plans, lowers and compiles): CI's slow step
def test_plan_auto_is_bitwise_with_dropout_and_its_oracle_switches_dropout_off_on_both_sides():
    """Under plan="auto" a rank's mask of its shard of an activation is no slice of the unsharded
    model's: the stages are bitwise with dropout on (each rank draws alike in every executor), the
    oracle compares with dropout off on both sides and says so. Negative: off on one side only."""
    case = planned_case(Scenario(case=CASE, plan="auto", mesh="dp=2"))
    ((_, ranks),) = run_planned_parity(case, 2)
    for executor in PLANNED_EXECUTORS[1:]:
        parity_runs.compare_with_eager(ranks, executor).assert_bitwise()
    assert oracle_executor(ranks) == DROPOUT_OFF
    report = planned_oracle(case, ranks)
    assert report.passed and "dropout off on both sides" in report.summary(), report.summary()
    one_side = planned_oracle(case, ranks, single_device_replay(case, ranks, EAGER))  # the reference drops
    assert not one_side.passed, one_side.summary()


class _ShardedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.25)
        self.proj = nn.Linear(32, 16)

    def forward(self, x):
        return self.proj(self.drop(nn.functional.gelu(self.fc(x))))


class TPDropoutMLP(nn.Module):
    """Dropout inside a TP region: on the colwise Linear's sharded activation."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = _ShardedDropout()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(x + self.mlp(self.norm(x)))


TP_CASE = ModelCase("tp_dropout_mlp", TPDropoutMLP, nn.functional.cross_entropy, _batch, batch_per_rank=2,
                    tp_rules={"mlp.fc.weight": "colwise", "mlp.proj.weight": "rowwise"}, tp_regions=("mlp",))


@pytest.mark.slow  # a second world of every stage; the tier keeps dropout's fsdp world above
def test_dropout_on_tp_shards_is_bitwise_and_its_oracle_switches_dropout_off_on_both_sides(model_check):
    """A rank's mask of its TP shard is no slice of any mask the unsharded model draws: the stages
    are bitwise with dropout on, the oracle compares with dropout off on both sides and says so.
    Negative: the per-slice reference (dropout on) against the eager program fails."""
    result = model_check(TP_CASE, plan="fsdp_tp", mesh="dp=1,tp=2")
    assert "dropout off on both sides" in result.oracle.summary()
    ranks = parity_runs.run_stage_parity(Scenario(case=TP_CASE, plan="fsdp_tp", mesh="dp=1,tp=2"), 1,
                                         executors=(EAGER,))
    assert oracle_executor(ranks) == DROPOUT_OFF
    on = parity_runs.oracle_check(Scenario(case=TP_CASE, plan="fsdp_tp", mesh="dp=1,tp=2"), ranks, EAGER)
    assert not on.passed, on.summary()
