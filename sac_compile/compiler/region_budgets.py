"""torch's per-region activation memory budgets (``torch.autograd.graph.
region_activation_memory_budget``), honoured per region.

torch 2.13 applies one budget per joint graph, ignores it once a checkpoint is in the graph
and refuses two different budgets in one graph. Here each annotated group of forward values
gets its own cap, with torch's meaning of ``b``: ``least + b * (unconstrained - least)``
device bytes, where ``least`` is what the group keeps when everything in it that may be
recomputed or offloaded is, and ``unconstrained`` what the cut keeps without a budget. The
caps (and a graph-wide ``memory_budget``, if any) are rows of :mod:`.exact`'s program.
"""
from __future__ import annotations

import time

import torch.fx as fx

from .budget import TILT, EXACT_TIME_LIMIT, BudgetResult, Cut, _cut, _is_activation
from .network import FlowNetwork
from .solvers import source_side

__all__ = ["region_budget_annotations", "solve_with_region_budgets"]


def region_budget_annotations(nodes: list[fx.Node]) -> dict[fx.Node, float]:
    """The forward nodes annotated by ``torch.autograd.graph.region_activation_memory_budget``
    (torch >= 2.13; none on an older torch) and their budgets."""
    try:
        from torch.fx.traceback import _get_memory_budget_annotation
    except ImportError:  # pragma: no cover - torch < 2.13
        return {}
    out = {}
    for v in nodes:
        b = _get_memory_budget_annotation(v)
        if b is not None and v.op == "call_function":
            out[v] = float(b)
    return out


def solve_with_region_budgets(net: FlowNetwork, regions: dict[fx.Node, float],
                              budget: float | int | None, solver: str | None = None
                              ) -> tuple[BudgetResult, list[str]]:
    """Per-region budgets, as torch defines them: for the activations annotated ``b``, a
    cap of ``least + b * (unconstrained - least)`` device bytes (0.0: as few as the region
    can keep, 1.0: what the cut keeps without a budget); with ``budget``, the graph-wide cap
    too. Solved by the exact program (any size, within its time limit). Returns the result
    and one line per region budget for the report."""
    from ..report import fmt_bytes
    from .exact import ExactProblem, objective, solve_exact

    t0 = time.perf_counter()
    problem = ExactProblem.from_network(net)
    idx = net.cls.index
    base = _cut(net, problem, objective, source_side(net, solver), 1.0)
    cap_all = None
    if budget is not None:
        cap_all = budget * base.nbytes if isinstance(budget, float) else float(budget)

    def group_bytes(cut: Cut, members: set[int]) -> float:
        """Device bytes ``cut`` keeps of ``members``, with their recomputes' RNG states."""
        kept = sum(nbytes for v, nbytes in zip(cut.kept, net.device_bytes(cut.kept, cut.w))
                   if idx[v] in members)
        return kept + sum(net.recompute_bytes.get(i, 0.0) for i in cut.recomputed
                          if i in members)

    group_caps, lines = [], []
    fits = cap_all is None or base.nbytes <= cap_all
    w_min = 1e-9
    for b in sorted(set(regions.values())):
        members = {idx[v] for v, bv in regions.items() if bv == b and v in idx
                   and _is_activation(net, idx[v])}
        if not members:
            continue
        most = group_bytes(base, members)
        edges = []
        for u, v, c in net.capacities(w_min, TILT):
            i = u // 2
            if v == u + 1 and u % 2 == 0 and u < net.source and i not in members \
                    and _is_activation(net, i):
                c = c * w_min
            edges.append((u, v, c))
        least = group_bytes(
            _cut(net, problem, objective, source_side(net, solver, edges=edges), w_min),
            members)
        cap = least + b * max(most - least, 0)
        fits = fits and most <= cap
        group_caps.append((sorted(members), cap))
        lines.append(f"region_activation_memory_budget({b:g}): {len(members)} values, cap "
                     f"{fmt_bytes(cap)} (least {fmt_bytes(least)}, unconstrained "
                     f"{fmt_bytes(most)})")
    if fits:
        res = BudgetResult(base.kept, budget if budget is not None else 1.0,
                           cap_all if cap_all is not None else base.nbytes, base.nbytes,
                           base.nbytes, base.nbytes, 1.0, [], 1, time.perf_counter() - t0,
                           base.on_host, "unconstrained cut", base.cost, base.cost)
        return res, lines
    sol = solve_exact(problem, cap_all, time_limit=EXACT_TIME_LIMIT, group_caps=group_caps)
    if sol is None:
        from .tagging import CompiledCheckpointError
        raise CompiledCheckpointError(
            "sac_compile: the per-region activation memory budgets (torch.autograd.graph."
            "region_activation_memory_budget) " + ("and memory_budget " if cap_all else "") +
            f"cannot be met together within {EXACT_TIME_LIMIT:g} s of the exact solver: "
            + "; ".join(lines) + ". To fix: raise a region's budget, or drop the graph-wide "
            "memory_budget, or put a graph break between the regions")
    nodes = net.cls.nodes
    kept = [nodes[i] for i in sol.kept]
    have = set(kept)
    evicted = [v for v in base.kept if v not in have and _is_activation(net, idx[v])]
    lifted = [nodes[i] for i in sol.recomputed if i in net.lifted_under_budget]
    res = BudgetResult(kept, budget if budget is not None else 1.0,
                       cap_all if cap_all is not None else base.nbytes, int(sol.device_bytes),
                       base.nbytes, 0, 1.0, evicted, 2 + len(group_caps),
                       time.perf_counter() - t0, [nodes[i] for i in sol.on_host],
                       "exact program (MILP" + (", optimal)" if sol.optimal else
                                                ", time limit)"),
                       sol.cost, sol.cost, lifted)
    return res, lines
