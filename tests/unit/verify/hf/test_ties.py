"""Sizes tied to each other (verify.hf.ties), the back-off's repairs (verify.hf.repairs) and the
shrink's fixes that came with them, on hand-made config dicts and fake config classes (no
transformers model is built here)."""

from __future__ import annotations

import pytest

from verify.hf import hf_case, ties
from verify.hf.backoff import fit, repair
from verify.hf.repairs import follow_equal_sizes, missing_attribute
from verify.hf.sizes import HEAD_DIM, HIDDEN, LAYERS, family, shrink_dict

# A layer's view at the default: head_dim 256 = qk_nope 192 (the layer's override) + qk_rope 64,
# and a coincidental 192 = v_head_dim 128 + qk_rope 64 on one of its parts.
MLA = {"hidden_size": 512, "num_hidden_layers": 4, "head_dim": 256, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
       "v_head_dim": 128, "layer_types": ["full", "full", "sliding", "sliding"],
       "per_layer_config": {"02": {"qk_nope_head_dim": 192}, "03": {"qk_nope_head_dim": 192}}}


def test_a_sum_in_a_layers_view_holds_after_the_shrink():
    out = shrink_dict(MLA)
    layer = next(iter(out["per_layer_config"].values()))
    assert out["head_dim"] == layer["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    assert layer["qk_nope_head_dim"] == HEAD_DIM  # the part stays a part: not 128 + 64 shrunk


def test_the_largest_sum_wins_and_its_parts_stay_parts():
    default = {"head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 128}
    shrunk = dict.fromkeys(default, 16)
    assert ties.sums(default, shrunk, {"qk_nope_head_dim"}) == {"head_dim": 32}


def test_no_sum_without_a_field_of_the_layers_own():
    default = {"head_dim": 256, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64}
    assert ties.sums(default, dict.fromkeys(default, 16), set()) == {}
    assert ties.sums({"a_head_dim": 10, "b_head_dim": 3, "c_head_dim": 4}, dict.fromkeys("abc", 1), {"a_head_dim"}) == {}


def test_without_overrides_the_head_dims_shrink_as_before():
    d = {k: v for k, v in MLA.items() if k != "per_layer_config"}
    assert shrink_dict(d)["head_dim"] == HEAD_DIM


def test_empty_rope_parameters_get_the_default_rope_per_layer_kind():
    class Cfg:
        default_theta = 123.0
    d = {"layer_types": ["sliding", "full", "sliding"], "rope_parameters": {}}
    ties.fill_empty_rope(d, Cfg)
    assert d["rope_parameters"] == {"sliding": {"rope_type": "default", "rope_theta": 123.0},
                                    "full": {"rope_type": "default", "rope_theta": 123.0}}


@pytest.mark.parametrize("d", [
    {"layer_types": ["full"], "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},  # set: kept
    {"layer_types": ["full"], "rope_parameters": None},  # None: the config derives it itself
    {"rope_parameters": {}},  # no layer kinds to key it by
])
def test_rope_parameters_that_are_set_or_unkeyed_stay(d):
    before = repr(d)
    ties.fill_empty_rope(d, object)
    assert repr(d) == before


def test_a_back_off_keep_survives_a_label_map_and_label_maps_are_not_layers():
    d = {"id2label": {0: "A", 1: "B"}, "num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 64}
    out = shrink_dict(d, keep=frozenset({"num_attention_heads"}))
    assert out["num_attention_heads"] == 64 and out["hidden_size"] == HIDDEN
    assert out["id2label"] == {0: "A", 1: "B"}


def test_a_per_layer_list_of_sizes_shrinks_per_layer_not_per_stage():
    out = shrink_dict({"num_hidden_layers": 6, "intermediate_size": [4096] * 6, "hidden_size": 512})
    assert out["intermediate_size"] == [64] * LAYERS


def test_a_list_of_layer_indices_is_not_a_list_of_sizes():
    out = shrink_dict({"num_hidden_layers": 6, "moe_layers": [0, 3, 5], "hidden_size": 512})
    assert out["moe_layers"] == [0, 3, 5]


class Attn:
    """A fake sub-config class, named in errors as transformers names its configs."""


class Outer:
    sub_configs = {"attn_config": Attn}


def test_a_field_a_sub_config_lacks_is_copied_from_the_enclosing_config():
    shrunk = {"rope_parameters": {"rope_theta": 500.0}, "attn_config": {"kv_n_heads": 1}}
    error = AttributeError("'Attn' object has no attribute 'rope_theta'")
    assert missing_attribute(Outer, {}, shrunk, error)["attn_config"] == {"kv_n_heads": 1, "rope_theta": 500.0}


@pytest.mark.parametrize("error", [
    AttributeError("'Attn' object has no attribute 'nowhere'"),  # the value is nowhere
    AttributeError("'Other' object has no attribute 'rope_theta'"),  # not a sub-config of Outer
    ValueError("'Attn' object has no attribute 'rope_theta'"),  # not an AttributeError
])
def test_missing_attribute_does_not_apply_elsewhere(error):
    shrunk = {"rope_parameters": {"rope_theta": 500.0}, "attn_config": {}}
    assert missing_attribute(Outer, {}, shrunk, error) is None


def test_an_equal_size_follows_the_size_it_equals():
    default = {"audio_config": {"model_type": "audio", "hidden_size": 1280, "adapter_input_size": 1280, "window_size": 7}}
    shrunk = shrink_dict(default)
    out = follow_equal_sizes(object, default, shrunk, ValueError("adapter_input_size must match hidden_size"))
    assert out["audio_config"]["adapter_input_size"] == HIDDEN == out["audio_config"]["hidden_size"]
    assert out["audio_config"]["window_size"] == 7


def test_an_ambiguous_or_absent_equal_size_is_left_alone():
    default = {"hidden_size": 1024, "intermediate_size": 1024, "adapter_input_size": 1024}  # 32 or 64
    assert follow_equal_sizes(object, default, shrink_dict(default), ValueError()) is None
    default = {"hidden_size": 1024, "adapter_input_size": 77}
    assert follow_equal_sizes(object, default, shrink_dict(default), ValueError()) is None


DEFAULT = {"hidden_size": 1024, "adapter_input_size": 1024, "rope_parameters": {"rope_theta": 9.0},
           "attn_config": {"kv_n_heads": 1}, "num_hidden_layers": 4}


class Model:
    """Fake validators and forward: the adapter must match the hidden size, then attention needs rope_theta."""

    sub_configs = {"attn_config": Attn}


def probe(d):
    if d["adapter_input_size"] != d["hidden_size"]:
        return ValueError("adapter_input_size must match hidden_size")
    if "rope_theta" not in d["attn_config"]:
        return AttributeError("'Attn' object has no attribute 'rope_theta'")
    return None


def repairs():
    return tuple(lambda default, d, e, r=r: r(Model, default, d, e) for r in (follow_equal_sizes, missing_attribute))


def test_repairs_chain_until_the_config_builds():
    fixed = repair(DEFAULT, shrink_dict(DEFAULT), probe(shrink_dict(DEFAULT)), probe, lambda d: 1, repairs())
    assert fixed is not None and probe(fixed[0]) is None and len(fixed[1]) == 2


def test_fit_takes_the_repair_before_any_field_is_restored():
    d, what = fit(DEFAULT, lambda keep=frozenset(), first_layers=False: shrink_dict(DEFAULT, keep=keep), probe,
                  lambda d: 1, repairs=repairs())
    assert probe(d) is None and d["hidden_size"] == HIDDEN and len(what) == 2


def test_without_repairs_or_within_no_budget_the_repair_gives_up():
    shrunk = shrink_dict(DEFAULT)
    assert repair(DEFAULT, shrunk, probe(shrunk), probe, lambda d: 1, ()) is None
    assert repair(DEFAULT, shrunk, probe(shrunk), probe, lambda d: 10**9, repairs(), budget=10) is None
    assert family("adapter_input_size") is None  # why the rule itself leaves it at its default


# gemma3n-like: the last 3 of 6 layers reuse the cache of the last earlier layer of their kind.
SHARED = {"num_hidden_layers": 6, "num_kv_shared_layers": 3, "hidden_size": 512,
          "layer_types": ["sliding", "full", "sliding", "sliding", "full", "sliding"]}


def kinds_on_both_sides(d):
    first = d["num_hidden_layers"] - d["num_kv_shared_layers"]
    return 0 < first < d["num_hidden_layers"] and set(d["layer_types"][:first]) == set(d["layer_types"])


def test_the_segments_mode_keeps_each_kind_on_both_sides_of_a_count_of_the_last_layers():
    out = shrink_dict(SHARED, segments=True)
    assert out["layer_types"] == ["sliding", "full", "sliding", "full"] and out["num_hidden_layers"] == 4
    assert out["num_kv_shared_layers"] == 2 and kinds_on_both_sides(out)


def test_the_rule_alone_loses_the_producers_the_segments_mode_keeps():
    assert not kinds_on_both_sides(shrink_dict(SHARED))  # the failure the back-off mode exists for


def test_a_count_below_several_layer_counts_is_ambiguous_and_left_to_the_rule():
    d = {"num_hidden_layers": 8, "n_recurrent_layers": 4, "n_input_layers": 2, "hidden_size": 64}
    assert ties.last_segments(d, {8, 4}, frozenset(), family) == {"n_recurrent_layers": (8, 4)}
    assert ties.segment_marks(8, {"n_recurrent_layers": (8, 4)}) == [["first"] * 4 + ["last"] * 4]


def test_fit_tries_the_segments_mode_before_restoring_a_field():
    def probe(d):
        return None if kinds_on_both_sides(d) else ValueError("producing a cache is different")

    def shrink(keep=frozenset(), first_layers=False, segments=False):
        return shrink_dict(SHARED, keep=keep, first_layers=first_layers, segments=segments)

    d, what = fit(SHARED, shrink, probe, lambda d: 1)
    assert d["num_hidden_layers"] == 4 and "both sides" in what[0]


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "how"), [
    ("cohere_compass_text", None),  # the rule: empty rope_parameters filled per layer kind
    ("dbrx", "missing_attribute"),  # a repair: rope_theta copied into the attention sub-config
    ("dory", "layer_sums"),  # input + recurrent + output sections = num_hidden_layers
    ("reformer", "list_sums, position_grid"),  # axial position embeddings: dims sum, shape multiplies
    ("perceiver", "output_positions"),  # the decoder predicts every configured position
    ("siglip2", None),  # the rule: pixels come as a sequence of patches with their grid
])
def test_library_types_the_ties_and_repairs_make_build(model_type, how, capfd):
    """A transformers type per new path builds and trains one eager step (slow: HF builds)."""
    pytest.importorskip("transformers")
    import torch

    case = hf_case(model_type)
    model = case.build()
    batch = case.batches(2 * case.batch_per_rank, 1)[0]
    case.loss_fn(model(*batch[:-1]), batch[-1]).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    err = capfd.readouterr().err
    assert (f"repairs {how}" in err) if how else ("backing off" not in err)
