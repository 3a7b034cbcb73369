"""The per-rank parallel program: the user's model over local shards with explicit collectives.

Each sharded parameter is wrapped in a parametrization that all-gathers (FSDP) or marks it for
gradient all-reduce (DDP) when the module reads it, so collectives appear at first use, layer by
layer, as they would under real FSDP. An uneven FSDP shard is zero-padded to the shape every
rank holds and narrowed back after its all-gather (``ParamSharding``, ``FSDPAllGather``). TP
regions get Megatron's f/g around them. The same program runs eagerly on a real world (the
parity reference) and is traced into the joint graph.

Tied parameters (one tensor under several names, e.g. an output head sharing the token
embedding) are held once, by their first name; the other names read it through that owner, and
a parametrized value is computed once per forward (``parametrize.cached``), so a tied parameter
is one graph input with one gradient, gathered (or all-reduced) once. The bias of a rowwise TP
Linear is added once, after its region's all-reduce (see ``autoparallel.parallelize.plan``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from autoparallel import patches
from autoparallel.mesh import MeshSpec, ParallelMesh
from autoparallel.parallelize.collectives import (
    CopyToTPRegion,
    DDPGradAllReduce,
    FSDPAllGather,
    ReduceFromTPRegion,
)
from autoparallel.parallelize.gathered_first import gather_first, with_zero_grads
from autoparallel.parallelize.plan import ParallelPlan, ParamSharding, in_module
from autoparallel.parallelize.replicated_draws import PATCH as REPLICATED_DRAWS
from autoparallel.parallelize.replicated_draws import ReplicatedDraws, from_first_rank
from autoparallel.validate import check_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_PARAMETRIZED = ".parametrizations."


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in float32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def clean_fqn(name: str) -> str:
    """``model.a.parametrizations.weight.original`` -> ``a.weight`` (the user's parameter name)."""
    name = "." + name.removeprefix("model.")
    if _PARAMETRIZED in name:
        owner, _, rest = name.partition(_PARAMETRIZED)
        name = f"{owner}.{rest.split('.')[0]}"
    return name[1:]


class _GatherParam(nn.Module):
    """Parametrization: local shard -> the tensor the module computes with.

    Computed with grad mode on whatever the caller's mode: the value is cached for the whole
    forward (``parametrize.cached``), and a model that first reads a parameter under
    ``torch.no_grad()`` (warm-up iterations of a recurrence that only backpropagates through its
    last ones) would otherwise cache a gathered tensor cut from its shard, and every later read,
    with grad on, would give the shard no gradient (eager gives it one)."""

    def __init__(self, sharding: ParamSharding, plan: ParallelPlan, mesh: ParallelMesh):
        super().__init__()
        self.fqn = sharding.fqn
        self.fsdp = None
        self.ddp = None
        if sharding.fsdp_dim is not None:
            rows = sharding.fsdp_rows if sharding.padded else None  # narrow the padding away
            self.fsdp = (mesh.group_name(sharding.fsdp_dim), mesh.size(sharding.fsdp_dim), rows)
        if sharding.ddp_dim is not None:
            self.ddp = mesh.group_name(sharding.ddp_dim)
        self.param_dtype = plan.param_dtype
        self.reduce_dtype = plan.reduce_dtype

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return self._gather(shard)

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.fsdp is not None:
            name, size, rows = self.fsdp
            return FSDPAllGather.apply(shard, name, size, self.param_dtype, self.reduce_dtype, rows)
        if self.ddp is not None:
            return DDPGradAllReduce.apply(shard, self.ddp)
        return shard


class ParallelProgram(nn.Module):
    """``forward(*model_inputs, target) -> loss`` on one rank, over local parameter shards."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        mesh: ParallelMesh,
        loss_fn: LossFn | None = None,
        *,
        shardings: Mapping[str, ParamSharding] | None = None,
        gather_first: Sequence[str] = (),
    ):
        super().__init__()
        self.plan = plan
        # Parameters some data-parallel ranks read and others do not: gathered at the start of each
        # forward on every rank, each given a zero gradient by the loss (parallelize/gathered_first.py).
        self.gather_first: tuple[str, ...] = tuple(gather_first)
        self.mesh_spec: MeshSpec = mesh.spec
        self.loss_fn = loss_fn or cross_entropy_loss
        self.shardings = dict(shardings or plan.resolve(model, mesh.spec))
        coord = mesh.coordinate()
        sizes = {n: s for n, s in mesh.spec.dims}
        # A scalar draw in forward is one for the whole batch: data-parallel rank 0's (replicated_draws).
        self._share_draw = from_first_rank([mesh.group_name(d) for d in plan.data_dims if sizes.get(d, 1) > 1])
        self._replicates_draws = any(sizes.get(d, 1) > 1 for d in plan.data_dims)
        self.model = copy.deepcopy(model)
        regions = plan.region_modules(model) if plan.tp_dim is not None else []
        # Tied parameters (one tensor, several names): the first name holds the shard, the others
        # read it through the holder (one graph input, one gradient).
        holder: dict[int, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) in holder:
                _tie(self.model, fqn, holder[id(p)])
                continue
            holder[id(p)] = fqn
            sharding = self.shardings[fqn]
            shard = sharding.shard(p.detach(), coord, sizes)
            _set_param(self.model, fqn, nn.Parameter(shard, requires_grad=p.requires_grad))
            if sharding.fsdp_dim or sharding.ddp_dim:
                owner, _, attr = fqn.rpartition(".")
                module = self.model.get_submodule(owner) if owner else self.model
                parametrize.register_parametrization(module, attr, _GatherParam(sharding, plan, mesh), unsafe=True)
        if plan.tp_dim is not None:
            self._install_tp_regions(regions, mesh.group_name(plan.tp_dim))

    def _install_tp_regions(self, regions: list[str], group_name: str) -> None:
        for name in regions:
            module = self.model.get_submodule(name)
            biased = self._rowwise_biases_after_reduce(name)
            module.register_forward_pre_hook(_copy_to_tp_hook(group_name))
            module.register_forward_hook(_reduce_from_tp_hook(group_name, name, biased))

    def _rowwise_biases_after_reduce(self, region: str) -> list[tuple[str, nn.Linear]]:
        """The rowwise Linears with a bias inside ``region``: each now computes without its bias
        (the region's reduce hook adds it once, after the all-reduce)."""
        out = []
        for sharding in self.shardings.values():
            linear_fqn = sharding.rowwise_bias_of
            if linear_fqn is None or not in_module(linear_fqn, region):
                continue
            linear = self.model.get_submodule(linear_fqn)
            linear.forward = _LinearWithoutBias(linear)
            out.append((linear_fqn, linear))
        return out

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """Local shards by the user's parameter FQN (deduplicated, model order)."""
        return {clean_fqn(n): p for n, p in self.named_parameters()}

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        *model_inputs, target = inputs
        model_inputs = cast_forward_inputs(model_inputs, self.plan.param_dtype)
        # A parametrized (gathered) tensor read twice in one forward, e.g. a tied weight, is
        # gathered once.
        draws = (ReplicatedDraws(self._share_draw) if self._replicates_draws and patches.enabled(REPLICATED_DRAWS)
                 else contextlib.nullcontext())
        with parametrize.cached(), draws, buffers_updated_in_place(self.model):
            first = gather_first(self.model, self.gather_first)
            loss = with_zero_grads(self.loss_fn(self.model(*model_inputs), target), first)
        check_loss(loss, needs_grad=False)
        return loss


@contextlib.contextmanager
def buffers_updated_in_place(model: nn.Module) -> Iterator[None]:
    """A buffer the model reassigns in forward (``self.x_max = torch.max(self.x_max, x.max())``:
    ibert's activation ranges) is copied into the buffer it replaced, which is put back. Eager
    PyTorch keeps the new tensor; a trace records only mutations of its inputs, so a reassigned
    buffer would silently keep its old value in every graph (and in an executor holding the old
    tensor). As an in-place update the graph returns it like batch norm's running stats. A
    reassignment with another shape or dtype cannot be an update: ValueError naming it."""
    before = [(mod, name, buf) for mod in model.modules() for name, buf in mod._buffers.items() if buf is not None]
    yield
    for mod, name, old in before:
        new = mod._buffers.get(name)
        if new is old or new is None:
            continue
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"{type(mod).__name__}.{name}: forward replaces a buffer of shape {tuple(old.shape)} {old.dtype} by one of "
                f"{tuple(new.shape)} {new.dtype}; a compiled step updates buffers in place: keep its shape and dtype")
        with torch.no_grad():
            old.copy_(new)
        mod._buffers[name] = old


def cast_forward_inputs(inputs, param_dtype: torch.dtype | None):
    """Floating tensors among ``inputs`` (nested lists, tuples, dicts) cast to ``param_dtype``, as
    FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` casts the root module's forward
    inputs (an image model's pixels); integer inputs (token ids, masks) and the loss target are
    left alone. ``param_dtype`` None: ``inputs`` unchanged."""
    if param_dtype is None:
        return inputs
    from torch.utils import _pytree as pytree

    def cast(x):
        return x.to(param_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != param_dtype else x

    return pytree.tree_map(cast, inputs)


class _LinearWithoutBias:
    """A rowwise Linear's forward without its bias: ``x @ W_local.T`` is a partial sum."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.outputs: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.linear.weight)
        self.outputs.append(out)
        return out


def _copy_to_tp_hook(group_name: str):
    def hook(module, args):
        return (CopyToTPRegion.apply(args[0], group_name), *args[1:])

    return hook


def _reduce_from_tp_hook(group_name: str, region: str, biased: list[tuple[str, nn.Linear]]):
    def hook(module, args, output):
        out = ReduceFromTPRegion.apply(output, group_name)
        for name, linear in biased:
            produced = linear.forward.outputs
            last = produced[-1] if produced else None
            produced.clear()
            if last is not output:
                raise ValueError(
                    f"TP region {region!r} does not return the output of its rowwise Linear {name!r}, so "
                    f"{name}.bias cannot be added once after the region's all-reduce: make {name!r} the "
                    "region's last op, or give it no bias"
                )
            out = out + linear.bias
        return out

    return hook


def _tie(root: nn.Module, alias: str, holder: str) -> None:
    """Make ``root.<alias>`` read the parameter held at ``root.<holder>`` (through the holder, so
    its parametrization, if any, applies)."""
    owner, _, attr = alias.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    h_owner, _, h_attr = holder.rpartition(".")
    source = root.get_submodule(h_owner) if h_owner else root
    del module._parameters[attr]
    cls = type(module)
    tied = type(f"Tied{cls.__name__}", (cls,), {attr: property(lambda self: getattr(source, h_attr))})
    module.__class__ = tied


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    owner, _, attr = fqn.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    module._parameters[attr] = value


def split_batch(inputs, plan: ParallelPlan, spec: MeshSpec, coord: Mapping[str, int]):
    """This rank's slice (dim 0) of each global input, split over the plan's data dims."""
    chunks, index = 1, 0
    for dim in plan.data_dims:
        chunks, index = chunks * spec.size(dim), index * spec.size(dim) + coord[dim]
    out = []
    for i, t in enumerate(inputs):
        if t.shape[0] % chunks:
            raise ValueError(
                f"input {i} has batch {t.shape[0]}, not divisible by the {chunks} data-parallel ranks "
                f"of mesh dims {list(plan.data_dims)}"
            )
        out.append(t.chunk(chunks, dim=0)[index])
    return tuple(out)


def data_slices(inputs, plan: ParallelPlan, spec: MeshSpec) -> list[tuple]:
    """Every data-parallel rank's slice of the global batch (:func:`split_batch`), the first
    being the one of coordinate 0 on every data dim."""
    dims = list(plan.data_dims)
    coords = itertools.product(*(range(spec.size(d)) for d in dims))
    return [split_batch(inputs, plan, spec, dict(zip(dims, c, strict=True))) for c in coords]
