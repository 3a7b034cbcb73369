"""What to do with each parameter: FSDP over one mesh dim, Megatron TP over another, or DDP.

A plan is data, resolved against a concrete model and mesh into one ``ParamSharding`` per
parameter. Resolution is where bad plans are caught (unknown parameter, module or mesh dim, a TP
dim that does not divide, a 0-dim parameter under FSDP, tied names that disagree, a parameter
inside a TP region that TP does not shard), so the tracer and the runtime can assume every
shard is well formed.

FSDP takes any dim 0, as PyTorch's FSDP2 does: dim 0 is padded to a multiple of the mesh dim, so
every rank holds ``ceil(dim0 / n)`` rows and the last ranks hold trailing zero rows (or only
padding). Equal shard shapes keep the traced graph the same on every rank (one rank's graph is
traced on a fake world and run on all of them). The all-gather gathers padded shards and a narrow
restores the true size; the gradient of the padding is zero, and AdamW keeps a zero parameter
with zero gradient at zero (weight decay multiplies it, both moments stay zero), so padding rows
are zero for the whole run. A checkpoint keeps a rank's real rows only: :meth:`ParamSharding.real_rows`.

**Patterns.** TP rules name parameters and TP regions name modules by FQN pattern, where ``*``
(and ``?``) match within one name of the dotted path, never across a dot: ``blocks.*`` matches
``blocks.0`` but not ``blocks.0.attn``. A rule or region that matches nothing is an error.

**TP rules.** ``tp_rules`` maps a parameter pattern to a style (``"colwise"``: the layer's
output features are split, ``"rowwise"``: its input features are split and the partial sums are
all-reduced at the end of the region) or a :class:`TPRule` that also says which tensor dim holds
those features and how many stacked blocks it holds (a fused qkv projection: ``chunks=3``).
The bias of an ``nn.Linear`` follows its weight: colwise, it is split like the weight's output
features; rowwise, it stays whole and is added once, after the region's all-reduce (added on
every rank before it, it would be counted tp times).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from autoparallel.defaults import AUTO, DDP, FSDP, FSDP_TP
from autoparallel.mesh import MeshSpec

TPStyle = Literal["colwise", "rowwise"]

# Megatron-style TP for LLaMA: q/k/v and the gate/up projections split their output features,
# wo and the down projection split their input features; one all-reduce closes each region.
LLAMA_TP_RULES: dict[str, TPStyle] = {
    "layers.*.attention.wq.weight": "colwise",
    "layers.*.attention.wk.weight": "colwise",
    "layers.*.attention.wv.weight": "colwise",
    "layers.*.attention.wo.weight": "rowwise",
    "layers.*.feed_forward.w1.weight": "colwise",
    "layers.*.feed_forward.w3.weight": "colwise",
    "layers.*.feed_forward.w2.weight": "rowwise",
}
# Modules whose input is copied into the TP region (all-reduce of its grad in backward) and whose
# output is all-reduced (identity in backward).
LLAMA_TP_REGIONS: tuple[str, ...] = ("layers.*.attention", "layers.*.feed_forward")


def fqn_match(pattern: str, fqn: str) -> bool:
    """``pattern`` matches ``fqn``, ``*`` and ``?`` within one dotted name (see the module
    docstring): ``layers.*.w`` matches ``layers.0.w``, not ``layers.0.sub.w``."""
    return _pattern_regex(pattern).fullmatch(fqn) is not None


def in_module(fqn: str, module: str) -> bool:
    """``fqn`` names something inside module ``module`` ("" is the root module: everything)."""
    return module == "" or fqn.startswith(module + ".")


@functools.cache
def _pattern_regex(pattern: str) -> re.Pattern:
    out = []
    for c in pattern:
        out.append("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c))
    return re.compile("".join(out))


@dataclass(frozen=True)
class TPRule:
    """How TP shards one parameter (see the module docstring).

    ``style``: ``"colwise"`` or ``"rowwise"``; ``dim``: the tensor dim split over the TP ranks
    (default ``nn.Linear``'s layout: 0 for colwise, 1 for rowwise; 1 for a colwise weight stored
    transposed, as in GPT-2's ``Conv1D``); ``chunks``: that dim holds ``chunks`` stacked blocks
    (``qkv = Linear(d, 3 * d)``: 3), each split over the TP ranks, so a rank holds its slice of
    every block, in block order.
    """

    style: TPStyle
    dim: int | None = None
    chunks: int = 1

    def __post_init__(self):
        if self.style not in ("colwise", "rowwise"):
            raise ValueError(f"TP style {self.style!r}: use 'colwise' or 'rowwise'")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"TPRule chunks={self.chunks!r}: an int >= 1")

    @property
    def axis(self) -> int:
        if self.dim is not None:
            return self.dim
        return 0 if self.style == "colwise" else 1

    @classmethod
    def of(cls, rule: TPStyle | TPRule) -> TPRule:
        return rule if isinstance(rule, TPRule) else cls(rule)


@dataclass(frozen=True)
class ParamSharding:
    """How one parameter is laid out on a rank.

    ``local_shape`` is what every rank holds: under FSDP its dim 0 is ``ceil(fsdp_rows / n)``
    for ``n = fsdp_size`` ranks, padding included. ``fsdp_rows`` is the true dim 0 of the tensor
    FSDP shards (the TP-local one under TP): the length the gathered tensor is narrowed to.
    """

    fqn: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    fsdp_dim: str | None = None  # mesh dim the (TP-local) parameter is sharded over on dim 0
    tp_dim: str | None = None
    tp_style: TPStyle | None = None
    ddp_dim: str | None = None  # mesh dim gradients are all-reduced over
    fsdp_rows: int | None = None  # dim 0 before padding (None: no FSDP)
    fsdp_size: int = 1  # ranks on fsdp_dim

    tp_axis: int | None = None  # the tensor dim TP splits (None: not TP-sharded)
    tp_chunks: int = 1  # stacked blocks along tp_axis, each split over the TP ranks
    # The bias of a rowwise TP Linear: whole on every TP rank, added once after the region's
    # all-reduce (the Linear's FQN).
    rowwise_bias_of: str | None = None

    @property
    def padding_rows(self) -> int:
        """Zero rows appended to dim 0 so that it divides the FSDP mesh dim (0 when it does)."""
        if self.fsdp_dim is None:
            return 0
        return self.local_shape[0] * self.fsdp_size - self.fsdp_rows

    @property
    def padded(self) -> bool:
        return self.padding_rows > 0

    def real_rows(self, coord: Mapping[str, int]) -> int:
        """How many leading rows of the local shard at mesh coordinate ``coord`` are real data
        (the rest is padding): the part of the shard a checkpoint keeps. A rank past the end
        holds 0 real rows and still takes part in every collective."""
        if self.fsdp_dim is None:
            return self.local_shape[0] if self.local_shape else 0
        rows = self.local_shape[0]
        return max(0, min(rows, self.fsdp_rows - coord[self.fsdp_dim] * rows))

    def real_shard(self, local: torch.Tensor, coord: Mapping[str, int]) -> torch.Tensor:
        """The real rows of a local shard (or of its gradient / optimizer state), padding dropped."""
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"{self.fqn}: local tensor of shape {tuple(local.shape)}, expected {self.local_shape}")
        return local.narrow(0, 0, self.real_rows(coord)) if self.fsdp_dim is not None else local

    def shard(self, full: torch.Tensor, coord: Mapping[str, int], sizes: Mapping[str, int]) -> torch.Tensor:
        """This rank's local piece of the full tensor (TP first, then FSDP on dim 0, zero-padded
        to ``local_shape``)."""
        t = full
        if self.tp_style is not None:
            n, i = sizes[self.tp_dim], coord[self.tp_dim]
            t = torch.cat([block.chunk(n, dim=self.tp_axis)[i] for block in t.chunk(self.tp_chunks, dim=self.tp_axis)], dim=self.tp_axis)
        if self.fsdp_dim is not None:
            rows = self.local_shape[0]
            start = min(coord[self.fsdp_dim] * rows, t.shape[0])
            real = t.narrow(0, start, self.real_rows(coord))
            out = real.new_zeros(self.local_shape)
            out[: real.shape[0]] = real
            return out
        return t.contiguous().clone()

    def unshard(self, pieces: Mapping[tuple[int, ...], torch.Tensor], spec: MeshSpec) -> torch.Tensor:
        """Reassemble the full tensor from every rank's piece, keyed by mesh coordinate tuple
        (padding dropped)."""
        names = spec.names

        def piece(fixed: dict[str, int]) -> torch.Tensor:
            for coord, t in pieces.items():
                if all(coord[names.index(k)] == v for k, v in fixed.items()):
                    return t
            raise KeyError(f"{self.fqn}: no piece for mesh coordinate {fixed}")

        def along_fsdp(fixed: dict[str, int]) -> torch.Tensor:
            if self.fsdp_dim is None:
                return piece(fixed)
            gathered = torch.cat([piece({**fixed, self.fsdp_dim: i}) for i in range(spec.size(self.fsdp_dim))], dim=0)
            return gathered.narrow(0, 0, self.fsdp_rows)

        if self.tp_style is None:
            return along_fsdp({})
        axis, chunks = self.tp_axis, self.tp_chunks
        per_rank = [along_fsdp({self.tp_dim: i}).chunk(chunks, dim=axis) for i in range(spec.size(self.tp_dim))]
        return torch.cat([piece[j] for j in range(chunks) for piece in per_rank], dim=axis)


@dataclass(frozen=True)
class ParallelPlan:
    """FSDP / TP / DDP over named mesh dims, plus mixed precision for FSDP; or ``auto``.

    ``param_dtype`` casts each shard before its all-gather; ``reduce_dtype`` is the dtype gradients
    are reduce-scattered in (defaults to the parameter's own dtype).

    ``ParallelPlan.auto(...)`` (``plan="auto"``) leaves every placement to the planner: the
    pipeline's ``plan`` stage plans the model (``autoparallel.planner``) and lowers the plan to the
    per-rank joint graph. ``planner`` holds what that stage is told: ``PlannerConfig`` fields by
    name, or under ``"solution"`` a finished ``autoparallel.planner.Solution`` to lower as it is. A hand
    plan has ``planner=None``.
    """

    name: str
    fsdp_dim: str | None = None
    tp_dim: str | None = None
    ddp_dim: str | None = None
    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    tp_rules: Mapping[str, TPStyle | TPRule] = field(default_factory=lambda: dict(LLAMA_TP_RULES))
    tp_regions: tuple[str, ...] = LLAMA_TP_REGIONS
    planner: Mapping[str, Any] | None = None

    @classmethod
    def auto(cls, **planner: Any) -> ParallelPlan:
        """Placements chosen by the planner (see the class docstring); ``planner``: PlannerConfig
        fields (``profile``, ``memory_budget``, ``pins``, ...) or ``solution=<Solution>``. ``param_dtype``
        / ``reduce_dtype`` are this plan's mixed precision, as for the hand plans."""
        kw = {k: planner.pop(k) for k in ("param_dtype", "reduce_dtype", "reshard_after_forward") if k in planner}
        return cls(name=AUTO, tp_rules={}, tp_regions=(), planner=dict(planner), **kw)

    @property
    def is_auto(self) -> bool:
        return self.planner is not None

    @classmethod
    def fsdp(cls, dp: str = "dp", **kw) -> ParallelPlan:
        return cls(name=FSDP, fsdp_dim=dp, **kw)

    @classmethod
    def fsdp_tp(cls, dp: str = "dp", tp: str = "tp", **kw) -> ParallelPlan:
        return cls(name=FSDP_TP, fsdp_dim=dp, tp_dim=tp, **kw)

    @classmethod
    def ddp(cls, dp: str = "dp", **kw) -> ParallelPlan:
        return cls(name=DDP, ddp_dim=dp, **kw)

    @classmethod
    def preset(cls, name: str, **kw) -> ParallelPlan:
        presets = {FSDP: cls.fsdp, FSDP_TP: cls.fsdp_tp, DDP: cls.ddp, AUTO: cls.auto}
        if name not in presets:
            raise ValueError(f"unknown plan {name!r}; valid plans: {sorted(presets)}")
        return presets[name](**kw)

    @property
    def data_dims(self) -> tuple[str, ...]:
        """Mesh dims the batch is split over."""
        return tuple(d for d in (self.fsdp_dim, self.ddp_dim) if d is not None)

    def describe(self) -> str:
        parts = [self.name]
        if self.is_auto:
            # A given plan (key "plan") is what the planner would decide: not part of the text.
            parts += [f"{k}={v}" for k, v in sorted(self.planner.items()) if k != "plan"]
        for label, dim in (("fsdp", self.fsdp_dim), ("tp", self.tp_dim), ("ddp", self.ddp_dim)):
            if dim:
                parts.append(f"{label}={dim}")
        if self.fsdp_dim:
            parts.append(f"reshard_after_forward={self.reshard_after_forward}")
        if self.param_dtype is not None:
            parts.append(f"param_dtype={_dtype_name(self.param_dtype)}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce_dtype={_dtype_name(self.reduce_dtype)}")
        return " ".join(parts)

    def tp_rule_of(self, fqn: str) -> TPRule | None:
        """The first TP rule whose pattern matches ``fqn``, None if none does."""
        for pattern, rule in self.tp_rules.items():
            if fqn_match(pattern, fqn):
                return TPRule.of(rule)
        return None

    def tp_style_of(self, fqn: str) -> TPStyle | None:
        rule = self.tp_rule_of(fqn)
        return rule.style if rule is not None else None

    def region_modules(self, model: nn.Module) -> list[str]:
        """FQNs of the modules the TP regions name, in model order; ValueError for a pattern that
        matches no module, or for a region inside another (its output would be all-reduced twice)."""
        names = [n for n, _ in model.named_modules()]  # "" is the root: a region for a whole model
        found = [n for n in names if any(fqn_match(p, n) for p in self.tp_regions)]
        for pattern in self.tp_regions:
            if not any(fqn_match(pattern, n) for n in names):
                raise ValueError(f"plan {self.name!r}: TP region {pattern!r} matches no module of the model")
        for outer in found:
            for inner in found:
                if inner != outer and in_module(inner, outer):
                    raise ValueError(
                        f"plan {self.name!r}: TP region {inner!r} is inside TP region {outer!r}; its output "
                        "would be all-reduced twice. Name only the outer module (or only the inner ones)"
                    )
        return found

    def resolve(self, model: nn.Module, mesh: MeshSpec) -> dict[str, ParamSharding]:
        """One ParamSharding per (deduplicated) parameter, or ValueError naming what is wrong."""
        if self.is_auto:
            raise ValueError(
                "plan 'auto' has no hand placements to resolve: the pipeline's plan stage places "
                "every parameter (run it through autoparallel.pipeline.run_pipeline)"
            )
        mesh = MeshSpec.parse(mesh)
        for role, dim in (("fsdp", self.fsdp_dim), ("tp", self.tp_dim), ("ddp", self.ddp_dim)):
            if dim is not None and dim not in mesh.names:
                raise ValueError(
                    f"plan {self.name!r}: {role} mesh dim {dim!r} is not in mesh {mesh} "
                    f"(dims: {list(mesh.names)})"
                )
        if self.fsdp_dim and self.ddp_dim:
            raise ValueError(f"plan {self.name!r}: FSDP and DDP on the same parameters are not supported")
        params = dict(model.named_parameters())
        rules, rowwise_biases = self._tp_layout(model) if self.tp_dim is not None else ({}, {})
        out = {}
        for fqn, p in params.items():
            shape = tuple(p.shape)
            local = list(shape)
            rule = rules.get(fqn)
            if rule is not None:
                size = mesh.size(self.tp_dim)
                local[rule.axis] = _divide(fqn, local, rule.axis, self.tp_dim, size, f"TP {rule.style}", rule.chunks)
            fsdp_rows, fsdp_size = None, 1
            if self.fsdp_dim is not None:
                fsdp_rows, fsdp_size = _fsdp_rows(fqn, local, self.fsdp_dim), mesh.size(self.fsdp_dim)
                local[0] = -(-fsdp_rows // fsdp_size)  # ceil: the last ranks hold padding
            out[fqn] = ParamSharding(
                fqn=fqn,
                full_shape=shape,
                local_shape=tuple(local),
                fsdp_dim=self.fsdp_dim,
                tp_dim=self.tp_dim if rule else None,
                tp_style=rule.style if rule else None,
                ddp_dim=self.ddp_dim,
                fsdp_rows=fsdp_rows,
                fsdp_size=fsdp_size,
                tp_axis=rule.axis if rule else None,
                tp_chunks=rule.chunks if rule else 1,
                rowwise_bias_of=rowwise_biases.get(fqn),
            )
        return out

    def _tp_layout(self, model: nn.Module) -> tuple[dict[str, TPRule], dict[str, str]]:
        """(TP rule per canonical parameter FQN, rowwise Linear biases -> their Linear), checked
        against the model: every rule matches a parameter, tied names agree, every TP-sharded
        parameter is inside a region and every parameter inside a region is TP-sharded (or a rowwise
        bias). Each error names the parameter and says what to change."""
        all_names = list(model.named_parameters(remove_duplicate=False))
        canonical: dict[int, str] = {}
        for fqn, p in all_names:
            canonical.setdefault(id(p), fqn)
        for pattern in self.tp_rules:
            if not any(fqn_match(pattern, fqn) for fqn, _ in all_names):
                raise ValueError(f"plan {self.name!r}: TP rule {pattern!r} matches no parameter of the model")
        rules: dict[str, TPRule] = {}
        for fqn, p in all_names:
            main = canonical[id(p)]
            rule, main_rule = self.tp_rule_of(fqn), self.tp_rule_of(main)
            if rule != main_rule:
                raise ValueError(
                    f"parameter {fqn!r} is tied to {main!r} (one tensor, two names), but the TP rules give "
                    f"them different layouts ({rule} vs {main_rule}); give both names the same rule"
                )
            if rule is not None:
                rules[main] = rule
        modules = dict(model.named_modules())
        rowwise_biases: dict[str, str] = {}
        for fqn, rule in list(rules.items()):
            owner, _, attr = fqn.rpartition(".")
            linear = modules.get(owner)
            if attr != "weight" or not isinstance(linear, nn.Linear) or linear.bias is None:
                continue
            bias = canonical[id(linear.bias)]
            if bias in rules:
                continue  # the plan says how: the shape checks in resolve validate it
            if rule.style == "colwise":
                rules[bias] = TPRule("colwise", dim=0, chunks=rule.chunks)  # split with the output features
            else:
                rowwise_biases[bias] = owner  # added once, after the region's all-reduce
        regions = self.region_modules(model)

        def region_of(fqn: str) -> str | None:
            return next((r for r in regions if in_module(fqn, r)), None)

        for fqn, p in all_names:
            main = canonical[id(p)]
            region = region_of(fqn)
            if main in rules and region is None:
                raise ValueError(
                    f"parameter {fqn!r} is TP-sharded ({rules[main].style}) but is in no TP region "
                    f"{list(self.tp_regions)}: nothing would gather or reduce its partial results. Add "
                    "the module that uses it to tp_regions, or remove its TP rule"
                )
            if region is not None and main not in rules and main not in rowwise_biases:
                raise ValueError(
                    f"parameter {fqn!r} is inside TP region {region!r} but no TP rule shards it: each TP "
                    "rank would compute a partial gradient for it that nothing reduces. Move it out of "
                    "the region (e.g. a norm before the region's module) or give it a TP rule"
                )
        return rules, rowwise_biases


def _divide(fqn: str, shape: list[int], axis: int, dim: str, size: int, what: str, chunks: int = 1) -> int:
    if len(shape) <= axis:
        raise ValueError(f"parameter {fqn!r} has shape {tuple(shape)}: no dim {axis} to shard for {what} over {dim!r}")
    if shape[axis] % (size * chunks):
        blocks = f" as {chunks} chunks of {shape[axis] / chunks:g}" if chunks > 1 else ""
        raise ValueError(
            f"parameter {fqn!r}: dim {axis} of size {shape[axis]}{blocks} is not divisible by mesh dim "
            f"{dim!r} of size {size} ({what}; FSDP pads dim 0, TP does not pad)"
        )
    return shape[axis] // size


def _fsdp_rows(fqn: str, shape: list[int], dim: str) -> int:
    """Dim 0 of a parameter FSDP shards; a 0-dim parameter has none to shard or pad."""
    if not shape:
        raise ValueError(
            f"parameter {fqn!r} is a 0-dim tensor (a scalar): FSDP shards and pads dim 0 over "
            f"mesh dim {dim!r}, and a scalar has no dim 0; make it a 1-element tensor of shape "
            "(1,) (FSDP then pads it), or keep it out of the plan"
        )
    return shape[0]


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")
