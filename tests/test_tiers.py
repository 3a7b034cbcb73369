"""The quick tier (the README's test line) and CI's slow step: tests/conftest.py SLOW_GROUPS moves
whole pipeline runs and gloo worlds to the slow step. These tests keep that table honest: every
entry still names tests (a renamed group would silently move them back, or a typo move nothing),
and the tier keeps a golden scenario of every kind."""

from __future__ import annotations

import pytest

from verify.goldens.catalog import GOLDEN_SCENARIOS


def _tier_conftest(config):
    found = [p for p in config.pluginmanager.get_plugins() if hasattr(p, "SLOW_GROUPS") and hasattr(p, "_is_slow_group")]
    assert len(found) == 1, "tests/conftest.py defines SLOW_GROUPS and _is_slow_group"
    return found[0]


def test_the_tier_keeps_a_golden_scenario_of_every_kind(request):
    slow = _tier_conftest(request.config).SLOW_GROUPS
    kept = [sc for sid, sc in GOLDEN_SCENARIOS.items() if sid not in slow]
    assert any(sc.model_case is None and sc.plan == "fsdp" for sc in kept), "LLaMA under FSDP"
    assert any(len(sc.mesh_spec.dims) == 2 and sc.plan == "fsdp_tp" for sc in kept), "a 2-D mesh (fusion)"
    assert any(sc.is_auto for sc in kept), 'plan="auto"'
    assert "zoo-gpt2-fsdp-dp2" not in slow, "a model that is not LLaMA (gpt2's tied weights) trains in the tier"
    assert len(kept) < len(GOLDEN_SCENARIOS), "the table moves some scenarios (else it is dead)"


def test_every_slow_group_names_collected_tests(request):
    items = request.session.items
    if not all(any(i.nodeid.startswith(d) for i in items) for d in ("tests/golden/", "tests/parity/", "tests/unit/")):
        pytest.skip("needs the whole suite collected and not deselected (the tier collects it)")
    conftest = _tier_conftest(request.config)
    groups = {g for m in (i.iter_markers("xdist_group") for i in items) for g in (str(x.args[0]) for x in m if x.args)}
    stale = sorted(set(conftest.SLOW_GROUPS) - groups)
    assert not stale, f"SLOW_GROUPS entries that name no collected test's xdist_group: {stale}"
    slow = [i.nodeid for i in items if i.get_closest_marker("slow") is not None]
    assert len(slow) > len(conftest.SLOW_GROUPS)
    unmarked = [i.nodeid for i in items if i.get_closest_marker("slow") is None
                and any(conftest._is_slow_group(str(m.args[0])) for m in i.iter_markers("xdist_group") if m.args)]
    assert not unmarked, f"tests of a slow group left in the tier: {unmarked[:5]}"
