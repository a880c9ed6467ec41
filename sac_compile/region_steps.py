"""The step hooks of ``apply_regions``' whole-model budgets: a call of the model is a step.

:class:`BudgetStep` (every whole-model byte budget) prices the step that ended and has
blocks compiled one by one compiled again where their split changes; :class:`MeasuredSteps`
(a :class:`~sac_compile.budgets.PeakBudget`) measures steps and sets the kept-byte cap
(:mod:`sac_compile.budgets.step_peak`); :func:`step_peak_of` finds a model's controller.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .budgets.step_peak import StepPeak
from .region_groups import rekey
from .torch_internals import pytree, queue_backward_callback

__all__ = ["BudgetStep", "EagerHook", "MeasuredSteps", "step_peak_of"]

_EAGER_REASON = ("sac_compile: apply_regions(memory_budget=PeakBudget(n)) measures each step "
                 "from the model's hooks, which run outside the compiled graphs: a function "
                 "compiled with fullgraph=True that calls the model cannot hold them. "
                 "Compile the model itself (torch.compile(model) or model.compile(): torch "
                 "runs its hooks outside its graph, fullgraph=True too), or its blocks one "
                 "by one, or drop fullgraph=True (a graph break at the model's call)")


def _eager(fn: Any) -> Any:
    try:
        return torch.compiler.disable(fn, reason=_EAGER_REASON)
    except TypeError:  # (a torch without ``reason``)
        return torch.compiler.disable(fn)


class EagerHook:
    """A model hook that runs eagerly under ``torch.compile`` of the whole model: Dynamo
    breaks the graph at it (before the model's forward, or after it) rather than tracing
    it, where it would do nothing. A step-peak budget's hooks must run: they begin the
    step's measurement and set the kept-byte cap the regions' graphs are compiled at, so
    a model compiled whole, with or without graph breaks, holds the budget as eager mode
    and blocks compiled one by one do. Picklable (a saved model keeps its budget)."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    __call__ = _eager(__call__)

    def __copy__(self) -> EagerHook:  # copies of the model share the budget
        return self

    def __deepcopy__(self, memo: dict) -> EagerHook:
        return self


class BudgetStep:
    """A forward pre-hook on the model of a whole-model budget (``apply_regions``): a call
    of the model is a new step, and the budget caps what a step's region calls keep.

    * Eager: the step that ended is priced if a call of it was not at a plan
      (:func:`sac_compile.runtime.model_budget.end_step`).
    * Blocks compiled one by one: their graphs' runs were counted
      (:mod:`sac_compile.compiler.budget_runs`); kinds that ran more calls than the split
      assumed are compiled again (:meth:`sac_compile.budgets.ModelBudget.count_step`). Blocks of
      several kinds arrive one kind at a time, each first compiled at the even split; once
      every kind was compiled the price is known. Either way the kinds whose split changes
      get new tokens here, at the start of a step - never within one, which would mix two
      splits - and Dynamo compiles each once more (logged, counted in
      ``ModelBudget.recompiles``).

    Under a compile of the whole model the hook is traced and does nothing: one graph
    holds every call of the step, under one cap."""

    def __init__(self, budget: Any) -> None:
        self.budget = budget

    # A copy of the model shares the budget, as its regions' RegionBudgets do.
    def __copy__(self) -> BudgetStep:
        return self

    def __deepcopy__(self, memo: dict) -> BudgetStep:
        return self

    def __call__(self, module: Any, args: Any) -> None:
        if torch.compiler.is_compiling():  # the model compiled whole: one graph, no kinds
            return None
        from .runtime.model_budget import end_step
        budget = self.budget
        end_step(budget)
        budget.count_step()
        if budget.rekey:
            rekey(budget)
        return None


def step_peak_of(model: nn.Module) -> StepPeak | None:
    """The controller of ``apply_regions(model, ..., memory_budget=PeakBudget(n))``: its
    ``fits`` (per step signature: the cap, the measured steps, whether done) and ``notes``;
    None without one."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(getattr(hook, "hook", hook), "__self__", None)
        if isinstance(owner, MeasuredSteps):
            return owner.controller
    return None


class MeasuredSteps:
    """The hooks of ``apply_regions(..., memory_budget=PeakBudget(n))`` in eager mode: a
    call of the model starts a step (after :class:`BudgetStep`, which prices the last one),
    whose kept-byte cap :class:`~sac_compile.budgets.step_peak.StepPeak` sets; its forward's
    outputs carry a gradient hook that, once the backward reaches them, queues the report
    of the step's end for when the whole backward is over (the autograd engine's final
    callback). Under ``torch.compile`` the hooks are traced and do nothing."""

    def __init__(self, controller: StepPeak) -> None:
        self.controller = controller
        self._step = 0  # the step whose end is queued (once per step)
        self._prices = 0  # prices the whole-model budget had found after the last start
        self._patterns: dict = {}  # step signature -> its region calls (the last step's)
        self._solved: dict = {}    # step signature -> the cap its plans were priced at
        self._compiles = 0         # graphs of its blocks compiled before this step
        self._region_calls = 0     # region calls begun in this step (their marks' numbers)

    def __reduce__(self) -> Any:  # pickled (torch.save of the model): measured afresh
        return (MeasuredSteps, (self.controller,))

    def __copy__(self) -> MeasuredSteps:  # copies of the model share the budget
        return self

    def __deepcopy__(self, memo: dict) -> MeasuredSteps:
        return self

    def begin(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return None
        from .runtime.model_budget import last_calls, reprice, reprice_nested
        leaves = [a for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]
        signature = tuple((tuple(a.shape), a.dtype, a.device.type) for a in leaves)
        param = next(module.parameters(), None)
        device = param.device if param is not None else (
            leaves[0].device if leaves else torch.device("cpu"))
        controller, model = self.controller, self.controller.model
        last = controller.signature
        if last is not None:
            pattern = last_calls(model)
            if pattern:
                self._patterns[last] = pattern
            if len(model.notes) > self._prices:  # the step that ended was priced again,
                self._solved[last] = model.nbytes  # at its cap: a pattern its plans lacked
                controller.reopen()
            elif model.compiles != self._compiles:  # a graph its calibration never ran
                controller.reopen("compiled a graph of the regions after its signature "
                                  "was calibrated (a branch or a block its graphs lacked)")
        cap = controller.begin(signature, device)
        if model.rekey:  # (a graph of every block to split again: lower_graph_peak)
            rekey(model)
        self._compiles, self._region_calls = model.compiles, 0
        fit = controller.fits[signature]
        if fit.prefix_caps is not None:  # caps placed in time (budgets/nested.py)
            placed = ("prefix", tuple(fit.prefix_caps))
            if self._solved.get(signature) == placed or reprice_nested(
                    model, fit.order, fit.prefix_caps):
                self._solved[signature] = placed
                self._prices = len(model.notes)
                return None
            fit.order = fit.prefix_caps = None  # (the calls changed: one cap over the step)
        changed = model.set_cap(cap)
        if self._solved.get(signature) != cap:  # this signature's plans: of another cap
            pattern = self._patterns.get(signature)
            reprice(model, cap, pattern)
            if pattern:
                self._solved[signature] = cap
        if changed:  # blocks compiled one by one: compiled again at the new cap
            with model.lock:
                model.rekey |= set(model.kinds)
            rekey(model)
        self._prices = len(model.notes)
        return None

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self.controller.measuring():
            return None
        step = self.controller.step
        outputs = [o for o in pytree.tree_leaves(output)
                   if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outputs:
            # No backward will end this step: the forward raised (this hook always runs;
            # a BudgetUnreachableError from the graph's compile, say), or ran without
            # gradients. Its measurement (on the CPU a profiler) stops now, undecided,
            # rather than run on until the model's next call.
            self.controller.close()
            return None

        def reached(grad: torch.Tensor) -> None:
            if self._step != step:
                self._step = step
                queue_backward_callback(lambda: self._ended(step))
        for o in outputs:
            o.register_hook(reached)
        return None

    def region_entered(self, module: nn.Module, args: Any) -> None:
        """A region's forward pre-hook: the step's k-th region call begins (a mark)."""
        if torch.compiler.is_compiling() or not self.controller.measuring():
            return None
        self._region_calls += 1
        self.controller.mark(f"f{self._region_calls}")
        return None

    def region_left(self, module: nn.Module, args: Any, output: Any) -> None:
        """A region's forward hook: when the backward reaches the call's outputs, its
        backward begins (a mark): until then the call holds what it keeps."""
        if torch.compiler.is_compiling() or not self.controller.measuring():
            return None
        phase, marked = f"b{self._region_calls}", []

        def reached(grad: torch.Tensor) -> None:
            if not marked:
                marked.append(True)
                self.controller.mark(phase)
        for o in pytree.tree_leaves(output):
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(reached)
        return None

    def _ended(self, step: int) -> None:
        from .runtime.model_budget import step_kept, step_order
        if self.controller.step == step:
            model = self.controller.model
            kept = step_kept(model)
            with model.lock:
                ran = sum(model.graph_runs.values())  # blocks compiled one by one ran
                if not kept and ran:  # what their splits keep (each block's share)
                    kept = sum(model.shares.values())
                compiled = model.compiles != self._compiles
                # (a graph of them all ran: split under the step's PeakBudget, no cap)
                whole = model.whole_runs > 0 and not ran
            self.controller.end(kept, compiled=compiled, calls=step_order(model),
                                whole=whole)
