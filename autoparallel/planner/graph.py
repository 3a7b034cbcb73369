"""The graph a plan is made on: the unsharded joint forward+loss+backward graph, with names.

The planner reuses the project's tracer: ``build_joint_graph`` under a plan that shards nothing
gives the single-device program as one joint graph whose placeholders and outputs carry role
labels (``param:<fqn>``, ``input:<i>``, ``tangent:loss``; ``loss``, ``grad:<fqn>``). Tracing runs
on fake tensors with device "cpu" (autograd on fake cuda tensors aborts CPU builds of torch).

Three things are added on top, all deterministic functions of the model, so a later re-trace
(the lowering of a plan) rebuilds the same graph:

* **blocks**: every node traced inside ``<container>[i]`` (the model's list of identical
  blocks) is labelled ``<container>.<i>`` through the project's AC-region annotation, which
  backward nodes inherit; gradient-accumulation adds, which autograd does not annotate, take
  the block of their latest labelled input. Identical blocks later share ILP variables.
* **aliases**: ``aten.alias`` after every multi-user tensor, so that one redistribution can feed
  several consumers and consumers can still differ (the source of seed 000's alias round trips).
* **canonical keys**: a name per node that survives re-tracing and does not depend on FX's
  name counters: ``<block or ->/<fwd|bwd>/<op>#<k>`` (k-th such op of that block and phase),
  ``<key of producer>/alias`` for aliases, the role for placeholders and ``out:<role>`` for
  graph outputs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel.mesh import ParallelMesh
from autoparallel.parallelize.joint import JointGraph, build_joint_graph
from autoparallel.parallelize.plan import ParallelPlan
from autoparallel.trainer.regions import annotate_ac_regions, clear_ac_regions

log = logging.getLogger(__name__)

ALIAS = torch.ops.aten.alias.default
UNSHARDED_PLAN_NAME = "unsharded"
NO_BLOCK = "-"


@dataclass
class PlanningGraph:
    """The traced joint graph plus what the planner needs to name its nodes."""

    gm: fx.GraphModule
    mesh: ParallelMesh
    keys: dict[str, str]  # fx node name -> canonical key
    blocks: dict[str, str]  # fx node name -> block label (absent outside blocks)
    block_container: str | None
    input_roles: list[str]
    output_roles: list[str | None]
    trace_seconds: float
    num_aliases: int
    # The trace itself, still open (``keep_joint=True``): lowering a plan swaps the per-rank
    # graph into its export so the first partition compiles it (autoparallel.planner.lower).
    joint: JointGraph | None = None

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def node_by_key(self) -> dict[str, fx.Node]:
        return {self.keys[n.name]: n for n in self.gm.graph.nodes if n.name in self.keys}


def find_block_container(model: nn.Module) -> str | None:
    """The module list of identical blocks: the longest ``ModuleList`` whose children share one class.

    ``None`` when the model has no list of at least two same-class modules (planning still
    works, without sharing variables between blocks).
    """
    best: tuple[int, str] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        classes = {type(c) for c in mod}
        if len(classes) != 1:
            continue
        if best is None or len(mod) > best[0]:
            best = (len(mod), name)
    return None if best is None else best[1]


@contextlib.contextmanager
def _blocks_annotated(model: nn.Module, container: str | None) -> Iterator[None]:
    """Annotate the blocks of ``container`` with their index for the scope of a trace."""
    if container is None:
        yield
        return

    owner_name, _, attr = container.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    blocks = list(getattr(owner, attr))
    already = [b for b in blocks if "forward" in b.__dict__]
    if already:
        # The user's model carries its own per-instance forward (e.g. AC regions already set):
        # use it as is rather than replacing and later deleting it.
        yield
        return
    annotate_ac_regions(owner, container=attr)
    try:
        yield
    finally:
        for b in blocks:
            clear_ac_regions(b)


class _CastParam(nn.Module):
    """Parametrization: the parameter as the forward computes with it (mixed precision)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return p.to(self.dtype)


def _with_param_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` whose floating parameters are cast to ``dtype`` where they are read.

    Gradients then flow back through the cast into the parameter's own dtype, which is what a
    mixed-precision FSDP program does; the planner's grad-reduce-dtype constraint acts on them.
    """
    from torch.nn.utils import parametrize

    model = copy.deepcopy(model)
    for fqn, p in list(model.named_parameters(remove_duplicate=True)):
        if p.is_floating_point() and p.dtype != dtype:
            owner, _, attr = fqn.rpartition(".")
            parametrize.register_parametrization(model.get_submodule(owner) if owner else model, attr, _CastParam(dtype), unsafe=True)
    return model


def trace_planning_graph(
    model: nn.Module,
    mesh: ParallelMesh,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    block_container: str | None | bool = True,
    keep_joint: bool = False,
) -> PlanningGraph:
    """Trace the unsharded joint graph of ``loss_fn(model(*inputs[:-1]), inputs[-1])``.

    ``block_container``: ``True`` finds the list of identical blocks, a string names it, ``None``
    or ``False`` plans without blocks. ``keep_joint``: keep the trace's export open
    (``PlanningGraph.joint``, closed by whoever lowers or discards it) instead of closing it.
    """

    if block_container is True:
        container = find_block_container(model)
    elif block_container in (None, False):
        container = None
    else:
        container = str(block_container)
        try:
            model.get_submodule(container)
        except AttributeError:
            raise ValueError(f"block container {container!r} is not a submodule of {type(model).__name__}") from None
    traced = _with_param_dtype(model, param_dtype) if param_dtype is not None else model
    t0 = time.perf_counter()
    with _blocks_annotated(traced, container):
        jg = build_joint_graph(traced, ParallelPlan(name=UNSHARDED_PLAN_NAME, param_dtype=param_dtype), mesh, example_inputs, loss_fn,
                               eager_dropout=False)  # dropout stays one op the planner places
    try:
        gm = jg.gm
        input_roles, output_roles = list(jg.input_roles), list(jg.output_roles)
    finally:
        if not keep_joint:
            jg.close()
    seconds = time.perf_counter() - t0
    blocks = _label_blocks(gm.graph, container)
    num_aliases = insert_aliases(gm.graph, blocks)
    gm.recompile()
    keys = canonical_keys(gm.graph, blocks)
    log.info("planning graph: %d nodes (%d aliases), traced in %.2fs", len(gm.graph.nodes), num_aliases, seconds)
    return PlanningGraph(gm, mesh, keys, blocks, container, input_roles, output_roles, seconds, num_aliases, jg if keep_joint else None)


def phase_of(node: fx.Node) -> str:
    return "bwd" if node.meta.get(M.PARTITIONER_TAG) == "is_backward" else "fwd"


def _label_blocks(graph: fx.Graph, container: str | None) -> dict[str, str]:
    if container is None:
        return {}
    labels: dict[str, str] = {}
    prefix = container + "."
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op == "placeholder":
            role = node.meta.get(M.ROLE) or ""
            _, _, fqn = role.partition(":")
            if fqn.startswith(prefix):
                labels[node.name] = prefix + fqn[len(prefix) :].split(".")[0]
            continue
        if node.op != "call_function":
            continue
        region = (node.meta.get(M.CUSTOM) or {}).get(M.AC_REGION)
        if region is not None:
            labels[node.name] = f"{prefix}{int(region)}"
            continue
        if phase_of(node) == "bwd" and node.target is torch.ops.aten.add.Tensor:
            # Gradient accumulation (autograd does not annotate it): the block of the latest
            # labelled backward input, which is where the gradient being accumulated came from.
            labelled = [a for a in node.all_input_nodes if a.name in labels and phase_of(a) == "bwd" and a.op != "placeholder"]
            if labelled:
                labels[node.name] = labels[max(labelled, key=order.__getitem__).name]
    return labels


def _single_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get(M.VAL), torch.Tensor)


def insert_aliases(graph: fx.Graph, blocks: dict[str, str]) -> int:
    """``aten.alias`` after every tensor with more than one user; the number inserted."""
    count = 0
    for node in list(graph.nodes):
        if node.op not in ("placeholder", "call_function") or not _single_tensor(node):
            continue
        if node.target is ALIAS or len(node.users) < 2:
            continue
        anchor = node
        if node.op == "placeholder":
            # Aliases of placeholders go after the last placeholder (FX keeps placeholders first).
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(anchor):
            alias = graph.call_function(ALIAS, (node,))
        alias.meta[M.VAL] = node.meta[M.VAL]
        for key in (M.PARTITIONER_TAG, M.CUSTOM, M.SEQ_NR):
            if key in node.meta:
                alias.meta[key] = node.meta[key]
        node.replace_all_uses_with(alias, delete_user_cb=lambda user, alias=alias: user is not alias)
        if node.name in blocks:
            blocks[alias.name] = blocks[node.name]
        count += 1
    graph.lint()
    return count


def op_name(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    return str(node.target)


def canonical_keys(graph: fx.Graph, blocks: dict[str, str]) -> dict[str, str]:
    """fx node name -> a key that does not depend on FX's name counters (see module docstring)."""
    keys: dict[str, str] = {}
    counters: dict[tuple[str, str, str], int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            keys[node.name] = str(node.meta.get(M.ROLE) or node.name)
        elif node.op in ("call_function", "get_attr"):
            if node.target is ALIAS:
                keys[node.name] = f"{keys[node.args[0].name]}/alias"
                continue
            block = blocks.get(node.name, NO_BLOCK)
            # a lifted tensor constant: "constant", numbered like ops (its attribute name is FX's counter)
            slot = (block, phase_of(node), op_name(node) if node.op == "call_function" else "constant")
            k = counters.get(slot, 0)
            counters[slot] = k + 1
            keys[node.name] = f"{block}/{slot[1]}/{slot[2]}#{k}"
    if len(set(keys.values())) != len(keys):
        raise AssertionError("canonical node keys are not unique")
    return keys


def module_of(node: fx.Node) -> str:
    """The module whose forward made the node (``custom[MODULE_PATH]``, written while tracing;
    backward nodes inherit their forward node's), or ``the model`` at the top level."""
    path = (node.meta.get(M.CUSTOM) or {}).get(M.MODULE_PATH)
    return repr(path) if path else "the model"


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in the order DTensor strategies list them (args, then kwargs)."""
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
