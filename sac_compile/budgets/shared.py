"""One byte budget for several independent regions: a single price per byte.

Each region's network is cut at the same Lagrangian weight ``w`` (:mod:`.search`: device
bytes of activations as they are, everything else scaled by ``w``). The regions do not
share values, so the cut of each at one ``w`` is optimal for the sum of their objectives:
every region gives up bytes where they are cheapest to give up *across the model*, not
within its own share. ``w`` is found once by :func:`.search.bisect_price` (as
:func:`.split.solve_with_budget` does for one network) so that the sum of the regions' kept
bytes fits the budget; identical regions switch at the same price, so the slack between the
last two prices is filled by moving regions one at a time to the cut just above it while
the total still fits.

A network may stand for several calls (``counts``: a block that runs twice per step keeps
its bytes twice): its bytes count that many times, and it moves as a whole, since all its
calls apply one plan.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..cut.exact import ExactProblem
from ..cut.network import FlowNetwork
from .search import Cut, bisect_price, cut_at, least_price, other_cost

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
                       solver: str | None = None, *,
                       counts: Sequence[int] | None = None) -> SharedPrice:
    """The largest ``w`` at which the cuts of all ``nets`` together keep at most ``cap``
    device bytes of activations, network ``k`` counted ``counts[k]`` times (default once).
    When even the least each can keep is above ``cap``: the cuts that keep the least
    (``total`` then above ``cap``: the caller says so, or raises
    :func:`.unreachable.unreachable_error`)."""
    problems = [ExactProblem.from_network(net) for net in nets]
    times = list(counts) if counts is not None else [1] * len(nets)
    solves = 0

    def summed(values: Sequence[int]) -> int:
        return sum(n * v for n, v in zip(times, values))

    def cuts_at(w: float) -> list[Cut]:
        nonlocal solves
        solves += len(nets)
        return [cut_at(net, problem, w, solver) for net, problem in zip(nets, problems)]

    base = cuts_at(1.0)
    unconstrained = [c.nbytes for c in base]
    if summed(unconstrained) <= cap:
        return SharedPrice(1.0, base, summed(unconstrained), unconstrained, unconstrained,
                           solves)
    w_min = least_price(other_cost(*nets))
    low = cuts_at(w_min)
    least = [c.nbytes for c in low]
    if summed(least) > cap:
        return SharedPrice(w_min, low, summed(least), unconstrained, least, solves)
    best, over, weight = bisect_price(cuts_at, lambda cuts: summed([c.nbytes for c in cuts])
                                      <= cap, w_min, low, base)
    # Identical regions switch at the same price: between the two last prices, move regions
    # one by one to the dearer side's cut (more bytes, less recompute) while the total fits.
    best = list(best)
    total = summed([c.nbytes for c in best])
    order = sorted(range(len(nets)), key=lambda k: over[k].cost - best[k].cost)
    for k in order:
        grow = times[k] * (over[k].nbytes - best[k].nbytes)
        if over[k].cost < best[k].cost and total + grow <= cap:
            best[k], total = over[k], total + grow
    return SharedPrice(weight, best, total, unconstrained, least, solves)
