"""``python -m sac_compile report``: one model, seven checkpointing strategies, one row each.

Strategies (keys in report.json in brackets):

* no AC [``no_ac``]: plain forward and backward; the reference for time and gradients.
* full AC [``full_ac``]: ``torch.utils.checkpoint(use_reentrant=False)`` on every block.
* torch SAC eager [``torch_sac_eager``]: upstream selective checkpointing
  (``create_selective_checkpoint_contexts``) saving matmuls and attention, every block.
* torch SAC compiled [``torch_sac_compiled``]: the same under ``torch.compile`` with Inductor
  and torch's own partitioner (``min_cut_rematerialization_partition``).
* ours eager [``ours_eager``]: ``sac_region(policy)`` on every block, the eager runtime.
* ours compiled [``ours_compiled``]: the same with ``backend=sac_backend`` (Inductor).
* ours budget [``ours_budget``]: ours compiled with ``make_backend(memory_budget=...)`` and
  the same policy with its MUSTs relaxed to PREFERs (MUST_SAVE -> PREFER_SAVE, ...), so that
  the budget may evict what the policy would save. A fraction is of the activation bytes the
  unconstrained partition (of that relaxed policy) saves, per forward/backward split.

How each figure is obtained:

* kept bytes: eager strategies are counted at run time with ``fixtures.measure``
  (``measure_noac``, ``measure_torch_sac``, ``sac_compile.demo.measure_ours``; full AC: the
  bytes autograd packs outside the checkpoints), i.e. every activation alive for backward
  when forward ends, inside and outside the checkpointed blocks. Compiled strategies: the
  bytes the forward graph hands to the backward graph, from the partition (ours: its
  ``PartitionReport``; upstream: the same figure read off torch's partition). Parameters
  and buffers are never counted.
* peak: CUDA ``max_memory_allocated`` above the step's start; on CPU, the runtime's own
  accounting of live saved values: the kept bytes (saved values only grow in forward and
  only shrink in backward, apart from recomputed values), stated as such.
* recompute FLOPs: eager: ``FlopCounterMode`` over a whole step, minus no AC's count;
  compiled: the FLOPs of the ops the backward graph recomputes, by the same
  ``torch.utils.flop_counter`` rules.
* time: ``fixtures.measure.interleaved_medians`` (round-robin, rotating order) and
  ``paired`` ratios to no AC, one run.
* grad diff: ``fixtures.models.max_grad_diff`` against no AC from the same seed. Compiled
  strategies run with ``torch._inductor.config.fallback_random = True`` so that dropout draws
  the same masks as eager mode.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from fixtures.measure import (SavedBytes, TORCH_SAVE_MATMUL_OPS, fmt_bytes, interleaved_medians,
                              measure_noac, measure_torch_sac, paired, param_storages, wrap_blocks,
                              wrapped_blocks)
from fixtures.models import clear_grads, grads_of, max_grad_diff

from .args import Target, UsageError
from .progress import Progress

log = logging.getLogger("sac_compile.cli")

__all__ = ["STRATEGIES", "Row", "run_report", "format_table", "write_json", "machine_label"]

#: (key, label, kind) in the order of the table.
STRATEGIES: list[tuple[str, str, str]] = [
    ("no_ac", "no AC", "eager"),
    ("full_ac", "full AC (torch.utils.checkpoint)", "eager"),
    ("torch_sac_eager", "torch SAC eager (save matmuls)", "eager"),
    ("torch_sac_compiled", "torch SAC compiled (inductor)", "compiled"),
    ("ours_eager", "ours eager", "eager"),
    ("ours_compiled", "ours compiled (sac_backend)", "compiled"),
    ("ours_budget", "ours compiled, memory budget", "compiled"),
]

#: Gradient differences above this (relative to the largest reference gradient) are flagged.
GRAD_RTOL = 1e-3


@dataclasses.dataclass
class Row:
    key: str
    label: str
    kind: str
    status: str = "ok"                  # ok | skipped | failed
    kept_bytes: int | None = None
    peak_bytes: int | None = None
    recompute_flops: int | None = None
    recomputed_ops: int | None = None
    time_ratio: float | None = None     # median of per-round ratios to no AC
    time_ms: float | None = None        # median step time
    grad_diff: float | None = None
    grad_rel: float | None = None
    compile_s: float | None = None
    rounds: int | None = None           # timed rounds behind time_ratio
    note: str = ""
    grads: dict[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    step: Callable[[], Any] | None = dataclasses.field(default=None, repr=False)
    flops_total: int | None = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("grads", "step", "flops_total"):
            d.pop(k)
        return d


# --------------------------------------------------------------------------------------
# Models: a per-strategy copy whose blocks can be wrapped
# --------------------------------------------------------------------------------------

class _CallableModule(nn.Module):
    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class _WholeModel(nn.Module):
    """A model without ``.blocks`` (or a plain function), checkpointed as one block."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        inner = inner if isinstance(inner, nn.Module) else _CallableModule(inner)
        self.blocks = nn.ModuleList([inner])

    def forward(self, *args: Any) -> Any:
        return self.blocks[0](*args)


def as_blocked_model(fn: Any) -> nn.Module:
    if isinstance(fn, nn.Module) and isinstance(getattr(fn, "blocks", None), (nn.ModuleList, list,
                                                                               tuple)):
        return fn
    return _WholeModel(fn)


def loss_of(out: Any) -> torch.Tensor:
    """The fixtures' loss (``out.sum()``), extended to outputs that are tuples/dicts."""
    if isinstance(out, torch.Tensor):
        return out.sum()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise UsageError("the model's output has no floating-point tensor that requires grad; "
                         "return a differentiable output (report runs forward and backward)")
    return functools.reduce(lambda a, b: a + b, (t.float().sum() for t in leaves))


# --------------------------------------------------------------------------------------
# Block wrappers
# --------------------------------------------------------------------------------------

def _full_ac(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a, **k: tuc.checkpoint(fwd, *a, use_reentrant=False, **k)


def _torch_sac(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
    ctx = functools.partial(tuc.create_selective_checkpoint_contexts, TORCH_SAVE_MATMUL_OPS)
    return lambda *a, **k: tuc.checkpoint(fwd, *a, use_reentrant=False, context_fn=ctx, **k)


def relax_musts(policy: Any) -> Callable[..., Any]:
    """``policy`` with MUST_SAVE/MUST_RECOMPUTE/MUST_CPU_OFFLOAD (and ``True``) answered as
    the matching PREFER: what a memory budget may override."""
    from ..policy import CheckpointPolicy as CP, normalize_policy

    fn = normalize_policy(policy)
    relaxed = {CP.MUST_SAVE: CP.PREFER_SAVE, CP.MUST_RECOMPUTE: CP.PREFER_RECOMPUTE,
               CP.MUST_CPU_OFFLOAD: CP.PREFER_CPU_OFFLOAD, True: CP.PREFER_SAVE}

    def relaxed_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(ctx, op, *args, **kwargs)
        return relaxed.get(out, out) if isinstance(out, (CP, bool)) else out
    return relaxed_policy


def _ours(policy: Any) -> Callable[[int, Callable[..., Any]], Callable[..., Any]]:
    from ..regions import sac_region

    def wrap(i: int, fwd: Callable[..., Any]) -> Callable[..., Any]:
        return sac_region(policy, name=f"blocks.{i}")(fwd)
    return wrap


# --------------------------------------------------------------------------------------
# Compiled: upstream's partition, recorded
# --------------------------------------------------------------------------------------

class _PartitionFigures:
    """Saved bytes / recomputed ops / recompute FLOPs of each forward-backward split."""

    def __init__(self) -> None:
        self.splits: list[dict[str, Any]] = []

    @property
    def kept_bytes(self) -> int:
        return sum(s["saved_bytes"] for s in self.splits)

    @property
    def recompute_flops(self) -> int:
        return sum(s["recompute_flops"] for s in self.splits)

    @property
    def recomputed_ops(self) -> int:
        return sum(s["recomputed_ops"] for s in self.splits)

    def add_report(self, report: Any) -> None:
        self.splits.append({"saved_bytes": report.saved_bytes,
                            "recompute_flops": report.recompute_flops,
                            "recomputed_ops": len(report.recomputed)})


def _upstream_recorder(figures: _PartitionFigures) -> Any:
    """A ``CustomPartitionerFn`` that calls torch's ``min_cut_rematerialization_partition``
    with exactly the arguments Inductor would pass it, and records what the split saves."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    global _UpstreamRecorder
    if _UpstreamRecorder is None:
        class UpstreamRecorder(CustomPartitionerFn):
            def __init__(self, figures: _PartitionFigures) -> None:
                self.figures = figures

            def uuid(self) -> str:
                return "sac_compile.cli.report:upstream-recorder:1"

            def __reduce__(self) -> Any:  # Inductor's cache pickles its config: by name
                return (_upstream_recorder, (_PartitionFigures(),))

            def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any):
                return _record_upstream(self.figures, gm, joint_inputs, **kwargs)

        UpstreamRecorder.__qualname__ = UpstreamRecorder.__name__ = "_UpstreamRecorder"
        _UpstreamRecorder = UpstreamRecorder
    return _UpstreamRecorder(figures)


_UpstreamRecorder: Any = None


def _record_upstream(figures: _PartitionFigures, gm: torch.fx.GraphModule, joint_inputs: Any,
                     **kwargs: Any) -> Any:
    import operator

    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from ..compiler import costs
    static_idx = set(kwargs.get("static_lifetime_input_indices") or ())
    primals = [n.name for n in gm.graph.find_nodes(op="placeholder")
               if str(n.target).startswith("primals")]
    static = {primals[i] for i in static_idx if i < len(primals)}
    joint = {n.name: n for n in gm.graph.nodes}
    fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
    fw_ops = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    recomputed = [joint[n.name] for n in bw.graph.nodes
                  if n.op == "call_function" and n.name in fw_ops and n.name in joint
                  and n.target is not operator.getitem and not costs.is_sym(n)]
    saved = [joint[n.name] for n in bw.graph.find_nodes(op="placeholder")
             if n.name in joint and "tangents" not in n.name and n.name not in static
             and not costs.is_sym(joint[n.name])]
    figures.splits.append({
        "saved_bytes": sum(costs.nbytes(n) for n in saved),
        "recompute_flops": sum(costs.flops(n) for n in recomputed),
        "recomputed_ops": len(recomputed)})
    return fw, bw


class _OnPartition:
    """``on_partition`` callback: records the split and says what it did (the partitioner
    itself logs the report to the ``sac_partition`` artifact). Pickles as a no-op (Inductor's cache pickles the
    partitioner, callback included, to build its key)."""

    def __init__(self, figures: _PartitionFigures, progress: Progress | None) -> None:
        self.figures = figures
        self.progress = progress

    def __reduce__(self) -> Any:
        return (_OnPartition, (_PartitionFigures(), None))

    def __call__(self, report: Any) -> None:
        self.figures.add_report(report)
        if self.progress is not None:
            self.progress.say(f"  partitioned: saves {fmt_bytes(report.saved_bytes)} in "
                              f"{len(report.saved)} values, recomputes {len(report.recomputed)}"
                              f" ops in backward")


def _upstream_backend(figures: _PartitionFigures) -> Callable[..., Any]:
    recorder = _upstream_recorder(figures)

    def inductor_with_torch_partitioner(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": recorder})
    return inductor_with_torch_partitioner


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class ReportConfig:
    target: Target
    policy_label: str
    policy: Any
    budget: float | int
    device: str
    steps: int
    seed: int
    compile: bool = True
    time_budget_s: float | None = None   # stop timing rounds early (after 3) once spent


def _cuda_peak(device: str) -> contextlib.AbstractContextManager:
    @contextlib.contextmanager
    def measure():
        box: dict[str, int] = {}
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            yield box
            torch.cuda.synchronize()
            box["peak"] = torch.cuda.max_memory_allocated() - base
        else:
            yield box
    return measure()


class _Runner:
    def __init__(self, cfg: ReportConfig, progress: Progress) -> None:
        self.cfg = cfg
        self.progress = progress
        self.template = as_blocked_model(cfg.target.fn)
        self.inputs = cfg.target.inputs
        self.rows: dict[str, Row] = {k: Row(k, label, kind) for k, label, kind in STRATEGIES}
        self.rows["ours_eager"].label = f"ours eager ({cfg.policy_label})"
        self.rows["ours_compiled"].label = f"ours compiled ({cfg.policy_label})"
        budget = cfg.budget
        self.rows["ours_budget"].label = (
            (f"ours compiled, budget {budget:g}" if isinstance(budget, float)
             else f"ours compiled, budget {fmt_bytes(budget)}") + f" ({cfg.policy_label}, "
            f"MUSTs relaxed)")

    # -- helpers ---------------------------------------------------------------------------
    def _copy(self) -> nn.Module:
        return copy.deepcopy(self.template)

    def _step_fn(self, model: Callable[..., Any], grads_model: nn.Module,
                 ctx: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], Any]:
        inputs, seed = self.inputs, self.cfg.seed

        def step() -> None:
            clear_grads(grads_model, inputs)
            torch.manual_seed(seed)
            with ctx():
                out = loss_of(model(*inputs))
            out.backward()
        return step

    def _flops(self, step: Callable[[], Any]) -> int:
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as fc:
            step()
        return int(fc.get_total_flops())

    def _grads_after(self, step: Callable[[], Any], model: nn.Module) -> dict[str, torch.Tensor]:
        step()
        grads = grads_of(model, self.inputs)
        clear_grads(model, self.inputs)
        return grads

    # -- eager -------------------------------------------------------------------------------
    def eager(self, key: str) -> None:
        row, model, inputs, seed = self.rows[key], self.template, self.inputs, self.cfg.seed
        with _cuda_peak(self.cfg.device) as peak:
            if key == "no_ac":
                res = measure_noac(model, inputs, seed=seed, loss=loss_of)
                row.kept_bytes, row.recomputed_ops = res.saved_bytes, 0
                wrap = None
            elif key == "full_ac":
                exclude = param_storages(model)
                clear_grads(model, inputs)
                torch.manual_seed(seed)
                with wrapped_blocks(model, _full_ac), SavedBytes(exclude) as outside:
                    out = loss_of(model(*inputs))
                out.backward()
                res_grads = grads_of(model, inputs)
                clear_grads(model, inputs)
                row.kept_bytes = outside.nbytes
                # The ops full AC re-runs: upstream SAC with an empty save list recomputes the
                # same ops, and its recompute mode counts them.
                row.recomputed_ops = measure_torch_sac(model, inputs, [], seed=seed,
                                                       loss=loss_of).recomputed_ops
                wrap = _full_ac
            elif key == "torch_sac_eager":
                res = measure_torch_sac(model, inputs, TORCH_SAVE_MATMUL_OPS, seed=seed,
                                        loss=loss_of)
                row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
                wrap = _torch_sac
            elif key == "ours_eager":
                from ..demo import measure_ours
                res = measure_ours(model, inputs, self.cfg.policy, seed=seed, loss=loss_of)
                row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
                wrap = _ours(self.cfg.policy)
            else:  # pragma: no cover
                raise KeyError(key)
        row.grads = res_grads if key == "full_ac" else res.grads
        row.peak_bytes = peak.get("peak", row.kept_bytes)
        ctx = (lambda: wrapped_blocks(model, wrap)) if wrap else contextlib.nullcontext
        row.step = self._step_fn(model, model, ctx)
        row.flops_total = self._flops(row.step)
        clear_grads(model, inputs)

    # -- compiled ----------------------------------------------------------------------------
    def compiled(self, key: str) -> None:
        row = self.rows[key]
        figures = _PartitionFigures()
        model = self._copy()
        if key == "torch_sac_compiled":
            wrap_blocks(model, _torch_sac)
            backend = _upstream_backend(figures)
            what = "torch's min_cut_rematerialization_partition"
        else:
            from ..compiler import make_backend
            budget = self.cfg.budget if key == "ours_budget" else None
            policy = self.cfg.policy if budget is None else relax_musts(self.cfg.policy)
            wrap_blocks(model, _ours(policy))
            backend = make_backend(memory_budget=budget, on_partition=self._on_partition(
                figures))
            what = "the SAC min-cut partitioner" + (f" with memory_budget={budget!r}"
                                                     if budget is not None else "")
        compiled = torch.compile(model, backend=backend)
        self.progress.say(f"compiling {row.label}: Dynamo trace -> AOTAutograd joint graph -> "
                          f"{what} -> Inductor C++ code generation (first call; cached after)")
        step = self._step_fn(compiled, model)
        t0 = time.perf_counter()
        from ..policy import CheckpointError
        try:
            with _cuda_peak(self.cfg.device) as peak:
                step()
        except CheckpointError as e:   # e.g. a memory budget below what must be saved
            torch._dynamo.reset()
            row.status, row.note = "failed", str(e).removeprefix("sac_compile: ")
            self.progress.say(f"{row.label}: failed: {row.note}")
            return
        row.compile_s = time.perf_counter() - t0
        row.grads = grads_of(model, self.inputs)
        clear_grads(model, self.inputs)
        if not figures.splits:
            row.note = "no partition was observed (an AOTAutograd cache hit?)"
        row.kept_bytes = figures.kept_bytes
        row.peak_bytes = peak.get("peak", row.kept_bytes)
        row.recompute_flops = figures.recompute_flops
        row.recomputed_ops = figures.recomputed_ops
        row.step = step
        self.progress.say(f"compiled {row.label} in {row.compile_s:.1f} s: "
                          f"{len(figures.splits)} forward/backward split(s), keeps "
                          f"{fmt_bytes(row.kept_bytes)}, recomputes {row.recomputed_ops} ops")

    def _on_partition(self, figures: _PartitionFigures) -> Callable[[Any], None]:
        return _OnPartition(figures, self.progress)

    # -- all -------------------------------------------------------------------------------
    def run(self) -> list[Row]:
        order = [k for k, _, kind in STRATEGIES if kind == "eager"]
        order += [k for k, _, kind in STRATEGIES if kind == "compiled"]
        for key in order:
            row = self.rows[key]
            self.progress.set_phase(f"measuring {row.label}")
            t0 = time.perf_counter()
            if row.kind == "compiled" and not self.cfg.compile:
                row.status, row.note = "skipped", "--no-compile"
            elif row.kind == "eager":
                self.eager(key)
            else:
                self.compiled(key)
            log.debug("measured %s in %.2f s", key, time.perf_counter() - t0)
            self.progress.advance()

        live = {k: r for k, r in self.rows.items() if r.status == "ok"}
        base_flops = self.rows["no_ac"].flops_total or 0
        for r in live.values():
            if r.kind == "eager":
                r.recompute_flops = max(0, (r.flops_total or 0) - base_flops)
        ref = self.rows["no_ac"].grads or {}
        scale = max((g.abs().max().item() for g in ref.values()), default=0.0) or 1.0
        for r in live.values():
            r.grad_diff = max_grad_diff(ref, r.grads or {})
            r.grad_rel = r.grad_diff / scale

        self.progress.set_phase(f"timing {len(live)} strategies, {self.cfg.steps} rounds")
        self.progress.say(f"timing: 1 warm-up round + {self.cfg.steps} interleaved rounds of "
                          f"{len(live)} strategies")

        def ticking(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                out = fn()
                self.progress.advance()
                return out
            return call

        # interleaved_medians collects garbage before every call; with Dynamo and Inductor
        # loaded a full collection takes a good part of a second. Freezing what exists now
        # leaves it only the objects the steps create.
        gc.collect()
        gc.freeze()
        try:
            timings = interleaved_medians({k: ticking(r.step) for k, r in live.items()},
                                          reps=self.cfg.steps, warmup=1,
                                          budget_s=self.cfg.time_budget_s)
        finally:
            gc.unfreeze()
        for k, r in live.items():
            r.time_ms = timings[k].median * 1e3
            r.time_ratio = paired(timings, k, "no_ac")
            r.rounds = len(timings[k].samples)
        return [self.rows[k] for k, _, _ in STRATEGIES]


def run_report(cfg: ReportConfig, progress: Progress) -> list[Row]:
    """Measure every strategy; compiled ones under ``fallback_random`` (eager RNG) and with
    the AOTAutograd cache off (so partitions are observed; Inductor's code cache stays on)."""
    import torch._functorch.config as _functorch_config
    import torch._inductor.config as _inductor_config
    runner = _Runner(cfg, progress)
    with _inductor_config.patch(fallback_random=True), \
            _functorch_config.patch(enable_autograd_cache=False):
        return runner.run()


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------

def _fmt_flops(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def format_table(rows: list[Row], device: str) -> str:
    peak_head = "peak (CUDA)" if device.startswith("cuda") else "peak* (CPU)"
    header = ["strategy", "kept", peak_head, "recompute FLOPs", "ops recomputed",
              "time vs no AC", "max |grad diff|"]
    body = []
    for r in rows:
        if r.status != "ok":
            body.append([r.label, "-", "-", "-", "-", "-", f"{r.status}: {r.note}"])
            continue
        body.append([
            r.label, fmt_bytes(r.kept_bytes), fmt_bytes(r.peak_bytes),
            _fmt_flops(r.recompute_flops),
            "-" if r.recomputed_ops is None else str(r.recomputed_ops),
            f"{r.time_ratio:.2f}x" if r.time_ratio is not None else "-",
            ("0" if not r.grad_diff else f"{r.grad_diff:.1e}")
            + ("" if r.grad_rel is None or r.grad_rel <= GRAD_RTOL else "  (!)"),
        ])
    widths = [max(len(row[i]) for row in [header, *body])
              for i in range(len(header) - 1)]

    def fmt(row: list[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row[:-1], widths))]
        return "  ".join(cells + [row[-1]])
    line = "  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1])
    return "\n".join([fmt(header), line, *map(fmt, body)])


def machine_label() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, {platform.system()} {platform.machine()}"


def meta(cfg: ReportConfig, elapsed: float) -> dict[str, Any]:
    t = cfg.target
    n_params = sum(p.numel() for p in as_blocked_model(t.fn).parameters())
    return {
        "model": t.label, "size": t.size, "policy": cfg.policy_label,
        "budget": cfg.budget, "device": cfg.device, "steps": cfg.steps, "seed": cfg.seed,
        "parameters": n_params,
        "inputs": [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in t.inputs],
        "blocks": len(as_blocked_model(t.fn).blocks),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": machine_label(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "elapsed_s": round(elapsed, 1),
        "definitions": {
            "kept_bytes": "activation bytes kept for backward (eager: counted at run time, "
                          "inside and outside the blocks; compiled: what the partition's "
                          "forward hands to its backward); parameters and buffers excluded",
            "peak_bytes": ("torch.cuda.max_memory_allocated during the step above its start"
                           if cfg.device.startswith("cuda") else
                           "CPU: the runtime's own accounting of live saved values (bytes "
                           "alive for backward when forward ends), not an allocator figure"),
            "recompute_flops": "FLOPs of forward ops re-run in backward, torch.utils."
                               "flop_counter rules (eager: FlopCounterMode over the step minus "
                               "no AC's; compiled: the partition's recomputed nodes)",
            "time_ratio": "median over interleaved rounds of step time / no AC's step time "
                          "in the same round",
            "grad_diff": "max |grad - no-AC grad| over parameters and inputs, same seed "
                         "(compiled: inductor fallback_random, eager RNG)",
        },
    }


def write_json(path: str, cfg: ReportConfig, rows: list[Row], elapsed: float) -> None:
    doc = {"meta": meta(cfg, elapsed), "strategies": [r.to_json() for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
