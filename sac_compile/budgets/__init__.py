"""Memory budgets, for both engines: what a budget value means, the one price search, what
a solve chose, and the one error for a budget out of reach.

Kept-byte budgets keep torch's meaning. Modules, top-down (each imports only later ones
and the shared core below the package, :mod:`sac_compile.cut` included):

==================  =========================================================================
``step_peak``       a :class:`PeakBudget` over eager steps: the whole-model kept-byte cap
                    set from measured step peaks
``nested``          kept bytes placed in time: per call a cut, each prefix of the step's
                    calls within its cap (a dynamic program over the price search's cuts)
``groups``          per-region caps in one split (ours and torch's), by the exact program
``kinds``           a whole-model budget over graphs compiled one by one: the price over
                    the block kinds
``shared``          one price per byte over several networks (a whole model's regions)
``split``           one split under a kept-byte budget: the search, then the exact program
``unreachable``     the error for a budget out of reach, and why it is
``search``          the price search: the cut at a price, the least price, the bisection
``result``          :class:`BudgetResult`, what a split's budget solve chose
``region``          a region's budget (:class:`RegionBudget`), its keys for compile caches
``model``           a whole-model budget (:class:`ModelBudget`), with the methods that
                    change what it learnt
``values``          budget values: fractions, bytes, text, :class:`PeakBudget`
==================  =========================================================================

The engines keep their own glue: the compiler's walk of a split under a peak
(:mod:`sac_compile.compiler.peak_budget`), its run counts and size guards
(``compiler/budget_runs.py``, ``compiler/size_guards.py``); the eager runtime's recording
(``runtime/budget_graph.py``, ``budget_run.py``, ``budget_plan.py``, ``model_budget.py``).

This package's own namespace holds the budget values and state (``sac_compile.budgets.
PeakBudget`` and the names below, importable from here as before); the solvers are
imported from their modules.
"""
from __future__ import annotations

from .model import ModelBudget
from .region import RegionBudget, budget_cache_text, budget_key, module_kind, region_budget
from .values import PeakBudget, budget_label, check_budget, parse_budget_text, proposed_budget

__all__ = ["PeakBudget", "RegionBudget", "ModelBudget", "region_budget", "budget_key",
           "proposed_budget", "budget_cache_text", "module_kind", "check_budget",
           "parse_budget_text", "budget_label"]
