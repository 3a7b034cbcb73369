"""Back-off of the generic shrink (:mod:`verify.hf.sizes`) when the shrunk config fails.

Some configs tie attributes to each other (a validator wants two sizes to agree, a forward
wants a channel count another field sets): shrinking each to its test size may break the tie.
Only when the shrunk config fails (to build or to run one eager step), :func:`fit` first tries the
repairs it is given (:mod:`verify.hf.repairs`: a failure read as a tie or a missing field), then the
segments mode (a count of the last layers splits the kinds kept: :func:`verify.hf.ties.last_segments`),
then finds which shrunk fields cause it: it restores one field at a time to the library's default,
the others still shrunk (the rule re-derives what follows them), then the rule's other modes
(:data:`MODES`): the token ids the library leaves unset (None) set to 0, where there are any (esm
reads ``input_ids.ne(pad_token_id)``); the derived fields left for the config to derive anew (zamba2's
``attention_hidden_size = 2 * hidden_size``, which the dict would otherwise pin); the first layers
kept instead of one of each kind, alone and with each field kept. It keeps the first candidate
that passes within a parameter budget. Nothing is cached; the order of the tries is the config's field order, the
fields whose values the error message names first, so the result is deterministic. A config
that no candidate fixes raises the original error (the cell stays NOT BUILT with it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from verify.hf.sizes import family

BUDGET = 5_000_000  # parameters a backed-off tiny model may have
MAX_TRIES = 64  # candidates probed at most (one equal to the shrunk dict, or over budget, is not probed)


def changed_fields(default: dict[str, Any], shrunk: dict[str, Any]) -> list[str]:
    """Top-level fields whose shrunk value differs from the default, in the config's order."""
    return [k for k in default if k in shrunk and shrunk[k] != default[k]]


def _mentioned(error: BaseException, default: dict[str, Any], shrunk: dict[str, Any], key: str) -> bool:
    """Whether ``error``'s message names ``key`` or one of its values (an int of 2+ digits)."""
    text = str(error)
    if re.search(rf"\b{re.escape(key)}\b", text):
        return True
    numbers = set(re.findall(r"\d{2,}", text))
    return any(str(v) in numbers for v in (default.get(key), shrunk.get(key)) if isinstance(v, int))


# The back-off's modes of the rule (keyword arguments of ``shrink``), as its report names them.
MODES = {"unset_tokens": "the unset token ids set to 0", "rederive": "the derived fields derived anew",
         "first_layers": "the first layers kept",
         "segments": "a layer of each kind kept on both sides of a count of the last layers"}


def unset_token_ids(default: dict[str, Any]) -> list[str]:
    """Token-id fields (``pad_token_id`` ...) the default leaves None, at any depth of sub-configs."""
    found = [k for k, v in default.items() if v is None and family(k) == "token"]
    return found + [k for v in default.values() if isinstance(v, dict) for k in unset_token_ids(v)]


Repair = Callable[[dict[str, Any], dict[str, Any], BaseException], "dict[str, Any] | None"]
MAX_REPAIRS = 4  # repairs chained at most (each may uncover the next failure)


def repair(default: dict[str, Any], shrunk: dict[str, Any], error: BaseException, probe, size, repairs: tuple[Repair, ...],
           budget: int = BUDGET) -> tuple[dict[str, Any], tuple[str, ...]] | None:
    """``(dict, the repairs applied)``: ``shrunk`` after the first repair of ``repairs`` that applies
    to ``error``, chained while each uncovers a new failure (at most :data:`MAX_REPAIRS`), once one
    passes ``probe`` within ``budget``; None when none leads there."""
    d, applied = shrunk, ()
    for _ in range(MAX_REPAIRS):
        fixed = next(((r.__name__, out) for r in repairs if (out := r(default, d, error)) is not None), None)
        if fixed is None:
            return None
        applied, d = (*applied, fixed[0]), fixed[1]
        try:
            if size(d) > budget:
                return None
        except Exception:  # noqa: BLE001 - a repaired dict that cannot even be sized is no fit
            return None
        error = probe(d)
        if error is None:
            return d, applied
    return None


def fit(default: dict[str, Any], shrink: Callable[..., dict[str, Any]], probe: Callable[[dict[str, Any]], BaseException | None],
        size: Callable[[dict[str, Any]], int], *, budget: int = BUDGET, max_tries: int = MAX_TRIES,
        label: str = "config", repairs: tuple[Repair, ...] = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``(dict, what was backed off)``: ``shrink()`` if ``probe`` passes on it (nothing backed off),
    else the shrunk dict mended by ``repairs`` (:func:`repair`), else the first candidate that passes
    with ``size`` within ``budget``. ``shrink(keep=..., **mode)`` returns the shrunk dict with the
    fields of ``keep`` at their default, in a mode of :data:`MODES` (``unset_tokens`` tried only where
    :func:`unset_token_ids` finds any); ``probe`` returns the error or None.
    Raises the shrunk config's own error when no candidate passes."""
    shrunk = shrink()
    error = probe(shrunk)
    if error is None:
        return shrunk, ()
    repaired = repair(default, shrunk, error, probe, size, repairs, budget) if repairs else None
    if repaired is not None:
        print(f"hf: {label}: builds after the repairs {', '.join(repaired[1])}", file=sys.stderr)
        return repaired
    fields = changed_fields(default, shrunk)
    fields.sort(key=lambda k: not _mentioned(error, default, shrunk, k))  # stable: the config's order within each
    modes = [{"unset_tokens": True}] if unset_token_ids(default) else []
    modes += [{"rederive": True}, {"first_layers": True}]
    candidates = ([((), {"segments": True})] + [((k,), {}) for k in fields] + [((), m) for m in modes]
                  + [((k,), {"first_layers": True}) for k in fields])
    print(f"hf: {label}: the shrunk config fails ({type(error).__name__}); backing off over {len(fields)} fields",
          file=sys.stderr)
    tries = 0
    for keep, mode in candidates:
        if tries >= max_tries:
            break
        try:
            d = shrink(keep=frozenset(keep), **mode)
            if d == shrunk or size(d) > budget:  # the same dict fails the same way: not probed again
                continue
            tries += 1
            if probe(d) is not None:
                continue
        except Exception:  # noqa: BLE001 - a candidate that cannot even be sized is no fit
            continue
        what = (*(f"{k} kept at its default" for k in keep), *(MODES[m] for m in mode))
        print(f"hf: {label}: builds with {', '.join(what)}", file=sys.stderr)
        return d, what
    raise error


__all__ = ["BUDGET", "MAX_REPAIRS", "MAX_TRIES", "MODES", "Repair", "changed_fields", "fit", "repair", "unset_token_ids"]
