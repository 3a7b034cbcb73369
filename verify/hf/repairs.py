"""Repairs the back-off (:mod:`verify.hf.backoff`) tries on a shrunk config that fails, before it
restores fields to their defaults.

A repair reads the failure and the dicts and returns a repaired shrunk dict, or None where it does
not apply. Each one is a class of failure, none keyed on a model type:

* :func:`follow_equal_sizes`: a size field of no family that the shrink left at its default while
  an equal size shrank (a validator: ``adapter_input_size must match hidden_size``);
* :func:`missing_attribute`: the model reads a field a sub-config does not have
  (``'DbrxAttentionConfig' object has no attribute 'rope_theta'``: the library's default sub-config
  lacks what every released config.json has); the field is copied from the enclosing config, where
  it is a field or an entry of one of its dicts (``rope_parameters["rope_theta"]``);
* :func:`layer_sums`: a layer count that is the sum of other layer counts at the default (a
  validator: ``n_input_layers + n_recurrent_layers + n_output_layers must equal num_hidden_layers``);
* :func:`list_sums`: a list of sizes that sums to a size at the default (a validator:
  ``axial_pos_embds factors ... sum to config.hidden_size``);
* :func:`position_grid`: a list whose product is the positions count at the default lays the
  positions out on a grid the training sequence must fill (``axial_pos_shape factors ... multiply
  to sequence length``): factored into the batches' sequence length;
* :func:`output_positions`: a head that predicts one token per configured position, whatever the
  input's length (perceiver's decoder queries ``max_position_embeddings`` positions): the loss
  sees ``positions / SEQ`` times the targets it expects; the positions count becomes the batches'
  sequence length.
"""

from __future__ import annotations

import copy
import re
from itertools import combinations
from typing import Any

from verify.hf import ties
from verify.hf.sizes import SEQ, family

_NO_ATTRIBUTE = re.compile(r"'(\w+)' object has no attribute '(\w+)'")


def follow_equal_sizes(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with the size fields that equal a shrunk size at the default following it
    (:func:`verify.hf.ties.follow_equal_sizes`); None where there is none."""
    out = copy.deepcopy(shrunk)
    ties.follow_equal_sizes(default, out, family)
    return out if out != shrunk else None


def _lookup(d: dict[str, Any], name: str) -> Any:
    """``d[name]``, else ``name`` in one of ``d``'s dict values (not a sub-config); None if absent."""
    if d.get(name) is not None:
        return d[name]
    for value in d.values():
        if isinstance(value, dict) and "model_type" not in value and value.get(name) is not None:
            return value[name]
    return None


def missing_attribute(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with the field an ``AttributeError`` says a sub-config of ``cls`` lacks, copied from
    the enclosing config (:func:`_lookup`); None where the error is another or the value is nowhere."""
    match = _NO_ATTRIBUTE.search(str(error)) if isinstance(error, AttributeError) else None
    if match is None:
        return None
    owner, name = match.groups()
    keys = [k for k, sub in (getattr(cls, "sub_configs", {}) or {}).items() if getattr(sub, "__name__", None) == owner]
    value = _lookup(shrunk, name)
    if not keys or value is None or not all(isinstance(shrunk.get(k), dict) for k in keys):
        return None
    return {**shrunk, **{k: {**shrunk[k], name: value} for k in keys}}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_sums(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with a layer count that is the sum of two or more other layer counts at the default
    (dory: 16 input + 40 recurrent + 16 output layers = 72) set to the sum of the shrunk parts, and
    the per-layer lists cut to that many first entries (the sections are consecutive runs of
    layers); None where no count is such a sum or the sum already holds. The most parts first."""
    counts = {k: v for k, v in default.items() if family(k) == "layers" and _int(v) and v > 0 and _int(shrunk.get(k))}
    for total, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        others = [k for k in counts if k != total and counts[k] < n]
        for r in range(len(others), 1, -1):
            for parts in combinations(others, r):
                new = sum(shrunk[p] for p in parts)
                if sum(counts[p] for p in parts) == n and new != shrunk[total]:
                    cut = {k: v[:new] for k, v in default.items() if isinstance(v, list) and len(v) == n}
                    return {**shrunk, total: new, **cut}
    return None


def _split(values: list[int], total: int) -> list[int] | None:
    """``values`` scaled to sum to ``total`` (each at least 1, the last takes the rest); None if impossible."""
    old = sum(values)
    head = [max(1, x * total // old) for x in values[:-1]]
    return [*head, total - sum(head)] if total - sum(head) >= 1 else None


def list_sums(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with each list of sizes whose default entries sum to the default of exactly one
    shrunk size field (reformer: ``axial_pos_embds_dim`` [64, 192] sums to ``hidden_size`` 256)
    scaled to sum to that field's shrunk value ([8, 24] for 32); None where there is none to mend."""
    sizes = {k: v for k, v in default.items() if family(k) not in (None, "none") and _int(v) and _int(shrunk.get(k))
             and shrunk[k] != v}
    out = dict(shrunk)
    for key, value in default.items():
        if not (isinstance(value, list) and len(value) > 1 and all(_int(x) and x > 0 for x in value)):
            continue
        match = [k for k, v in sizes.items() if v == sum(value) and k != key]
        new = _split(value, shrunk[match[0]]) if len(match) == 1 else None
        if new is not None and sum(shrunk.get(key) or []) != shrunk[match[0]]:
            out[key] = new
    return out if out != shrunk else None


def _factors(n: int, parts: int) -> list[int]:
    """``n`` as a product of ``parts`` factors, as even as its prime factors allow, ascending."""
    out, p = [1] * parts, 2
    while n > 1:
        while n % p == 0:
            out[out.index(min(out))] *= p
            n //= p
        p += 1
    return sorted(out)


def position_grid(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with each list whose product at the default is the default positions count
    (reformer: ``axial_pos_shape`` [64, 64] lays 4096 positions on a grid, and a training sequence
    must fill it) factored into the batches' sequence length :data:`verify.hf.sizes.SEQ`; None
    where there is no such list, or it already fills that length."""
    positions = {v for k, v in default.items() if family(k) == "positions" and _int(v) and v > SEQ}
    out = dict(shrunk)
    for key, value in default.items():
        if isinstance(value, list) and len(value) > 1 and all(_int(x) and x > 1 for x in value):
            product = 1
            for x in value:
                product *= x
            if product in positions:
                out[key] = _factors(SEQ, len(value))
    return out if out != shrunk else None


_BATCH_SIZES = re.compile(r"Expected input batch_size \((\d+)\) to match target batch_size \((\d+)\)")


def output_positions(cls, default: dict[str, Any], shrunk: dict[str, Any], error: BaseException) -> dict[str, Any] | None:
    """``shrunk`` with its positions counts set to the batches' sequence length :data:`SEQ` where the
    loss got ``rows`` predictions for ``targets`` targets and ``rows / targets`` is a shrunk positions
    count over :data:`SEQ` (the head predicts every configured position, not every input token);
    None for another error or ratio."""
    match = _BATCH_SIZES.search(str(error))
    if match is None:
        return None
    rows, targets = map(int, match.groups())
    keys = [k for k, v in shrunk.items() if family(k) == "positions" and _int(v) and rows * SEQ == targets * v and v != SEQ]
    return {**shrunk, **{k: SEQ for k in keys}} if keys else None


REPAIRS = (follow_equal_sizes, missing_attribute, layer_sums, list_sums, position_grid, output_positions)

__all__ = ["REPAIRS", "follow_equal_sizes", "layer_sums", "list_sums", "missing_attribute", "output_positions", "position_grid"]
