"""A plan: where every tensor of the joint graph lives on the mesh, and what that costs.

JSON schema (``Solution.to_json`` / ``Solution.from_json``, ``"schema": "autoparallel.plan/1"``)::

    {
      "schema": "autoparallel.plan/1",
      "model": str,                      # what was planned (class name, preset, layers)
      "mesh": [[dim name, size], ...],   # outermost first
      "profile": str,                    # device profile name
      "memory_budget_bytes": float|null, # per-rank parameter bytes allowed (null: no bound)
      "param_memory_bytes": int,         # per-rank parameter bytes of this plan
      "objective_us": float,             # compute + communication of one step, microseconds
      "compute_us": float, "comm_us": float,
      "lp_bound_us": float | null,       # the LP relaxation's bound
      "proven_optimal": bool,            # false when the solver stopped at its time limit
      "params": {fqn: {mesh dim: placement}},          # one entry per parameter
      "inputs": {role: {mesh dim: placement}},         # "input:<i>", "buffer:<fqn>", "tangent:..."
      "nodes": {key: {"op": str,                       # canonical key -> placements
                      "out": [{mesh dim: placement} | null, ...],   # per output
                      "in": [{mesh dim: placement}, ...],           # per tensor input, in the
                                                                    # order of tensor_args(node)
                      "comm": [[collective, ...], ...]}},           # per input: the collectives
                                                                    # that move it, "all_gather(dp)"
      "node_names": {fx node name: key},   # the traced graph's names (may cover a subset of
                                           # blocks when the plan was made on fewer blocks)
      "comm": {kind: {mesh dim: {"count": int, "bytes": int}}},     # predicted per step
      "fallbacks": {key: why},             # ops that took the replicated fallback (no sharding
                                           # strategy; a random op that is not a dropout)
      "constants": {key: attribute},       # tensor constants lifted from forward (get_attr)
      "peak": {"bytes": int, "at": key,    # per-rank live parameters + activations + gradients at the
               "budget_bytes": float|null},  # step's worst point (planner/memory.py), and where
      "stats": {...}                       # solve statistics (not part of the plan's identity)
    }

Placements are strings: ``R``, ``S(d)``, ``P(sum)``/``P(avg)``/..., ``MaskP(op, shape, dim)``
(:func:`parse_placement` reads them back). A node's key is its canonical key
(``autoparallel.planner.graph``): ``<block>/<fwd|bwd>/<op>#<k>``, ``<key>/alias``, the role of a
placeholder, ``out:<role>`` for graph outputs; a re-trace of the same model gives the same keys.

The canonical text (:meth:`Solution.text`) holds everything that identifies the plan and nothing that
varies between runs (no timings, no FX names), so it is a golden.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autoparallel import roles

SCHEMA = "autoparallel.plan/1"


def placement_text(p: Placement) -> str:
    return str(p)


_SHARD = re.compile(r"^S\((\d+)\)$")
_STRIDED = re.compile(r"^_S\((\d+), (\d+)\)$")  # str(_StridedShard(d, split_factor=f)): _S(d, f)
_PARTIAL = re.compile(r"^P\((\w+)\)$")
_MASK = re.compile(r"^MaskP\((\w+), (.*), (-?\d+)\)$")


def parse_placement(text: str) -> Placement:
    """The Placement a plan spells as ``text`` (``R``, ``S(d)``, ``_S(d, split_factor)``, ``P(op)``, ``MaskP(...)``)."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if m := _SHARD.match(text):
        return Shard(int(m.group(1)))
    if m := _STRIDED.match(text):
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(int(m.group(1)), split_factor=int(m.group(2)))
    if m := _PARTIAL.match(text):
        return Partial(m.group(1))
    if m := _MASK.match(text):
        from torch.distributed.tensor.placement_types import _MaskPartial

        shape = ast.literal_eval(m.group(2))
        return _MaskPartial(offset_shape=shape, offset_dim=int(m.group(3)), reduce_op=m.group(1))
    raise ValueError(f"bad placement {text!r}: expected R, S(d), _S(d, split_factor), P(op) or MaskP(op, shape, dim)")


def by_dim(placements: Sequence[Placement] | None, names: Sequence[str]) -> dict[str, str] | None:
    if placements is None:
        return None
    return {n: placement_text(p) for n, p in zip(names, placements, strict=True)}


def dims_text(d: Mapping[str, str] | None, names: Sequence[str]) -> str:
    if d is None:
        return "-"
    return " ".join(f"{n}:{d[n]}" for n in names)


_DIGITS = re.compile(r"(\d+)")


def natural_key(key: str) -> tuple:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return tuple(int(p) if p.isdigit() else p for p in _DIGITS.split(key))


@dataclass
class NodePlacement:
    op: str
    out: list[dict[str, str] | None]
    ins: list[dict[str, str]]
    comm: list[list[str]] = field(default_factory=list)  # per input: collectives moving it, e.g. "all_gather(dp)"


@dataclass
class Solution:
    model: str
    mesh: list[tuple[str, int]]
    profile: str
    memory_budget_bytes: float | None  # None: no bound
    param_memory_bytes: int
    objective_us: float
    compute_us: float
    comm_us: float
    lp_bound_us: float | None
    proven_optimal: bool
    params: dict[str, dict[str, str]]
    inputs: dict[str, dict[str, str]]
    nodes: dict[str, NodePlacement]
    node_names: dict[str, str]
    comm: dict[str, dict[str, dict[str, int]]]
    stats: dict[str, Any] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # key -> why it is replicated (strategies.NO_STRATEGY ...)
    constants: dict[str, str] = field(default_factory=dict)  # key -> the get_attr's attribute
    peak: dict[str, Any] = field(default_factory=dict)  # {"bytes", "at", "budget_bytes"} (planner/memory.py)
    _context: Any = field(default=None, repr=False, compare=False)

    @property
    def mesh_names(self) -> list[str]:
        return [n for n, _ in self.mesh]

    @property
    def gap(self) -> float | None:
        if self.lp_bound_us is None or not math.isfinite(self.lp_bound_us) or self.objective_us <= 0:
            return None
        return max(0.0, (self.objective_us - self.lp_bound_us) / self.objective_us)

    # --- identity -----------------------------------------------------------------------------
    def text(self) -> str:
        """Canonical plan text: the golden of a plan (see module docstring)."""
        names = self.mesh_names
        gib = 2**30
        lines = [
            f"model: {self.model}",
            f"mesh: {','.join(f'{n}={s}' for n, s in self.mesh)}",
            f"profile: {self.profile}",
            f"param memory: {self.param_memory_bytes} bytes per rank ({self.param_memory_bytes / gib:.4f} GiB), "
            f"budget {'none' if self.memory_budget_bytes is None else f'{int(self.memory_budget_bytes)} bytes'}",
            f"objective: {self.objective_us:.3f} us (compute {self.compute_us:.3f} us, communication {self.comm_us:.3f} us)",
            f"optimal: {'proven' if self.proven_optimal else 'NOT PROVEN (solver time limit)'}",
            "",
            "## parameters",
        ]
        width = max((len(f) for f in self.params), default=10)
        for fqn in sorted(self.params, key=natural_key):
            lines.append(f"{fqn:<{width}}  {dims_text(self.params[fqn], names)}")
        lines += ["", "## inputs"]
        for role in sorted(self.inputs, key=natural_key):
            lines.append(f"{role}  {dims_text(self.inputs[role], names)}")
        lines += ["", "## communication (per step)"]
        for kind in sorted(self.comm):
            for dim in sorted(self.comm[kind]):
                c = self.comm[kind][dim]
                lines.append(f"{kind} {dim}: {c['count']} collectives, {c['bytes']} bytes")
        if self.fallbacks:  # absent when empty: plans without any keep their text
            lines += ["", "## replicated fallbacks"]
            lines += [f"{key}  {self.fallbacks[key]}" for key in sorted(self.fallbacks, key=natural_key)]
        if self.constants:
            lines += ["", "## constants (lifted from forward, replicated)"]
            lines += [f"{key}  {self.constants[key]}" for key in sorted(self.constants, key=natural_key)]
        if self.peak.get("budget_bytes") is not None:  # absent without a peak budget: older plans keep their text
            lines += ["", "## peak memory", f"{self.peak['bytes']} bytes per rank at {self.peak['at']}, budget {int(self.peak['budget_bytes'])} bytes"]
        lines += ["", "## nodes"]
        for key in sorted(self.nodes, key=natural_key):
            np_ = self.nodes[key]
            outs = ", ".join(dims_text(o, names) for o in np_.out)
            ins = "; ".join(dims_text(i, names) for i in np_.ins)
            moves = "; ".join(" ".join(c) for c in np_.comm if c)
            lines.append(f"{key}  {np_.op}  out[{outs}]  in[{ins}]" + (f"  moves[{moves}]" if moves else ""))
        return "\n".join(lines) + "\n"

    # --- (de)serialization --------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "mesh": [list(d) for d in self.mesh],
            "profile": self.profile,
            "memory_budget_bytes": self.memory_budget_bytes,
            "param_memory_bytes": self.param_memory_bytes,
            "objective_us": self.objective_us,
            "compute_us": self.compute_us,
            "comm_us": self.comm_us,
            "lp_bound_us": self.lp_bound_us if self.lp_bound_us is not None and math.isfinite(self.lp_bound_us) else None,
            "proven_optimal": self.proven_optimal,
            "params": self.params,
            "inputs": self.inputs,
            "nodes": {k: {"op": v.op, "out": v.out, "in": v.ins, "comm": v.comm} for k, v in self.nodes.items()},
            "node_names": self.node_names,
            "comm": self.comm,
            "stats": self.stats,
            "fallbacks": self.fallbacks,
            "constants": self.constants,
            "peak": self.peak,
        }

    @classmethod
    def from_json(cls, data: Mapping, *, source: str = "plan") -> Solution:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{source}: not an autoparallel plan (schema {data.get('schema')!r}, expected {SCHEMA!r})")
        try:
            return cls(
                model=data["model"],
                mesh=[(str(n), int(s)) for n, s in data["mesh"]],
                profile=data["profile"],
                memory_budget_bytes=None if data["memory_budget_bytes"] is None else float(data["memory_budget_bytes"]),
                param_memory_bytes=int(data["param_memory_bytes"]),
                objective_us=float(data["objective_us"]),
                compute_us=float(data["compute_us"]),
                comm_us=float(data["comm_us"]),
                lp_bound_us=None if data["lp_bound_us"] is None else float(data["lp_bound_us"]),
                proven_optimal=bool(data["proven_optimal"]),
                params={k: dict(v) for k, v in data["params"].items()},
                inputs={k: dict(v) for k, v in data["inputs"].items()},
                nodes={k: NodePlacement(v["op"], list(v["out"]), list(v["in"]), [list(c) for c in v.get("comm", [])]) for k, v in data["nodes"].items()},
                node_names=dict(data["node_names"]),
                comm={k: {d: dict(c) for d, c in v.items()} for k, v in data["comm"].items()},
                stats=dict(data.get("stats") or {}),
                fallbacks=dict(data.get("fallbacks") or {}),
                constants=dict(data.get("constants") or {}),
                peak=dict(data.get("peak") or {}),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed plan JSON ({type(e).__name__}: {e})") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Solution:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"plan file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_json(data, source=str(path))

    # --- reading a plan -----------------------------------------------------------------------
    def key_of(self, node: str) -> str:
        """A canonical key from a key, an FX node name of the traced graph, or a parameter FQN."""
        if node in self.nodes:
            return node
        if node in self.node_names:
            return self.node_names[node]
        if roles.param(node) in self.nodes:
            return roles.param(node)
        close = [k for k in self.nodes if node in k][:5]
        raise ValueError(f"no node {node!r} in the plan; give a canonical key, an FX node name or a parameter FQN (close: {close})")

    def explain(self, node: str) -> str:
        """The node's candidates, their costs given its neighbours' placements, and why the chosen one won."""
        if self._context is None:
            raise ValueError("explain needs the planning context: this plan was loaded from JSON; plan again to explain it")
        return self._context.explain(self.key_of(node))

    def costliest(self, n: int = 5) -> list[tuple[str, float]]:
        """The ``n`` nodes whose chosen placements cost the most (microseconds: compute plus the
        moves into them), costliest first: where to start ``explain``."""
        if self._context is None:
            raise ValueError("costliest needs the planning context: this plan was loaded from JSON; plan again")
        return self._context.costliest(n)

    def param_table(self) -> str:
        names = self.mesh_names
        width = max((len(f) for f in self.params), default=10)
        head = f"{'parameter':<{width}}  " + "  ".join(f"{n:<8}" for n in names)
        rows = [head, "-" * len(head)]
        for fqn in sorted(self.params, key=natural_key):
            rows.append(f"{fqn:<{width}}  " + "  ".join(f"{self.params[fqn][n]:<8}" for n in names))
        return "\n".join(rows)

    def _verdict(self) -> str:
        if self.proven_optimal:
            return "optimal"
        if self.stats.get("plan_source") == "heuristic":  # planner/incumbent.py
            return "NOT proven optimal: the solver's time limit stopped it; plan = heuristic incumbent"
        return "time limit reached: best plan found, NOT proven optimal"

    def summary(self) -> str:
        gib = 2**30
        gap = self.gap
        lines = [
            f"objective {self.objective_us / 1e3:.3f} ms per step (compute {self.compute_us / 1e3:.3f} ms, communication {self.comm_us / 1e3:.3f} ms)",
            f"param memory {self.param_memory_bytes / gib:.4f} GiB per rank"
            + (f" (budget {self.memory_budget_bytes / gib:.4f} GiB)" if self.memory_budget_bytes is not None else " (no budget)"),
            *(
                [
                    f"peak memory {self.peak['bytes'] / gib:.4f} GiB per rank (parameters, activations, gradients) at {self.peak['at']}"
                    + (f" (budget {self.peak['budget_bytes'] / gib:.4f} GiB)" if self.peak.get("budget_bytes") is not None else "")
                ]
                if self.peak
                else []
            ),
            f"solver: {self._verdict()}"
            + (f", LP bound {self.lp_bound_us / 1e3:.3f} ms, gap {gap:.2e}" if gap is not None else ""),
        ]
        for kind in sorted(self.comm):
            for dim in sorted(self.comm[kind]):
                c = self.comm[kind][dim]
                lines.append(f"  {kind:<14} {dim:<8} {c['count']:>6} x  {c['bytes'] / gib:10.4f} GiB")
        if self.fallbacks:
            lines.append(f"replicated fallback ({len(self.fallbacks)} node(s), the whole op on every rank):")
            lines += [f"  {key}: {self.fallbacks[key]}" for key in sorted(self.fallbacks, key=natural_key)]
        if self.constants:
            lines.append(f"tensor constants ({len(self.constants)}, replicated): " + ", ".join(
                f"{key} ({self.constants[key]})" for key in sorted(self.constants, key=natural_key)))
        return "\n".join(lines)


def diff(a: Solution, b: Solution, *, max_nodes: int = 40) -> str:
    """What differs between two plans: objective, parameters, inputs, nodes (the first
    ``max_nodes`` of them), communication."""
    if a.mesh != b.mesh:
        return f"plans are for different meshes: {a.mesh} vs {b.mesh}"
    names = a.mesh_names
    lines = [f"objective: {a.objective_us:.3f} us -> {b.objective_us:.3f} us ({b.objective_us - a.objective_us:+.3f} us)"]
    for title, da, db in (("parameters", a.params, b.params), ("inputs", a.inputs, b.inputs)):
        changed = [k for k in sorted(set(da) | set(db), key=natural_key) if da.get(k) != db.get(k)]
        lines.append(f"{title}: {len(changed)} differ")
        for k in changed:
            lines.append(f"  {k}: {dims_text(da.get(k), names)} -> {dims_text(db.get(k), names)}")
    changed = [k for k in list(dict.fromkeys([*a.nodes, *b.nodes])) if _node_view(a.nodes.get(k)) != _node_view(b.nodes.get(k))]
    lines.append(f"nodes: {len(changed)} of {len(set(a.nodes) | set(b.nodes))} differ")
    for k in changed[:max_nodes]:
        na, nb = a.nodes.get(k), b.nodes.get(k)
        fa = "absent" if na is None else ", ".join(dims_text(o, names) for o in na.out)
        fb = "absent" if nb is None else ", ".join(dims_text(o, names) for o in nb.out)
        lines.append(f"  {k}: out {fa} -> {fb}")
    if len(changed) > max_nodes:
        lines.append(f"  ... and {len(changed) - max_nodes} more")
    kinds = sorted(set(a.comm) | set(b.comm))
    for kind in kinds:
        dims = sorted(set(a.comm.get(kind, {})) | set(b.comm.get(kind, {})))
        for dim in dims:
            ca = a.comm.get(kind, {}).get(dim, {"count": 0, "bytes": 0})
            cb = b.comm.get(kind, {}).get(dim, {"count": 0, "bytes": 0})
            if ca != cb:
                lines.append(f"comm {kind} {dim}: {ca['count']} x {ca['bytes']} B -> {cb['count']} x {cb['bytes']} B")
    return "\n".join(lines) + "\n"


def _node_view(n: NodePlacement | None):
    return None if n is None else (n.out, n.ins)
