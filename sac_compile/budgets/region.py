"""A region's memory budget, as ``sac_region(policy, memory_budget=...)`` and
``apply_regions(..., memory_budget=...)`` give it: the value and what the eager runtime
learns of it (its plans per recorded signature).

On ``sac_region`` the budget is the region's own; on ``apply_regions`` a byte budget is one
budget for all the regions it makes together (a :class:`~.model.ModelBudget`: a single price
per byte found over all of them, each region's cut optimal for the total), and a fraction is
each region's own. A :class:`RegionBudget` is part of a region's frame
(:class:`~sac_compile.policy.RegionFrame`) and of its compiled group's key
(:mod:`sac_compile.region_groups`, through :attr:`RegionBudget.key`): two regions with
different budgets never share a split.
"""
from __future__ import annotations

import threading
from typing import Any

from .model import ModelBudget
from .values import budget_label, check_budget

__all__ = ["RegionBudget", "region_budget", "budget_key", "budget_cache_text", "module_kind"]


class RegionBudget:
    """A region's budget (``value``, as given to :func:`check_budget`) and, in eager mode,
    its decisions per recorded signature (``plans``: one solve per shape, reused)."""

    def __init__(self, value: float | int, model: ModelBudget | None = None,
                 kind: str = "") -> None:
        self.value = value
        self.model = model
        self.kind = kind  # a whole-model budget: the block's module_kind
        self.lock = threading.RLock()
        self.plans: dict[Any, Any] = {}

    @property
    def key(self) -> str:
        """What a compiled region's group is keyed by."""
        return budget_key(self)

    def __repr__(self) -> str:
        shared = f", shared by {len(self.model.members)} regions" if self.model else ""
        return f"RegionBudget({budget_label(self.value)}{shared})"

    # Copies (copy.deepcopy of a module) share the budget: its plans depend on shapes only.
    def __copy__(self) -> RegionBudget:
        return self

    def __deepcopy__(self, memo: dict) -> RegionBudget:
        return self

    def __reduce__(self) -> Any:  # (a shared ModelBudget is pickled once: still shared)
        return (RegionBudget, (self.value, self.model, self.kind))


def budget_key(budget: RegionBudget | None) -> str:
    if budget is None:
        return "none"
    kind = type(budget.value).__name__
    model = f"|model={id(budget.model)}|kind={budget.kind}" if budget.model is not None \
        else ""
    return f"{kind}:{budget.value!r}{model}"


def budget_cache_text(budget: RegionBudget | None, *, whole: bool = False) -> str | None:
    """What a compiled region's split depends on of its budget, for the compile caches
    (the same in every process): the value; for a whole-model budget also the model's
    size, the block's kind and its share at the price (or the even split before it).
    None where the split must not come from a cache: a model of several kinds before its
    price is found, whose partitions record the kinds' networks for it. ``whole``: the
    graph holds all the model's regions (one cap over them, no share)."""
    if budget is None:
        return "none"
    text = f"{type(budget.value).__name__}:{budget.value!r}"
    model = budget.model
    if model is not None:
        # (a step-peak budget's graph of every block is split under the step's PeakBudget,
        # lowered by what measured steps found above it; a graph of some, at the kept-byte
        # cap they set: each key carries both, whichever way a graph is classified)
        peak = (f"|cap={model.nbytes}|peak={model.graph_peak_budget().value}"
                if model.step_peak is not None else "")
        if whole:
            return text + f"|model of {len(model.members)}|whole graph" + peak
        with model.lock:
            shares = model.kind_share
            pending = budget.kind in model.rekey  # (until then: the even split)
        if shares is None and len(set(model.kinds)) > 1:
            return None
        share = "even" if shares is None or pending else repr(shares.get(budget.kind))
        text += f"|model of {len(model.members)}|kind={budget.kind}|share={share}"
        if model.calls:  # a step runs some blocks more than once: a smaller even split
            text += f"|calls={sorted(model.calls.items())!r}"
        text += peak  # (the cap measured steps set, budgets/step_peak.py)
    return text


def module_kind(module: Any) -> str:
    """Blocks of one kind: the same class, parameters and buffers (names, shapes, dtypes)
    and submodule classes. Identical blocks (a transformer's layers) are one kind: they
    compile to one graph with one split. (Blocks whose ``forward`` branches on an
    attribute may still compile to different graphs; each keeps at most its share.)"""
    import hashlib
    parts = [f"{type(module).__module__}.{type(module).__qualname__}"]
    parts += [f"{n}:{type(m).__qualname__}" for n, m in module.named_modules()]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}"
              for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def region_budget(value: Any, *, what: str = "memory_budget",
                  model: ModelBudget | None = None) -> RegionBudget | None:
    """``value`` checked (:func:`check_budget`'s rules and errors) as a region's budget."""
    if value is None:
        return None
    return RegionBudget(check_budget(value, what=what), model)

