"""Parameters without a gradient on gloo: frozen ones (``requires_grad=False``) and ones the loss
does not reach, through every stage (``verify.check.check_model``), as eager PyTorch trains them:
gradient None, no AdamW step, the value bitwise unchanged after every step, no gradient
collective in the graph; and the checker failing each way a program could get that wrong.

Small models of our own: an MLP with a frozen first layer, one with a pooler whose output the
loss drops and a layer it never calls, a low-rank adapter on a frozen base (LoRA; also under
plan="auto"), a TP region with a frozen colwise layer (fsdp_tp); and Hugging Face's Marian, whose
sinusoidal position tables are frozen. The gloo worlds beyond the two cells and the negative
tests in the tier are in CI's slow step (``tests/conftest.py`` SLOW_GROUPS).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoparallel import roles
from autoparallel.runtime import steps
from verify.check import check_model
from verify.hf import KeywordInputs, token_loss
from verify.model_case import ModelCase
from verify.parity.runs import EAGER, JOINT, compare_with_eager, oracle_check, run_stage_parity
from verify.stages import rank_context
from verify.stages.registry import check_conservation
from verify.stages.scenario import Scenario


class FrozenFirst(nn.Module):
    """A frozen feature layer (a fine-tuned model's base) under a trainable head."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 16).requires_grad_(False)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        return self.head(torch.relu(self.base(x)))


class Pooler(nn.Module):
    """``pool`` is computed and dropped (a pooler an LM loss skips); ``idle`` is never called."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)
        self.pool = nn.Linear(8, 8)
        self.idle = nn.Linear(8, 8)

    def forward(self, x):
        h = self.out(torch.tanh(self.body(x)))
        self.pool(h)
        return h


class LoRALinear(nn.Module):
    """``base(x) + x @ A.T @ B.T * scale`` with the base frozen (B starts non-zero so that A's
    first gradient is too)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T * 0.5


class LoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16).requires_grad_(False)
        self.mix = LoRALinear(16, 16)
        self.head = LoRALinear(16, 8)

    def forward(self, x):
        return self.head(torch.relu(self.mix(torch.relu(self.emb(x)))))


def mse(out, target):
    return ((out - target) ** 2).mean()


def batch(n: int):
    return torch.randn(n, 8), torch.randn(n, 8)


FROZEN = ModelCase("frozen_first", FrozenFirst, mse, batch, batch_per_rank=2)
POOLER = ModelCase("pooler", Pooler, mse, batch, batch_per_rank=2)
LORA = ModelCase("lora", LoRA, mse, batch, batch_per_rank=2)
WITHOUT_GRAD = {
    "frozen_first": {"base.bias": "frozen", "base.weight": "frozen"},
    "pooler": {f"{m}.{p}": "unreached" for m in ("idle", "pool") for p in ("bias", "weight")},
    "lora": {f"{m}.base.{p}": "frozen" for m in ("head", "mix") for p in ("bias", "weight")}
    | {"emb.bias": "frozen", "emb.weight": "frozen"},
}
REDUCE = {"fsdp": "reduce_scatter", "ddp": "all_reduce"}

TIER = {("frozen_first", "fsdp"), ("pooler", "ddp")}  # the rest: CI's slow step


def _cells():
    for case in (FROZEN, POOLER, LORA):
        for plan in ("fsdp", "ddp"):
            group = "gradless-parity-tier" if (case.name, plan) in TIER else "gradless-parity"
            yield pytest.param(case, plan, id=f"{case.name}-{plan}", marks=pytest.mark.xdist_group(group))


@pytest.mark.parametrize("case, plan", list(_cells()))
def test_every_stage_trains_a_parameter_without_a_gradient_as_eager_does(case, plan):
    result = check_model(case, plan=plan, mesh="dp=2")
    result.assert_ok()  # every stage bitwise, the oracle within its bound
    gradless = WITHOUT_GRAD[case.name]
    assert result.params_without_grad() == gradless
    assert "no gradient (" in result.summary()
    for stage, rep in result.parity.items():  # each stage's final values of them were compared, every rank
        finals = {d.name for d in rep.diffs if "/final/param:" in d.name}
        assert finals == {f"rank{r}/final/param:{fqn}" for r in range(2) for fqn in gradless}, stage
        nones = [d for d in rep.diffs if d.note == "no gradient on either side"]
        assert len(nones) == 2 * 3 * len(gradless), stage  # ranks x steps x parameters
    unchanged = {c.name for c in result.oracle.checks if c.name.startswith("unchanged:")}
    assert unchanged == {f"unchanged:{fqn}" for fqn in gradless}
    assert all(c.passed and c.bound == 0 for c in result.oracle.checks if c.name in unchanged)
    nones = [c for c in result.oracle.checks if c.name in {roles.grad(fqn) for fqn in gradless}]
    assert len(nones) == len(gradless) and all(c.passed and c.note == "no gradient on either side" for c in nones)
    laws = [p for r in result.run.results if r.input is not None
            for p in check_conservation(r.name, result.run.stage(r.input).graphs, r.graphs)]
    assert laws == []  # no collective lost or duplicated by any stage
    # No gradient collective for them: one reduce per trained parameter in the joint graph.
    trained = len(dict(case.factory().named_parameters())) - len(gradless)
    (count,) = [c["count"] for c in result.stats()["joint"]["collectives"][REDUCE[plan]].values()]
    assert count == trained


@pytest.mark.xdist_group("gradless-parity")
def test_lora_under_auto():
    result = check_model(LORA, plan="auto", mesh="dp=2")
    result.assert_ok()
    assert result.params_without_grad() == WITHOUT_GRAD["lora"]
    assert {c.name for c in result.oracle.checks if c.name.startswith("unchanged:")} == {
        f"unchanged:{fqn}" for fqn in WITHOUT_GRAD["lora"]}


class TPBlock(nn.Module):
    """A TP region with a frozen colwise ``up``, a trainable rowwise ``down`` and a ``pool`` the
    region computes and drops."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16).requires_grad_(False)
        self.down = nn.Linear(16, 8)
        self.pool = nn.Linear(8, 8)

    def forward(self, x):
        self.pool(x)
        return self.down(torch.relu(self.up(x)))


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = TPBlock()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        return self.head(self.mlp(x))


TP_CASE = ModelCase("tp_frozen", TPNet, mse, batch, batch_per_rank=2, tp_regions=("mlp",),
                    tp_rules={"mlp.up.weight": "colwise", "mlp.down.weight": "rowwise", "mlp.pool.weight": "colwise"})


@pytest.mark.xdist_group("gradless-parity")
def test_fsdp_tp_with_a_frozen_colwise_layer_and_a_dropped_one():
    result = check_model(TP_CASE, plan="fsdp_tp", mesh="dp=1,tp=2")
    result.assert_ok()
    assert result.params_without_grad() == {"mlp.pool.bias": "unreached", "mlp.pool.weight": "unreached",
                                            "mlp.up.bias": "frozen", "mlp.up.weight": "frozen"}
    collectives = result.stats()["joint"]["collectives"]
    assert collectives["reduce_scatter"]["dp"]["count"] == 4  # down.weight, down.bias, head.weight, head.bias
    assert len([c for c in result.oracle.checks if c.name.startswith("unchanged:")]) == 4


# --- the checker fails each way a program could get it wrong ---------------------------------------

FROZEN_FSDP = Scenario(case=FROZEN, plan="fsdp", mesh="dp=2")


def _giving_zero_grads(make):
    """An executor factory whose executors return zeros where the real one returns no gradient:
    AdamW then steps the parameter (its weight decay moves it)."""

    def build(*args, **kwargs):
        inner = make(*args, **kwargs)

        def step(params, inputs):
            loss, grads = inner(params, inputs)
            return loss, {k: torch.zeros_like(params[k]) if g is None else g for k, g in grads.items()}

        return steps.Executor(step, inner.buffers)

    return build


@pytest.mark.xdist_group("gradless-parity-tier")
def test_a_graph_that_gives_a_frozen_parameter_a_gradient_fails_parity(monkeypatch):
    # the joint stages' executors are built by the registry from verify.stages.rank_context
    monkeypatch.setattr(rank_context, "joint_graph_executor", _giving_zero_grads(rank_context.joint_graph_executor))
    ranks = run_stage_parity(FROZEN_FSDP, 2, executors=(EAGER, JOINT))
    bad = {d.name for d in compare_with_eager(ranks, JOINT).mismatches()}
    frozen = [f"rank{r}/{{}}:{fqn}" for r in range(2) for fqn in ("base.weight", "base.bias")]
    assert {n for n in bad if "/step0/" in n} == {f.format("step0/grad") for f in frozen}  # then the rest diverges
    assert {f.format("final/param") for f in frozen} <= bad
    assert oracle_check(FROZEN_FSDP, ranks).passed  # the reference, eager, is right


@pytest.mark.xdist_group("gradless-parity-tier")
def test_an_eager_program_that_gives_a_gradient_the_model_does_not_fails_parity_and_the_oracle(monkeypatch):
    monkeypatch.setattr(rank_context, "eager_program_executor", _giving_zero_grads(rank_context.eager_program_executor))
    ranks = run_stage_parity(FROZEN_FSDP, 2, executors=(EAGER, JOINT))
    assert not compare_with_eager(ranks, JOINT).bitwise
    oracle = oracle_check(FROZEN_FSDP, ranks)
    assert {c.name for c in oracle.failures()} == {
        f"{what}:{fqn}" for fqn in ("base.weight", "base.bias") for what in ("grad", "unchanged")}


@pytest.mark.xdist_group("gradless-parity-tier")
def test_a_frozen_parameter_changed_without_any_gradient_fails_parity(monkeypatch):
    """No gradient anywhere and every loss equal (the write lands after the last forward): only
    the final values tell."""
    make = rank_context.joint_graph_executor

    def writing(*args, **kwargs):
        inner = make(*args, **kwargs)

        def step(params, inputs):
            loss, grads = inner(params, inputs)
            with torch.no_grad():
                params["base.bias"].add_(1.0)
            return loss, grads

        return steps.Executor(step, inner.buffers)

    monkeypatch.setattr(rank_context, "joint_graph_executor", writing)
    ranks = run_stage_parity(FROZEN_FSDP, 1, executors=(EAGER, JOINT))
    assert {d.name for d in compare_with_eager(ranks, JOINT).mismatches()} == {"rank0/final/param:base.bias",
                                                                               "rank1/final/param:base.bias"}


# --- a Hugging Face model with frozen parameters ----------------------------------------------------


def _marian():
    """Marian (encoder-decoder): its sinusoidal position tables are frozen Embedding weights."""
    transformers = pytest.importorskip("transformers")

    config = transformers.MarianConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        pad_token_id=0, decoder_start_token_id=0, use_cache=False)
    return KeywordInputs(transformers.MarianMTModel(config), ("input_ids", "attention_mask", "decoder_input_ids"))


def _seq2seq_batch(n: int):
    tokens = lambda: torch.randint(3, 64, (n, 8))  # noqa: E731
    return tokens(), torch.ones(n, 8, dtype=torch.long), tokens(), tokens()


@pytest.mark.xdist_group("gradless-parity")
def test_marian_with_frozen_sinusoidal_position_tables_passes_every_stage():
    """Refused before ('does not require grad; plans shard trainable parameters only')."""
    case = ModelCase("hf-marian", _marian, token_loss, _seq2seq_batch, batch_per_rank=2)
    result = check_model(case, plan="fsdp", mesh="dp=2")
    result.assert_ok()
    tables = {f"model.model.{side}.embed_positions.weight": "frozen" for side in ("encoder", "decoder")}
    assert result.params_without_grad() == tables
    assert {c.name for c in result.oracle.checks if c.name.startswith("unchanged:")} == {f"unchanged:{f}" for f in tables}
