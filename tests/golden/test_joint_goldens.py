"""Goldens of the joint graphs: a change to tracing or the plan shows up as a text diff."""

import pytest

from verify.scenario import Scenario

CONFIGS = {
    "tiny-fsdp-dp8": Scenario(preset="tiny", plan="fsdp", mesh="dp=8"),
    "tiny-fsdp_tp-dp4tp2": Scenario(preset="tiny", plan="fsdp_tp", mesh="dp=4,tp=2"),
}


def header(sc: Scenario, stage: str) -> dict:
    return {"preset": sc.preset, "mesh": str(sc.mesh_spec), "plan": sc.plan_obj().describe(), "stage": stage}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def traced(request):
    sc = CONFIGS[request.param]
    with sc.trace() as jg:
        yield sc, jg


def test_joint_graph(traced, golden):
    sc, jg = traced
    golden.graph(jg.gm, header=header(sc, "joint"))


def test_collective_counts(traced, golden):
    sc, jg = traced
    golden.counts([("joint", jg.gm)], header=header(sc, "collective counts"))
