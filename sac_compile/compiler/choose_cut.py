"""Deciding a split: the flow network of a tagged joint graph, and the cut chosen on it.

:func:`flow_network` classifies the joint graph's nodes and builds the min-cut network
(:mod:`sac_compile.cut.network`), with what an offload decision keeps off the device
(:mod:`sac_compile.cut.stand_ins`). :func:`choose_cut` solves it - plainly, under a memory
budget for the split, or under the budgets of the regions in it - each through the
region-boundary floor where that lowers the peak (:mod:`.boundaries`). It edits no graph
(the floor marks the boundary values it keeps, for their reason) and words nothing: the
:class:`Cut` it returns is typed facts, worded by :mod:`.describe`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..budgets import PeakBudget
from ..budgets.groups import (RegionBudgetFacts, region_budget_annotations,
                              solve_with_region_budgets, torch_global_budget)
from ..budgets.result import BudgetResult
from ..budgets.split import solve_with_budget
from ..cut.network import CostModel, FlowNetwork, build_flow_network, classify
from ..cut.solvers import solve
from ..cut.stand_ins import keep_stand_ins_off_device
from ..errors import BudgetUnreachableError
from .boundaries import solve_lowering_peak
from .facts import Floor, HostWhy, PeakFit, Unfused
from .fused_saves import solve_allocating_less
from .peak_budget import solve_peak_budget
from .storage import HookTraces, packed_sizes

__all__ = ["Cut", "flow_network", "choose_cut"]


@dataclasses.dataclass
class Cut:
    """The values a split keeps for the backward, and why."""

    saved: list[fx.Node]
    # Values the cut keeps on the host though no policy asked for it, and why.
    host: list[fx.Node] = dataclasses.field(default_factory=list)
    host_why: HostWhy | None = None
    # Values computed from offloaded ones that may not stay on the device in their place.
    stand_ins: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    memory_budget: float | int | PeakBudget | None = None  # the partitioner's, as given
    torch_budget_ignored: float | None = None  # torch's global budget, not applied
    budget: BudgetResult | None = None         # under a budget (the split's or regions')
    region_budgets: RegionBudgetFacts | None = None  # under the regions' budgets
    floor: Floor = Floor()
    peak_fit: PeakFit | None = None            # under a PeakBudget: how it was met
    unfused: Unfused = Unfused()  # under Inductor: kept values it would fuse away, dropped
    # under a byte budget with symbolic sizes: the guards keeping them at most their hints
    # (.size_guards), and the sizes that could not be guarded
    size_guards: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


def flow_network(gm: fx.GraphModule, num_fwd_outputs: int, static: set[fx.Node],
                 cost_model: CostModel, traces: HookTraces
                 ) -> tuple[FlowNetwork, dict[fx.Node, fx.Node]]:
    """The min-cut network of ``gm``, and the stand-ins banned from the device (see
    :mod:`sac_compile.cut.stand_ins`)."""
    cls = classify(gm, num_fwd_outputs)
    net = build_flow_network(gm, cls, cost_model, static_inputs=static,
                             rng_functionalized=True, packed_bytes=packed_sizes(gm, traces),
                             can_offload=_offload_pass_available(gm))
    return net, keep_stand_ins_off_device(net)


def choose_cut(gm: fx.GraphModule, net: FlowNetwork, stand_ins: dict[fx.Node, fx.Node],
               memory_budget: float | int | PeakBudget | None, solver: str, *,
               fusing: bool = False, peak_margin: int = 0, least_kept: int = 0) -> Cut:
    """The cut of ``net``: without a budget, under ``memory_budget`` (a
    :class:`~sac_compile.budgets.PeakBudget`: the cheapest kept-byte budget whose cut's
    modelled peak fits, :mod:`.peak_budget`), or under the regions' budgets (torch's global
    ``activation_memory_budget`` is honoured as the regions' when the partitioner has none:
    torch ignores it once a region is in the graph). ``fusing``: the graphs go to Inductor
    (:mod:`.fused_saves`); ``least_kept``: under a PeakBudget, k > 0: the k-th cheapest cut keeping
    the least (:func:`.peak_budget.solve_peak_budget`)."""
    torch_budget = torch_global_budget()
    regions = region_budget_annotations(net.cls.nodes,
                                        torch_budget if memory_budget is None else None)
    memory_budget, regions, whole = _step_peak_of_a_whole_model(memory_budget, regions)
    ignored = torch_budget if torch_budget is not None and memory_budget is not None else None
    unfused: dict[int, Unfused] = {}

    def lowering_peak(solve_net, kept_of):  # noqa: ANN001,ANN202
        def solved(n: FlowNetwork):  # noqa: ANN202
            res = solve_net(n)
            if fusing:
                res, fact = solve_allocating_less(gm, n, res, solve_net, kept_of)
                unfused[id(res)] = fact
            return res
        res, floor = solve_lowering_peak(gm, net, solved, kept_of)
        return res, floor, unfused.get(id(res), Unfused())

    if memory_budget is None and not regions:
        (saved, _), floor, dropped = lowering_peak(lambda n: solve(n, solver), lambda r: r[0])
        return Cut(saved, [v for v in net.offloaded(saved) if not _marked_offload(v)],
                   HostWhy.CHEAPEST, stand_ins, memory_budget, ignored, floor=floor,
                   unfused=dropped)
    facts = None
    if isinstance(memory_budget, PeakBudget):
        def under(n: FlowNetwork, kept_cap: float | int,
                  exact: bool) -> tuple[BudgetResult, Any]:
            if regions:  # (always by the exact program)
                return solve_with_region_budgets(n, regions, kept_cap, solver)
            return solve_with_budget(n, kept_cap, solver, exact=exact), None

        try:
            (res, facts), floor, fit = solve_peak_budget(gm, net, memory_budget, under,
                                                         fused=fusing, margin=peak_margin,
                                                         least_kept=least_kept)
            if whole is not None:
                whole.graph_least = False
        except BudgetUnreachableError as e:
            if whole is None or not whole.graph_margin:
                raise
            # (lowered by measured steps below the least the model finds: the model's
            # least, measured next; the controller calls the budget out of reach if that
            # measures above it too, without compiling it again)
            memory_budget = e.proposed_budget
            (res, facts), floor, fit = solve_peak_budget(gm, net, memory_budget, under,
                                                         fused=fusing, margin=peak_margin,
                                                         least_kept=least_kept)
            whole.graph_least = True
        return Cut(res.saved, [v for v in res.offloaded if not _marked_offload(v)],
                   HostWhy.BUDGET, stand_ins, memory_budget, ignored, res, facts, floor,
                   peak_fit=fit, size_guards=_guard_sizes(net, memory_budget, regions))
    if regions:
        (res, facts), floor, dropped = lowering_peak(
            lambda n: solve_with_region_budgets(n, regions, memory_budget, solver),
            lambda r: r[0].saved)
    else:
        res, floor, dropped = lowering_peak(
            lambda n: solve_with_budget(n, memory_budget, solver), lambda r: r.saved)
    return Cut(res.saved, [v for v in res.offloaded if not _marked_offload(v)],
               HostWhy.BUDGET, stand_ins, memory_budget, ignored, res, facts, floor,
               unfused=dropped, size_guards=_guard_sizes(net, memory_budget, regions))


def _step_peak_of_a_whole_model(memory_budget: Any, regions: list[Any]
                                ) -> tuple[Any, list[Any], Any]:
    """``apply_regions(..., memory_budget=PeakBudget(n))`` with a graph holding every block
    (the model compiled whole): the graph is split under the step's PeakBudget as the
    backend's would be (the cut chosen on the step's timeline: keeping more can lower the
    peak, which no kept-byte cap finds), lowered by what measured steps found above
    ``n``, rather than under the controller's kept-byte cap. Also that model's budget
    (:class:`~sac_compile.budgets.ModelBudget`), None where the graph is not such."""
    whole = [g for g in regions if g.model is not None and g.model.step_peak is not None
             and not g.partial]
    if memory_budget is not None or not whole:
        return memory_budget, regions, None
    model = whole[0].model
    return model.graph_peak_budget(), [g for g in regions if g not in whole], model


def _guard_sizes(net: FlowNetwork, memory_budget: Any, regions: list[Any]
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A cap in bytes was priced at the size hints: hold the sizes there
    (:mod:`.size_guards`)."""
    if not _caps_bytes(memory_budget, regions):
        return ((), ())
    from .size_guards import guard_sizes_at_most_hints
    added, left = guard_sizes_at_most_hints(v for v in net.cls.nodes if v.op != "placeholder")
    return tuple(added), tuple(left)


def _caps_bytes(memory_budget: Any, regions: list[Any]) -> bool:
    """Whether a cap in bytes applies: the partitioner's (a PeakBudget's too), a region's or
    a whole model's."""
    value = memory_budget.value if isinstance(memory_budget, PeakBudget) else memory_budget
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    return any(not g.torch_meaning and (g.model is not None or
                                        not isinstance(g.fraction, float)) for g in regions)


def _marked_offload(node: fx.Node) -> bool:
    dec = graph_meta.decision(node)
    return dec is not None and dec.offloads


def _offload_pass_available(gm: fx.GraphModule) -> bool:
    """Whether values of this graph can leave the device: some are on an accelerator, and
    this torch has the offload pass (without it, MUST_CPU_OFFLOAD is an error and the rest
    stays on the device: see :mod:`.storage`)."""
    if not any(isinstance(graph_meta.val(n), torch.Tensor) and graph_meta.val(n).device.type
               != "cpu" for n in gm.graph.nodes):
        return False
    from .offload import TorchAPIMissing, torch_api
    try:
        torch_api()
    except TorchAPIMissing:
        return False
    return True
