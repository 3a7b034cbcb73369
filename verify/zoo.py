"""A zoo of tiny models that are not LLaMA: what the verification layer itself is tested on.

Each entry is a :class:`verify.stages.scenario.ModelCase` (a module factory, a loss, a batch factory and
the TP rules that fit the model), so any of them runs through ``Scenario(model="verify.zoo:NAME")``,
``verify.check.check_model`` and ``python -m verify report --model verify.zoo:NAME``. They live in
the package, not under ``tests/``, because the golden catalog (``verify/goldens/catalog.py``)
names zoo scenarios and the report must be able to rebuild them from any install.

They are written the way PyTorch users write models, with the patterns that break compile stacks:

* :data:`gpt2`: GPT-2 style. Learned positions, LayerNorm, biased Linears, GELU, a fused qkv
  projection (TP splits it as 3 chunks) and an output head tied to the token embedding.
* :data:`convnet`: Conv2d + BatchNorm2d (running stats updated in place) + GroupNorm, and a
  hand-written label-smoothing loss.
* :data:`ln_mlp`: pre-norm MLP blocks whose LayerNorm saves two of its three outputs for the
  backward (mean and rstd), and user-written TP rules over a region pattern ``blocks.*``.

Every model has a few thousand parameters: a gloo parity run of three steps takes well under a
second of compute per executor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoparallel.parallelize.plan import TPRule
from verify.model_case import ModelCase

__all__ = ["HYBRID_BATCH_PINS", "ZOO", "ClampedCoefs", "DropPath", "LogSigmoidGate", "MaskFromPythonData", "ONE_HOT_PARTIAL_PINS", "OneHotRouter",
           "Prototypes", "StridedDepthwiseConv", "conv_batch", "convnet", "gpt2", "ln_mlp", "one_hot_loss", "routed_batch"]


# --- GPT-2 style -------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Fused qkv projection; the head count comes from the (possibly TP-local) weight shape."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, head_dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = GPT2MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 32, seq_len: int = 8, dim: int = 16, head_dim: int = 4, n_layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(GPT2Block(dim, head_dim) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, two names
        for module in self.modules():  # GPT-2's N(0, 0.02) weights; biases keep nn.Linear's
            if isinstance(module, (nn.Linear, nn.Embedding)):  # (non-zero) init, so a doubled one shows
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def gpt2_batch(n: int, vocab: int = 32, seq_len: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (n, seq_len + 1))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


gpt2 = ModelCase(
    name="gpt2",
    factory=GPT2,
    loss_fn=token_cross_entropy,
    batch=gpt2_batch,
    tp_rules={
        # Megatron: qkv and fc split their outputs (qkv as 3 chunks: each rank keeps its heads of
        # q, k and v), the projections split their inputs; biases follow their weights.
        "blocks.*.attn.qkv.weight": TPRule("colwise", chunks=3),
        "blocks.*.attn.proj.weight": "rowwise",
        "blocks.*.mlp.fc.weight": "colwise",
        "blocks.*.mlp.proj.weight": "rowwise",
    },
    tp_regions=("blocks.*.attn", "blocks.*.mlp"),
)


# --- a conv net with BatchNorm and GroupNorm ---------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.relu(self.gn(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def label_smoothing_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    """Cross-entropy against smoothed one-hot targets, written out by hand."""
    logp = logits.log_softmax(dim=-1)
    target = torch.full_like(logp, smoothing / (logits.shape[-1] - 1))
    target.scatter_(-1, labels.unsqueeze(-1), 1.0 - smoothing)
    return -(target * logp).sum(dim=-1).mean()


def convnet_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 6, 6), torch.randint(0, 4, (n,))


convnet = ModelCase(name="convnet", factory=ConvNet, loss_fn=label_smoothing_loss, batch=convnet_batch, batch_per_rank=2)


# --- pre-norm MLP blocks with user TP rules -----------------------------------------------------


class MLPBlock(nn.Module):
    """One TP region: fc (colwise) -> GELU -> proj (rowwise, its bias added once after the
    region's all-reduce)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class LNMLP(nn.Module):
    """x -> [x + block(norm(x))] x n -> head. The norms sit outside the TP regions."""

    def __init__(self, dim: int = 16, hidden: int = 32, n_layers: int = 2, out: int = 4):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(n_layers))
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(n_layers))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, block in zip(self.norms, self.blocks, strict=True):
            x = x + block(norm(x))
        return self.head(x)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def ln_mlp_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16), torch.randn(n, 4)


ln_mlp = ModelCase(
    name="ln_mlp",
    factory=LNMLP,
    loss_fn=mse_loss,
    batch=ln_mlp_batch,
    batch_per_rank=2,
    tp_rules={"blocks.*.fc.weight": "colwise", "blocks.*.proj.weight": "rowwise"},
    tp_regions=("blocks.*",),
)

#: name -> case, for command lines and parametrized tests.
ZOO: dict[str, ModelCase] = {c.name: c for c in (gpt2, convnet, ln_mlp)}


# --- What plan="auto" places by itself ----------------------------------------------------------
# (tests/unit/autoparallel/planner/test_replicated_fallbacks.py, tests/parity/test_planned_fallbacks_parity.py)


class MaskFromPythonData(nn.Module):
    """A mask made in forward from Python data (``torch.tensor``: a lifted constant) and
    positions from ``torch.arange`` (a factory)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        mask = torch.tensor([1.0, 0.0, 1.0, 1.0] * 4)
        return self.lin(x * mask + torch.arange(16, dtype=x.dtype))


class Prototypes(nn.Module):
    """Distances to learned prototypes: ``torch.cdist`` (aten._cdist_forward / _cdist_backward
    have no DTensor strategy on torch 2.13), whose gradient reaches a parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.protos = nn.Parameter(torch.randn(4, 16))
        self.head = nn.Linear(4, 8)

    def forward(self, x):
        return self.head(torch.cdist(self.lin(x), self.protos))


class LogSigmoidGate(nn.Module):
    """A gate through ``logsigmoid`` (inkling's router): ``aten.log_sigmoid_forward`` has no
    registered DTensor strategy on torch 2.13, only a decomposition, which the planner places by."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.head(nn.functional.logsigmoid(self.fc(x)))


class DropPath(nn.Module):
    """Stochastic depth: one keep draw per example, from ``torch.bernoulli`` of a made tensor."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        keep = torch.bernoulli(torch.full((x.shape[0], 1), 1 - self.p, dtype=x.dtype))
        return x * keep / (1 - self.p)


class SingleKeyAttention(nn.Module):
    """Attention over one key (segformer's sequence reduction on a tiny image): every query's
    softmax is over a single score, so it is 1 whatever q and k are, and their gradients are 0
    exactly; fp32 leaves rounding noise there (the kernel's backward cancels two equal sums), at
    1e-19 in fp64. A drop path through ``torch.rand`` on the residual, as segformer's."""

    def __init__(self, dim: int = 16, heads: int = 2, drop: float = 0.3):
        super().__init__()
        self.heads, self.drop = heads, drop
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, 8)

    def forward(self, x):  # x: (batch, tokens, dim)
        b, t, d = x.shape
        pooled = x.mean(dim=1, keepdim=True)  # the one key
        split = lambda y: y.view(b, y.shape[1], self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(pooled)), split(self.v(pooled)))
        keep = (torch.rand(b, 1, 1, dtype=x.dtype) + (1 - self.drop)).floor()
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d)) * keep / (1 - self.drop)
        return self.head(x.mean(dim=1))


def single_key_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16, 16), torch.randn(n, 8)  # 16 queries: CPU SDPA's flash kernel


class StridedDepthwiseConv(nn.Module):
    """A conv stem then a depthwise, strided convolution and GroupNorm (mobilevitv2's inverted
    residual, shrunk): on a 2-D mesh DTensor's convolution strategy lets the planner split the
    batch over both mesh dims (``[S(0), S(0)]``), which DTensor's convolution handler cannot run
    (``autoparallel.planner.batch_local``)."""

    def __init__(self, channels: int = 8, classes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.depthwise = nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=channels, bias=False)
        self.norm = nn.GroupNorm(2, channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.stem(x))
        x = F.silu(self.norm(self.depthwise(x)))
        return self.head(x.mean(dim=(2, 3)))


def conv_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 8, 8), torch.randint(0, 4, (n,))


#: The depthwise convolution's forward and backward pinned to the batch on both mesh dims of
#: ``dp=2,tp=2`` (canonical plan keys; what mobilevitv2's plan chose by itself for a backward).
HYBRID_BATCH_PINS = {
    "-/fwd/aten.convolution.default#1": "dp:S(0),tp:S(0)",
    "-/bwd/aten.convolution_backward.default#0": "dp:S(0),tp:S(0)",
}


class ClampedCoefs(nn.Module):
    """Clamps a weight in place before using it (gemma3n's AltUp ``coefs.weight.data.clamp_``):
    under plan="auto" the graph returns the parameter's new value (``mutated:coefs.weight``), and
    AOTAutograd gives that output a tangent of its own besides the loss's."""

    def __init__(self):
        super().__init__()
        self.coefs, self.head = nn.Linear(16, 16, bias=False), nn.Linear(16, 8)

    def forward(self, x):
        self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.head(torch.tanh(self.coefs(x)))


class OneHotRouter(nn.Module):
    """dbrx's router in small: each token's top expert as ``F.one_hot`` of the router's argmax
    gates the experts' outputs. ``one_hot`` checks its indices (``aten._assert_async.msg``: "Class
    values must be non-negative", "... smaller than num_classes"), calls with no output that the
    planner places on the whole value (``autoparallel.planner.side_effects``)."""

    def __init__(self, dim: int = 16, experts: int = 4, classes: int = 4):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(dim, experts)
        self.up = nn.Linear(dim, dim * experts)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        gate = logits.softmax(-1) * F.one_hot(logits.argmax(-1), self.experts).to(x.dtype)
        h = self.up(x).unflatten(-1, (self.experts, -1))
        return self.head((gate.unsqueeze(-1) * h).sum(-2).mean(1))


def one_hot_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against ``F.one_hot`` of the labels: the one_hot's checks read the data (a
    negative label raises "Class values must be non-negative", in eager and on every rank)."""
    return -(F.one_hot(labels, logits.shape[-1]).to(logits.dtype) * logits.log_softmax(-1)).sum(-1).mean()


def routed_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4, 16), torch.randint(0, 4, (n,))


#: The labels' "non-negative" check of :func:`one_hot_loss` on ``dp=2,tp=2`` with its ``all`` pinned
#: to each data-parallel rank's rows (``Partial(product)``: a rank's term, not the value): the
#: assert must be moved to the whole value (one all-reduce of one bool) before it runs.
ONE_HOT_PARTIAL_PINS = {"-/fwd/aten.all.default#2": "dp:P(product),tp:R"}
