"""Goldens diff locally: one op inserted into one layer's forward changes at most 10 golden lines.

The model is traced twice, once with the op added by a model subclass, and the two golden texts
(header, stats table, canonical graph) are compared line by line. Before names were scoped by
module (verify.graphs.canon, "Names"), every node after the insertion that shared the new node's op was
renumbered, and so was every line reading one of them (71 changed lines in a 331-line graph).
The baseline is the golden scenario's own pipeline run, shared with the golden tests' worker.
"""

from __future__ import annotations

import difflib

import pytest
import torch.nn.functional as F

from autoparallel.mesh import fake_world
from autoparallel.models.llama3 import FeedForward, TransformerBlock
from autoparallel.parallelize import build_joint_graph
from autoparallel.partition import apply_placement
from autoparallel.pipeline import StageResult
from verify.goldens.catalog import ALL_SCENARIOS, golden_run, stage_text

SID = "tiny-fsdp-dp8"
pytestmark = pytest.mark.xdist_group(SID)  # the golden tests' worker has the baseline run
MAX_CHANGED = 10


class _ScaledAttentionBlock(TransformerBlock):
    """``h = x + 0.5 * attn(norm(x))``: a residual-branch scale, one op in the layer's forward."""

    def _forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin) * 0.5
        return h + self.feed_forward(self.ffn_norm(h))


class _DoubledGateFeedForward(FeedForward):
    """``w2(silu(w1 x) * 2 * w3 x)``: the op lands between two ops of its module (the mul after
    it is renumbered, forward and backward)."""

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * 2.0 * self.w3(x))


def changed_lines(old: str, new: str) -> int:
    """Lines changed between two texts: inserted + deleted, a replaced run counting its longer side."""
    n = 0
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            n += max(i2 - i1, j2 - j1)
    return n


def _golden_texts_with(edit, *, partition: bool) -> dict[str, str]:
    """Golden texts of the joint graph (and the first partition) of the edited model."""
    sc = ALL_SCENARIOS[SID]
    model = sc.model(device="meta")
    edit(model)
    with fake_world(sc.mesh_spec) as mesh:
        jg = build_joint_graph(model, sc.plan_obj(), mesh, sc.example_inputs())
        texts = {"joint": stage_text(SID, StageResult("joint", jg.gm, 0.0))}  # before apply_placement rewrites it
        if partition:
            fp = apply_placement(jg).first_partition  # closes the trace
            texts["first_partition"] = stage_text(SID, StageResult("first_partition", (fp.fw, fp.bw), 0.0))
        else:
            jg.close()
    return texts


def _scale_attention(model):
    model.layers[1].__class__ = _ScaledAttentionBlock


def _double_gate(model):
    model.layers[1].feed_forward.__class__ = _DoubledGateFeedForward


@pytest.mark.parametrize(
    "edit, partition",
    [pytest.param(_scale_attention, True, id="block-residual-scale"), pytest.param(_double_gate, False, id="ffn-mid-op")],
)
def test_one_inserted_op_changes_at_most_ten_golden_lines(edit, partition, shared_pipeline_runs):
    base = golden_run(SID)
    for name, new in _golden_texts_with(edit, partition=partition).items():
        old = stage_text(SID, base.stage(name))
        assert new != old, f"{name}: the inserted op must show"
        diff = "\n".join(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
        assert 0 < changed_lines(old, new) <= MAX_CHANGED, f"{name}: {changed_lines(old, new)} lines changed\n{diff}"


def test_changed_lines_counts_a_replaced_line_once():
    assert changed_lines("a\nb\nc", "a\nB\nc") == 1
    assert changed_lines("a\nb\nc", "a\nx\nb\nc") == 1
    assert changed_lines("a\nb\nc", "a\nc") == 1
    assert changed_lines("a\nb\nc", "a\nB\nx\nc") == 2
