"""Role labels: what a graph input or output *is*, built and read in this module only.

Placeholders carry ``meta[ROLE]`` and the output node carries one label per output (see
``autoparallel.meta.ROLE``). Stages hand graphs to each other, so the labels are the contract
between them: the tracer writes ``param:<fqn>``, the bucketing tagger looks for ``param:`` and
``grad:``, the runtime feeds tensors by role, canonical text names placeholders by role. Spelling a
prefix twice is how a stage silently stops finding what another wrote, so every label is made by a
constructor here and read by a predicate or :func:`parse` here (a test greps the other modules for
the prefixes).

Labels:

=================  ==================================================================
``param:<fqn>``    a parameter (its local shard), by the user's FQN
``buffer:<fqn>``   a buffer
``input:<i>``      the i-th user input (model inputs, then the loss target)
``tangent:<out>``  the tangent of output ``<out>`` (``tangent:loss``; ``tangent:mutated:<fqn>``
                   for a parameter's new value, which AOT puts before the loss's; a step
                   feeds it zeros, the loss's a 1)
``loss``           the loss, the first user output
``output:<i>``     another user output
``grad:<fqn>``     the gradient of parameter ``<fqn>`` (the output is None, or absent, for a
                   parameter without one: frozen, or the loss does not reach it)
``mutated:<fqn>``  the new value of buffer ``<fqn>`` (an in-place update, e.g. BatchNorm's
                   running stats, that the graph returns for the caller to apply)
``saved:<k>``      the k-th value a forward graph saves for its backward (and the
                   backward placeholder that receives it)
=================  ==================================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

PARAM = "param"
BUFFER = "buffer"
INPUT = "input"
TANGENT = "tangent"
OUTPUT = "output"
GRAD = "grad"
SAVED = "saved"
LOSS = "loss"
MUTATED = "mutated"

_SEP = ":"
KINDS = (PARAM, BUFFER, INPUT, TANGENT, LOSS, OUTPUT, GRAD, SAVED, MUTATED)


# --- constructors -------------------------------------------------------------------------------


def param(fqn: str) -> str:
    return f"{PARAM}{_SEP}{fqn}"


def buffer(fqn: str) -> str:
    return f"{BUFFER}{_SEP}{fqn}"


def input_(index: int) -> str:
    return f"{INPUT}{_SEP}{index}"


def tangent(of: str) -> str:
    """The tangent of output ``of`` (a label itself, e.g. ``loss``)."""
    return f"{TANGENT}{_SEP}{of}"


def grad(fqn: str) -> str:
    return f"{GRAD}{_SEP}{fqn}"


def saved(index: int) -> str:
    return f"{SAVED}{_SEP}{index}"


def mutated(fqn: str) -> str:
    """The new value of buffer (or input) ``fqn`` after an in-place update in the graph."""
    return f"{MUTATED}{_SEP}{fqn}"


def user_output(index: int) -> str:
    """The label of user output ``index``: the loss first, then ``output:<i>``."""
    return LOSS if index == 0 else f"{OUTPUT}{_SEP}{index}"


def grad_of(role: str) -> str:
    """``param:<fqn>`` (or any ``kind:<name>``) -> ``grad:<name>``."""
    return grad(name(role))


# --- readers ------------------------------------------------------------------------------------


def parse(role: str) -> tuple[str, str]:
    """``(kind, name)``: ``("param", "layers.0.w")``, ``("loss", "")``. ValueError for a label that
    is none of the kinds above (it names the label)."""
    if role == LOSS:
        return LOSS, ""
    kind, sep, rest = str(role).partition(_SEP)
    if not sep or kind not in KINDS or kind == LOSS:
        raise ValueError(f"{role!r} is not a role label; labels are {', '.join(k + ':<...>' for k in KINDS if k != LOSS)} or {LOSS!r}")
    return kind, rest


def kind(role: object) -> str | None:
    """The kind of ``role`` (``"param"``, ..., ``"loss"``), None for anything that is not a label."""
    if not isinstance(role, str):
        return None
    try:
        return parse(role)[0]
    except ValueError:
        return None


def name(role: str) -> str:
    """What follows the kind: the FQN, the index, or the output a tangent belongs to."""
    return parse(role)[1]


def is_param(role: object) -> bool:
    return kind(role) == PARAM


def is_buffer(role: object) -> bool:
    return kind(role) == BUFFER


def is_input(role: object) -> bool:
    return kind(role) == INPUT


def is_tangent(role: object) -> bool:
    return kind(role) == TANGENT


def is_grad(role: object) -> bool:
    return kind(role) == GRAD


def is_saved(role: object) -> bool:
    return kind(role) == SAVED


def is_mutated(role: object) -> bool:
    return kind(role) == MUTATED


def names_of(roles: Sequence[str | None], of_kind: str) -> list[str]:
    """The names of the labels of one kind, in order (``names_of(roles, PARAM)`` -> FQNs)."""
    return [parse(r)[1] for r in roles if kind(r) == of_kind]


# --- AOT descriptors and placeholder names -------------------------------------------------------

# AOTAutograd names a joint graph's placeholders primals_<i+1> / tangents_<k> (partitioners keep
# the names), and Dynamo sources name a compiled module's inputs.
_AOT_PRIMAL = re.compile(r"primals_(\d+)")
_AOT_TANGENT_PREFIX = "tangents"
_SOURCE_KEY = re.compile(r"\.(_modules|_parameters|_buffers)\['([^']+)'\]")
_SOURCE_INPUT = re.compile(r"^L\['inputs'\]\[(\d+)\]$")


def aot_primal_name(index: int) -> str:
    """The joint-graph placeholder name AOT gives primal ``index`` (0-based)."""
    return f"primals_{index + 1}"


def aot_primal_index(placeholder_name: str) -> int | None:
    """0-based primal index of an AOT placeholder name, None for other names."""
    m = _AOT_PRIMAL.fullmatch(placeholder_name)
    return int(m.group(1)) - 1 if m else None


def is_aot_tangent_name(placeholder_name: str) -> bool:
    return str(placeholder_name).startswith(_AOT_TANGENT_PREFIX)


def aot_tangent_name(index: int = 0) -> str:
    return f"{_AOT_TANGENT_PREFIX}_{index + 1}"


def of_source_name(source: str, strip_prefix: str = "") -> str | None:
    """The label of a Dynamo graph input from its source name (``L['self']._modules['model']
    ._parameters['w']`` -> ``param:w`` after ``strip_prefix``; ``L['inputs'][0]`` -> ``input:0``)."""
    path = _SOURCE_KEY.findall(source)
    if path and path[-1][0] in ("_parameters", "_buffers"):
        fqn = ".".join(key for _, key in path).removeprefix(strip_prefix)
        return param(fqn) if path[-1][0] == "_parameters" else buffer(fqn)
    m = _SOURCE_INPUT.match(source)
    return input_(int(m.group(1))) if m else None


def of_descriptor(
    desc: object,
    *,
    fqn: Callable[[str], str] = str,
    plain_inputs: Sequence[str | None] | None = None,
    name_unknown: bool = True,
) -> str | None:
    """The label of an AOT input/output descriptor (None for None).

    ``fqn`` turns a descriptor's target into the user's FQN (e.g. dropping parametrization
    paths). ``plain_inputs``: labels of a Dynamo graph's inputs, for descriptors that only say
    "plain input i" (a compiled module's parameters arrive as plain inputs); without it they are
    ``input:<i>``. Descriptors of other kinds get their class name (``name_unknown``), so an
    unexpected input still shows up in canonical text instead of vanishing, or None.
    """
    from torch._functorch._aot_autograd import descriptors as D

    if desc is None:
        return None
    if isinstance(desc, D.ParamAOTInput):
        return param(fqn(desc.target))
    if isinstance(desc, D.BufferAOTInput):
        return buffer(fqn(desc.target))
    if isinstance(desc, D.PlainAOTInput):
        if plain_inputs is None:
            return input_(desc.idx)
        return plain_inputs[desc.idx] if desc.idx < len(plain_inputs) else None
    if isinstance(desc, D.TangentAOTInput):
        return tangent(str(of_descriptor(desc.output, fqn=fqn, plain_inputs=plain_inputs)))
    if isinstance(desc, D.PlainAOTOutput):
        return user_output(desc.idx)
    if isinstance(desc, D.GradAOTOutput):
        inner = of_descriptor(desc.grad_of, fqn=fqn, plain_inputs=plain_inputs)
        return grad_of(inner) if kind(inner) is not None else None
    if isinstance(desc, D.InputMutationAOTOutput):
        inner = of_descriptor(desc.mutated_input, fqn=fqn, plain_inputs=plain_inputs)
        return mutated(name(inner)) if kind(inner) is not None else None
    if isinstance(desc, D.SavedForBackwardsAOTOutput):
        return None  # numbered by the caller (saved:<k>), in output order
    return type(desc).__name__ if name_unknown else None
