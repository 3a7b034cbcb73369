"""The shrink's back-off (verify.hf.backoff) on fake configs of our own: a validator tying two
sizes, a forward that fails unless two sizes agree, one that never builds, one fixed only by
keeping the first layers; and that a config that builds is never backed off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from verify.hf.backoff import changed_fields, fit
from verify.hf.sizes import shrink_dict

DEFAULT = {"hidden_size": 256, "embedding_size": 128, "num_hidden_layers": 4, "vocab_size": 1000,
           "layer_types": ["full", "full", "full", "sliding"], "hidden_act": "gelu"}


def shrink(keep=frozenset(), first_layers=False):
    return shrink_dict(DEFAULT, keep=keep, first_layers=first_layers)


def size(d):
    return d["hidden_size"] * d["embedding_size"] + d["vocab_size"] * d["hidden_size"]


class TiedConfig:
    """A config whose validator wants the embedding as wide as the hidden layers."""

    def __init__(self, d):
        if d["embedding_size"] != d["hidden_size"] * 4:
            raise ValueError("embedding_size must be 4 x hidden_size")
        self.d = d


class Mismatched(nn.Module):
    """A model whose forward fails unless its projection's input is the embedding's width."""

    def __init__(self, d):
        super().__init__()
        self.embed = nn.Embedding(d["vocab_size"], d["embedding_size"])
        self.proj = nn.Linear(128, d["hidden_size"])

    def forward(self, x):
        return self.proj(self.embed(x))


def probe_with(build):
    def probe(d):
        try:
            build(d)
        except Exception as e:  # noqa: BLE001
            return e
        return None
    return probe


def test_a_config_that_builds_is_not_backed_off():
    calls = []
    d, what = fit(DEFAULT, shrink, lambda d: calls.append(d), size)
    assert d == shrink() and what == () and len(calls) == 1


def test_a_validator_tying_two_sizes_keeps_the_one_it_needs_at_the_default():
    d, what = fit(DEFAULT, shrink, probe_with(TiedConfig), size)
    assert d["embedding_size"] == 128 and d["hidden_size"] == 32 and what == ("embedding_size kept at its default",)


def test_a_forward_that_needs_two_sizes_to_agree_gets_them_and_stays_small():
    d, what = fit(DEFAULT, shrink, probe_with(lambda d: Mismatched(d)(torch.tensor([1]))), size)
    assert d["embedding_size"] == 128 and d["hidden_size"] == 32 and d["vocab_size"] == 64
    assert "embedding_size kept at its default" in what


def test_the_fields_the_error_names_are_tried_first():
    tried = []

    def probe(d):
        tried.append(tuple(k for k in DEFAULT if d.get(k) == DEFAULT[k] and k != "hidden_act"))
        return None if d["embedding_size"] == 128 else ValueError("mat1 and mat2 shapes cannot be multiplied (1x128 and 16x4)")
    fit(DEFAULT, shrink, probe, size)
    assert tried[1] == ("embedding_size",)  # after the shrunk config itself: 128 is in the message


def test_a_layer_kind_that_breaks_the_model_is_dropped_by_keeping_the_first_layers():
    d, what = fit(DEFAULT, shrink, lambda d: ValueError("sliding") if "sliding" in d["layer_types"] else None, size)
    assert d["layer_types"] == ["full", "full"] and d["num_hidden_layers"] == 2 and what == ("the first layers kept",)


def test_a_model_that_never_builds_raises_its_own_error_after_a_bounded_number_of_tries():
    calls = []
    error = RuntimeError("never builds")

    def probe(d):
        calls.append(d)
        return error
    with pytest.raises(RuntimeError, match="never builds"):
        fit(DEFAULT, shrink, probe, size, max_tries=5)
    assert len(calls) == 1 + 5


def test_a_fix_beyond_the_parameter_budget_is_not_taken():
    probe = probe_with(TiedConfig)
    with pytest.raises(ValueError, match="embedding_size must be"):
        fit(DEFAULT, shrink, probe, size, budget=100)


def test_changed_fields_are_the_shrunk_ones_in_the_configs_order():
    assert changed_fields(DEFAULT, shrink()) == ["hidden_size", "embedding_size", "num_hidden_layers", "vocab_size", "layer_types"]


def _moded(d, **mode):
    """``d`` shrunk in the modes the back-off asks for, recording them."""
    _moded.calls.append(mode)
    out = shrink_dict(d, unset_tokens=mode.get("unset_tokens", False), first_layers=mode.get("first_layers", False))
    if mode.get("rederive"):
        out["attention_hidden_size"] = 2 * out["hidden_size"]  # what a __post_init__ would derive
    return out


def test_a_model_reading_an_unset_token_id_gets_the_token_mode():
    default = dict(DEFAULT, pad_token_id=None)
    _moded.calls = []
    d, what = fit(default, lambda keep=frozenset(), **m: _moded(dict(default, **{k: default[k] for k in keep}), **m),
                  probe_with(lambda d: torch.tensor([1]).ne(d["pad_token_id"])), size)
    assert d["pad_token_id"] == 0 and what == ("the unset token ids set to 0",)


def test_without_unset_token_ids_the_token_mode_is_never_tried():
    _moded.calls = []
    with pytest.raises(ValueError, match="never"):
        fit(DEFAULT, lambda keep=frozenset(), **m: _moded(DEFAULT, **m),
            probe_with(lambda d: (_ for _ in ()).throw(ValueError("never"))), size)
    assert {"unset_tokens": True} not in _moded.calls and {"rederive": True} in _moded.calls


def test_a_width_pinned_by_the_dict_is_derived_anew_by_the_derive_mode():
    default = dict(DEFAULT, attention_hidden_size=512)

    def needs_twice(d):
        if d["attention_hidden_size"] != 2 * d["hidden_size"]:
            raise RuntimeError(f"size {d['attention_hidden_size']} vs {2 * d['hidden_size']}")
    _moded.calls = []
    d, what = fit(default, lambda keep=frozenset(), **m: _moded(default, **m), probe_with(needs_twice), size)
    assert d["attention_hidden_size"] == 2 * d["hidden_size"] == 64 and what == ("the derived fields derived anew",)
