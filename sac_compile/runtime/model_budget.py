"""A whole-model budget in eager mode (``apply_regions(..., memory_budget="2GiB")``).

Step 1 records: each region call's flow network is kept (no tensors) in the
:class:`~sac_compile.budgets.ModelBudget`, and the call is cut at its part of the budget:
what the step has left, split evenly over the regions it has not run yet (identical blocks:
the budget over their number, which is what the price gives them too). So step 1 keeps at
most the budget as well, unless a region cannot keep as little as its part (said in its
note). When the first region recorded runs again (the next step), one price per byte is
found over all the recorded networks together
(:func:`sac_compile.cut.shared_budget.solve_shared_price`), each region's plan is its cut
at that price, and from then on every region applies its plan: no solve per step. A call
whose ops or shapes match no plan starts a new recording step (a shape change re-solves).
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
    kept: int = 0                                   # device bytes its recording plan keeps


def on_region_entry(budget: RegionBudget, region: str) -> None:
    """A region with a whole-model budget starts a call: if it is the first region the
    recording step saw, the step is over - find the price and every region's plan."""
    model = budget.model
    with model.lock:
        if model.weight is None and model.pending and model.pending[0].region == region:
            _solve(model)


def plan_in_model(run: BudgetRun, rg: RegionGraph, signature: tuple) -> Plan:
    """The plan of a call no stored plan matches, in a recording step: its cut under the
    rest of the budget split evenly over the regions the step has not run yet (so the step
    keeps at most the budget), recorded for the price found when the step is over (a new
    recording step if a price was already found)."""
    from ..cut import costs
    from ..cut.budget import budget_label
    from ..cut.shared_budget import solve_shared_price
    model = run.budget.model
    with model.lock:
        if model.weight is not None:  # new shapes or ops: record a new step
            model.weight = None
            model.pending = []
            model.notes = [f"region {run.region!r} ran ops or shapes no plan matched: the "
                           f"price is found again after this step"]
        committed = sum(r.kept for r in model.pending)
        seen = {r.region for r in model.pending}
        left = max(1, len(set(model.members) - seen))
        cap = max(float(model.nbytes) - committed, 0.0) / left
        price = solve_shared_price([rg.net], cap, or_least=True)
        cut, free = price.cuts[0], price.unconstrained[0]
        labels = {v: f"{costs.op_label(v)}, {costs.nbytes(v):,} B" for v in rg.where}
        model.pending.append(_Recorded(run.region, run.budget, signature, rg.net,
                                       dict(rg.where), labels, cut.nbytes))
    over = cut.nbytes > cap * (1 + 1e-9) + 1
    note = (f"whole-model memory budget {budget_label(model.nbytes)}: recording step; this "
            f"call keeps {cut.nbytes:,} B of its {free:,} B without a budget, within its part "
            f"of what the step has left ({int(cap):,} B: {max(int(model.nbytes - committed), 0):,}"
            f" B over {left} region{'s' if left > 1 else ''} not yet run)" if not over else
            f"whole-model memory budget {budget_label(model.nbytes)}: recording step; this "
            f"call keeps {cut.nbytes:,} B, the least it can keep, above its part of what the "
            f"step has left ({int(cap):,} B), so this step may keep more than the budget")
    note += (f"; one price per byte over all {len(model.members)} regions is found when the "
             f"first region runs again")
    dropped = _dropped(rg.net, cut.kept, rg.where, labels,
                       f"its part of the whole-model budget {budget_label(model.nbytes)} in "
                       f"the recording step")
    plan = plan_of_cut(rg, cut.kept, cut.on_host, signature, [note], dropped, cut.nbytes,
                       free, cap)
    plan.final = False  # not stored: the region's plan comes with the price
    return plan


def _dropped(net: Any, kept: list[fx.Node], where: dict[fx.Node, tuple[int, int]],
             labels: dict[fx.Node, str], why: str) -> list[tuple[int, int, int, str]]:
    """``(op number, output, bytes, why)`` of each value the cut without a budget keeps
    and ``kept`` does not."""
    have = set(kept)
    return [(where[v][0], where[v][1], int(net.save_cost[net.cls.index[v]]),
             f"{labels.get(v, v.name)}: recomputed in backward to meet {why}")
            for v in _kept_unconstrained(net) if v not in have and v in where]


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
        dropped = _dropped(rec.net, cut.kept, rec.where, rec.labels,
                           f"the whole-model budget {budget_label(model.nbytes)}")
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
