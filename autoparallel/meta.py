"""Every ``node.meta`` / ``gm.meta`` key the stack reads or writes, in one place.

Passes communicate through node metadata (recompute tags, saved-tensor records, phases, bucket
tags). Spelling a key twice is how a tag silently stops reaching its reader, so no other module
writes a key as a string literal: import it from here.
"""

# --- keys PyTorch itself reads/writes -------------------------------------------------------
VAL = "val"  # FakeTensor (or tuple of them) describing the node's output
RECOMPUTE = "recompute"  # torch.utils.checkpoint.CheckpointPolicy
AC_GRAPH_ID = "ac_graph_id"  # int region id; PyTorch compares these with ``>``
CUSTOM = "custom"  # free-form dict written by torch.fx.traceback.annotate / preserved by re-traces
DESC = "desc"  # AOT descriptor on joint-graph placeholders/outputs
PARTITIONER_TAG = "partitioner_tag"  # "is_forward" / "is_backward" on AOT joint graphs
PARTITIONER_TAG_BACKWARD = "is_backward"  # the node was traced in the backward
SEQ_NR = "seq_nr"
NN_MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"
AUTOGRAD_BACKWARD = "autograd_backward"
FROM_NODE = "from_node"  # list[torch.fx.traceback.NodeSource]: provenance history (Inductor, tlparse)
GRAPHARG = "grapharg"  # Dynamo GraphArg (with .source) on the placeholders of a Dynamo graph

# --- keys inside node.meta["custom"] (they survive preserve_node_meta re-traces) -----------
AP_MUST_SAVE = "ap_must_save"  # bool: the first partition saved this node for backward
AP_MUST_SAVE_GETITEM_INDICES = "ap_must_save_getitem_indices"  # list[int] for multi-output ops
PHASE = "phase"  # "forward" / "backward" (graph trainer)
PHASE_BACKWARD = "backward"
PHASE_FORWARD = "forward"
# torch 2.11's remat pass reads only this marker (2.13 reads PHASE); backward nodes carry both,
# so the graph trainer's remat works on the GPU machines' torch 2.11 too.
REMAT_PASS_TAG = "remat_pass_tag"
REMAT_PASS_TAG_BACKWARD = "is_backward"
AC_REGION = "ac_region_id"  # int: the activation-checkpointing region (transformer block) of a node
# str: path of the innermost module whose forward created the node ("layers.0.attention.wq"; an
# FSDP/DDP parametrization is named after its parameter, "layers.0.attention.wq.weight"); backward
# nodes inherit their forward node's. Canonical golden names are numbered per op within it.
MODULE_PATH = "ap_module_path"
# str: the canonical key (autoparallel.planner.graph) of the unsharded node a lowered node was
# made for: its op, or a collective moving one of its inputs (the graph outputs: "output").
# Written by the lowering of a plan; predicted and traced communication are compared per key.
PLANNED_NODE = "ap_planned_node"

# --- autoparallel's own node.meta keys ------------------------------------------------------
# Pre-overlap bucketing eligibility ("fsdp_ag", "grad_rs", "grad_ar"), written on a joint graph
# and carried to the split graphs by the partitioner. Not kept in "custom": a re-trace copies a
# forward node's custom dict onto the backward nodes derived from it (the reduce-scatter would
# inherit its all-gather's tag), so each compile tags its own joint graph instead.
BUCKET = "ap_bucket"
# What a placeholder is, as a label: "param:<fqn>", "buffer:<fqn>", "input:<i>", "tangent:<i>".
# On the output node: a list with one label per output ("loss", "output:<i>", "grad:<fqn>", or
# "saved:<i>" for tensors a forward graph saves for backward; None where the output is None).
ROLE = "ap_role"

# --- GraphModule.meta keys --------------------------------------------------------------------
GM_GROUP_DIMS = "ap_group_dims"  # {process-group name: mesh-dim label}, travels with the graph
GM_STAGE = "ap_stage"  # human-readable name of the pipeline stage that produced the graph

# ac_graph_id for nodes tagged by autoparallel passes: large, so they form their own AC region and
# never merge with a user checkpoint region (whose ids are small block indices).
AP_AC_GRAPH_ID = 100000


def custom_meta(node) -> dict:
    """The node's own ``meta["custom"]`` dict, safe to write.

    Tracers hand one ``custom`` dict to every node created under the same annotation (and
    partitioners copy meta shallowly), so writing into a shared dict would tag other nodes too:
    the dict is copied before it is returned.
    """
    own = dict(node.meta.get(CUSTOM) or {})
    node.meta[CUSTOM] = own
    return own


def bucket_tag(node) -> str | None:
    return node.meta.get(BUCKET)


def set_bucket_tag(node, tag: str | None) -> None:
    if tag is None:
        node.meta.pop(BUCKET, None)
    else:
        node.meta[BUCKET] = tag
