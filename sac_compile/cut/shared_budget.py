"""One byte budget for several independent regions: a single price per byte.

Each region's network is cut at the same Lagrangian weight ``w`` (:mod:`.budget`: device
bytes of activations as they are, everything else scaled by ``w``). The regions do not
share values, so the cut of each at one ``w`` is optimal for the sum of their objectives:
every region gives up bytes where they are cheapest to give up *across the model*, not
within its own share. ``w`` is found once by bisection (as :func:`.budget.solve_with_budget`
does for one network) so that the sum of the regions' kept bytes fits the budget; identical
regions switch at the same price, so the slack between the last two prices is filled by
moving regions one at a time to the cut just above it while the total still fits.

A network may stand for several calls (``counts``: a block that runs twice per step keeps
its bytes twice): its bytes count that many times, and it moves as a whole, since all its
calls apply one plan.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .budget import BISECT_STEPS, TILT, Cut, _cut
from .network import INF, FlowNetwork
from .solvers import source_side

__all__ = ["SharedPrice", "solve_shared_price"]


@dataclasses.dataclass
class SharedPrice:
    weight: float                 # the price found (1.0: no region gives anything up)
    cuts: list[Cut]               # one per network, at ``weight``
    total: int                    # their kept device bytes together, each call counted
    unconstrained: list[int]      # each network's bytes at w = 1 (per call)
    least: list[int]              # each network's least reachable bytes (per call)
    solves: int


def solve_shared_price(nets: Sequence[FlowNetwork], cap: float,
                       solver: str | None = None, *, or_least: bool = False,
                       counts: Sequence[int] | None = None) -> SharedPrice:
    """The largest ``w`` at which the cuts of all ``nets`` together keep at most ``cap``
    device bytes of activations, network ``k`` counted ``counts[k]`` times (default once).
    When even the least each can keep is above ``cap``: ``ValueError`` (with the least
    reachable total in its message), or with ``or_least`` the cuts that keep the least
    (``total`` then above ``cap``)."""
    from .exact import ExactProblem, objective

    problems = [ExactProblem.from_network(net) for net in nets]
    times = list(counts) if counts is not None else [1] * len(nets)
    solves = 0

    def summed(values: Sequence[int]) -> int:
        return sum(n * v for n, v in zip(times, values))

    def cuts_at(w: float) -> list[Cut]:
        nonlocal solves
        out = []
        for net, problem in zip(nets, problems):
            solves += 1
            edges = None if w == 1.0 else net.capacities(w, TILT)
            out.append(_cut(net, problem, objective, source_side(net, solver, edges=edges), w))
        return out

    base = cuts_at(1.0)
    unconstrained = [c.nbytes for c in base]
    if summed(unconstrained) <= cap:
        return SharedPrice(1.0, base, summed(unconstrained), unconstrained, unconstrained,
                           solves)
    other = sum(c for net in nets for i, v in enumerate(net.cls.nodes)
                for c in (net.recompute_cost[i], net.offload_cost[i],
                          net.save_cost[i] if v.op == "placeholder" else 0.0)
                if c not in (0, INF))
    w_min = min(0.5 / other, 1e-3) if other > 0 else 1e-3
    low = cuts_at(w_min)
    least = [c.nbytes for c in low]
    if summed(least) > cap:
        if or_least:
            return SharedPrice(w_min, low, summed(least), unconstrained, least, solves)
        err = ValueError(f"the least the regions can keep together is {summed(least):,} B")
        err.least_bytes = summed(least)  # type: ignore[attr-defined]  (for the caller's fix)
        err.unconstrained_bytes = summed(unconstrained)  # type: ignore[attr-defined]
        raise err
    best, over = low, base
    lo, hi = math.log(w_min), 0.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        cuts = cuts_at(math.exp(mid))
        if summed([c.nbytes for c in cuts]) <= cap:
            lo, best = mid, cuts
        else:
            hi, over = mid, cuts
    # Identical regions switch at the same price: between the two last prices, move regions
    # one by one to the dearer side's cut (more bytes, less recompute) while the total fits.
    best = list(best)
    total = summed([c.nbytes for c in best])
    order = sorted(range(len(nets)), key=lambda k: over[k].cost - best[k].cost)
    for k in order:
        grow = times[k] * (over[k].nbytes - best[k].nbytes)
        if over[k].cost < best[k].cost and total + grow <= cap:
            best[k], total = over[k], total + grow
    return SharedPrice(math.exp(lo), best, total, unconstrained, least, solves)
