"""Traced SAC against eager SAC, peak memory, for a model that is not ours (a transformers model).

The LLaMA comparison (``verify.parity.trainer``) builds its eager SAC with the model's own
``apply_ac``. A model users bring has no such hook, so both sides are put on it from outside,
with the same op policy (``autoparallel.ac``):

* **eager SAC**: each block of the model's block list runs under ``torch.utils.checkpoint``
  with the op-selective context (:func:`checkpoint_blocks`);
* **traced SAC**: the blocks are annotated as AC regions, the whole step is traced
  (``trace_train_step``), tagged by the graph SAC pass and rematerialized (``graph_sac``), and run
  under ``torch.no_grad()`` (``run_traced``).

The block list is the model's largest ``nn.ModuleList`` of modules of one class
(:func:`block_list`): ``transformer.h`` in GPT-2, ``encoder.layer`` in BERT. Both steps run with
the generator seeded alike, so dropout draws the same masks and the losses must be equal.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoparallel import ac
from autoparallel.runtime.steps import seeded
from autoparallel.trainer import run_traced
from autoparallel.trainer.regions import annotate_ac_regions
from autoparallel.trainer.sac import graph_sac
from autoparallel.trainer.trace import trace_train_step
from verify.graphs.memory import PeakMemory, peak_memory
from verify.hf import ARCHS, VOCAB, hf_case

EAGER_SAC, TRACED_SAC = "eager SAC", "traced SAC+remat"


def block_list(model: nn.Module) -> tuple[nn.Module, str]:
    """``(parent, name)`` of the model's block list: the ``nn.ModuleList`` of modules of one class
    holding the most parameters. ValueError when the model has none."""
    best, size = None, -1
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0 or len({type(b) for b in child}) != 1:
                continue
            n = sum(p.numel() for p in child.parameters())
            if n > size:
                best, size = (parent, name, parent_name), n
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks of one class to checkpoint")
    return best[0], best[1]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    def run(*positional: Any) -> Any:
        return type(self).forward(self, *positional, **kwargs)

    return ac.checkpoint_block(run, ac.OP, self._ap_eager_sac_region, *args)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Op-selective activation checkpointing on each block of ``model``'s block list, in place
    (the eager side of the comparison). Keyword arguments of a block's call reach it unchanged."""
    parent, name = block_list(model)
    for idx, block in enumerate(getattr(parent, name)):
        block._ap_eager_sac_region = idx
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def sac_peaks(
    build: Callable[[], nn.Module],
    loss_fn: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    num_model_inputs: int,
    device: torch.device | str,
    seed: int = 0,
) -> tuple[dict[str, PeakMemory], dict[str, torch.Tensor]]:
    """Peak memory of one training step with eager SAC and with traced SAC (module docstring);
    ``build()`` makes a fresh model on ``device`` (called twice: one model per side). Returns the
    peaks and the losses by side."""
    device = torch.device(device)
    eager = checkpoint_blocks(build())
    traced_model = build()
    parent, name = block_list(traced_model)
    annotate_ac_regions(parent, container=name)
    step = graph_sac(trace_train_step(traced_model, loss_fn, inputs, num_model_inputs=num_model_inputs,
                                      record_module_stack=False), ac.OP)
    model_in, loss_in = tuple(inputs[:num_model_inputs]), tuple(inputs[num_model_inputs:])
    losses: dict[str, torch.Tensor] = {}

    def eager_step() -> None:
        eager.zero_grad(set_to_none=True)
        with seeded(seed, [device]):
            loss = loss_fn(eager(*model_in), *loss_in)
            loss.backward()
        losses[EAGER_SAC] = loss.detach()

    def traced_step() -> None:
        traced_model.zero_grad(set_to_none=True)
        with seeded(seed, [device]):
            losses[TRACED_SAC] = run_traced(step, traced_model, inputs)

    peaks = {EAGER_SAC: peak_memory(eager_step, device=device), TRACED_SAC: peak_memory(traced_step, device=device)}
    return peaks, losses


def hf_sac_peaks(
    arch: str, *, batch: int = 4, seq: int = 64, device: torch.device | str = "cpu", seed: int = 0, **overrides: Any
) -> tuple[dict[str, PeakMemory], dict[str, torch.Tensor]]:
    """:func:`sac_peaks` for the ``verify.hf`` token-task architecture ``arch`` (causal or masked
    LM) on ``batch`` x ``seq`` random tokens; ``overrides`` go to its config (sizes, dropout)."""
    if arch not in ARCHS or ARCHS[arch].task not in ("causal", "masked"):
        raise ValueError(f"hf_sac_peaks: {arch!r} is not a causal or masked LM of verify.hf; "
                         f"those are {sorted(a for a, x in ARCHS.items() if x.task in ('causal', 'masked'))}")
    case = hf_case(arch, attention_mask=True, **overrides)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (batch, seq), generator=g).to(device)
    targets = torch.randint(3, VOCAB, (batch, seq), generator=g).to(device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    return sac_peaks(lambda: case.build(seed, device), case.loss_fn, (tokens, mask, targets),
                     num_model_inputs=2, device=device, seed=seed)
