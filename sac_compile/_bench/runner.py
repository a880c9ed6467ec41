"""Run every strategy on one model: kept bytes, recompute, time, gradient difference.

Strategies (keys in report.json in brackets):


* no AC [``no_ac``]: plain forward and backward; the reference for time and gradients.
* full AC [``full_ac``]: ``torch.utils.checkpoint(use_reentrant=False)`` on every block.
* torch SAC eager [``torch_sac_eager``]: upstream selective checkpointing
  (``create_selective_checkpoint_contexts``) saving matmuls and attention, every block.
* torch SAC compiled [``torch_sac_compiled``]: the same under ``torch.compile`` with Inductor
  and torch's own partitioner (``min_cut_rematerialization_partition``).
* ours eager [``ours_eager``]: ``sac_region(policy)`` on every block, the eager runtime.
* ours compiled [``ours_compiled``]: the same with ``backend=sac_backend`` (Inductor).
* ours eager, budget [``ours_eager_budget``]: ``sac_region(relaxed(policy), memory_budget=...)``
  on every block, as ``apply_regions`` gives it (a fraction: each block's own; bytes: one
  budget for all blocks, priced together), the eager runtime; measured on the third step
  (the first records and plans; a whole-model budget prices its regions on the second).
  A :class:`~sac_compile.budgets.PeakBudget` (``--budget peak:...``): ``apply_regions(copy,
  relaxed(policy), where=<its blocks>, memory_budget=budget)`` on a copy of the model, its
  calibration steps run first (the step-peak controller measures them), then measured.
* ours budget [``ours_budget``]: ours compiled with ``make_backend(memory_budget=...)`` and
  the same policy with its MUSTs relaxed to PREFERs (MUST_SAVE -> PREFER_SAVE, ...), so that
  the budget may evict what the policy would save. A fraction is of the activation bytes the
  unconstrained partition (of that relaxed policy) saves, per forward/backward split.

How each figure is obtained:

* kept bytes: eager strategies are counted at run time with ``_bench.measure``
  (``measure_noac``, ``measure_torch_sac``, ``_bench.strategies.measure_ours``; full AC: the
  bytes autograd packs outside the checkpoints), i.e. every activation alive for backward
  when forward ends, inside and outside the checkpointed blocks. Compiled strategies: the
  bytes the forward graph hands to the backward graph, from the partition (ours: its
  ``PartitionReport``; upstream: the same figure read off torch's partition). Parameters
  and buffers are never counted.
* peak: measured, every row alike (``sac_compile.measured_peak``): the most bytes torch's
  allocator held at once during one step (forward, backward, the gradients it makes),
  above what it held when the step began; the step after the measurements (compiled: after
  the compiling one), gradients cleared before it. CUDA: ``max_memory_allocated``; CPU: the
  profiler's allocation events replayed in time order (Inductor's buffers included).
  ``model_peak_bytes`` (compiled rows): the partitioner's peak model of its split
  (``sac_compile.compiler.peak``: activations only, the largest split's), an explanation
  beside the measurement. ``grad_bytes``: what the step left allocated (its gradients).
  ``working_bytes`` (CPU): the measured peak of what the step allocates and also frees
  (activations, recomputed values, temporaries; not the gradients it leaves), the measured
  figure beside the model's.
* recompute FLOPs: eager: ``FlopCounterMode`` over a whole step, minus no AC's count;
  compiled: the FLOPs of the ops the backward graph recomputes, by the same
  ``torch.utils.flop_counter`` rules.
* time: ``_bench.measure.interleaved_medians`` (round-robin, rotating order) and
  ``paired`` ratios to no AC, one run.
* grad diff: ``_bench.gradients.max_grad_diff`` against no AC from the same seed. Compiled
  strategies run with ``torch._inductor.config.fallback_random = True`` so that dropout draws
  the same masks as eager mode.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn as nn

from ..budgets import PeakBudget
from ..measured_peak import measured_peak
from ..policies import relaxed
from ..policy import CheckpointError
from ..report import fmt_bytes
from ..tensor_memory import param_storages
from ..torch_internals import dynamo_reset
from .measure import (TORCH_SAVE_MATMUL_OPS, SavedBytes, interleaved_medians, measure_noac,
                      measure_torch_sac, paired, wrap_blocks, wrapped_blocks)
from .gradients import clear_grads, grads_of, max_grad_diff
from .partition_figures import OnPartition, PartitionFigures, upstream_backend
from .strategies import (as_blocked_model, copy_model, full_ac, loss_of, measure_ours,
                         ours, torch_sac)

log = logging.getLogger("sac_compile.report")

__all__ = ["STRATEGIES", "GRAD_RTOL", "Row", "ReportConfig", "Target", "run_report"]


@dataclasses.dataclass
class Target:
    """The model to measure: what ``--model`` / ``explain TARGET`` resolved to."""

    label: str
    fn: Any                       # an nn.Module or a callable
    inputs: tuple
    is_fixture: bool              # a built-in model (``_bench.models``)
    size: str | None = None


class Progress(Protocol):
    def say(self, text: str) -> None: ...
    def set_phase(self, text: str) -> None: ...
    def advance(self) -> None: ...


#: (key, label, kind) in the order of the table.
STRATEGIES: list[tuple[str, str, str]] = [
    ("no_ac", "no AC", "eager"),
    ("full_ac", "full AC (torch.utils.checkpoint)", "eager"),
    ("torch_sac_eager", "torch SAC eager (save matmuls)", "eager"),
    ("torch_sac_compiled", "torch SAC compiled (inductor)", "compiled"),
    ("ours_eager", "ours eager", "eager"),
    ("ours_compiled", "ours compiled (sac_backend)", "compiled"),
    ("ours_eager_budget", "ours eager, memory budget", "eager"),
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
    peak_bytes: int | None = None       # measured step peak (sac_compile.measured_peak)
    model_peak_bytes: int | None = None  # compiled: the partitioner's peak model
    grad_bytes: int | None = None       # allocated at the step's end (its gradients)
    working_bytes: int | None = None    # CPU: measured peak of what the step also frees
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
        given = budget.label() if hasattr(budget, "label") else \
            f"{budget:g}" if isinstance(budget, float) else fmt_bytes(budget, 2)
        self.rows["ours_budget"].label = (f"ours compiled, budget {given} "
                                          f"({cfg.policy_label}, MUSTs relaxed)")
        self.rows["ours_eager_budget"].label = self.rows["ours_budget"].label.replace(
            "ours compiled", "ours eager")

    # -- helpers ---------------------------------------------------------------------------
    def _copy(self) -> nn.Module:
        return copy_model(self.template)

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

    def _measure_peak(self, row: Row, step: Callable[[], Any], grads_model: nn.Module
                      ) -> None:
        """One more step under :func:`~sac_compile.measured_peak.measured_peak`: its peak
        and what it left allocated. Gradients are cleared (and garbage collected) before it,
        so that the step frees nothing made before it (the CPU profiler could not see
        that free: it knows only the sizes of what it saw allocated)."""
        clear_grads(grads_model, self.inputs)
        gc.collect()
        with measured_peak(self.cfg.device) as m:
            step()
        clear_grads(grads_model, self.inputs)
        row.peak_bytes, row.grad_bytes, row.working_bytes = m.bytes, m.end, m.working

    def _flops(self, step: Callable[[], Any]) -> int:
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as fc:
            step()
        return int(fc.get_total_flops())

    # -- eager -------------------------------------------------------------------------------
    def eager(self, key: str) -> None:
        row, model, inputs, seed = self.rows[key], self.template, self.inputs, self.cfg.seed
        if key == "no_ac":
            res = measure_noac(model, inputs, seed=seed, loss=loss_of)
            row.kept_bytes, row.recomputed_ops = res.saved_bytes, 0
            wrap = None
        elif key == "full_ac":
            exclude = param_storages(model)
            clear_grads(model, inputs)
            torch.manual_seed(seed)
            with wrapped_blocks(model, full_ac), SavedBytes(exclude) as outside:
                out = loss_of(model(*inputs))
            out.backward()
            res_grads = grads_of(model, inputs)
            clear_grads(model, inputs)
            row.kept_bytes = outside.nbytes
            # The ops full AC re-runs: upstream SAC with an empty save list recomputes the
            # same ops, and its recompute mode counts them.
            row.recomputed_ops = measure_torch_sac(model, inputs, [], seed=seed,
                                                   loss=loss_of).recomputed_ops
            wrap = full_ac
        elif key == "torch_sac_eager":
            res = measure_torch_sac(model, inputs, TORCH_SAVE_MATMUL_OPS, seed=seed,
                                    loss=loss_of)
            row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
            wrap = torch_sac
        elif key == "ours_eager":
            res = measure_ours(model, inputs, self.cfg.policy, seed=seed, loss=loss_of)
            row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
            wrap = ours(self.cfg.policy)
        elif key == "ours_eager_budget" and isinstance(self.cfg.budget, PeakBudget):
            return self._eager_peak_budget(row)
        elif key == "ours_eager_budget":  # the first step records and plans
            wrap = ours(relaxed(self.cfg.policy), self.cfg.budget, len(model.blocks))
            for _ in range(2):  # (a whole-model budget prices its regions on step 2)
                res = measure_ours(model, inputs, seed=seed, loss=loss_of, regions=wrap)
            res = measure_ours(model, inputs, seed=seed, loss=loss_of, regions=wrap)
            row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
            row.note = res.note
        else:  # pragma: no cover
            raise KeyError(key)
        row.grads = res_grads if key == "full_ac" else res.grads
        ctx = (lambda: wrapped_blocks(model, wrap)) if wrap else contextlib.nullcontext
        row.step = self._step_fn(model, model, ctx)
        row.flops_total = self._flops(row.step)
        self._measure_peak(row, row.step, model)
        clear_grads(model, inputs)

    def _eager_peak_budget(self, row: Row) -> None:
        """The eager budget row under a :class:`~sac_compile.budgets.PeakBudget`: a copy of
        the model with ``apply_regions(copy, relaxed(policy), where=<its blocks>,
        memory_budget=budget)`` (the step-peak controller is the model's step hooks), its
        calibration steps run until the controller measures no more (at most
        ``MAX_STEPS`` + 1), then measured as every eager row. Blocks that are functions,
        not modules, have no hooks to mark a step: skipped, saying so."""
        from ..budgets.step_peak import MAX_STEPS
        from ..regions import apply_regions, step_peak_of
        model, inputs = self._copy(), self.inputs
        if isinstance(self.cfg.budget.value, float):
            row.status, row.note = "skipped", ("a PeakBudget in eager mode is bytes (the "
                                               "step is measured; a fraction is compiled only)")
            return
        if not all(isinstance(b, nn.Module) for b in model.blocks):
            row.status, row.note = "skipped", ("a PeakBudget in eager mode needs the blocks "
                                               "as modules (apply_regions' step hooks)")
            return
        blocks = {id(b) for b in model.blocks}
        apply_regions(model, relaxed(self.cfg.policy), memory_budget=self.cfg.budget,
                      where=lambda path, m: id(m) in blocks)
        controller = step_peak_of(model)
        step = self._step_fn(model, model)
        try:
            for _ in range(MAX_STEPS + 1):
                step()
                if controller is None or all(f.done for f in controller.fits.values()):
                    break
            # kept and recomputed as every eager row counts them (the blocks already
            # regions: measure_ours only observes their inputs)
            res = measure_ours(model, inputs, seed=self.cfg.seed, loss=loss_of,
                               regions=lambda i, forward: forward)
        except CheckpointError as e:  # a budget out of reach (BudgetUnreachableError)
            row.status, row.note = "failed", str(e).removeprefix("sac_compile: ")
            self.progress.say(f"{row.label}: failed: {row.note}")
            return
        row.grads = res.grads
        row.kept_bytes, row.recomputed_ops = res.saved_bytes, res.recomputed_ops
        row.note = controller.notes[-1] if controller is not None and controller.notes else ""
        row.step = step
        row.flops_total = self._flops(step)
        self._measure_peak(row, step, model)
        clear_grads(model, inputs)

    # -- compiled ----------------------------------------------------------------------------
    def compiled(self, key: str) -> None:
        row = self.rows[key]
        figures = PartitionFigures()
        model = self._copy()
        if key == "torch_sac_compiled":
            wrap_blocks(model, torch_sac)
            backend = upstream_backend(figures)
            what = "torch's min_cut_rematerialization_partition"
        else:
            from ..compiler import make_backend
            budget = self.cfg.budget if key == "ours_budget" else None
            policy = self.cfg.policy if budget is None else relaxed(self.cfg.policy)
            wrap_blocks(model, ours(policy))
            backend = make_backend(memory_budget=budget, on_partition=self._on_partition(
                figures))
            what = "the SAC min-cut partitioner" + (f" with memory_budget={budget!r}"
                                                     if budget is not None else "")
        compiled = torch.compile(model, backend=backend)
        self.progress.say(f"compiling {row.label}: Dynamo trace -> AOTAutograd joint graph -> "
                          f"{what} -> Inductor C++ code generation (first call; cached after)")
        step = self._step_fn(compiled, model)
        t0 = time.perf_counter()
        try:
            step()
        except CheckpointError as e:   # e.g. a memory budget below what must be saved
            dynamo_reset()
            row.status, row.note = "failed", str(e).removeprefix("sac_compile: ")
            self.progress.say(f"{row.label}: failed: {row.note}")
            return
        row.compile_s = time.perf_counter() - t0
        row.grads = grads_of(model, self.inputs)
        clear_grads(model, self.inputs)
        if not figures.splits:
            row.note = "no partition was observed (an AOTAutograd cache hit?)"
        row.kept_bytes = figures.kept_bytes
        row.model_peak_bytes = figures.peak_bytes
        self._measure_peak(row, step, model)  # the second call: compiled, cached
        row.recompute_flops = figures.recompute_flops
        row.recomputed_ops = figures.recomputed_ops
        row.step = step
        self.progress.say(f"compiled {row.label} in {row.compile_s:.1f} s: "
                          f"{len(figures.splits)} forward/backward split(s), keeps "
                          f"{fmt_bytes(row.kept_bytes, 2)}, recomputes {row.recomputed_ops} ops")

    def _on_partition(self, figures: PartitionFigures) -> Callable[[Any], None]:
        return OnPartition(figures, self.progress)

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
    from ..torch_internals import functorch_config as _functorch_config
    from ..torch_internals import inductor_config as _inductor_config
    runner = _Runner(cfg, progress)
    with _inductor_config.patch(fallback_random=True), \
            _functorch_config.patch(enable_autograd_cache=False):
        return runner.run()
