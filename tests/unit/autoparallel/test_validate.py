"""Data-dependent code in a user's model is named, never a bare PyTorch exception: the op, the
model's source line and what to change, from both front ends (the joint-graph trace, which the
planner uses too, and the graph trainer's make_fx trace)."""

import pytest
import torch
from torch import nn

from autoparallel import patches
from autoparallel.parallelize import ParallelPlan
from autoparallel.passes.value_guards import PATCH as VALUE_GUARDS
from autoparallel.pipeline import JOINT, PipelineOptions, run_pipeline
from autoparallel.trainer.trace import trace_train_step
from autoparallel.validate import data_dependent_error


class ItemNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = x.abs().max().item()  # the line the error must name
        return self.lin(x) / scale


class NonzeroNet(ItemNet):
    def forward(self, x):
        kept = torch.nonzero(x[:, 0] > 0)  # the line the error must name
        return self.lin(x)[kept.squeeze(1)]


class BranchNet(ItemNet):
    def forward(self, x):
        if x.sum() > 0:  # the line the error must name
            return self.lin(x)
        return -self.lin(x)


CASES = [
    (ItemNet, "aten._local_scalar_dense.default", "scale = x.abs().max().item()", "reads a tensor's value into Python"),
    (NonzeroNet, "aten.nonzero.default", "kept = torch.nonzero(x[:, 0] > 0)", "output shape that depends on tensor values"),
    (BranchNet, "aten._local_scalar_dense.default", "if x.sum() > 0:", "reads a tensor's value into Python"),
]


def _mse(out, target):
    return (out.float() - target).pow(2).mean()


def _line_of(text: str) -> tuple[int, str]:
    with open(__file__, encoding="utf-8") as f:
        return next((i, line.strip()) for i, line in enumerate(f, 1) if text in line and "the line the error must name" in line)


@pytest.mark.parametrize(("cls", "op", "line", "what"), CASES, ids=[c[0].__name__ for c in CASES])
def test_the_joint_trace_names_the_op_and_the_models_line(cls, op, line, what):
    """The refusal, as the joint trace gives it where no guarded value can be taken (patch
    value_guards off here; on, these models trace: tests/unit/autoparallel/passes/test_value_guards.py)."""
    with patches.disabled(VALUE_GUARDS), pytest.raises(ValueError) as info:
        run_pipeline(cls(), _mse, (torch.randn(4, 4), torch.randn(4, 4)), ParallelPlan.fsdp(), "dp=2",
                     PipelineOptions(alternatives=False), until=JOINT)
    msg = str(info.value)
    number, source = _line_of(line)
    assert msg.startswith(f"the model is not traceable: {op} at {__file__}:{number} ({source})"), msg
    assert what in msg and "torch.where" in msg
    assert type(info.value.__cause__).__module__ == "torch._subclasses.fake_tensor"  # PyTorch's, kept as the cause


def test_the_graph_trainer_traces_unbacked_values_and_names_a_branch_on_one():
    """make_fx traces .item() and nonzero with unbacked symbols (one graph, values decided at run
    time); a Python branch on such a value cannot be traced, and is named."""
    batch = (torch.randn(4, 4), torch.randn(4, 4))
    assert "aten._local_scalar_dense" in str(trace_train_step(ItemNet(), _mse, batch).gm.code).replace("torch.ops.", "")
    number, source = _line_of("if x.sum() > 0:")
    with pytest.raises(ValueError) as info:
        trace_train_step(BranchNet(), _mse, batch)
    assert str(info.value).startswith(
        f"the model is not traceable: a value read from a tensor at {__file__}:{number} ({source}) decides Python "
        "control flow"), str(info.value)


def test_other_errors_are_left_alone():
    assert data_dependent_error(RuntimeError("shape mismatch")) is None
    try:
        try:
            raise KeyError("x")
        except KeyError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as e:
        assert data_dependent_error(e) is None


class MaskedFastPath(ItemNet):
    """What transformers' masking_utils does: an eager-only fast path decided by the data."""

    def forward(self, x):
        if not torch.compiler.is_compiling() and bool((x != 0).all()):  # eager fast path
            return self.lin(x)
        return self.lin(x * (x != 0))


def test_a_model_that_asks_is_compiling_traces_its_graph_path():
    run = run_pipeline(MaskedFastPath(), _mse, (torch.randn(4, 4), torch.randn(4, 4)), ParallelPlan.fsdp(), "dp=2",
                       PipelineOptions(alternatives=False), until=JOINT)
    assert any(n.target is torch.ops.aten.ne.Scalar for n in run.stage(JOINT).graphs.graph.nodes)
    assert not torch.compiler.is_compiling(), "the flag is restored"


def test_the_graph_trainer_traces_the_graph_path_too():
    traced = trace_train_step(MaskedFastPath(), _mse, (torch.randn(4, 4), torch.randn(4, 4)))
    assert any(n.target is torch.ops.aten.ne.Scalar for n in traced.gm.graph.nodes)
    assert not torch.compiler.is_compiling()
