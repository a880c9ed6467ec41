"""torch's activation memory budgets, honoured where torch ignores them: per region
(``torch.autograd.graph.region_activation_memory_budget``) and graph-wide
(``torch._functorch.config.activation_memory_budget``).

torch 2.13 applies one budget per joint graph, ignores both once a checkpoint is in the
graph and refuses two different region budgets in one graph. Here each annotated stretch
of the forward gets its own cap, with torch's meaning of ``b``: ``least + b * (unconstrained
- least)`` device bytes, where ``least`` is what the stretch keeps when everything in it that
may be recomputed or offloaded is, and ``unconstrained`` what the cut keeps without a
budget. A stretch is one region call's annotated values (a ``with`` around two region calls
gives each call a cap of the same fraction), or, outside regions, a run of consecutive
annotated values. torch's graph-wide budget is one more cap, over every value no region
budget covers (torch: a region's annotation overrides the global budget). Values under no
cap are kept as the cut without any budget keeps them (their bytes stay in the objective).
The caps (and our own ``memory_budget``, if any) are rows of :mod:`sac_compile.cut.exact`'s program.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from .. import graph_meta
from ..cut.exact import ExactProblem, solve_exact
from ..cut.network import FlowNetwork
from ..errors import CompiledCheckpointError
from ..torch_internals import TorchAPIMissing
from .region import RegionBudget
from .result import BudgetResult
from .search import TILT, Cut, cut_at, is_activation
from .split import EXACT_TIME_LIMIT
from .unreachable import budget_unreachable
from .values import budget_label

__all__ = ["BudgetGroup", "region_budget_annotations", "torch_global_budget",
           "solve_with_region_budgets", "GroupFigures", "GroupShares", "RegionBudgetFacts"]


@dataclasses.dataclass
class BudgetGroup:
    """Values under one cap: torch's meaning (``least + b * (unconstrained - least)``) or
    ours (``sac_region(memory_budget=...)``: a fraction of the unconstrained bytes, or
    bytes)."""

    label: str               # for the report: what set the budget, on which values
    fraction: float          # torch's b in [0, 1]; ours: the budget as given
    nodes: list[fx.Node]
    torch_meaning: bool = True
    model: Any = None        # a whole-model budget (.model.ModelBudget)
    partial: bool = False    # the graph holds some of the model's blocks (.kinds)
    graph_cap: Any = None    # then its cap, found once per graph: (bytes, even split, line)

    def cap(self, least: float, most: float) -> float:
        if self.torch_meaning:
            return least + self.fraction * max(most - least, 0)
        if isinstance(self.fraction, float):
            return self.fraction * most
        return float(self.fraction)


@dataclasses.dataclass(frozen=True)
class GroupFigures:
    """One budget group of a split, under the chosen cut (worded by the compiler's report)."""

    label: str
    values: int    # activations under the cap
    cap: float
    least: float   # the least the group can keep
    most: float    # what the cut without a budget keeps of it
    kept: float    # what the chosen cut keeps of it


@dataclasses.dataclass(frozen=True)
class GroupShares:
    """A whole-model budget: each region's share of the bytes kept."""

    label: str
    shares: dict[str, int]


@dataclasses.dataclass(frozen=True)
class RegionBudgetFacts:
    groups: list[GroupFigures]   # groups with something to keep, in order
    shares: list[GroupShares]
    # a whole-model budget's blocks compiled one by one: how this graph's cap was found
    # (worded by cut/kinds.py, which prices across graphs)
    price_notes: list[str] = dataclasses.field(default_factory=list)


def torch_global_budget() -> float | None:
    """``torch._functorch.config.activation_memory_budget`` when it asks for less than the
    default strategy (< 1.0); None otherwise."""
    from ..torch_internals import functorch_config as config
    b = getattr(config, "activation_memory_budget", 1.0)
    return float(b) if b is not None and float(b) < 1.0 else None


def region_budget_annotations(nodes: list[fx.Node], global_fraction: float | None = None
                              ) -> list[BudgetGroup]:
    """The groups of forward values under torch's budgets: one per annotated stretch
    (``region_activation_memory_budget``, torch >= 2.13) and, with ``global_fraction``
    (torch's ``activation_memory_budget``), one over the values none of them covers."""
    try:
        from ..torch_internals import get_memory_budget_annotation
    except TorchAPIMissing:  # pragma: no cover - torch < 2.13
        get_memory_budget_annotation = None
    groups: dict[object, BudgetGroup] = {}
    rest: list[fx.Node] = []
    run, last = 0, None
    for v in nodes:
        if v.op != "call_function":
            continue
        b = get_memory_budget_annotation(v) if get_memory_budget_annotation else None
        call = graph_meta.outer_region_id(v)
        if b is None:
            rest.append(v)
            if call is None:
                last = None  # a value outside regions and budgets ends a run
            continue
        b = float(b)
        if last != (b, call):
            run, last = run + 1, (b, call)
        key = (b, call) if call is not None else (b, "run", run)
        if key not in groups:
            path = graph_meta.region_path(v)
            where = f"region {path[0]!r}" if path else "outside regions"
            groups[key] = BudgetGroup(f"region_activation_memory_budget({b:g}): {where}", b, [])
        groups[key].nodes.append(v)
    out = list(groups.values()) + our_budget_groups(nodes)
    if global_fraction is not None and rest:
        out.append(BudgetGroup(
            f"torch._functorch.config.activation_memory_budget={global_fraction:g} (torch's "
            f"meaning: least + {global_fraction:g} x (unconstrained - least)): "
            f"{'the values no region budget covers' if out else 'the whole graph'}",
            global_fraction, rest))
    return out


def our_budget_groups(nodes: list[fx.Node]) -> list[BudgetGroup]:
    """``sac_region(memory_budget=...)``: one group per region call with a budget (the
    tagging mode writes ``meta["sac_region_budgets"]``); a whole-model budget
    (``apply_regions(..., memory_budget=bytes)``) is one group over all its regions in this
    graph (``partial`` when the graph holds only some of them)."""
    groups: dict[object, BudgetGroup] = {}
    names: dict[object, set[str]] = {}
    for v in nodes:
        for region_id, name, budget in graph_meta.region_budgets(v):
            assert isinstance(budget, RegionBudget)
            model = budget.model
            key = ("model", id(model)) if model is not None else ("region", region_id)
            if key not in groups:
                label = (f"memory_budget={budget_label(model.nbytes)} for the whole model "
                         f"({len(model.members)} regions)") if model is not None else \
                    f"memory_budget={budget_label(budget.value)} of region {name!r}"
                groups[key] = BudgetGroup(label, model.nbytes if model is not None
                                          else budget.value, [], False, model)
                names[key] = set()
            groups[key].nodes.append(v)
            names[key].add(name)
    _adopt_values_computed_from(groups, nodes)
    for key, group in groups.items():
        # Some of a whole-model budget's blocks (per-block compiles): the graph's cap comes
        # from the blocks' kinds and the price over them (kinds.py).
        group.partial = group.model is not None and bool(set(group.model.members) -
                                                         names[key])
        if group.model is not None and group.model.step_peak is not None and \
                not group.partial and not group.model.steps_begun:
            # (the model's step hooks run eagerly, a graph break at them, and measure the
            # step; a graph holding every block compiled before any step began (the
            # model's forward compiled without its hooks): nothing would)
            raise group.model.hooks_traced_error(
                f"regions {', '.join(sorted(names[key])[:3])}")
    return list(groups.values())


def _adopt_values_computed_from(groups: dict[object, BudgetGroup], nodes: list[fx.Node]
                                ) -> None:
    """A value outside every region that is computed only from one group's values (and
    graph inputs) joins that group: the cut can keep it in their place (``cos(mm)`` for
    ``sin``'s backward, ``t(sin)`` for addmm's), so the group's cap must count it, else a
    budget of 10% kept twice what no budget keeps, its note saying the cap was met."""
    owner = {v: key for key, group in groups.items() for v in group.nodes}
    for v in nodes:
        if v.op != "call_function" or v in owner or graph_meta.region_path(v):
            continue
        keys = {owner.get(a) for a in v.all_input_nodes if a.op != "placeholder"}
        if len(keys) == 1 and None not in keys:
            key = keys.pop()
            owner[v] = key
            groups[key].nodes.append(v)


def solve_with_region_budgets(net: FlowNetwork, groups: list[BudgetGroup],
                              budget: float | int | None, solver: str | None = None
                              ) -> tuple[BudgetResult, RegionBudgetFacts]:
    """torch's budgets, as torch defines them: for the activations of each group, a cap of
    ``least + b * (unconstrained - least)`` device bytes (0.0: as few as the group can keep,
    1.0: what the cut keeps without a budget); with ``budget``, our graph-wide cap too.
    Solved by the exact program (any size, within its time limit). Returns the result and
    each group's figures, for the report."""
    from ..report import fmt_bytes

    t0 = time.perf_counter()
    problem = ExactProblem.from_network(net)
    idx = net.cls.index
    base = cut_at(net, problem, 1.0, solver)
    cap_all = None
    if budget is not None:
        cap_all = budget * base.nbytes if isinstance(budget, float) else float(budget)

    def group_bytes(kept: list[fx.Node], w: float, recomputed: frozenset[int] | set[int],
                    members: set[int]) -> float:
        """Device bytes kept of ``members``, with their recomputes' RNG states."""
        total = sum(nbytes for v, nbytes in zip(kept, net.device_bytes(kept, w))
                    if idx[v] in members)
        return total + sum(net.recompute_bytes.get(i, 0.0) for i in recomputed
                           if i in members)

    group_caps, figures, capped = [], [], set()
    extra: list[str] = []  # a whole-model budget's blocks in this graph (kinds.py)
    fits = cap_all is None or base.nbytes <= cap_all
    w_min = 1e-9
    for group in groups:
        members = {idx[v] for v in group.nodes if v in idx and is_activation(net, idx[v])}
        if not members:
            continue
        most = group_bytes(base.kept, base.w, base.recomputed, members)
        even = False
        if group.partial:
            from .kinds import graph_cap
            if group.graph_cap is None:  # (not again for the peak floor's second solve)
                group.graph_cap = graph_cap(net, group.model,
                                            _by_region(group, idx, members), solver)
            cap_bytes, even, line = group.graph_cap
            group.fraction = int(cap_bytes)
            extra.append(line)
        edges = []
        for u, v, c in net.capacities(w_min, TILT):
            i = u // 2
            if v == u + 1 and u % 2 == 0 and u < net.source and i not in members \
                    and is_activation(net, i):
                c = c * w_min
            edges.append((u, v, c))
        low = cut_at(net, problem, w_min, solver, edges)
        least = group_bytes(low.kept, low.w, low.recomputed, members)
        cap = group.cap(least, most)
        peak = group.model.step_peak if group.model is not None else None
        if (even or peak is not None) and least > cap:  # the least they can, not an error
            extra.append(f"{group.label}: the least these blocks can keep, "
                         f"{fmt_bytes(least)}, is above " + (
                             f"the cap {fmt_bytes(cap)} the measured steps of "
                             f"{peak.label()} set; they keep it" if peak is not None else
                             f"the even split {fmt_bytes(cap)}; they keep it until the "
                             f"price is found"))
            cap = least
        if least > cap * (1 + 1e-9) + 1:  # (torch's meaning: never, cap >= least)
            _unreachable(net, group, low, members, cap, least, most)
        fits = fits and most <= cap
        group_caps.append((sorted(members), cap))
        capped |= members
        if most:  # (else nothing to keep: values of annotated code the backward needs not)
            figures.append((GroupFigures(group.label, len(members), cap, least, most, 0.0),
                            members))
    if fits:
        res = BudgetResult(base.kept, budget if budget is not None else 1.0,
                           cap_all if cap_all is not None else base.nbytes, base.nbytes,
                           base.nbytes, base.nbytes, 1.0, [], 1, time.perf_counter() - t0,
                           base.on_host, "unconstrained cut", base.cost, base.cost)
        kept_of = lambda m: group_bytes(base.kept, base.w, base.recomputed, m)  # noqa: E731
        return res, _facts(figures, groups, idx, kept_of, extra)
    # Without our graph-wide cap, values under no cap keep their price (a byte each).
    priced = [] if cap_all is not None else [
        i for i in range(len(net.cls.nodes)) if i not in capped and is_activation(net, i)]
    sol = solve_exact(problem, cap_all, time_limit=EXACT_TIME_LIMIT, group_caps=group_caps,
                      priced=priced)
    if sol is None:
        raise CompiledCheckpointError(
            "sac_compile: the memory budgets of this graph's regions (torch's region_"
            "activation_memory_budget or activation_memory_budget, sac_region/apply_regions' "
            "memory_budget) " + ("and the graph-wide memory_budget " if cap_all else "") +
            f"cannot be met together within {EXACT_TIME_LIMIT:g} s of the exact solver: "
            + "; ".join(f"{g.label}, {g.values} values, cap {fmt_bytes(g.cap)} (least "
                        f"{fmt_bytes(g.least)}, unconstrained {fmt_bytes(g.most)})"
                        for g, _ in figures) + ". To fix: raise a region's "
            "budget, or drop the graph-wide memory_budget, or put a graph break between the "
            "regions")
    nodes = net.cls.nodes
    kept = [nodes[i] for i in sol.kept]
    have = set(kept)
    evicted = [v for v in base.kept if v not in have and is_activation(net, idx[v])]
    lifted = [nodes[i] for i in sol.recomputed if i in net.lifted_under_budget]
    on_host = set(sol.on_host)
    recomputed = set(sol.recomputed)
    kept_idx = [i for i in sol.kept if i not in on_host]

    def sol_bytes(members: set[int]) -> float:
        return sum(net.save_cost[i] for i in kept_idx if i in members) + \
            sum(net.recompute_bytes.get(i, 0.0) for i in recomputed if i in members)

    res = BudgetResult(kept, budget if budget is not None else 1.0,
                       cap_all if cap_all is not None else base.nbytes, int(sol.device_bytes),
                       base.nbytes, 0, 1.0, evicted, 2 + len(group_caps),
                       time.perf_counter() - t0, [nodes[i] for i in sol.on_host],
                       "exact program (MILP" + (", optimal)" if sol.optimal else
                                                ", time limit)"),
                       sol.cost, sol.cost, lifted)
    return res, _facts(figures, groups, idx, sol_bytes, extra)


def _by_region(group: BudgetGroup, idx: dict[fx.Node, int], members: set[int] | None = None
               ) -> dict[str, set[int]]:
    """The indices of each of the group's regions' values (among ``members``, if given)."""
    by_region: dict[str, set[int]] = {}
    for v in group.nodes:
        i = idx.get(v)
        if i is None or (members is not None and i not in members):
            continue
        for _, name, budget in graph_meta.region_budgets(v):
            if budget.model is group.model:
                by_region.setdefault(name, set()).add(i)
    return by_region


def _shares(groups: list[BudgetGroup], idx: dict[fx.Node, int],
            kept_of: Callable[[set[int]], float]) -> list[GroupShares]:
    """A whole-model budget: each region's share of the bytes kept (also on the budget)."""
    out = []
    for group in groups:
        if group.model is None:
            continue
        by_region = _by_region(group, idx)
        shares = {name: int(kept_of(members)) for name, members in by_region.items()}
        # (partial: a kind's graph serves every block of its kind)
        group.model.record_shares(shares, whole_kind=group.partial)
        out.append(GroupShares(group.label, shares))
    return out


def _unreachable(net: FlowNetwork, group: BudgetGroup, low: Cut, members: set[int],
                 cap: float, least: float, most: float) -> None:
    """Our budget on a region (or the whole model) below what it can keep: the error
    :mod:`.unreachable` gives for a graph-wide one, naming the group."""
    idx = net.cls.index
    kept = [v for v in low.kept if idx[v] in members]
    rng = sum(net.recompute_bytes.get(i, 0.0) for i in low.recomputed if i in members)
    raise budget_unreachable(net, kept, group.fraction, cap, int(least), int(most), rng,
                             prefix=f"{group.label}: ") from None


def _facts(figures: list[tuple[GroupFigures, set[int]]], groups: list[BudgetGroup],
           idx: dict[fx.Node, int], kept_of: Callable[[set[int]], float],
           price_notes: list[str]) -> RegionBudgetFacts:
    """Each group's figures with the bytes the chosen cut keeps of it, and the shares."""
    return RegionBudgetFacts([dataclasses.replace(g, kept=kept_of(set(members)))
                              for g, members in figures], _shares(groups, idx, kept_of),
                             price_notes)
