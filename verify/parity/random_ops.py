"""Random ops switched off on both sides of the oracle, where no rank's masks are a slice of the
single-device program's.

The stages are compared bitwise with their eager reference drawing the same numbers (every
executor seeds the rank's generator alike). The oracle is another matter: it compares the
parallel program with the unsharded model on one process, and a mask drawn on a rank's local
shard of an activation (a plan that shards activations, ``plan="auto"`` or TP) is no slice of
any mask the unsharded model draws. There the oracle runs both sides with dropout at p=0: the
parallel side as its graph with every dropout's probability set to 0 (``graph_without_random_ops``),
the single-device side under ``random_ops_disabled`` (dropout called with p=0). Dropout at p=0 is
the identity on both sides, bitwise, and draws nothing on either (the graph's ``native_dropout``
also runs with ``train=False``: at p=0 in training it would still draw a mask), so what remains
is what the oracle is for: the placements' arithmetic. A random op that is not a dropout cannot
be switched off that way, and is an error naming it and the model's line; unless the program
draws it exactly as the single-device model does (``keep_others=True``: ``plan="auto"``
replicates such an op, every rank drawing the whole tensor from one seed), where it stays on,
on both sides, drawing in the same order from the same generator state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoparallel import meta as M
from autoparallel.ac import is_random
from autoparallel.fx_utils import copy_graph_module
from autoparallel.runtime.steps import Executor

aten = torch.ops.aten

#: The executor the oracle compares when dropout is off on both sides (its name says so).
DROPOUT_OFF = "eager (dropout off on both sides)"

# Graph side: dropout's probability set to 0, its backward's scale to 1 / (1 - 0). Every op with a
# ``dropout_p`` argument (the attention kernels, forward and backward) gets 0 there too.
_DROPOUT_P = "dropout_p"
_GRAPH_SWITCHES = {
    aten.native_dropout.default: ("p", 0.0),  # (input, p, train)
    aten.native_dropout_backward.default: ("scale", 1.0),  # (grad, mask, scale)
}
# Eager side: the dropout functions and their probability argument (name, position).
_EAGER_SWITCHES = {
    F.dropout: ("p", 1),
    F.dropout1d: ("p", 1),
    F.dropout2d: ("p", 1),
    F.dropout3d: ("p", 1),
    F.alpha_dropout: ("p", 1),
    F.feature_alpha_dropout: ("p", 1),
    torch.dropout: ("p", 1),
    F.scaled_dot_product_attention: ("dropout_p", 4),
}


def _switch(op) -> tuple[int, str, float] | None:
    """Where ``op`` takes the argument that switches its randomness off: (position, name, value)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    name, value = _GRAPH_SWITCHES.get(op, (_DROPOUT_P, 0.0))
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == name:
            return i, name, value
    return None


def is_dropout(op) -> bool:
    """Whether ``op`` is a dropout (an argument switches its randomness off: ``p`` or
    ``dropout_p``); any other random op draws numbers the model uses as they are. The oracle's own
    list, kept apart from the planner's ``strategies.is_dropout`` on purpose: a checker sharing
    the checked code's definition could not see it miss a dropout."""
    return _switch(op) is not None


def _draws(op, args, kwargs) -> bool:
    """Whether a call of ``op`` draws from the generator: a random op, unless its dropout
    probability is 0 (an attention kernel called without dropout is tagged random all the same)."""
    if not is_random(op):
        return False
    switch = _switch(op)
    if switch is None:
        return True
    i, name, _ = switch
    p = args[i] if len(args) > i else kwargs.get(name, 0.0)
    return p != 0


class RandomOpError(ValueError):
    """A random op the oracle cannot switch off on both sides (it is not a dropout)."""


def random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's nodes that draw from the generator."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and is_random(n.target)]


def _model_line(node: fx.Node) -> str:
    trace = (node.meta.get(M.STACK_TRACE) or "").strip().splitlines()
    files = [line.strip() for line in trace if line.strip().startswith("File ")]
    return f" ({files[-1]})" if files else ""


def graph_without_random_ops(gm: fx.GraphModule, *, keep_others: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` with every dropout at p=0 (forward and backward), drawing nothing; the same
    node names, so a plan's placements per node still apply. RandomOpError names any other random
    op, unless ``keep_others`` (the program draws it as the single-device model does: it stays)."""
    others = [n for n in random_nodes(gm) if _switch(n.target) is None]
    if others and not keep_others:
        n = others[0]
        raise RandomOpError(
            f"random op {n.target} (node {n.name}{_model_line(n)}) is not a dropout: the oracle cannot switch it "
            f"off on both sides ({len(others)} such node(s)), and no rank's draws are a slice of the single-device "
            "program's under this plan. Draw it from an input of the model (pass the noise in), or check this "
            "model under a plan that shards only the batch (fsdp, ddp)")
    out = copy_graph_module(gm)
    for n in out.graph.nodes:
        switch = _switch(n.target) if n.op == "call_function" else None
        if switch is None:
            continue
        index, name, value = switch
        if name in n.kwargs:
            n.update_kwarg(name, value)
        elif index < len(n.args):  # else left at its default, 0
            n.update_arg(index, value)
        if n.target is aten.native_dropout.default:  # (input, p, train): at p=0 in training it still draws
            if "train" in n.kwargs:
                n.update_kwarg("train", False)
            else:
                n.update_arg(2, False)
    out.recompile()
    return out


class _DropoutAtZero(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        switch = _EAGER_SWITCHES.get(func)
        if switch is not None:
            name, index = switch
            if len(args) > index:
                args = (*args[:index], 0.0, *args[index + 1:])
            else:
                kwargs[name] = 0.0
        return func(*args, **kwargs)


class _NoOtherRandomOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _draws(func, args, kwargs or {}):
            raise RandomOpError(
                f"random op {func} ran with dropout switched off: it is not a dropout, so the oracle cannot switch "
                "it off on both sides. Draw it from an input of the model (pass the noise in), or check this model "
                "under a plan that shards only the batch (fsdp, ddp)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def random_ops_disabled(*, keep_others: bool = False) -> Iterator[None]:
    """Inside, every dropout runs at p=0 (the identity), and any other random op raises
    RandomOpError (or, ``keep_others``, draws as usual): the single-device side of
    ``graph_without_random_ops``."""
    with _DropoutAtZero(), _NoOtherRandomOps() if not keep_others else contextlib.nullcontext():
        yield


def executor_without_random_ops(executor: Executor) -> Executor:
    """``executor`` with every step run under :func:`random_ops_disabled` (an eager program's)."""

    def run(params, inputs):
        with random_ops_disabled():
            return executor.step(params, inputs)

    return Executor(run, executor.buffers)


__all__ = [
    "DROPOUT_OFF",
    "RandomOpError",
    "executor_without_random_ops",
    "graph_without_random_ops",
    "is_dropout",
    "random_nodes",
    "random_ops_disabled",
]
