"""plan="auto" options: what the plan stage is told is checked before anything is traced."""

import pytest
import torch
from torch import nn

from autoparallel import pipeline as P
from autoparallel.mesh import fake_world
from autoparallel.parallelize import ParallelPlan
from autoparallel.planner import Solution
from autoparallel.planner.auto import (
    _check_reduce_dtype,
    local_params,
    plan_for_pipeline,
    planner_config,
)
from verify import zoo


def test_planner_options_become_the_planner_config():
    config = planner_config(ParallelPlan.auto(profile="a100", memory_budget=1e6, param_dtype=torch.bfloat16))
    assert (config.profile, config.memory_budget, config.param_dtype) == ("a100", 1e6, torch.bfloat16)


def test_an_unknown_planner_option_is_named():
    with pytest.raises(ValueError, match=r"plan 'auto': unknown planner option\(s\) \['budget'\]; options: \[.*'memory_budget'"):
        planner_config(ParallelPlan.auto(budget=1))


def test_a_reduce_dtype_the_planner_cannot_honour_is_refused():
    model = nn.Linear(4, 4)  # fp32 parameters: the planner reduces their gradients in fp32
    _check_reduce_dtype(ParallelPlan.auto(reduce_dtype=torch.float32), model)
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.bfloat16: parameter 'weight' is torch.float32"):
        _check_reduce_dtype(ParallelPlan.auto(reduce_dtype=torch.bfloat16), model)


def test_the_plan_stage_refuses_a_reduce_dtype_before_tracing():
    model = nn.Linear(4, 4)
    with fake_world("dp=2") as mesh, pytest.raises(ValueError, match=r"reduce_dtype=torch.bfloat16: parameter 'weight'"):
        plan_for_pipeline(model, None, [torch.randn(2, 4)], mesh, ParallelPlan.auto(reduce_dtype=torch.bfloat16))


def test_the_plan_stage_reports_the_solvers_seconds_and_keeps_its_plan(mlp, mlp_batch):
    """The stage's seconds are the solver's own figures (strategies, problem, LP plus MILP), and
    ``solved`` is the solver's plan: a copy, made before alias round trips were removed."""
    make_model, loss = mlp
    with torch.device("meta"):
        model = make_model()
    with fake_world("dp=2,tp=2") as mesh:
        planned = P.run_pipeline(model, loss, mlp_batch(), "auto", mesh, until=P.PLAN).planned
    stats, seconds = planned.solution.stats, planned.report.seconds
    assert planned.report.solver == stats
    assert seconds["strategies"] == stats["strategy_seconds"] > 0
    assert seconds["problem"] == stats["problem_seconds"] > 0
    assert stats["lp_seconds"] > 0 and stats["solve_seconds"] > 0
    assert seconds["solve"] == stats["lp_seconds"] + stats["solve_seconds"]
    assert seconds["trace"] > 0 and seconds["alias_round_trips"] > 0
    solved = planned.solved
    assert isinstance(solved, Solution) and solved is not planned.solution and solved._context is None
    assert solved.params == planned.solution.params and solved.mesh == planned.solution.mesh


def test_a_buffers_new_value_is_placed_like_the_buffer():
    """A model that updates a buffer in place (BatchNorm's running stats) returns the new value,
    which the module copies into the buffer's local piece: placed otherwise, the copy fails at run
    time (Hugging Face ResNet under plan='auto': 'size of tensor a (16) must match b (4)'). The
    buffer is pinned sharded over tp here; its new value must follow."""
    case = zoo.convnet
    with torch.device("meta"):
        model = case.factory()
    pin = "dp:R,tp:S(0)"
    with fake_world("dp=2,tp=2") as mesh:
        run = P.run_pipeline(model, case.loss_fn, case.batch(4), ParallelPlan.auto(pins={"buffer:bn.running_mean": pin}),
                             mesh, until=P.PLAN)
    plan = run.planned.solution
    assert plan.inputs["buffer:bn.running_mean"] == {"dp": "R", "tp": "S(0)"}
    for fqn in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert plan.nodes[f"out:mutated:{fqn}"].out == [plan.inputs[f"buffer:{fqn}"]], fqn


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 16))

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) * self.scale)


def test_a_real_model_under_auto_gives_the_module_its_ranks_values():
    """The lowered module runs on this rank's pieces of the model's own parameters and buffers; before,
    every one was allocated with torch.empty (a second compile that runs the module refused it)."""
    torch.manual_seed(0)
    model, inputs = _Scaled(), (torch.randn(4, 8), torch.randn(4, 4))
    run = P.run_pipeline(model, nn.functional.mse_loss, inputs, ParallelPlan.auto(), "dp=2",
                         P.PipelineOptions(keep_compiled=True, alternatives=False), until=P.SECOND_COMPILE)
    try:
        module = run.module
        assert module.uninitialised == ()
        plan = run.planned.solution
        with fake_world("dp=2") as mesh:
            expected = local_params(plan, dict(model.named_parameters()), mesh)
        assert expected.keys() == module.local_parameters().keys()
        for fqn, local in module.local_parameters().items():
            assert torch.equal(local, expected[fqn]), fqn
        assert torch.equal(module.model.get_buffer("scale"), model.scale)  # replicated or not: rank 0's piece
        assert run.compiled is not None
    finally:
        torch._dynamo.reset()


def test_a_model_on_meta_under_auto_still_plans_but_has_no_values():
    with torch.device("meta"):
        model = _Scaled()
    run = P.run_pipeline(model, nn.functional.mse_loss, (torch.randn(4, 8), torch.randn(4, 4)), ParallelPlan.auto(), "dp=2",
                         P.PipelineOptions(alternatives=False), until="first_partition")
    assert set(run.module.uninitialised) == {"up.weight", "up.bias", "down.weight", "down.bias", "scale"}
