"""plan="auto" options: what the plan stage is told is checked before anything is traced."""

import pytest
import torch
from torch import nn

from autoparallel.parallelize import ParallelPlan
from autoparallel.planner.auto import _check_reduce_dtype, planner_config


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
