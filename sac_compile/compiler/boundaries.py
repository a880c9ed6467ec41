"""The region-boundary floor: a region's recompute never drags other regions' values into
the backward's working set, as eager checkpointing guarantees.

Why: the min-cut minimises bytes kept at the end of forward plus recompute cost. On a
whole-model graph of blocks that recompute everything, recomputing from the graph's input
is cheaper in that objective than keeping any block boundary, so the cut keeps nothing;
the backward then recomputes the whole stack before its first gradient, and every block's
recomputed values stay alive until that block's own backward: the peak of no
checkpointing. Eager checkpointing keeps each region's input and recomputes one region at
a time, just before its backward.

The floor (torch's partitioner has the same rule in ``cleanup_recompute_tags``: it saves
the value at the boundary between two consecutive checkpointed regions): a *boundary
value* - made outside a region call (in another region call, or outside every region) and
read there by an op whose decision is to recompute - may not be recomputed itself, so
wherever that region is recomputed it starts from values kept at or inside its own
boundary. It is a ban in the flow network (``recompute = infinite``), not a MUST_SAVE: a
boundary nobody's backward needs is still not kept.

It is applied only where it lowers the peak (:func:`.peak.cut_peak`): the cut is solved
as before; if it recomputes a boundary value, it is solved again with the floor, and the
cut with the lower peak wins (the one without the floor on a tie, so bytes and recompute
FLOPs change only where the peak asks for it). Cross-region recompute that does not raise
the peak stays allowed (a residual add recomputed from kept matmul outputs, say).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch.fx as fx

from .. import graph_meta
from ..policy import CheckpointError, CheckpointPolicy
from ..cut import costs
from ..cut.network import INF, Classification, FlowNetwork
from .describe import boundary_reason
from .facts import Floor
from .peak import cut_peak
from .storage_walk import storage_base

__all__ = ["region_call", "boundary_values", "with_floor", "recomputed_by", "solve_lowering_peak"]

P = CheckpointPolicy
R = TypeVar("R")
_RECOMPUTES = (P.MUST_RECOMPUTE, P.PREFER_RECOMPUTE)


def region_call(node: fx.Node) -> Any:
    """The outermost region call that ran ``node`` (ours, or torch's own checkpoint); None
    outside every region."""
    if graph_meta.has_outer_region_id(node):
        return ("sac", graph_meta.outer_region_id(node))
    if graph_meta.has_ac_graph_id(node):
        return ("torch", graph_meta.ac_graph_id(node))
    return None


def boundary_values(cls: Classification, net: FlowNetwork) -> dict[fx.Node, fx.Node]:
    """Each boundary value (see the module docstring) that the cut could recompute, with one
    op of another region call that reads it to recompute."""
    out: dict[fx.Node, fx.Node] = {}
    for u in cls.nodes:
        if u.op != "call_function":
            continue
        group = region_call(u)
        reader = next((v for v in u.users if v in cls.index and region_call(v) not in
                       (None, group) and getattr(graph_meta.decision(v), "policy", None)
                       in _RECOMPUTES), None)
        if reader is None:
            continue
        # A view costs nothing to recompute and shares its base's storage: the base is
        # what must not be recomputed (an input's view drags nothing).
        base = storage_base(u)
        i = cls.index.get(base)
        if i is None or base.op != "call_function" or net.recompute_cost[i] == INF or \
                net.save_cost[i] == INF:
            continue  # cannot be recomputed anyway, or cannot be kept (the cut decides)
        out.setdefault(base, reader)
    return out


def with_floor(net: FlowNetwork, boundary: dict[fx.Node, fx.Node]) -> FlowNetwork:
    """``net`` with the boundary values banned from recompute (a copy)."""
    idx = net.cls.index
    recompute = list(net.recompute_cost)
    bans = dict(net.ban_reason)
    lifted = dict(net.lifted_under_budget)
    for u, reader in boundary.items():
        i = idx[u]
        recompute[i] = INF
        lifted.pop(i, None)
        bans[u] = boundary_reason(_fact(u, reader))
    return dataclasses.replace(net, recompute_cost=recompute, ban_reason=bans,
                               lifted_under_budget=lifted)


def _fact(u: fx.Node, reader: fx.Node) -> graph_meta.BoundaryFact:
    made, read = graph_meta.region_path(u), graph_meta.region_path(reader)
    return graph_meta.BoundaryFact(made[-1] if made else None, read[-1] if read else None)


def recomputed_by(cls: Classification, kept: set[fx.Node]) -> set[fx.Node]:
    """The forward-side values a backward with ``kept`` computes itself."""
    out: set[fx.Node] = set()
    stack = [a for b in cls.backward for a in b.all_input_nodes if a in cls.index]
    stack += [o for o in cls.bwd_outputs if isinstance(o, fx.Node) and o in cls.index]
    while stack:
        n = stack.pop()
        if n in out or n in kept or n.op == "placeholder":
            continue
        out.add(n)
        stack.extend(a for a in n.all_input_nodes if a in cls.index)
    return out


def solve_lowering_peak(gm: fx.GraphModule, net: FlowNetwork, solve: Callable[[FlowNetwork], R],
                        kept_of: Callable[[R], list[fx.Node]], *,
                        unfloored: list[R] | None = None) -> tuple[R, Floor]:
    """``solve(net)``, or ``solve`` of the floored network where that lowers the peak (see
    the module docstring). Returns the result and what the floor did; the kept boundary
    values of a floored cut carry a :class:`~sac_compile.graph_meta.BoundaryFact` (for
    their reason). ``unfloored``: where the floored cut is returned, the cut without the
    floor is appended to it (a peak budget weighs both: the floor's is the lower peak,
    the other may fit the cap for less)."""
    res = solve(net)
    cls = net.cls
    boundary = boundary_values(cls, net)
    kept = set(kept_of(res))
    dragged = recomputed_by(cls, kept) & set(boundary)
    if not dragged:
        return res, Floor()
    floored = with_floor(net, boundary)
    try:
        res_floor = solve(floored)
    except CheckpointError as e:  # e.g. a budget the floor's kept boundaries exceed
        return res, Floor(refused=str(e).splitlines()[0])
    kept_floor = kept_of(res_floor)
    before, after = cut_peak(gm.graph, cls, kept), cut_peak(gm.graph, cls, kept_floor)
    if after >= before:
        return res, Floor()
    if unfloored is not None:
        unfloored.append(res)
    held = [u for u in kept_floor if u in boundary and u not in kept]
    for u in held:
        graph_meta.set_boundary(u, _fact(u, boundary[u]))
    return res_floor, Floor(tuple(held), sum(costs.nbytes(u) for u in held), before, after)
