"""The generic shrink rule (verify.hf.sizes): on hand-written config dicts, then on the library's
configs of each family (a decoder, an encoder, a seq2seq model, a vision model, a composite with
sub-configs), which must build within a size budget and train one step."""

from __future__ import annotations

import pytest

from verify.hf.sizes import HIDDEN, KEEP, LAYERS, OVERRIDES, VOCAB, derived_fields, family, num_parameters, shrink_dict, shrunk_dict

transformers = pytest.importorskip("transformers")

from verify.hf import hf_case, tiny_config  # noqa: E402  (after the extra's skip)

BUDGET = 2_000_000  # parameters of a tiny model


@pytest.mark.parametrize(("key", "fam"), [
    ("hidden_size", "hidden"), ("d_model", "hidden"), ("n_embd", "hidden"), ("hidden_size_per_layer_input", "hidden"),
    ("num_hidden_layers", "layers"), ("encoder_layers", "layers"), ("n_layer", "layers"), ("depths", "depths"),
    ("num_attention_heads", "heads"), ("num_key_value_heads", "heads"), ("head_dim", "head_dim"), ("d_kv", "head_dim"),
    ("intermediate_size", "ffn"), ("moe_intermediate_size", "ffn"), ("d_ff", "ffn"),
    ("num_local_experts", "experts"), ("num_experts_per_tok", "top_k"), ("vocab_size", "vocab"),
    ("encoder_hash_byte_group_vocab", "vocab"),
    ("pad_token_id", "token"), ("eos_token_id", "token"), ("image_token_index", "token"),
    ("max_position_embeddings", "positions"), ("image_size", "image"), ("hidden_sizes", "widths"),
])
def test_a_fields_name_says_its_size_family(key, fam):
    assert family(key) == fam


@pytest.mark.parametrize("key", ["hidden_act", "dropout", "initializer_range", "rms_norm_eps", "tie_word_embeddings", "num_labels",
                                 "vocab_file", "vocabulary_files"])
def test_fields_that_are_not_sizes_have_no_family(key):
    assert family(key) is None


def test_sizes_shrink_and_nothing_else_changes():
    d = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
         "vocab_size": 32000, "hidden_dropout_prob": 0.1, "hidden_act": "gelu", "num_channels": 3, "use_cache": True}
    out = shrink_dict(d)
    assert out == {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2, "intermediate_size": 64,
                   "vocab_size": VOCAB, "hidden_dropout_prob": 0.1, "hidden_act": "gelu", "num_channels": 3, "use_cache": False}
    assert shrink_dict({"hidden_size": 8, "num_attention_heads": 1})["hidden_size"] == 8  # never grown


def test_a_hashed_vocabulary_shrinks_with_the_token_vocabulary():
    """blt's hash n-gram embedding has encoder_hash_byte_group_vocab rows per group size (500002 x 6
    x 32: 96M parameters, an OOM-killed rank) and no "_size" in its name."""
    d = {"vocab_size": 260, "encoder_hash_byte_group_vocab": 500002, "encoder_hash_byte_group_size": [3, 4, 5, 6, 7, 8],
         "encoder_hash_byte_group_nb_functions": 1}
    out = shrink_dict(d)
    assert out["encoder_hash_byte_group_vocab"] == VOCAB
    assert out["encoder_hash_byte_group_size"] == [3, 4, 5, 6, 7, 8] and out["encoder_hash_byte_group_nb_functions"] == 1


def test_token_ids_beyond_the_vocabulary_are_mapped_into_it():
    out = shrink_dict({"vocab_size": 32000, "pad_token_id": 31999, "bos_token_id": 1, "eos_token_id": [2, 32001],
                       "decoder_start_token_id": 250000, "image_token_index": None})
    assert out["pad_token_id"] < VOCAB and out["bos_token_id"] == 1 and all(i < VOCAB for i in out["eos_token_id"])
    assert out["decoder_start_token_id"] < 3 and out["image_token_index"] is None


def test_per_layer_fields_follow_the_layer_count():
    d = {"num_hidden_layers": 6, "layer_types": ["sliding", "full"] * 3, "per_layer_config": {"1": {"a": 1}, "4": {"a": 2}},
         "depths": [3, 4, 6, 3], "hidden_sizes": [256, 512, 1024, 2048], "num_heads": [3, 6, 12, 24], "out_features": ["stage4"]}
    out = shrink_dict(d)
    assert out["layer_types"] == ["sliding", "full"]
    assert out["per_layer_config"] == {"1": {"a": 1}}
    assert out["depths"] == [1, 1, 1, 1] and out["hidden_sizes"] == [16, 32, 64, 128] and out["num_heads"] == [2, 2, 2, 2]
    assert out["out_features"] is None  # a stage that may be gone: the backbone's default


def test_sub_configs_are_shrunk_recursively():
    d = {"model_type": "x", "text_config": {"model_type": "llama", "hidden_size": 4096, "layer_types": None},
         "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24}, "projector": {"dim": 512}}
    out = shrink_dict(d, lambda key, value: key == "vision_config")
    assert out["text_config"]["hidden_size"] == HIDDEN and out["vision_config"]["num_hidden_layers"] == LAYERS
    assert out["projector"] == {"dim": 512}  # neither a config (no model_type) nor a declared sub-config


@pytest.mark.parametrize("model_type", ["mistral", "bert", "bart", "vit", "gemma3"])
def test_each_family_builds_within_the_budget_and_trains_a_step(model_type):
    """A decoder, an encoder, a seq2seq model, a vision model and a composite (gemma3: a vision and
    a text sub-config), none hand-sized (verify.hf.ARCHS has no entry for them)."""
    case = hf_case(model_type)
    model = case.build()
    assert num_parameters(model) < BUDGET, f"{model_type}: {num_parameters(model)} parameters"
    batch = case.batches(4, 1)[0]
    loss = case.loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    assert loss.isfinite()


def test_a_composite_is_over_budget_unless_its_sub_configs_shrink():
    """The negative: shrinking only the top level (the probe that left 53 types at full size)
    leaves gemma3's vision and text towers at the library's size."""
    default = transformers.AutoConfig.for_model("gemma3")
    top_only = type(default).from_dict(shrink_dict({k: v for k, v in default.to_dict().items() if not isinstance(v, dict)})
                                       | {k: v for k, v in default.to_dict().items() if isinstance(v, dict)})
    assert top_only.text_config.hidden_size > 1000
    tiny = tiny_config("gemma3")
    assert tiny.text_config.hidden_size == HIDDEN and tiny.vision_config.hidden_size == HIDDEN
    assert tiny.text_config.vocab_size == VOCAB and tiny.image_token_id < VOCAB


def test_the_rule_keeps_the_librarys_dropout():
    config = tiny_config("bert")
    default = transformers.BertConfig()
    assert config.hidden_dropout_prob == default.hidden_dropout_prob > 0
    assert config.attention_probs_dropout_prob == default.attention_probs_dropout_prob > 0


def test_the_layers_kept_are_one_of_each_kind_then_the_first():
    d = {"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 4,
         "mlp_only_layers": [0, 1, 2, 3, 4, 5, 6, 7][::-1], "per_layer": {"00": 1, "03": 2, "05": 3}}
    out = shrink_dict(d)
    assert out["layer_types"] == ["linear_attention", "full_attention"] and out["num_hidden_layers"] == 2
    assert out["mlp_only_layers"] == [7, 4]  # every per-layer list keeps the same layers
    assert out["per_layer"] == {"00": 1, "01": 2}  # keyed by layer: layers 0 and 3 kept, 3 now the second
    own = shrink_dict({"num_hidden_layers": 4, "per_layer_config": {"1": {"num_attention_heads": 64, "window": 9}}})
    assert own["per_layer_config"] == {"1": {"num_attention_heads": 2, "window": 9}}  # a layer's own sizes shrink
    three = shrink_dict({"num_hidden_layers": 6, "layer_types": ["a", "b", "c"] * 2})
    assert three["layer_types"] == ["a", "b", "c"] and three["num_hidden_layers"] == 3  # more kinds: more layers
    same = shrink_dict({"num_hidden_layers": 6, "layer_types": ["a"] * 6})
    assert same["layer_types"] == ["a", "a"] and same["num_hidden_layers"] == LAYERS  # one kind: the first layers


def test_an_unset_layer_count_is_the_length_of_the_per_layer_list_of_names():
    """nemotron_h (nemo_speechlm's text config): num_hidden_layers None, 52 layers named in
    layers_block_type; before, the 52 layers were kept (the cell spent its 300 s building)."""
    kinds = ["mamba", "moe", "mamba", "attention", "moe", "mamba"] * 2
    out = shrink_dict({"num_hidden_layers": None, "layers_block_type": kinds, "mtp_layers_block_type": ["attention", "moe"]})
    assert out["layers_block_type"] == ["mamba", "moe", "attention"] and out["num_hidden_layers"] is None
    assert out["mtp_layers_block_type"] == ["attention", "moe"]  # not as long: another list, kept
    absent = shrink_dict({"layers_block_type": kinds})  # the count left out of to_dict() altogether
    assert absent["layers_block_type"] == ["mamba", "moe", "attention"] and "num_hidden_layers" not in absent
    assert shrink_dict({"num_hidden_layers": None, "block_names": kinds})["block_names"] == kinds  # no layer list: kept
    assert shrink_dict({"num_hidden_layers": None, "layer_types": kinds}, keep=frozenset({"num_hidden_layers"}))[
        "layer_types"] == kinds  # the count kept at its default: the list too


def test_a_layer_count_that_counts_the_stages_is_kept():
    out = shrink_dict({"num_layers": 4, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24]})
    assert out["num_layers"] == 4 and out["num_heads"] == [2, 2, 2, 2]
    assert shrink_dict({"num_layers": 4, "depths": [2, 2, 6]})["num_layers"] == LAYERS  # 3 stages: 4 counts layers


def test_out_indices_are_clamped_to_the_layers_left_never_none():
    out = shrink_dict({"num_hidden_layers": 12, "out_indices": [3, 5, 7, 11], "out_features": ["stage12"]})
    assert out["out_indices"] == [2] and out["out_features"] is None
    assert shrink_dict({"num_hidden_layers": 12, "out_indices": None})["out_indices"] is None


def test_sizes_left_unset_get_their_test_size_other_unset_fields_stay():
    out = shrink_dict({"vocab_size": None, "num_experts_per_tok": None, "n_routed_experts": None, "head_dim": None,
                       "n_shared_experts": None, "q_lora_rank": None, "pad_token_id": None, "sliding_window": None})
    assert out["vocab_size"] == VOCAB and out["num_experts_per_tok"] == 2 and out["n_routed_experts"] == 4
    assert out["head_dim"] == HIDDEN // 2 and out["n_shared_experts"] == 1
    assert out["q_lora_rank"] is None and out["pad_token_id"] is None and out["sliding_window"] is None  # None means off


def test_group_counts_become_one():
    out = shrink_dict({"num_groups": 32, "mamba_n_groups": 8, "n_groups": 8, "num_query_groups": 32})
    assert out == {"num_groups": 1, "mamba_n_groups": 1, "n_groups": 1, "num_query_groups": 32}


@pytest.mark.parametrize(("d", "heads", "head_dim"), [
    ({"hidden_size": 4096, "expand": 2, "num_heads": 128, "head_dim": 64}, "num_heads", "head_dim"),
    ({"hidden_size": 4096, "mamba_expand": 2, "mamba_n_heads": 128, "mamba_d_head": 64, "head_dim": 128,
      "num_attention_heads": 32}, "mamba_n_heads", "mamba_d_head"),
    ({"hidden_size": 4096, "mamba_expand": 2, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": 8},
     "mamba_n_heads", "mamba_d_head"),
])
def test_a_state_space_blocks_heads_times_head_dim_is_its_width(d, heads, head_dim):
    out = shrink_dict(d)
    width = out.get("mamba_d_ssm") or out.get("expand", out.get("mamba_expand")) * out["hidden_size"]
    assert out[heads] * out[head_dim] == width
    if "num_attention_heads" in d:
        assert out["head_dim"] == HIDDEN // 2  # the attention's head dim: the plain rule


def test_without_an_expand_field_there_is_no_state_space_rule():
    assert shrink_dict({"hidden_size": 4096, "num_heads": 32, "head_dim": 128})["head_dim"] == HIDDEN // 2


def test_fields_declared_auto_are_derived_again_from_the_shrunk_sizes():
    cfg = transformers.AutoConfig.for_model("bamba")
    assert cfg.mamba_d_head == 64  # derived at full size
    tiny = tiny_config("bamba")
    assert tiny.mamba_d_head * tiny.mamba_n_heads == tiny.mamba_expand * tiny.hidden_size


def test_a_model_type_keeps_only_the_fields_keep_names_at_their_default():
    assert list(tiny_config("cvt").depth) == list(transformers.AutoConfig.for_model("cvt").depth) == [1, 2, 10]
    assert tiny_config("cvt").embed_dim == [16, 32, 64] and "embed_dim" not in KEEP["cvt"]
    assert tiny_config("swinv2").depths == [1, 1, 1, 1]  # no entry: the generic rule


def test_a_query_key_head_dim_stays_the_sum_of_its_parts():
    out = shrink_dict({"qk_head_dim": 192, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "head_dim": 64})
    assert out["qk_head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"] and out["head_dim"] == HIDDEN // 2
    assert shrink_dict({"qk_head_dim": 192})["qk_head_dim"] == HIDDEN // 2  # no parts: the plain rule


def test_stages_equal_at_the_default_stay_equal_and_increasing_widths_shrink_as_before():
    assert shrink_dict({"hidden_sizes": [64, 64, 128, 256, 512]})["hidden_sizes"] == [16, 16, 32, 64, 128]
    assert shrink_dict({"hidden_sizes": [96, 192, 384, 768]})["hidden_sizes"] == [16, 32, 64, 128]
    assert shrink_dict({"intermediate_size": [512, 512, 1024]})["intermediate_size"] == [32, 32, 64]


def test_channel_fields_follow_the_widths_they_equal_at_the_default():
    d = {"hidden_sizes": [256, 512, 1024, 2048], "stage_in_channels": [48, 128, 512, 1024],
         "stage_out_channels": [128, 512, 1024, 2048], "stem_out_channels": 256, "num_channels": 3}
    out = shrink_dict(d)
    ins, outs = out["stage_in_channels"], out["stage_out_channels"]
    assert all(outs[i] == ins[i + 1] for i in range(3))  # a stage's input is the previous stage's output
    assert outs[-1] == out["hidden_sizes"][-1] and out["stem_out_channels"] == out["hidden_sizes"][0]
    assert out["num_channels"] == 3 and ins[0] == 48  # no width equals them: left alone
    # 768 is shrunk to two values (hidden_size 32, the last stage 128): a channel field of 768 is left alone
    out = shrink_dict({"hidden_size": 768, "hidden_sizes": [96, 192, 384, 768], "out_channels": 768})
    assert out["out_channels"] == 768


def test_an_unset_default_choice_takes_the_first_of_its_list():
    assert shrink_dict({"languages": ["en_XX", "de_DE"], "default_language": None})["default_language"] == "en_XX"
    assert shrink_dict({"languages": ["en_XX", "de_DE"], "default_language": "de_DE"})["default_language"] == "de_DE"
    assert shrink_dict({"default_language": None})["default_language"] is None  # no choices: left unset
    assert shrink_dict({"languages": [], "default_language": None})["default_language"] is None


def test_unset_token_ids_become_zero_only_in_the_token_mode():
    d = {"vocab_size": 1000, "pad_token_id": None, "mask_token_id": None, "eos_token_id": 2, "text": {"model_type": "x", "pad_token_id": None}}
    assert shrink_dict(d)["pad_token_id"] is None and shrink_dict(d)["mask_token_id"] is None
    out = shrink_dict(d, unset_tokens=True)
    assert (out["pad_token_id"], out["mask_token_id"], out["eos_token_id"], out["text"]["pad_token_id"]) == (0, 0, 2, 0)


def _derived_config():
    from huggingface_hub.dataclasses import strict

    @strict
    class DerivedConfig(transformers.PreTrainedConfig):
        """A config of our own that derives a width from its hidden size in __post_init__."""

        model_type = "derived-test"
        hidden_size: int = 256

        def __post_init__(self, **kwargs):
            self.attention_hidden_size = 2 * self.hidden_size
            super().__post_init__(**kwargs)

    return DerivedConfig


def test_derived_fields_are_the_attributes_post_init_sets_and_rederive_drops_them():

    cls = _derived_config()
    assert derived_fields(cls) == {"attention_hidden_size"}
    pinned = cls.from_dict(shrunk_dict(cls()))
    assert (pinned.hidden_size, pinned.attention_hidden_size) == (HIDDEN, HIDDEN)  # the dict pins the shrunk value
    derived = cls.from_dict(shrunk_dict(cls(), rederive=True))
    assert (derived.hidden_size, derived.attention_hidden_size) == (HIDDEN, 2 * HIDDEN)
    assert derived_fields(transformers.PretrainedConfig) == frozenset() and derived_fields(dict) == frozenset()


def test_a_count_declared_none_is_derived_again_from_the_shrunk_sizes():
    from huggingface_hub.dataclasses import strict

    @strict
    class BlocksConfig(transformers.PreTrainedConfig):
        """Ours: the blocks the model builds default to the layer count (xlstm's num_blocks)."""

        model_type = "blocks-test"
        num_hidden_layers: int = 32
        num_blocks: int | None = None
        window: int | None = None  # derived as a constant: reset and derived again, unchanged

        def __post_init__(self, **kwargs):
            self.num_blocks = self.num_hidden_layers if self.num_blocks is None else self.num_blocks
            self.window = 512 if self.window is None else self.window
            super().__post_init__(**kwargs)

    tiny = BlocksConfig.from_dict(shrunk_dict(BlocksConfig()))
    assert (tiny.num_hidden_layers, tiny.num_blocks, tiny.window) == (LAYERS, LAYERS, 512)
    assert BlocksConfig.from_dict(shrunk_dict(BlocksConfig(num_blocks=7))).num_blocks == 7  # set: kept
    assert tiny_config("xlstm").num_blocks == LAYERS  # the library's default: 32 blocks before
    assert tiny_config("vit").pooler_output_size == tiny_config("vit").hidden_size  # derived from the width


def test_a_library_default_that_builds_no_model_gets_its_override():

    config = transformers.AutoConfig.for_model("lfm2_moe")
    assert config.layer_types is None  # the library's default: the model indexes it per layer
    d = shrunk_dict(config)
    assert d["layer_types"] == OVERRIDES["lfm2_moe"]["layer_types"] and len(d["layer_types"]) == d["num_hidden_layers"]
    d = shrunk_dict(transformers.AutoConfig.for_model("efficientnet"))
    assert d["hidden_dim"] == 1280 * d["width_coefficient"]  # the head's width the model hard-codes


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["xmod", "esm", "lfm2_moe", "textnet"])
def test_types_each_new_rule_fixes_build_and_train_a_step(model_type):
    """xmod: a default choice; esm: the unset token ids (back-off); lfm2_moe: its override; textnet:
    stage-width ties, channel fields and per-block lists (the derive mode: the unit tests above,
    zamba2's build takes 25 s)."""
    case = hf_case(model_type)
    model = case.build()
    assert num_parameters(model) <= BUDGET
    batch = case.batches(4, 1)[0]
    case.loss_fn(model(*batch[:-1]), batch[-1]).backward()


def test_per_block_lists_of_each_stage_are_cut_to_the_new_depths():
    d = {"depths": [3, 2], "conv_layer_strides": [[1, 2, 1], [2, 1]], "kernel_sizes": [3, 5], "dilations": [[1, 2], [1, 2, 3]]}
    out = shrink_dict(d)
    assert out["depths"] == [1, 1] and out["conv_layer_strides"] == [[1], [2]]  # a stage's first block kept
    assert out["kernel_sizes"] == [3, 5] and out["dilations"] == [[1, 2], [1, 2, 3]]  # one per stage / not per block: left
