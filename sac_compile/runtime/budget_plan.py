"""Solve one recorded region call under its memory budget: the same network and the same
search as a compiled split (:func:`sac_compile.budgets.split.solve_with_budget`), or, for
a whole-model budget, the cut at the model's price per byte (:mod:`.model_budget`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from .. import graph_meta
from ..errors import BudgetUnreachableError
from ..policy import CheckpointError
from ..tensor_memory import storage_nbytes
from ..torch_internals import pytree
from .budget_graph import Plan, RegionGraph, plan_of_cut, region_network

if TYPE_CHECKING:  # annotations only: budget_run calls this module
    from .budget_run import BudgetRun

__all__ = ["solve_region", "packed_sizes", "evicted_values"]


def packed_sizes(nodes: list[Any]) -> dict[tuple[int, int], int]:
    """The packed bytes of outputs saved with ``SaveWithHooks``: ``pack`` run once on a meta
    copy of each (no data); hooks that cannot run on meta count the value's own bytes."""
    sizes: dict[tuple[int, int], int] = {}
    for node in nodes:
        dec = node.decision
        if dec is None or dec.hooks is None:
            continue
        for i, facts in enumerate(node.outs):
            t = facts[0]() if facts is not None else None
            if not isinstance(t, torch.Tensor):
                continue
            try:
                packed = dec.hooks.pack(torch.empty_like(t, device="meta"))
                leaves = pytree.tree_leaves(packed)
                sizes[(id(node), i)] = sum(x.numel() * x.element_size() for x in leaves
                                           if isinstance(x, torch.Tensor))
            except Exception:
                sizes[(id(node), i)] = storage_nbytes(t)
    return sizes


def solve_region(run: BudgetRun, recorder: Any, signature: tuple) -> Plan:
    """The plan of this call: its network cut under the region's budget."""
    rg = region_network(recorder.decisions, recorder.handles, packed_sizes(recorder.decisions))
    try:
        return _solve(run, rg, signature)
    finally:  # the graph holds the forward's tensors in meta["val"], and FX nodes form
        for v in rg.graph.nodes:  # cycles: drop them now, not at the next collection
            v.meta.clear()


def _solve(run: BudgetRun, rg: RegionGraph, signature: tuple) -> Plan:
    if run.budget.model is not None:
        from .model_budget import plan_in_model
        return plan_in_model(run, rg, signature)
    from ..budgets import budget_label
    from ..budgets.split import solve_with_budget
    try:
        res = solve_with_budget(rg.net, run.budget.value)
    except BudgetUnreachableError as e:
        raise e.prefixed(f"region {run.region!r} (eager mode): ") from None
    except CheckpointError as e:
        raise CheckpointError(f"region {run.region!r} (eager mode): {e}") from None
    evicted = evicted_values(rg, res.evicted, run.budget.value)
    notes = [f"memory budget {budget_label(run.budget.value)}: {res.activation_bytes:,} B of "
             f"activations kept, cap {int(res.budget_bytes):,} B (unconstrained "
             f"{res.unconstrained_bytes:,} B, least reachable {res.min_bytes:,} B); "
             f"{res.method}, {res.solves} solves" +
             (f"; {len(res.offloaded)} values offloaded" if res.offloaded else "") +
             (f"; {len(evicted)} values dropped to meet it" if evicted else "")]
    if rg.stand_ins:
        notes.append(f"{len(rg.stand_ins)} values computed from values the policy offloads "
                     f"are recomputed rather than kept on the device in their place")
    return plan_of_cut(rg, res.saved, res.offloaded, signature, notes, evicted,
                       res.activation_bytes, res.unconstrained_bytes, res.budget_bytes)


def evicted_values(rg: RegionGraph, evicted: list[fx.Node], budget: Any
                   ) -> list[tuple[int, int, int, str]]:
    """``(op number, output, bytes, why)`` of each value the cut without a budget keeps and
    the budget's cut does not."""
    from ..cut import costs
    from ..budgets import budget_label
    out = []
    for v in evicted:
        if v not in rg.where:
            continue
        dec = graph_meta.decision(v)
        what = dec.label if dec is not None else "min-cut save"
        out.append((rg.where[v][0], rg.where[v][1], costs.nbytes(v),
                    f"{what} overridden by memory budget {budget_label(budget)}: recomputed "
                    f"in backward"))
    return out
