"""The memory budget: the cheapest cut whose activation bytes fit a cap.

What a budget is - one meaning in Python and on the command line (:func:`check_budget`):

* a float in (0, 1]: a fraction of the activation bytes the unconstrained cut saves
  (``1.0`` = 100%, no eviction);
* an int >= 2, or a string with a unit (``"64MiB"``, ``"2k"``): a byte count;
* anything else is a ``ValueError`` that says what to write instead: ``1`` (100% or one
  byte?), 0, negatives, ``inf``/``nan``, a float above 1, ``True``.

The search
----------
``B`` = the budget above, per forward/backward split. Activation bytes ``A(cut)`` are the
*device* bytes of the kept non-input values (inputs and parameters are excluded: they are
alive anyway; a value kept on the host takes none; a ``SaveWithHooks`` value takes its
packed bytes). With ``K(cut)`` = kept input bytes + recompute cost + offload cost (the rest
of :mod:`.network`'s objective), each solve minimises the Lagrangian::

    A(cut)  +  w * K(cut),        0 < w <= 1

so a budget is met by recomputing or by offloading, whichever costs less per byte freed.
``w = 1`` is the unconstrained cut. Lowering ``w`` makes recomputing, offloading (and keeping inputs)
cheaper than keeping activations; ``A`` of an optimal cut is monotone in ``w`` (if ``w1 < w2``
then ``A1 <= A2``). :func:`solve_with_budget` solves ``w = 1`` (done when ``A <= B``), then
``w_min`` (``w_min * K`` below one byte: the least ``A`` reachable; above ``B`` ->
:class:`~sac_compile.CheckpointError` naming the values that cannot be recomputed), then
bisects ``log w`` (18 solves) for the largest ``w`` with ``A <= B``. Below ``w = 1``, recompute
costs are tilted by up to 5% in graph order, so that identical blocks give way one at a
time. Infinite capacities (MUST decisions, bans) stay infinite at every ``w``: a budget
never breaks a MUST.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import time
from typing import Any

import torch.fx as fx

from .. import graph_meta
from ..budgets import budget_label, check_budget, proposed_budget  # noqa: F401
from ..errors import BudgetUnreachableError
from . import costs
from .network import INF, FlowNetwork
from .reasons import ReasonKind, kind_of
from .solvers import source_side

__all__ = ["check_budget", "budget_label", "solve_with_budget",
           "BudgetResult"]

BISECT_STEPS = 18

# Keys of :data:`_BAN_FIX` beyond the reason kinds.
_HOOKS = "SaveWithHooks"
_RNG_STATE = "RNG state"


@dataclasses.dataclass
class BudgetResult:
    saved: list[fx.Node]                 # the chosen cut's saved nodes, graph order
    budget: float | int                  # as given
    budget_bytes: float                  # the cap on activation bytes for this split
    activation_bytes: int                # what the chosen cut saves (inputs excluded)
    unconstrained_bytes: int             # what the cut without a budget saves
    min_bytes: int                       # the least reachable
    weight: float                        # the chosen w (1.0: the unconstrained cut)
    evicted: list[fx.Node]               # saved without the budget, not with it
    solves: int
    seconds: float
    offloaded: list[fx.Node] = dataclasses.field(default_factory=list)  # kept on the host
    method: str = ""                     # how the cut was found
    cost: float = 0.0                    # its recompute + offload + kept-input cost
    lagrangian_cost: float = 0.0         # the same for the Lagrangian search's cut
    lifted: list[fx.Node] = dataclasses.field(default_factory=list)  # upstream bans lifted


def _is_activation(net: FlowNetwork, i: int) -> bool:
    v = net.cls.nodes[i]
    return v.op != "placeholder" and (net.save_cost[i] != INF or net.offload_cost[i] != INF)


# Identical blocks would all switch at the same ``w`` (the budget then met with much room to
# spare): recompute costs get a graph-order tilt of up to this much, later values cheaper.
TILT = 0.05


def _activation_bytes(net: FlowNetwork, saved: list[fx.Node], w: float = 1.0) -> int:
    """Device bytes of the kept activations (an offloaded value takes none)."""
    idx = net.cls.index
    acts = [v for v in saved if _is_activation(net, idx[v])]
    return int(sum(net.device_bytes(acts, w)))


# The exact program (:mod:`.exact`) refines the search on splits up to this many nodes.
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
    from .exact import ExactProblem, objective

    t0 = time.perf_counter()
    solves = 0
    problem = ExactProblem.from_network(net)

    def at(w: float, edges: Any = None) -> Cut:
        nonlocal solves
        solves += 1
        if edges is None and w != 1.0:
            edges = net.capacities(w, TILT)
        side = source_side(net, solver, edges=edges)
        return _cut(net, problem, objective, side, w)

    base = at(1.0)
    cap = budget * base.nbytes if isinstance(budget, float) else float(budget)

    def result(cut: Cut, min_bytes: int, method: str, lagrangian_cost: float) -> BudgetResult:
        kept = set(cut.kept)
        evicted = [v for v in base.kept if v not in kept
                   and _is_activation(net, net.cls.index[v])]
        lifted = [net.cls.nodes[i] for i in sorted(cut.recomputed)
                  if i in net.lifted_under_budget]
        return BudgetResult(cut.kept, budget, cap, cut.nbytes, base.nbytes, min_bytes, cut.w,
                            evicted, solves, time.perf_counter() - t0, cut.on_host,
                            method, cut.cost, lagrangian_cost, lifted)

    if base.nbytes <= cap:
        return result(base, base.nbytes, "unconstrained cut", base.cost)
    # Everything but activation bytes together worth less than one byte at w_min.
    other = sum(c for i, v in enumerate(net.cls.nodes)
                for c in (net.recompute_cost[i], net.offload_cost[i],
                          net.save_cost[i] if v.op == "placeholder" else 0.0)
                if c not in (0, INF))
    w_min = min(0.5 / other, 1e-3) if other > 0 else 1e-3
    low = at(w_min)
    if low.nbytes > cap:
        # Keeps its type and message through Dynamo (a CheckpointError, not wrapped).
        rng = sum(net.recompute_bytes.get(i, 0.0) for i in low.recomputed)
        raise budget_unreachable(net, low.kept, budget, cap, low.nbytes, base.nbytes,
                                 rng) from None
    best, over = low, base
    lo, hi = math.log(w_min), 0.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        cut = at(math.exp(mid))
        if cut.nbytes <= cap:
            lo, best = mid, cut
        else:
            hi, over = mid, cut
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


@dataclasses.dataclass
class Cut:
    kept: list[fx.Node]
    on_host: list[fx.Node]
    nbytes: int              # device bytes of kept activations
    cost: float              # K: recompute + offload + kept input bytes
    w: float
    recomputed: frozenset[int] = frozenset()  # node indices recomputed at a cost


def _cut(net: FlowNetwork, problem: Any, objective: Any, side: set[int], w: float) -> Cut:
    from .solvers import kept_nodes
    kept = kept_nodes(net, side)
    on_host = net.offloaded(kept, w)
    idx = net.cls.index
    recomputed = {i for i in range(len(net.cls.nodes))
                  if 2 * i not in side and problem.recompute[i] not in (0, INF)}
    cost, _ = objective(problem, {idx[v] for v in kept}, {idx[v] for v in on_host}, recomputed)
    rng = sum(net.recompute_bytes.get(i, 0.0) for i in recomputed)
    return Cut(kept, on_host, int(_activation_bytes(net, kept, w) + rng), cost, w,
               frozenset(recomputed))


def _exact_cut(net: FlowNetwork, problem: Any, cap: float, best: Cut) -> tuple[Cut, str] | None:
    """The exact program's cut, when it is cheaper than ``best`` (or as cheap: then ours)."""
    try:
        from .exact import solve_exact
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
    candidates = [v for v in over.kept if v not in have and _is_activation(net, idx[v])]
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


_BAN_FIX = {
    ReasonKind.MUST_SAVE: "relax those MUST_SAVE decisions to PREFER_SAVE "
                          "(policies.relaxed(policy)) so they may be recomputed",
    # A SaveWithHooks is a MUST that relaxed(policy) leaves alone: its hooks=True form
    # turns it into PREFER_SAVE (and relaxes the other MUSTs too).
    _HOOKS: "let the budget recompute the values SaveWithHooks packs: "
            "policies.relaxed(policy, hooks=True) turns SaveWithHooks (and the other MUSTs) "
            "into PREFER_SAVE, so they may be recomputed (a value the budget still keeps is "
            "then kept unpacked)",
    ReasonKind.UPSTREAM_BAN: "put those ops in a region whose policy returns PREFER_RECOMPUTE "
                             "for them (outside every region they keep upstream's ban)",
    ReasonKind.RANDOM: "let their random ops be recomputed (torch's RNG functionalisation)",
    ReasonKind.EFFECTFUL: "keep collectives and effectful ops out of the budget's reach "
                          "(they are never replayed)",
    ReasonKind.MUST_RUN_IN_FORWARD: "none for those: torch runs them in the forward",
    # Kept because recomputing them would keep more (a CPU generator's state): recomputing
    # more is not the fix.
    _RNG_STATE: "run on an accelerator, where a recomputed random op keeps 16 bytes of RNG "
                "state instead of the CPU generator's 5,056",
}


def _fix_kind(v: fx.Node, reason: Any) -> Any:
    """What fixes ``v``'s ban: its reason's kind, or :data:`_HOOKS` for a SaveWithHooks
    decision (a MUST_SAVE that ``relaxed(policy)`` does not relax)."""
    kind = kind_of(reason)
    dec = graph_meta.decision(v)
    if kind is ReasonKind.MUST_SAVE and getattr(dec, "hooks", None) is not None:
        return _HOOKS
    return kind


def _random_ancestor(net: FlowNetwork, v: fx.Node, kept: set[fx.Node]) -> fx.Node | None:
    """A random op that recomputing ``v`` would replay (not through kept values), keeping
    its generator's state (:attr:`FlowNetwork.recompute_bytes`); None if there is none."""
    idx = net.cls.index
    seen, stack = {v}, list(v.all_input_nodes)
    while stack:
        u = stack.pop()
        if u in seen or u not in idx or u in kept or u.op == "placeholder":
            continue
        seen.add(u)
        if idx[u] in net.recompute_bytes:
            return u
        stack.extend(u.all_input_nodes)
    return None


def _blocking_bans(net: FlowNetwork, v: fx.Node) -> list[fx.Node]:
    """The nearest ancestors of ``v`` that cannot be recomputed even under a budget (not
    graph inputs): what stops ``v`` from being recomputed."""
    idx = net.cls.index
    out, seen, stack = [], {v}, list(v.all_input_nodes)
    while stack and len(out) < 3:
        u = stack.pop()
        if u in seen or u not in idx:
            continue
        seen.add(u)
        if u.op == "placeholder":
            continue
        if u in net.ban_reason and idx[u] not in net.lifted_under_budget:
            out.append(u)
            continue
        stack.extend(u.all_input_nodes)
    return out


def budget_unreachable(net: FlowNetwork, saved: list[fx.Node], budget: float | int,
                       cap: float, min_bytes: int, base_bytes: int, rng_bytes: float = 0.0,
                       prefix: str = "") -> BudgetUnreachableError:
    """The error for a budget no cut meets: the values that keep it out of reach, why, and
    fixes that work, among them ``proposed_budget`` (valid, met: see
    :func:`~sac_compile.budgets.proposed_budget`)."""
    from ..report import fmt_bytes
    idx = net.cls.index

    def where(v: fx.Node) -> str:
        path = graph_meta.region_path(v)
        return f" in region {path[-1]!r}" if path else " (outside every region)"

    acts = sorted((v for v in saved if _is_activation(net, idx[v])),
                  key=lambda v: -net.save_cost[idx[v]])
    items, kinds = [], []
    for v in acts[:5]:
        base = v.args[0] if v.target is operator.getitem and v.args else v
        if v in net.ban_reason and idx[v] not in net.lifted_under_budget:
            why = net.ban_reason[v]
            kinds.append(_fix_kind(v, why))
        elif idx.get(base) in net.recompute_bytes:
            rng = net.recompute_bytes[idx[base]]
            kinds.append(_RNG_STATE)
            why = (f"a random op: recomputing it keeps its generator's RNG state, "
                   f"{fmt_bytes(rng)} (a CPU generator's whole state), more than its outputs")
        elif (random := _random_ancestor(net, v, set(saved))) is not None:
            kinds.append(_RNG_STATE)
            why = (f"recomputing it replays {random.name} ({costs.op_label(random)}), a random "
                   f"op whose generator state "
                   f"({fmt_bytes(net.recompute_bytes[idx[random]])}) is larger to keep")
        else:
            blockers = _blocking_bans(net, v)
            kinds.extend(_fix_kind(b, net.ban_reason[b]) for b in blockers)
            why = ("recomputing it needs " + ", ".join(
                f"{b.name} ({costs.op_label(b)}{where(b)}: {net.ban_reason[b]})"
                for b in blockers) + ", which cannot be recomputed and is larger to keep"
                   ) if blockers else "kept so that others can be recomputed"
        items.append(f"{v.name} ({costs.op_label(v)}, {fmt_bytes(net.save_cost[idx[v]])}"
                     f"{where(v)}: {why})")
    if rng_bytes:
        kinds.append(_RNG_STATE)
        items.append(f"the RNG states of the random ops it recomputes ({fmt_bytes(rng_bytes)}"
                     f"; a CPU generator's state is 5,056 bytes, an accelerator's 16)")
    given = (f"{budget_label(budget)} of {fmt_bytes(base_bytes)} = {fmt_bytes(cap)}"
             if isinstance(budget, float) else fmt_bytes(cap))
    least = min(min_bytes, base_bytes) if base_bytes else min_bytes
    proposed = proposed_budget(budget, least, base_bytes)
    if _HOOKS in kinds:  # relaxed(policy, hooks=True) relaxes the plain MUSTs as well
        kinds = [k for k in kinds if k is not ReasonKind.MUST_SAVE]
    fixes = [_BAN_FIX[k] for k in dict.fromkeys(kinds) if k in _BAN_FIX]
    meaning = " (keep what the policy keeps)" if proposed == 1.0 else ""
    # (No "recompute more": at the least reachable all that may be recomputed is.)
    fix = (f"raise the budget to at least {fmt_bytes(least)}: memory_budget={proposed!r}"
           f"{meaning}" + "".join(f", or {f}" for f in fixes) + "; on an accelerator, values may also be offloaded (MUST/PREFER_CPU_OFFLOAD)")
    return BudgetUnreachableError(
        f"{prefix}sac_compile: memory budget {given} cannot be met: even with everything "
        f"recomputed or offloaded that may be, this forward/backward split keeps "
        f"{fmt_bytes(least)} of activations on the device. Largest values it must "
        f"still keep: {'; '.join(items) or 'none'}. To fix: {fix}.",
        budget=budget, least_bytes=int(least), unconstrained_bytes=int(base_bytes),
        proposed_budget=proposed)
