"""``ModelCase``: a user's model as the verification layer runs it.

A case is what the pipeline and the parity runs need to know about a model that is not one of
the LLaMA presets: how to build it (``factory``, called under a fixed seed, on ``meta`` for the
graphs and on the CPU for parity), its loss (``loss_fn(model(*inputs[:-1]), inputs[-1])``), how to
draw a global batch (``batch(n)`` -> the model inputs then the target, ``n`` examples, from
PyTorch's global RNG, which the caller seeds), and the TP rules and regions that fit it (only
read by plans with a TP dim). It is a frozen value: scenarios holding it stay hashable.

``load_case("package.module:name")`` finds one by reference (what ``--model`` takes): ``name``
is a ``ModelCase`` or a function returning one; a bare name is looked up in ``verify.zoo``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from autoparallel.parallelize.plan import TPRule, TPStyle

Batch = Callable[[int], Sequence[torch.Tensor]]
ZOO_MODULE = "verify.zoo"


@dataclass(frozen=True)
class ModelCase:
    """A model factory, its loss, its batch factory and the TP layout that fits it.

    ``tp_rules``: parameter pattern -> ``"colwise"`` / ``"rowwise"`` / ``TPRule`` (a mapping is
    accepted and kept as a tuple of pairs, in order); ``tp_regions``: module patterns closed by
    one all-reduce each (see ``autoparallel.parallelize.plan``). ``batch_per_rank``: examples per
    data-parallel rank in the batches scenarios draw.
    """

    name: str
    factory: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Batch
    tp_rules: tuple[tuple[str, TPStyle | TPRule], ...] | Mapping[str, TPStyle | TPRule] = ()
    tp_regions: tuple[str, ...] = ()
    batch_per_rank: int = 1

    def __post_init__(self):
        if isinstance(self.tp_rules, Mapping):
            object.__setattr__(self, "tp_rules", tuple(self.tp_rules.items()))
        object.__setattr__(self, "tp_regions", tuple(self.tp_regions))
        for what in ("factory", "loss_fn", "batch"):
            if not callable(getattr(self, what)):
                raise TypeError(f"ModelCase {self.name!r}: {what} must be callable, got {type(getattr(self, what)).__name__}")
        if not isinstance(self.batch_per_rank, int) or self.batch_per_rank < 1:
            raise ValueError(f"ModelCase {self.name!r}: batch_per_rank must be an int >= 1, got {self.batch_per_rank!r}")

    def build(self, seed: int = 0, device: str | torch.device = "cpu") -> nn.Module:
        """``factory()`` under ``torch.manual_seed(seed)`` (the global RNG is restored after), on
        ``device`` (``"meta"``: no storage, for tracing)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                model = self.factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelCase {self.name!r}: factory returned {type(model).__name__}, not an nn.Module")
        return model

    def batches(self, global_batch: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
        """``steps`` global batches of ``global_batch`` examples, deterministic in ``seed``."""
        out = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10_000 + seed)
            for _ in range(steps):
                batch = self.batch(global_batch)
                if isinstance(batch, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in batch) or len(batch) < 2:
                    raise TypeError(
                        f"ModelCase {self.name!r}: batch({global_batch}) must return a tuple of tensors "
                        "(the model inputs, then the loss target)"
                    )
                out.append(tuple(batch))
        return out


def load_case(ref: str | ModelCase) -> ModelCase:
    """The case ``ref`` names: ``"package.module:name"`` (a ``ModelCase``, or a function returning
    one) or a name in ``verify.zoo``. ValueError that says which part is wrong."""
    if isinstance(ref, ModelCase):
        return ref
    module_name, sep, attr = str(ref).partition(":")
    if not sep:
        module_name, attr = ZOO_MODULE, ref
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {ref!r}: cannot import module {module_name!r} ({e}); use package.module:name") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"--model {ref!r}: module {module_name!r} has no attribute {attr!r}")
    case = obj if isinstance(obj, ModelCase) else obj() if callable(obj) else None
    if not isinstance(case, ModelCase):
        raise ValueError(
            f"--model {ref!r}: {attr!r} is a {type(obj).__name__}; it must be a verify.ModelCase or a function "
            "returning one (a model factory, its loss_fn and a batch factory)"
        )
    return case
