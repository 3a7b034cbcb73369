"""Device profiles: explicit, by name or JSON, never a silent default."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autoparallel.planner import PROFILES, DeviceProfile, Link, get_profile
from autoparallel.planner.profile import with_links


def test_unknown_profile_name_is_an_error_listing_the_shipped_ones():
    with pytest.raises(ValueError, match="unknown device profile 'h200x'.*a100.*h100"):
        get_profile("h200x")


def test_default_is_h100_and_a_profile_passes_through():
    assert get_profile().name == "h100"
    custom = dataclasses.replace(PROFILES["h100"], name="mine")
    assert get_profile(custom) is custom


def test_json_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "mine.json"
    prof = with_links(dataclasses.replace(PROFILES["a100"], name="mine"), tp=Link(900.0, 1.0))
    path.write_text(json.dumps(prof.to_json()))
    back = get_profile(str(path))
    assert back == prof and back.tflops(torch.bfloat16) == 312.0
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))
    bad = prof.to_json()
    bad["peak_tflops"] = {"fp8": 1.0}
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="'fp8' is not a dtype name"):
        get_profile(str(path))
    bad = prof.to_json()
    del bad["mem_bandwidth_gbps"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="missing.*mem_bandwidth_gbps"):
        get_profile(str(path))
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_profile(str(path))


def test_mesh_dims_map_to_links_innermost_first():
    h100 = PROFILES["h100"]
    links = h100.links((("dp", 16), ("tp", 8)))
    assert links == {"dp": h100.inter_node, "tp": h100.intra_node}
    assert h100.links((("dp", 4), ("tp", 2))) == {"dp": h100.intra_node, "tp": h100.intra_node}
    assert h100.links((("dp", 16),)) == {"dp": h100.inter_node}
    fast = with_links(h100, dp=Link(1000.0, 0.5))
    assert fast.links((("dp", 16), ("tp", 8)))["dp"] == Link(1000.0, 0.5)


@pytest.mark.parametrize(
    "field,value,match",
    [("efficiency", 1.5, "fraction"), ("mem_bandwidth_gbps", 0.0, "> 0"), ("gpus_per_node", 0, ">= 1"), ("launch_floor_us", -1.0, ">= 0")],
)
def test_bad_profile_values_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(PROFILES["h100"], **{field: value})


def test_the_bounds_of_profile_values_are_themselves_allowed():
    """No launch floor (0 us) and a profile at its full peak (efficiency 1) are valid profiles."""
    edge = dataclasses.replace(PROFILES["h100"], launch_floor_us=0.0, efficiency=1.0)
    assert (edge.launch_floor_us, edge.efficiency) == (0.0, 1.0)


def test_bad_links_are_rejected():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(0.0, 1.0)
    with pytest.raises(ValueError, match="latency"):
        Link(1.0, float("nan"))
    assert isinstance(PROFILES["h100"], DeviceProfile)
