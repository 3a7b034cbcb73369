"""The generic rule that shrinks any transformers config to test size (``verify.hf``'s any-type cases).

A config's sizes are recognised by the name of the field that holds them (``hidden_size``,
``d_model``, ``n_embd`` ... are one family), in the config and, recursively, in its sub-configs
(``text_config``, ``vision_config``, ``audio_config``, ``encoder``/``decoder`` ...): hidden sizes, layers,
heads (key/value heads and head dims too), experts, intermediate sizes, vocabulary, positions,
image and audio sizes. Everything else keeps the library's default (dropout on). What the rule
also has to keep consistent, found by building every type of transformers 5.24:

* token ids (pad, bos, eos, decoder start, a multimodal placeholder ...) must lie inside the shrunk
  vocabulary: an id beyond it is mapped onto 0, 1 or 2 (the batches draw tokens from 3 up, so a
  placeholder id never occurs in them);
* per-layer lists (``layer_types``, ``mlp_only_layers``, per-layer windows ...) as long as the old
  layer count are cut to the new one, and dicts keyed by layer index keep the layers left;
* per-stage lists of vision backbones (``depths``, ``hidden_sizes``, ``num_heads`` per stage) keep
  their length (other fields count stages) and shrink their values;
* the layers kept are the first of each kind a per-layer list of names (``layer_types`` ...) has,
  then the first ones up to :data:`LAYERS`: a hybrid keeps one layer of each kind (a validator may
  want an attention layer beside the recurrent ones, a cache or rope table one of each);
* a layer count that equals the length of a per-stage ``depths`` list counts stages: kept;
* no layer count (unset, or absent from the dict) beside a per-layer list of kinds
  (``layers_block_type``, ``layer_types``): the list's length is the count, cut as any per-layer list;
* a backbone's ``out_features`` name stages that may be gone: reset to the default (the last);
  ``out_indices`` (some configs forbid None) are clamped to the layers left;
* a size the library leaves unset (None) that the model needs (vocabulary, experts per token,
  experts, ``head_dim``, key/value heads) gets its test size;
* group counts (group norms, SSM groups) become 1, which divides any channel count;
* a state-space block's width is ``expand * hidden_size`` (or its ``d_ssm``): its head dim is set
  so that heads * head dim is that width (what the Mamba-2 validators check);
* ``qk_head_dim`` stays the sum of its plain and rotary parts (``qk_nope_head_dim + qk_rope_head_dim``);
* a field whose declared default is ``"auto"`` (derived in ``__post_init__``) is reset to it;
* derived fields are recomputed: the shrunk config is built anew from its ``to_dict()`` with the
  sizes replaced, so ``__post_init__`` runs on the new sizes.
"""

from __future__ import annotations

import re
from typing import Any

VOCAB = 64
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
POSITIONS = 64
IMAGE = 32
PATCH = 4
STAGE_WIDTH = 16  # a vision backbone's first stage; later stages double it
SPECIAL_IDS = 3  # ids 0, 1, 2 are kept for special tokens; batches draw 3 ..

# (pattern over a field's name, the family it belongs to); the first match wins.
_RULES: tuple[tuple[str, str], ...] = (
    (r"(.*_)?vocab_size(_.*)?", "vocab"),
    (r"(.*_)?(token_id|token_ids|token_index)", "token"),
    (r"num_experts_per_tok(en)?|moe_topk|num_selected_experts|top_k|moe_k", "top_k"),
    (r"num_(local_|routed_)?experts|n_routed_experts|moe_num_experts|num_experts_total", "experts"),
    (r"n_group|topk_group|num_expert_groups?|(num|n)_shared_experts", "one"),
    (r"(.*_)?(head_dim|d_head|headdim)|d_kv|kv_channels|attention_head_size|qk_(nope|rope)_head_dim|v_head_dim", "head_dim"),
    (r"(.*_)?lora_rank", "head_dim"),
    (r"rotary_dim|rotary_emb_dim", "rotary"),
    (r"depths?", "depths"),
    (r"(.*_)?(num_)?(hidden_|encoder_|decoder_|text_|vision_)?layers|n_layers?|num_(decoder|encoder)_layers", "layers"),
    (r"(.*_)?(attention_heads|num_heads|n_heads?|key_value_heads|kv_heads)|(num|n)_[a-z]+_heads", "heads"),
    (r"(.*_)?(num_groups|n_groups|ngroups)", "one"),
    (r"(.*_)?d_ssm", "ffn"),
    (r"hidden_sizes|embed_dims|dims|widths|embedding_sizes|channels_list", "widths"),
    (r"(.*_)?(intermediate_size|ffn_dim|d_ff|hidden_dim|mlp_dim|inner_dim|n_inner|ffn_hidden_size)", "ffn"),
    (r"(.*_)?(hidden_size|d_model|n_embd|embed_dim|embedding_size|embedding_dim|word_embed_proj_dim|projection_dim|dim|d_embed|width)|(.*_)?hidden_size(_.*)?", "hidden"),
    (r"(.*_)?(max_position_embeddings|n_positions|max_seq_len|max_sequence_length|n_ctx)", "positions"),
    (r"image_size|img_size", "image"),
    (r"patch_size", "patch"),
    (r"out_features", "stages"),
    (r"out_indices", "stage_indices"),
    (r"num_mel_bins|feature_size", "none"),  # audio inputs: sized by the batch, left at the default
)
_COMPILED = tuple((re.compile(pattern), family) for pattern, family in _RULES)
# A per-layer list of layer kinds, which counts the layers where no count field does.
_LAYER_KINDS = re.compile(r"(.*_)?layers?_(block_)?types?")


def family(key: str) -> str | None:
    """The size family of the config field ``key`` (``"hidden"``, ``"layers"`` ...), or None."""
    for pattern, fam in _COMPILED:
        if pattern.fullmatch(key):
            return fam
    return None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _token(v: Any, vocab: int) -> Any:
    if _int(v):
        return v % SPECIAL_IDS if v >= vocab else v
    if isinstance(v, list) and all(_int(x) for x in v):
        return [x % SPECIAL_IDS if x >= vocab else x for x in v]
    return v


def _layer_index(key: Any) -> int | None:
    if _int(key):
        return key
    return int(key) if isinstance(key, str) and key.isdigit() else None


def _scalar(fam: str, v: Any) -> Any:
    """The shrunk value of an int field of family ``fam`` (never above the default)."""
    new = {"vocab": VOCAB, "top_k": EXPERTS_PER_TOKEN, "experts": EXPERTS, "one": 1, "head_dim": HEAD_DIM,
           "rotary": HEAD_DIM // 2, "layers": LAYERS, "depths": LAYERS, "heads": HEADS, "ffn": FFN, "hidden": HIDDEN,
           "positions": POSITIONS, "image": IMAGE, "patch": PATCH}.get(fam)
    return v if new is None or v <= 0 else min(v, new)


def _list(fam: str, v: list) -> list:
    """The shrunk value of a per-stage list: its length kept, its values shrunk."""
    if fam == "depths":
        return [min(x, 1) for x in v]
    if fam in ("widths", "hidden"):
        return [min(x, STAGE_WIDTH * 2**i) for i, x in enumerate(v)]
    if fam == "ffn":
        return [min(x, 2 * STAGE_WIDTH * 2**i) for i, x in enumerate(v)]
    if fam == "heads":
        return [min(x, HEADS) for x in v]
    if fam in ("image", "patch"):
        return [_scalar(fam, x) for x in v]
    return v


# Sizes the library may leave unset (None) that a model needs: these get their test size.
_UNSET = {"vocab", "top_k", "experts", "one"}
_UNSET_KEYS = {"head_dim", "num_key_value_heads"}


def kept_layers(d: dict[str, Any], count: int, first_layers: bool = False) -> list[int]:
    """The layers kept of ``count``: the first layer of each kind that ``d``'s per-layer lists of
    names (``layer_types`` ...; lists of strings ``count`` long) tell apart, then the first
    ones, up to :data:`LAYERS` in all unless there are more kinds; ``first_layers``: the first
    :data:`LAYERS` only (the back-off's other mode, :mod:`verify.hf.backoff`)."""
    lists = [] if first_layers else [
        v for v in d.values() if isinstance(v, list) and len(v) == count and all(isinstance(x, str) for x in v)]
    first: dict[tuple, int] = {}
    for i in range(count):
        first.setdefault(tuple(v[i] for v in lists), i)
    kept = set(first.values())
    for i in range(count):  # top up with the first layers not kept yet
        if len(kept) >= LAYERS:
            break
        kept.add(i)
    return sorted(kept)


def _ssm(out: dict[str, Any]) -> None:
    """A state-space block's head dim, so that heads * head dim = its width (``d_ssm``, else
    ``expand * hidden_size``), in place; a config without an ``expand`` field is left alone."""
    expand = next((out[k] for k in ("mamba_expand", "expand") if _int(out.get(k))), None)
    if expand is None or not _int(out.get("hidden_size")):
        return
    ssm = [k for k in out if "mamba" in k or "ssm" in k]
    width = next((out[k] for k in ssm if family(k) == "ffn" and _int(out[k])), expand * out["hidden_size"])
    heads = next((k for k in ssm if family(k) == "heads" and _int(out[k])), "num_heads")
    head_dim = next((k for k in ssm if family(k) == "head_dim"), "head_dim")
    if _int(out.get(heads)) and _int(out.get(head_dim)) and width % out[heads] == 0:
        out[head_dim] = width // out[heads]


def shrink_dict(d: dict[str, Any], is_sub_config=lambda key, value: False, keep: frozenset[str] = frozenset(),
                first_layers: bool = False) -> dict[str, Any]:
    """``d`` (a config's ``to_dict()``) with every size replaced by its test size; nested
    configs (dicts that carry a ``model_type``, or keys ``is_sub_config`` names) shrunk too.
    The fields of ``keep`` stay at their value in ``d``; ``first_layers``: see :func:`kept_layers`."""
    out = dict(d)
    stage_counts = {len(v) for k, v in d.items() if family(k) == "depths" and isinstance(v, list)}
    layers_before = {v for k, v in d.items() if family(k) == "layers" and _int(v) and v > LAYERS and k not in keep} - stage_counts
    if not layers_before and not any(family(k) == "layers" and k in keep for k in d):
        # no layer count (unset or left out of the dict) where a per-layer list of names is the count
        # (nemotron_h: num_hidden_layers is deprecated, its layers_block_type's length counts): that length
        layers_before = {len(v) for k, v in d.items() if _LAYER_KINDS.fullmatch(k) and isinstance(v, list)
                         and len(v) > LAYERS and all(isinstance(x, str) for x in v)} - stage_counts
    kept = {n: kept_layers(d, n, first_layers) for n in layers_before}
    for key, value in d.items():
        fam = family(key)
        if key in keep:
            continue
        if fam == "stages" and value is not None and layers_before:
            out[key] = None  # a backbone's output stages name stages that may be gone: its default, the last
        elif fam == "stage_indices" and isinstance(value, list) and layers_before:
            last = min(len(k) for k in kept.values())
            out[key] = sorted({min(i, last) for i in value if _int(i)})  # clamped to the layers left
        elif isinstance(value, dict) and ("model_type" in value or is_sub_config(key, value)):
            out[key] = shrink_dict(value, first_layers=first_layers)
        elif isinstance(value, dict) and layers_before and value and all(_layer_index(k) is not None for k in value):
            keep = min(kept.values(), key=len)  # keyed by layer: those kept, renumbered
            out[key] = {type(k)(keep.index(_layer_index(k))).zfill(len(k)) if isinstance(k, str) else keep.index(k):
                        shrink_dict(v) if isinstance(v, dict) else v  # a layer's own sizes shrink too
                        for k, v in value.items() if _layer_index(k) in keep}
        elif fam == "token":
            out[key] = _token(value, VOCAB)
        elif fam == "layers" and _int(value) and value in kept:
            out[key] = len(kept[value])
        elif fam == "layers" and _int(value) and value in stage_counts:
            pass  # counts the stages of the depths list: kept
        elif fam is not None and _int(value):
            out[key] = _scalar(fam, value)
        elif fam is not None and isinstance(value, list) and value and all(_int(x) for x in value):
            out[key] = _list(fam, value)
        elif value is None and (fam in _UNSET or key in _UNSET_KEYS):
            out[key] = _scalar(fam, 1 << 30)  # unset in the library's default: the test size
        if isinstance(out[key], (list, tuple)) and len(out[key]) in kept and fam not in ("widths", "depths"):
            out[key] = type(out[key])(out[key][i] for i in kept[len(out[key])])  # one entry per layer: those kept
    _ssm(out)
    if all(_int(out.get(k)) for k in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # the sum of its parts, as the default
    if "use_cache" in out:
        out["use_cache"] = False  # a training step keeps no cache
    return out


def _auto_fields(cls) -> dict[str, Any]:
    """Fields of config class ``cls`` declared ``"auto"`` (derived from the sizes in ``__post_init__``)."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return {}
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default == "auto"}


def default_dict(config) -> dict[str, Any]:
    """``config.to_dict()`` with the fields declared ``"auto"`` reset to it: what the rule shrinks."""
    return {**config.to_dict(), **_auto_fields(type(config))}


def shrunk_dict(config, keep: frozenset[str] = frozenset(), first_layers: bool = False, **overrides: Any) -> dict[str, Any]:
    """The dict :func:`shrink_config` builds its config from."""
    cls = type(config)
    subs = set(getattr(cls, "sub_configs", {}) or {})
    d = shrink_dict(default_dict(config), lambda key, value: key in subs, keep, first_layers)
    d.update({k: getattr(config, k) for k in KEEP.get(getattr(config, "model_type", ""), ())})
    d.update(overrides)
    return d


def shrink_config(config, keep: frozenset[str] = frozenset(), first_layers: bool = False, **overrides: Any):
    """A new config of ``config``'s class with the test sizes (:func:`shrink_dict`; ``keep`` and
    ``first_layers`` as there), then ``overrides`` (top-level fields), built from its dict so
    derived fields follow the sizes."""
    return type(config).from_dict(shrunk_dict(config, keep, first_layers, **overrides))


# Fields a model type keeps at the library's default, where the generic rule cannot work.
KEEP: dict[str, tuple[str, ...]] = {
    # modeling_cvt indexes a stage's drop-path rates (one per block) by the stage's number
    # (drop_path_rates[self.stage]): stage i needs more than i blocks, which the default depths
    # [1, 2, 10] give and any uniform shrink of them does not.
    "cvt": ("depth",),
}


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["KEEP", "VOCAB", "default_dict", "family", "num_parameters", "shrink_config", "shrink_dict", "shrunk_dict"]
