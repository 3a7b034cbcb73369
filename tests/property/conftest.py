"""Hypothesis profiles for the property tests: what the tier runs, and what CI's deeper pass runs.

The tier (``pytest -n auto``, every machine, <= 90 s on 2 cores) runs ``TIER_EXAMPLES`` (25) examples
per property: enough to exercise every strategy branch in seconds. The depth lives in CI's own
property step (``.ci/run``), which runs ``DEEP_EXAMPLES`` per property twice: derandomized (the
fixed example set CI's tier used to run, so CI checks at least what it checked before) and with a
fresh random seed it prints. A property that needs more than the tier's examples to mean
anything says so with its own ``@settings``.

* ``autoparallel`` (default): ``TIER_EXAMPLES`` examples, no deadline (graph building and merging
  take milliseconds, tracing in a merge can take more on a loaded machine);
* ``ci`` (loaded when the ``CI`` environment variable is set): the same, derandomized and without
  the example database, so a CI run is reproducible;
* ``ci-deep`` (``--hypothesis-profile=ci-deep``): ``DEEP_EXAMPLES`` examples, derandomized, no
  database (``.ci/run``);
* ``ci-random`` (``--hypothesis-profile=ci-random``): ``DEEP_EXAMPLES`` random examples, no
  database; ``.ci/run`` sets ``--hypothesis-seed`` to a fresh seed it prints, so what a random
  run finds can be replayed from the log.

``--hypothesis-profile`` picks any of them. Importing ``torch.testing._internal.common_utils``
loads PyTorch's own profile, so the chosen profile is loaded again before every test.

Local runs keep Hypothesis' example database in ``.hypothesis/`` (in the working directory): a
failure found once is replayed first by every later local run until it is fixed, whatever the
example count.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

TIER_EXAMPLES = 25
DEEP_EXAMPLES = 40  # x 2 passes: 383 s of CI at 200, 235 s at 100, 152 s at 60 (2026-11-29), the 30-minute budget's share

settings.register_profile(
    "autoparallel",
    max_examples=TIER_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci", parent=settings.get_profile("autoparallel"), derandomize=True, database=None
)
settings.register_profile(
    "ci-deep", parent=settings.get_profile("ci"), max_examples=DEEP_EXAMPLES
)
settings.register_profile(
    "ci-random", parent=settings.get_profile("autoparallel"), max_examples=DEEP_EXAMPLES, database=None
)
PROFILE = "ci" if os.environ.get("CI") else "autoparallel"
settings.load_profile(PROFILE)


@pytest.fixture(autouse=True)
def _hypothesis_profile(request):
    settings.load_profile(request.config.getoption("--hypothesis-profile", None) or PROFILE)
    yield
