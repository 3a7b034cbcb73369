"""autoparallel.defaults: the one home of the defaults command lines show, and free of torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autoparallel.defaults import BUCKET_CAP_MB, PLANS
from autoparallel.parallelize.plan import ParallelPlan
from autoparallel.passes.pre_overlap_bucketing import PreOverlapConfig


def test_the_code_uses_the_defaults_it_names():
    assert PreOverlapConfig().bucket_cap_mb == BUCKET_CAP_MB
    assert [ParallelPlan.preset(name).name for name in PLANS] == list(PLANS)
    with pytest.raises(ValueError, match=rf"valid plans: {sorted(PLANS)}".replace("[", r"\[").replace("]", r"\]")):
        ParallelPlan.preset("zero3")


def test_defaults_load_without_torch():
    code = "import sys, autoparallel.defaults, verify.stages.defaults; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
