"""A :class:`~sac_compile.budgets.PeakBudget` under Inductor, held by the allocator's figure
rather than by the model: the compiled graph's step is run once, on stand-ins for its
inputs, before the backend hands it out; where the measured peak is above the cap, the split is
made again under a cap lowered by the excess, and measured again. Where a lowering did not
lower the measured peak (the model's error is not the same at every cut), the next is
lowered by the model's error at that split (measured minus modelled) or twice the excess,
the more; below the least the model finds, the model's least is tried. Last, where none of
those measured within the cap (or the model finds no split under it), the cuts that keep
the least (with the region-boundary floor and without it, cheapest first, each first with
the values it recomputes put back while its modelled peak stays within its own) are
measured: the model's error is not the same at every cut, so its least is not always the
least measured (HF GPT-2, bench, at full AC's measured peak 25,882,760 B: its least
measured 26,569,888 B; the cut keeping the least 25,367,696 B with 3.49 GFLOPs
recomputed, with values put back 25,795,624 B with 1.14).

Why: the cut is chosen before Inductor runs, against the model of what Inductor allocates
(:mod:`.inductor_alloc`). The model follows Inductor's allocation rules but not all of its
reordering; near full AC's peak it was measured 3% low (HF Llama, bench; 8.5% at a cut
a tie picked before the split was deterministic), so
a split the model fits could peak above the budget. A measured byte beats a modelled one:
the trial is the step as the user's will run it (the same compiled code, the same shapes),
measured by :mod:`sac_compile.measured_peak` (CPU: the profiler's allocation events; an
accelerator: its allocator's peak statistic), and costs one forward and backward per try at
compile time.

The trial runs on stand-ins for the graph's tensor inputs (:func:`trial_inputs`): those the
graph writes (a buffer updated in place, as AOTAutograd's analysis of the graph says; every
input where it says nothing) are copies, every other one an alias of the user's tensor
(a new leaf on its storage, read and never written), so the trial holds no second copy of
the parameters and the user's parameters, buffers, ``.grad`` and hooks are untouched; the
RNG state is restored afterwards (the user's random stream is unchanged). It is skipped,
with a report note saying so, where it cannot measure: a profiler already running (CPU),
inputs that are tensor subclasses, no output needing a gradient (nothing to budget), or a
trial that raised (the step itself then raises where the user runs it). On an accelerator
the trial resets the device's peak statistic (as ``measured_peak`` does) and, while it
runs, holds a step's working set (its activations, the gradients it makes, copies of what
the graph writes) beside the parameters: what the user's first step holds.
Each try is a partition
whose report goes to ``on_partition`` only for the split kept, its notes saying what was
measured.
Still above the cap after :data:`MAX_TRIES` and the cuts keeping the least:
:class:`~sac_compile.errors.BudgetUnreachableError` with the least measured peak as the
proposed budget (or, where the model found no split under the cap and the cuts keeping the
least measured above it, the model's).

A try AOTAutograd's cache serves (another process split it) is measured as a fresh one:
each try's key names the cap it was split under, not what its compile measured, so a first
split measured above the cap is in the cache too, under the key looked up first. A
PeakBudget fraction's graphs are not served (:func:`cache_may_serve`: their cap only a
partition gives); a served split the trial cannot measure is a warning.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch

from ..budgets import PeakBudget
from ..budgets.step_peak import stop_for_a_trial
from ..errors import BudgetUnreachableError
from ..torch_internals import aot_mutated_inputs
from .partition import SACPartitioner

__all__ = ["fit_measured", "cache_may_serve", "trial_step_peak", "trial_inputs", "MAX_TRIES"]

MAX_TRIES = 5  # splits tried (the first, then each under a cap lowered by the excess)
# then the cuts keeping the least: with the floor and without it, each with values put back
# first, then as it is (``peak_budget._least_kept_tries``)
LEAST_KEPT_TRIES = 4


def fit_measured(compile_once: Callable[[], Any], example_inputs: Sequence[Any],
                 partitioner: SACPartitioner, graph_budget: PeakBudget | None = None,
                 graph_key: str | None = None) -> Any:
    """``compile_once()`` (the backend's compile of one Dynamo graph, ``graph_key``: which),
    made again under a lower cap while its measured step peak is above ``partitioner``'s
    PeakBudget, or ``graph_budget``: the one the graph is split under without the
    partitioner's (a graph of every region of ``apply_regions(..., memory_budget=
    PeakBudget(n))``)."""
    budget = partitioner.memory_budget
    if not isinstance(budget, PeakBudget):
        budget = graph_budget if budget is None else None
    if budget is None:
        return compile_once()
    partitioner.graph_key = graph_key
    try:
        return _fit(compile_once, example_inputs, partitioner, budget)
    finally:
        partitioner.graph_key = None


def _fit(compile_once: Callable[[], Any], example_inputs: Sequence[Any],
         partitioner: SACPartitioner, budget: PeakBudget) -> Any:
    measured: list[tuple[int, int]] = []  # (margin, measured peak) per try
    emit, partitioner.on_partition = partitioner.on_partition, None  # the kept split's only
    try:
        try:
            return _lowered(compile_once, example_inputs, partitioner, budget, measured, emit)
        except BudgetUnreachableError as e:
            compiled, peak, cap = _least_kept(compile_once, example_inputs, partitioner,
                                              budget, measured, emit)
            if compiled is not None:
                return compiled
            if peak is not None and measured and peak < min(p for _, p in measured):
                raise _still_above(budget, cap, [*measured, (0, peak)], None) from e
            raise e
    finally:
        partitioner.peak_margin, partitioner.least_kept = 0, 0
        partitioner.on_partition = emit


@dataclasses.dataclass(frozen=True)
class _Try:
    """One split, compiled and measured (:func:`_split_and_measure`)."""

    compiled: Any
    report: Any
    cap: int | None       # the user's cap in bytes (None: nothing to measure against)
    peak: int | None      # the trial's measured step peak (None: not measured, why_not)
    why_not: str


def _split_and_measure(compile_once: Callable[[], Any], example_inputs: Sequence[Any],
                       partitioner: SACPartitioner, budget: PeakBudget, margin: int,
                       least_kept: int = 0) -> _Try:
    """``compile_once()`` split under the cap lowered by ``margin`` (or at the
    ``least_kept``-th cut keeping the least), then its step measured against the user's cap.
    ``cap`` None: nothing to measure against (not partitioned, an inference graph, or split
    by torch's partitioner: no regions). BudgetUnreachableError: the model finds no split."""
    partitioner.peak_margin, partitioner.least_kept = margin, least_kept
    partitioner.last_report, hits = None, _aot_cache_hits()
    with _backward_compiled_now(), aot_mutated_inputs(len(example_inputs)) as written:
        compiled = compile_once()
    report = partitioner.last_report
    if report is None and _aot_cache_hits() > hits:
        # Served by AOTAutograd's cache: split in an earlier compile (another process)
        # under this try's key, which names the cap lowered by `margin`, not what that
        # compile measured: a first try measured above the cap and lowered is in the
        # cache too, under the first try's key. So what is served is measured as a fresh
        # split is.
        if not cache_may_serve(budget):
            raise RuntimeError(f"sac_compile: AOTAutograd's cache served a graph split "
                               f"under {budget.label()}, whose regions were not keyed for "
                               f"it (a bug: please report it)")
        cap = budget.value
    elif report is None or report.budget_bytes is None:
        return _Try(compiled, report, None, None, "")
    else:
        cap = report.budget_bytes + margin  # the user's cap (the report's is lowered)
    stop_for_a_trial()  # (a step-peak controller's measurement of this step)
    peak, why_not = trial_step_peak(compiled, example_inputs, written=written[0])
    return _Try(compiled, report, cap, peak, why_not)


def _kept(t: _Try, partitioner: SACPartitioner, note: str,
          emit: Callable[[Any], Any] | None) -> Any:
    """The split of ``t``, measured within its cap: its report says so (a split the cache
    served counts its graph instead), and goes to ``on_partition``."""
    if t.report is not None:
        t.report.notes.append(note)
        t.report.budget_bytes, t.report.budget_measured = t.cap, t.peak
    elif partitioner.memory_budget is not None and partitioner.graph_key:
        partitioner.count_graph(partitioner.graph_key, t.peak, t.cap)  # (served)
    return _emitted(t.compiled, t.report, emit)


def _least_kept(compile_once: Callable[[], Any], example_inputs: Sequence[Any],
                partitioner: SACPartitioner, budget: PeakBudget,
                measured: list[tuple[int, int]], emit: Callable[[Any], Any] | None
                ) -> tuple[Any, int | None, int]:
    """The last tries, where every split the model chose measured above the cap (or the
    model finds none under it): the cuts that keep the least (with the region-boundary
    floor and without it), cheapest first, each with values put back first
    (``peak_budget._least_kept_tries``), each measured. The model's error is not the same
    at every cut, so its least is not always the least measured (HF GPT-2, bench, Inductor:
    the model's least split under ``PeakBudget(25,882,760)``, full AC's measured peak,
    measured 26,569,888 B; the cheapest cut keeping the least with values put back,
    25,795,624 B).
    ``(compiled, the least measured peak, the cap)``, compiled None where none measures
    within the cap or none can be tried (the caller raises)."""
    least: int | None = None
    cap = budget.value if isinstance(budget.value, int) else 0
    for k in range(1, LEAST_KEPT_TRIES + 1):
        try:
            t = _split_and_measure(compile_once, example_inputs, partitioner, budget, 0, k)
        except BudgetUnreachableError:
            break  # (no k-th)
        if t.cap is None or t.peak is None:
            break  # (nothing to measure against, or not measured)
        cap, least = t.cap, t.peak if least is None else min(least, t.peak)
        if t.peak <= t.cap:
            note = _held_note(budget, t.cap, [*measured, (0, t.peak)])
            return _kept(t, partitioner, note + " (the last, the cut keeping the least)",
                         emit), t.peak, t.cap
    return None, least, cap


def _lowered(compile_once: Callable[[], Any], example_inputs: Sequence[Any],
             partitioner: SACPartitioner, budget: PeakBudget,
             measured: list[tuple[int, int]], emit: Callable[[Any], Any] | None) -> Any:
    """The split under the cap, made again under a cap lowered while its measured step is
    above (see the module docstring); ``measured``: each try's (margin, peak), appended."""
    margin = cap = 0  # (cap: the user's, in bytes, from the first split's report)
    for _ in range(MAX_TRIES):
        try:
            t = _split_and_measure(compile_once, example_inputs, partitioner, budget, margin)
        except BudgetUnreachableError as e:
            if not measured:
                raise
            # lowered below the least the model finds: try that least (its split of
            # the lowest modelled peak), unless it was tried
            least_margin = cap - e.least_bytes
            if least_margin <= max(m for m, _ in measured):
                raise _still_above(budget, cap, measured, e) from e
            margin = least_margin
            continue
        if t.cap is None:
            return _emitted(t.compiled, t.report, emit)
        cap = t.cap
        if t.peak is None:
            if t.report is not None:
                t.report.notes.append(f"{budget.label()}: the step was not measured before "
                                      f"the first run ({t.why_not}); it holds as the model "
                                      f"does")
            else:  # (served: the split of this key, which its compile may have lowered)
                from ..logs import log
                log.warning("sac_compile: %s: a split AOTAutograd's cache served was not "
                            "measured before its first run (%s); it may be one its first "
                            "compile measured above the cap", budget.label(), t.why_not)
            return _emitted(t.compiled, t.report, emit)
        measured.append((margin, t.peak))
        if t.peak <= cap:
            return _kept(t, partitioner, _held_note(budget, cap, measured), emit)
        # lowered by the excess; where the last lowering did not lower the measured
        # peak, by the model's error at this split (what it measured above its modelled
        # step peak) if that is more, else by twice the excess
        excess = t.peak - cap
        stuck = len(measured) > 1 and t.peak >= measured[-2][1]
        modelled = t.report.budget_peak if t.report is not None else None
        error = t.peak - (modelled or t.peak)
        margin = max(margin + excess * (2 if stuck else 1), error if stuck else 0)
    raise _still_above(budget, cap, measured, None)


@contextlib.contextmanager
def _backward_compiled_now() -> Iterator[None]:
    """AOTAutograd compiles the backward when it first runs, by default: the trial runs it
    inside Dynamo's compile, where that second compile's metrics collide with the first's;
    so the backward is compiled with the forward (as torch's ``standalone_compile`` does)."""
    from ..torch_internals import functorch_config
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


def _aot_cache_hits() -> int:
    from ..torch_internals import dynamo_counters
    return dynamo_counters["aot_autograd"].get("autograd_cache_hit", 0)


def cache_may_serve(budget: Any) -> bool:
    """Whether AOTAutograd's cache may serve a graph split under ``budget`` (the backend
    then keys its regions for it): yes, but under a PeakBudget fraction, whose cap is the
    unconstrained split's modelled peak, which only a partition gives - a served split
    could not be measured against it. (Inductor's own cache still serves the code.)"""
    return not (isinstance(budget, PeakBudget) and not isinstance(budget.value, int))


def _emitted(compiled: Any, report: Any, emit: Callable[[Any], Any] | None) -> Any:
    if emit is not None and report is not None:
        emit(report)
    return compiled


def _held_note(budget: PeakBudget, cap: int, measured: list[tuple[int, int]]) -> str:
    tries = "; then ".join(f"{p:,} B with the cap lowered by {m:,} B" if m else
                           f"{p:,} B" for m, p in measured)
    return (f"{budget.label()}: the compiled step, run once on stand-ins for its inputs before "
            f"the first step, measured {tries} (cap {cap:,} B)")


def _still_above(budget: PeakBudget, cap: int, measured: list[tuple[int, int]],
                 cause: BudgetUnreachableError | None) -> BudgetUnreachableError:
    from ..budgets.unreachable import unreachable_error
    from ..report import fmt_bytes
    least = min(p for _, p in measured)
    why = ("the model cannot lower the split's peak further" if cause is not None else
           f"after {len(measured)} splits, each under a cap lowered by what the last one "
           "measured above it")
    return unreachable_error(
        f"{budget.label()} (cap {fmt_bytes(cap)})",
        f"measured, the compiled step, run once before the first step, peaked at "
        f"{', '.join(f'{p:,} B' for _, p in measured)}, and {why}",
        ["checkpoint more values (a policy that recomputes more, or MUST_RECOMPUTE where "
         "the policy saves)"],
        budget=budget, least=least,  # (measured: the least proposed, not the model's)
        unconstrained=max(least, cause.unconstrained_bytes if cause is not None else 0))


def trial_step_peak(compiled: Callable[..., Any], example_inputs: Sequence[Any], *,
                    written: Collection[int] | None = None) -> tuple[int | None, str]:
    """The measured peak of one step of ``compiled`` (its forward, then the backward of
    the sum of every output needing a gradient) on stand-ins for ``example_inputs``: what
    the step allocates above its start, the gradients it makes included. ``(None, why)``
    where it cannot be measured.

    ``written``: the positions of the inputs ``compiled`` writes (AOTAutograd's analysis);
    those are copied, every other tensor input is aliased (a detached leaf on the same
    storage: read, never written, its ``.grad`` and hooks not the original's), so the trial
    holds no copy of the parameters. ``None`` (not known): every tensor input is copied."""
    from ..measured_peak import measured_peak
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return None, "its inputs include tensor subclasses"
    devices = {t.device for t in tensors}
    device = next((d for d in devices if d.type != "cpu"), torch.device("cpu"))
    from ..torch_internals import profiler_enabled, pytree
    if device.type == "cpu" and profiler_enabled():
        return None, "a profiler is running, and the CPU measurement is the profiler's"
    args = trial_inputs(example_inputs, written)
    cuda = [d for d in devices if d.type == "cuda"]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"), torch.enable_grad():
        try:
            with measured_peak(device) as m:
                outputs = [o for o in pytree.tree_leaves(compiled(*args))
                           if isinstance(o, torch.Tensor) and o.requires_grad]
                if not outputs:
                    return None, "no output needs a gradient"
                # the gradients of a loss that sums them: a one, expanded (not allocated)
                torch.autograd.backward(outputs, [
                    torch.ones((), dtype=o.dtype, device=o.device).expand(o.shape)
                    for o in outputs])
                del outputs
        except Exception as e:  # noqa: BLE001 - the step itself will say it, not the trial
            return None, f"the trial raised {type(e).__name__}: {str(e)[:200]}"
    return m.peak(), ""


def trial_inputs(example_inputs: Sequence[Any], written: Collection[int] | None
                 ) -> list[Any]:
    """The trial's arguments: symbolic sizes at their hints; a tensor the graph writes
    (or every tensor, ``written`` None) copied, once per distinct tensor (the same tensor
    passed twice is one copy; two views of one storage become two independent copies);
    any other tensor aliased as a new leaf (``detach``: the same storage and version
    counter, views stay views of it; gradients accumulate into the alias, never into the
    user's ``.grad``, and no hook of the user's runs)."""
    copies: dict[Any, torch.Tensor] = {}
    args = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, (torch.SymInt, torch.SymFloat)):  # (dynamic shapes): its size
            from ..torch_internals import symbolic_hint
            args.append(symbolic_hint(a, fallback=-1))
        elif not isinstance(a, torch.Tensor):
            args.append(a)
        elif written is not None and i not in written:
            args.append(a.detach().requires_grad_(a.requires_grad))
        else:
            key = (a.untyped_storage().data_ptr(), a.storage_offset(), tuple(a.shape),
                   tuple(a.stride()), a.dtype)
            if key not in copies:
                copies[key] = a.detach().clone().requires_grad_(a.requires_grad)
            args.append(copies[key])
    return args
