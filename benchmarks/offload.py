"""CPU offload and bf16 ``SaveWithHooks`` against upstream SAC and upstream's offload pass.

On a CUDA device (the GPU rows): a GPT stack (``fixtures.models.GPT``, default d=1024,
16 heads, 8 layers, batch 8 x seq 1024, fp32, dropout 0 so that gradients compare), every
block checkpointed per configuration, compiled with Inductor. Per configuration: peak
``torch.cuda.max_memory_allocated`` during a forward+backward step and the step time
(median of ``--steps`` after ``--warmup``), both as ratios to no activation checkpointing,
and the gradient difference against eager no AC.

Configurations (the same save list everywhere: ``mm``/``addmm`` and the fused attention
kernels, torch's ``create_selective_checkpoint_contexts`` form for upstream):

* no AC: ``backend="inductor"``, no checkpointing (the reference);
* upstream SAC: ``torch.utils.checkpoint`` + ``create_selective_checkpoint_contexts``;
* upstream offload pass: upstream SAC with ``torch._functorch.config.
  enable_activation_offloading = True``. torch offloads only forward values whose node
  carries ``meta["should_offload"]`` and sets that nowhere itself (the flag is marked
  "testing purpose"), so a joint-graph pass (``joint_custom_post_pass``) marks the
  ``mm``/``addmm`` outputs, as a user of the pass has to. Run twice: torch's defaults
  (synchronous copies) and its side stream with prefetching
  (``activation_offload_separate_stream``, ``activation_reload_prefetch``);
* ours SAC: ``sac_region`` with the save list, ``backend=sac_backend``;
* ours offload: ``MUST_CPU_OFFLOAD`` for ``mm``/``addmm`` outputs (``MUST_SAVE`` for the
  attention kernels), ``sac_backend``; our offload defaults (side stream, forward waits
  sunk to the end of the forward graph, reloads prefetched), and once with the waits not
  sunk (``sac_compile.compiler.offload.DEFAULTS`` patched for that row);
* ours bf16 hooks: ``SaveWithHooks(to_bf16, from_bf16)`` for ``mm``/``addmm`` outputs.

Target line: "peak memory <= upstream's best at <= +2% step time over upstream SAC".

Without CUDA, the same configurations are traced on the ``meta`` device at the GPU size
(``--meta-layers`` blocks; attention there is the math path, so the fused-kernel saves
appear as what that path keeps) with aot_eager-level compilation (partition only), and
the script prints what the graphs do: bytes the forward hands to the backward on the
device and on the host, offload/reload node counts, and the bytes that stay on the device
until the end of the forward (values whose offload wait was sunk there).

    PYTHONPATH=. python benchmarks/offload.py [--configs ...] [--steps 10] [--layers 8]

Each GPU row compiles with Inductor (about a minute each at the default size); to stay
within a time limit, run subsets: ``--configs upstream_sac,upstream_offload,ours_offload``
(no AC is always run: it is the reference for the ratios). Written to run on torch 2.11 as
well (checked here on 2.13 only): what an older torch lacks (upstream's offload pass and its flags, the efficient-attention op,
sac_compile itself) turns its rows into "n/a" lines that say why.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import operator
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.models import GPT, GPTBlock, grads_of, max_grad_diff  # noqa: E402
from sac_compile.report import fmt_bytes  # noqa: E402

try:  # ours; on a torch it does not support, the upstream rows still run
    from sac_compile import CheckpointPolicy as CP
    from sac_compile import SaveWithHooks, sac_backend, sac_region
    SAC_COMPILE_MISSING: str | None = None
except Exception as _e:  # noqa: BLE001
    from torch.utils.checkpoint import CheckpointPolicy as CP
    SaveWithHooks = sac_backend = sac_region = None  # type: ignore[assignment]
    SAC_COMPILE_MISSING = (f"sac_compile does not import on torch {torch.__version__} "
                           f"({type(_e).__name__}: {_e}); it needs torch >= 2.13")

aten = torch.ops.aten

#: Linear layers' matmuls: what is offloaded / packed.
LINEAR_OPS = frozenset({aten.mm.default, aten.addmm.default})
#: The fused attention kernels this torch has (saved on the device in every SAC row).
ATTENTION_OPS = frozenset(
    getattr(aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(aten, name))
SAVE_OPS = sorted(LINEAR_OPS | ATTENTION_OPS, key=str)


# --------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------

def to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def from_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


BF16 = SaveWithHooks(to_bf16, from_bf16) if SaveWithHooks is not None else None


def save_policy(ctx, op, *args, **kwargs):
    return CP.MUST_SAVE if op in LINEAR_OPS or op in ATTENTION_OPS else None


def offload_policy(ctx, op, *args, **kwargs):
    if op in LINEAR_OPS:
        return CP.MUST_CPU_OFFLOAD
    return CP.MUST_SAVE if op in ATTENTION_OPS else None


def bf16_policy(ctx, op, *args, **kwargs):
    if op in LINEAR_OPS:
        return BF16
    return CP.MUST_SAVE if op in ATTENTION_OPS else None


for _fn in (save_policy, offload_policy, bf16_policy):
    _fn.cache_hash = f"benchmarks/offload.py:{_fn.__name__}:1"  # AOTAutograd's cache key


# --------------------------------------------------------------------------------------
# What this torch has
# --------------------------------------------------------------------------------------

def torch_offload_support() -> str | None:
    """None when this torch has upstream's activation-offloading pass, else why not."""
    if not hasattr(functorch_config, "enable_activation_offloading"):
        return (f"torch {torch.__version__} has no torch._functorch.config."
                f"enable_activation_offloading (upstream's offload pass)")
    try:
        import torch._functorch._activation_offloading.activation_offloading  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} lacks torch._functorch._activation_offloading ({e})"
    return None


def unavailable(cfg: "Config") -> str | None:
    """Why ``cfg`` cannot run with this torch / sac_compile (None: it can)."""
    if cfg.side == "ours" and SAC_COMPILE_MISSING:
        return SAC_COMPILE_MISSING
    if cfg.policy is offload_policy and importlib.util.find_spec(
            "torch._functorch._activation_offloading.offload_ops") is None:
        return (f"CPU offload under compile needs torch >= 2.12 (torch.ops.ao); this is torch "
                f"{torch.__version__}")
    if cfg.torch_flags.get("enable_activation_offloading"):
        return torch_offload_support()
    return None


def pinned_pool() -> contextlib.AbstractContextManager:
    """torch's pinned-buffer pool for its async offload ops (without it every ``ao.offload``
    allocates fresh pinned memory, ~3 ms each), where this torch has it."""
    try:
        from torch._functorch._activation_offloading.offload_ops import pinned_memory_pool
    except ImportError:
        return contextlib.nullcontext()
    return pinned_memory_pool()


def _torch_flags(**flags: Any) -> dict[str, Any]:
    """The functorch config flags of ``flags`` that this torch has."""
    return {k: v for k, v in flags.items() if hasattr(functorch_config, k)}


# --------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Config:
    key: str
    label: str
    side: str                       # "ref" | "upstream" | "ours"
    wrap: str                       # "none" | "torch_sac" | "region"
    policy: Any = None
    torch_flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    mark_offload: bool = False      # upstream: mark mm/addmm outputs should_offload
    our_defaults: dict[str, bool] = dataclasses.field(default_factory=dict)


CONFIGS = [
    Config("no_ac", "no AC", "ref", "none"),
    Config("upstream_sac", "upstream SAC (save mm + attention)", "upstream", "torch_sac"),
    Config("upstream_offload", "upstream offload pass (torch defaults: sync)", "upstream",
           "torch_sac", torch_flags={"enable_activation_offloading": True}, mark_offload=True),
    Config("upstream_offload_async", "upstream offload pass (side stream + prefetch)",
           "upstream", "torch_sac",
           torch_flags={"enable_activation_offloading": True,
                        "activation_offload_separate_stream": True,
                        "activation_reload_prefetch": True}, mark_offload=True),
    Config("ours_sac", "ours SAC (sac_backend, save mm + attention)", "ours", "region",
           save_policy),
    Config("ours_offload", "ours MUST_CPU_OFFLOAD mm (our defaults)", "ours", "region",
           offload_policy),
    Config("ours_offload_sink", "ours MUST_CPU_OFFLOAD mm, waits sunk", "ours", "region",
           offload_policy, our_defaults={"activation_offload_sink_wait": True}),
    Config("ours_bf16", "ours bf16 SaveWithHooks on mm", "ours", "region", bf16_policy),
]


@contextlib.contextmanager
def our_offload_defaults(overrides: dict[str, bool]):
    """Patch ``sac_compile.compiler.offload.DEFAULTS`` for one row (a private table: the
    row says so when this sac_compile has none)."""
    if not overrides:
        yield
        return
    from sac_compile.compiler import offload
    table = getattr(offload, "DEFAULTS", None)
    if not isinstance(table, dict):
        raise RuntimeError("this sac_compile has no compiler.offload.DEFAULTS to patch")
    saved = dict(table)
    table.update(overrides)
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


class EfficientAttentionGPTBlock(GPTBlock):
    """The fixture's ``GPTBlock`` with its attention as the fused memory-efficient kernel,
    called directly. On the meta device ``F.scaled_dot_product_attention`` takes the math
    path (bmm, softmax, bmm); this is the kernel a GPU runs for fp32, so the traced graphs
    keep what the GPU's would. Same computation as ``GPTBlock.forward`` otherwise."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]


def _torch_sac_forward(fwd: Callable[..., Any]) -> Callable[..., Any]:
    import torch.utils.checkpoint as tuc
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    ctx = functools.partial(create_selective_checkpoint_contexts, SAVE_OPS)
    return lambda *a, **k: tuc.checkpoint(fwd, *a, use_reentrant=False, context_fn=ctx, **k)


def build(cfg: Config, args: argparse.Namespace, device: str, layers: int):
    """The GPT stack for ``cfg`` on ``device``, its input, and the model."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta" if device == "meta" else "cpu"):
            model = GPT(d=args.d, n_heads=args.heads, n_layers=layers, d_out=64,
                        dropout=0.0)
            x = torch.randn(args.batch, args.seq, args.d)
    model = model.to(device=device, dtype=dtype).train()
    x = x.to(device=device, dtype=dtype).requires_grad_(True)
    for i, block in enumerate(model.blocks):
        if device == "meta" and hasattr(aten, "_scaled_dot_product_efficient_attention"):
            block.__class__ = EfficientAttentionGPTBlock
        if cfg.wrap == "torch_sac":
            block.forward = _torch_sac_forward(block.forward)
        elif cfg.wrap == "region":
            sac_region(cfg.policy, name=f"blocks.{i}")(block)
    return model, x


# --------------------------------------------------------------------------------------
# Upstream: marking values for torch's offload pass
# --------------------------------------------------------------------------------------

def mark_linear_outputs(graph: torch.fx.Graph) -> None:
    """``should_offload`` on every mm/addmm output of the joint graph (torch's pass then
    offloads those its ``can_offload`` accepts among the forward's saved values)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target in LINEAR_OPS:
            node.meta["should_offload"] = True


def _mark_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MarkLinearOutputs(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            mark_linear_outputs(graph)

        def uuid(self) -> Any:
            return "benchmarks/offload.py:mark_linear_outputs:1"
    return MarkLinearOutputs()


# --------------------------------------------------------------------------------------
# Graph-level figures (any device; the CPU path runs them on "meta")
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class GraphFigures:
    device_bytes: int = 0         # what the forward hands to the backward, on the device
    host_bytes: int = 0           # ... in host memory (offloaded)
    offloads: int = 0             # ao.offload / device_put-to-CPU nodes in the forward
    reloads: int = 0              # ao.reload / device_put-to-device nodes in the backward
    held_to_end: int = 0          # device bytes kept alive to the forward's end by sunk waits
    recomputed: int = 0           # forward ops the backward runs again
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def forward_end_bytes(self) -> int:
        """Device bytes alive at the end of the forward (saved + not yet released)."""
        return self.device_bytes + self.held_to_end


def _val_bytes(node: torch.fx.Node) -> tuple[int, str]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0, ""
    return val.numel() * val.element_size(), val.device.type


def _is_transfer(node: torch.fx.Node, to_cpu: bool) -> bool:
    if node.op != "call_function":
        return False
    name = str(node.target)
    if name.startswith("ao.offload") and to_cpu:
        return True
    if name.startswith("ao.reload") and not to_cpu:
        return True
    if "device_put" in name or name.endswith("_to_copy.default"):
        _, dev = _val_bytes(node)
        src = node.args[0] if node.args else None
        _, src_dev = _val_bytes(src) if isinstance(src, torch.fx.Node) else (0, "")
        return (dev == "cpu") == to_cpu and src_dev not in ("", dev)
    return False


def graph_figures(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                  static_names: set[str]) -> GraphFigures:
    g = GraphFigures()
    for node in bw.graph.find_nodes(op="placeholder"):
        if "tangents" in node.name or node.name in static_names:
            continue
        nbytes, dev = _val_bytes(node)
        if dev == "cpu":
            g.host_bytes += nbytes
        elif dev:
            g.device_bytes += nbytes
    g.offloads = sum(_is_transfer(n, True) for n in fw.graph.nodes)
    g.reloads = sum(_is_transfer(n, False) for n in bw.graph.nodes)
    # A wait with a keepalive after which the forward computes nothing more: the device
    # value it keeps alive is only released at the end of the forward.
    nodes = list(fw.graph.nodes)
    last_compute = max((i for i, n in enumerate(nodes) if n.op == "call_function"
                        and not str(n.target).startswith("ao.")
                        and n.target is not operator.getitem), default=-1)
    for i, n in enumerate(nodes):
        if (n.op == "call_function" and str(n.target).startswith("ao.wait_tensor")
                and i > last_compute and len(n.args) > 1
                and isinstance(n.args[1], torch.fx.Node)):
            g.held_to_end += _val_bytes(n.args[1])[0]
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    g.recomputed = sum(1 for n in bw.graph.nodes if n.op == "call_function"
                       and n.name in fw_ops and n.target is not operator.getitem)
    return g


def _static_names(gm: torch.fx.GraphModule, kwargs: dict) -> set[str]:
    primals = [n.name for n in gm.graph.find_nodes(op="placeholder")
               if str(n.target).startswith("primals")]
    return {primals[i] for i in kwargs.get("static_lifetime_input_indices") or ()
            if i < len(primals)}


def trace_graphs(cfg: Config, args: argparse.Namespace) -> tuple[GraphFigures | None, str]:
    """Compile ``cfg`` on the meta device (partition only) and read its graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from sac_compile.compiler import SACPartitioner

    captured: list[tuple[torch.fx.GraphModule, torch.fx.GraphModule, set[str]]] = []
    reports: list[Any] = []

    def boxed(gm, _):
        return make_boxed_func(gm.forward)

    if cfg.side == "ours":
        class Capturing(SACPartitioner):
            def __call__(self, gm, joint_inputs, **kwargs):
                static = _static_names(gm, kwargs)
                fw, bw = super().__call__(gm, joint_inputs, **kwargs)
                captured.append((fw, bw, static))
                return fw, bw
        partition = Capturing(on_partition=reports.append)
    else:
        def partition(gm, joint_inputs, **kwargs):
            static = _static_names(gm, kwargs)
            if cfg.mark_offload:
                mark_linear_outputs(gm.graph)
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            captured.append((fw, bw, static))
            return fw, bw

    backend = aot_autograd(fw_compiler=boxed, bw_compiler=boxed, partition_fn=partition)
    model, x = build(cfg, args, "meta", args.meta_layers)
    torch._dynamo.reset()
    _clear_offload_state()
    note = ""
    try:
        with functorch_config.patch(_torch_flags(**cfg.torch_flags)), \
                our_offload_defaults(cfg.our_defaults):
            torch.compile(model, backend=backend)(x)  # the forward; backward needs a device
    except Exception as e:  # noqa: BLE001 - graphs captured before a run-time failure count
        if not captured:
            return None, _why(e)
        note = "(forward not run on meta past the offload: graphs captured)"
    figs = GraphFigures()
    for fw, bw, static in captured:
        g = graph_figures(fw, bw, static)
        for f in dataclasses.fields(GraphFigures):
            if f.name != "notes":
                setattr(figs, f.name, getattr(figs, f.name) + getattr(g, f.name))
    for r in reports:
        figs.notes.extend(n for n in r.notes if "offload" in n.lower() or "hooks" in n.lower())
    return figs, note


def _why(e: BaseException) -> str:
    """The root cause's type and first line (Dynamo wraps backend errors)."""
    while True:
        inner = e.__cause__ or getattr(e, "inner_exception", None)
        if not isinstance(inner, BaseException) or inner is e:
            break
        e = inner
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _clear_offload_state() -> None:
    """torch's offload ops keep process-wide state (streams, pending waits, a pinned pool);
    a meta run leaves entries the next one would reuse."""
    try:
        from torch._functorch._activation_offloading import offload_ops as ops
    except ImportError:
        return
    for name in ("_clear_wait_registry", "_pool_clear"):
        fn = getattr(ops, name, None)
        if callable(fn):
            fn()
    streams = getattr(ops, "_transfer_streams", None)
    if isinstance(streams, dict):
        streams.clear()


def run_meta(args: argparse.Namespace, configs: list[Config]) -> None:
    print(f"\nGraph level, meta device (no data): GPT d={args.d}, {args.heads} heads, "
          f"{args.meta_layers} layers, batch {args.batch} x seq {args.seq}, {args.dtype}; "
          f"aot_eager (partition only); attention as the fused memory-efficient kernel (what a "
          f"GPU runs for fp32); upstream's reload prefetching is off (it times ops by running "
          f"them, which needs a device).")
    head = (f"{'configuration':<48} {'device':>10} {'host':>10} {'offl':>4} {'reld':>4} "
            f"{'held*':>10} {'fwd end*':>10} {'recomp':>6}")
    print(head)
    print("-" * len(head))
    notes = []
    for cfg in configs:
        if unavailable(cfg):
            print(f"{cfg.label:<48} n/a: {unavailable(cfg)}")
            continue
        t0 = time.perf_counter()
        if cfg.torch_flags.get("activation_reload_prefetch"):
            cfg = dataclasses.replace(cfg, torch_flags={
                k: v for k, v in cfg.torch_flags.items() if k != "activation_reload_prefetch"})
        figs, note = trace_graphs(cfg, args)
        if figs is None:
            print(f"{cfg.label:<48} failed: {note}")
            continue
        print(f"{cfg.label:<48} {fmt_bytes(figs.device_bytes, 1):>10} {fmt_bytes(figs.host_bytes, 1):>10} "
              f"{figs.offloads:>4} {figs.reloads:>4} {fmt_bytes(figs.held_to_end, 1):>10} "
              f"{fmt_bytes(figs.forward_end_bytes, 1):>10} {figs.recomputed:>6}  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        notes.extend(f"  {cfg.key}: {n}" for n in figs.notes)
    print("device/host: bytes the forward hands to the backward (parameters excluded); "
          "offl/reld: offload/reload nodes;\nheld*: device bytes an offloaded value keeps "
          "until the forward's end (its wait sunk there); fwd end*: device + held, the "
          "activation bytes on the device when the forward ends (an estimate of what the "
          "step's peak holds besides the working set).")
    if notes:
        print("our reports:")
        print("\n".join(notes))


# --------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    cfg: Config
    status: str = "ok"
    peak: int = 0                 # max_memory_allocated during a step
    base: int = 0                 # allocated before the step (parameters, input)
    ms: float = 0.0               # median step time
    grad_rel: float | None = None
    compile_s: float = 0.0
    note: str = ""


def compiled_model(cfg: Config, model: torch.nn.Module) -> Callable[..., Any]:
    return torch.compile(model, backend=sac_backend if cfg.side == "ours" else "inductor")


def run_cuda_row(cfg: Config, args: argparse.Namespace, ref: dict | None) -> Row:
    row = Row(cfg)
    if unavailable(cfg):
        row.status, row.note = "n/a", unavailable(cfg)
        return row
    torch._dynamo.reset()
    _clear_offload_state()
    gc.collect()
    torch.cuda.empty_cache()
    model, x = build(cfg, args, "cuda", args.layers)
    try:
        marks = {"joint_custom_post_pass": _mark_pass()} if cfg.mark_offload else {}
        with functorch_config.patch(_torch_flags(**cfg.torch_flags)), \
                torch._inductor.config.patch(marks), our_offload_defaults(cfg.our_defaults), \
                pinned_pool():
            fn = compiled_model(cfg, model)

            def step() -> None:
                fn(x).float().sum().backward()

            t0 = time.perf_counter()
            step()  # compiles
            torch.cuda.synchronize()
            row.compile_s = time.perf_counter() - t0
            if ref is not None:
                got = {k: v.cpu() for k, v in grads_of(model, (x,)).items()}
                row.grad_rel = max_grad_diff(ref, got) / \
                    max(g.abs().max().item() for g in ref.values())
            times, peaks = [], []
            for i in range(args.warmup + args.steps):
                model.zero_grad(set_to_none=True)
                x.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                step()
                torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                    peaks.append(torch.cuda.max_memory_allocated())
                    row.base = base
            row.ms = statistics.median(times) * 1e3
            row.peak = max(peaks)
    except Exception as e:  # noqa: BLE001 - one row's failure does not end the run
        row.status, row.note = "failed", _why(e)
    return row


def reference_grads_cuda(args: argparse.Namespace) -> dict:
    cfg = CONFIGS[0]
    model, x = build(cfg, args, "cuda", args.layers)
    model(x).float().sum().backward()
    return {k: v.cpu() for k, v in grads_of(model, (x,)).items()}  # off the device


def run_cuda(args: argparse.Namespace, configs: list[Config]) -> None:
    print(f"\nCUDA: {torch.cuda.get_device_name()}; GPT d={args.d}, {args.heads} heads, "
          f"{args.layers} layers, batch {args.batch} x seq {args.seq}, {args.dtype}, dropout 0; "
          f"Inductor; median of {args.steps} steps after {args.warmup} warm-up")
    ref = reference_grads_cuda(args) if not args.no_grad_check else None
    if "no_ac" not in {c.key for c in configs}:
        configs = [CONFIGS[0], *configs]
    rows = []
    for cfg in configs:
        row = run_cuda_row(cfg, args, ref)
        rows.append(row)
        print(f"  {cfg.label:<48} {row.status:<6} peak {fmt_bytes(row.peak, 1):>10} step "
              f"{row.ms:8.2f} ms (compile {row.compile_s:.0f} s) {row.note}", flush=True)
    base = next(r for r in rows if r.cfg.key == "no_ac")
    if base.status != "ok":
        print(f"no AC failed ({base.note}): no ratios")
        return
    print(f"\n{'configuration':<48} {'peak':>10} {'peak/noAC':>9} {'act/noAC':>8} "
          f"{'step ms':>8} {'time/noAC':>9} {'grad rel':>9}")
    for r in rows:
        if r.status != "ok":
            print(f"{r.cfg.label:<48} {r.status}: {r.note}")
            continue
        act = (r.peak - r.base) / max(base.peak - base.base, 1)
        grad = f"{r.grad_rel:.1e}" if r.grad_rel is not None else "-"
        print(f"{r.cfg.label:<48} {fmt_bytes(r.peak, 1):>10} {r.peak / base.peak:>9.3f} "
              f"{act:>8.3f} {r.ms:>8.2f} {r.ms / base.ms:>9.3f} {grad:>9}")
    print("peak: max_memory_allocated in the step; act: the same above what was allocated "
          "before it (parameters, input); grad rel: max |grad diff| against eager no AC "
          "over the largest gradient")
    print(target_line(rows))


def target_line(rows: list[Row]) -> str:
    ok = [r for r in rows if r.status == "ok"]
    ups = [r for r in ok if r.cfg.side == "upstream"]
    sac = next((r for r in ok if r.cfg.key == "upstream_sac"), None)
    ours = [r for r in ok if r.cfg.side == "ours"]
    if not ups or sac is None or not ours:
        return ("peak memory <= upstream's best at <= +2% step time over upstream SAC: "
                "n/a (upstream SAC or our rows missing)")
    best = min(ups, key=lambda r: r.peak)
    hits = [r for r in ours if r.peak <= best.peak and r.ms <= 1.02 * sac.ms]
    detail = (f"upstream's best peak {fmt_bytes(best.peak, 1)} ({best.cfg.label}), upstream SAC "
              f"{sac.ms:.2f} ms")
    if hits:
        h = min(hits, key=lambda r: r.peak)
        return (f"peak memory <= upstream's best at <= +2% step time over upstream SAC: yes "
                f"({h.cfg.label}: {fmt_bytes(h.peak, 1)}, {h.ms / sac.ms:.3f}x upstream SAC; "
                f"{detail})")
    closest = min(ours, key=lambda r: r.peak)
    return (f"peak memory <= upstream's best at <= +2% step time over upstream SAC: no "
            f"(lowest of ours: {closest.cfg.label} {fmt_bytes(closest.peak, 1)}, "
            f"{closest.ms / sac.ms:.3f}x upstream SAC; {detail})")


# --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """This script's flags (``benchmarks/gpu_check.py`` takes its defaults from here)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="",
                        help="comma-separated keys: " + ", ".join(c.key for c in CONFIGS))
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8, help="blocks on the GPU")
    parser.add_argument("--meta-layers", type=int, default=2,
                        help="blocks traced on the meta device (no CUDA)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-grad-check", action="store_true")
    parser.add_argument("--meta", action="store_true",
                        help="the graph-level (meta device) table even with CUDA")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    wanted = {k.strip() for k in args.configs.split(",") if k.strip()}
    unknown = wanted - {c.key for c in CONFIGS}
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {[c.key for c in CONFIGS]}")
    configs = [c for c in CONFIGS if not wanted or c.key in wanted]
    if args.dtype == "bf16":
        configs = [c for c in configs if c.key != "ours_bf16"]
        print("ours bf16 SaveWithHooks: skipped, the model is already bf16")

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    if SAC_COMPILE_MISSING:
        print(f"ours: n/a: {SAC_COMPILE_MISSING}")
    why = torch_offload_support()
    print("upstream offload pass: " + (why or "torch._functorch.config."
                                       "enable_activation_offloading (present)"))
    cuda = torch.cuda.is_available()
    if cuda:
        run_cuda(args, configs)
    else:
        print("GPU rows (peak max_memory_allocated, step time, ratios to no AC, the target "
              "line) need a CUDA device: torch.cuda.is_available() is False here. Graph-level "
              "figures follow.")
    if not cuda or args.meta:
        run_meta(args, configs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
