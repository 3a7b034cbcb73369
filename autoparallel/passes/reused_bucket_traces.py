"""A bucket like an earlier one reuses its merge's trace instead of tracing it again.

Upstream bucketing (``torch/_inductor/fx_passes/bucketing.py``) builds each bucket's nodes by
tracing the merge function with ``make_fx`` on the members' fake values (``_trace``): one trace
per bucket. A model repeats its blocks, so most buckets repeat an earlier bucket's signature: on
the 8B LLaMA at 32 layers, 174 of the 188 bucket traces of the two bucketing passes were repeats,
and tracing was most of the pre-overlap pass.

Patch ``reused_bucket_traces``: inside :func:`reusing_bucket_traces`, a bucket whose merge
function and arguments match an earlier bucket's (every tensor's shape, stride, storage offset,
dtype, device and ``requires_grad``; every other argument's value) gets that trace's graph back.
Its fake values are made afresh first, by running the graph on this bucket's values: a value is
never shared between two buckets' nodes, so their storages stay distinct, as the overlap
scheduler's memory estimate (which keys on storages) needs. A symbolic size, or an argument whose
value cannot be compared (an opaque group object), is traced as upstream does. The graphs are
the ones upstream builds, node by node.

The swap is of the module attribute ``_trace`` (``_insert_fn_trace_before_node`` looks it up at
call time), scoped and restored on exit, exceptions included; the reused traces go with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import patches

PATCH = "reused_bucket_traces"

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class _Unkeyable(Exception):
    """An argument whose trace cannot be told apart from another's by value."""


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        sizes = (*x.shape, *x.stride(), x.storage_offset())
        if not all(type(s) is int for s in sizes):
            raise _Unkeyable("symbolic size")
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(y) for y in x))
    if isinstance(x, _PLAIN):
        return (type(x).__name__, x)
    raise _Unkeyable(type(x).__name__)


def trace_key(fn: Callable, inps: Any) -> tuple | None:
    """What a bucket's trace depends on: the merge function and its arguments' metadata; None
    when an argument cannot be compared by value (then the bucket is traced)."""
    try:
        hash(fn)
        return (fn, _key(list(inps)))
    except (_Unkeyable, TypeError):
        return None


class _FreshValues(fx.Interpreter):
    """Runs a reused trace on a new bucket's fake values and gives every node a value of its own."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            n.meta[M.VAL] = pytree.tree_map_only(torch.Tensor, snapshot_fake, out)
        return out


def _retrace_values(gm: fx.GraphModule, inps: Any) -> fx.GraphModule:
    fake_mode = detect_fake_mode(inps)
    assert fake_mode is not None, "a key matched a stored trace, whose arguments had one (upstream asserts it)"
    with fake_mode, enable_python_dispatcher():
        _FreshValues(gm).run(*pytree.tree_leaves(inps), enable_io_processing=False)
    return gm


@contextlib.contextmanager
def reusing_bucket_traces() -> Iterator[dict]:
    """Within the scope, a bucket like an earlier one reuses its trace (unless the patch is
    disabled). Yields the counts (``traced``, ``reused``) for reports and tests."""
    counts = {"traced": 0, "reused": 0}
    if not patches.enabled(PATCH):
        yield counts
        return
    from torch._inductor.fx_passes import bucketing

    upstream = bucketing._trace
    traces: dict[tuple, fx.GraphModule] = {}

    def trace(fn, inps):
        key = trace_key(fn, inps)
        if key is not None and key in traces:
            counts["reused"] += 1
            return _retrace_values(traces[key], inps)
        counts["traced"] += 1
        gm = upstream(fn, inps)
        if key is not None:
            traces[key] = gm
        return gm

    bucketing._trace = trace
    try:
        yield counts
    finally:
        bucketing._trace = upstream


__all__ = ["PATCH", "reusing_bucket_traces", "trace_key"]
