"""How often a whole-model budget's blocks run per step when they are compiled.

A block compiled on its own (``block.compile()``, or a graph break between blocks) is cut at
its share of the budget per call (:mod:`sac_compile.budgets.kinds`). How many calls a step
makes of it is not in any graph: a block the model calls twice runs its one compiled graph
twice. Nothing Python sees inside a compiled graph can count it without a graph break (a
``fullgraph=True`` compile forbids one, and Dynamo would guard a counter's value), so the
callable the backend returns is wrapped: each run of a graph counts, per kind of block, the
region calls it holds (:attr:`ModelBudget.graph_runs`). The model's step hook
(:class:`sac_compile.region_steps.BudgetStep`) reads the count when the step ends
(:meth:`sac_compile.budgets.ModelBudget.count_step`).

A graph holding every block of a model is one cap over all its calls: its calls are not
counted. Under a step-peak budget (``apply_regions(..., memory_budget=PeakBudget(n))``, a
model compiled whole: its step hooks run eagerly) the measuring controller still needs to
know that such a graph was compiled (a step that compiles is not measured) and that it ran
(it was split under the step's PeakBudget, so the step is judged by that, not by a
kept-byte cap): :meth:`ModelBudget.compiled_graph` and :meth:`ModelBudget.count_whole_run`.
"""
from __future__ import annotations

import collections
import functools
from typing import Any

import torch

__all__ = ["counted", "whole_model_peak", "whole_models"]


def _regions_by_model(gm: torch.fx.GraphModule
                      ) -> tuple[dict[int, Any], collections.Counter, set[int]]:
    """The whole-model budgets of the regions in Dynamo's graph ``gm`` (by ``id``), how many
    region calls of each ``(model, kind)`` one run of it makes, and the models all of
    whose members' regions it holds (their split is one cap over the graph)."""
    from ..region_groups import group_of_token, name_in_graph
    from .regions_compiled import region_checkpoints
    found: collections.Counter = collections.Counter()
    models: dict[int, Any] = {}
    names: dict[int, set[str]] = collections.defaultdict(set)
    for node, _, context_fn in region_checkpoints(gm):
        try:
            group = group_of_token(context_fn.args[0])
        except KeyError:
            continue
        budget = group.budget
        if budget is not None and budget.model is not None:
            models[id(budget.model)] = budget.model
            found[(id(budget.model), budget.kind)] += 1
            names[id(budget.model)].add(name_in_graph(group, node))
    return models, found, {m for m in models if names[m] >= set(models[m].members)}


def whole_models(gm: torch.fx.GraphModule) -> set[int]:
    """The whole-model budgets (by ``id``) all of whose members' regions are in Dynamo's
    graph ``gm``: the one walk that says so for the cache keys
    (:mod:`.cache_keys`), the run counts and the graph's step-peak budget (here)."""
    return _regions_by_model(gm)[2]


def _budgeted_calls(gm: torch.fx.GraphModule) -> list[tuple[Any, str, int]]:
    """``(model budget, kind, region calls)`` of the whole-model budgets' regions in
    Dynamo's graph ``gm`` (its checkpoint calls, each a region call per run). A graph
    holding every block of a model is one cap over all its calls: ``(model, None, 0)``
    under a step-peak budget (its runs are told, not counted), left out otherwise."""
    models, found, whole = _regions_by_model(gm)
    return [(models[m], kind, n) for (m, kind), n in found.items() if m not in whole] + \
        [(models[m], None, 0) for m in whole if models[m].step_peak is not None]


def counted(gm: torch.fx.GraphModule, compiled: Any) -> Any:
    """``compiled`` (the backend's callable for ``gm``), counting its whole-model budgets'
    region calls at each run; ``compiled`` itself when it holds none."""
    calls = _budgeted_calls(gm)
    if not calls:
        return compiled
    for model in {id(m): m for m, _, _ in calls}.values():
        model.compiled_graph()

    @functools.wraps(compiled)
    def run(*args: Any, **kwargs: Any) -> Any:
        for model, kind, n in calls:
            if kind is None:
                model.count_whole_run()
            else:
                model.count_runs(kind, n)
        return compiled(*args, **kwargs)
    return run


def whole_model_peak(gm: torch.fx.GraphModule) -> Any:
    """The PeakBudget Dynamo's graph ``gm`` is split under when it holds every region of
    an ``apply_regions(..., memory_budget=PeakBudget(n))`` model (the model compiled whole:
    :func:`sac_compile.compiler.choose_cut.choose_cut` takes the step's PeakBudget for it),
    so that Inductor's measured trial holds it too; None otherwise."""
    for model, kind, _ in _budgeted_calls(gm):
        if kind is None:
            return model.graph_peak_budget()
    return None
