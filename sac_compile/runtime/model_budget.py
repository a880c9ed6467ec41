"""A whole-model budget in eager mode (``apply_regions(..., memory_budget="2GiB")``).

The budget caps the bytes the regions keep in one *step* - one call of the model, marked
by ``apply_regions``' forward pre-hook (:class:`sac_compile.region_steps.BudgetStep`) -
summed over every region *call*: a block that runs twice keeps twice.

Step 1 records: each region call's flow network is kept (no tensors), and the call is cut
at its part of what the step has left, split evenly over the regions that have not run yet
in it (one part more when a region runs again: its later calls and the regions still to
come share what is left). So step 1 keeps at most the budget as well, unless a call cannot
keep as little as its part (said in its note). When the step ends, one price per byte is
found over the step's calls together, each network counted as often as it ran
(:func:`sac_compile.budgets.shared.solve_shared_price`); each region's plan for that
shape is its cut at the price. From then on calls apply their plans: no solve per step.

A *price* is found for the calls of one step (its pattern: how often each region ran at
which shape). A call is at its plan only while the step stays within that pattern: all its
planned calls of one price, and no region running more often than in the step the price was
found for. Any other call - a shape or ops no plan matched, a region the price never saw
(one skipped in step 1), one more call of a region, a plan of another price - is cut at
what the step has left once the calls the step's price still expects are set aside (its
note says why), and at the end of that step the price is found again over its calls. So a
step keeps at most the budget unless a call's least is above what is left, which its note
says. Steps alternating between patterns (two batch sizes) keep each price's plans: a step
whose calls all belong to one earlier price needs no new solve.

Without the step hook (regions given a :class:`~sac_compile.budgets.ModelBudget` by hand),
a step ends when the region that started it runs again: a region that runs twice in a row
at the start of the step is then seen as two steps.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ..budgets import ModelBudget, RegionBudget, budget_label
from .budget_graph import Plan, RegionGraph, plan_of_cut

if TYPE_CHECKING:  # annotations only: budget_run calls this module
    from .budget_run import BudgetRun

__all__ = ["on_region_entry", "at_plan", "plan_in_model", "end_step", "reprice",
           "reprice_nested", "step_kept", "step_order", "last_calls"]

_PRICES_KEPT = 8  # recent prices whose plans stay usable (steps alternating patterns)

Key = tuple  # (region name, signature)


@dataclasses.dataclass
class _Recorded:
    region: str
    budget: RegionBudget
    signature: tuple
    net: Any                                        # the region call's FlowNetwork
    where: dict[fx.Node, tuple[int, int]]
    labels: dict[fx.Node, str]                      # for the values a plan may drop


@dataclasses.dataclass
class _Steps:
    """The eager bookkeeping of one ModelBudget: this step's calls, the prices found."""

    hooked: bool = False            # apply_regions' pre-hook marks the steps
    first: str | None = None        # without it: the region that started this step
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ran: set = dataclasses.field(default_factory=set)   # regions run this step
    kept: int = 0                   # bytes kept by this step's calls so far
    gen: int | None = None          # the price this step's planned calls are of
    unpriced: bool = False          # a call not at a plan: price again when the step ends
    nets: dict = dataclasses.field(default_factory=dict)      # Key -> _Recorded
    prices: dict = dataclasses.field(default_factory=dict)    # gen -> {Key: (count, bytes)}
    next_gen: int = 0
    last_calls: dict = dataclasses.field(default_factory=dict)  # the last step's calls
    order: list = dataclasses.field(default_factory=list)  # this step's (Key, bytes kept)


def _steps(model: ModelBudget) -> _Steps:
    return model.eager_state(_Steps)


def end_step(model: ModelBudget, *, hooked: bool = True) -> None:
    """A step is over (the model is called again): if a call of it was not at a plan, find
    the price over its calls; then start counting the next step's."""
    with model.lock:
        steps = _steps(model)
        steps.hooked = steps.hooked or hooked
        calls, unpriced = dict(steps.calls), steps.unpriced
        steps.last_calls, steps.order = calls, []
        steps.calls, steps.ran, steps.kept = collections.Counter(), set(), 0
        steps.gen, steps.unpriced, steps.first = None, False, None
        if unpriced and calls:
            _solve(model, steps, calls)


def step_kept(model: ModelBudget) -> int:
    """The bytes this step's region calls keep, so far."""
    with model.lock:
        return _steps(model).kept


def step_order(model: ModelBudget) -> list[tuple[Key, int]]:
    """This step's region calls so far, in the order they ran:
    ``[((region, signature), bytes kept), ...]``."""
    with model.lock:
        return list(_steps(model).order)


def last_calls(model: ModelBudget) -> dict:
    """The region calls of the step that ended last: ``{(region, signature): calls}``."""
    with model.lock:
        return dict(_steps(model).last_calls)


def reprice(model: ModelBudget, nbytes: int, calls: dict | None) -> None:
    """The cap is now ``nbytes`` (a step-peak controller's, at the start of a step);
    ``calls`` (a step's pattern, :func:`last_calls`), where known, are priced again under
    it, so the step applies plans of the new cap; the prices of other patterns (another
    batch size) stay. Unknown: the step records, as a first step does."""
    with model.lock:
        model.set_cap(nbytes)
        steps = _steps(model)
        calls = {k: n for k, n in (calls or {}).items() if k in steps.nets}
        if not calls:
            return
        for gen in [g for g, priced in steps.prices.items() if set(priced) <= set(calls)]:
            del steps.prices[gen]  # (superseded: the same calls, another cap)
        _solve(model, steps, calls)


def reprice_nested(model: ModelBudget, order: list[Key], caps: list[float]) -> bool:
    """Plans for a step whose region calls ran in ``order`` (each once), the kept bytes of
    the first ``d + 1`` of them within ``caps[d]`` (:mod:`sac_compile.budgets.nested`: a
    step-peak controller's caps, from where a measured step held what); the cap of the
    step is what they keep together. False (nothing changed) where a call ran twice, or
    one was never recorded: the caller prices one cap over the step instead."""
    from ..budgets.nested import solve_nested
    with model.lock:
        steps = _steps(model)
        if len(set(order)) != len(order) or any(k not in steps.nets for k in order):
            return False
        recs = [steps.nets[k] for k in order]
        found = solve_nested([r.net for r in recs], caps)
        model.set_cap(found.total)
        for gen in [g for g, priced in steps.prices.items() if set(priced) <= set(order)]:
            del steps.prices[gen]  # (superseded: the same calls, other caps)
        _apply_cuts(model, steps, order, [1] * len(order), found.cuts,
                    found.unconstrained, None,
                    f"step-peak budget {model.step_peak!r}: {found.total:,} B kept by "
                    f"{len(order)} calls, " + (
                        "each prefix of the calls within what the measured step left beside "
                        "it where they hold their values" if found.fits else
                        "each its least: no choice keeps every prefix within its cap"))
        return True


def on_region_entry(budget: RegionBudget, region: str) -> list[Plan]:
    """A region of a whole-model budget starts a call: the plans it may apply (those of the
    step's price that the step has not used up yet)."""
    model = budget.model
    with model.lock:
        steps = _steps(model)
        if not steps.hooked and steps.first == region and steps.calls:
            end_step(model, hooked=False)  # no step hook: the first region runs again
        steps.first = steps.first or region
        with budget.lock:
            plans = list(budget.plans.values())
        return [p for p in plans if p.gen in steps.prices
                and (steps.gen is None or p.gen == steps.gen)
                and steps.calls[(region, p.signature)]
                < steps.prices[p.gen].get((region, p.signature), (0, 0))[0]]


def at_plan(run: BudgetRun, plan: Plan) -> None:
    """The call applies its plan: counted in the step."""
    model = run.budget.model
    with model.lock:
        steps = _steps(model)
        steps.calls[(run.region, plan.signature)] += 1
        steps.ran.add(run.region)
        steps.kept += plan.kept_bytes
        steps.order.append(((run.region, plan.signature), plan.kept_bytes))
        steps.gen = plan.gen


def plan_in_model(run: BudgetRun, rg: RegionGraph, signature: tuple) -> Plan:
    """The plan of a call not at a plan of the step's price: its cut under what the step
    has left, less what the price's calls still to come in it keep (or, with no price in
    the step yet, split evenly over the regions still to run), recorded for the price
    found when the step ends."""
    from ..budgets.shared import solve_shared_price
    from ..cut import costs
    model = run.budget.model
    key = (run.region, signature)
    with model.lock:
        steps = _steps(model)
        left = float(model.nbytes) - steps.kept
        why = _why_unplanned(steps, key)
        if steps.gen is not None:
            expected = steps.prices[steps.gen]
            reserve = sum(max(0, n - steps.calls[k]) * b for k, (n, b) in expected.items())
            cap = max(left - reserve, 0.0)
            part = (f"what the step has left ({max(int(left), 0):,} B) less the "
                    f"{int(reserve):,} B its calls still to come at the price keep")
        else:
            to_run = len(set(model.members) - steps.ran)
            again = run.region in steps.ran  # its later calls share with those to come
            parts = max(1, to_run + again)
            cap = max(left, 0.0) / parts
            over = f"{to_run} region{'s' if to_run != 1 else ''} not yet run" + (
                " and this one again" if again else "")
            part = (f"its part of what the step has left ({int(cap):,} B: "
                    f"{max(int(left), 0):,} B over {over})")
        price = solve_shared_price([rg.net], cap)
        cut, free = price.cuts[0], price.unconstrained[0]
        labels = {v: f"{costs.op_label(v)}, {costs.nbytes(v):,} B" for v in rg.where}
        steps.nets[key] = _Recorded(run.region, run.budget, signature, rg.net,
                                    dict(rg.where), labels)
        steps.calls[key] += 1
        steps.ran.add(run.region)
        steps.kept += cut.nbytes
        steps.order.append((key, cut.nbytes))
        steps.unpriced = True
        step_total = steps.kept
    over = cut.nbytes > cap * (1 + 1e-9) + 1
    head = f"whole-model memory budget {budget_label(model.nbytes)}: {why}; this call keeps "
    note = head + (f"{cut.nbytes:,} B of its {free:,} B without a budget, within {part}"
                   if not over else
                   f"{cut.nbytes:,} B, the least it can keep, above {part}, so this step "
                   f"keeps more than the budget ({step_total:,} B so far)")
    note += (f"; one price per byte over this step's calls of the {len(model.members)} "
             f"regions is found when the step ends")
    dropped = _dropped(rg.net, cut.kept, rg.where, labels,
                       f"its part of the whole-model budget {budget_label(model.nbytes)} in "
                       f"this step")
    plan = plan_of_cut(rg, cut.kept, cut.on_host, signature, [note], dropped, cut.nbytes,
                       free, cap)
    plan.final = False  # not stored: the region's plan comes with the price
    return plan


def _why_unplanned(steps: _Steps, key: Key) -> str:
    region = key[0]
    if not steps.prices:
        return "recording step"
    known = [g for g, calls in steps.prices.items() if key in calls]
    if not known:
        seen = any(k[0] == region for calls in steps.prices.values() for k in calls)
        return (f"region {region!r} ran ops or shapes no plan matched" if seen else
                f"region {region!r} was not in the step the price was found for")
    if steps.gen is not None and steps.gen not in known:
        return (f"region {region!r}'s plan is of another price than this step's other "
                f"calls")
    return f"region {region!r} ran more often than in the step the price was found for"


def _dropped(net: Any, kept: list[fx.Node], where: dict[fx.Node, tuple[int, int]],
             labels: dict[fx.Node, str], why: str) -> list[tuple[int, int, int, str]]:
    """``(op number, output, bytes, why)`` of each value the cut without a budget keeps
    and ``kept`` does not."""
    have = set(kept)
    return [(where[v][0], where[v][1], int(net.save_cost[net.cls.index[v]]),
             f"{labels.get(v, v.name)}: recomputed in backward to meet {why}")
            for v in _kept_unconstrained(net) if v not in have and v in where]


def _solve(model: ModelBudget, steps: _Steps, calls: dict[Key, int]) -> None:
    """The price over a step's calls, each network counted as often as it ran; each
    region's plan for each of its shapes is its cut at that price."""
    from ..budgets.shared import solve_shared_price
    from ..budgets.unreachable import unreachable_error
    keys = list(calls)
    recs = [steps.nets[k] for k in keys]
    counts = [calls[k] for k in keys]
    price = solve_shared_price([r.net for r in recs], float(model.nbytes), counts=counts)
    if price.total > model.nbytes and model.step_peak is None:
        regions = ", ".join(dict.fromkeys(r.region for r in recs))
        raise unreachable_error(
            f"whole-model memory budget {budget_label(model.nbytes)} of apply_regions",
            f"the least the regions can keep together is {price.total:,} B, with everything "
            f"recomputed or offloaded that may be (regions {regions}, each call counted)",
            ["relax the policy's MUST_SAVE decisions to PREFER_SAVE (policies.relaxed("
             "policy); policies.relaxed(policy, hooks=True) also relaxes SaveWithHooks) so "
             "the budget may evict them"],
            budget=model.nbytes, least=price.total,
            unconstrained=sum(n * free for n, free in zip(counts, price.unconstrained)))
    total = sum(n * free for n, free in zip(counts, price.unconstrained))
    n_calls, regions = sum(counts), len({r.region for r in recs})
    head = (f"whole-model memory budget {budget_label(model.nbytes)}: {price.total:,} B kept "
            f"by {n_calls} call{'s' if n_calls > 1 else ''} of {regions} region"
            f"{'s' if regions > 1 else ''} together (without the budget {total:,} B); one "
            f"price per byte, w = {price.weight:.3g}, {price.solves} solves")
    _apply_cuts(model, steps, keys, counts, price.cuts, price.unconstrained, price.weight,
                head)


def _apply_cuts(model: ModelBudget, steps: _Steps, keys: list[Key], counts: list[int],
                cuts: list[Any], unconstrained_bytes: list[int], weight: float | None,
                head: str) -> None:
    """Each call's cut becomes its region's plan at its signature, of a new price."""
    recs = [steps.nets[k] for k in keys]
    gen, steps.next_gen = steps.next_gen, steps.next_gen + 1
    shares: dict[str, int] = {}
    unconstrained: dict[str, int] = {}
    for rec, n, cut, free in zip(recs, counts, cuts, unconstrained_bytes):
        shares[rec.region] = shares.get(rec.region, 0) + n * cut.nbytes
        unconstrained[rec.region] = unconstrained.get(rec.region, 0) + n * free
    for rec, n, cut, free in zip(recs, counts, cuts, unconstrained_bytes):
        rg = RegionGraph(None, rec.net, rec.where, {})
        dropped = _dropped(rec.net, cut.kept, rec.where, rec.labels,
                           f"the whole-model budget {budget_label(model.nbytes)}")
        runs = f" (each of its {n} calls per step)" if n > 1 else ""
        note = f"{head}; this call's share {cut.nbytes:,} B{runs} of its {free:,} B without it"
        plan = plan_of_cut(rg, cut.kept, cut.on_host, rec.signature, [note], dropped,
                           cut.nbytes, free, float(model.nbytes))
        plan.gen = gen
        with rec.budget.lock:
            rec.budget.plans[rec.signature] = plan
    steps.prices[gen] = {k: (n, c.nbytes) for k, n, c in zip(keys, counts, cuts)}
    for old in sorted(steps.prices)[:-_PRICES_KEPT]:
        del steps.prices[old]
    live = {k for calls_of in steps.prices.values() for k in calls_of}
    steps.nets = {k: r for k, r in steps.nets.items() if k in live}
    model.priced(weight, shares, unconstrained, head)


def _kept_unconstrained(net: Any) -> list[fx.Node]:
    from ..budgets.search import is_activation
    from ..cut.solvers import solve
    saved, _ = solve(net)
    return [v for v in saved if is_activation(net, net.cls.index[v])]
