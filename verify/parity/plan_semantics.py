"""The independent plan checker's ``semantics`` group (verify/parity/plan_check.py runs it): each op
run on every simulated rank's shard of real values in its chosen input placements, the outputs
reassembled in its chosen output placements and compared with the unsharded op's output; ranks
that claim a replicated output must agree; a call with no output (an assert) must get every input
whole on every rank. Nothing of the planner is imported here."""

from __future__ import annotations

import zlib

import torch
from torch import fx
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial
from torch.utils import _pytree as pytree

from autoparallel import meta as M
from autoparallel import roles
from verify.parity.differential import Feeds


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]


def tensor_metas(node: fx.Node) -> list[torch.Tensor | None]:
    val = node.meta.get(M.VAL)
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, list | tuple):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def dropout_p(node: fx.Node) -> float | None:
    """The op's ``dropout_p`` (its schema default when not given), None for an op without one."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == "dropout_p":
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get("dropout_p", a.default_value)
    return None


def static_args(node: fx.Node) -> str:
    return repr(pytree.tree_map(lambda x: "T" if isinstance(x, fx.Node) else x, (node.args, node.kwargs)))


def unsharded_values(gm: fx.GraphModule, seed: int) -> dict[fx.Node, object]:
    """Every node's value on one device, from deterministic random inputs (token ids and labels in
    the range their uses allow)."""
    feeds = Feeds(1, seed)
    values: dict[fx.Node, object] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            values[n] = out
            return out

    def value(ph: fx.Node) -> torch.Tensor:
        val = ph.meta[M.VAL]
        if roles.is_tangent(ph.meta.get(M.ROLE)):
            return torch.ones(tuple(val.shape), dtype=val.dtype)
        try:
            return feeds.value(ph)[0]
        except ValueError:  # an integer whose range its uses do not tell (read through an alias): 0 or 1
            return torch.randint(0, 2, tuple(val.shape), generator=torch.Generator().manual_seed(seed), dtype=val.dtype)

    args = [value(ph) for ph in gm.graph.find_nodes(op="placeholder")]
    with torch.no_grad():
        _Record(gm).run(*args, enable_io_processing=False)
    return values


_SIZE_ARGS = {"size", "shape", "input_sizes"}


def simulate(node, values, ins, outs, sizes, coords, seed) -> str | None:
    """Run ``node`` on every rank's shards; a description of the first disagreement, or None."""
    g = torch.Generator().manual_seed(seed * 7919 + zlib_key(node.name))
    args = tensor_inputs(node)
    pieces = [_split(values[a], pl, sizes, coords, g) for a, pl in zip(args, ins, strict=True)]
    masks = [next((m[r] for _, m in pieces if m[r] is not None), None) for r in range(len(coords))]
    want = values[node]
    if want is None:  # a call with no output (an assert, a print): its effect is the unsharded one only on whole inputs
        problem = _not_whole(pieces, [values[a] for a in args], coords)
        if problem:
            return problem
    local_outs = []
    schema = node.target._schema
    size_names = {i: a.name for i, a in enumerate(schema.arguments) if a.name in _SIZE_ARGS}
    metas = tensor_metas(node)
    for r, c in enumerate(coords):
        it = iter([p[0][r] for p in pieces])  # tensor inputs in tensor_inputs' order
        new_args = pytree.tree_map(lambda x, it=it: next(it) if isinstance(x, fx.Node) else x, (node.args, node.kwargs))
        call_args, call_kwargs = list(new_args[0]), dict(new_args[1])
        if outs and outs[0] is not None and metas and metas[0] is not None:
            local = _local_shape(tuple(metas[0].shape), outs[0], sizes, c)
            for i, name in size_names.items():
                if i < len(call_args) and isinstance(call_args[i], list | tuple):
                    call_args[i] = [-1 if v == -1 else s for v, s in zip(call_args[i], local, strict=False)]
                elif name in call_kwargs and isinstance(call_kwargs[name], list | tuple):
                    call_kwargs[name] = [-1 if v == -1 else s for v, s in zip(call_kwargs[name], local, strict=False)]
        got = node.target(*call_args, **call_kwargs)
        local_outs.append(list(got) if isinstance(got, list | tuple) else [got])
    wants = [] if want is None else list(want) if isinstance(want, list | tuple) else [want]
    for k, (pl, ref) in enumerate(zip(outs, wants, strict=True)):
        if pl is None or not isinstance(ref, torch.Tensor):
            continue
        try:
            full = _combine([o[k] for o in local_outs], pl, sizes, coords, masks)
        except _Disagree as e:
            return f"output {k}: {e}"
        except RuntimeError as e:
            return f"output {k}: the shards do not reassemble under {pl}: {str(e).splitlines()[0][:160]}"
        problem = _differs(full, ref)
        if problem:
            return f"output {k} ({pl}) reassembled from the ranks differs from the unsharded op: {problem}"
    return None


def _not_whole(pieces, fulls, coords) -> str | None:
    """The first rank whose piece of an input is not the whole unsharded value, described; None
    when every rank passes every input whole (what a call run for its side effect needs: a check of
    a piece, or of one rank's term of a Partial, is another check than the single-device one)."""
    for k, ((local, _), full) in enumerate(zip(pieces, fulls, strict=True)):
        for r, c in enumerate(coords):
            if local[r].shape != full.shape or not torch.equal(local[r], full):
                return (f"input {k}: rank {c} passes a piece of shape {tuple(local[r].shape)}, not the whole value "
                        f"{tuple(full.shape)}: a call with no output (an assert, a print) runs only on the whole value")
    return None


def zlib_key(name: str) -> int:
    return zlib.crc32(name.encode()) % (2**31)


def _local_shape(shape, pl, sizes, coord) -> list[int]:
    shape = list(shape)
    for p, n, c in zip(pl, sizes, coord, strict=True):
        if isinstance(p, Shard):
            chunk = -(-shape[p.dim] // n) if shape[p.dim] else 0
            shape[p.dim] = max(0, min(chunk, shape[p.dim] - c * chunk))
    return shape


def _split(full, pl, sizes, coords, g):
    """Each rank's local value of ``full`` under ``pl`` (mesh dims outer first), and each rank's
    mask where a MaskPartial input hides rows (None otherwise)."""
    locals_, masks = [], []
    noise: dict = {}  # (mesh dim, outer coordinate) -> the summands' noise, shared by its ranks
    for c in coords:
        x, mask = full, None
        for i, (p, n) in enumerate(zip(pl, sizes, strict=True)):
            j = c[i]
            if isinstance(p, Shard):
                x = _chunk(x, p.dim, n, j)
            elif isinstance(p, _MaskPartial):
                span = -(-p.offset_shape[p.offset_dim] // n)
                lo = j * span
                mask = (x < lo) | (x >= lo + span)
                x = (x - lo).masked_fill(mask, 0)
            elif isinstance(p, Partial):
                x = _partial_piece(x, p.reduce_op, n, j, g, noise.setdefault((i, c[:i]), {}))
        locals_.append(x)
        masks.append(mask)
    return locals_, masks


def _partial_piece(x, op, n, j, g, noise: dict):
    """Rank j's summand: pieces of ``x`` that reduce (sum, avg, max, min) to ``x``, with noise of
    its own magnitude, so that a non-linear op on them cannot pass by homogeneity."""
    if not x.is_floating_point():
        raise ValueError(f"a Partial({op}) of a {x.dtype} tensor")
    if "noise" not in noise:
        scale = float(x.abs().mean()) + 1.0 if x.numel() else 1.0
        drawn = torch.randn((n, *x.shape), generator=g, dtype=torch.float64) * scale
        noise["noise"] = drawn - drawn.mean(0, keepdim=True)
    e = noise["noise"][j].to(x.dtype)
    if op == "sum":
        return x / n + e
    if op == "avg":
        return x + e
    if op in ("max", "min"):
        lower = e.abs() + 1.0
        return x if j == 0 else (x - lower if op == "max" else x + lower)
    raise ValueError(f"Partial({op}) is not simulated")


def _chunk(x, dim, n, j):
    chunk = -(-x.shape[dim] // n) if x.shape[dim] else 0
    start = min(j * chunk, x.shape[dim])
    return x.narrow(dim, start, max(0, min(chunk, x.shape[dim] - start)))


class _Disagree(Exception):
    pass


def _combine(local, pl, sizes, coords, masks):
    """The full value from every rank's output under ``pl`` (innermost mesh dim first);
    ``masks``: per rank, the rows a MaskPartial input hid (its output rows there are dropped)."""
    pieces = dict(zip(coords, local, strict=True))
    for i in reversed(range(len(pl))):
        p = pl[i]
        grouped: dict[tuple, list] = {}
        for c, t in sorted(pieces.items()):
            grouped.setdefault(c[:i], []).append((c, t))
        new = {}
        for head, members in grouped.items():
            ts = [t for _, t in members]
            if isinstance(p, Shard):
                new[head] = torch.cat(ts, dim=p.dim)
            elif isinstance(p, Replicate):
                for c, t in members[1:]:
                    problem = _differs(t, ts[0])
                    if problem:
                        raise _Disagree(f"ranks at {members[0][0]} and {c} disagree on a replicated value: {problem}")
                new[head] = ts[0]
            elif isinstance(p, _MaskPartial):
                acc = None
                for c, t in members:
                    m = next((mm for cc, mm in zip(coords, masks, strict=True) if cc[: len(c)] == c and mm is not None), None)
                    if m is not None:
                        t = t.masked_fill(m.reshape(*m.shape, *([1] * (t.dim() - m.dim()))), 0)
                    acc = t if acc is None else acc + t
                new[head] = acc
            elif isinstance(p, Partial):
                stack = torch.stack(ts)
                new[head] = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}[p.reduce_op]
            else:
                raise _Disagree(f"placement {p} is not simulated")
        pieces = new
    return pieces[()]


def _differs(got, want) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if got.is_complex():
        got, want = torch.view_as_real(got), torch.view_as_real(want)
    if not got.is_floating_point():
        n = int((got != want).sum())
        return f"{n} of {got.numel()} elements differ" if n else None
    a, b = got.double(), want.double()
    if bool(((torch.isnan(a) != torch.isnan(b))).any()):
        return "NaN on one side"
    a, b = a.nan_to_num(), b.nan_to_num()
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    tol = (1e-3 if want.dtype.itemsize >= 4 else 3e-2) * scale + 1e-6
    return f"max |diff| {err:.3e} > {tol:.3e} (scale {scale:.3e})" if err > tol else None
