"""LLaMA-3 in plain PyTorch, written for the compile stack rather than for speed.

It exists because the passes and the parity tests need a realistic model whose
graphs stay easy to reason about. The graphs are real-valued (RoPE uses cos/sin
buffers, not complex tensors). Attention reads its head count from the weight
shapes, so tensor-parallel local shards run unchanged. Activation checkpointing
never renames parameters. The initial weights depend only on a seed, so two
builds can be compared bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

__all__ = [
    "PRESETS",
    "SAC_SAVE_OPS",
    "VALID_AC_MODES",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "OpSACState",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_ac",
    "apply_rope",
    "build_model",
    "ffn_hidden_dim",
    "model_args",
    "op_sac_context_fn",
    "op_sac_policy",
    "parse_ac_mode",
    "precompute_rope",
    "repeat_kv",
    "restore_sac_meta",
]


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelArgs:
    """Hyper-parameters of a LLaMA-3 model.

    ``n_kv_heads=None`` means ``n_kv_heads == n_heads`` and is resolved in ``__post_init__``.
    With ``tie_embeddings=True`` the output head uses ``tok_embeddings.weight`` as its weight.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "multiple_of",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelArgs.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelArgs.n_heads ({self.n_heads}) must be divisible by "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelArgs.dim / n_heads (head_dim={self.head_dim}) must be even for RoPE"
            )
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise ValueError(
                f"ModelArgs.ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier!r}"
            )
        if not self.norm_eps > 0:
            raise ValueError(f"ModelArgs.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelArgs.rope_theta must be > 0, got {self.rope_theta!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (GQA)."""
        assert self.n_kv_heads is not None
        return self.n_heads // self.n_kv_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """LLaMA's SwiGLU width: 4*dim -> 2/3 of that -> optional multiplier -> round up."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=32),
    "debug": ModelArgs(
        dim=256,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim_multiplier=1.3,
        multiple_of=64,
        vocab_size=1024,
        max_seq_len=128,
    ),
    "8b": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        vocab_size=128256,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
}


def model_args(preset: str, **overrides: Any) -> ModelArgs:
    """Return a fresh copy of ``PRESETS[preset]`` with ``overrides`` applied (and re-validated)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[preset], **overrides)


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with its own ``weight``; computes in float32 and casts back, as LLaMA does."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real RoPE tables ``(cos, sin)``, each ``[max_seq_len, head_dim]``, float32.

    Frequencies follow LLaMA's pairing of adjacent channels ``(2i, 2i+1)``: every
    frequency is repeated twice along the last dim (``repeat_interleave``) so that
    :func:`apply_rope` can work on the flat head dimension.
    """
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    freqs = 1.0 / (theta**exponent)
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    angles = angles.repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[bs, seq, heads, head_dim]`` with the tables for its ``seq`` positions.

    For each channel pair (a, b) this computes ``(a*c - b*s, b*c + a*s)``, which is
    LLaMA's complex multiplication. It is written as ``x*cos - rot*sin`` with
    ``rot = (b, -a)``, so the block contains no tensor-tensor ``aten.add.Tensor``.
    :func:`op_sac_policy` relies on that to find the residual add. The result is
    bitwise equal to the real form ``(a*c - b*s, b*c + a*s)``, since ``u - (-v) == u + v``
    exactly in IEEE. torch's complex multiply differs from it by rounding (~1 ulp).
    """
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack((b, a.neg()), dim=-1).flatten(-2)
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    return (x * cos - rot * sin).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[bs, seq, n_kv, hd] -> [bs, seq, n_kv * n_rep, hd]`` via expand + reshape."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv, hd = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv, n_rep, hd)
        .reshape(bs, seqlen, n_kv * n_rep, hd)
    )


class Attention(nn.Module):
    """Causal GQA attention with RoPE.

    The head counts are read from the projection outputs at run time
    (``view(bs, seq, -1, head_dim)``), so column-sharded ``wq``/``wk``/``wv`` and a
    row-sharded ``wo`` (tensor-parallel local shards with whole heads) work unchanged.
    Only ``head_dim`` and ``n_rep`` are fixed, and neither changes under TP.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.n_kv_heads is not None
        self.head_dim = args.head_dim
        self.n_rep = args.n_rep
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq = apply_rope(xq, cos, sin)
        xk = apply_rope(xk, cos, sin)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        q, k, v = (t.transpose(1, 2) for t in (xq, keys, values))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# --------------------------------------------------------------------------------------
# Activation checkpointing policy (shared with graph-level SAC passes)
# --------------------------------------------------------------------------------------


def _existing_ops(names: tuple[str, ...], namespace: Any) -> frozenset:
    ops = set()
    for name in names:
        packet = getattr(namespace, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


_SDPA_OPS = _existing_ops(
    (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_attention_math_for_mps",
    ),
    torch.ops.aten,
)

#: Ops whose outputs op-selective AC saves. ``aten.mm`` is saved only at odd positions
#: within a block, and ``aten.add.Tensor`` only for the block's first residual add;
#: see :func:`op_sac_policy`.
SAC_SAVE_OPS: frozenset = (
    _SDPA_OPS
    | _existing_ops(("reduce_scatter_tensor",), torch.ops._c10d_functional)
    | frozenset({torch.ops.aten.mm.default, torch.ops.aten.max.default})
)

_MM = torch.ops.aten.mm.default
_ADD = torch.ops.aten.add.Tensor


def _is_residual_add(func: Any, args: tuple) -> bool:
    """A residual add is an ``aten.add.Tensor`` whose two operands are both tensors.

    It works on eager args (``torch.Tensor``) and on FX node args (``torch.fx.Node``).
    Inside a block, the only other ``aten.add.Tensor`` is RMSNorm's ``+ eps``, whose
    second operand is a Python scalar.
    """
    if func is not _ADD or len(args) < 2:
        return False
    tensor_like = (torch.Tensor, torch.fx.Node)
    return isinstance(args[0], tensor_like) and isinstance(args[1], tensor_like)


def op_sac_policy(
    func: Any, *, mm_index: int | None = None, residual_add_index: int | None = None
) -> CheckpointPolicy:
    """Pure op-selective AC decision for one op of one transformer block.

    Args:
        func: the op (an ``OpOverload``, e.g. ``node.target`` of an FX ``call_function`` node).
        mm_index: for ``aten.mm``, its 1-based position among the block's mms in forward
            order. Odd positions are saved, even ones recomputed (1st, 3rd, 5th, ... saved).
            Required when ``func`` is ``aten.mm.default``.
        residual_add_index: for a residual ``aten.add.Tensor`` (two tensor operands), its
            1-based position among the block's residual adds. Only the first is saved.
            Pass ``None`` for a non-residual add (e.g. ``x + eps``).

    Returns ``MUST_SAVE`` for SDPA (every ``aten._scaled_dot_product_*`` forward variant),
    ``_c10d_functional.reduce_scatter_tensor``, ``aten.max.default``, odd mms and the first
    residual add. Every other op gets ``PREFER_RECOMPUTE``.

    Graph passes usually go through :class:`OpSACState`, which keeps the per-block counters::

        state = OpSACState()                  # one per block (ac_graph_id) and per pass
        for node in forward_nodes_of_block:   # in forward order
            node.meta["recompute"] = state.decide(node.target, node.args)
    """
    if func is _MM:
        if mm_index is None or mm_index < 1:
            raise ValueError("op_sac_policy: aten.mm needs a 1-based mm_index")
        return (
            CheckpointPolicy.MUST_SAVE if mm_index % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        )
    if func is _ADD:
        if residual_add_index == 1:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func in SAC_SAVE_OPS or _is_sdpa_forward(func):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _is_sdpa_forward(func: Any) -> bool:
    """Any ``aten._scaled_dot_product_*`` forward overload, including ones this torch lacks."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace != "aten":
        return False
    name = func._opname
    return name.startswith("_scaled_dot_product_") and not name.endswith("_backward")


@dataclass
class OpSACState:
    """Per-block counters that feed :func:`op_sac_policy`.

    Make a new one for each block (and, in eager SAC, one per forward/recompute mode).
    Then call :meth:`decide` once per op, in forward order. In an FX graph, feed it the
    block's ``OpOverload`` nodes (``aten.detach`` included or not; it never moves a
    counter). ``operator.getitem`` nodes of a multi-output op, such as SDPA's
    ``(out, logsumexp)``, take their parent's decision, as they do under eager SAC tracing.
    """

    mm_count: int = 0
    residual_add_count: int = 0

    def decide(self, func: Any, args: tuple = ()) -> CheckpointPolicy:
        """Advance the counters for ``func`` and return its policy.

        ``args`` are the op's positional args (tensors or FX nodes). They are only used to
        tell a residual add from ``x + scalar``.
        """
        mm_index = None
        add_index = None
        if func is _MM:
            self.mm_count += 1
            mm_index = self.mm_count
        elif _is_residual_add(func, args):
            self.residual_add_count += 1
            add_index = self.residual_add_count
        return op_sac_policy(func, mm_index=mm_index, residual_add_index=add_index)


def op_sac_context_fn(ac_graph_id: int) -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` implementing op-selective AC.

    Each call (one per checkpointed forward) gets fresh counters, with separate counters
    for forward and recompute mode. The caching context carries the int ``ac_graph_id``,
    so graph nodes traced under it get ``meta["ac_graph_id"] == ac_graph_id``.
    """
    states = {False: OpSACState(), True: OpSACState()}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return states[bool(ctx.is_recompute)].decide(func, args)

    caching, cached = create_selective_checkpoint_contexts(policy)
    caching.ac_graph_id = int(ac_graph_id)
    return caching, cached


_SAC_META_KEYS = ("recompute", "ac_graph_id")


@contextlib.contextmanager
def restore_sac_meta(keys: tuple[str, ...] = _SAC_META_KEYS) -> Iterator[None]:
    """Undo SAC's writes to ``torch.fx.traceback.current_meta`` when the region ends.

    Under make_fx / aot_export, ``_CachingTorchDispatchMode`` sets
    ``current_meta["recompute"]`` and ``["ac_graph_id"]`` and never clears them. Every
    node traced afterwards, including the whole backward, would then inherit the tag.
    """
    old = {k: fx_traceback.current_meta[k] for k in keys if k in fx_traceback.current_meta}
    try:
        yield
    finally:
        # Look the dict up again: preserve_node_meta() may have rebound the global.
        cm = fx_traceback.current_meta
        for k in keys:
            cm.pop(k, None)
        cm.update(old)


# --------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))``; ``out = h + ffn(norm(h))``.

    ``ac_mode`` (``None``, ``"full"`` or ``"op"``) is read by ``forward``. It is set by
    :func:`apply_ac` and leaves parameter FQNs unchanged (no wrapper module).
    """

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ac_mode: str | None = None

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.ac_mode is None:
            return self._forward(x, cos, sin)
        if self.ac_mode == "full":
            context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
        elif self.ac_mode == "op":
            layer_id = self.layer_id

            def context_fn() -> tuple[Any, Any]:
                return op_sac_context_fn(layer_id)

        else:
            raise ValueError(
                f"TransformerBlock.ac_mode must be None, 'full' or 'op', got {self.ac_mode!r}"
            )
        with restore_sac_meta():
            return checkpoint(
                self._forward, x, cos, sin, use_reentrant=False, context_fn=context_fn
            )


class Transformer(nn.Module):
    """LLaMA-3 decoder: ``tokens [bs, seq] (int64) -> logits [bs, seq, vocab]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Passing _weight skips nn.Embedding's RNG init: init_weights() owns initialization,
        # and normal_() on meta tensors would import torch._dynamo (seconds).
        self.tok_embeddings = nn.Embedding(
            args.vocab_size, args.dim, _weight=torch.empty(args.vocab_size, args.dim)
        )
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Computed on CPU and moved: arange on meta goes through the Python refs and
        # imports torch._dynamo, which costs seconds.
        cos, sin = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta, device="cpu")
        device = self.norm.weight.device
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seqlen} exceeds max_seq_len {self.args.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        cos = self.rope_cos[:seqlen]
        sin = self.rope_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def _init_std(self, fqn: str) -> float | None:
        """Init std for a parameter FQN. ``None`` means ones (norm weights)."""
        if fqn.endswith("norm.weight"):
            return None
        if fqn == "output.weight":
            return self.args.dim**-0.5
        if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            layer_id = int(fqn.split(".")[1])
            return 0.02 / math.sqrt(2 * (layer_id + 1))
        return 0.02

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Set every parameter and buffer deterministically from ``seed``.

        Every parameter is drawn from its own CPU ``torch.Generator``, seeded from
        ``(seed, FQN)``. The global RNG is never touched, and the result does not depend
        on the order of initialisation or on the device. The same seed gives bitwise
        identical parameters. Linear and embedding weights are N(0, 0.02); ``wo``/``w2``
        use the depth-scaled std ``0.02 / sqrt(2 * (layer_id + 1))``; the untied output
        head uses ``dim**-0.5``; norm weights are ones. The RoPE buffers are recomputed
        too, so ``build on meta -> to_empty(device=...) -> init_weights(seed)`` gives the
        same model as a direct build. Embedding tying is restored if ``to_empty`` broke it.
        """
        params = list(self.parameters())
        if any(p.is_meta for p in params):
            raise RuntimeError(
                "init_weights: materialize the model first (model.to_empty(device=...))"
            )
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        device = self.rope_cos.device
        cos, sin = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos = cos.to(device)
        self.rope_sin = sin.to(device)
        fake = _is_fake(params[0])
        for fqn, p in self.named_parameters():
            std = self._init_std(fqn)
            if std is None:
                p.fill_(1.0)
            elif not fake:
                g = torch.Generator(device="cpu")
                g.manual_seed(_param_seed(seed, fqn))
                values = torch.empty(p.shape, dtype=torch.float32, device="cpu")
                values.normal_(0.0, std, generator=g)
                p.copy_(values)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fake_mode_active() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _param_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{int(seed)}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def build_model(
    preset_or_args: str | ModelArgs,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Transformer:
    """Build a :class:`Transformer` from a preset name or :class:`ModelArgs`.

    The model is constructed on ``meta`` (cheap: no memory, no global-RNG use) and
    then materialized on ``device`` (default CPU) and set by ``init_weights(seed)``. The
    same seed gives bitwise identical parameters, whatever the global RNG state.
    ``device="meta"`` skips materialization and initialization (use it for shape work
    on 8b). Under an active ``FakeTensorMode`` the parameters are fake tensors, and
    only the deterministic parts (norm ones, RoPE tables) are set.
    """
    args = model_args(preset_or_args) if isinstance(preset_or_args, str) else preset_or_args
    if not isinstance(args, ModelArgs):
        raise TypeError(
            f"build_model expects a preset name or ModelArgs, got {type(args).__name__}"
        )
    target = torch.device("cpu") if device is None else torch.device(device)
    if target.type != "meta" and _fake_mode_active():
        # Fake parameters cannot be swapped in by to_empty(); construct them directly
        # (fake kernels do not consume the global RNG).
        with torch.device(target):
            model = Transformer(args)
        model.init_weights(seed)
        return model
    with torch.device("meta"):
        model = Transformer(args)
    if target.type == "meta":
        return model
    model.to_empty(device=target)
    model.init_weights(seed)
    return model


# --------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------

VALID_AC_MODES = ("none", "full", "layer:K", "op")
_AC_MODES_MSG = "valid modes: None, 'none', 'full', 'layer:K' (K >= 1), 'op'"


def parse_ac_mode(mode: str | None, n_layers: int) -> list[str | None]:
    """Per-block ``ac_mode`` list for ``mode`` (see :func:`apply_ac`). Raises ValueError."""
    if mode is None or mode == "none":
        return [None] * n_layers
    if mode in ("full", "op"):
        return [mode] * n_layers
    if isinstance(mode, str) and mode.startswith("layer:"):
        k_str = mode[len("layer:") :]
        if k_str.isascii() and k_str.isdigit() and int(k_str) >= 1:
            k = int(k_str)
            return ["full" if i % k == 0 else None for i in range(n_layers)]
    raise ValueError(f"unknown activation checkpointing mode {mode!r}; {_AC_MODES_MSG}")


def apply_ac(model: Transformer, mode: str | None) -> Transformer:
    """Set activation checkpointing on ``model``'s blocks in place and return ``model``.

    Modes:
      * ``None`` / ``"none"``: no AC (removes a previous setting).
      * ``"full"``: checkpoint every block (non-reentrant); only block inputs are saved.
      * ``"layer:K"``: fully checkpoint blocks whose index ``% K == 0``.
      * ``"op"``: op-selective AC per block via :func:`op_sac_context_fn` / :func:`op_sac_policy`.

    Blocks are not wrapped, so parameter FQNs are unchanged. Every checkpoint call
    restores ``current_meta`` afterwards (:func:`restore_sac_meta`), so SAC tags do not
    leak into later graph nodes under make_fx / aot_export.
    """
    per_block = parse_ac_mode(mode, len(model.layers))
    for block, block_mode in zip(model.layers, per_block, strict=True):
        block.ac_mode = block_mode
    return model
