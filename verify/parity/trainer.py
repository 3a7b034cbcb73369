"""The graph trainer's stages on the LLaMA-3 presets, for parity, memory and golden tests.

* :func:`sac_graphs` returns the traced step graph with op SAC tags before and after the remat
  pass (what golden files of the graph trainer should show).
* :func:`traced_step` traces (and caches, per process) the training step of a preset; the graph
  depends only on shapes and FQNs, never on parameter values, so every test of the same shape
  shares one trace. Callers must not modify the cached graph (passes here work on copies).
* :func:`eager_executor` / :func:`traced_executor` plug a model into
  ``autoparallel.runtime.steps.train_steps`` (AdamW between steps) for bitwise comparisons;
  :func:`stage_parity` compares every stage with eager that way (the report's verdicts).
* :func:`rank_sac_memory` is the per-rank entry point of the multi-rank memory test
  (``verify.parity.launch.run_gated``: NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from autoparallel import ac
from autoparallel.models.llama3 import Transformer, apply_ac, build_model, model_args
from autoparallel.runtime.steps import Executor, train_steps
from autoparallel.trainer import (
    TracedStep,
    annotate_ac_regions,
    run_traced,
    sac_stages,
    trace_train_step,
)
from verify.graphs.memory import peak_memory, ratio
from verify.parity.compare import ParityReport, compare_traces
from verify.stages.defaults import TRAINER_PRESET
from verify.stages.pipeline_run import intra_op_threads

__all__ = [
    "cross_entropy_loss",
    "intra_op_threads",
    "eager_executor",
    "make_batches",
    "make_model",
    "rank_sac_memory",
    "sac_graphs",
    "stage_parity",
    "traced_executor",
    "traced_step",
    "traced_sac_step",
]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (float32), the loss of every trainer test."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_model(
    preset: str = TRAINER_PRESET,
    *,
    tie_embeddings: bool = False,
    ac: str | None = None,
    regions: bool = True,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Transformer:
    """A deterministic model (same seed -> bitwise equal weights), AC mode ``ac`` applied,
    AC regions annotated for graph SAC when ``regions``."""
    model = build_model(model_args(preset, tie_embeddings=tie_embeddings), seed=seed, device=device)
    apply_ac(model, ac)
    if regions:
        annotate_ac_regions(model)
    return model


def make_batches(
    preset: str = TRAINER_PRESET,
    *,
    steps: int = 3,
    batch: int = 4,
    seq: int | None = None,
    seed: int = 1234,
    device: torch.device | str | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``(tokens, next-token targets)``, deterministic in ``seed``."""
    args = model_args(preset)
    seq = seq or args.max_seq_len
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


@functools.lru_cache(maxsize=8)
def _traced(
    preset: str,
    tie_embeddings: bool,
    batch: int,
    seq: int | None,
    device: str,
    ac: str | None,
    module_stack: bool,
) -> TracedStep:
    # Always called with every argument positionally: lru_cache keys on the call's spelling.
    # Traced on the execution device: ops that take a device argument are baked into the graph.
    model = make_model(preset, tie_embeddings=tie_embeddings, ac=ac, device=device)
    example = make_batches(preset, steps=1, batch=batch, seq=seq, device=device)[0]
    return trace_train_step(model, cross_entropy_loss, example, record_module_stack=module_stack)


def traced_step(
    preset: str = TRAINER_PRESET,
    *,
    tie_embeddings: bool = False,
    batch: int = 4,
    seq: int | None = None,
    device: str = "cpu",
    ac: str | None = None,
    module_stack: bool = False,
) -> TracedStep:
    """The traced (no graph SAC) training step of ``preset`` for ``[batch, seq]`` tokens; cached.

    ``ac`` applies eager activation checkpointing (``apply_ac``) to the model before tracing.
    ``module_stack=True`` records ``nn_module_stack`` on the nodes (tracing takes twice as long).
    """
    return _traced(preset, tie_embeddings, batch, seq, str(device), ac, module_stack)


@functools.lru_cache(maxsize=8)
def _traced_sac(
    preset: str, tie_embeddings: bool, batch: int, seq: int | None, device: str, policy: str
) -> tuple[TracedStep, TracedStep]:
    step = _traced(preset, tie_embeddings, batch, seq, device, None, False)
    tagged, remat = sac_stages(step, policy)
    return step.with_graph(tagged), step.with_graph(remat)


def traced_sac_step(
    preset: str = TRAINER_PRESET,
    *,
    tie_embeddings: bool = False,
    batch: int = 4,
    seq: int | None = None,
    device: str = "cpu",
    policy: str = ac.OP,
    remat: bool = True,
) -> TracedStep:
    """The traced step with graph SAC ``policy``; ``remat=False`` gives the tagged graph
    before the remat pass (it computes exactly what the traced step does). Cached."""
    tagged, rematerialized = _traced_sac(preset, tie_embeddings, batch, seq, str(device), policy)
    return rematerialized if remat else tagged


def sac_graphs(
    preset: str = TRAINER_PRESET, *, policy: str = ac.OP, batch: int = 4, seq: int | None = None
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``(before_remat, after_remat)`` graphs of the traced step with graph SAC ``policy``.

    ``before_remat`` carries the ``recompute`` / ``ac_graph_id`` tags of ``apply_sac_pass``;
    ``after_remat`` is the result of ``remat_using_tags_for_fwd_loss_bwd_graph`` (recomputed ops
    duplicated before their first backward use). The trace is cached per shape; the two graphs
    are fresh copies on every call. ``gm.meta[GM_STAGE]`` names the stage of each.
    """
    return sac_stages(traced_step(preset, batch=batch, seq=seq), policy)


# --------------------------------------------------------------------------------------------
# Executors for autoparallel.runtime.steps.train_steps
# --------------------------------------------------------------------------------------------


def eager_executor(model: torch.nn.Module) -> Executor:
    """``loss.backward()`` on ``model`` (params updated in place by train_steps' AdamW)."""

    def run(params, inputs):
        model.zero_grad(set_to_none=True)
        tokens, targets = inputs
        loss = cross_entropy_loss(model(tokens), targets)
        loss.backward()
        return loss.detach(), {fqn: p.grad for fqn, p in model.named_parameters()}

    return run


def traced_executor(step: TracedStep, model: torch.nn.Module) -> Executor:
    """``run_traced(step, model, inputs)`` (gradients accumulated into ``param.grad``)."""

    def run(params, inputs):
        model.zero_grad(set_to_none=True)
        loss = run_traced(step, model, inputs)
        return loss, {fqn: p.grad for fqn, p in model.named_parameters()}

    return run


#: The graph trainer's stages, in order: the traced step, the graph SAC tags, the remat pass.
TRAINER_STAGES = ("traced_step", "before_remat", "after_remat")


def stage_step(stage: str, preset: str = TRAINER_PRESET, *, policy: str = ac.OP, batch: int = 4) -> TracedStep:
    """The (cached) traced step of one of :data:`TRAINER_STAGES`."""
    if stage == "traced_step":
        return traced_step(preset, batch=batch)
    if stage in ("before_remat", "after_remat"):
        return traced_sac_step(preset, batch=batch, policy=policy, remat=stage == "after_remat")
    raise ValueError(f"unknown graph-trainer stage {stage!r}; stages: {list(TRAINER_STAGES)}")


def stage_parity(
    preset: str = TRAINER_PRESET, *, policy: str = ac.OP, batch: int = 4, steps: int = 2, lr: float = 1e-2
) -> dict[str, ParityReport]:
    """Each of :data:`TRAINER_STAGES` trained ``steps`` AdamW steps against eager, bitwise: the
    traced step and the SAC-tagged graph (tags change nothing it computes) against plain eager,
    the rematerialized graph against eager with ``apply_ac(model, policy)``."""
    batches = make_batches(preset, steps=steps, batch=batch)

    def train(executor, model):
        return train_steps(executor, dict(model.named_parameters()), batches, lr=lr)

    plain = make_model(preset, regions=False)
    checkpointed = make_model(preset, ac=policy, regions=False)
    references = {"eager": train(eager_executor(plain), plain),
                  f"eager+apply_ac({policy})": train(eager_executor(checkpointed), checkpointed)}
    out = {}
    for stage in TRAINER_STAGES:
        ref = f"eager+apply_ac({policy})" if stage == "after_remat" else "eager"
        model = make_model(preset)
        traced = train(traced_executor(stage_step(stage, preset, policy=policy, batch=batch), model), model)
        out[stage] = compare_traces(references[ref], traced, a_name=ref, b_name=stage)
    return out


# --------------------------------------------------------------------------------------------
# Multi-rank memory comparison
# --------------------------------------------------------------------------------------------


def rank_sac_memory(
    rank: int,
    world_size: int,
    device: str,
    preset: str = "tiny",
    batch: int = 4,
    seq: int | None = None,
) -> dict[str, object]:
    """Per rank: traced op SAC + remat vs eager ``apply_ac(model, "op")``, one data-parallel step.

    Each rank takes its own batch, runs the step, all-reduces (averages) its gradients over the
    world and measures the step's peak memory. Returns both peaks (``PeakMemory``), their
    ratios, whether the losses and the averaged gradients of the two runs are bitwise equal, and
    the largest gradient difference (CUDA attention backward kernels may use atomics).
    """
    batches = make_batches(preset, steps=1, batch=batch, seq=seq, seed=100 + rank, device=device)
    tokens, targets = batches[0]
    eager = make_model(preset, ac=ac.OP, regions=False, device=device)
    traced_model = make_model(preset, device=device)
    # Cached per process: forked (gloo) ranks reuse a trace their parent already made.
    sac = traced_sac_step(preset, batch=batch, seq=seq, device=device, policy=ac.OP)

    def all_reduce_grads(model: torch.nn.Module) -> None:
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)

    losses: dict[str, torch.Tensor] = {}

    def eager_step() -> None:
        eager.zero_grad(set_to_none=True)
        loss = cross_entropy_loss(eager(tokens), targets)
        loss.backward()
        all_reduce_grads(eager)
        losses["eager"] = loss.detach()

    def traced_step_fn() -> None:
        traced_model.zero_grad(set_to_none=True)
        losses["traced"] = run_traced(sac, traced_model, (tokens, targets))
        all_reduce_grads(traced_model)

    eager_peak = peak_memory(eager_step, device=device)
    traced_peak = peak_memory(traced_step_fn, device=device)
    pairs = list(zip(eager.parameters(), traced_model.parameters(), strict=True))
    grads_equal = all(torch.equal(a.grad, b.grad) for a, b in pairs)
    max_grad_diff = max(float((a.grad - b.grad).abs().max()) for a, b in pairs)
    out: dict[str, object] = {
        "rank": rank,
        "device": device,
        "eager": eager_peak,
        "traced": traced_peak,
        "ratio": ratio(traced_peak, eager_peak),
        "loss_equal": torch.equal(losses["eager"], losses["traced"]),
        "grads_equal": grads_equal,
        "max_grad_diff": max_grad_diff,
    }
    if eager_peak.reserved is not None:
        out["ratio_reserved"] = ratio(traced_peak, eager_peak, "reserved")
        out["ratio_active"] = ratio(traced_peak, eager_peak, "active")
    return out
