"""A forward that reseeds the global RNG is refused at trace time, naming the call.

Some library models reseed the global generator inside their training forward: reformer draws
a fresh seed from OS entropy per layer (``torch.seed()``, then ``torch.manual_seed``) so that its
reversible backward can replay the layer's dropout; LSH attention with a ``hash_seed`` calls
``torch.manual_seed`` with a constant. A traced graph cannot carry a reseed: its random ops draw
from the generator as it stands when the graph runs, so the draws after the reseed differ from
eager's; and an entropy seed makes no two eager runs agree, so no bitwise reference exists at all.
Before this check such a model traced silently and failed later as "NOT bitwise" on nearly every
tensor, with no reason given (docs/failure-classes.md section 11j).

:func:`reseeds_refused` scopes a wrapper around ``torch.seed`` / ``torch.manual_seed`` (the
module attributes library code calls) that records each call's site, and compares the default
generator's ``initial_seed()`` before and after as a backstop for reseeds made through the
generator object itself. The global generator's state is restored before the refusal is raised.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from autoparallel.parallelize.traced_values import model_site

__all__ = ["RNGReseedError", "reseeds_refused"]

_NAMES = ("seed", "manual_seed")


class RNGReseedError(ValueError):
    """The model reseeds the global RNG in forward (a ValueError: input the stack refuses)."""


@contextlib.contextmanager
def reseeds_refused() -> Iterator[None]:
    """Inside: the global CPU generator may not be reseeded; on exit, raise RNGReseedError naming
    where it was (the generator's state restored first)."""
    state = torch.get_rng_state()
    before = torch.initial_seed()
    sites: list[str] = []
    originals = {name: getattr(torch, name) for name in _NAMES}

    def recording(name: str):
        fn = originals[name]

        @functools.wraps(fn)
        def call(*args, **kwargs):
            sites.append(f"torch.{name}() at {model_site()}")
            return fn(*args, **kwargs)
        return call

    for name in _NAMES:
        setattr(torch, name, recording(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        reseeded = bool(sites) or torch.initial_seed() != before
        if reseeded:
            torch.set_rng_state(state)
    if reseeded:
        where = "; ".join(dict.fromkeys(sites)) or "through torch.default_generator (the call site is not known)"
        raise RNGReseedError(
            f"the model reseeds the global RNG in forward ({where}): a traced graph cannot replay a reseed "
            "(its random ops draw from the generator as it stands when the graph runs), and a seed drawn "
            "from OS entropy makes no two eager runs agree. Seed once outside the step, or give the module "
            "its own torch.Generator")
