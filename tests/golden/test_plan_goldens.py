"""Goldens of automatic placement: the canonical plan text of each case in verify.stages.plan_cases.

A change to candidates, costs, the formulation or the solver shows up as a text diff (placements
per parameter, input and node; predicted collectives; the objective). Regenerate with
`python -m verify goldens --update` and review the diff.
"""

import pytest

from verify.goldens.catalog import plan_case_text
from verify.stages.plan_cases import GOLDEN_CASES


def _grouped(names):
    # One xdist worker per model: its trace is made once per process (verify.stages.plan_cases) and
    # shared with the planner tests of the same group.
    return [pytest.param(n, marks=pytest.mark.xdist_group(f"planner-{GOLDEN_CASES[n].preset}")) for n in sorted(names)]


@pytest.mark.parametrize("name", _grouped(GOLDEN_CASES))
def test_plan_text(name, golden):
    golden.check_text(plan_case_text(name))
