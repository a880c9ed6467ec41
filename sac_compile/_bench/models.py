"""Small reference models shared by the tests, the benchmarks and the demo.

``make_model(name, size=..., seed=..., device=...)`` returns ``(model, inputs)``:

* ``model.blocks`` is an ``nn.ModuleList`` of the checkpointable units; callers wrap those
  into regions (this module imports nothing of ``sac_compile``).
* ``model(*inputs)`` returns a tensor; ``model(*inputs).sum()`` (or :func:`loss_fn`) is the
  loss. Every model ends in a small, randomly initialised ``head`` Linear so that the sum is
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

Hugging Face causal language models (``HF_MODEL_NAMES``, ``make_hf_model``; needs
``transformers``, the ``integrations`` extra): GPT-2, Llama with grouped-query attention and
Mixtral, built from small configs (nothing is downloaded) with ``use_cache=False``, as
``tests/test_hf_models.py`` builds them. :class:`HFCausalLM` adapts any such model (one a
user's factory returns, too) to the protocol above: ``.blocks`` are its decoder layers and
``forward(input_ids)`` returns HF's own loss with ``labels=input_ids``.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["MODEL_NAMES", "SIZES", "make_model", "HF_MODEL_NAMES", "HF_SIZES", "HFCausalLM",
           "is_hf_model", "make_hf_model", "loss_fn", "reference_grads", "grads_of",
           "clear_grads", "max_grad_diff", "MLP", "MLPBlock", "GPT", "GPTBlock", "ConvNet", "ConvBNBlock",
           "MoE", "MoEBlock"]

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


# --------------------------------------------------------------------------------------
# Hugging Face causal language models
# --------------------------------------------------------------------------------------

HF_MODEL_NAMES: tuple[str, ...] = ("gpt2", "llama", "mixtral")

#: size -> (config overrides, input_ids shape) shared by the HF models.
HF_SIZES: dict[str, tuple[dict, tuple[int, int]]] = {
    # As tests/test_hf_models.py: 2 layers, width 32, vocabulary 64, 2 x 16 tokens.
    "test": (dict(layers=2, width=32, heads=4, kv_heads=2, ffn=64, vocab=64, positions=32),
             (2, 16)),
    "bench": (dict(layers=4, width=256, heads=8, kv_heads=4, ffn=688, vocab=4096,
                   positions=256), (4, 128)),
}


def _hf_config(transformers: Any, name: str, c: dict) -> Any:
    common = dict(vocab_size=c["vocab"], use_cache=False, bos_token_id=0, eos_token_id=0)
    if name == "gpt2":
        return transformers.GPT2Config(n_layer=c["layers"], n_embd=c["width"], n_head=c["heads"],
                                       n_positions=c["positions"], **common)
    kwargs = dict(num_hidden_layers=c["layers"], hidden_size=c["width"],
                  intermediate_size=c["ffn"], num_attention_heads=c["heads"],
                  num_key_value_heads=c["kv_heads"], max_position_embeddings=c["positions"],
                  attn_implementation="sdpa", **common)
    if name == "llama":
        return transformers.LlamaConfig(**kwargs)
    return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **kwargs)


def is_hf_model(model: Any) -> bool:
    """A ``transformers`` model (a ``PreTrainedModel``), without importing transformers."""
    return isinstance(model, nn.Module) and any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
        for c in type(model).__mro__)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers: the ``ModuleList`` of the classes HF names in
    ``_no_split_modules`` (what accelerate and FSDP wrap one by one), else the first
    ``ModuleList`` named ``layers`` or ``h``."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    fallback = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if layer_classes and all(type(m).__name__ in layer_classes for m in module):
            return module
        if fallback is None and name.rsplit(".", 1)[-1] in ("layers", "h"):
            fallback = module
    return fallback


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the report measures models: ``.blocks`` are its decoder
    layers (each becomes one region), ``forward(input_ids)`` is HF's loss on
    ``labels=input_ids`` (its own shifted cross-entropy, outside every region)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layers found (no ModuleList of "
                             f"its _no_split_modules {getattr(model, '_no_split_modules', None)}"
                             f", none named 'layers' or 'h'); return a model with a `.blocks` "
                             f"list and forward(*inputs) -> loss instead")
        if getattr(model, "loss_type", "") is None:
            # GPT-2 has none: HF warns that it defaults to this one, and under compile the
            # warning is a graph break each time Dynamo traces the loss.
            model.loss_type = "ForCausalLM"
        self.model = model
        self.blocks = layers

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        out = self.model(input_ids=input_ids, labels=input_ids, **kwargs)
        if getattr(out, "loss", None) is None:
            raise ValueError(f"{type(self.model).__name__}(input_ids=..., labels=...) returned no "
                             f"loss; the report takes a causal language model (...ForCausalLM)")
        return out.loss


def make_hf_model(name: str, *, size: str = "test", seed: int = 0,
                  device: str | torch.device = "cpu") -> tuple[nn.Module, tuple[Tensor, ...]]:
    """HF model ``name`` (``HF_MODEL_NAMES``) from a small config, in training mode, as an
    :class:`HFCausalLM`, and its ``input_ids``. Weights and tokens are a function of
    ``seed`` alone (the global RNG is left as it was). Raises ``ImportError`` without
    ``transformers``."""
    import transformers
    if name not in HF_MODEL_NAMES:
        raise ValueError(f"unknown Hugging Face model {name!r}; expected one of "
                         f"{list(HF_MODEL_NAMES)}")
    if size not in HF_SIZES:
        raise ValueError(f"unknown size {size!r} for hf:{name}; expected one of {list(HF_SIZES)}")
    overrides, shape = HF_SIZES[size]
    cfg = _hf_config(transformers, name, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, overrides["vocab"], shape)
    wrapped = HFCausalLM(model.to(device).train())
    wrapped.fixture_name = f"hf:{name}"
    wrapped.fixture_size = size
    return wrapped, (ids.to(device),)


# --------------------------------------------------------------------------------------
# Reference gradients
# --------------------------------------------------------------------------------------

def loss_fn(out: Tensor) -> Tensor:
    """The fixtures' loss: the sum of the output (the model's head makes it non-trivial)."""
    return out.sum()


def grads_of(model: nn.Module, inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """Detached copies of the current ``.grad`` of parameters (``"param:<name>"``) and of
    inputs that require grad (``"input:<i>"``); missing grads are left out."""
    out: dict[str, Tensor] = {}
    for pname, p in model.named_parameters():
        if p.grad is not None:
            out[f"param:{pname}"] = p.grad.detach().clone()
    for i, t in enumerate(inputs):
        if isinstance(t, Tensor) and t.requires_grad and t.grad is not None:
            out[f"input:{i}"] = t.grad.detach().clone()
    return out


def clear_grads(model: nn.Module, inputs: tuple[Tensor, ...]) -> None:
    """Set ``.grad`` of the model's parameters and of the inputs that require grad to None."""
    for p in model.parameters():
        p.grad = None
    for t in inputs:
        if isinstance(t, Tensor) and t.requires_grad:
            t.grad = None


def reference_grads(model: nn.Module, inputs: tuple[Tensor, ...], seed: int = 0, *,
                    loss: Callable[[Tensor], Tensor] = loss_fn,
                    forward: Callable[..., Tensor] | None = None) -> dict[str, Tensor]:
    """One forward+backward without checkpointing, from ``torch.manual_seed(seed)``.

    Returns the parameter and input gradients (see :func:`grads_of`). ``.grad`` of the model
    and the inputs is cleared before and after, so calls do not accumulate. Like any training
    step it updates BatchNorm running stats; pass a ``copy.deepcopy`` of the model if the
    buffers matter. ``forward`` (default ``model``) lets a caller run a wrapped forward with
    the same bookkeeping, e.g. ``reference_grads(m, x, 0, forward=checkpointed_forward)``.
    """
    fwd = model if forward is None else forward
    clear_grads(model, inputs)
    torch.manual_seed(seed)
    loss(fwd(*inputs)).backward()
    grads = grads_of(model, inputs)
    clear_grads(model, inputs)
    return grads


def max_grad_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """Largest absolute difference over the gradients of two :func:`grads_of` dicts.

    A key present in only one of them is an error (a gradient that went missing)."""
    if a.keys() != b.keys():
        raise KeyError(f"gradient sets differ: only in first {sorted(a.keys() - b.keys())}, "
                       f"only in second {sorted(b.keys() - a.keys())}")
    worst = 0.0
    for key in a:
        worst = max(worst, (a[key].float() - b[key].float()).abs().max().item())
    return worst
