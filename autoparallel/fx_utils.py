"""FX helpers that passes, runtime, trainer and verify share: collective predicates, the one
"no meta['val']" error, graph copies, FLOP nodes."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import fx

from autoparallel import meta as M

_c10d = torch.ops._c10d_functional

ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default
WAIT = _c10d.wait_tensor.default


def is_dtype_cast(node: fx.Node) -> bool:
    """A pure dtype conversion: ``prims.convert_element_type`` or ``aten._to_copy(x, dtype=...)``
    that changes nothing but the dtype."""
    if node.op != "call_function":
        return False
    if node.target == torch.ops.prims.convert_element_type.default:
        return True
    if node.target == torch.ops.aten._to_copy.default:
        return set(node.kwargs) <= {"dtype"} and "dtype" in node.kwargs and len(node.args) == 1
    return False


GROUP_ARG = "group_name"


def schema_group_index(target: Any) -> int | None:
    """Position of the ``group_name`` argument in any op's schema (the functional collectives and
    their autograd twins alike), else None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == GROUP_ARG:
            return i
    return None


def group_arg_index(node: fx.Node) -> int | None:
    """Position of the ``group_name`` argument of a ``_c10d_functional`` node, else None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "_c10d_functional":
        return None
    return schema_group_index(target)


def group_arg(node: fx.Node) -> Any:
    """The raw group argument (a name, or a ProcessGroup object) of a node whose op has one, in
    any namespace; None if it has none. :func:`group_of` is the name, for functional collectives."""
    idx = schema_group_index(node.target)
    if idx is None:
        return None
    if idx < len(node.args):
        return node.args[idx]
    return node.kwargs.get(GROUP_ARG)


def group_arg_name(value: Any) -> str:
    """The group name a group argument stands for (a ProcessGroup object's ``group_name``)."""
    name = getattr(value, "group_name", None)
    return str(name if name is not None else value)


def resolve_attr(owner: Any, target: str) -> Any:
    """The object a ``get_attr`` target names under ``owner`` (None where a part is missing)."""
    obj = owner
    for part in str(target).split("."):
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def schema_arg(node: fx.Node, name: str):
    """Argument ``name`` of an OpOverload call node, positional or keyword (None if absent)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def group_of(node: fx.Node) -> str | None:
    """The process-group name a collective node uses (None for non-collectives)."""
    i = group_arg_index(node)
    if i is None:
        return None
    if i < len(node.args):
        return str(node.args[i])
    return str(node.kwargs[GROUP_ARG])


# --- shared by the collective passes (bucketing, chained all-gather fusion) -------------------

ALL_GATHER_OUT = _c10d.all_gather_into_tensor_out.default
COLLECTIVE_LAUNCHES = frozenset({ALL_GATHER, ALL_GATHER_OUT, REDUCE_SCATTER, ALL_REDUCE})


def missing_val_error(node: fx.Node, why: str, hint: str = "") -> ValueError:
    """The error for a node without ``meta["val"]``: it names the node, what needed the value
    and how to get one (``hint``: a caller-specific way out, appended)."""
    return ValueError(
        f"node {node.name!r} ({node.format_node()}) has no meta['{M.VAL}'], needed for {why}; "
        "propagate FakeTensor vals first (trace with make_fx/aot or run FakeTensorProp)" + hint
    )


def node_val(node: fx.Node, why: str):
    """``node.meta["val"]``, or :func:`missing_val_error`."""
    try:
        return node.meta[M.VAL]
    except KeyError:
        raise missing_val_error(node, why) from None


def new_node_like(graph: fx.Graph, target, args, like: fx.Node, kwargs=None) -> fx.Node:
    """A ``call_function`` node at the graph's insertion point with ``like``'s meta (phase,
    module path, tags) and its own ``meta["val"]``, computed from its inputs' vals in their
    FakeTensorMode (or on the vals themselves where they are not fake)."""
    from torch._guards import detect_fake_mode

    node = graph.call_function(target, tuple(args), kwargs or {})
    node.meta.update({k: v for k, v in like.meta.items() if k != M.VAL})
    vals = [a.meta[M.VAL] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        node.meta[M.VAL] = target(*vals, **(kwargs or {}))
    else:
        with mode:
            node.meta[M.VAL] = target(*vals, **(kwargs or {}))
    return node


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph and nodes, so a pass that rewrites or tags the copy in
    place leaves ``gm`` untouched.

    Node names are kept; each node's ``meta`` dict is copied (its values, FakeTensors included,
    are shared: passes replace meta entries, they do not mutate them); ``gm.meta`` is copied too.
    Cheaper than ``copy.deepcopy`` (no FakeTensor copies, no pickled pytree specs), which matters
    on graphs of 8B-model size. The copy generates its Python code when first called or asked
    for its ``code`` (a lazy GraphModule): most copies are snapshots that are only read, and
    code generation was most of a copy's cost.
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module

    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    with warnings.catch_warnings():
        # Deep-copying pytree specs warns about a deprecation inside torch itself.
        warnings.simplefilter("ignore", FutureWarning)
        graph._codegen = copy.deepcopy(gm.graph._codegen)  # the calling convention (pytree specs)
    out = _make_graph_module(gm, graph, graph_module_cls=_LazyGraphModule)
    out.meta = dict(gm.meta)
    return out


def size_hint(x: int | torch.SymInt, fallback: int | None = None) -> int:
    """``x`` as an int: a symbolic size's trace-time hint (``fallback`` where it has none)."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch 2.11 (the GPU machines' CUDA build) names it hint_int
        from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint
    return int(optimization_hint(x) if fallback is None else optimization_hint(x, fallback=fallback))


def tensor_bytes(t: torch.Tensor) -> int:
    """``numel * element_size`` of a (fake) tensor; symbolic sizes use their trace-time hint."""
    return size_hint(t.numel(), fallback=0) * t.element_size()


def collective_bytes(node: fx.Node) -> int:
    """Bytes a collective moves: ``max(output bytes, input bytes)`` (the full, unsharded buffer)."""
    out = node_val(node, "the collective's size")
    inp = node_val(node.all_input_nodes[0], f"the size of collective {node.name!r}")
    return max(tensor_bytes(out), tensor_bytes(inp))


def resolve_group(node: fx.Node):
    """The live process group of collective ``node``; ValueError naming the node if none."""
    import torch.distributed as dist

    name = group_of(node)
    if name is None:
        raise ValueError(f"node {node.name!r} is not a _c10d_functional collective")
    if not dist.is_initialized():
        raise ValueError(
            f"node {node.name!r} uses process group {name!r} but no world is running; enter "
            "autoparallel.mesh.fake_world(...) (or a real world) whose groups the graph names"
        )
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except (RuntimeError, ValueError, KeyError):
        raise ValueError(
            f"node {node.name!r} uses unknown process group {name!r}: the running world has no "
            "group of that name; rebind the graph to this world (autoparallel.runtime.rebind."
            "rebind_groups) or trace it on this world"
        ) from None


def group_size_of(node: fx.Node) -> int:
    """Group size of a collective: its ``group_size`` argument, else its live group's size."""
    size = schema_arg(node, "group_size") if group_arg_index(node) is not None else None
    if size is None:
        size = resolve_group(node).size()
    return int(size)


def wait_of(node: fx.Node) -> fx.Node | None:
    """The single ``wait_tensor`` user of a collective launch (None if it has another shape)."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    return user if user.op == "call_function" and user.target is WAIT else None


def is_flop_compute(node: fx.Node) -> bool:
    """A node PyTorch's FLOP counter knows (mm, bmm, addmm, SDPA, conv, ...): what Inductor's
    overlap scheduler calls a compute node."""
    if node.op != "call_function":
        return False
    from torch.utils.flop_counter import flop_registry

    target = node.target
    return getattr(target, "overloadpacket", None) in flop_registry or target in flop_registry


def max_consec_compute_between_rs(graph: fx.Graph, is_compute=is_flop_compute) -> int:
    """Longest run of compute nodes between two consecutive reduce-scatter launches (graph order).

    The regression metric of topo-span bucketing: bucketing that rewires dependencies lets the
    following topological sort batch many matmuls before the first reduce-scatter. Compute nodes
    are ``is_flop_compute`` by default (the scheduler's notion, and the seeds' telemetry);
    verify.graphs.stats reports this same function.
    """
    best = 0
    run: int | None = None  # None until the first reduce-scatter
    rs_targets = (REDUCE_SCATTER, _c10d.reduce_scatter_tensor_coalesced.default)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in rs_targets:
            if run is not None:
                best = max(best, run)
            run = 0
        elif run is not None and is_compute(node):
            run += 1
    return best
