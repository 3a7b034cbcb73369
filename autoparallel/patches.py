"""Every patch of the compile stack, in one list, with the tests that guard it.

A *patch* is a pass or behaviour change that replaces what upstream PyTorch would do. Each entry
says what it does, what running without it means (the upstream behaviour it replaces), and which
tests must fail when it is disabled. ``AUTOPARALLEL_DISABLE=name1,name2`` disables patches for a
run (the mutation harness uses this); ``disabled(...)`` does the same for a scope in-process.
Code asks ``enabled(name)`` at the point where it would apply the patch.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

ENV_VAR = "AUTOPARALLEL_DISABLE"


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str
    when_disabled: str  # the upstream / pre-fix behaviour that runs instead
    guards: tuple[str, ...]  # pytest node ids, relative to the repository root


PATCHES: dict[str, Patch] = {}


def _register(name: str, summary: str, when_disabled: str, guards: tuple[str, ...]) -> None:
    if name in PATCHES:
        raise ValueError(f"patch {name!r} registered twice")
    PATCHES[name] = Patch(name, summary, when_disabled, guards)


# --- registered patches (keep in pipeline order) ----------------------------------------------

# Entries are added by the issues that build each pass; see tests/unit/autoparallel/test_patches.py.

# Automatic placement (the plan stage, plan="auto"): autoparallel/planner/.
_register(
    "eliminate_alias_round_trips",
    "the plan stage rewires each consumer of an alias that wants the alias's producer's placement "
    "to the producer (per input position), and erases aliases left without users, from graph and plan",
    "every consumer reads the alias: a round trip (producer -> alias placement -> back) runs for each "
    "such consumer, and the producer stays alive until the last one",
    (
        "tests/unit/autoparallel/planner/test_alias_round_trips.py::test_consumer_wanting_the_producer_placement_is_rewired",
        "tests/unit/autoparallel/planner/test_alias_round_trips.py::test_alias_without_users_is_erased_from_graph_and_plan",
        "tests/unit/autoparallel/planner/test_alias_round_trips.py::test_repeated_input_is_rewired_by_position",
    ),
)

_register(
    "solver_incumbent",
    "ilp.solve computes a heuristic plan (planner/incumbent.py: greedy with forward checking, then best "
    "responses, checked against every row of the formulation) and returns it, flagged NOT proven optimal, "
    "when the LP/MIP find no plan within the time limit",
    "a time limit that stops the LP relaxation or the MIP before any plan raises SolverTimeout: the model "
    "is REFUSED (deepseek_v4, 1.86M variables), or not, by the machine's load (gemma3n_text)",
    (
        "tests/unit/autoparallel/planner/test_planner_ilp.py::test_a_solver_time_out_returns_the_heuristic_plan_marked_not_proven",
        "tests/unit/autoparallel/planner/test_planner_models.py::test_a_time_limit_reports_the_heuristic_plan_in_the_summary",
    ),
)

_register(
    "side_effect_nodes",
    "a call run only for its side effect (no users, no tensor value: aten._assert_async.msg, one_hot's "
    "'Class values must be non-negative' check; _assert_scalar, _print) is a replicated fallback with no "
    "output: its inputs planned Replicate (an all-reduce of one_hot's one-element all()), the op run on "
    "them on every rank by the lowering, so every rank checks the value the single-device program checks "
    "(autoparallel/planner/side_effects.py)",
    "the planner refuses the model at the first such node (\"has no tensor meta['val']\"): dbrx REFUSED",
    (
        "tests/unit/autoparallel/planner/test_side_effects.py::test_an_assert_is_a_replicated_fallback_with_no_output",
        "tests/unit/autoparallel/planner/test_side_effects.py::test_the_lowered_graph_keeps_the_assert_and_is_bitwise_with_eager",
        "tests/parity/test_side_effects_parity.py::test_one_hot_checks_under_auto_are_bitwise_and_pass_the_oracle",
    ),
)

# The joint stage's lowering of a plan (plan="auto"): autoparallel/planner/lower.py.
_register(
    "permuted_split_cat",
    "the lowered plan's split -> W getitems -> cat (DTensor's gather or scatter of a dim other "
    "than 0 around a dim-0 collective) becomes one permuted copy: reshape, permute, contiguous clone, view",
    "each such move stays W + 2 nodes (W the group size), ~1,900 nodes of an 8B planned graph",
    (
        "tests/unit/autoparallel/passes/test_permuted_split_cat.py::test_a_gather_on_dim_1_becomes_one_permuted_copy",
        "tests/unit/autoparallel/passes/test_permuted_split_cat.py::test_a_scatter_on_dim_1_becomes_one_permuted_copy",
        # the lowering's own moves (direct_moves) trace no chain; with them off, DTensor's chains are rewritten
        "tests/unit/autoparallel/planner/test_lower.py::test_the_lowered_module_runs_its_final_graph_with_and_without_split_cat_rewrites",
    ),
)

_register(
    "direct_moves",
    "the lowering writes each move (redistribution between planned placements) itself: per mesh dim of "
    "DTensor's transform plan one functional collective (all_reduce, all_gather_into_tensor, "
    "reduce_scatter_tensor) or a local narrow, and one permuted copy for a dim other than 0 "
    "(autoparallel/planner/moves.py); Shard -> Shard, Replicate -> Partial, strided and uneven shards stay DTensor's",
    "every move is DTensor's redistribute_local_tensor: a dim > 0 is traced as chunk -> W getitems -> cat "
    "and rewritten after the trace by permuted_split_cat (a third of the 8B lowering's seconds)",
    (
        "tests/unit/autoparallel/planner/test_moves.py::test_a_gather_of_dim_1_is_one_all_gather_and_one_permuted_copy",
        "tests/unit/autoparallel/planner/test_moves.py::test_a_reduce_scatter_of_dim_1_is_one_permuted_copy_and_one_reduce_scatter",
        "tests/unit/autoparallel/planner/test_lower.py::test_the_lowered_graph_has_no_split_cat_move",
    ),
)
_register(
    "layout_blind_moves",
    "a moved piece whose consumers, through to the graph's outputs, only permute dims, detach or cast it "
    "(autoparallel/planner/layout_reads.py) stays in its collective's layout: no permute -> contiguous "
    "clone -> permute into the traced value's strides",
    "every moved piece is copied into the traced layout: a weight gradient reduce-scattered before its t "
    "and dtype cast costs 3 nodes and a memory pass more (8B planned, 8 layers: ~170 nodes)",
    (
        "tests/unit/autoparallel/planner/test_layout_reads.py::test_a_gradient_scattered_before_its_t_and_cast_is_not_copied",
        "tests/unit/autoparallel/planner/test_layout_reads.py::test_only_blind_ops_up_to_the_output_skip_the_copy",
        "tests/parity/test_planned_parity.py::test_the_layout_blind_case_leaves_pieces_in_their_collectives_layout",
    ),
)
_register(
    "batch_local_convolution",
    "a convolution (or its backward) planned with nothing but the batch dim sharded, on several mesh "
    "dims ([S(0), S(0)], DTensor's own strategy expanded over a 2-D mesh), is lowered as the op on the "
    "local tensors: the call DTensor's convolution handler makes on a batch-only placement",
    "the lowering dispatches it through DTensor, whose convolution handler reads dim_map and refuses "
    "('Tensor dim 0 is already sharded on mesh dim 0 ... hybrid sharding strategies'): plan='auto' "
    "refuses the model (mobilevitv2 on dp=2,tp=2)",
    (
        "tests/unit/autoparallel/planner/test_batch_local.py::test_a_convolution_with_the_batch_on_both_mesh_dims_is_lowered",
        "tests/unit/autoparallel/planner/test_batch_local.py::test_only_a_batch_split_over_several_mesh_dims_runs_locally",
    ),
)

# apply_placement boundary, first partition, second compile (pipeline steps 3-5).
_register(
    "tangent_roles",
    "the second compile labels its tangent placeholders from AOT's descriptors: the loss's "
    "tangent:loss, a parameter's new value's tangent:mutated:<fqn> (AOT puts it before the loss's)",
    "tangents_1 is labelled tangent:loss whatever it is and the others are left unlabelled: with a "
    "parameter updated in place in forward (gemma3n_text), the collective-pass executor fails "
    "(\"placeholder 'tangents_2' has no role label\") and the loss's 1 would go to the new value's tangent",
    (
        "tests/unit/autoparallel/planner/test_mutated_params.py::test_the_second_compile_labels_each_tangent_by_what_it_is_the_tangent_of",
        "tests/parity/test_mutated_params_parity.py::test_a_parameter_clamped_in_place_trains_as_in_eager",
    ),
)
_register(
    "fsdp_chain_recompute",
    "mark_fsdp_all_gather_recomputation tags MUST_RECOMPUTE on every forward node after each FSDP "
    "wait that reads only the gathered weight (t/permute/slice/select/view/cast, the narrow of a "
    "padded uneven shard included; a chain or a fan-out tree, e.g. a tied weight) and on the dtype cast before the all-gather",
    "only the all-gather and its wait are tagged: the partitioner saves the first untagged node "
    "after the wait (the transposed gathered weight, 2.62 GiB on LLaMA-3 8B; the narrowed padded "
    "weight of an uneven shard) and the cast shard",
    (
        "tests/unit/autoparallel/passes/test_fsdp_recompute.py::test_transposed_weight_after_wait_is_recomputed_not_saved",
        "tests/unit/autoparallel/passes/test_fsdp_recompute.py::test_recompute_tags_cast_all_gather_wait_and_chain",
        "tests/unit/autoparallel/passes/test_fsdp_recompute.py::test_fan_out_after_a_padded_narrow_is_recomputed_not_saved",
        "tests/unit/autoparallel/passes/test_fsdp_recompute.py::test_padded_gathered_and_narrowed_weights_are_recomputed_not_saved",
        "tests/unit/autoparallel/test_partition.py::test_no_all_gather_output_or_wait_saved_for_backward",
        "tests/unit/autoparallel/passes/test_fsdp_recompute.py::test_a_tied_weight_gathered_once_and_read_twice_is_recomputed_on_both_paths",
    ),
)
_register(
    "replay_saves_partitioner",
    "the second compile partitions with ReplaySavesPartitioner: it saves exactly the nodes the "
    "first partition saved (custom.ap_must_save), MUST_RECOMPUTE wins, PREFER_RECOMPUTE adds no save",
    "the second compile runs stock min_cut_rematerialization_partition, which makes its own "
    "save/recompute decisions (different saved set; with the AC pass it saves gathered weights)",
    (
        "tests/unit/autoparallel/test_partition.py::test_second_compile_saves_exactly_what_first_saved",
        "tests/unit/autoparallel/test_partition.py::test_ac_pass_in_second_compile_adds_no_save_and_no_all_gather",
    ),
)
_register(
    "eager_kernels_retrace",
    "the second compile's re-trace (autoparallel_backend) lifts the same Python kernels as eager_kernels, so "
    "the first partition's upsample_bilinear2d and upsample_bilinear2d_backward are recorded as those ops again",
    "the re-trace runs upsample_bilinear2d's Python decomposition (gathers, products and sums): the joint "
    "stage is bitwise and the second compile is not (mobilevit: 1547 of 2088 tensors, 6.3e-3)",
    (
        "tests/unit/autoparallel/test_eager_kernels.py::test_second_compile_of_an_upsampling_model_is_eager_bitwise",
    ),
)
_register(
    "aot_graph_text_only_when_logged",
    "the first partition and the second compile render AOTAutograd's joint, forward and backward "
    "graphs as text (print_readable) only when a structured-trace handler or the aot_joint_graph / "
    "aot_graphs logger listens",
    "AOTAutograd's enable_log=True (no way to pass False through aot_module_simplified or "
    "aot_compile_joint_with_descriptors): the joint graph and both partitions are printed on every "
    "compile and the text dropped when nobody listens",
    (
        "tests/unit/autoparallel/test_aot_graph_text.py::test_no_graph_text_without_a_listener",
    ),
)
_register(
    "overlap_config_persists",
    "autoparallel_backend passes the overlap-scheduling Inductor settings to the compilers "
    "themselves (compile_fx config_patches), so they are in force when the backward is compiled "
    "lazily on the first .backward()",
    "the settings live in a config.patch context that has exited before the lazy backward "
    "compile: the backward is compiled without overlap scheduling (the bug #483 fixed)",
    (
        "tests/unit/autoparallel/test_compile.py::test_overlap_config_in_force_when_backward_compiles",
        "tests/unit/autoparallel/test_compile_inductor.py::test_inductor_overlap_config_in_force_when_the_lazy_backward_compiles",
    ),
)


# Training steps of the graphs (every executor, and plan="auto"'s reference): autoparallel/runtime/steps.py.
_register(
    "zero_tangents",
    "a step feeds the loss's tangent a 1 and every other tangent (a parameter's new value, "
    "tangent:mutated:<fqn>) zeros shaped as its placeholder, the zeros autograd materializes for "
    "an output nothing reads",
    "every tangent gets a 1: a parameter updated in place in forward gets 1 added to its gradient "
    "in the joint and split graphs and in plan=\"auto\"'s reference, not in the compiled modules",
    (
        "tests/unit/autoparallel/runtime/test_steps.py::test_only_the_loss_s_tangent_is_a_one",
        "tests/parity/test_mutated_params_parity.py::test_a_parameter_clamped_in_place_trains_as_in_eager",
    ),
)

# Collective passes on the split fw/bw graphs (the stages after second_compile): autoparallel/passes/.
_register(
    "fuse_chained_allgathers",
    "fuse_chained_allgathers replaces all_gather(dp) -> wait -> [identity views] -> all_gather(tp) "
    "-> wait (either direction) by one all-gather on the flattened dp*tp group (+ a reshuffle "
    "when the chain's rank order is column-major)",
    "chains stay as two all-gathers on the two sub-groups (two launches per chain)",
    (
        "tests/unit/autoparallel/passes/test_fuse_chained_allgathers.py::test_fuses_direct_chain_both_directions",
        "tests/unit/autoparallel/passes/test_fuse_chained_allgathers.py::test_fuses_identity_view_chain",
        "tests/golden/test_planned_pipeline.py::test_chained_all_gathers_fused_on_the_planned_graphs",
    ),
)
_register(
    "pre_overlap_bucketing",
    "bucket_tagged_collectives merges the collectives tagged on the joint graph (param-derived "
    "all-gathers, gradient reduce-scatters/all-reduces) into byte-capped buckets on the split "
    "fw/bw graphs, before the overlap scheduler adds its per-group ordering dependencies",
    "no pre-bucketing: every per-parameter collective reaches the overlap scheduler on its own",
    (
        "tests/unit/autoparallel/passes/test_pre_overlap_bucketing.py::test_merges_tagged_collectives_on_hand_graph",
        "tests/unit/autoparallel/passes/test_pre_overlap_bucketing.py::test_split_fw_bw_graphs_are_bucketed",
    ),
)
_register(
    "canonical_bucket_layout",
    "plan_buckets lists each bucket's members by what they carry (an all-gather by the param: "
    "placeholder it reads, a reduction by the grad: output it reaches), so graphs traced per rank "
    "that compute the same gradients in other orders lay a merged collective out alike on every rank",
    "members listed in graph order: a rank whose graph computes a gradient earlier puts it at "
    "another offset, and the reduction adds one gradient's rows to another's",
    (
        "tests/unit/autoparallel/passes/test_bucket_layout.py::test_graphs_computing_gradients_in_other_orders_lay_buckets_out_alike",
        "tests/unit/autoparallel/passes/test_bucket_layout.py::test_all_gathers_are_listed_by_the_parameter_they_read",
    ),
)
_register(
    "eager_dropout",
    "the joint trace decomposes aten.dropout as ATen's dropout runs on the input's device: native_dropout "
    "where the fused kernel runs (CUDA), else the CPU composite (bernoulli in the input's dtype, div by 1 - p, "
    "mul), whose autograd multiplies by the noise rounded to that dtype, as eager does",
    "upstream's Python decomposition emits native_dropout on every device: on CPU its backward scales by the "
    "unrounded 1 / (1 - p) (bf16/fp16: 84 of 99 probabilities differ from eager) and in fp32 it scales by "
    "float(1 / (1 - p)) where eager divides by float(1 - p) (15 of 99): dropout under bf16 params not bitwise",
    (
        "tests/unit/autoparallel/test_eager_dropout.py::test_traced_dropout_is_eager_bitwise_for_every_p_and_dtype",
        "tests/parity/test_random_ops_parity.py::test_bf16_params_dropout_bitwise_at_every_stage",
    ),
)
_register(
    "in_place_dropout",
    "the planner's trace (upstream's native_dropout kept) decomposes aten.dropout_ (nn.Dropout(inplace=True), "
    "F.dropout(..., inplace=True)) as x.copy_(aten.dropout(x, p, train)): one native_dropout, which the planner "
    "places as a dropout and the oracle switches off with the single-device side's F.dropout",
    "aten.dropout_ traces as its composite (empty_like, bernoulli_, div_, mul_), a random op that is not a "
    "dropout: it stays on in the ranks' dropout-off program while the reference runs F.dropout at p=0 "
    "(mobilenet_v1/v2 under auto: 'eager (dropout off on both sides)' FAIL, worst |diff| / bound 3.78e+06)",
    (
        "tests/unit/autoparallel/test_eager_dropout.py::test_planner_trace_keeps_an_in_place_dropout_one_native_dropout",
        "tests/parity/test_random_ops_parity.py::test_in_place_dropout_under_auto_is_switched_off_on_both_sides",
    ),
)
_register(
    "eager_kernels",
    "inside the joint trace, ops with a CPU kernel whose Autograd/CompositeImplicitAutograd key carries a "
    "Python decomposition (upsample family, hardshrink, softshrink, margin losses; not native_batch_norm) "
    "trace as the ATen op and its derivative, as eager runs them",
    "the trace runs the Python decomposition: bilinear interpolate becomes _unsafe_index gathers and its "
    "backward _unsafe_index_put(accumulate=True), other roundings than eager (mobilevit NOT bitwise)",
    (
        "tests/unit/autoparallel/test_eager_kernels.py::test_traced_interpolate_is_eager_bitwise",
        "tests/unit/autoparallel/test_eager_kernels.py::test_joint_graph_of_an_upsampling_model_is_eager_bitwise",
    ),
)
_register(
    "pinned_layouts",
    "after the joint trace, each pointwise op whose same-shaped tensor operands have mixed layouts is "
    "followed by prims.copy_strided to the strides the trace recorded, so the real tensor has the fake "
    "tensor's layout whatever the kernel picked (ATen's kernel and the op's Python decomposition take the "
    "operands in other orders: softplus_backward, hardswish_backward)",
    "the real layout of such an op can differ from the traced one: a view the trace made of its output "
    "(the reshape in its gradient's path) raises 'view size is not compatible with input tensor's size "
    "and stride' at run time (doge, qwen3_5_moe_text fsdp)",
    (
        "tests/unit/autoparallel/passes/test_pinned_layouts.py::test_traced_joint_graph_of_mixed_layout_softplus_runs",
        "tests/unit/autoparallel/passes/test_pinned_layouts.py::test_joint_graph_pins_the_mixed_layout_op",
    ),
)
_register(
    "kernel_strides",
    "inside the joint trace and the second compile's re-trace, an op with one output of its operands' "
    "broadcast shape whose operands have mixed layouts gets, as its fake output, the dimension order the "
    "CPU kernel gives on tiny probe operands of the same dimension orders (TensorIterator's layout rule)",
    "such an op's fake output has its Python decomposition's layout (softplus_backward, hardswish_backward "
    "read their operands in another order than ATen's kernel): pinned_layouts copies the real output into "
    "it, so later reductions sum in another order than eager (qwen3_5, qwen3_next, olmo_hybrid, lara_mini "
    "fsdp: NOT bitwise at 1e-12..4e-9)",
    (
        "tests/unit/autoparallel/test_kernel_strides.py::test_fake_strides_of_mixed_layout_ops_are_the_kernel_strides",
        "tests/unit/autoparallel/test_kernel_strides.py::test_joint_graph_of_a_transposed_softplus_gate_is_eager_bitwise",
    ),
)
_register(
    "value_guards",
    "a model that reads a tensor's value into Python (.item(), `if t:`, .tolist()) or takes a nonzero (itself, "
    "or inside x[mask] / masked_select) is traced with the value / count a real eager run of the rank's batch slice gives (a read downstream of a random "
    "op that is not a replicated scalar draw stays refused, naming it); each read becomes autoparallel.guard_value "
    "on the loss, each counted tensor is read through autoparallel.guard_rows: another value at run time raises "
    "a named error (module, line, both "
    "values) instead of computing the traced branch",
    "the trace refuses the model (REFUSED: 'reads a tensor's value into Python'); upstream's real-value "
    "propagation instead bakes the branch in with no check: another batch computes a wrong result silently",
    (
        "tests/unit/autoparallel/passes/test_value_guards.py::test_a_batch_with_the_traced_value_is_bitwise_with_eager",
        "tests/unit/autoparallel/passes/test_value_guards.py::test_a_batch_with_another_value_raises_the_guard",
        "tests/unit/autoparallel/passes/test_value_guards.py::test_a_nonzero_is_traced_with_its_row_count_and_guarded",
        "tests/unit/autoparallel/passes/test_value_guards.py::test_bool_mask_indexing_is_traced_with_the_count_and_bitwise_with_eager",
        "tests/parity/test_value_guards_parity.py::test_bool_mask_indexing_is_guarded_and_bitwise_at_every_stage",
        "tests/parity/test_value_guards_parity.py::test_a_value_read_is_guarded_and_bitwise_at_every_stage",
        "tests/unit/autoparallel/planner/test_planned_value_guards.py::test_the_lowered_graph_holds_the_guard_and_is_bitwise_with_eager",
        "tests/unit/autoparallel/planner/test_planned_value_guards.py::test_a_batch_that_takes_the_other_branch_raises_the_guard",
    ),
)
_register(
    "replicated_draws",
    "a scalar random draw in forward (a random factory call with no tensor argument and a 0-dim result: a "
    "layer drop's torch.rand([])) is one draw for the whole batch: every data-parallel rank draws it (its "
    "generator advancing as in eager) and takes data-parallel rank 0's through an all-gather per data dim; "
    "a read it decides is then traced with the eager run's outcome and guarded (value_guards)",
    "each rank keeps its own draw: ranks that take different branches issue different collectives (a hang "
    "or mispaired all-gathers), so a read a draw decides stays refused (m2m_100, nllb-moe, seamless_m4t*)",
    (
        "tests/unit/autoparallel/parallelize/test_replicated_draws.py::test_a_layer_drop_is_traced_with_the_eager_draw_and_bitwise",
        "tests/parity/test_value_guards_parity.py::test_a_layer_drop_is_replicated_guarded_and_bitwise",
    ),
)
_register(
    "trace_as_compiling",
    "the joint trace and the graph trainer's trace run with torch.compiler.is_compiling() true, as a "
    "torch.compile session does: models skip their data-dependent eager fast paths (transformers' "
    "attention-mask checks)",
    "aot_export / make_fx trace with is_compiling() false: every transformers decoder and encoder stops "
    "at a data-dependent aten._local_scalar_dense in masking_utils",
    (
        "tests/unit/autoparallel/test_validate.py::test_a_model_that_asks_is_compiling_traces_its_graph_path",
        "tests/unit/autoparallel/test_validate.py::test_the_graph_trainer_traces_the_graph_path_too",
    ),
)
_register(
    "contiguous_gathered_shards",
    "after an all-gather bucket merge (pre-overlap and topo-span bucketing), a parameter whose "
    "shard is one row is cloned contiguous: upstream's merge hands it out as a strided view of the "
    "bucket, on which CPU kernels compute something else (native_group_norm: wrong values; "
    "BatchNorm: another rounding; a view: a run-time error)",
    "upstream's strided views reach the parameters' consumers (the zoo convnet under fsdp on dp=8: "
    "loss 1.43 vs 1.53 at step 0)",
    (
        "tests/unit/autoparallel/passes/test_contiguous_gathered_shards.py::test_one_row_shards_come_out_contiguous_and_compute_what_unbucketed_ones_do",
        "tests/unit/autoparallel/passes/test_contiguous_gathered_shards.py::test_a_view_of_a_bucketed_one_row_parameter_runs",
    ),
)
_register(
    "shared_provenance",
    "the collective passes run with the nodes' provenance histories (meta from_node) taken off and "
    "given back after: upstream bucketing's NodeSources then copy empty lists, and get the "
    "originals' histories shared (same provenance, half the passes' time on tiny LLaMA)",
    "upstream bucketing deep-copies every bucket member's history into every node it creates "
    "(new nodes x members deep copies)",
    (
        "tests/unit/autoparallel/passes/test_shared_provenance.py::test_bucketed_nodes_share_the_histories_of_their_members",
        "tests/unit/autoparallel/passes/test_shared_provenance.py::test_histories_come_back_when_the_pass_raises",
    ),
)
_register(
    "reused_bucket_traces",
    "the collective passes on a graph reuse a bucket merge's make_fx trace for every later bucket with "
    "the same merge function and argument metadata, each reuse given fake values of its own (same "
    "graphs; 174 of 188 traces on the 8B at 32 layers were repeats)",
    "upstream bucketing traces every bucket's merge function with make_fx, one trace per bucket",
    (
        "tests/unit/autoparallel/passes/test_reused_bucket_traces.py::test_a_repeated_bucket_is_traced_once",
        "tests/unit/autoparallel/passes/test_reused_bucket_traces.py::test_a_bucket_of_another_signature_is_traced",
    ),
)
_register(
    "kept_random_draws",
    "after the first partition and the second compile's replay partition, every random op of the joint "
    "graph that neither graph kept (a dropout whose output nothing reads) is drawn again in the forward, "
    "right before the next draw the forward kept (an empty_like feeding it from a dropped value becomes "
    "an empty_strided of its layout); before the first partition, a dead draw with several outputs "
    "(native_dropout, as plan='auto' keeps dropout) is read through one getitem",
    "AOT's partitioners build the forward from its outputs and leave out a draw nobody reads; eager draws "
    "it, so every later dropout draws the mask of the one before it (pegasus_x under fsdp dp=2: loss "
    "22.810 vs 22.737 from the first partition on); a dead native_dropout without users stops AOT's "
    "default partitioner (pegasus_x under auto: 'Expected native_dropout_8 to be a tensor')",
    (
        "tests/unit/autoparallel/passes/test_kept_random_draws.py::test_a_dead_dropout_is_drawn_again_where_the_joint_graph_drew_it",
        "tests/unit/autoparallel/passes/test_kept_random_draws.py::test_a_model_with_a_dead_dropout_is_bitwise_after_the_partition",
        "tests/unit/autoparallel/passes/test_kept_random_draws.py::test_a_dead_dropout_under_auto_is_partitioned_and_drawn_in_order",
    ),
)
_register(
    "unread_saves_dropped",
    "the replay partition leaves out saved values that only dead code of the backward reads (a dead "
    "forward draw the backward's extraction copied with its chain, random ops being impure) and "
    "extracts the graphs again",
    "such a chain's placeholders stay saved for the backward; one the forward updates in place (a "
    "BatchNorm running stat before a dropout) fails autograd's version check in the second compile's "
    "backward (efficientnet under fsdp dp=2: 'is at version 8; expected version 7')",
    (
        "tests/unit/autoparallel/test_unread_saves.py::test_batchnorm_before_dropout_trains_bitwise_in_the_second_compile",
        "tests/unit/autoparallel/test_unread_saves.py::test_the_second_compile_saves_no_buffer_its_backward_does_not_read",
    ),
)
_register(
    "random_op_order",
    "after each collective pass, the graph's random ops (dropout, bernoulli, rand) are put back in "
    "the order they drew in before it (a stable topological sort with each random op after the "
    "previous one); a pass that adds or drops one, or makes that order impossible, is an error naming them",
    "upstream's topological sort after a bucket merge, and the overlap scheduler, reorder random ops "
    "on independent branches: on CPU they then draw each other's masks (T5 and BART under fsdp dp=2: "
    "the decoder's embedding dropout ahead of the encoder's attention dropout, loss off by 0.3)",
    (
        "tests/unit/autoparallel/passes/test_random_order.py::test_bucketing_a_weight_two_branches_read_keeps_their_dropouts_in_order",
        "tests/parity/test_random_ops_parity.py::test_an_encoder_and_a_decoder_reading_one_embedding_are_bitwise_at_every_stage",
    ),
)
_register(
    "primary_fsdp_group",
    "inside the overlap scheduler, identify_fsdp_groups returns only the process group with the "
    "most FSDP all-gathers (ties: the one seen first)",
    "upstream identify_fsdp_groups: every group with an FSDP-looking all-gather is bucketed",
    (
        "tests/unit/autoparallel/passes/test_topo_span_bucketing.py::test_identify_fsdp_groups_picks_primary_group",
        "tests/unit/autoparallel/passes/test_topo_span_bucketing.py::test_identify_fsdp_groups_ties_pick_one",
    ),
)
_register(
    "topo_span_bucketing",
    "inside the overlap scheduler, greedy_bucket_collective_by_mb buckets same-key collectives "
    "without an adjacency requirement, closing a bucket on bytes or on topological span, never "
    "co-bucketing dependent collectives",
    "upstream greedy_bucket_collective_by_mb: only adjacent same-key collectives, no span bound",
    (
        "tests/unit/autoparallel/passes/test_topo_span_bucketing.py::test_greedy_bucket_splits_on_span_cap",
        "tests/unit/autoparallel/passes/test_topo_span_bucketing.py::test_greedy_bucket_merges_non_adjacent_same_key",
    ),
)
_register(
    "estimation_tables_only_when_traced",
    "inside the overlap scheduler, the table of compute estimates (a structured-trace artifact: "
    "FLOPs of every compute node counted on fake tensors) is built only when a structured-trace "
    "handler listens",
    "upstream _log_compute_estimations builds the table on every run and drops it when nobody "
    "listens: about a fifth of the overlap pass at LLaMA-3 8B shapes",
    (
        "tests/unit/autoparallel/passes/test_overlap_scheduling.py::test_the_estimates_table_is_built_only_for_a_structured_trace",
    ),
)


# Graph trainer (the second front end, docs/design.md): autoparallel/trainer/.
_register(
    "phase_tagging",
    "trace_train_step marks nodes traced inside torch.autograd.grad with custom.phase='backward' "
    "(forward/loss nodes 'forward'), the backward-region marker the remat pass and graph SAC read",
    "make_fx marks no node as backward: the remat pass finds no backward region and is a no-op "
    "(nothing is recomputed, SAC saves no memory), and graph SAC cannot tell forward from backward",
    (
        "tests/unit/autoparallel/trainer/test_trace.py::test_backward_nodes_carry_phase_tags",
        "tests/unit/autoparallel/trainer/test_sac.py::test_remat_duplicates_recomputed_ops_into_backward",
        "tests/unit/autoparallel/trainer/test_trainer_memory.py::test_remat_lowers_traced_peak",
    ),
)
_register(
    "sac_skips_backward",
    "graph SAC (apply_sac_pass) tags forward nodes only; backward nodes are skipped at the source",
    "backward nodes get recompute tags too, and the remat pass duplicates backward ops",
    (
        "tests/unit/autoparallel/trainer/test_sac.py::test_sac_tags_forward_nodes_only",
        "tests/unit/autoparallel/trainer/test_sac.py::test_remat_duplicates_recomputed_ops_into_backward",
    ),
)
_register(
    "traced_no_grad",
    "run_traced executes the traced fwd+loss+bwd graph under torch.no_grad()",
    "the graph runs with grad mode on: autograd records a second graph over it and the returned "
    "gradients keep every intermediate of the step alive (much higher peak memory)",
    (
        "tests/unit/autoparallel/trainer/test_trainer_memory.py::test_no_grad_execution_lowers_peak",
        "tests/unit/autoparallel/trainer/test_trainer_memory.py::test_traced_sac_peak_within_limit_of_eager_sac",
    ),
)


# --- enable / disable -------------------------------------------------------------------------

_scoped: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("autoparallel_disabled", default=frozenset())


def _check_names(names, source: str) -> frozenset[str]:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch name(s) {unknown} in {source}; known patches: {sorted(PATCHES)}")
    return frozenset(names)


def disabled_from_env() -> frozenset[str]:
    raw = os.environ.get(ENV_VAR, "")
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return _check_names(names, f"${ENV_VAR}")


def enabled(name: str) -> bool:
    """Whether patch ``name`` is in force (not disabled by the environment or a scope)."""
    if name not in PATCHES:
        raise ValueError(f"unknown patch {name!r}; known patches: {sorted(PATCHES)}")
    return name not in disabled_from_env() and name not in _scoped.get()


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Disable patches within a scope (this thread/context only); restored on exit."""
    token = _scoped.set(_scoped.get() | _check_names(names, "disabled(...)"))
    try:
        yield
    finally:
        _scoped.reset(token)
