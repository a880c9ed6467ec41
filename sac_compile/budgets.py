"""A region's memory budget, as ``sac_region(policy, memory_budget=...)`` and
``apply_regions(..., memory_budget=...)`` give it: the value and what the runtime learns.

One meaning everywhere, :func:`sac_compile.compiler.budget.check_budget`'s (the same as
``make_backend(memory_budget=...)``): a float in (0, 1] is a fraction of the activation bytes
the region keeps without a budget (the cut of the same flow network at no budget); an int
>= 2 or a string such as ``"64MiB"`` is bytes. On ``sac_region`` the budget is the region's
own; on ``apply_regions`` a byte budget is one budget for all the regions it makes together
(a :class:`ModelBudget`: a single price per byte found over all of them, each region's cut
optimal for the total), and a fraction is each region's own.

A :class:`RegionBudget` is part of a region's frame (:class:`~sac_compile.policy.
RegionFrame`) and of its compiled group's key (:mod:`sac_compile.region_groups`): two
regions with different budgets never share a split.
"""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["RegionBudget", "ModelBudget", "region_budget", "budget_key"]


class ModelBudget:
    """One byte budget shared by the regions ``apply_regions`` made: the price per byte
    (the Lagrange multiplier of :mod:`sac_compile.compiler.budget`'s search) found once
    over all of them, and each region's share. ``members``: the regions' names."""

    def __init__(self, nbytes: int, members: tuple[str, ...] = ()) -> None:
        self.nbytes = nbytes
        self.members = members
        self.lock = threading.RLock()
        self.weight: float | None = None          # the price found (None: not yet)
        self.shares: dict[str, int] = {}          # region name -> bytes it keeps
        self.unconstrained: dict[str, int] = {}   # region name -> bytes without a budget
        self.pending: list[Any] = []              # regions recorded, awaiting the price
        self.plans: dict[Any, Any] = {}           # eager: signature -> plan at the price
        self.head: Any = None                     # the first region recorded in a step
        self.notes: list[str] = []

    def __repr__(self) -> str:
        from .compiler.budget import budget_label
        return f"ModelBudget({budget_label(self.nbytes)} for {len(self.members)} regions)"

    def __reduce__(self) -> Any:  # what it learnt is found again after loading
        return (ModelBudget, (self.nbytes, self.members))


class RegionBudget:
    """A region's budget (``value``, as given to :func:`check_budget`) and, in eager mode,
    its decisions per recorded signature (``plans``: one solve per shape, reused)."""

    def __init__(self, value: float | int, model: ModelBudget | None = None) -> None:
        self.value = value
        self.model = model
        self.lock = threading.RLock()
        self.plans: dict[Any, Any] = {}

    @property
    def key(self) -> str:
        """What a compiled region's group is keyed by."""
        return budget_key(self)

    def __repr__(self) -> str:
        from .compiler.budget import budget_label
        shared = f", shared by {len(self.model.members)} regions" if self.model else ""
        return f"RegionBudget({budget_label(self.value)}{shared})"

    # Copies (copy.deepcopy of a module) share the budget: its plans depend on shapes only.
    def __copy__(self) -> RegionBudget:
        return self

    def __deepcopy__(self, memo: dict) -> RegionBudget:
        return self

    def __reduce__(self) -> Any:  # (a shared ModelBudget is pickled once: still shared)
        return (RegionBudget, (self.value, self.model))


def budget_key(budget: RegionBudget | None) -> str:
    if budget is None:
        return "none"
    kind = type(budget.value).__name__
    model = f"|model={id(budget.model)}" if budget.model is not None else ""
    return f"{kind}:{budget.value!r}{model}"


def region_budget(value: Any, *, what: str = "memory_budget",
                  model: ModelBudget | None = None) -> RegionBudget | None:
    """``value`` checked (:func:`check_budget`'s rules and errors) as a region's budget."""
    if value is None:
        return None
    from .compiler.budget import check_budget
    return RegionBudget(check_budget(value, what=what), model)
