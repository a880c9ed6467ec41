"""The price search, one for every kept-byte budget: the cut of a flow network at a price
per byte ``w``, and ``w`` found by bisection.

``B`` = a budget in bytes. Activation bytes ``A(cut)`` are the *device* bytes of the kept
non-input values (inputs and parameters are excluded: they are alive anyway; a value kept
on the host takes none; a ``SaveWithHooks`` value takes its packed bytes). With ``K(cut)``
= kept input bytes + recompute cost + offload cost (the rest of
:mod:`sac_compile.cut.network`'s objective), each solve minimises the Lagrangian::

    A(cut)  +  w * K(cut),        0 < w <= 1

so a budget is met by recomputing or by offloading, whichever costs less per byte freed.
``w = 1`` is the unconstrained cut. Lowering ``w`` makes recomputing, offloading (and
keeping inputs) cheaper than keeping activations; ``A`` of an optimal cut is monotone in
``w`` (if ``w1 < w2`` then ``A1 <= A2``). A search solves ``w = 1`` (done when ``A <= B``),
then :func:`least_price` (``w_min * K`` below one byte: the least ``A`` reachable; above
``B``: the budget is out of reach, :mod:`.unreachable`), then :func:`bisect_price` bisects
``log w`` (:data:`BISECT_STEPS` solves) for the largest ``w`` with ``A <= B``. Below
``w = 1``, recompute costs are tilted by up to 5% in graph order (:data:`TILT`), so that
identical blocks give way one at a time. Infinite capacities (MUST decisions, bans) stay
infinite at every ``w``: a budget never breaks a MUST.

The callers differ only in what one solve at ``w`` is - one network
(:mod:`.split`), several networks summed (:mod:`.shared`), the kinds of a model's
blocks (:mod:`.kinds`) - and in how the slack the last price leaves is filled.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

from ..cut.network import INF, FlowNetwork
from ..cut.solvers import source_side

__all__ = ["Cut", "cut_at", "cut_of_side", "is_activation", "activation_bytes",
           "other_cost", "least_price", "bisect", "bisect_price", "BISECT_STEPS", "TILT"]

BISECT_STEPS = 18

# Identical blocks would all switch at the same ``w`` (the budget then met with much room to
# spare): recompute costs get a graph-order tilt of up to this much, later values cheaper.
TILT = 0.05

T = TypeVar("T")


@dataclasses.dataclass
class Cut:
    kept: list[fx.Node]
    on_host: list[fx.Node]
    nbytes: int              # device bytes of kept activations
    cost: float              # K: recompute + offload + kept input bytes
    w: float
    recomputed: frozenset[int] = frozenset()  # node indices recomputed at a cost


def is_activation(net: FlowNetwork, i: int) -> bool:
    v = net.cls.nodes[i]
    return v.op != "placeholder" and (net.save_cost[i] != INF or net.offload_cost[i] != INF)


def activation_bytes(net: FlowNetwork, saved: list[fx.Node], w: float = 1.0) -> int:
    """Device bytes of the kept activations (an offloaded value takes none)."""
    idx = net.cls.index
    acts = [v for v in saved if is_activation(net, idx[v])]
    return int(sum(net.device_bytes(acts, w)))


def cut_of_side(net: FlowNetwork, problem: Any, side: set[int], w: float) -> Cut:
    """The cut a min-cut's source ``side`` gives at price ``w``, with its objective
    (``problem``: the network's :class:`~sac_compile.cut.exact.ExactProblem`)."""
    from ..cut.exact import objective
    from ..cut.solvers import kept_nodes
    kept = kept_nodes(net, side)
    on_host = net.offloaded(kept, w)
    idx = net.cls.index
    recomputed = {i for i in range(len(net.cls.nodes))
                  if 2 * i not in side and problem.recompute[i] not in (0, INF)}
    cost, _ = objective(problem, {idx[v] for v in kept}, {idx[v] for v in on_host}, recomputed)
    rng = sum(net.recompute_bytes.get(i, 0.0) for i in recomputed)
    return Cut(kept, on_host, int(activation_bytes(net, kept, w) + rng), cost, w,
               frozenset(recomputed))


def cut_at(net: FlowNetwork, problem: Any, w: float, solver: str | None = None,
           edges: Any = None) -> Cut:
    """The min cut of ``net`` at price ``w`` (``edges``: capacities of its own, else the
    network's at ``w`` with :data:`TILT`; none at ``w = 1``)."""
    if edges is None and w != 1.0:
        edges = net.capacities(w, TILT)
    return cut_of_side(net, problem, source_side(net, solver, edges=edges), w)


def other_cost(*nets: FlowNetwork) -> float:
    """Everything of ``nets``' objectives but activation bytes: recompute and offload costs
    and kept inputs' bytes, summed."""
    return sum(c for net in nets for i, v in enumerate(net.cls.nodes)
               for c in (net.recompute_cost[i], net.offload_cost[i],
                         net.save_cost[i] if v.op == "placeholder" else 0.0)
               if c not in (0, INF))


def least_price(other: float) -> float:
    """``w_min``: the price at which ``other`` (:func:`other_cost`) is worth less than one
    byte, so the cut keeps the least bytes reachable."""
    return min(0.5 / other, 1e-3) if other > 0 else 1e-3


def bisect(lo: Any, hi: Any, at: Callable[[Any], T], fits: Callable[[T], bool], steps: int,
           *, low: Any = None, high: Any = None,
           midpoint: Callable[[Any, Any], Any] = lambda lo, hi: (lo + hi) / 2,
           done: Callable[[Any, Any], bool] = lambda lo, hi: False) -> tuple[Any, Any, Any]:
    """The one bisection of every budget search: between ``lo`` (whose solve ``low``
    fits) and ``hi`` (whose solve ``high`` does not), ``steps`` times (fewer once
    ``done(lo, hi)``), solve ``at(midpoint(lo, hi))`` and move ``lo`` there if ``fits``,
    else ``hi``. Returns the last solve that fits, the last that does not, and ``lo``."""
    best, over = low, high
    for _ in range(steps):
        if done(lo, hi):
            break
        mid = midpoint(lo, hi)
        found = at(mid)
        if fits(found):
            lo, best = mid, found
        else:
            hi, over = mid, found
    return best, over, lo


def bisect_price(at: Callable[[float], T], fits: Callable[[T], bool], w_min: float,
                 low: T, high: T, steps: int = BISECT_STEPS) -> tuple[T, T, float]:
    """:func:`bisect` over ``log w`` between ``w_min`` (whose solve ``low`` fits) and 1
    (whose solve ``high`` does not): ``at(w)`` solves at ``w``, ``fits`` says whether a
    solve is within the budget. Returns the solve at the largest price found that fits,
    the solve at the least price found that does not, and the price of the first."""
    best, over, lo = bisect(math.log(w_min), 0.0, lambda mid: at(math.exp(mid)), fits, steps,
                            low=low, high=high)
    return best, over, math.exp(lo)
