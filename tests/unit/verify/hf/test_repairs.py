"""The back-off's repairs for sums, grids and per-position heads (verify.hf.repairs), on hand-made
config dicts; the library types they make build are in test_ties.py's slow test."""

from __future__ import annotations

import pytest

from verify.hf.repairs import REPAIRS, layer_sums, list_sums, output_positions, position_grid
from verify.hf.sizes import HIDDEN, POSITIONS, SEQ, family, shrink_dict

SECTIONS = {"num_hidden_layers": 12, "n_input_layers": 2, "n_recurrent_layers": 8, "n_output_layers": 2,
            "layer_types": ["a", "b"] * 6, "hidden_size": 256}


def _mend(repair, default, error=ValueError()):
    return repair(object, default, shrink_dict(default), error)


def test_a_layer_count_that_is_a_sum_of_sections_becomes_the_sum_of_the_shrunk_sections():
    out = _mend(layer_sums, SECTIONS)
    parts = out["n_input_layers"] + out["n_recurrent_layers"] + out["n_output_layers"]
    assert out["num_hidden_layers"] == parts == len(out["layer_types"]) == 6
    assert out["layer_types"] == ["a", "b"] * 3  # the first layers: sections are consecutive runs


def test_layer_sums_leaves_counts_that_are_no_sum_or_already_add_up():
    assert _mend(layer_sums, {**SECTIONS, "n_output_layers": 3}) is None  # 2 + 8 + 3 != 12
    assert layer_sums(object, SECTIONS, {**SECTIONS}, ValueError()) is None  # unshrunk: the sum holds


def test_a_list_that_sums_to_a_size_is_scaled_to_its_shrunk_value():
    default = {"hidden_size": 256, "axial_pos_embds_dim": [64, 192], "kernel_sizes": [3, 5]}
    out = _mend(list_sums, default)
    assert sum(out["axial_pos_embds_dim"]) == HIDDEN and out["axial_pos_embds_dim"] == [8, 24]
    assert out["kernel_sizes"] == [3, 5]


def test_list_sums_leaves_lists_that_sum_to_no_size_or_to_two():
    assert _mend(list_sums, {"hidden_size": 256, "dims": [100, 100]}) is None
    # 256 is both the hidden size and the intermediate size: ambiguous, left alone
    assert _mend(list_sums, {"hidden_size": 256, "intermediate_size": 256, "split": [64, 192]}) is None


def test_a_position_grid_is_factored_into_the_sequence_length():
    default = {"max_position_embeddings": 4096, "axial_pos_shape": [64, 64], "strides": [2, 2]}
    out = _mend(position_grid, default)
    assert out["axial_pos_shape"][0] * out["axial_pos_shape"][1] == SEQ
    assert out["strides"] == [2, 2]
    assert _mend(position_grid, {"max_position_embeddings": 4096, "axial_pos_shape": [32, 64]}) is None


def test_a_head_over_every_configured_position_gets_as_many_positions_as_tokens():
    default = {"max_position_embeddings": 2048, "hidden_size": 256}
    rows = 4 * POSITIONS  # 4 examples: logits for every configured position, targets for SEQ tokens
    out = _mend(output_positions, default, ValueError(f"Expected input batch_size ({rows}) to match target batch_size ({4 * SEQ})."))
    assert out["max_position_embeddings"] == SEQ and out["hidden_size"] == HIDDEN


@pytest.mark.parametrize("error", [
    ValueError("Expected input batch_size (12) to match target batch_size (32)."),  # no positions ratio
    ValueError("shapes cannot be multiplied"),
])
def test_output_positions_does_not_apply_to_other_errors(error):
    assert _mend(output_positions, {"max_position_embeddings": 2048}, error) is None


def test_the_repairs_are_registered_and_the_latent_sizes_are_sizes():
    assert {layer_sums, list_sums, position_grid, output_positions} <= set(REPAIRS)
    assert family("d_latents") == "hidden" and family("num_self_attends_per_block") == "layers"

