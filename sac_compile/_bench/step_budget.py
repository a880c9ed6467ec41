"""One measured training step per strategy, compiled whole: the step's measured peak
(:mod:`sac_compile.measured_peak`), its modelled peak where ours made the split, the FLOPs
the backward recomputes and the gradients against no checkpointing (issue 27's tests and
``benchmarks/step_budget.py``).

Strategies, each on every ``model.blocks[i]``:

* ``ours``: ``sac_region(relaxed(save_matmuls))``, compiled with ``make_backend(compiler,
  memory_budget=budget)`` (a :class:`~sac_compile.budgets.PeakBudget`: the step's peak);
* ``ours recompute_all``: our regions recomputing everything (full AC, ours);
* ``torch none`` / ``torch SAC`` / ``torch full AC``: no checkpointing, torch's SAC
  (``PREFER_SAVE`` matmuls and attention, the rest ``PREFER_RECOMPUTE``: what torch's
  budget may trade) and ``torch.utils.checkpoint``, split by torch's partitioner with
  ``activation_memory_budget = torch_budget`` where given.

The step: gradients cleared (``None``), garbage collected, forward, the fixtures' loss
(``sum``) and backward, from seed 0; the first step compiles, the second is measured.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from ..policy import CheckpointError
from ..report import PartitionReport
from .gradients import clear_grads, grads_of, max_grad_diff
from .measure import wrap_blocks
from .partition_figures import PartitionFigures, upstream_aot_eager, upstream_backend
from .strategies import full_ac, loss_of, ours, torch_sac_prefer, torch_sac_with

__all__ = ["StepPoint", "run_step", "run_eager_step", "build_model", "STRATEGIES"]

STRATEGIES = ("ours", "ours recompute_all", "torch none", "torch SAC", "torch full AC")


@dataclasses.dataclass
class StepPoint:
    """A measured step. Bytes are above what was allocated when the step began."""

    strategy: str
    budget: Any = None            # ours: the PeakBudget; torch: activation_memory_budget
    status: str = "ok"            # ok | unreachable | error
    measured: int | None = None   # the step's measured peak (gradients included)
    modelled: int | None = None   # ours: the split's modelled step peak
    flops: int | None = None      # FLOPs the backward recomputes
    kept: int | None = None       # bytes the forward hands to the backward
    grad_rel: float | None = None  # largest gradient difference / largest gradient
    note: str = ""
    proposed: Any = None          # unreachable: the budget proposed
    replayed: int | None = None   # eager: ops the backward replayed
    steps: int | None = None      # eager PeakBudget: steps run before the measured one


def build_model(name: str, size: str, dropout: bool = True) -> tuple[torch.nn.Module, tuple]:
    """A fixture model by name: ``gpt2``/``llama`` (Hugging Face, needs transformers),
    else ``fixtures.models``' own; ``dropout=False``: every ``nn.Dropout`` at p=0."""
    if name in ("gpt2", "llama"):
        from .hf_models import make_hf_model
        model, inputs = make_hf_model(name, size=size)
    else:
        from .models import make_model
        model, inputs = make_model(name, size=size)
    if not dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    return model, inputs


def run_step(name: str, size: str, strategy: str, *, compiler: str = "inductor",
             budget: Any = None, torch_budget: float | None = None,
             reference: dict | None = None, dropout: bool = True) -> StepPoint:
    """One compiled step of model ``name`` under ``strategy`` (:data:`STRATEGIES`);
    ``reference``: the gradients of no checkpointing (:func:`reference_step`), to check;
    ``dropout=False``: every ``nn.Dropout`` at p=0 (torch's partitioner recomputes a
    dropout with a fresh mask under ``aot_eager``: its gradients are wrong with one)."""
    from .. import policies
    from ..compiler import make_backend
    from ..measured_peak import measured_peak
    from ..torch_internals import dynamo_reset, functorch_config, inductor_config

    point = StepPoint(strategy, budget if strategy.startswith("ours") else torch_budget)
    model, inputs = build_model(name, size, dropout)
    reports: list[PartitionReport] = []
    figures = PartitionFigures()
    if strategy.startswith("ours"):
        policy = policies.recompute_all if strategy == "ours recompute_all" else \
            policies.relaxed(policies.save_matmuls)
        wrap_blocks(model, ours(policy))
        backend = make_backend(compiler=compiler, memory_budget=budget,
                               on_partition=reports.append)
    else:
        if strategy == "torch SAC":
            wrap_blocks(model, torch_sac_with(torch_sac_prefer))
        elif strategy == "torch full AC":
            wrap_blocks(model, full_ac)
        backend = upstream_backend(figures) if compiler == "inductor" else \
            upstream_aot_eager(figures)
    dynamo_reset()
    fn = torch.compile(model, backend=backend)

    def step() -> None:
        torch.manual_seed(0)
        loss_of(fn(*inputs)).backward()

    patch = {} if torch_budget is None else {"activation_memory_budget": torch_budget}
    try:
        # no caches: the budget must be in force while the graphs are partitioned
        # Inductor draws dropout masks from eager's RNG only with fallback_random (so that
        # its gradients can be checked against eager's), which also allocates the masks
        # its own RNG would compute in the kernels: only where there is a dropout.
        with functorch_config.patch(enable_autograd_cache=False, **patch), \
                inductor_config.patch(force_disable_caches=True,
                                      fallback_random=compiler == "inductor" and dropout):
            step()
            clear_grads(model, inputs)
            gc.collect()
            with measured_peak() as m:
                step()
    except Exception as e:  # noqa: BLE001 - a point that fails is a row that says so
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, CheckpointError):
            cause = cause.__cause__
        point.status = "unreachable" if cause is not None else "error"
        point.note = str(cause or e).split("\n")[0][:160]
        point.proposed = getattr(cause, "proposed_budget", None)
        dynamo_reset()
        return point
    point.measured = m.bytes
    if reference is not None:
        largest = max(float(g.abs().max()) for g in reference.values())
        point.grad_rel = max_grad_diff(reference, grads_of(model, inputs)) / largest
    clear_grads(model, inputs)
    if reports:
        report = reports[-1]
        point.flops = sum(r.recompute_flops for r in reports)
        point.kept = sum(r.saved_bytes for r in reports)
        peaks = [r.peak.step(fused=compiler == "inductor") for r in reports if r.peak]
        point.modelled = max(peaks, default=None)
        point.note = f"{len(reports)} split(s)" + (
            f", budget_peak {report.budget_peak}" if report.budget_peak is not None else "")
    else:
        point.flops, point.kept = figures.recompute_flops, figures.kept_bytes
    dynamo_reset()
    return point


def run_eager_step(name: str, size: str, policy: Any, *, budget: Any = None,
                   reference: dict | None = None, dropout: bool = True,
                   compiler: str | None = None, compile_blocks: bool = False) -> StepPoint:
    """One measured step of model ``name`` with ``apply_regions(model, policy,
    where=<its blocks>, memory_budget=budget)``, eager, or with ``compiler`` the model
    compiled whole (``torch.compile(model, backend=make_backend(compiler=compiler))``),
    or, ``compile_blocks``, each block compiled on its own (``block.compile(backend=...,
    fullgraph=True)``, torchtitan's order): with a :class:`~sac_compile.budgets.PeakBudget`,
    the steps before it calibrate (until its controller measures no more: at most
    ``MAX_STEPS`` + 1 eager, twice that compiled, where each cap tried compiles once
    more), then one more is measured. Compiled, the FLOPs and kept bytes are those of the
    splits the measured step ran (blocks compiled one by one: one split, shared by every
    block, times the block calls)."""
    from ..budgets.step_peak import MAX_STEPS
    from ..compiler import make_backend
    from ..measured_peak import measured_peak
    from ..regions import apply_regions, step_peak_of
    from ..runtime import collect_stats
    from ..torch_internals import dynamo_reset, inductor_config

    label = f"ours {'eager' if compiler is None else compiler + ' apply_regions'}" + \
        (" blocks" if compile_blocks else "")
    point = StepPoint(f"{label} {getattr(policy, '__name__', policy)}", budget)
    model, inputs = build_model(name, size, dropout)
    blocks = {id(b) for b in model.blocks}
    apply_regions(model, policy, where=lambda path, m: id(m) in blocks,
                  memory_budget=budget)
    controller = step_peak_of(model)
    fits = [controller.fits] if controller is not None else []
    reports: list[PartitionReport] = []
    splits: list[PartitionReport] = []  # the splits of the last step that compiled
    fn: Any = model
    if compiler is not None:
        dynamo_reset()
        backend = make_backend(compiler=compiler, on_partition=reports.append)
        if compile_blocks:
            for block in model.blocks:
                block.compile(backend=backend, fullgraph=True)
        else:
            fn = torch.compile(model, backend=backend)

    def step() -> None:
        torch.manual_seed(0)
        made = len(reports)
        loss_of(fn(*inputs)).backward()
        if len(reports) > made:
            splits[:] = reports[made:]

    # (Inductor draws dropout masks from eager's RNG only with fallback_random, so that
    # its gradients can be checked against eager's)
    with inductor_config.patch(fallback_random=compiler == "inductor" and dropout):
        try:
            limit = MAX_STEPS + 2 if compiler is None else 2 * MAX_STEPS + 3
            for point.steps in range(1, limit):
                step()
                clear_grads(model, inputs)
                if not fits or (fits[0] and all(f.done for f in fits[0].values())):
                    break
            gc.collect()
            with measured_peak() as m, collect_stats() as stats:
                step()
        except CheckpointError as e:  # (a BudgetUnreachableError: a row that says so)
            point.status, point.note = "unreachable", str(e).split("\n")[0][:160]
            point.proposed = getattr(e, "proposed_budget", None)
            return point
    point.measured = m.bytes
    if compiler is None:
        point.replayed = len(stats.recomputed_ops)
        point.flops = stats.recomputed_flops
        point.kept = sum(r.nbytes for r in stats.saved)
    elif compile_blocks:
        calls = len(model.blocks)
        if len(splits) != 1:  # (identical blocks share one graph: several is not these)
            point.status, point.note = "error", f"{len(splits)} splits for {calls} blocks"
            return point
        point.flops = splits[0].recompute_flops * calls
        point.kept = splits[0].saved_bytes * calls
        point.note = f"{len(reports)} splits made, 1 in the step x {calls} blocks"
    else:
        point.flops = sum(r.recompute_flops for r in splits)
        point.kept = sum(r.saved_bytes for r in splits)
        point.note = f"{len(reports)} splits made, {len(splits)} in the step"
    if reference is not None:
        largest = max(float(g.abs().max()) for g in reference.values())
        point.grad_rel = max_grad_diff(reference, grads_of(model, inputs)) / largest
    clear_grads(model, inputs)
    if compiler is not None:
        dynamo_reset()
    return point


def reference_step(name: str, size: str, dropout: bool = True) -> dict:
    """The gradients of one step without checkpointing, eager, from seed 0."""
    model, inputs = build_model(name, size, dropout)
    torch.manual_seed(0)
    loss_of(model(*inputs)).backward()
    return grads_of(model, inputs)
