"""Trace one training step (forward, loss, ``torch.autograd.grad``) into a single FX graph.

``trace_train_step(model, loss_fn, example_inputs)`` runs ``make_fx`` with fake tensors over

    loss = loss_fn(model(*inputs[:k]), *inputs[k:]);  grads = torch.autograd.grad(loss, params)

and returns a :class:`TracedStep`: the graph plus the role of each placeholder and output.

Graph calling convention: ``gm(*params, *buffers, *inputs) -> (loss, *grads)``.

* Parameters come first, in ``model.named_parameters()`` order (duplicates removed, so a tied
  weight is one input and gets one gradient, the sum over its uses, as eager autograd
  accumulates it). Buffers follow, in ``named_buffers()`` order, then the user inputs. Buffers
  are graph inputs, never constants, so the graph holds no tensor of its own.
* Placeholders carry ``meta[ROLE]`` = ``"param:<fqn>"`` / ``"buffer:<fqn>"`` / ``"input:<i>"``;
  the output node carries the list ``["loss", "grad:<fqn>", ...]``.
* Phases: every node traced inside the ``autograd.grad`` call has
  ``meta["custom"][PHASE] == PHASE_BACKWARD``; nodes traced in the forward and the loss have
  ``PHASE_FORWARD``; backward nodes also carry ``REMAT_PASS_TAG``, the marker torch 2.11's
  remat pass reads instead of ``PHASE`` (patch ``phase_tagging``; disabled, no node carries a
  phase and PyTorch's remat pass finds no backward region). make_fx marks nothing as backward.
* ``seq_nr``: backward nodes get the ``seq_nr`` of the forward op whose ``grad_fn`` produced them
  (autograd pre/post hooks installed on the traced autograd graph, as AOTAutograd does). After
  tracing, each backward node inherits its forward node's ``custom`` entries (except
  ``PHASE``, e.g. the AC region of :func:`annotate_ac_regions`), ``nn_module_stack`` and
  ``ac_graph_id``; never its ``recompute`` tag (a tagged backward node is exactly what the
  SAC tag-leak bug produced).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

from autoparallel import meta as M
from autoparallel import roles
from autoparallel.compiling_flag import tracing_as_compiling
from autoparallel.gc_pauses import fewer_collections
from autoparallel.patches import enabled
from autoparallel.validate import check_loss, data_dependent_ops_named

__all__ = [
    "LOSS_ROLE",
    "TracedStep",
    "copy_forward_meta_to_backward",
    "is_backward_node",
    "is_forward_node",
    "trace_train_step",
]

LOSS_ROLE = roles.LOSS


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A traced training step and what each of its inputs and outputs is.

    ``gm(*params, *buffers, *inputs)`` returns ``(loss, *grads)``, one gradient per entry of
    ``param_fqns``. ``tied`` maps every alias FQN of a shared parameter to the FQN it is
    traced under (``{"output.weight": "tok_embeddings.weight"}`` for tied embeddings).
    Passes that return a new graph give a new step through :meth:`with_graph`.
    """

    gm: fx.GraphModule
    param_fqns: tuple[str, ...]
    buffer_fqns: tuple[str, ...]
    num_inputs: int
    num_model_inputs: int
    tied: dict[str, str]
    # (shape, dtype) of each traced input: the graph is specialized to them
    input_specs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()

    @property
    def input_roles(self) -> tuple[str, ...]:
        return (
            tuple(roles.param(f) for f in self.param_fqns)
            + tuple(roles.buffer(f) for f in self.buffer_fqns)
            + tuple(roles.input_(i) for i in range(self.num_inputs))
        )

    @property
    def output_roles(self) -> tuple[str, ...]:
        return (roles.LOSS,) + tuple(roles.grad(f) for f in self.param_fqns)

    def with_graph(self, gm: fx.GraphModule) -> TracedStep:
        """The same step with ``gm`` (the result of a pass) as its graph."""
        _check_signature(gm, self.input_roles, len(self.output_roles))
        return dataclasses.replace(self, gm=gm)

    def flat_inputs(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The graph's positional inputs from name->tensor maps and the user inputs."""
        missing = [f for f in self.param_fqns if f not in params] + [
            f for f in self.buffer_fqns if f not in buffers
        ]
        if missing:
            raise ValueError(
                f"the traced step needs parameters/buffers {missing} that the model does not have; "
                "run the step with the model it was traced from"
            )
        if len(inputs) != self.num_inputs:
            raise ValueError(f"the traced step takes {self.num_inputs} inputs, got {len(inputs)}")
        for i, (t, (shape, dtype)) in enumerate(zip(inputs, self.input_specs, strict=False)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"input {i} has shape {tuple(t.shape)} {t.dtype}, but the step was traced with {shape} {dtype}: "
                    "a traced step is specialized to the traced shapes. Trace again (trace_train_step) with "
                    "example inputs of this shape"
                )
        return (
            [params[f] for f in self.param_fqns]
            + [buffers[f] for f in self.buffer_fqns]
            + list(inputs)
        )


def is_backward_node(node: fx.Node) -> bool:
    """The node was traced inside ``torch.autograd.grad`` (``custom[PHASE] == PHASE_BACKWARD``)."""
    return node.meta.get(M.CUSTOM, {}).get(M.PHASE) == M.PHASE_BACKWARD


def is_forward_node(node: fx.Node) -> bool:
    """The node was traced in the model's forward or the loss (``custom[PHASE] == PHASE_FORWARD``)."""
    return node.meta.get(M.CUSTOM, {}).get(M.PHASE) == M.PHASE_FORWARD


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    if enabled("phase_tagging"):
        annotation = {M.PHASE: name}
        if name == M.PHASE_BACKWARD:
            annotation[M.REMAT_PASS_TAG] = M.REMAT_PASS_TAG_BACKWARD
        with fx_traceback.annotate(annotation):
            yield
    else:
        yield


def _install_seq_nr_hooks(loss: torch.Tensor) -> list[Any]:
    """Give backward nodes the ``seq_nr`` of the forward op they differentiate.

    A pre-hook on every ``grad_fn`` of the traced autograd graph pushes that node's sequence
    number onto ``current_meta`` (FX copies it to the nodes traced while the grad_fn runs); the
    post-hook pops it. Unlike AOTAutograd's ``setup_stacktrace_preservation_hooks`` this does not
    set ``autograd_backward``: the phase annotation is the single backward marker here.
    """
    handles: list[Any] = []
    roots = [loss.grad_fn] if loss.grad_fn is not None else []
    seen: set[Any] = set(roots)
    queue = list(roots)
    while queue:
        node = queue.pop()
        seq_nr = node._sequence_nr()

        def pre(grad_outputs: Any, seq_nr: int = seq_nr) -> None:
            fx_traceback.set_grad_fn_seq_nr(seq_nr)

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            fx_traceback.reset_grad_fn_seq_nr()

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(post))
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return handles


def _validate_model(
    model: torch.nn.Module,
) -> tuple[list[tuple[str, torch.nn.Parameter]], dict[str, str]]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"trace_train_step: model must be an nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise ValueError("trace_train_step: the model has no parameters to differentiate")
    frozen = [fqn for fqn, p in params if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"trace_train_step: parameter(s) {frozen} have requires_grad=False; the traced step "
            "returns a gradient for every parameter. Make them buffers, or set requires_grad=True"
        )
    canonical = {id(p): fqn for fqn, p in params}
    tied = {
        fqn: canonical[id(p)]
        for fqn, p in model.named_parameters(remove_duplicate=False)
        if canonical[id(p)] != fqn
    }
    return params, tied


def trace_train_step(
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    example_inputs: Sequence[torch.Tensor],
    *,
    num_model_inputs: int = 1,
    record_module_stack: bool = True,
) -> TracedStep:
    """Trace ``loss_fn(model(*inputs[:k]), *inputs[k:])`` and its gradients into one graph.

    ``k = num_model_inputs``. ``example_inputs`` only give shapes and dtypes: tracing runs on
    fake tensors (``tracing_mode="fake"``) and never touches the model's values. The graph is
    specialized to these shapes. See the module docstring for the calling convention,
    roles and metadata. ``record_module_stack=False`` skips ``nn_module_stack`` (and stack
    traces) on the nodes, which halves the tracing time.

    Raises ValueError naming the offending thing for: a parameter with
    ``requires_grad=False``, a loss that is not a floating-point scalar, a parameter the loss
    does not use, inputs that are not tensors, or a bad ``num_model_inputs``.
    """
    params, tied = _validate_model(model)
    buffers = list(model.named_buffers())
    inputs = tuple(example_inputs)
    bad = [i for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)]
    if bad:
        raise ValueError(
            f"trace_train_step: example_inputs[{bad[0]}] is not a tensor (inputs: {bad})"
        )
    if not (isinstance(num_model_inputs, int) and 0 < num_model_inputs <= len(inputs)):
        raise ValueError(
            f"num_model_inputs must be in 1..{len(inputs)} (len(example_inputs)), got {num_model_inputs!r}"
        )
    param_fqns = tuple(f for f, _ in params)
    buffer_fqns = tuple(f for f, _ in buffers)
    n_p, n_b = len(param_fqns), len(buffer_fqns)

    def step(*flat: torch.Tensor) -> list[torch.Tensor]:
        p_in, b_in, x_in = flat[:n_p], flat[n_p : n_p + n_b], flat[n_p + n_b :]
        state = dict(zip(param_fqns, p_in, strict=True)) | dict(zip(buffer_fqns, b_in, strict=True))
        # The module stays reparametrized through the backward: an eagerly checkpointed block
        # (apply_ac) re-runs its forward inside autograd.grad.
        with _reparametrize_module(model, state, tie_weights=True, strict=True):
            with _phase(M.PHASE_FORWARD):
                out = model(*x_in[:num_model_inputs])
                loss = loss_fn(out, *x_in[num_model_inputs:])
            check_loss(loss)
            handles = _install_seq_nr_hooks(loss)
            try:
                with _phase(M.PHASE_BACKWARD):
                    grads = torch.autograd.grad(loss, p_in, allow_unused=True)
            finally:
                for h in handles:
                    h.remove()
        unused = [fqn for fqn, g in zip(param_fqns, grads, strict=True) if g is None]
        if unused:
            raise ValueError(
                f"parameter(s) {unused} do not contribute to the loss; the traced step needs a "
                "gradient for every parameter (remove them or make them buffers)"
            )
        return [loss, *grads]

    flat_example = [p.detach().requires_grad_(True) for _, p in params]
    flat_example += [b.detach() for _, b in buffers]
    flat_example += [x.detach() for x in inputs]
    with (
        fx_traceback.preserve_node_meta(),
        torch.autograd.set_multithreading_enabled(False),
        torch.enable_grad(),
        fewer_collections(),
    ):
        if record_module_stack:
            step._orig_mod = model  # type: ignore[attr-defined]  # the module stack's root
        with tracing_as_compiling(), data_dependent_ops_named():
            gm = make_fx(step, tracing_mode="fake", record_module_stack=record_module_stack)(
                *flat_example
            )

    traced = TracedStep(
        gm=gm,
        param_fqns=param_fqns,
        buffer_fqns=buffer_fqns,
        num_inputs=len(inputs),
        num_model_inputs=num_model_inputs,
        tied=tied,
        input_specs=tuple((tuple(x.shape), x.dtype) for x in inputs),
    )
    _label_roles(gm, traced.input_roles, traced.output_roles)
    copy_forward_meta_to_backward(gm)
    gm.meta[M.GM_STAGE] = "trainer:traced"
    gm.graph.lint()
    return traced


# --------------------------------------------------------------------------------------------
# Roles and metadata
# --------------------------------------------------------------------------------------------


def _label_roles(
    gm: fx.GraphModule, input_roles: Sequence[str], output_roles: Sequence[str]
) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(input_roles):
        raise AssertionError(
            f"traced {len(placeholders)} placeholders for {len(input_roles)} inputs"
        )
    for node, role in zip(placeholders, input_roles, strict=True):
        node.meta[M.ROLE] = role
    out = gm.graph.output_node()
    out.meta[M.ROLE] = list(output_roles)


def _check_signature(gm: fx.GraphModule, input_roles: Sequence[str], num_outputs: int) -> None:
    roles = [n.meta.get(M.ROLE) for n in gm.graph.nodes if n.op == "placeholder"]
    if roles != list(input_roles):
        raise ValueError(
            f"graph placeholders {roles[:4]}... do not match the step's inputs {list(input_roles)[:4]}...: "
            "a pass must keep the placeholders (and their ROLE meta) of the traced step"
        )
    outs = gm.graph.output_node().args[0]
    if len(outs) != num_outputs:
        raise ValueError(f"graph returns {len(outs)} values, the step returns {num_outputs}")


_INHERITED_META = (M.NN_MODULE_STACK, M.AC_GRAPH_ID)
_OWN_PHASE_KEYS = (M.PHASE, M.REMAT_PASS_TAG)


def copy_forward_meta_to_backward(gm: fx.GraphModule) -> int:
    """Copy forward-node metadata onto the backward nodes sharing its ``seq_nr``; return the count.

    The forward node of a ``seq_nr`` is the first non-backward node carrying it. Each backward
    node with that ``seq_nr`` gets the forward node's ``custom`` entries (its own ``PHASE``
    kept), ``nn_module_stack`` and ``ac_graph_id``. ``recompute`` is never copied.
    """
    fwd_of: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_backward_node(node):
            continue
        seq = node.meta.get(M.SEQ_NR)
        if seq is not None:
            fwd_of.setdefault(seq, node)
    copied = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not is_backward_node(node):
            continue
        src = fwd_of.get(node.meta.get(M.SEQ_NR))
        if src is None:
            continue
        custom = M.custom_meta(node)
        for key, value in src.meta.get(M.CUSTOM, {}).items():
            if key not in _OWN_PHASE_KEYS:
                custom[key] = copy.deepcopy(value)
        for key in _INHERITED_META:
            if key in src.meta:
                node.meta[key] = copy.copy(src.meta[key])
        copied += 1
    return copied
