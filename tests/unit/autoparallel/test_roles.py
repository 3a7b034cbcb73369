"""Role labels: constructors and readers agree, bad labels are named, AOT names and descriptors map."""

import pytest
from torch._functorch._aot_autograd import descriptors as D

from autoparallel import roles


@pytest.mark.parametrize(
    ("label", "kind", "name"),
    [
        (roles.param("layers.0.w"), roles.PARAM, "layers.0.w"),
        (roles.buffer("rope_cos"), roles.BUFFER, "rope_cos"),
        (roles.input_(1), roles.INPUT, "1"),
        (roles.tangent(roles.LOSS), roles.TANGENT, "loss"),
        (roles.grad("w"), roles.GRAD, "w"),
        (roles.saved(3), roles.SAVED, "3"),
        (roles.user_output(2), roles.OUTPUT, "2"),
        (roles.user_output(0), roles.LOSS, ""),
    ],
)
def test_constructed_labels_parse_back(label, kind, name):
    assert roles.parse(label) == (kind, name)
    assert roles.kind(label) == kind


def test_spelling_is_the_documented_one():
    # Goldens and users read these strings: the spelling is part of the contract.
    assert [roles.param("a"), roles.buffer("b"), roles.input_(0), roles.tangent("loss"), roles.grad("a"),
            roles.saved(0), roles.user_output(1), roles.LOSS] == [
        "param:a", "buffer:b", "input:0", "tangent:loss", "grad:a", "saved:0", "output:1", "loss"]


@pytest.mark.parametrize("bad", ["weight", "parameter:x", "", "loss:1", ":x"])
def test_parse_names_a_bad_label(bad):
    with pytest.raises(ValueError, match="is not a role label"):
        roles.parse(bad)
    assert roles.kind(bad) is None


def test_predicates_and_names_of():
    labels = [roles.param("a"), None, roles.buffer("b"), roles.param("c"), roles.tangent("loss"), 7]
    assert roles.names_of(labels, roles.PARAM) == ["a", "c"]
    assert [roles.is_param(r) for r in labels] == [True, False, False, True, False, False]
    assert roles.is_tangent(labels[4]) and not roles.is_tangent("tangents_1")
    assert roles.grad_of(roles.param("x.y")) == "grad:x.y"


def test_aot_placeholder_names():
    assert roles.aot_primal_name(0) == "primals_1"
    assert roles.aot_primal_index("primals_12") == 11
    assert roles.aot_primal_index("primals_x") is None and roles.aot_primal_index("tangents_1") is None
    assert roles.is_aot_tangent_name(roles.aot_tangent_name(0)) and not roles.is_aot_tangent_name("primals_1")


def test_dynamo_source_names():
    src = "L['self']._modules['model']._modules['layers']._parameters['w']"
    assert roles.of_source_name(src, "model.") == "param:layers.w"
    assert roles.of_source_name("L['self']._modules['model']._buffers['rope']", "model.") == "buffer:rope"
    assert roles.of_source_name("L['inputs'][1]") == "input:1"
    assert roles.of_source_name("G['something']") is None


def test_descriptors():
    p = D.ParamAOTInput("model.w.parametrizations.weight.original")
    assert roles.of_descriptor(p, fqn=lambda t: t.split(".")[1]) == "param:w"
    assert roles.of_descriptor(D.PlainAOTInput(2)) == "input:2"
    assert roles.of_descriptor(D.PlainAOTInput(1), plain_inputs=["param:a", "buffer:b"]) == "buffer:b"
    assert roles.of_descriptor(D.GradAOTOutput(D.PlainAOTInput(0)), plain_inputs=["param:a"]) == "grad:a"
    assert roles.of_descriptor(D.GradAOTOutput(D.PlainAOTInput(0)), plain_inputs=[None]) is None
    assert roles.of_descriptor(D.PlainAOTOutput(0)) == "loss"
    assert roles.of_descriptor(D.TangentAOTInput(D.PlainAOTOutput(0))) == "tangent:loss"
    assert roles.of_descriptor(None) is None
