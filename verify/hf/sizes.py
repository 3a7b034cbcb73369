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
  their length (other fields count stages) and shrink their values, by rank (stages equal at the
  default stay equal); per-stage lists of per-block entries are cut to the new depths; channel
  fields no family names (``stage_out_channels`` ...) follow the widths they equal at the default;
* a ``default_<x>`` left None beside a list ``<x>s`` of choices takes the first (xmod's language);
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
* a field whose declared default is ``"auto"`` (derived in ``__post_init__``) is reset to it, and an
  integer field declared None that no family names (derived too: xlstm's ``num_blocks`` from
  ``num_hidden_layers``) is reset to None;
* derived fields are recomputed: the shrunk config is built anew from its ``to_dict()`` with the
  sizes replaced, so ``__post_init__`` runs on the new sizes;
* sizes tied to each other across a layer's overrides, and rope parameters the default leaves
  empty: :mod:`verify.hf.ties`; a config the library's default cannot run: :data:`OVERRIDES`.
"""

from __future__ import annotations

import re
from typing import Any

from verify.hf.ties import fill_empty_rope, last_segments, layer_override_sums, segment_marks

VOCAB = 64
HIDDEN = 32
FFN = 64
LAYERS = 2
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
POSITIONS = 64
SEQ = 8  # the batches' sequence length (verify.hf)
IMAGE = 32
PATCH = 4
STAGE_WIDTH = 16  # a vision backbone's first stage; later stages double it
SPECIAL_IDS = 3  # ids 0, 1, 2 are kept for special tokens; batches draw 3 ..

# (pattern over a field's name, the family it belongs to); the first match wins.
_RULES: tuple[tuple[str, str], ...] = (
    # a hashed n-gram vocabulary (blt's encoder_hash_byte_group_vocab, 500002 rows per hash)
    # is named without "_size": 96M parameters in the "tiny" model until it matched
    (r"(.*_)?vocab(_size(_.*)?)?", "vocab"),
    (r"(.*_)?(token_id|token_ids|token_index)", "token"),
    (r"num_experts_per_tok(en)?|moe_topk|num_selected_experts|top_k|moe_k", "top_k"),
    (r"num_(local_|routed_)?experts|n_routed_experts|moe_num_experts|num_experts_total", "experts"),
    (r"n_group|topk_group|num_expert_groups?|(num|n)_shared_experts", "one"),
    (r"(.*_)?(head_dim|d_head|headdim)|d_kv|kv_channels|attention_head_size|qk_(nope|rope)_head_dim|v_head_dim", "head_dim"),
    (r"(.*_)?lora_rank", "head_dim"),
    (r"rotary_dim|rotary_emb_dim", "rotary"),
    (r"depths?", "depths"),
    (r"(.*_)?(num_)?(hidden_|encoder_|decoder_|text_|vision_)?layers|n_layers?|num_(decoder|encoder)_layers", "layers"),
    (r"num_self_attends_per_block", "layers"),  # perceiver: the latent self-attention layers
    (r"(.*_)?(attention_heads|num_heads|n_heads?|key_value_heads|kv_heads)|(num|n)_[a-z]+_heads", "heads"),
    (r"(.*_)?(num_groups|n_groups|ngroups)", "one"),
    (r"(.*_)?d_ssm", "ffn"),
    (r"hidden_sizes|embed_dims|dims|widths|embedding_sizes|channels_list", "widths"),
    (r"(.*_)?(intermediate_size|ffn_dim|d_ff|hidden_dim|mlp_dim|inner_dim|n_inner|ffn_hidden_size)", "ffn"),
    (r"(.*_)?(hidden_size|d_model|n_embd|embed_dim|embedding_size|embedding_dim|word_embed_proj_dim|projection_dim|dim|d_embed|width|d_latents)|(.*_)?hidden_size(_.*)?", "hidden"),
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
    if fam in ("widths", "hidden", "ffn"):  # by rank of value: stages equal at the default stay equal
        ranks = sorted(set(v))
        base = 2 * STAGE_WIDTH if fam == "ffn" else STAGE_WIDTH
        return [min(x, base * 2 ** ranks.index(x)) for x in v]
    if fam == "heads":
        return [min(x, HEADS) for x in v]
    if fam in ("image", "patch"):
        return [_scalar(fam, x) for x in v]
    return v


# Sizes the library may leave unset (None) that a model needs: these get their test size.
_UNSET = {"vocab", "top_k", "experts", "one"}
_UNSET_KEYS = {"head_dim", "num_key_value_heads"}
# Dicts keyed by an int that is a class label, not a layer index: never cut to the layers kept.
_LABEL_MAPS = {"id2label", "label2id"}


def kept_layers(d: dict[str, Any], count: int, first_layers: bool = False, marks: tuple[list, ...] = ()) -> list[int]:
    """The layers kept of ``count``: the first layer of each kind that ``d``'s per-layer lists of
    names (``layer_types`` ...; lists of strings ``count`` long) tell apart, then the first
    ones, up to :data:`LAYERS` in all unless there are more kinds; ``first_layers``: the first
    :data:`LAYERS` only (the back-off's other mode, :mod:`verify.hf.backoff`); ``marks``: more
    per-layer lists that tell kinds apart (:func:`verify.hf.ties.last_segments`)."""
    lists = [] if first_layers else [
        v for v in d.values() if isinstance(v, list) and len(v) == count and all(isinstance(x, str) for x in v)]
    lists += list(marks)
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


def _channels(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Channel fields the rule has no family for (``stem_out_channels``, ``stage_in_channels`` ...)
    follow the widths it shrank, in place: an entry equal at the default to a width (``hidden_sizes``,
    ``embed_dim`` ...) of 16 or more takes that width's new value, so a stage's input stays the
    previous stage's output; a default value shrunk to two different values is left alone."""
    new: dict[int, set[int]] = {}
    for key, value in d.items():
        if family(key) in ("widths", "hidden"):
            pairs = [(value, out[key])] if _int(value) else zip(value, out[key]) if isinstance(value, list) else []
            for old, now in pairs:
                if _int(old) and _int(now) and old >= 16:
                    new.setdefault(old, set()).add(now)
    remap = {old: now.pop() for old, now in new.items() if len(now) == 1}
    for key, value in d.items():
        if family(key) is None and _CHANNELS.fullmatch(key):
            if _int(value):
                out[key] = remap.get(value, value)
            elif isinstance(value, list) and all(_int(x) for x in value):
                out[key] = [remap.get(x, x) for x in value]


_CHANNELS = re.compile(r"(.*_)?(out_|in_|mid_|hidden_)?channels")


def _per_block(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Per-stage lists of per-block entries (textnet's ``conv_layer_kernel_sizes``: one list per
    stage, as long as that stage's depth) are cut to the shrunk depths, in place: the model builds
    one block per entry, whatever ``depths`` says. The first blocks stay (a stage's first one
    downsamples)."""
    for dk, dv in d.items():
        new = out.get(dk)
        if family(dk) != "depths" or not isinstance(dv, list) or not isinstance(new, list) or not all(_int(n) for n in dv):
            continue
        for key, value in d.items():
            if (key != dk and isinstance(value, list) and len(value) == len(dv)
                    and all(isinstance(x, list) and len(x) == n for x, n in zip(value, dv))):
                out[key] = [x[:m] for x, m in zip(value, new)]


def _default_choice(d: dict[str, Any], out: dict[str, Any]) -> None:
    """A ``default_<x>`` the library leaves None beside a list ``<x>s`` of choices gets the first
    choice, in place: xmod's forward refuses to run without a default language
    (``default_language``) when the inputs name none, and a training loop passes tokens only."""
    for key, value in d.items():
        choices = d.get(key.removeprefix("default_") + "s")
        if value is None and key.startswith("default_") and isinstance(choices, list) and choices:
            out[key] = choices[0]


def shrink_dict(d: dict[str, Any], is_sub_config=lambda key, value: False, keep: frozenset[str] = frozenset(),
                first_layers: bool = False, unset_tokens: bool = False, segments: bool = False) -> dict[str, Any]:
    """``d`` (a config's ``to_dict()``) with every size replaced by its test size; nested
    configs (dicts that carry a ``model_type``, or keys ``is_sub_config`` names) shrunk too.
    The fields of ``keep`` stay at their value in ``d``; ``first_layers``: see :func:`kept_layers`;
    ``unset_tokens``: token ids the library leaves None become 0 (the back-off's token mode);
    ``segments`` (a back-off mode): counts of the last layers keep a layer of each kind on both
    sides of their boundary (:func:`verify.hf.ties.last_segments`)."""
    out = dict(d)
    stage_counts = {len(v) for k, v in d.items() if family(k) == "depths" and isinstance(v, list)}
    counts = {v for k, v in d.items() if family(k) == "layers" and _int(v) and v > LAYERS} - stage_counts  # kept ones too
    layers_before = {v for k, v in d.items() if family(k) == "layers" and _int(v) and v > LAYERS and k not in keep} - stage_counts
    if not layers_before and not any(family(k) == "layers" and k in keep for k in d):
        # no layer count (unset or left out of the dict) where a per-layer list of names is the count
        # (nemotron_h: num_hidden_layers is deprecated, its layers_block_type's length counts): that length
        layers_before = {len(v) for k, v in d.items() if _LAYER_KINDS.fullmatch(k) and isinstance(v, list)
                         and len(v) > LAYERS and all(isinstance(x, str) for x in v)} - stage_counts
    subs = last_segments(d, layers_before, keep, family) if segments else {}
    kept = {n: kept_layers(d, n, first_layers, tuple(segment_marks(n, subs))) for n in layers_before}
    layer_maps: dict[str, dict[Any, Any]] = {}  # a layer-keyed dict: {its new layer key: the old one}
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
            out[key] = shrink_dict(value, first_layers=first_layers, unset_tokens=unset_tokens, segments=segments)
        elif (isinstance(value, dict) and layers_before and value and key not in _LABEL_MAPS
              and all(_layer_index(k) is not None for k in value)):
            layers = min(kept.values(), key=len)  # keyed by layer: those kept, renumbered
            layer_maps[key] = {type(k)(layers.index(_layer_index(k))).zfill(len(k)) if isinstance(k, str)
                               else layers.index(k): k for k in value if _layer_index(k) in layers}
            out[key] = {new: shrink_dict(value[k]) if isinstance(value[k], dict) else value[k]  # a layer's own sizes too
                        for new, k in layer_maps[key].items()}
        elif fam == "token" and value is None and unset_tokens:
            out[key] = 0  # an id the batches never draw (they draw from SPECIAL_IDS up)
        elif fam == "token":
            out[key] = _token(value, VOCAB)
        elif key in subs:  # the last k of n layers: as many as are kept there
            out[key] = sum(i >= subs[key][0] - subs[key][1] for i in kept[subs[key][0]])
        elif fam == "layers" and _int(value) and value in kept:
            out[key] = len(kept[value])
        elif fam == "layers" and _int(value) and value in stage_counts:
            pass  # counts the stages of the depths list: kept
        elif fam is not None and _int(value):
            out[key] = _scalar(fam, value)
        elif fam is not None and isinstance(value, list) and value and all(_int(x) for x in value):
            per_layer = len(value) in counts and fam not in ("widths", "depths", "layers")  # a size per layer, not per stage
            out[key] = [_scalar(fam, x) for x in value] if per_layer else _list(fam, value)
        elif value is None and (fam in _UNSET or key in _UNSET_KEYS):
            out[key] = _scalar(fam, 1 << 30)  # unset in the library's default: the test size
        if isinstance(out[key], (list, tuple)) and len(out[key]) in kept and fam not in ("widths", "depths"):
            out[key] = type(out[key])(out[key][i] for i in kept[len(out[key])])  # one entry per layer: those kept
    _channels({k: v for k, v in d.items() if k not in keep}, out)
    _per_block({k: v for k, v in d.items() if k not in keep}, out)
    _default_choice(d, out)
    _ssm(out)
    layer_override_sums(d, out, layer_maps, family)
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


def _class_default(cls) -> dict[str, Any] | None:
    """``cls().to_dict()``, or None for a class without a buildable default (it derives nothing we know of)."""
    try:
        return cls().to_dict()
    except Exception:  # noqa: BLE001 - any failure of the library's own default
        return None


def _derived_counts(cls) -> dict[str, int]:
    """The integer fields ``cls`` declares None and the rule does not size, with the values a
    default ``cls()`` derives for them in ``__post_init__``."""
    import dataclasses

    default = _class_default(cls)
    if default is None:
        return {}
    return {f.name: default[f.name] for f in dataclasses.fields(cls)
            if f.default is None and family(f.name) is None
            and isinstance(default.get(f.name), int) and not isinstance(default.get(f.name), bool)}


def _reset_derived_counts(cls, d: dict[str, Any]) -> None:
    """Reset to None, in place, the counts of :func:`_derived_counts` that ``d`` (and its
    sub-configs) holds at their derived default: ``__post_init__`` derived them from the default
    sizes (xlstm's ``num_blocks`` is ``num_hidden_layers``, vit's ``pooler_output_size`` is
    ``hidden_size``); passed back as numbers they would keep the default's size. A value set to
    something else (a user's config) is kept."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return
    for key, value in _derived_counts(cls).items():
        if d.get(key) == value:
            d[key] = None
    for key, sub in (getattr(cls, "sub_configs", {}) or {}).items():
        if isinstance(d.get(key), dict):
            _reset_derived_counts(sub, d[key])


def default_dict(config) -> dict[str, Any]:
    """``config.to_dict()`` with the fields declared ``"auto"`` reset to it, and the counts derived
    from a field declared None reset to None (:func:`_reset_derived_counts`): what the rule shrinks."""
    d = {**config.to_dict(), **_auto_fields(type(config))}
    _reset_derived_counts(type(config), d)
    return d


def derived_fields(cls) -> frozenset[str]:
    """Attributes a default ``cls()`` has that are no declared field of ``cls`` (nor of the base
    config): set in ``__post_init__`` from the sizes (zamba2's ``attention_hidden_size = 2 *
    hidden_size``). Passed back to ``from_dict`` they would override what it derives."""
    import dataclasses

    from transformers import PretrainedConfig

    if not (isinstance(cls, type) and issubclass(cls, PretrainedConfig) and dataclasses.is_dataclass(cls)):
        return frozenset()
    default = _class_default(cls)
    if default is None:
        return frozenset()
    keys = set(default) - set(PretrainedConfig().to_dict())
    return frozenset(keys - {f.name for f in dataclasses.fields(cls)})


def _drop_derived(cls, d: dict[str, Any], keep: frozenset[str]) -> None:
    """``d`` without ``cls``'s derived fields (:func:`derived_fields`), nor those of its
    sub-configs of known class, in place: ``from_dict`` derives them anew from the shrunk sizes."""
    for key in derived_fields(cls) - keep:
        d.pop(key, None)
    for key, sub in (getattr(cls, "sub_configs", {}) or {}).items():
        if isinstance(d.get(key), dict):
            _drop_derived(sub, d[key], frozenset())


def shrunk_dict(config, keep: frozenset[str] = frozenset(), first_layers: bool = False, unset_tokens: bool = False,
                rederive: bool = False, segments: bool = False, **overrides: Any) -> dict[str, Any]:
    """The dict :func:`shrink_config` builds its config from; ``rederive`` (the back-off's derive
    mode): without the derived fields (:func:`derived_fields`), which the config derives anew."""
    cls = type(config)
    subs = set(getattr(cls, "sub_configs", {}) or {})
    d = shrink_dict(default_dict(config), lambda key, value: key in subs, keep, first_layers, unset_tokens, segments)
    if rederive:
        _drop_derived(cls, d, keep)
    fill_empty_rope(d, cls)
    model_type = getattr(config, "model_type", "")
    d.update({k: getattr(config, k) for k in KEEP.get(model_type, ())})
    for key, value in OVERRIDES.get(model_type, {}).items():  # a sub-config's fields merge into it
        d[key] = {**d[key], **value} if isinstance(value, dict) and isinstance(d.get(key), dict) else value
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

# Fields a model type sets where the library's default cannot build at all (any size), set where
# no generic rule can know the value.
OVERRIDES: dict[str, dict[str, Any]] = {
    # Lfm2MoeConfig leaves layer_types None (unlike lfm2, it derives none), and every decoder layer
    # indexes config.layer_types[layer_idx]: the library's default config builds no model. One layer
    # of each kind the model knows ("conv", else attention), as the rule keeps for hybrids.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # modeling_efficientnet hard-codes the top conv's width, round_filters(config, 1280) (1280 x
    # width_coefficient), while the BatchNorm after it and the classifier take config.hidden_dim:
    # hidden_dim must be 1280 x width_coefficient, a constant of the code no rule can see. The
    # default (B7: widths x 2.0, depths x 3.1, 64 M parameters) with B0's coefficients (1.0):
    # 4.0 M parameters at 4 labels.
    "efficientnet": {"width_coefficient": 1.0, "depth_coefficient": 1.0, "hidden_dim": 1280},
    # modeling_dbrx clamps the fused qkv with attn_config.clip_qkv, None by default:
    # torch.clamp(min=None, max=None) raises. 8.0 is the value of the released dbrx configs.
    # A dict value merges into the sub-config of that name.
    "dbrx": {"attn_config": {"clip_qkv": 8.0}},
}


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["KEEP", "OVERRIDES", "VOCAB", "default_dict", "derived_fields", "family", "num_parameters", "shrink_config", "shrink_dict", "shrunk_dict"]
