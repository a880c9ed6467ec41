"""A Llama-style decoder, one training step per checkpointing strategy: peak memory, step
time and gradients (section 2 of ``benchmarks/gpu_check.py``).

The model: token embedding, ``layers`` pre-norm decoder blocks (RMSNorm, rotary
embeddings, grouped-query attention through ``F.scaled_dot_product_attention`` with
``is_causal=True``, SwiGLU MLP, no biases: every Linear is an ``aten.mm``), a final RMSNorm,
an output Linear and the cross-entropy loss in fp32. Built once per run; every strategy runs
a shallow clone that shares its parameters (``copy.deepcopy`` with the parameters in the
memo), so memory is the same model's in every row.

Every block is wrapped as the strategy says and, for compiled strategies, compiled on its
own (``block.compile(backend=...)``, torchtitan's per-block order: one graph per block,
reused by the identical blocks where Dynamo's guards allow); embedding, head and loss run
eagerly in every row. Strategies (``STRATEGIES``):

* eager: no AC; full AC (``torch.utils.checkpoint``); torch SAC with torchtitan's save list
  (:data:`TORCHTITAN_SAVE_LIST`; ``--torch-sac-mm every_other`` is torchtitan's policy that
  saves every second ``mm`` only); ours (``sac_region(save_matmuls)``);
* compiled (Inductor): no AC; torch SAC (torchtitan's list, torch's partitioner); torch's
  ``activation_memory_budget=0.5``; ours ``save_matmuls``; ours ``relaxed(save_matmuls)``
  with ``memory_budget=0.5``; ours offloading the ``mm`` outputs to the CPU; ours
  ``SaveWithHooks`` packing the ``mm`` outputs (to fp8 with a per-tensor scale in a bf16
  model, to bf16 in an fp32 one: lossy by design, marked so).

Per row: ``torch.cuda.max_memory_allocated`` during a step (peak statistics reset before
it; gradients are zeroed in place, not freed, so "act" = peak minus what was allocated
before the step is the step's activations and temporaries), the median step time
(CUDA-synchronised) over interleaved rounds (each round runs every strategy once, the order
rotating), its median per-round ratio to no AC and to torch SAC of the same mode, and the
largest gradient difference against eager no AC. Compiled rows of ours also carry the
graph-level peak their ``PartitionReport`` computes, where the report has such a field.
On the CPU there is no allocator peak: those columns are ``None``.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import importlib.util
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc

aten = torch.ops.aten


def _ops(namespace: Any, *names: str) -> list[Any]:
    """``namespace.<name>.default`` for the names this torch has."""
    return [getattr(namespace, n).default for n in names if hasattr(namespace, n)]


#: torchtitan's op-level SAC save list (torchtitan/models/llama3/parallelize.py,
#: ``_op_sac_save_list``): matmuls, the SDPA kernels, reduce-scatter, ``max`` (float8
#: scaling); ``_scaled_mm`` as its float8 recipes add. Only the ops this torch has.
TORCHTITAN_SAVE_LIST: list[Any] = [
    *_ops(aten, "mm", "_scaled_mm", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_attention_math",
          "_scaled_dot_product_fused_attention_overrideable"),
    *_ops(getattr(torch.ops, "_c10d_functional"), "reduce_scatter_tensor"),
    aten.max.default,
]


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class LlamaConfig:
    layers: int = 8
    d: int = 2048
    heads: int = 16
    kv_heads: int = 8
    ffn: int = 0          # 0: Llama's rule, 2/3 of 4d rounded up to a multiple of 256
    vocab: int = 32768
    seq: int = 2048
    batch: int = 1
    dtype: str = "bf16"   # bf16 | fp32

    @property
    def ffn_dim(self) -> int:
        if self.ffn:
            return self.ffn
        m = 256 if self.d >= 256 else 8
        return m * math.ceil(int(8 * self.d / 3) / m)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(seq: int, head_dim: int, theta: float = 500000.0) -> tuple[torch.Tensor, ...]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, T, H, hd]`` (rotate-half form, fp32 inside)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        assert cfg.d % cfg.heads == 0 and cfg.heads % cfg.kv_heads == 0, cfg
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.d // cfg.heads
        hd = self.head_dim
        self.attention_norm = RMSNorm(cfg.d)
        self.wq = nn.Linear(cfg.d, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.d, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.d, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.d, bias=False)
        self.ffn_norm = RMSNorm(cfg.d)
        self.w1 = nn.Linear(cfg.d, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.d, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.heads, self.kv_heads, self.head_dim
        h = self.attention_norm(x)
        q = apply_rope(self.wq(h).view(B, T, H, hd), cos, sin)
        k = apply_rope(self.wk(h).view(B, T, KV, hd), cos, sin)
        v = self.wv(h).view(B, T, KV, hd)
        if KV != H:  # torchtitan's repeat_kv
            k = k.repeat_interleave(H // KV, dim=2)
            v = v.repeat_interleave(H // KV, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, H * hd))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.d)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d)
        self.output = nn.Linear(cfg.d, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, cfg.d // cfg.heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


def build_model(cfg: LlamaConfig, device: str, seed: int = 0) -> tuple[Llama, torch.Tensor,
                                                                         torch.Tensor]:
    """The model (built on ``device``, parameters in ``cfg.dtype``, rotary tables fp32),
    input tokens and targets, from ``seed``."""
    with torch.random.fork_rng(devices=[device] if device.startswith("cuda") else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Llama(cfg)
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
    model.to(dtype=cfg.torch_dtype)
    model.cos, model.sin = model.cos.float(), model.sin.float()
    return model.train(), tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def shared_clone(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s module tree whose parameters and buffers are ``model``'s."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block: full AC, or torch SAC (``context_fn``)."""

    def __init__(self, inner: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.context_fn = context_fn

    def forward(self, *args: Any) -> Any:
        if self.context_fn is None:
            return tuc.checkpoint(self.inner, *args, use_reentrant=False)
        return tuc.checkpoint(self.inner, *args, use_reentrant=False, context_fn=self.context_fn)


def torchtitan_context_fn(mm: str) -> Callable[[], Any]:
    """torch SAC's ``context_fn`` with torchtitan's list: every listed op saved (``mm="all"``),
    or torchtitan's policy that saves every second ``mm`` only (``"every_other"``; its
    counters per forward and per recompute, one set per block)."""
    from sac_compile.compiler.regions_compiled import torch_sac_contexts  # quiet under compile
    if mm == "all":
        return functools.partial(torch_sac_contexts, TORCHTITAN_SAVE_LIST)
    save = frozenset(TORCHTITAN_SAVE_LIST)
    meta: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return tuc.CheckpointPolicy.MUST_SAVE if keep else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(torch_sac_contexts, policy)


# SaveWithHooks packs (module level: the policy's identity keys the compile caches).
def pack_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.detach().abs().amax().float().clamp(min=1e-12) / 448.0
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def unpack_fp8_to_bf16(packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, scale = packed
    return (q.float() * scale).to(torch.bfloat16)


def pack_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def unpack_bf16_to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


def _offload_needs(device: str) -> str | None:
    if device.startswith("cuda") and importlib.util.find_spec(
            "torch._functorch._activation_offloading.offload_ops") is None:
        return (f"CPU offload under compile needs torch >= 2.12 (torch.ops.ao); this is torch "
                f"{torch.__version__}")
    return None


def _hooks_needs(cfg: LlamaConfig, device: str) -> str | None:
    if cfg.dtype == "bf16" and not hasattr(torch, "float8_e4m3fn"):
        return f"torch {torch.__version__} has no float8_e4m3fn to pack a bf16 model's values to"
    return None


@dataclasses.dataclass
class Strategy:
    key: str
    label: str
    mode: str                     # eager | compiled
    side: str                     # ref | upstream | ours
    lossy: bool = False           # packs saved values to a lower precision on purpose


STRATEGIES: list[Strategy] = [
    Strategy("no_ac", "no AC", "eager", "ref"),
    Strategy("full_ac", "full AC (torch.utils.checkpoint)", "eager", "upstream"),
    Strategy("torch_sac", "torch SAC, torchtitan's list", "eager", "upstream"),
    Strategy("ours_eager", "ours eager (save_matmuls)", "eager", "ours"),
    Strategy("no_ac_compiled", "no AC", "compiled", "ref"),
    Strategy("torch_sac_compiled", "torch SAC, torchtitan's list", "compiled", "upstream"),
    Strategy("torch_budget", "torch activation_memory_budget=0.5", "compiled", "upstream"),
    Strategy("ours_compiled", "ours save_matmuls", "compiled", "ours"),
    Strategy("ours_budget", "ours relaxed(save_matmuls), memory_budget=0.5", "compiled", "ours"),
    Strategy("ours_offload", "ours offload mm outputs (+ save attention)", "compiled", "ours"),
    Strategy("ours_hooks", "ours SaveWithHooks on mm outputs", "compiled", "ours", lossy=True),
]
STRATEGY_KEYS = [s.key for s in STRATEGIES]


def needs(s: Strategy, cfg: LlamaConfig, device: str) -> str | None:
    """Why ``s`` cannot run here (None: it can)."""
    if s.key == "ours_offload":
        return _offload_needs(device)
    if s.key == "ours_hooks":
        return _hooks_needs(cfg, device)
    return None


def label_of(s: Strategy, cfg: LlamaConfig, mm: str) -> str:
    text = f"{s.label} ({s.mode})"
    if s.key.startswith("torch_sac") and mm == "every_other":
        text = text.replace("list", "list, every other mm")
    if s.key == "ours_hooks":
        text += ": fp8 e4m3 + scale" if cfg.dtype == "bf16" else ": bf16"
    return text


def _ours_policy(key: str, cfg: LlamaConfig) -> Any:
    from sac_compile import SaveWithHooks, policies
    if key in ("ours_eager", "ours_compiled"):
        return policies.save_matmuls
    if key == "ours_budget":
        return policies.relaxed(policies.save_matmuls)
    if key == "ours_offload":
        return policies.compose(policies.offload_ops(aten.mm), policies.save_matmuls)
    hooks = (SaveWithHooks(pack_fp8, unpack_fp8_to_bf16) if cfg.dtype == "bf16"
             else SaveWithHooks(pack_bf16, unpack_bf16_to_fp32))

    def pack_mm_outputs(ctx, op, *args, **kwargs):
        return hooks if op == aten.mm.default else None

    pack_mm_outputs.cache_hash = f"benchmarks/gpu_llama.py:pack_mm_outputs:{cfg.dtype}:1"
    return policies.compose(pack_mm_outputs, policies.save_matmuls)


def _inductor(functorch_patches: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Inductor as a backend object of its own (Dynamo's cache entries are per backend, so
    rows never share compiled code), with ``torch._functorch.config`` patched while it
    compiles (the partition happens then)."""
    import torch._functorch.config as functorch_config

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx
        with functorch_config.patch(functorch_patches or {}):
            return compile_fx(gm, example_inputs)
    return inductor


@dataclasses.dataclass
class Built:
    model: nn.Module
    reports: list[Any] = dataclasses.field(default_factory=list)


def build_strategy(s: Strategy, base: Llama, cfg: LlamaConfig, mm: str) -> Built:
    """A clone of ``base`` (shared parameters) with every block wrapped (and compiled) as
    ``s`` says. Compilation itself happens at the first call."""
    model = shared_clone(base)
    built = Built(model)
    backend: Any = None
    if s.side == "ours":
        from sac_compile import sac_region
        policy = _ours_policy(s.key, cfg)
        for block in model.layers:
            sac_region(policy, name="layer")(block)
        if s.mode == "compiled":
            from sac_compile.compiler import make_backend
            budget = 0.5 if s.key == "ours_budget" else None
            backend = make_backend(memory_budget=budget, on_partition=built.reports.append)
    elif s.key in ("full_ac", "torch_sac", "torch_sac_compiled"):
        for i, block in enumerate(model.layers):
            ctx = None if s.key == "full_ac" else torchtitan_context_fn(mm)
            model.layers[i] = Checkpointed(block, ctx)
    if s.mode == "compiled" and backend is None:
        patches = {"activation_memory_budget": 0.5} if s.key == "torch_budget" else None
        backend = _inductor(patches)
    if backend is not None:
        for block in model.layers:
            block.compile(backend=backend)
    return built


def peak_fields(report: Any) -> dict[str, Any]:
    """The report's figures whose name says ``peak`` (issue 17), {} where it has none: a
    number as it is; an object (``PartitionReport.peak``, a ``MemoryPeak``) as its
    ``bytes``, ``forward``, ``backward`` and ``phase``."""
    out: dict[str, Any] = {}
    for name in dir(report):
        if "peak" not in name.lower() or name.startswith("_"):
            continue
        try:
            value = getattr(report, name)
        except Exception:  # noqa: BLE001 - a property that cannot answer is left out
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
        elif value is not None and not callable(value):
            for part in ("bytes", "forward", "backward", "phase"):
                inner = getattr(value, part, None)
                if isinstance(inner, (int, float, str)) and not isinstance(inner, bool):
                    out[name if part == "bytes" else f"{name}.{part}"] = inner
    return out
