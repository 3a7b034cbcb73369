"""Hugging Face transformers architectures as ``ModelCase`` s (the ``[hf]`` extra).

``hf_case("gpt2")`` builds ``GPT2LMHeadModel`` from a tiny config that keeps the library's
defaults (dropout included: a model trains as users train it) and overrides only sizes, and
``use_cache=False`` (a training step keeps no cache). Nothing is downloaded: configs are built in
code, weights are the library's random initialisation under the case's seed.

Each family gets its task's loss and batches: token cross-entropy for causal and masked LMs
(targets random tokens), the same on the decoder for sequence-to-sequence models (inputs: the
encoder's and the decoder's tokens), class cross-entropy for image classifiers.
``python -m verify report --hf NAME`` and ``check_model(hf_case(NAME), ...)`` run them; the CI
matrix is ``tests/parity/test_hf_parity.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verify.model_case import ModelCase

VOCAB = 64
SEQ = 8
IMAGE = 16
LABELS = 4

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32)
_ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=40)


@dataclass(frozen=True)
class Arch:
    """One architecture: its config and model class names in ``transformers``, the task (how the
    batches and the loss look) and the config's size overrides."""

    config: str
    model: str
    task: str  # "causal", "masked", "seq2seq", "image"
    sizes: dict[str, Any] = field(default_factory=dict)


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", "causal", dict(n_embd=32, n_layer=2, n_head=2, n_positions=32)),
    "gpt_neo": Arch("GPTNeoConfig", "GPTNeoForCausalLM", "causal", dict(
        hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=32,
        attention_types=[[["global", "local"], 1]], window_size=8)),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "causal", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)),
    "gptj": Arch("GPTJConfig", "GPTJForCausalLM", "causal", dict(n_embd=32, n_layer=2, n_head=2, n_positions=32, rotary_dim=8)),
    "opt": Arch("OPTConfig", "OPTForCausalLM", "causal", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, max_position_embeddings=32,
        word_embed_proj_dim=32)),
    "bloom": Arch("BloomConfig", "BloomForCausalLM", "causal", dict(hidden_size=32, n_layer=2, n_head=2)),
    "falcon": Arch("FalconConfig", "FalconForCausalLM", "causal", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)),
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "causal", _DECODER),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "causal", _DECODER),
    "mixtral": Arch("MixtralConfig", "MixtralForCausalLM", "causal", dict(_DECODER, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "causal", _DECODER),
    "qwen2_moe": Arch("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "causal", dict(
        _DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "gemma": Arch("GemmaConfig", "GemmaForCausalLM", "causal", dict(_DECODER, head_dim=16)),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", "causal", dict(_DECODER, head_dim=16)),
    "phi": Arch("PhiConfig", "PhiForCausalLM", "causal", {k: v for k, v in _DECODER.items() if k != "num_key_value_heads"}),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", "causal", dict(_DECODER, pad_token_id=0)),  # default 32000: outside VOCAB
    "starcoder2": Arch("Starcoder2Config", "Starcoder2ForCausalLM", "causal", _DECODER),
    "bert": Arch("BertConfig", "BertForMaskedLM", "masked", _ENCODER),
    "roberta": Arch("RobertaConfig", "RobertaForMaskedLM", "masked", _ENCODER),
    "distilbert": Arch("DistilBertConfig", "DistilBertForMaskedLM", "masked", dict(
        dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32)),
    "albert": Arch("AlbertConfig", "AlbertForMaskedLM", "masked", dict(_ENCODER, embedding_size=16)),
    "electra": Arch("ElectraConfig", "ElectraForMaskedLM", "masked", dict(_ENCODER, embedding_size=32)),
    "t5": Arch("T5Config", "T5ForConditionalGeneration", "seq2seq", dict(
        d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0)),
    "bart": Arch("BartConfig", "BartForConditionalGeneration", "seq2seq", dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)),
    "vit": Arch("ViTConfig", "ViTForImageClassification", "image", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=IMAGE, patch_size=4)),
    "swin": Arch("SwinConfig", "SwinForImageClassification", "image", dict(
        image_size=IMAGE, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
    "resnet": Arch("ResNetConfig", "ResNetForImageClassification", "image", dict(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
}


def _transformers():
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ValueError("verify.hf needs transformers: pip install -c constraints.txt -e '.[hf]'") from None


def hf_config(name: str, **overrides: Any):
    """The tiny config of architecture ``name`` (library defaults but sizes), with ``overrides``
    (sizes too: ``hf_config("gpt2", n_embd=256)``)."""
    arch = _arch(name)
    cls = getattr(_transformers(), arch.config)
    kw: dict[str, Any] = dict(arch.sizes)
    if arch.task == "image":
        kw["num_labels"] = LABELS
    else:
        kw["vocab_size"] = VOCAB
    config = cls(**{**kw, **overrides})
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _arch(name: str) -> Arch:
    if name not in ARCHS:
        raise ValueError(f"unknown Hugging Face architecture {name!r}; known: {sorted(ARCHS)}")
    return ARCHS[name]


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


def token_loss(out, target: torch.Tensor) -> torch.Tensor:
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def class_loss(out, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out).float(), target)


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n, SEQ))


def _mask(n: int) -> torch.Tensor:
    return torch.ones(n, SEQ, dtype=torch.long)


# The model's keyword inputs (a tokenizer's output: tokens and their attention mask; without a
# mask, transformers looks for packed sequences with a data-dependent branch), then the target.
_INPUTS: dict[str, tuple[str, ...]] = {
    "causal": ("input_ids", "attention_mask"),
    "masked": ("input_ids", "attention_mask"),
    "seq2seq": ("input_ids", "attention_mask", "decoder_input_ids"),
    "image": ("pixel_values",),
}
_BATCHES: dict[str, Callable[[int], tuple[torch.Tensor, ...]]] = {
    "causal": lambda n: (_tokens(n), _mask(n), _tokens(n)),
    "masked": lambda n: (_tokens(n), _mask(n), _tokens(n)),
    "seq2seq": lambda n: (_tokens(n), _mask(n), _tokens(n), _tokens(n)),
    "image": lambda n: (torch.randn(n, 3, IMAGE, IMAGE), torch.randint(0, LABELS, (n,))),
}


class KeywordInputs(nn.Module):
    """Calls the wrapped model with its positional inputs as keywords (a ModelCase's batch is
    positional; a transformers model's forward takes its inputs by name, in an order that
    differs between families). Parameter names gain the prefix ``model.``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.names):
            raise TypeError(f"{type(self.model).__name__} takes {list(self.names)}, got {len(inputs)} inputs")
        return self.model(**dict(zip(self.names, inputs, strict=True)))


def hf_case(name: str, *, batch_per_rank: int = 2, **overrides: Any) -> ModelCase:
    """A ModelCase of Hugging Face architecture ``name`` (see :data:`ARCHS`), config overrides
    allowed (``hf_case("gpt2", resid_pdrop=0.0)``)."""
    arch = _arch(name)
    config = hf_config(name, **overrides)
    model_cls = getattr(_transformers(), arch.model)
    loss = class_loss if arch.task == "image" else token_loss
    names = _INPUTS[arch.task]
    return ModelCase(f"hf-{name}", lambda: KeywordInputs(model_cls(config), names), loss, _BATCHES[arch.task],
                     batch_per_rank=batch_per_rank)


__all__ = ["ARCHS", "Arch", "KeywordInputs", "class_loss", "hf_case", "hf_config", "token_loss"]
