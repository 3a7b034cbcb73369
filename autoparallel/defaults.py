"""Defaults and names that command lines show before anything loads, in one torch-free module.

``python -m verify`` builds every subcommand's parser (flag choices, defaults, help) without
importing torch, so these live here rather than beside the code that uses them
(``passes.pre_overlap_bucketing.PreOverlapConfig``, ``parallelize.plan.ParallelPlan.preset``).
"""

BUCKET_CAP_MB = 25.0  # pre-overlap bucketing: the byte cap of one bucket, in MB

FSDP, FSDP_TP, DDP, AUTO = "fsdp", "fsdp_tp", "ddp", "auto"  # ParallelPlan.preset names
HAND_PLANS = (FSDP, FSDP_TP, DDP)
PLANS = (*HAND_PLANS, AUTO)  # AUTO: the ILP planner places everything
LOWERINGS = ("dtensor", "replay")  # PipelineOptions.lowering: how the joint stage lowers a plan="auto" plan
# The default lowering: "replay" (every planned parity cell bitwise through it, docs/lean-planned.md);
# "dtensor" (every op through DTensor's dispatch) stays selectable as the reference it is tested against.
DEFAULT_LOWERING = "replay"
