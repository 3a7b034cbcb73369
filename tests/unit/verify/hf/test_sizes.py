"""The generic shrink rule (verify.hf.sizes): on hand-written config dicts, then on the library's
configs of each family (a decoder, an encoder, a seq2seq model, a vision model, a composite with
sub-configs), which must build within a size budget and train one step."""

from __future__ import annotations

import pytest

from verify.hf.sizes import HIDDEN, LAYERS, VOCAB, family, num_parameters, shrink_dict

transformers = pytest.importorskip("transformers")

from verify.hf import hf_case, tiny_config  # noqa: E402  (after the extra's skip)

BUDGET = 2_000_000  # parameters of a tiny model


@pytest.mark.parametrize(("key", "fam"), [
    ("hidden_size", "hidden"), ("d_model", "hidden"), ("n_embd", "hidden"), ("hidden_size_per_layer_input", "hidden"),
    ("num_hidden_layers", "layers"), ("encoder_layers", "layers"), ("n_layer", "layers"), ("depths", "depths"),
    ("num_attention_heads", "heads"), ("num_key_value_heads", "heads"), ("head_dim", "head_dim"), ("d_kv", "head_dim"),
    ("intermediate_size", "ffn"), ("moe_intermediate_size", "ffn"), ("d_ff", "ffn"),
    ("num_local_experts", "experts"), ("num_experts_per_tok", "top_k"), ("vocab_size", "vocab"),
    ("pad_token_id", "token"), ("eos_token_id", "token"), ("image_token_index", "token"),
    ("max_position_embeddings", "positions"), ("image_size", "image"), ("hidden_sizes", "widths"),
])
def test_a_fields_name_says_its_size_family(key, fam):
    assert family(key) == fam


@pytest.mark.parametrize("key", ["hidden_act", "dropout", "initializer_range", "rms_norm_eps", "tie_word_embeddings", "num_labels"])
def test_fields_that_are_not_sizes_have_no_family(key):
    assert family(key) is None


def test_sizes_shrink_and_nothing_else_changes():
    d = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
         "vocab_size": 32000, "hidden_dropout_prob": 0.1, "hidden_act": "gelu", "num_channels": 3, "use_cache": True}
    out = shrink_dict(d)
    assert out == {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2, "intermediate_size": 64,
                   "vocab_size": VOCAB, "hidden_dropout_prob": 0.1, "hidden_act": "gelu", "num_channels": 3, "use_cache": False}
    assert shrink_dict({"hidden_size": 8, "num_attention_heads": 1})["hidden_size"] == 8  # never grown


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
