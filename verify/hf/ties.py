"""Sizes a config ties to each other, kept consistent after the generic shrink (:mod:`verify.hf.sizes`).

The shrink sets every size of a family to its test size on its own; a validator or a forward that
ties two fields together then sees them disagree. The ties kept here, found by building every type
of transformers 5.24 (none keyed on a model type):

* a head dim that is the sum of two others in a layer's view (the top-level fields under the
  layer's own overrides of a layer-keyed dict such as ``per_layer_config``): at the default
  ``head_dim`` 256 = ``qk_nope_head_dim`` 192 (the layer's override) + ``qk_rope_head_dim`` 64,
  and a validator wants it so; after the shrink the sum is kept (dots3_note's sliding layers);
* ``rope_parameters`` the library's default leaves empty while the config names its layers'
  kinds (``layer_types``) and the model reads one entry per kind: each kind gets the library's
  default rope (``default_rope_type``, ``default_theta``) (cohere_compass_text: KeyError
  'full_attention' on the default config, at any size).
"""

from __future__ import annotations

import re
from itertools import permutations
from typing import Any

HEAD_DIM_FAMILY = "head_dim"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(d: dict[str, Any], family) -> dict[str, int]:
    return {k: v for k, v in d.items() if _int(v) and family(k) == HEAD_DIM_FAMILY}


def sums(default: dict[str, int], shrunk: dict[str, int], own: set[str]) -> dict[str, int]:
    """The fields ``a`` of ``default`` that equal the sum of two others (``a = b + c``) with one of
    the three in ``own`` (a layer's overrides), mapped to ``b + c`` of ``shrunk``: what ``a`` must
    become for the tie to hold after the shrink. The largest sum is taken first and its parts stay
    parts (``head_dim`` 256 = 192 + 64 wins over a coincidental 192 = 128 + 64 on one of its parts).
    A field that is no such sum is left out."""
    out: dict[str, int] = {}
    parts: set[str] = set()
    triples = [(a, b, c) for a, b, c in permutations(default, 3)
               if b < c and default[a] == default[b] + default[c] and own & {a, b, c} and {a, b, c} <= set(shrunk)]
    for a, b, c in sorted(triples, key=lambda t: -default[t[0]]):  # the largest sum first; its parts stay parts
        if a not in out and a not in parts and not {b, c} & set(out):
            out[a] = shrunk[b] + shrunk[c]
            parts |= {b, c}
    return out


def layer_override_sums(default: dict[str, Any], out: dict[str, Any], layer_maps: dict[str, dict[Any, Any]], family) -> None:
    """In place: for every layer-keyed dict of overrides (``layer_maps``: its key -> {new layer key:
    old layer key}), the head-dim sums of each kept layer's view hold after the shrink (:func:`sums`);
    a sum lives where its field does: in the layer's overrides, else at the top level."""
    for key, renumbered in layer_maps.items():
        for new, old in renumbered.items():
            own_default, own_out = default[key].get(old), out[key].get(new)
            if not isinstance(own_default, dict) or not isinstance(own_out, dict):
                continue
            view_default = {**_ints(default, family), **_ints(own_default, family)}
            view_out = {**_ints(out, family), **_ints(own_out, family)}
            for field, value in sums(view_default, view_out, set(_ints(own_default, family))).items():
                (own_out if field in own_out else out)[field] = value


def fill_empty_rope(d: dict[str, Any], cls) -> None:
    """In place: ``rope_parameters`` left empty by the library's default while ``layer_types`` names
    the layers' kinds gets the library's default rope for each kind (the model reads one per kind)."""
    kinds = d.get("layer_types")
    if d.get("rope_parameters") != {} or not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        return
    rope = {"rope_type": getattr(cls, "default_rope_type", "default"), "rope_theta": getattr(cls, "default_theta", 10_000.0)}
    d["rope_parameters"] = {kind: dict(rope) for kind in dict.fromkeys(kinds)}




_SIZE_NAME = re.compile(r".+_(size|dim)")


def follow_equal_sizes(default: dict[str, Any], out: dict[str, Any], family) -> None:
    """In place, in ``out`` and its sub-configs: a size-named field (``*_size``, ``*_dim``) of no family
    that the shrink left at its default takes the new value of the one shrunk size field of ``default``
    it equals (an adapter's ``adapter_input_size`` 1280 is the encoder's ``hidden_size`` 1280, and a
    validator says so). Only a repair of the back-off (:mod:`verify.hf.repairs`): equal defaults
    are often a coincidence (a kernel size of 4 and 4 experts), so a config that builds never gets it."""
    for key, value in default.items():
        if isinstance(value, dict) and "model_type" in value and isinstance(out.get(key), dict):
            follow_equal_sizes(value, out[key], family)
    shrunk = {k: v for k, v in default.items() if _int(v) and family(k) not in (None, "none") and out.get(k) != v}
    for key, value in default.items():
        if family(key) is None and _SIZE_NAME.fullmatch(key) and _int(value) and out.get(key) == value:
            equal = {out[k] for k, v in shrunk.items() if v == value}
            if len(equal) == 1:  # one new value it can follow; ambiguous ties stay as they are
                out[key] = equal.pop()




def last_segments(d: dict[str, Any], counts: set[int], keep: frozenset[str], family) -> dict[str, tuple[int, int]]:
    """``{field: (n, k)}``: the layer counts ``k`` of ``d`` smaller than a layer count ``n`` being shrunk,
    read as the last ``k`` of the ``n`` layers (gemma3n's ``num_kv_shared_layers`` 15 of 35 reuse
    the cache of an earlier layer of their kind: a kind must be kept on both sides)."""
    out: dict[str, tuple[int, int]] = {}
    for key, k in d.items():
        if family(key) == "layers" and _int(k) and k > 0 and key not in keep:
            above = [n for n in counts if k < n]
            if len(above) == 1:  # one count it is part of; several: ambiguous, left to the rule
                out[key] = (above[0], k)
    return out


def segment_marks(n: int, subs: dict[str, tuple[int, int]]) -> list[list[str]]:
    """Per-layer lists of names (one per count of :func:`last_segments` of ``n``) marking the last
    ``k`` layers, so that the shrink keeps a layer of each kind before and within them."""
    return [["last" if i >= n - k else "first" for i in range(n)] for m, k in subs.values() if m == n]


__all__ = ["fill_empty_rope", "follow_equal_sizes", "last_segments", "layer_override_sums", "segment_marks", "sums"]
