"""Unit tests for autoparallel.models.llama3: shapes, deterministic init, TP-shaped weights, AC."""

from __future__ import annotations

import operator
from collections import defaultdict

import pytest
import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import CheckpointPolicy

from autoparallel.ac import OpSACState, parse_ac_mode
from autoparallel.models.llama3 import (
    PRESETS,
    Attention,
    ModelArgs,
    Transformer,
    apply_ac,
    apply_rope,
    build_model,
    ffn_hidden_dim,
    model_args,
    precompute_rope,
)

SAVE = CheckpointPolicy.MUST_SAVE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE
MM = torch.ops.aten.mm.default
ADD = torch.ops.aten.add.Tensor
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _tokens(args: ModelArgs, bs: int = 2, seq: int | None = None, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (bs, seq or args.max_seq_len), generator=g)


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    targets = torch.roll(tokens, -1, dims=1)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _loss_and_grads(model: Transformer, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = _loss(model, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _trace_joint(model: Transformer, tokens: torch.Tensor) -> torch.fx.GraphModule:
    """make_fx of fwd + loss + autograd.grad; nodes are annotated with meta["custom"]["phase"]."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def step(params, buffers, tokens):
        # Keep the parametrization active through backward: recomputation reads module attrs.
        with _reparametrize_module(model, {**params, **buffers}):
            with fx_traceback.annotate({"phase": "forward"}):
                loss = _loss(model, tokens)
            with fx_traceback.annotate({"phase": "backward"}):
                grads = torch.autograd.grad(loss, list(params.values()))
        return loss, grads

    with fx_traceback.preserve_node_meta():
        return make_fx(step, tracing_mode="fake")(params, buffers, tokens)


def _phase(node: torch.fx.Node) -> str | None:
    return node.meta.get("custom", {}).get("phase")


def _ops(gm: torch.fx.GraphModule, target, phase: str | None = None) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target == target and (phase is None or _phase(n) == phase)
    ]


# --------------------------------------------------------------------------------------
# Configuration and shapes
# --------------------------------------------------------------------------------------


def test_presets_and_ffn_hidden_dims():
    assert set(PRESETS) == {"tiny", "debug", "8b"}
    # hidden = 4*dim -> int(2*hidden/3) -> int(mult*hidden) -> round up to multiple_of
    assert ffn_hidden_dim(64, 256, None) == 256  # 170 -> 256
    assert model_args("tiny").ffn_hidden_dim == 256
    assert model_args("debug").ffn_hidden_dim == 896  # 682 -> 886 -> 896
    assert model_args("8b").ffn_hidden_dim == 14336  # 10922 -> 14198 -> 14336
    a = model_args("8b")
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (4096, 32, 32, 8, 128256)
    assert (a.rope_theta, a.max_seq_len, a.multiple_of) == (500000.0, 8192, 1024)
    # presets are copied, overrides re-validated
    t = model_args("tiny", n_layers=3)
    assert t.n_layers == 3 and PRESETS["tiny"].n_layers == 2


def test_model_args_validation():
    assert ModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=8, max_seq_len=4).n_kv_heads == 4
    with pytest.raises(ValueError, match="dim"):
        model_args("tiny", dim=66)
    with pytest.raises(ValueError, match="n_kv_heads"):
        model_args("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="n_layers"):
        model_args("tiny", n_layers=0)
    with pytest.raises(ValueError, match="valid presets"):
        model_args("70b")
    with pytest.raises(ValueError) as exc:
        model_args("nope")
    assert all(name in str(exc.value) for name in ("tiny", "debug", "8b"))


@pytest.mark.parametrize("preset", ["tiny", "debug"])
def test_forward_shapes(preset):
    args = model_args(preset)
    model = build_model(preset)
    tokens = _tokens(args, bs=2, seq=16)
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    assert logits.dtype == torch.float32
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.attention.wq.weight" in names
    assert "layers.1.feed_forward.w2.weight" in names
    assert model.layers[0].feed_forward.w1.weight.shape == (args.ffn_hidden_dim, args.dim)
    assert model.layers[0].attention.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert not any(b.is_complex() for b in model.buffers())
    assert model.state_dict().keys() == dict(model.named_parameters()).keys()  # non-persistent
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_tokens(args, bs=1, seq=args.max_seq_len + 1))


def test_8b_on_meta():
    args = model_args("8b")
    model = build_model("8b", device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    per_layer = (
        2 * args.dim * args.dim  # wq, wo
        + 2 * args.dim * args.n_kv_heads * args.head_dim  # wk, wv
        + 3 * args.dim * args.ffn_hidden_dim
        + 2 * args.dim
    )
    assert n == 2 * args.vocab_size * args.dim + args.n_layers * per_layer + args.dim
    assert n == 8_030_261_248
    shallow = build_model(model_args("8b", n_layers=1), device="meta")  # full depth: 0.4 s more
    logits = shallow(torch.zeros(1, 16, dtype=torch.long, device="meta"))
    assert logits.shape == (1, 16, args.vocab_size)


def test_rope_matches_complex_formulation():
    hd, seq = 16, 8
    cos, sin = precompute_rope(hd, seq, 10000.0)
    x = torch.randn(2, seq, 3, hd, generator=torch.Generator().manual_seed(0))
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(seq).float(), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)
    ref = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot[None, :, None])
    torch.testing.assert_close(apply_rope(x, cos, sin), ref.flatten(-2))


# --------------------------------------------------------------------------------------
# Deterministic init
# --------------------------------------------------------------------------------------


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_init_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = build_model("tiny", seed=0)
    state = torch.get_rng_state()
    torch.manual_seed(999)
    b = build_model("tiny", seed=0)
    torch.set_rng_state(state)
    c = build_model("tiny", seed=0)
    assert torch.equal(torch.get_rng_state(), state)  # building does not touch the global RNG
    assert _params_equal(a, b) and _params_equal(a, c)
    d = build_model("tiny", seed=1)
    assert not any(
        torch.equal(p, q)
        for (n, p), q in zip(a.named_parameters(), d.parameters(), strict=True)
        if "norm" not in n
    )
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(64))
    # depth-scaled std for output projections of deeper layers
    assert a.layers[1].attention.wo.weight.std() < a.layers[1].attention.wq.weight.std()


def test_meta_to_empty_init_matches_direct_build():
    direct = build_model("tiny", seed=7)
    lazy = build_model("tiny", device="meta")
    lazy.to_empty(device="cpu")
    lazy.init_weights(7)
    assert _params_equal(direct, lazy)
    assert torch.equal(direct.rope_cos, lazy.rope_cos) and torch.equal(
        direct.rope_sin, lazy.rope_sin
    )
    tokens = _tokens(direct.args)
    with torch.no_grad():
        assert torch.equal(direct(tokens), lazy(tokens))


def test_init_weights_on_meta_raises():
    with pytest.raises(RuntimeError, match="to_empty"):
        build_model("tiny", device="meta").init_weights(0)


@pytest.mark.parametrize("preset", ["tiny", "debug"])
def test_build_under_fake_tensor_mode(preset):
    args = model_args(preset)
    with FakeTensorMode():
        model = build_model(preset)
        assert all(isinstance(p, FakeTensor) for p in model.parameters())
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, args.vocab_size)


def test_tied_embeddings():
    args = model_args("tiny", tie_embeddings=True)
    model = build_model(args, seed=3)
    assert model.output.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    assert len(names) == len(set(map(id, model.parameters())))
    # meta -> to_empty breaks the tie; init_weights restores it and gives the same values
    lazy = build_model(args, device="meta")
    lazy.to_empty(device="cpu")
    lazy.init_weights(3)
    assert lazy.output.weight is lazy.tok_embeddings.weight
    assert _params_equal(model, lazy)
    loss, grads = _loss_and_grads(model, _tokens(args))
    assert torch.isfinite(loss) and "output.weight" not in grads


# --------------------------------------------------------------------------------------
# Tensor-parallel-shaped (local shard) weights
# --------------------------------------------------------------------------------------


def test_attention_runs_with_tp_sharded_weights():
    args = model_args("tiny")  # 4 heads, 2 kv heads, head_dim 16 -> n_rep 2
    hd, tp = args.head_dim, 2
    full = Attention(args)
    torch.nn.init.normal_(full.wq.weight, std=0.05, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 8, args.dim, generator=torch.Generator().manual_seed(1))
    cos, sin = precompute_rope(hd, 8, args.rope_theta)
    q_rows = args.n_heads * hd // tp
    kv_rows = args.n_kv_heads * hd // tp
    total = torch.zeros(2, 8, args.dim)
    with torch.no_grad():
        for r in range(tp):
            shard = Attention(args).requires_grad_(False)
            shard.wq.weight = torch.nn.Parameter(full.wq.weight[r * q_rows : (r + 1) * q_rows])
            shard.wk.weight = torch.nn.Parameter(full.wk.weight[r * kv_rows : (r + 1) * kv_rows])
            shard.wv.weight = torch.nn.Parameter(full.wv.weight[r * kv_rows : (r + 1) * kv_rows])
            shard.wo.weight = torch.nn.Parameter(full.wo.weight[:, r * q_rows : (r + 1) * q_rows])
            out = shard(x, cos, sin)
            assert out.shape == (2, 8, args.dim)
            total += out
        # row-parallel wo: the partial outputs sum to the unsharded result
        torch.testing.assert_close(total, full(x, cos, sin), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------


def test_apply_ac_modes_and_errors():
    model = build_model(model_args("tiny", n_layers=5))
    names = [n for n, _ in model.named_parameters()]
    assert [b.ac_mode for b in apply_ac(model, "full").layers] == ["full"] * 5
    assert [b.ac_mode for b in apply_ac(model, "op").layers] == ["op"] * 5
    assert [b.ac_mode for b in apply_ac(model, "layer:2").layers] == [
        "full",
        None,
        "full",
        None,
        "full",
    ]
    assert [b.ac_mode for b in apply_ac(model, "layer:1").layers] == ["full"] * 5
    assert [b.ac_mode for b in apply_ac(model, "none").layers] == [None] * 5
    apply_ac(model, "op")
    assert [b.ac_mode for b in apply_ac(model, None).layers] == [None] * 5
    assert [n for n, _ in apply_ac(model, "op").named_parameters()] == names  # FQNs unchanged
    for bad in (
        "bogus",
        "selective",
        "layer:0",
        "layer:-1",
        "layer:",
        "layer:x",
        "layer:²",
        "Full",
        2,
    ):
        with pytest.raises(ValueError, match="valid modes") as exc:
            apply_ac(model, bad)
        assert all(m in str(exc.value) for m in ("'full'", "'layer:K'", "'op'", "'none'"))
    assert [b.ac_mode for b in model.layers] == ["op"] * 5  # failed calls change nothing
    assert parse_ac_mode("layer:3", 7) == ["full", None, None, "full", None, None, "full"]


def _count_block_forwards(model: Transformer, fn) -> list[int]:
    counts = [0] * len(model.layers)
    handles = [
        block.attention.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, block in enumerate(model.layers)
    ]
    try:
        fn()
    finally:
        for h in handles:
            h.remove()
    return counts


@pytest.mark.parametrize(
    "mode, expected",
    [
        (None, [1, 1, 1, 1]),
        ("full", [2, 2, 2, 2]),
        ("layer:2", [2, 1, 2, 1]),
        ("layer:3", [2, 1, 1, 2]),
    ],
)
def test_full_and_layer_ac_recompute_the_selected_blocks(mode, expected):
    args = model_args("tiny", n_layers=4)
    model = apply_ac(build_model(args), mode)
    tokens = _tokens(args, seq=8)
    assert _count_block_forwards(model, lambda: _loss(model, tokens).backward()) == expected


@pytest.mark.parametrize("mode", ["full", "op", "layer:2"])
def test_ac_is_bitwise_equal_to_no_ac(mode):
    args = model_args("tiny")
    model = build_model(args, seed=0)
    tokens = _tokens(args)
    ref_loss, ref_grads = _loss_and_grads(model, tokens)
    apply_ac(model, mode)
    loss, grads = _loss_and_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


def test_full_ac_trace_recomputes_without_tags():
    args = model_args("tiny", n_layers=1)
    model = apply_ac(build_model(args), "full")
    gm = _trace_joint(model, _tokens(args, seq=8))
    assert not any("recompute" in n.meta for n in gm.graph.nodes)
    per_block = 7  # wq wk wv wo w1 w3 w2
    assert len(_ops(gm, MM, "forward")) == args.n_layers * per_block + 1
    # full AC: the block forwards are traced again inside the backward
    assert len(_ops(gm, SDPA_CPU)) == 2 * args.n_layers


@pytest.fixture(scope="module")
def op_traced() -> torch.fx.GraphModule:
    args = model_args("tiny")
    return _trace_joint(apply_ac(build_model(args), "op"), _tokens(args, seq=8))


def test_op_sac_tags_on_traced_graph(op_traced):
    gm = op_traced
    fwd = [n for n in gm.graph.nodes if _phase(n) == "forward" and n.op == "call_function"]
    by_block: dict[int, list[torch.fx.Node]] = defaultdict(list)
    for n in fwd:
        if "recompute" in n.meta:
            assert isinstance(n.meta["ac_graph_id"], int)
            by_block[n.meta["ac_graph_id"]].append(n)
    assert sorted(by_block) == [0, 1]
    for nodes in by_block.values():
        mms = [n.meta["recompute"] for n in nodes if n.target == MM]
        assert mms == [SAVE, RECOMPUTE, SAVE, RECOMPUTE, SAVE, RECOMPUTE, SAVE]
        sdpa = [n for n in nodes if n.target == SDPA_CPU]
        assert len(sdpa) == 1 and sdpa[0].meta["recompute"] == SAVE
        residual = [
            n
            for n in nodes
            if n.target == ADD and all(isinstance(a, torch.fx.Node) for a in n.args)
        ]
        assert [n.meta["recompute"] for n in residual] == [SAVE, RECOMPUTE]
        # the saved residual add is h = x + attn(...), read by ffn_norm and the final add
        assert residual[1].args[0] is residual[0]
        eps_adds = [n for n in nodes if n.target == ADD and n not in residual]
        assert eps_adds and all(n.meta["recompute"] == RECOMPUTE for n in eps_adds)
        for target in (
            torch.ops.aten.silu.default,
            torch.ops.aten.mul.Tensor,
            torch.ops.aten.rsqrt.default,
        ):
            tagged = [n for n in nodes if n.target == target]
            assert tagged and all(n.meta["recompute"] == RECOMPUTE for n in tagged)
    # no tag leaks: embedding, final norm and output projection, and the whole backward are clean
    untagged_fwd = [n for n in fwd if "recompute" not in n.meta]
    assert any(n.target == torch.ops.aten.embedding.default for n in untagged_fwd)
    assert _ops(gm, MM, "forward")[-1] in untagged_fwd  # output head
    bwd = [n for n in gm.graph.nodes if _phase(n) == "backward"]
    assert bwd and not any("recompute" in n.meta or "ac_graph_id" in n.meta for n in bwd)
    assert not any(n.target == SDPA_CPU for n in bwd)  # SAC under tracing does not re-trace
    assert "recompute" not in fx_traceback.current_meta


def test_op_sac_policy_replays_on_fx_nodes(op_traced):
    """A graph pass using OpSACState on FX nodes makes the same decisions as eager SAC."""
    states: dict[int, OpSACState] = defaultdict(OpSACState)
    decided: dict[torch.fx.Node, CheckpointPolicy] = {}
    for n in op_traced.graph.nodes:
        if "recompute" not in n.meta:
            continue
        if n.target is operator.getitem:
            decided[n] = decided[n.args[0]]
        else:
            assert isinstance(n.target, torch._ops.OpOverload), n
            decided[n] = states[n.meta["ac_graph_id"]].decide(n.target, n.args)
        assert decided[n] == n.meta["recompute"], n
    assert len(decided) > 100
    assert {s.mm_count for s in states.values()} == {7}
    assert {s.residual_add_count for s in states.values()} == {2}
