"""The goldens catalog's headers, slots and run groups, and find_unused's verdicts, spelled out
(line-level mutation of verify/goldens found them reached only through the whole golden runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoparallel.passes.topo_span_bucketing import TopoSpanConfig
from autoparallel.pipeline import PLANNED_STAGE_NAMES, STAGE_NAMES
from verify.goldens import catalog
from verify.goldens.cli import UnusedCheck, find_unused
from verify.stages.scenario import Scenario

PLAN = "fsdp fsdp=dp reshard_after_forward=True"


@pytest.mark.parametrize(
    "sid, want",
    [
        ("tiny-fsdp-dp8", {"preset": "tiny", "mesh": "dp=8", "plan": PLAN, "stage": "joint"}),
        ("tiny-fsdp-dp3-uneven", {"preset": "tiny", "layers": "1", "mesh": "dp=3", "plan": PLAN, "stage": "joint"}),
        ("gpt2-fsdp-dp2", {"model": "gpt2", "mesh": "dp=2", "plan": PLAN, "stage": "joint"}),
        ("tiny-auto-dp8", {"preset": "tiny", "mesh": "dp=8", "plan": "auto", "stage": "joint"}),
        ("tiny-fsdp-dp4-split", {"preset": "tiny", "mesh": "dp=4", "plan": PLAN,
                                 "passes": "bucket_cap_mb=0.1 max_topo_span=60 overlap_bucket_cap_mb=None",
                                 "stage": "joint"}),
    ],
)
def test_header_names_the_model_the_layers_only_when_set_and_non_default_passes(sid, want):
    got = catalog.header(catalog.GOLDEN_SCENARIOS[sid], "joint")
    assert got == want and list(got) == list(want)  # the order is the golden file's


def test_options_text_spells_topo_span_settings_and_sorts_the_rest():
    text = catalog._options_text({"z": 1, "topo_span": TopoSpanConfig(max_topo_span=7, bucket_cap_mb=2.0), "a": "x"})
    assert text == "a=x max_topo_span=7 overlap_bucket_cap_mb=2.0 z=1"


def test_slots_stages_ids_groups_and_options():
    assert catalog.golden_stages("tiny-auto-dp8") == PLANNED_STAGE_NAMES
    assert catalog.golden_stages("tiny-fsdp-dp8") == STAGE_NAMES
    slots = catalog.golden_slots()
    assert slots == sorted(slots, key=lambda s: s[0]) and len(slots) == len(set(slots))
    assert len(slots) == sum(len(catalog.golden_stages(sid)) for sid in catalog.GOLDEN_SCENARIOS)
    assert slots[0] == (sorted(catalog.GOLDEN_SCENARIOS)[0], catalog.golden_stages(sorted(catalog.GOLDEN_SCENARIOS)[0])[0])
    other = Scenario(preset="tiny", plan="fsdp", mesh="dp=2")
    assert catalog.scenario_id(other) is None and catalog.scenario_id(catalog.ALL_SCENARIOS["debug-fsdp-dp8"]) == "debug-fsdp-dp8"
    assert catalog.run_group(catalog.GOLDEN_SCENARIOS["tiny-fsdp-dp8"]) == "tiny-fsdp-dp8"
    assert catalog.run_group(other) == f"run {other.header()}"
    assert catalog.pipeline_options(other) == {}
    split = catalog.pipeline_options(catalog.GOLDEN_SCENARIOS["tiny-fsdp-dp4-split"])
    assert split["bucket_cap_mb"] == 0.1
    split["bucket_cap_mb"] = 99  # a copy: the catalog is not changed through it
    assert catalog.PIPELINE_OPTIONS["tiny-fsdp-dp4-split"]["bucket_cap_mb"] == 0.1


def _log(log_dir: Path, name: str, **record) -> None:
    base = {"worker": "", "whole_tree": True, "tests": [], "passed": [], "used": []}
    (log_dir / f"usage-{name}.json").write_text(json.dumps({**base, **record}))


def test_find_unused_says_why_it_could_not_check(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    assert find_unused(tmp_path, log) == UnusedCheck([], "pytest did not finish its session")
    _log(log, "gw0", worker="gw0")  # a worker's record alone: the session did not finish
    assert find_unused(tmp_path, log) == UnusedCheck([], "pytest did not finish its session")
    _log(log, "main", whole_tree=False)
    assert find_unused(tmp_path, log) == UnusedCheck([], "the run was given paths, so it did not collect every golden test")
    _log(log, "main", tests=["t::b", "t::a", "t::c"], passed=["t::c"])
    assert find_unused(tmp_path, log) == UnusedCheck(
        [], "2 golden test(s) did not pass (failed, deselected or skipped), e.g. t::a")


def test_find_unused_lists_the_golden_files_no_test_read(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    goldens = tmp_path / "goldens" / "golden"
    goldens.mkdir(parents=True)
    read, unread = goldens / "a.txt", goldens / "b.txt"
    for p in (read, unread, goldens / ".hidden"):
        p.write_text("x")
    _log(log, "main", tests=["t::a"], passed=["t::a"], used=[str(read.resolve())])
    assert find_unused(tmp_path, log) == UnusedCheck([unread], files=2)
    assert find_unused(tmp_path / "nowhere", log) == UnusedCheck([], files=0)  # no goldens/ at all
