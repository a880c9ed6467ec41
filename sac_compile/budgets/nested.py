"""Kept bytes placed in time: region calls whose kept values live in nested intervals.

The calls of a step's blocks run forward in order ``1..L`` and backward in reverse; call
``j``'s kept values live from its forward to its backward, so while blocks ``1..d`` hold
theirs and the others do not (the forward between calls ``d`` and ``d + 1``, the backward
between the backwards of calls ``d + 1`` and ``d``), the step holds the *prefix*
``P_d = kept_1 + ... + kept_d`` on top of what it holds anyway. A measured step gives,
per depth ``d``, the most it held there beside its prefix; the peak budget ``n`` then caps
each prefix: ``P_d <= caps[d]``. One price per byte over all calls meets only the tightest
of these: where the step peaks late in the backward (gradients made, the embedding's
backward), the last blocks' values are freed before that moment and may be kept at no
cost to the peak; where it peaks at the loss's backward, every call holds its values
then and the uniform price is what the caps ask.

:func:`solve_nested` picks, per call, one cut among those the price search gives for its
network (the cuts at :data:`PRICES` prices from the least reachable to none, and the exact
program's at :data:`EXACT_OPTIONS` kept-byte caps between them: a price only reaches the
cuts on the lower convex hull of cost against bytes), minimising
the summed cost (recompute, offload: the search's objective) with every prefix within its
cap: a dynamic program over the calls in order, its states the prefix's bytes (those
within one :data:`RESOLUTION` of the largest cap merged, the cheaper kept).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ..cut.exact import ExactProblem
from ..cut.network import FlowNetwork
from .search import Cut, cut_at, least_price, other_cost

__all__ = ["NestedCuts", "solve_nested", "PRICES", "RESOLUTION"]

PRICES = 16         # cuts per network: prices from the least reachable to 1, log-spaced,
MAX_SOLVES = 64     # then refined between neighbours that cut differently, up to this many
RESOLUTION = 2048   # prefix bytes merged within 1/RESOLUTION of the largest cap
EXACT_OPTIONS = 8   # then the exact program's cuts at this many kept-byte caps between them
EXACT_TIME_LIMIT = 2.0  # seconds per such solve (past it: its best cut, if any)


@dataclasses.dataclass
class NestedCuts:
    cuts: list[Cut]          # one per call, in call order
    total: int               # their kept bytes together
    fits: bool               # every prefix within its cap (else: the least of each)
    unconstrained: list[int]  # each call's kept bytes without a budget


def cut_options(net: FlowNetwork, problem: ExactProblem | None = None) -> list[Cut]:
    """The cuts of ``net`` over the prices from the least reachable to 1: :data:`PRICES`
    log-spaced, then between two neighbours that cut differently their midpoint (log),
    up to :data:`MAX_SOLVES` solves; least kept first, each keeping more than the one
    before for less cost (the others dropped)."""
    problem = problem or ExactProblem.from_network(net)
    lo = math.log(least_price(other_cost(net)))
    at: dict[float, Cut] = {}
    for k in range(PRICES):
        x = lo * (1 - k / (PRICES - 1))
        at[x] = cut_at(net, problem, math.exp(x))
    while len(at) < MAX_SOLVES:
        xs = sorted(at)
        gaps = [(a, b) for a, b in zip(xs, xs[1:])
                if at[a].nbytes != at[b].nbytes and b - a > 1e-3]
        if not gaps:
            break
        for a, b in gaps[:MAX_SOLVES - len(at)]:
            at[(a + b) / 2] = cut_at(net, problem, math.exp((a + b) / 2))
    cuts = list(at.values())
    least, most = min(c.nbytes for c in cuts), max(c.nbytes for c in cuts)
    if most > least:
        # Between the hull's cuts: measured on HF GPT-2 (bench, eager, PeakBudget(45 MB)),
        # 0.671 GFLOPs recomputed against 0.705 with the price search's cuts alone.
        cuts += _exact_cuts(net, problem, [least + (most - least) * j / (EXACT_OPTIONS + 1)
                                           for j in range(1, EXACT_OPTIONS + 1)])
    out: list[Cut] = []
    for c in sorted(cuts, key=lambda c: (c.nbytes, c.cost)):
        if not out or c.cost < out[-1].cost:
            out.append(c)
    return out


def _problem_key(net: FlowNetwork) -> tuple:
    """Everything the searches read of ``net``, by node index: two networks with the same
    key have the same cuts, node ``i`` of one for node ``i`` of the other."""
    return (tuple(net.structure), tuple(net.save_cost), tuple(net.offload_cost),
            tuple(net.recompute_cost), tuple(sorted(net.lifted_under_budget.items())),
            tuple(sorted(net.recompute_bytes.items())),
            tuple(v.op == "placeholder" for v in net.cls.nodes))


def _translated(cut: Cut, src: FlowNetwork, dst: FlowNetwork) -> Cut:
    """``cut`` of ``src`` as the same cut of ``dst`` (same :func:`_problem_key`)."""
    index, nodes = src.cls.index, dst.cls.nodes
    return dataclasses.replace(cut, kept=[nodes[index[v]] for v in cut.kept],
                               on_host=[nodes[index[v]] for v in cut.on_host])


def _exact_cuts(net: FlowNetwork, problem: ExactProblem, caps: Sequence[float]) -> list[Cut]:
    """The exact program's cheapest cut within each kept-byte cap of ``caps`` (none where
    scipy has no MILP, or it found none in :data:`EXACT_TIME_LIMIT`)."""
    try:
        from ..cut.exact import solve_exact
    except ImportError:  # pragma: no cover - a scipy without milp
        return []
    nodes, out = net.cls.nodes, []
    for cap in caps:
        sol = solve_exact(problem, cap, time_limit=EXACT_TIME_LIMIT)
        if sol is not None:
            out.append(Cut([nodes[i] for i in sol.kept], [nodes[i] for i in sol.on_host],
                           int(sol.device_bytes), sol.cost, 1.0, frozenset(sol.recomputed)))
    return out


def solve_nested(nets: Sequence[FlowNetwork], caps: Sequence[float]) -> NestedCuts:
    """One cut per network (in call order) with ``sum(kept[:d + 1]) <= caps[d]`` for every
    ``d`` at the least summed cost; where no choice fits, each network's least. Calls of
    identical blocks have the same problem (:func:`_problem_key`): their options are
    searched once (a 32-layer model: one search, not 32, per calibration step)."""
    searched: dict[tuple, tuple[FlowNetwork, list[Cut]]] = {}
    options = []
    for net in nets:
        first, opts = searched.setdefault(_problem_key(net), (net, []))
        if first is net:
            opts[:] = cut_options(net)
        options.append(opts if first is net else [_translated(c, first, net) for c in opts])
    finite = [c for c in caps if math.isfinite(c)]
    step = max(max(finite, default=1.0), 1.0) / RESOLUTION
    # state: bucket of the prefix's bytes -> (cost, prefix bytes, choices)
    states: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for d, opts in enumerate(options):
        nxt: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for cost, total, chosen in states.values():
            for k, c in enumerate(opts):
                t = total + c.nbytes
                if t > caps[d]:
                    break  # (options grow in bytes)
                key = int(t // step)
                entry = (cost + c.cost, t, chosen + (k,))
                if key not in nxt or entry[:2] < nxt[key][:2]:
                    nxt[key] = entry
        if not nxt:
            least = [o[0] for o in options]
            return NestedCuts(least, sum(c.nbytes for c in least), False,
                              [o[-1].nbytes for o in options])
        # a state keeping more for no less cost is of no use
        pruned, best = {}, math.inf
        for key in sorted(nxt, key=lambda k: nxt[k][1]):
            if nxt[key][0] < best:
                pruned[key], best = nxt[key], nxt[key][0]
        states = pruned
    _, total, chosen = min(states.values(), key=lambda s: (s[0], s[1]))
    cuts = [options[d][k] for d, k in enumerate(chosen)]
    return NestedCuts(cuts, total, True, [o[-1].nbytes for o in options])
