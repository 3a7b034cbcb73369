"""LLaMA-3 in plain PyTorch, written for the compile stack rather than for speed.

It exists because the passes and the parity tests need a realistic model whose
graphs stay easy to reason about. The graphs are real-valued (RoPE uses cos/sin
buffers, not complex tensors). Attention reads its head count from the weight
shapes, so tensor-parallel local shards run unchanged. Activation checkpointing
never renames parameters. The initial weights depend only on a seed, so two
builds can be compared bitwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoparallel import ac

__all__ = [
    "PRESETS",
    "VALID_AC_MODES",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_ac",
    "apply_rope",
    "build_model",
    "ffn_hidden_dim",
    "model_args",
    "precompute_rope",
    "repeat_kv",
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
        return ac.checkpoint_block(self._forward, self.ac_mode, self.layer_id, x, cos, sin)


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

VALID_AC_MODES = ac.AC_MODES


def apply_ac(model: Transformer, mode: str | None) -> Transformer:
    """Set activation checkpointing on ``model``'s blocks in place and return ``model``.

    Modes:
      * ``None`` / ``"none"``: no AC (removes a previous setting).
      * ``"full"``: checkpoint every block (non-reentrant); only block inputs are saved.
      * ``"layer:K"``: fully checkpoint blocks whose index ``% K == 0``.
      * ``"op"``: op-selective AC per block (``autoparallel.ac``: the policy graph SAC shares).

    Blocks are not wrapped, so parameter FQNs are unchanged. Every checkpoint call
    restores ``current_meta`` afterwards (``autoparallel.ac.restore_sac_meta``), so SAC tags do
    not leak into later graph nodes under make_fx / aot_export.
    """
    per_block = ac.parse_ac_mode(mode, len(model.layers))
    for block, block_mode in zip(model.layers, per_block, strict=True):
        block.ac_mode = block_mode
    return model
