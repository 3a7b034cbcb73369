"""hf_case takes any model type, a PretrainedConfig or a config.json; tokens only by default,
the attention mask on request; the hand-sized ARCHS keep their configs; a forward that packs an
example's codebooks into rows gets that many rows per example."""

from __future__ import annotations

import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from verify.hf import ARCHS, hf_case, hf_config, input_task, model_config, model_types, rows_per_example, task_of, tiny_config  # noqa: E402


def test_every_auto_table_contributes_model_types():
    types = model_types()
    assert len(types) > 250 and types == sorted(types)
    assert task_of("llama") == ("causal", "LlamaForCausalLM")
    assert task_of("bert")[0] == "masked" and task_of("t5")[0] == "seq2seq" and task_of("vit")[0] == "image"
    assert task_of("deit") == ("image", "DeiTForImageClassification")  # a tuple of heads: the first


def test_an_unknown_model_type_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown Hugging Face model type 'gpt3'.*known: .*gpt2"):
        hf_case("gpt3")


@pytest.mark.parametrize(("name", "task"), [("gpt2", "causal"), ("mistral", "causal"), ("bert", "masked"), ("bart", "seq2seq")])
def test_tokens_only_by_default_and_the_mask_on_request(name, task):
    plain, masked = hf_case(name), hf_case(name, attention_mask=True)
    inputs = lambda case: case.build().names  # noqa: E731
    names = {"causal": ("input_ids",), "masked": ("input_ids",), "seq2seq": ("input_ids", "decoder_input_ids")}[task]
    assert inputs(plain) == names
    assert inputs(masked) == (names[0], "attention_mask", *names[1:])
    batch, masked_batch = plain.batches(4, 1)[0], masked.batches(4, 1)[0]
    assert len(batch) == len(names) + 1 and len(masked_batch) == len(names) + 2
    assert masked_batch[1].dtype == torch.long
    assert (masked_batch[1] == 1).all() and batch[0].min() >= 3  # ids 0..2: special tokens, never drawn
    for case, b in ((plain, batch), (masked, masked_batch)):
        model = case.build()
        case.loss_fn(model(*b[:-1]), b[-1]).backward()
    assert masked.name.endswith("+mask") and not plain.name.endswith("+mask")


def test_a_wrong_number_of_inputs_names_the_ones_the_model_takes():
    model = hf_case("gpt2").build()
    batch = hf_case("gpt2", attention_mask=True).batches(2, 1)[0]
    with pytest.raises(TypeError, match=r"takes \['input_ids'\], got 2 inputs"):
        model(*batch[:-1])


def test_the_hand_sized_architectures_keep_their_configs():
    """ARCHS names take their hand-written sizes (their graphs, and the matrix, stay as they were),
    not the generic rule's."""
    assert hf_config("gpt2").n_layer == ARCHS["gpt2"].sizes["n_layer"] == 2
    assert hf_config("gemma").head_dim == 16 and hf_config("albert").embedding_size == 16
    assert tiny_config("albert").embedding_size != 16  # what the generic rule would have given


def test_a_pretrained_config_and_a_config_json_are_shrunk_by_the_same_rule(tmp_path):
    config = transformers.MistralConfig(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, vocab_size=5000)
    from_config = hf_case(config).build().model.config
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    from_json = hf_case(str(path)).build().model.config
    for c in (from_config, from_json):
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.vocab_size) == (32, 2, 2, 64)
        assert c.rms_norm_eps == config.rms_norm_eps and not c.use_cache
    assert hf_case(str(path)).name == "hf-mistral"


def test_a_config_json_without_a_model_type_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ValueError, match="needs its model_type"):
        hf_case(str(path))


def test_an_image_model_gets_pixels_of_its_configs_size_and_class_targets():
    case = hf_case("deit")
    pixels, labels = case.batches(2, 1)[0]
    config = case.build().model.config
    assert pixels.shape == (2, config.num_channels, config.image_size, config.image_size) and config.num_labels == 4
    assert labels.dtype == torch.long and labels.max() < 4


def test_a_composites_head_gets_the_sub_config_of_its_class():
    config = tiny_config("llama4")
    text = model_config(transformers.Llama4ForCausalLM, config)
    assert text is config.text_config and isinstance(text, transformers.Llama4TextConfig)
    plain = tiny_config("mistral")
    assert model_config(transformers.MistralForCausalLM, plain) is plain
    assert model_config(transformers.MistralForCausalLM, config) is config  # no sub-config of that class: unchanged


def test_an_image_classifier_that_takes_tokens_gets_tokens():
    assert input_task("image", transformers.ImageGPTForImageClassification) == "image_tokens"
    assert input_task("image", transformers.ViTForImageClassification) == "image"
    assert input_task("image", transformers.Siglip2ForImageClassification) == "image_patches"
    assert input_task("causal", transformers.MistralForCausalLM) == "causal"
    case = hf_case("imagegpt")
    inputs, target = (b := case.batches(2, 1)[0])[:-1], b[-1]
    assert inputs[0].dtype == torch.long and target.shape == (2,)


class _Codes:
    def forward(self, input_ids):
        """
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size * num_codebooks, sequence_length)`):
                audio codes, the codebooks of one example on consecutive rows.
        """


class _Tokens:
    def forward(self, input_ids):
        """
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
                tokens.
        """


def test_a_forward_that_packs_codebooks_into_rows_gets_that_many_rows_per_example():
    """Failed before: musicgen's 4 rows were one example of 4 codebooks, and a data-parallel slice
    of 2 rows no example ("shape '[-1, 4, 8]' is invalid for input of size 16")."""
    config = types.SimpleNamespace(num_codebooks=3)
    assert rows_per_example(_Codes, config) == 3
    assert rows_per_example(_Tokens, config) == 1  # a codebook count alone (moshi's) is not the layout
    assert rows_per_example(_Codes, types.SimpleNamespace()) == 1
    inputs, target = hf_case("musicgen").batch(2)
    assert inputs.shape[0] == target.shape[0] == 2 * tiny_config("musicgen").decoder.num_codebooks
