"""The pytest plugin of mutmut's pytest runs (``-p verify.commands.mutation.pytest_hook``, put there by
verify/commands/mutation/workdir.py's ``[tool.mutmut]`` table and the baseline run): a module of
its own, so those runs load nothing else of the line-mutation harness."""

from __future__ import annotations

import os

MAX_EXAMPLES_ENV = "AP_MUTATION_MAX_EXAMPLES"


def pytest_collection_modifyitems(items) -> None:
    """Cap Hypothesis examples (``$AP_MUTATION_MAX_EXAMPLES``), derandomized and without the example
    database. A profile cannot do this: ``@given`` binds its settings when the module is imported."""
    cap = os.environ.get(MAX_EXAMPLES_ENV)
    if not cap:
        return
    from hypothesis import settings

    for item in items:
        fn = getattr(item, "obj", None)
        current = getattr(fn, "_hypothesis_internal_use_settings", None)
        if getattr(fn, "is_hypothesis_test", False) and current is not None:
            fn._hypothesis_internal_use_settings = settings(
                current, max_examples=min(current.max_examples, int(cap)), derandomize=True, database=None
            )
