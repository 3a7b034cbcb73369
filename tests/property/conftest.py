"""Hypothesis profiles for the property tests.

``autoparallel`` (default): 200 examples per property, no deadline (graph building and merging
take milliseconds, tracing in a merge can take more on a loaded machine). ``ci`` (loaded when the
``CI`` environment variable is set): the same, derandomized and without the example database, so
a CI run is reproducible. ``ci-random`` (``--hypothesis-profile=ci-random``): random, without the
example database; ``.ci/run`` runs the properties once more this way with ``--hypothesis-seed``
set to a fresh seed it prints, so what a random run finds can be replayed from the log.
``--hypothesis-profile`` picks any of them. Importing ``torch.testing._internal.common_utils``
loads PyTorch's own profile, so the chosen profile is loaded again before every test.

Local runs keep Hypothesis' example database in ``.hypothesis/`` (in the working directory): a
failure found once is replayed first by every later local run until it is fixed.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "autoparallel",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci", parent=settings.get_profile("autoparallel"), derandomize=True, database=None
)
settings.register_profile("ci-random", parent=settings.get_profile("autoparallel"), database=None)
PROFILE = "ci" if os.environ.get("CI") else "autoparallel"
settings.load_profile(PROFILE)


@pytest.fixture(autouse=True)
def _hypothesis_profile(request):
    settings.load_profile(request.config.getoption("--hypothesis-profile", None) or PROFILE)
    yield
