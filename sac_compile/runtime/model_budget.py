"""A whole-model budget in eager mode (``apply_regions(..., memory_budget="2GiB")``).

Step 1 records: each region call is cut as without a budget and its flow network is kept
(no tensors) in the :class:`~sac_compile.budgets.ModelBudget`. When the first region
recorded runs again (the next step), one price per byte is found over all the recorded
networks together (:func:`sac_compile.cut.shared_budget.solve_shared_price`), each
region's plan is its cut at that price, and from then on every region applies its plan:
no solve per step. A call whose ops or shapes match no plan starts a new recording step
(a shape change re-solves). The first step keeps what the regions keep without a budget:
the report says so.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ..budgets import ModelBudget, RegionBudget, proposed_budget
from ..errors import BudgetUnreachableError
from .budget_graph import RegionGraph
from .budget_graph import Plan, plan_of_cut

if TYPE_CHECKING:  # annotations only: budget_run calls this module
    from .budget_run import BudgetRun

__all__ = ["on_region_entry", "plan_in_model"]


@dataclasses.dataclass
class _Recorded:
    region: str
    budget: RegionBudget
    signature: tuple
    net: Any                                        # the region call's FlowNetwork
    where: dict[fx.Node, tuple[int, int]]
    labels: dict[fx.Node, str]                      # for the values a plan may drop


def on_region_entry(budget: RegionBudget, region: str) -> None:
    """A region with a whole-model budget starts a call: if it is the first region the
    recording step saw, the step is over - find the price and every region's plan."""
    model = budget.model
    with model.lock:
        if model.weight is None and model.pending and model.pending[0].region == region:
            _solve(model)


def plan_in_model(run: BudgetRun, rg: RegionGraph, signature: tuple) -> Plan:
    """The plan of a call no stored plan matches: its cut without a budget, recorded for
    the next price (a new recording step if a price was already found)."""
    from ..cut import costs
    from ..cut.budget import budget_label
    from ..cut.solvers import solve
    model = run.budget.model
    with model.lock:
        if model.weight is not None:  # new shapes or ops: record a new step
            model.weight = None
            model.pending = []
            model.notes = [f"region {run.region!r} ran ops or shapes no plan matched: the "
                           f"price is found again after this step"]
        model.pending.append(_Recorded(
            run.region, run.budget, signature, rg.net, dict(rg.where),
            {v: f"{costs.op_label(v)}, {costs.nbytes(v):,} B" for v in rg.where}))
    from ..cut.budget import _activation_bytes
    saved, _ = solve(rg.net)
    nbytes = _activation_bytes(rg.net, saved)
    note = (f"whole-model memory budget {budget_label(model.nbytes)}: recording step (this "
            f"call keeps what it keeps without a budget, {nbytes:,} B); the price per byte "
            f"over all {len(model.members)} regions is found when the first region runs again")
    plan = plan_of_cut(rg, saved, rg.net.offloaded(saved), signature, [note], [], nbytes,
                       nbytes, float(model.nbytes))
    plan.final = False  # not stored: the region's plan comes with the price
    return plan


def _solve(model: ModelBudget) -> None:
    from ..cut.budget import budget_label
    from ..cut.shared_budget import solve_shared_price
    pending = model.pending
    try:
        price = solve_shared_price([r.net for r in pending], float(model.nbytes))
    except ValueError as e:
        regions = ", ".join(dict.fromkeys(r.region for r in pending))
        least = int(e.least_bytes)  # type: ignore[attr-defined]
        proposed = proposed_budget(model.nbytes, least, least)
        raise BudgetUnreachableError(
            f"whole-model memory budget {budget_label(model.nbytes)} of apply_regions cannot "
            f"be met: {e}, with everything recomputed or offloaded that may be (regions "
            f"{regions}). To fix: raise the budget to at least that (memory_budget="
            f"{proposed!r}), or relax the policy's MUST_SAVE decisions to PREFER_SAVE "
            f"(policies.relaxed(policy); policies.relaxed(policy, hooks=True) also relaxes "
            f"SaveWithHooks) so the budget may evict them",
            budget=model.nbytes, least_bytes=least,
            unconstrained_bytes=int(e.unconstrained_bytes),  # type: ignore[attr-defined]
            proposed_budget=proposed) from None
    shares: dict[str, int] = {}
    unconstrained: dict[str, int] = {}
    for rec, cut, free in zip(pending, price.cuts, price.unconstrained):
        shares[rec.region] = shares.get(rec.region, 0) + cut.nbytes
        unconstrained[rec.region] = unconstrained.get(rec.region, 0) + free
    model.weight, model.shares, model.unconstrained = price.weight, shares, unconstrained
    total = sum(price.unconstrained)
    head = (f"whole-model memory budget {budget_label(model.nbytes)}: {price.total:,} B kept "
            f"by {len(shares)} regions together (without the budget {total:,} B); one price "
            f"per byte, w = {price.weight:.3g}, {price.solves} solves")
    for rec, cut, free in zip(pending, price.cuts, price.unconstrained):
        rg = RegionGraph(None, rec.net, rec.where, {})
        kept = set(cut.kept)
        dropped = [(rec.where[v][0], rec.where[v][1], int(rec.net.save_cost[rec.net.cls.index[v]]),
                    f"{rec.labels.get(v, v.name)}: recomputed in backward to meet the "
                    f"whole-model budget {budget_label(model.nbytes)}")
                   for v in _kept_unconstrained(rec.net) if v not in kept and v in rec.where]
        note = f"{head}; this call's share {cut.nbytes:,} B of its {free:,} B without it"
        plan = plan_of_cut(rg, cut.kept, cut.on_host, rec.signature, [note], dropped,
                           cut.nbytes, free, float(model.nbytes))
        with rec.budget.lock:
            rec.budget.plans[rec.signature] = plan
    model.notes.append(head)
    model.pending = []


def _kept_unconstrained(net: Any) -> list[fx.Node]:
    from ..cut.budget import _is_activation
    from ..cut.solvers import solve
    saved, _ = solve(net)
    return [v for v in saved if _is_activation(net, net.cls.index[v])]
