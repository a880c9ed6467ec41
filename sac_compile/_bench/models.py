"""Small reference models shared by the tests, the benchmarks and the demo.

``make_model(name, size=..., seed=..., device=...)`` returns ``(model, inputs)``:

* ``model.blocks`` is an ``nn.ModuleList`` of the checkpointable units; callers wrap those
  into regions (this module imports nothing of ``sac_compile``).
* ``model(*inputs)`` returns a tensor; ``model(*inputs).sum()`` (or ``gradients.loss_fn``) is
  the loss. Every model ends in a small, randomly initialised ``head`` Linear so that the sum is
  not a constant of the last LayerNorm and input gradients are not identically zero.
* Initialisation and inputs are a function of ``seed`` alone (the global RNG is left as it
  was); the model is built on the CPU and moved to ``device``, so values do not depend on it.

Models (``MODEL_NAMES``):

``mlp``   blocks of Linear(d->4d) -> GELU -> Linear(4d->d) -> residual -> LayerNorm.
``gpt``   pre-LN transformer blocks: qkv Linear, ``F.scaled_dot_product_attention(is_causal=True)``,
          attention-output Dropout(0.1), proj Linear, residual; LayerNorm, MLP with GELU and
          Dropout(0.1), residual. ``size="stack32"`` is a 32-block stack of small blocks.
``conv``  Conv2d -> BatchNorm2d (training mode: running stats are updated in place) -> ReLU
          blocks, residual where the shapes match, then mean-pool and Linear.
``moe``   router Linear -> softmax -> top-2 of E experts, per-expert capacity chosen with
          ``topk``, dispatch with ``index_select``, combine with ``index_add_`` into a gate
          matrix built by ``scatter``; residual. All shapes are static (no ``nonzero``).

Hugging Face models under the same protocol are in ``hf_models.py``; the gradients the
tests and the report compare, in ``gradients.py``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MODEL_NAMES", "SIZES", "make_model", "MLP", "MLPBlock", "GPT", "GPTBlock", "ConvNet",
           "ConvBNBlock", "MoE", "MoEBlock"]

MODEL_NAMES: tuple[str, ...] = ("mlp", "gpt", "conv", "moe")


# --------------------------------------------------------------------------------------
# MLP
# --------------------------------------------------------------------------------------

class MLPBlock(nn.Module):
    """Linear(d->h) -> GELU -> Linear(h->d) -> residual -> LayerNorm."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, n_layers: int, d_out: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(n_layers))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------------------
# GPT-style transformer
# --------------------------------------------------------------------------------------

class GPTBlock(nn.Module):
    """Pre-LN block: x + proj(dropout(sdpa(qkv(ln1(x))))), then x + dropout(mlp(ln2(x)))."""

    def __init__(self, d: int, n_heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        assert d % n_heads == 0, (d, n_heads)
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_drop = nn.Dropout(dropout)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(self.attn_drop(y))
        x = x + self.mlp_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
        return x

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention over ``[B, H, T, C/H]`` heads (a subclass may pick the kernel)."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class GPT(nn.Module):
    def __init__(self, d: int, n_heads: int, n_layers: int, d_out: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(d, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------------------
# Conv + BatchNorm
# --------------------------------------------------------------------------------------

class ConvBNBlock(nn.Module):
    """Conv2d(3x3) -> BatchNorm2d -> ReLU, plus the input when the shapes match."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.residual = c_in == c_out

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn(self.conv(x)))
        return x + y if self.residual else y


class ConvNet(nn.Module):
    def __init__(self, c_in: int, channels: int, n_blocks: int, n_classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            ConvBNBlock(c_in if i == 0 else channels, channels) for i in range(n_blocks))
        self.head = nn.Linear(channels, n_classes)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


# --------------------------------------------------------------------------------------
# Mixture of experts
# --------------------------------------------------------------------------------------

class Expert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    """Top-k routed experts with a static per-expert capacity.

    Each token picks its top ``k`` experts (``topk`` over the softmax of the router); the
    renormalised weights are scattered into a dense ``(tokens, experts)`` gate matrix. Each
    expert then takes the ``capacity`` tokens with the largest gate for it (``topk`` again;
    tokens beyond the capacity are dropped, slots left over carry gate 0), gathers them with
    ``index_select``, and adds its gated output back with an in-place ``index_add_``.
    """

    def __init__(self, d: int, hidden: int, n_experts: int, k: int = 2,
                 capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.k = k
        self.capacity_factor = capacity_factor
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(n_experts))

    def capacity(self, n_tokens: int) -> int:
        per_expert = self.capacity_factor * n_tokens * self.k / len(self.experts)
        return max(1, min(n_tokens, math.ceil(per_expert)))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = self.norm(x).reshape(-1, shape[-1])
        probs = self.router(tokens).softmax(dim=-1)                    # (N, E)
        top_w, top_i = probs.topk(self.k, dim=-1)                       # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, top_i, top_w)       # (N, E)
        capacity = self.capacity(tokens.shape[0])
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            gate, idx = gates[:, e].topk(capacity)                     # (C,), (C,)
            h = expert(tokens.index_select(0, idx)) * gate.unsqueeze(-1)
            out.index_add_(0, idx, h)
        return x + out.view(shape)


class MoE(nn.Module):
    def __init__(self, d: int, hidden: int, n_experts: int, n_layers: int, d_out: int,
                 k: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock(d, hidden, n_experts, k) for _ in range(n_layers))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# --------------------------------------------------------------------------------------
# Sizes and the factory
# --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Spec:
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


SIZES: dict[str, dict[str, _Spec]] = {
    "mlp": {
        "test": _Spec(lambda: MLP(d=16, hidden=64, n_layers=2, d_out=8), (4, 16)),
        # The benchmark: 8 layers, 64x1024 input, 1024 -> 4096 -> 1024, LayerNorm.
        "bench": _Spec(lambda: MLP(d=1024, hidden=4096, n_layers=8, d_out=16), (64, 1024)),
    },
    "gpt": {
        "test": _Spec(lambda: GPT(d=32, n_heads=4, n_layers=2, d_out=8), (2, 8, 32)),
        "bench": _Spec(lambda: GPT(d=256, n_heads=4, n_layers=4, d_out=64), (4, 128, 256)),
        # Many small blocks: for partitioner solve-time benchmarks, not for step time.
        "stack32": _Spec(lambda: GPT(d=32, n_heads=2, n_layers=32, d_out=8), (2, 16, 32)),
    },
    "conv": {
        "test": _Spec(lambda: ConvNet(c_in=3, channels=8, n_blocks=3, n_classes=5), (2, 3, 8, 8)),
        "bench": _Spec(lambda: ConvNet(c_in=3, channels=32, n_blocks=4, n_classes=10),
                       (16, 3, 32, 32)),
    },
    "moe": {
        "test": _Spec(lambda: MoE(d=16, hidden=32, n_experts=4, n_layers=2, d_out=8),
                      (2, 8, 16)),
        "bench": _Spec(lambda: MoE(d=128, hidden=256, n_experts=8, n_layers=2, d_out=16),
                       (4, 64, 128)),
    },
}


def _perturb_norms(model: nn.Module) -> None:
    """LayerNorm/BatchNorm affine parameters start at 1 and 0; nudge them (deterministically,
    under the caller's seed) so that gradient checks see non-trivial scales and shifts."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)) and m.weight is not None:
                m.weight.add_(0.1 * torch.randn_like(m.weight))
                m.bias.add_(0.1 * torch.randn_like(m.bias))


def make_model(name: str, *, size: str = "test", seed: int = 0,
               device: str | torch.device = "cpu") -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Build fixture ``name`` at ``size``: ``(model in training mode, inputs)``.

    The float inputs require grad, so input gradients are checked too. The global RNG state
    is the same after the call as before it.
    """
    if name not in SIZES:
        raise ValueError(f"unknown fixture model {name!r}; expected one of {list(MODEL_NAMES)}")
    sizes = SIZES[name]
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for fixture {name!r}; expected one of "
                         f"{list(sizes)}")
    spec = sizes[size]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.build()
        _perturb_norms(model)
        x = torch.randn(spec.input_shape)
    model = model.to(device).train()
    model.fixture_name = name
    model.fixture_size = size
    x = x.to(device).requires_grad_(True)
    return model, (x,)
