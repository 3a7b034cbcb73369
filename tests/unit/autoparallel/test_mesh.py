"""MeshSpec (autoparallel/mesh.py): parsing "dp=4,tp=2" with errors that say what was expected,
and row-major rank coordinates."""

import pytest

from autoparallel.mesh import MeshSpec


@pytest.mark.parametrize(
    "text, msg",
    [("dp", "expected 'name=size"), ("dp=0", "sizes must be ints >= 1"), ("dp=2,dp=2", "appears twice"), ("", "expected")],
)
def test_bad_mesh_text(text, msg):
    with pytest.raises(ValueError, match=msg):
        MeshSpec.parse(text)


def test_mesh_coordinates_row_major():
    spec = MeshSpec.parse("dp=2,tp=4")
    assert spec.coordinate(0) == {"dp": 0, "tp": 0}
    assert spec.coordinate(5) == {"dp": 1, "tp": 1}
    assert spec.world_size == 8 and str(spec) == "dp=2,tp=4"
