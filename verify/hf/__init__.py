"""Hugging Face transformers architectures as ``ModelCase`` s (the ``[hf]`` extra).

``hf_case(X)`` takes any model type of the installed transformers with a causal-LM, masked-LM,
seq2seq-LM or image-classification auto class (:func:`model_types`), a ``PretrainedConfig`` or a
path to a ``config.json``, and builds the model from a tiny config that keeps the library's
defaults (dropout included: a model trains as users train it) and overrides only sizes, and
``use_cache=False`` (a training step keeps no cache): the 27 names of :data:`ARCHS` by their
hand-written sizes, every other config by the generic rule of :mod:`verify.hf.sizes`. Nothing is
downloaded: weights are the library's random initialisation under the case's seed.

Each family gets its task's loss and batches, tokens only by default (``attention_mask=True``
adds a tokenizer's mask): token cross-entropy for causal and masked LMs (targets random tokens),
the same on the decoder for sequence-to-sequence models (inputs: the encoder's and the decoder's
tokens), class cross-entropy for image classifiers. ``python -m verify report --hf NAME`` and
``check_model(hf_case(NAME), ...)`` run them; the CI matrix is ``tests/parity/test_hf_parity.py``,
every type: ``python -m verify sweep`` (``docs/hf-coverage.md``).
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verify.hf.backoff import fit
from verify.hf.repairs import REPAIRS
from verify.hf.sizes import IMAGE as GENERIC_IMAGE
from verify.hf.sizes import SEQ  # noqa: F401 - verify.hf.SEQ: the batches' sequence length
from verify.hf.sizes import default_dict, num_parameters, shrink_config, shrunk_dict
from verify.model_case import ModelCase

VOCAB = 64
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


# The auto-class tables a model type is looked up in, by task; the first match wins, in the
# order a type is trained: an encoder-decoder as seq2seq (bart also has a decoder-only causal
# head), an encoder as a masked LM (bert, roberta ... also have a causal head that needs
# is_decoder=True), the rest as causal LMs, image classifiers last.
TASK_MAPPINGS: dict[str, str] = {
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}


def _mappings() -> dict[str, dict[str, Any]]:
    _transformers()
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    return {task: getattr(auto, table) for task, table in TASK_MAPPINGS.items()}


def model_types() -> list[str]:
    """Every model type the installed transformers has a causal-LM, masked-LM, seq2seq-LM or
    image-classification auto class for (what ``hf_case`` takes by name), sorted."""
    return sorted({t for table in _mappings().values() for t in table})


def task_of(model_type: str) -> tuple[str, str]:
    """``(task, model class name)`` of ``model_type``: the first auto table (:data:`TASK_MAPPINGS`)
    that has it; ValueError naming the known types."""
    for task, table in _mappings().items():
        if model_type in table:
            cls = table[model_type]
            return task, cls if isinstance(cls, str) else cls[0]  # several heads: the first, the plain one
    raise ValueError(f"unknown Hugging Face model type {model_type!r}: no causal-LM, masked-LM, seq2seq-LM or "
                     f"image-classification auto class in transformers; known: {', '.join(model_types())}")


def _arch(name: str) -> Arch:
    if name not in ARCHS:
        raise ValueError(f"unknown Hugging Face architecture {name!r}; known: {sorted(ARCHS)}")
    return ARCHS[name]


def hf_config(name: str, **overrides: Any):
    """The tiny config of architecture ``name`` (library defaults but sizes), with ``overrides``
    (sizes too: ``hf_config("gpt2", n_embd=256)``). A name of :data:`ARCHS` takes its hand-written
    sizes; any other model type, the generic rule (:func:`verify.hf.sizes.shrink_config`)."""
    if name not in ARCHS:
        return tiny_config(name, **overrides)
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


def _load_config(model):
    """A ``PretrainedConfig`` from a model type name, a config, or a path to a ``config.json``."""
    import json
    from pathlib import Path

    transformers = _transformers()
    if isinstance(model, transformers.PretrainedConfig):
        return model
    text = str(model)
    if text.endswith(".json") or Path(text).is_file():
        d = json.loads(Path(text).read_text())
        if "model_type" not in d:
            raise ValueError(f"{text}: a config.json needs its model_type (the transformers model type it configures)")
        model_type = d.pop("model_type")
        task_of(model_type)
        return transformers.AutoConfig.for_model(model_type, **d)
    task_of(text)  # ValueError naming the known types
    return transformers.AutoConfig.for_model(text)


def tiny_config(model, **overrides: Any):
    """The test-size config of ``model`` (a model type name, a ``PretrainedConfig`` or a path to a
    ``config.json``) by the generic rule of :mod:`verify.hf_sizes`, then ``overrides``; an image
    classifier gets :data:`LABELS` classes."""
    config = _load_config(model)
    task, _ = task_of(config.model_type)
    if task == "image":
        overrides = {"num_labels": LABELS, **overrides}
    return shrink_config(config, **overrides)


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


def _inputs(task: str, attention_mask: bool) -> tuple[str, ...]:
    """The model's keyword inputs: what a training loop passes, tokens only by default; with
    ``attention_mask`` also a tokenizer's mask (all ones: without one, transformers looks for
    packed sequences with a data-dependent branch)."""
    mask = ("attention_mask",) if attention_mask else ()
    return {
        "causal": ("input_ids", *mask),
        "masked": ("input_ids", *mask),
        "seq2seq": ("input_ids", *mask, "decoder_input_ids"),
        "image": ("pixel_values",),
        "image_tokens": ("input_ids", *mask),
        "image_patches": ("pixel_values", "pixel_attention_mask", "spatial_shapes"),
    }[task]


def rows_per_example(model_cls, config) -> int:
    """Rows of ``input_ids`` one example takes: the config's ``num_codebooks`` where the forward's
    docstring gives ``input_ids`` the shape ``(batch_size * num_codebooks, sequence_length)`` (a
    decoder over several streams of audio codes), else 1. With one row per example such a model
    reads 4 rows as one example of 4 codebooks, and a data-parallel slice of 2 rows is no example:
    "shape '[-1, 4, 8]' is invalid for input of size 16" on the rank."""
    doc = getattr(model_cls.forward, "__doc__", None) or ""
    packed = re.search(r"input_ids \(`[^`]*` of shape `\(batch_size \* num_codebooks,", doc)
    return int(getattr(config, "num_codebooks", 1) or 1) if packed else 1


def _batch(task: str, attention_mask: bool, image: tuple[int, int, int] = (3, IMAGE, IMAGE), rows: int = 1):
    """``batch(n)``: the inputs of :func:`_inputs`, then the target (tokens, or a class); token
    inputs and targets have ``rows`` rows per example (:func:`rows_per_example`)."""
    if task == "image":
        return lambda n: (torch.randn(n, *image), torch.randint(0, LABELS, (n,)))
    if task == "image_patches":  # image = (grid side, features per patch): a full side x side grid
        side, features = image[0], image[1]
        return lambda n: (torch.randn(n, side * side, features), torch.ones(n, side * side, dtype=torch.long),
                          torch.full((n, 2), side, dtype=torch.long), torch.randint(0, LABELS, (n,)))
    if task == "image_tokens":
        return lambda n: (_tokens(n), *((_mask(n),) if attention_mask else ()), torch.randint(0, LABELS, (n,)))
    seq2seq = task == "seq2seq"

    def batch(n: int) -> tuple[torch.Tensor, ...]:
        n = n * rows
        tokens = (_tokens(n), *((_mask(n),) if attention_mask else ()), *((_tokens(n),) if seq2seq else ()))
        return (*tokens, _tokens(n))

    return batch


def _image_shape(config) -> tuple[int, int, int]:
    """(channels, height, width) of an image model's ``pixel_values``: the config's (or its vision
    config's) image size and channels, :data:`verify.hf.sizes.IMAGE` where it names none."""
    for c in (config, getattr(config, "vision_config", None), getattr(config, "backbone_config", None)):
        if c is None:
            continue
        size = getattr(c, "image_size", None) or getattr(c, "img_size", None)
        if size is not None:
            h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
            return getattr(c, "num_channels", 3), h, w
    return getattr(config, "num_channels", 3), GENERIC_IMAGE, GENERIC_IMAGE


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


def input_task(task: str, model_cls) -> str:
    """``task``, or ``"image_tokens"`` for an image classifier whose forward takes tokens and no
    pixels (ImageGPT classifies sequences of colour-cluster ids): its inputs are tokens; or
    ``"image_patches"`` for one that takes ``spatial_shapes`` (siglip2's native-resolution pixels
    come cut into patches, a sequence of ``channels * patch**2`` features, with each image's grid)."""
    import inspect

    params = inspect.signature(model_cls.forward).parameters
    if task == "image" and "pixel_values" not in params and "input_ids" in params:
        return "image_tokens"
    if task == "image" and {"pixel_values", "spatial_shapes"} <= set(params):
        return "image_patches"
    return task


PATCH_GRID = 4  # an image of patches: a 4 x 4 grid


def _patch_shape(config) -> tuple[int, int]:
    """(grid side, features per patch: channels x patch size^2) of a patch-sequence image model's
    inputs (:func:`input_task`), from its (or its vision config's) ``num_channels`` and ``patch_size``."""
    c = getattr(config, "vision_config", None) or config
    return PATCH_GRID, getattr(c, "num_channels", 3) * getattr(c, "patch_size") ** 2


def model_config(model_cls, config):
    """The config ``model_cls`` takes: ``config``, or its sub-config of the class the model declares
    (a composite's causal-LM head, ``Llama4ForCausalLM``, is built from the text config)."""
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(config, want):
        return config
    for key in getattr(type(config), "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, want):
            return sub
    return config


def _case(label: str, config, task: str, model_cls_name: str, image, batch_per_rank: int, attention_mask: bool) -> ModelCase:
    model_cls = getattr(_transformers(), model_cls_name)
    config = model_config(model_cls, config)
    task = input_task(task, model_cls)
    if task == "image_patches":
        image = _patch_shape(config)
    loss = class_loss if task.startswith("image") else token_loss
    names = _inputs(task, attention_mask)
    suffix = "+mask" if attention_mask and task != "image" else ""
    return ModelCase(f"hf-{label}{suffix}", lambda: KeywordInputs(model_cls(config), names), loss,
                     _batch(task, attention_mask, image, rows_per_example(model_cls, config)), batch_per_rank=batch_per_rank)


def _probe(case: ModelCase) -> BaseException | None:
    """What stops ``case``'s model from building and training one eager step, or None (the
    global RNG and the warning filters restored after)."""
    import warnings

    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            model = case.build()
            batch = case.batches(2 * case.batch_per_rank, 1)[0]
            case.loss_fn(model(*batch[:-1]), batch[-1]).backward()
    except Exception as e:  # noqa: BLE001 - any failure is the probe's answer
        return e
    return None


def fitted_config(model, *, batch_per_rank: int = 2, attention_mask: bool = False, **overrides: Any):
    """:func:`tiny_config`, or, only where that one fails to build or to train one eager step,
    the back-off's (:func:`verify.hf.backoff.fit`): a few fields kept at the library's default."""
    base = _load_config(model)
    task, model_cls_name = task_of(base.model_type)
    if task == "image":
        overrides = {"num_labels": LABELS, **overrides}
    cls = type(base)

    def case(d):
        config = cls.from_dict(d)
        return _case("probe", config, task, model_cls_name, _image_shape(config), batch_per_rank, attention_mask)

    def probe(d):
        try:
            built = case(d)
        except Exception as e:  # noqa: BLE001 - a config its validators refuse is the probe's answer too
            return e
        return _probe(built)

    def size(d):
        return num_parameters(case(d).build(device="meta"))

    def shrink(keep=frozenset(), first_layers=False, unset_tokens=False, rederive=False, segments=False):
        return shrunk_dict(base, keep, first_layers, unset_tokens, rederive, segments, **overrides)

    repairs = tuple(functools.wraps(r)(functools.partial(r, cls)) for r in REPAIRS)
    d, _ = fit(default_dict(base), shrink, probe, size, label=base.model_type, repairs=repairs)
    return cls.from_dict(d)


def hf_case(model, *, batch_per_rank: int = 2, attention_mask: bool = False, **overrides: Any) -> ModelCase:
    """A ModelCase of a Hugging Face architecture: a name of :data:`ARCHS` (hand-written sizes),
    any other model type of :func:`model_types`, a ``PretrainedConfig`` or a path to a
    ``config.json`` (shrunk by the generic rule of :mod:`verify.hf.sizes`, backed off only where
    that fails: :func:`fitted_config`); config overrides allowed
    (``hf_case("gpt2", resid_pdrop=0.0)``). Inputs are what a training loop passes: the tokens
    (an image model: the pixels); ``attention_mask=True`` adds a tokenizer's all-ones mask."""
    if isinstance(model, str) and model in ARCHS:
        arch = _arch(model)
        return _case(model, hf_config(model, **overrides), arch.task, arch.model, (3, IMAGE, IMAGE), batch_per_rank,
                     attention_mask)
    config = fitted_config(model, batch_per_rank=batch_per_rank, attention_mask=attention_mask, **overrides)
    task, model_cls_name = task_of(config.model_type)
    label = model if isinstance(model, str) and "/" not in model and not model.endswith(".json") else config.model_type
    return _case(label, config, task, model_cls_name, _image_shape(config), batch_per_rank, attention_mask)


__all__ = ["ARCHS", "Arch", "KeywordInputs", "class_loss", "fitted_config", "hf_case", "hf_config", "input_task", "model_config", "model_types", "rows_per_example", "task_of",
           "tiny_config", "token_loss"]
