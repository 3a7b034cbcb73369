"""Randomness in training is bitwise: dropout through every stage on gloo.

Every executor of a rank trains with the CPU generator seeded per step (``train_steps(seed=)``,
``verify.parity.runs.rank_seed``: one seed per data-parallel slice), so the eager parallel
program and each stage's graphs draw the same masks in the same order; the single-device oracle
draws each slice's masks with that slice's seed. Random ops are saved, never recomputed
(``autoparallel.ac.is_random``): a replay on CPU would draw another mask for the backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoparallel import ac, partition, roles
from autoparallel import meta as M
from autoparallel.parallelize import ParallelPlan
from verify.check import check_model
from verify.graphs.canon import own_scope
from verify.model_case import ModelCase
from verify.parity import runs as parity_runs
from verify.parity.planned import EXECUTORS as PLANNED_EXECUTORS
from verify.parity.planned import (
    planned_case,
    planned_oracle,
    run_planned_parity,
    single_device_replay,
)
from verify.parity.random_ops import DROPOUT_OFF
from verify.parity.runs import COMPILE_EXECUTORS, EAGER, oracle_executor, run_compile_parity
from verify.stages import rank_context
from verify.stages.scenario import Scenario

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
    # dropout really ran: the joint graph draws masks, as eager's CPU dropout draws them (patch eager_dropout)
    assert any(n.target is aten.bernoulli.p for n in result.run.stage("joint").graphs.graph.nodes)


@pytest.mark.slow  # 9 s; in the tier, test_random_order.py guards the pass on a hand-built graph
def test_an_encoder_and_a_decoder_reading_one_embedding_are_bitwise_at_every_stage(model_check):
    """Failed before the collective passes kept the random ops' order: 'second_compile' and
    'collective_passes' trained differently (T5 and BART under fsdp dp=2: loss off by 0.3)."""
    model_check(SEQ2SEQ, plan="fsdp", mesh="dp=2")


def test_without_seeding_the_stages_differ(monkeypatch):
    """The negative side: every executor drawing from wherever the generator stood (as before)."""
    unseeded = rank_context.train_steps

    def train_steps(*args, seed=None, **kwargs):
        return unseeded(*args, **kwargs)

    monkeypatch.setattr(rank_context, "train_steps", train_steps)
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


class InPlaceDropoutClassifier(nn.Module):
    """mobilenet_v1/v2's classifier in small: pooled features, ``nn.Dropout(inplace=True)`` (ATen's
    ``dropout_``, which has no Python decomposition), a Linear."""

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.5, inplace=True)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x):
        return self.classifier(self.drop(torch.relu(self.features(x)).mean(1)))


def _pooled_batch(n):
    return torch.randn(n, 8, 16), torch.randint(0, 4, (n,))


IN_PLACE_CASE = ModelCase("in_place_dropout_classifier", InPlaceDropoutClassifier, nn.functional.cross_entropy,
                          _pooled_batch, batch_per_rank=2)


@pytest.mark.slow  # plan="auto" parity worlds (each rank plans, lowers and compiles): CI's slow step
@pytest.mark.parametrize("plan, mesh", [("auto", "dp=2"), ("auto", "dp=2,tp=2"), ("fsdp", "dp=2")])
def test_in_place_dropout_under_auto_is_switched_off_on_both_sides(plan, mesh):
    """An in-place dropout (docs/failure-classes.md 13c): under auto the planner's trace made it
    bernoulli_ -> div_ -> mul_, a random op no switch knew, so it stayed on in the ranks'
    dropout-off program while the reference ran F.dropout at p=0 (loss 0.13 apart at a scale of
    1.38, every gradient beyond its bound). Now one native_dropout, off on both sides; fsdp
    compares with dropout on (each slice's masks), as before."""
    result = check_model(IN_PLACE_CASE, plan=plan, mesh=mesh, steps=1)
    assert result.ok, result.failures()
    assert ("dropout off on both sides" in result.oracle.summary()) == (plan == "auto"), result.oracle.summary()


@pytest.mark.slow  # a plan="auto" parity world
def test_in_place_dropout_on_one_side_only_fails_the_oracle():
    """Negative: the ranks' dropout-off program against the reference with dropout on (the
    in-place dropout drawing at p=0.5) is beyond tolerance: the oracle sees a dropout left on."""
    case = planned_case(Scenario(case=IN_PLACE_CASE, plan="auto", mesh="dp=2"))
    ((_, ranks),) = run_planned_parity(case, 1, executors=(EAGER,))
    assert oracle_executor(ranks) == DROPOUT_OFF
    assert planned_oracle(case, ranks).passed
    one_side = planned_oracle(case, ranks, single_device_replay(case, ranks, EAGER))
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


# --- mixed precision (FSDP2's MixedPrecisionPolicy): bf16 parameters, fp32 gradient reduction -------

BF16 = ParallelPlan.fsdp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class TokenDropoutMLP(nn.Module):
    """Token ids in (nothing to cast), an nn.Dropout module between two Linears."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.up = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(32, 4)

    def forward(self, tokens):
        return self.down(self.drop(torch.relu(self.up(self.emb(tokens))))).mean(1)


def _token_batch(n):
    return torch.randint(0, 32, (n, 8)), torch.randint(0, 4, (n,))


TOKEN_CASE = ModelCase("token_dropout_mlp", TokenDropoutMLP, nn.functional.cross_entropy, _token_batch, batch_per_rank=2)


def test_bf16_params_dropout_bitwise_at_every_stage(model_check):
    """Every stage was NOT bitwise: the trace's native_dropout backward scaled by the unrounded
    1 / (1 - p), eager's CPU dropout multiplies by the noise rounded to bf16 (patch eager_dropout).
    The loss is bf16 (FSDP2 casts no output); the oracle compares it in the reference's fp32."""
    result = model_check(TOKEN_CASE, plan=BF16, mesh="dp=2")
    assert all(rep.bitwise for rep in result.parity.values()) and result.oracle.passed
    assert any(c.name.startswith("loss (bf16 under param_dtype, compared in fp32)") for c in result.oracle.checks)
    assert "floating inputs cast" not in result.summary()  # token ids: nothing cast


def test_bf16_params_float_inputs_are_cast_as_fsdp2_does(model_check):
    """Float inputs under bf16 parameters were refused ("Cast the input"). The parallel program
    casts them to bf16 (MixedPrecisionPolicy(cast_forward_inputs=True)), the trace records the cast,
    and the oracle's reference reads the same rounded values in fp32."""
    result = model_check(CASE, plan=BF16, mesh="dp=2")
    assert "floating inputs cast to bfloat16 as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does" in result.summary()
    joint = result.run.stage("joint").graphs
    x = next(n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get(M.ROLE) == roles.input_(0))
    assert x.meta[M.VAL].dtype is torch.float32
    assert [(u.target, u.kwargs.get("dtype")) for u in x.users] == [(aten._to_copy.default, torch.bfloat16)]


def _planted_fp32_dropout(monkeypatch) -> list[str]:
    """The clean-up pass, planted: the forward dropout's mask scaled in fp32 (by the unrounded
    1 / (1 - p), as native_dropout's backward does) and its product computed in fp32 and cast back,
    where eager scales the mask in bf16. Returns the planted node's name once the pass ran."""
    real, planted = partition.cleanup_graph, []

    def cleanup_graph(gm):
        report = real(gm)
        mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor and own_scope(n) == "drop")
        def cast(node, dtype):
            out = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
            out.meta[M.VAL] = node.meta[M.VAL].to(dtype)  # the partitioner reads every node's value
            return out

        x, noise = mul.args  # noise = bernoulli(...) / (1 - p), in bf16 (eager's)
        with gm.graph.inserting_before(mul):
            noise32 = gm.graph.call_function(aten.div.Tensor, (cast(noise.args[0], torch.float32), *noise.args[1:]))
            noise32.meta[M.VAL] = noise.meta[M.VAL].to(torch.float32)
            mul.args = (cast(x, torch.float32), noise32)
        bf16 = mul.meta[M.VAL]
        mul.meta[M.VAL] = bf16.to(torch.float32)
        with gm.graph.inserting_after(mul):
            back = cast(mul, torch.bfloat16)
        mul.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        gm.recompile()
        planted.append(mul.name)
        return report

    monkeypatch.setattr(partition, "cleanup_graph", cleanup_graph)
    return planted


def test_a_dropout_applied_in_another_dtype_fails_and_its_node_is_named(monkeypatch):
    """The negative side of the two above: the planted stage and every stage after it are NOT
    bitwise, and check_model's differential execution names the clean-up pass and the dropout's
    product (its op, its module, the dtype it computed in, the size of the difference)."""
    planted = _planted_fp32_dropout(monkeypatch)
    result = check_model(TOKEN_CASE, plan=BF16, mesh="dp=2", steps=1)
    assert result.parity["joint"].bitwise and not result.parity["cleanup"].bitwise and not result.ok
    why = result.explanations["cleanup"]
    assert f"pass cleanup computes other values than its input; first differing node: node '{planted[0]}' (aten.mul) in module 'drop'" in why
    assert "computed in torch.float32, not torch.bfloat16" in why and "max |diff|" in why
    assert result.explanations["collective_passes"] == why  # a later stage: the same first pass
    assert f"why: {why}" in "\n".join(result.failures())
