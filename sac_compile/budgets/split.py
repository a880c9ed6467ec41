"""A kept-byte budget on one forward/backward split: the cheapest cut whose device
activation bytes fit a cap (a fraction of what the unconstrained cut keeps, or bytes:
:func:`~.values.check_budget`), the same for a compiled split and an eager region.

:func:`solve_with_budget` runs the price search (:mod:`.search`: ``w = 1``, the least price,
then ``log w`` bisected), then refines its cut: on splits up to :data:`EXACT_MAX_NODES`
nodes by the exact program (:mod:`sac_compile.cut.exact`), above that by putting values back
into the budget's slack one by one. A budget below the least reachable is
:func:`.unreachable.budget_unreachable`'s error, naming the values that cannot be recomputed.
"""
from __future__ import annotations

import time
from typing import Any

from ..cut.exact import ExactProblem
from ..cut.network import INF, FlowNetwork
from .result import BudgetResult
from .search import (TILT, Cut, bisect_price, cut_at, is_activation, least_price,
                     other_cost)
from .unreachable import budget_unreachable

__all__ = ["solve_with_budget", "EXACT_MAX_NODES", "EXACT_TIME_LIMIT"]


EXACT_MAX_NODES = 2000
EXACT_TIME_LIMIT = 20.0   # seconds per split; past it, HiGHS's best cut if it beats ours
FILL_TRIES = 24           # larger splits: values put back into the budget's slack, one by one


def solve_with_budget(net: FlowNetwork, budget: float | int,
                      solver: str | None = None, *, exact: bool = True) -> BudgetResult:
    """The cheapest cut whose device activation bytes fit ``budget`` (see the module
    docstring): the Lagrangian search, then the exact program (splits up to
    :data:`EXACT_MAX_NODES` nodes; ``exact=False``: never, as a search over many budgets
    asks) or, above that, the budget's slack filled greedily.
    :class:`~sac_compile.CheckpointError` when no cut fits."""
    t0 = time.perf_counter()
    solves = 0
    problem = ExactProblem.from_network(net)

    def at(w: float, edges: Any = None) -> Cut:
        nonlocal solves
        solves += 1
        return cut_at(net, problem, w, solver, edges)

    base = at(1.0)
    cap = budget * base.nbytes if isinstance(budget, float) else float(budget)

    def result(cut: Cut, min_bytes: int, method: str, lagrangian_cost: float) -> BudgetResult:
        kept = set(cut.kept)
        evicted = [v for v in base.kept if v not in kept
                   and is_activation(net, net.cls.index[v])]
        lifted = [net.cls.nodes[i] for i in sorted(cut.recomputed)
                  if i in net.lifted_under_budget]
        return BudgetResult(cut.kept, budget, cap, cut.nbytes, base.nbytes, min_bytes, cut.w,
                            evicted, solves, time.perf_counter() - t0, cut.on_host,
                            method, cut.cost, lagrangian_cost, lifted)

    if base.nbytes <= cap:
        return result(base, base.nbytes, "unconstrained cut", base.cost)
    w_min = least_price(other_cost(net))
    low = at(w_min)
    if low.nbytes > cap:
        # Keeps its type and message through Dynamo (a CheckpointError, not wrapped).
        rng = sum(net.recompute_bytes.get(i, 0.0) for i in low.recomputed)
        raise budget_unreachable(net, low.kept, budget, cap, low.nbytes, base.nbytes,
                                 rng) from None
    best, over, _ = bisect_price(at, lambda cut: cut.nbytes <= cap, w_min, low, base)
    lagrangian = best.cost
    if exact and len(net.cls.nodes) <= EXACT_MAX_NODES:
        refined = _exact_cut(net, problem, cap, best)
        if refined is not None:
            solves += 1
            return result(refined[0], low.nbytes, refined[1], lagrangian)
    best, tries = _fill_slack(net, cap, best, over, at)
    method = f"Lagrangian search, slack filled ({tries} tries)" if tries else \
        "Lagrangian search"
    return result(best, low.nbytes, method, lagrangian)


def _exact_cut(net: FlowNetwork, problem: Any, cap: float, best: Cut) -> tuple[Cut, str] | None:
    """The exact program's cut, when it is cheaper than ``best`` (or as cheap: then ours)."""
    try:
        from ..cut.exact import solve_exact
        sol = solve_exact(problem, cap, time_limit=EXACT_TIME_LIMIT)
    except ImportError:  # a scipy without milp
        return None
    if sol is None or sol.cost >= best.cost * (1 - 1e-9):
        if sol is not None and sol.optimal:
            return best, "Lagrangian search, proven optimal by the exact program"
        return None
    nodes = net.cls.nodes
    kept = [nodes[i] for i in sol.kept]
    cut = Cut(kept, [nodes[i] for i in sol.on_host], int(sol.device_bytes), sol.cost,
              best.w, frozenset(sol.recomputed))
    how = "exact program (MILP, optimal)" if sol.optimal else \
        f"exact program (MILP, best found in {EXACT_TIME_LIMIT:g} s)"
    return cut, how


def _fill_slack(net: FlowNetwork, cap: float, best: Cut, over: Cut,
                at: Any) -> tuple[Cut, int]:
    """Put values back into the budget's slack: each value the next cut over the budget
    keeps and ``best`` does not, most expensive to recompute first, forced kept at
    ``best``'s weight while the bytes still fit and the cost drops."""
    idx = net.cls.index
    have = set(best.kept)
    candidates = [v for v in over.kept if v not in have and is_activation(net, idx[v])]
    candidates.sort(key=lambda v: -net.recompute_cost[idx[v]])
    forced: list[int] = []
    tries = 0
    for v in candidates[:FILL_TRIES]:
        i = idx[v]
        trial = forced + [i]
        edges = net.capacities(best.w, TILT)
        for j in trial:
            edges.append((net.source, 2 * j, INF))
            edges.append((2 * j + 1, net.sink, INF))
        tries += 1
        cut = at(best.w, edges)
        if cut.nbytes <= cap and cut.cost < best.cost:
            best, forced = cut, trial
    return best, tries

