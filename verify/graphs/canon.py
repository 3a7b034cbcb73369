"""FX graph -> canonical text, the body of every reviewed golden file.

The text is a pure function of the graph's structure and metadata: the same graph gives the same
bytes in any process, worker, test order and ``PYTHONHASHSEED``. One line per node, in graph
order (graph order is a topological order; a pass that reorders nodes shows up in the diff)::

    # tiny mlp, forward
    input:0: f32[8, 32]
    param:fc1.weight: f32[64, 32]
    fc1/t_0: f32[32, 64] = aten.t.default(param:fc1.weight)
    fc1/mm_0: f32[8, 64] = aten.mm.default(input:0, fc1/t_0)
    fc2.weight/all_gather_into_tensor_0: f32[32, 16] = _c10d_functional.all_gather_into_tensor.default(arg_2, 8, dp)  {recompute=MUST_RECOMPUTE ac=ap}
    fc2.weight/wait_tensor_0: f32[32, 16] = _c10d_functional.wait_tensor.default(fc2.weight/all_gather_into_tensor_0)
    return:
      loss = sum_0
      grad:fc1.weight = fc1/mm_1

Rules:

* **Names.** Placeholders are named by ``node.meta[ROLE]`` (``param:<fqn>``, ``input:<i>``,
  ``tangent:<i>``, ...) and otherwise ``arg_<position>``. Every other node is
  ``<scope>/<op>_<k>`` where ``<op>`` is the op's short name (``aten.mm.default`` -> ``mm``,
  ``operator.getitem`` -> ``getitem``) and ``k`` counts that op's nodes *within the scope*, in
  graph order. The scope keeps names local: a node inserted into one layer renumbers only nodes
  of that layer, not every later node of the graph. It is, first found:

  1. the module path the tracer recorded (``custom[MODULE_PATH]``, see
     ``autoparallel.parallelize.module_paths``; backward nodes carry their forward node's),
  2. the innermost entry of ``nn_module_stack`` (make_fx / Dynamo traces), normalized to a dotted
     path (Dynamo's ``L['self'].layers[0]`` -> ``layers.0``; the stack's keys, which Dynamo
     makes from object ids, are never read),
  3. the AC region (``custom[AC_REGION]`` = ``i`` -> ``ac<i>``),
  4. the scope of the node's latest (in graph order) input that has one by rules 1-3 (gradient
     accumulation, a detach the partitioner adds, bucketing glue). Never a borrowed scope, so a
     chain of such nodes does not move as a whole when its head changes; the latest input, so
     a gradient accumulation keeps its scope when an earlier contribution gets a new producer,
  5. none: the node is ``<op>_<k>``, counted per op over the graph's unscoped nodes.

  Backward nodes (AOT's ``partitioner_tag == "is_backward"``, the graph trainer's
  ``custom[PHASE] == "backward"``) are ``<scope>/bw/<op>_<k>`` with their own counters, counted
  from the end of the graph: a module's backward runs its forward ops in reverse, so an op
  appended to a module's forward renumbers nothing, forward or backward, and one inserted
  earlier renumbers only the later same-op nodes of that module in both.

  The full target, overload included, is printed on the right-hand side.
* **Process groups.** The ``group_name`` argument of any op whose schema has one (the
  ``_c10d_functional`` collectives) prints as its mesh-dim label (``dp``, ``tp``, ``dp*tp``),
  looked up in ``group_dims`` (argument, else ``gm.meta[GM_GROUP_DIMS]``). A group the map does
  not know raises ``ValueError`` naming the node.
* **Types.** ``name: <val> = ...`` where ``<val>`` comes from ``node.meta["val"]``: tensors as
  ``f32[8, 64]`` (device appended as ``@cuda:0`` when it is not the CPU), tuples/lists of them
  as ``(f32[2], f32[2])``, SymInts as their expression, other values via ``repr``. Shape symbols
  are renamed in order of first appearance (``s0``, ``s1``, unbacked ``u0``, ...), because the
  symbol ids the tracer picks are not meaningful; ``canonicalize_pair`` shares one renaming
  between the forward and the backward.
* **Missing ``val``.** By default a node without ``meta["val"]`` raises ``ValueError`` naming the
  node (run ``FakeTensorProp`` or trace with ``make_fx``/``aot_export`` first). With
  ``require_val=False`` such nodes print without the ``: <val>`` part. ``get_attr`` nodes without
  ``val`` are described from the attribute itself; the output node never needs one.
* **Tags** at the end of the line, in this fixed order: ``recompute=<CheckpointPolicy name>``,
  ``ac=<ac_graph_id>`` (``ap`` for ``AP_AC_GRAPH_ID``), ``must_save`` (``must_save[0,2]`` with
  getitem indices, ``must_save=False`` when explicitly false), ``phase=<custom phase>``,
  ``bucket=<meta[BUCKET] tag>``.
* **Constants** print deterministically: floats with ``repr``, dtypes as ``torch.float32``,
  devices as ``device('cpu')``, kwargs and dict keys sorted, sets sorted, object addresses
  replaced by ``0x?``. No stack traces, file paths or node-name counters of the input graph.
* **Output.** ``return:`` followed by one line per output value, prefixed with its role from the
  output node's ``meta[ROLE]`` list where present (``loss = sum_0``, ``saved:3 = mm_2``).
"""

from __future__ import annotations

import enum
import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from autoparallel import meta as M
from autoparallel.fx_utils import (
    group_arg_name,
    missing_val_error,
    resolve_attr,
    schema_group_index,
)
from autoparallel.mesh import dim_label, group_dims_of

__all__ = ["canonical_names", "canonicalize", "canonicalize_pair", "SymbolNamer"]

_ADDR_RE = re.compile(r"0x[0-9a-fA-F]+")
_NON_IDENT_RE = re.compile(r"\W+")
_SYM_PREFIX_RE = re.compile(r"^[A-Za-z_]+")

_DTYPE_ABBRS = {
    torch.bool: "b8",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def dtype_abbr(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``f32`` (``print_readable`` spelling); unknown dtypes spelled out."""
    abbr = _DTYPE_ABBRS.get(dtype)
    if abbr is None:
        from torch.fx.graph import dtype_abbrs

        abbr = dtype_abbrs.get(dtype, str(dtype).removeprefix("torch."))
    return abbr


class SymbolNamer:
    """Renames shape symbols by first appearance (``s75`` -> ``s0``), one counter per prefix.

    Share one instance between graphs that share a ShapeEnv (forward and backward) so a symbol
    keeps its name across both.
    """

    def __init__(self) -> None:
        self._map: dict[Any, Any] = {}
        self._counts: dict[str, int] = {}

    def expr_text(self, expr: Any) -> str:
        import sympy

        if not isinstance(expr, sympy.Basic):
            return str(expr)
        for sym in sorted(expr.free_symbols, key=lambda s: s.name):
            if sym not in self._map:
                m = _SYM_PREFIX_RE.match(sym.name)
                prefix = m.group(0) if m else "s"
                k = self._counts.get(prefix, 0)
                self._counts[prefix] = k + 1
                self._map[sym] = sympy.Symbol(f"{prefix}{k}", **sym.assumptions0)
        return str(expr.xreplace(self._map))

    def sym_text(self, value: torch.SymInt | torch.SymFloat | torch.SymBool) -> str:
        node = value.node
        const = node.maybe_as_int() if hasattr(node, "maybe_as_int") else None
        if const is not None:
            return str(const)
        return self.expr_text(node.expr)


def _is_sym(x: Any) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _dim_text(d: Any, syms: SymbolNamer) -> str:
    return syms.sym_text(d) if _is_sym(d) else str(int(d))


def tensor_text(t: torch.Tensor, syms: SymbolNamer) -> str:
    """``f32[8, 64]`` (``@cuda:0`` appended off the CPU)."""
    shape = ", ".join(_dim_text(d, syms) for d in t.shape)
    text = f"{dtype_abbr(t.dtype)}[{shape}]"
    dev = t.device
    if dev.type not in ("cpu", "meta"):
        text += f"@{dev}"
    return text


def val_text(v: Any, syms: SymbolNamer) -> str:
    """The ``: <val>`` part of a line for a ``meta["val"]`` value."""
    if isinstance(v, torch.Tensor):
        return tensor_text(v, syms)
    if _is_sym(v):
        return syms.sym_text(v)
    text = _container_text(v, lambda x: val_text(x, syms))
    return text if text is not None else _const_text(v, syms)


def _container_text(a: Any, item) -> str | None:
    """Tuples, lists, dicts (keys sorted) and sets (sorted) with ``item`` for the elements."""
    if isinstance(a, tuple):
        inner = ", ".join(item(x) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(item(x) for x in a) + "]"
    if isinstance(a, Mapping):
        pairs = sorted((item(k), item(v)) for k, v in a.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    if isinstance(a, (set, frozenset)):
        return "{" + ", ".join(sorted(item(x) for x in a)) + "}"
    return None


def _const_text(x: Any, syms: SymbolNamer) -> str:
    if x is None or isinstance(x, (bool, int, str)):
        return repr(x)
    if isinstance(x, float):
        return repr(x)
    if _is_sym(x):
        return syms.sym_text(x)
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, torch.device):
        return f"device({str(x)!r})"
    if isinstance(x, (torch.layout, torch.memory_format)):
        return str(x)
    if isinstance(x, torch.Tensor):
        return f"tensor({tensor_text(x, syms)})"
    if isinstance(x, enum.Enum):
        return f"{type(x).__name__}.{x.name}"
    if isinstance(x, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(x)
    if isinstance(x, slice):
        return f"slice({_const_text(x.start, syms)}, {_const_text(x.stop, syms)}, {_const_text(x.step, syms)})"
    return _ADDR_RE.sub("0x?", repr(x))


def _op_short_name(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload):
            name = t._opname
        elif isinstance(t, torch._ops.OpOverloadPacket):
            name = t._qualified_op_name.split("::")[-1]
        elif isinstance(t, torch._ops.HigherOrderOperator):
            name = t.name()
        else:
            name = getattr(t, "__name__", type(t).__name__)
    elif node.op == "call_method":
        name = str(t)
    elif node.op == "call_module":
        name = str(t).replace(".", "_")
    elif node.op == "get_attr":
        name = "get_attr"
    else:
        name = node.op
    name = _NON_IDENT_RE.sub("_", name)
    return name if name.strip("_") else "node"


def _target_text(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(t)
        if isinstance(t, torch._ops.HigherOrderOperator):
            return f"higher_order.{t.name()}"
        if getattr(operator, getattr(t, "__name__", ""), None) is t:
            return f"operator.{t.__name__}"
        try:
            from torch.fx.node import _get_qualified_name

            text = _get_qualified_name(t)
        except Exception:
            text = f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"
        return _ADDR_RE.sub("0x?", text)
    if node.op == "call_method":
        return f"call_method.{t}"
    if node.op == "call_module":
        return f"call_module[{t}]"
    return str(t)


def _missing_val_error(node: fx.Node) -> ValueError:
    return missing_val_error(node, "canonical text (shapes inline)", "; or pass require_val=False to omit shapes")


def _tags_text(node: fx.Node) -> str:
    parts = []
    meta = node.meta
    if M.RECOMPUTE in meta and meta[M.RECOMPUTE] is not None:
        pol = meta[M.RECOMPUTE]
        parts.append("recompute=" + (pol.name if isinstance(pol, enum.Enum) else repr(pol)))
    if M.AC_GRAPH_ID in meta and meta[M.AC_GRAPH_ID] is not None:
        gid = meta[M.AC_GRAPH_ID]
        parts.append("ac=ap" if gid == M.AP_AC_GRAPH_ID else "ac=" + repr(gid))
    custom = meta.get(M.CUSTOM) or {}
    if M.AP_MUST_SAVE in custom:
        if custom[M.AP_MUST_SAVE]:
            idx = custom.get(M.AP_MUST_SAVE_GETITEM_INDICES)
            if idx:
                parts.append("must_save[" + ",".join(str(int(i)) for i in sorted(idx)) + "]")
            else:
                parts.append("must_save")
        else:
            parts.append("must_save=False")
    if custom.get(M.PHASE) is not None:
        parts.append(f"phase={custom[M.PHASE]}")
    if meta.get(M.BUCKET) is not None:
        parts.append(f"bucket={meta[M.BUCKET]}")
    return "  {" + " ".join(parts) + "}" if parts else ""


_STACK_ROOT_RE = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")  # Dynamo's root: L['self'].
_STACK_INDEX_RE = re.compile(r"\[['\"]?([^'\"\]]+)['\"]?\]")


def _stack_path(entry: Any) -> str:
    """Dotted module path of one ``nn_module_stack`` value (``(path, type)`` or a path)."""
    path = entry[0] if isinstance(entry, tuple) else entry
    path = _STACK_ROOT_RE.sub("", str(path))
    path = _STACK_INDEX_RE.sub(r".\1", path)
    return path.strip(".")


def own_scope(node: fx.Node) -> str | None:
    """The naming scope a node's metadata gives it (rules 1-3 of the module docstring)."""
    custom = node.meta.get(M.CUSTOM) or {}
    path = custom.get(M.MODULE_PATH)
    if path:
        return str(path)
    stack = node.meta.get(M.NN_MODULE_STACK)
    if stack:
        path = _stack_path(list(stack.values())[-1])
        if path:
            return path
    region = custom.get(M.AC_REGION)
    if region is not None:
        return f"ac{region}"
    return None


def _is_backward(node: fx.Node) -> bool:
    """AOT's ``partitioner_tag`` or the graph trainer's ``custom[PHASE]`` says backward."""
    if node.meta.get(M.PARTITIONER_TAG) == "is_backward":
        return True
    return (node.meta.get(M.CUSTOM) or {}).get(M.PHASE) == M.PHASE_BACKWARD


def node_names(graph: fx.Graph) -> dict[fx.Node, str]:
    """Canonical name of every node but the output (see the module docstring, "Names")."""
    names: dict[fx.Node, str] = {}
    used: set[str] = set()
    scope_of: dict[fx.Node, str | None] = {}
    own: set[fx.Node] = set()  # nodes whose scope came from their own metadata
    index: dict[fx.Node, int] = {}  # graph position of the non-placeholder nodes
    forward, backward = [], []
    position = 0
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            role = node.meta.get(M.ROLE)
            base = str(role) if role is not None else f"arg_{position}"
            position += 1
            name, k = base, 1
            while name in used:  # duplicate roles: keep every name unique
                name, k = f"{base}~{k}", k + 1
            used.add(name)
            names[node] = name
            continue
        scope = own_scope(node)
        if scope is not None:
            own.add(node)
        else:  # the latest input with a scope of its own: no chains of borrowed scopes
            scoped = [a for a in node.all_input_nodes if a in own]
            scope = scope_of[max(scoped, key=index.__getitem__)] if scoped else None
        scope_of[node] = scope
        index[node] = len(index)
        (backward if _is_backward(node) else forward).append(node)
    counts: dict[tuple[str | None, bool, str], int] = {}
    # Backward nodes count from the end: the backward runs a scope's ops in reverse, so an op
    # appended to a module's forward renumbers nothing in either direction.
    for is_bw, nodes in ((False, forward), (True, backward[::-1])):
        for node in nodes:
            scope, short = scope_of[node], _op_short_name(node)
            base = "/".join(p for p in (scope, "bw" if is_bw else None, short) if p)
            key = (scope, is_bw, short)
            while True:
                k = counts.get(key, 0)
                counts[key] = k + 1
                name = f"{base}_{k}"
                if name not in used:
                    break
            used.add(name)
            names[node] = name
    return names


def graph_and_owner(gm: fx.GraphModule | fx.Graph) -> tuple[fx.Graph, Any]:
    """(graph, owning module or None) of a GraphModule or a Graph."""
    if isinstance(gm, fx.GraphModule):
        return gm.graph, gm
    if isinstance(gm, fx.Graph):
        return gm, gm.owning_module
    raise TypeError(f"expected an fx.GraphModule or fx.Graph, got {type(gm).__name__}")


def canonical_names(gm: fx.GraphModule | fx.Graph) -> dict[fx.Node, str]:
    """Each node's name in the canonical text (the output node has none), so pictures and
    tables can name nodes as the graph text a reviewer reads does."""
    graph, _ = graph_and_owner(gm)
    return node_names(graph)


def _canonical_lines(
    gm: fx.GraphModule | fx.Graph,
    *,
    group_dims: Mapping[str, str] | None,
    require_val: bool,
    syms: SymbolNamer,
) -> list[str]:
    graph, owner = graph_and_owner(gm)
    if group_dims is None:
        group_dims = group_dims_of(owner) if owner is not None else {}
    names = node_names(graph)
    defined: set[fx.Node] = set()
    lines: list[str] = []
    user = None  # the node whose arguments are being printed

    def arg_text(a: Any) -> str:
        if isinstance(a, fx.Node):
            if a not in defined:
                raise ValueError(
                    f"node {user.name!r} ({_target_text(user)}) uses {a.name!r} "
                    + ("before it is defined: the graph is not in topological order (graph.lint())"
                       if a in names else "which is not a node of this graph")
                )
            return names[a]
        text = _container_text(a, arg_text)
        return text if text is not None else _const_text(a, syms)

    def group_text(node: fx.Node, value: Any) -> str:
        try:
            return dim_label(
                group_arg_name(value),
                group_dims,
                where=f"node {node.name!r} ({_target_text(node)})",
            )
        except ValueError as e:
            raise ValueError(f"{e}, or pass group_dims={{name: label}} to canonicalize()") from None

    for node in graph.nodes:
        user = node
        if node.op == "output":
            lines.extend(_output_lines(node, arg_text))
            continue
        name = names[node]
        if node.op == "placeholder":
            rhs = ""
        else:
            args = list(node.args)
            kwargs = dict(node.kwargs)
            gidx = schema_group_index(node.target)
            parts = []
            for i, a in enumerate(args):
                parts.append(group_text(node, a) if i == gidx else arg_text(a))
            for k in sorted(kwargs):
                v = (
                    group_text(node, kwargs[k])
                    if (gidx is not None and k == "group_name")
                    else arg_text(kwargs[k])
                )
                parts.append(f"{k}={v}")
            if node.op == "get_attr":
                rhs = f" = get_attr({str(node.target)!r})"
            else:
                rhs = f" = {_target_text(node)}({', '.join(parts)})"
        if M.VAL in node.meta:
            typ = ": " + val_text(node.meta[M.VAL], syms)
        elif node.op == "get_attr":
            attr = resolve_attr(owner, node.target)
            if isinstance(attr, torch.Tensor):
                typ = ": " + tensor_text(attr, syms)
            elif isinstance(attr, torch.nn.Module):
                typ = ": module"
            elif require_val:
                raise _missing_val_error(node)
            else:
                typ = ""
        elif require_val:
            raise _missing_val_error(node)
        else:
            typ = ""
        lines.append(f"{name}{typ}{rhs}{_tags_text(node)}")
        defined.add(node)
    return lines


def _output_lines(node: fx.Node, arg_text) -> list[str]:
    value = node.args[0] if node.args else None
    roles = node.meta.get(M.ROLE)
    if not isinstance(value, (tuple, list)):
        role = roles[0] if isinstance(roles, (list, tuple)) and roles else roles
        prefix = f"{role} = " if isinstance(role, str) else ""
        return [f"return: {prefix}{arg_text(value)}"]
    if not value:
        return ["return: ()"]
    out = ["return:"]
    for i, v in enumerate(value):
        role = roles[i] if isinstance(roles, (list, tuple)) and i < len(roles) else None
        prefix = f"{role} = " if role is not None else ""
        out.append(f"  {prefix}{arg_text(v)}")
    return out


def canonicalize(
    gm: fx.GraphModule | fx.Graph,
    *,
    group_dims: Mapping[str, str] | None = None,
    title: str | None = None,
    require_val: bool = True,
    symbols: SymbolNamer | None = None,
) -> str:
    """Canonical, deterministic text of ``gm`` (see the module docstring for the format).

    ``group_dims`` overrides the graph's ``gm.meta[GM_GROUP_DIMS]`` map; ``title`` adds a
    ``# title`` first line; ``require_val=False`` omits shapes of nodes that have no
    ``meta["val"]`` instead of raising; ``symbols`` shares a shape-symbol renaming between calls.
    The result ends with a newline.
    """
    syms = symbols if symbols is not None else SymbolNamer()
    lines = [f"# {title}"] if title else []
    body = _canonical_lines(gm, group_dims=group_dims, require_val=require_val, syms=syms)
    lines.extend(body if body else ["(empty graph)"])
    return "\n".join(lines) + "\n"


def canonicalize_pair(
    fw_gm: fx.GraphModule | fx.Graph,
    bw_gm: fx.GraphModule | fx.Graph,
    *,
    group_dims: Mapping[str, str] | None = None,
    title: str | None = None,
    require_val: bool = True,
) -> str:
    """Canonical text of a forward/backward pair: ``== forward ==`` then ``== backward ==``.

    Node names restart in each section; shape symbols share one renaming across both.
    """
    syms = SymbolNamer()
    fw = canonicalize(fw_gm, group_dims=group_dims, require_val=require_val, symbols=syms)
    bw = canonicalize(bw_gm, group_dims=group_dims, require_val=require_val, symbols=syms)
    head = f"# {title}\n" if title else ""
    return f"{head}== forward ==\n{fw}\n== backward ==\n{bw}"
