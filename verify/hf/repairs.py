"""Repairs the back-off (:mod:`verify.hf.backoff`) tries on a shrunk config that fails, before it
restores fields to their defaults.

A repair reads the failure and the dicts and returns a repaired shrunk dict, or None where it does
not apply. Each one is a class of failure, none keyed on a model type:

* :func:`follow_equal_sizes`: a size field of no family that the shrink left at its default while
  an equal size shrank (a validator: ``adapter_input_size must match hidden_size``);
* :func:`missing_attribute`: the model reads a field a sub-config does not have
  (``'DbrxAttentionConfig' object has no attribute 'rope_theta'``: the library's default sub-config
  lacks what every released config.json has); the field is copied from the enclosing config, where
  it is a field or an entry of one of its dicts (``rope_parameters["rope_theta"]``).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from verify.hf import ties
from verify.hf.sizes import family

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


REPAIRS = (follow_equal_sizes, missing_attribute)

__all__ = ["REPAIRS", "follow_equal_sizes", "missing_attribute"]
