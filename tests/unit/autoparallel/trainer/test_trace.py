"""trace_train_step: one make_fx graph (forward, loss, autograd.grad), its roles, phases and metadata."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoparallel import meta as M
from autoparallel.trainer import (
    LOSS_ROLE,
    annotate_ac_regions,
    clear_ac_regions,
    is_backward_node,
    is_forward_node,
    region_of,
    run_traced,
    trace_train_step,
)
from verify.parity.trainer import (
    cross_entropy_loss,
    make_batches,
    make_model,
    traced_step,
)

PRESET = "tiny"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_step():
    return traced_step(PRESET, batch=2, module_stack=True)


@pytest.fixture(scope="module")
def tiny_batch():
    return make_batches(PRESET, steps=1, batch=2)[0]


def _call_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_inputs_are_params_then_buffers_then_user_inputs(tiny_step):
    model = make_model(PRESET)
    roles = [n.meta[M.ROLE] for n in tiny_step.gm.graph.nodes if n.op == "placeholder"]
    expected = (
        [f"param:{f}" for f, _ in model.named_parameters()]
        + [f"buffer:{f}" for f, _ in model.named_buffers()]
        + ["input:0", "input:1"]
    )
    assert roles == expected == list(tiny_step.input_roles)
    out_roles = tiny_step.gm.graph.output_node().meta[M.ROLE]
    assert out_roles == [LOSS_ROLE] + [f"grad:{f}" for f, _ in model.named_parameters()]
    assert len(tiny_step.gm.graph.output_node().args[0]) == len(out_roles)
    # Buffers are inputs: the graph owns no tensor constants.
    assert not [n for n in tiny_step.gm.graph.nodes if n.op == "get_attr"]


def test_backward_nodes_carry_phase_tags(tiny_step):
    """Guard of patch ``phase_tagging``: the backward is one contiguous, phase-tagged region."""
    nodes = list(tiny_step.gm.graph.nodes)
    backward = [i for i, n in enumerate(nodes) if is_backward_node(n)]
    forward = [i for i, n in enumerate(nodes) if is_forward_node(n)]
    assert backward, "no node is tagged custom.phase == 'backward'"
    assert forward, "no node is tagged custom.phase == 'forward'"
    assert backward == list(range(backward[0], backward[-1] + 1)), (
        "backward region is not contiguous"
    )
    assert max(forward) < backward[0]
    # Every computation is in one phase or the other.
    untagged = [
        n.name for n in _call_nodes(tiny_step.gm) if not (is_backward_node(n) or is_forward_node(n))
    ]
    assert not untagged
    # The gradients of the matmuls are backward nodes.
    assert any(n.target is torch.ops.aten.mm.default for n in nodes if is_backward_node(n))


def test_backward_nodes_inherit_forward_metadata(tiny_step):
    gm = tiny_step.gm
    fwd_by_seq = {}
    for n in _call_nodes(gm):
        if is_forward_node(n) and M.SEQ_NR in n.meta:
            fwd_by_seq.setdefault(n.meta[M.SEQ_NR], n)
    backward = [n for n in _call_nodes(gm) if is_backward_node(n)]
    linked = [n for n in backward if n.meta.get(M.SEQ_NR) in fwd_by_seq]
    assert len(linked) > 0.8 * len(backward), (
        f"only {len(linked)}/{len(backward)} backward nodes share a seq_nr"
    )
    for n in linked:
        src = fwd_by_seq[n.meta[M.SEQ_NR]]
        assert region_of(n) == region_of(src), n.name
        assert n.meta.get(M.NN_MODULE_STACK) == src.meta.get(M.NN_MODULE_STACK), n.name
        assert M.RECOMPUTE not in n.meta
    # Both blocks' regions show up in the backward, and module paths name the blocks.
    assert {region_of(n) for n in linked} >= {0, 1}
    paths = {fqn for n in linked for fqn, _ in n.meta.get(M.NN_MODULE_STACK, {}).values()}
    assert any("layers.1" in p for p in paths), sorted(paths)[:5]


def test_one_region_per_block(tiny_step):
    regions = {region_of(n) for n in _call_nodes(tiny_step.gm) if is_forward_node(n)}
    assert regions == {None, 0, 1}
    # Embedding, final norm, output head and loss are outside every region.
    embedding = [
        n for n in _call_nodes(tiny_step.gm) if n.target is torch.ops.aten.embedding.default
    ]
    assert embedding and region_of(embedding[0]) is None


def test_annotate_ac_regions_survives_deepcopy_and_clear():
    import copy

    model = make_model(PRESET)
    clone = copy.deepcopy(model)
    assert clone.layers[1].forward.__self__ is clone.layers[1]
    tokens, targets = make_batches(PRESET, steps=1, batch=1)[0]
    torch.testing.assert_close(model(tokens), clone(tokens), rtol=0, atol=0)
    clear_ac_regions(clone)
    assert "forward" not in clone.layers[0].__dict__
    with pytest.raises(ValueError, match="module list 'blocks'"):
        annotate_ac_regions(model, container="blocks")


def test_tied_parameter_is_one_input_with_one_gradient():
    model = make_model("debug", tie_embeddings=True)
    step = traced_step("debug", tie_embeddings=True)  # shared with the parity tests
    assert step.tied == {"output.weight": "tok_embeddings.weight"}
    assert "param:output.weight" not in step.input_roles
    assert step.output_roles.count("grad:tok_embeddings.weight") == 1
    assert len(step.param_fqns) == len(list(model.parameters()))


def test_traced_step_matches_eager_bitwise(tiny_step, tiny_batch):
    model = make_model(PRESET)
    loss = run_traced(tiny_step, model, tiny_batch)
    traced = {f: p.grad.clone() for f, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager_loss = cross_entropy_loss(model(tiny_batch[0]), tiny_batch[1])
    eager_loss.backward()
    assert torch.equal(loss, eager_loss.detach())
    for f, p in model.named_parameters():
        assert torch.equal(traced[f], p.grad), f
    # run_traced accumulates like backward() does.
    run_traced(tiny_step, model, tiny_batch)
    for f, p in model.named_parameters():
        assert torch.equal(p.grad, traced[f] + traced[f]), f


def test_tracing_eagerly_checkpointed_model_does_not_leak_recompute_tags():
    """apply_ac(model, "op") under make_fx tags block ops; nothing after a block may inherit it."""
    step = traced_step(PRESET, batch=2, ac="op", module_stack=True)
    tagged = [n for n in step.gm.graph.nodes if M.RECOMPUTE in n.meta]
    assert tagged, "eager SAC left no recompute tag at all: the test would prove nothing"
    assert not [n.name for n in tagged if is_backward_node(n)], (
        "recompute tags leaked into the backward"
    )
    outside = [n.name for n in tagged if region_of(n) is None]
    assert not outside, f"recompute tags leaked onto nodes outside the blocks: {outside[:5]}"
    # The ops right after the last block (final norm, output head, loss) are untagged.
    last_tagged = max(i for i, n in enumerate(step.gm.graph.nodes) if n in set(tagged))
    after = [
        n for i, n in enumerate(step.gm.graph.nodes) if i > last_tagged and n.op == "call_function"
    ]
    assert after and all(M.RECOMPUTE not in n.meta for n in after)
    assert {n.meta[M.AC_GRAPH_ID] for n in tagged} == {0, 1}


# --- bad input -------------------------------------------------------------------------------


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = torch.nn.Linear(4, 8)
        self.lin2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


_X = torch.randn(3, 4)
_Y = torch.randn(3, 2)


def test_mlp_step_matches_eager_bitwise():
    model = _MLP()
    step = trace_train_step(model, F.mse_loss, (_X, _Y))
    loss = run_traced(step, model, (_X, _Y))
    traced = {f: p.grad.clone() for f, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = F.mse_loss(model(_X), _Y)
    eager.backward()
    assert torch.equal(loss, eager.detach())
    assert all(torch.equal(traced[f], p.grad) for f, p in model.named_parameters())


def test_non_scalar_loss_is_rejected():
    def per_element(out, target):
        return F.mse_loss(out, target, reduction="none")

    with pytest.raises(ValueError, match=r"scalar \(0-dim\) tensor, got shape \(3, 2\)"):
        trace_train_step(_MLP(), per_element, (_X, _Y))
    with pytest.raises(ValueError, match="floating-point scalar"):
        trace_train_step(_MLP(), lambda out, target: (out.sum() > 0).long(), (_X, _Y))


def test_frozen_parameter_is_rejected(tiny_batch):
    model = make_model(PRESET)
    model.norm.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"\['norm.weight'\] have requires_grad=False"):
        trace_train_step(model, cross_entropy_loss, tiny_batch)


def test_unused_parameter_and_bad_inputs_are_rejected():
    model = _MLP()
    model.unused = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"\['unused'\] do not contribute to the loss"):
        trace_train_step(model, F.mse_loss, (_X, _Y))
    with pytest.raises(ValueError, match=r"example_inputs\[1\] is not a tensor"):
        trace_train_step(_MLP(), F.mse_loss, (_X, [1, 2]))
    with pytest.raises(ValueError, match="num_model_inputs"):
        trace_train_step(_MLP(), F.mse_loss, (_X, _Y), num_model_inputs=3)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        trace_train_step(lambda x: x, F.mse_loss, (_X, _Y))


def test_run_traced_rejects_a_different_model(tiny_step, tiny_batch):
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="parameters/buffers .* the model does not have"):
        run_traced(tiny_step, other, tiny_batch)
    with pytest.raises(ValueError, match="takes 2 inputs, got 1"):
        run_traced(tiny_step, make_model(PRESET), tiny_batch[:1])


def test_run_traced_with_another_batch_shape_says_the_step_is_specialized(tiny_step, tiny_batch):
    """It used to fail deep in a view: "shape '[4, 8]' is invalid for input of size 16"."""
    tokens, labels = tiny_batch
    with pytest.raises(ValueError, match=r"input 0 has shape \(1, \d+\) torch.int64, but the step was traced with \(\d+, \d+\).*specialized to the traced shapes"):
        run_traced(tiny_step, make_model(PRESET), (tokens[:1], labels[:1]))
