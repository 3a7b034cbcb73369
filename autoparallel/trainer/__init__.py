"""Graph trainer: one make_fx graph per training step (forward, loss, backward), phase tags,
graph SAC + remat, and no-grad execution. See docs/design.md, "The graph trainer"."""

from autoparallel.trainer.execute import accumulate_grads, run_traced
from autoparallel.trainer.regions import annotate_ac_regions, clear_ac_regions, region_of
from autoparallel.trainer.sac import (
    SAC_POLICIES,
    apply_sac_pass,
    graph_sac,
    live_recomputable_values,
    recompute_summary,
    remat_pass,
    sac_stages,
)
from autoparallel.trainer.trace import (
    LOSS_ROLE,
    TracedStep,
    copy_forward_meta_to_backward,
    is_backward_node,
    is_forward_node,
    trace_train_step,
)

__all__ = [
    "LOSS_ROLE",
    "SAC_POLICIES",
    "TracedStep",
    "accumulate_grads",
    "annotate_ac_regions",
    "apply_sac_pass",
    "clear_ac_regions",
    "copy_forward_meta_to_backward",
    "graph_sac",
    "is_backward_node",
    "is_forward_node",
    "live_recomputable_values",
    "recompute_summary",
    "region_of",
    "remat_pass",
    "run_traced",
    "sac_stages",
    "trace_train_step",
]
