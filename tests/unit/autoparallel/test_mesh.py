"""MeshSpec (autoparallel/mesh.py): parsing "dp=4,tp=2" with errors that say what was expected,
and row-major rank coordinates."""

import pytest

from autoparallel.mesh import MeshSpec, fake_world


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


@pytest.mark.parametrize("text, single, size", [("dp=1,tp=2", "tp", 2), ("dp=2,tp=1", "dp", 2)])
def test_a_size_one_dim_leaves_every_label_resolvable(text, single, size):
    """With a size-1 dim, one group is both a dim's and the flattened mesh's; the flat label used to
    overwrite the dim's, so plans over it failed with "unknown mesh dim 'tp'"."""
    with fake_world(text) as mesh:
        assert set(mesh.group_dims.values()) == {"dp", "tp"}  # graphs name the group by its dim
        assert mesh.group_name(single) == mesh.group_name("dp*tp")
        assert mesh.size(single) == size and mesh.size("dp*tp") == 2
        with pytest.raises(ValueError, match=r"unknown mesh dim 'pp'; known: \['dp', 'dp\*tp', 'tp'\]"):
            mesh.group_name("pp")
