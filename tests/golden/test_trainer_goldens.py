"""Goldens of the graph trainer: the traced debug step with op SAC tags, before and after remat."""

import functools

import pytest

from verify.goldens import graph_golden_text
from verify.parity.trainer import sac_graphs


@functools.cache
def graphs():
    return dict(zip(("before_remat", "after_remat"), sac_graphs("debug", policy="op"), strict=True))


@pytest.mark.parametrize("stage", ["before_remat", "after_remat"])
def test_op_sac_traced_step(stage, golden):
    header = {"preset": "debug", "trainer": "trace_train_step (make_fx)", "sac": "op", "stage": stage}
    golden.check_text(graph_golden_text(f"debug op-SAC {stage}", header, graphs()[stage]))
