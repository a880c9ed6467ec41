"""What an offload decision keeps off the device: the value, and the values computed from it.

A policy that offloads a value (``MUST/PREFER_CPU_OFFLOAD``) asks that the device not keep
it for backward. The cut could meet that to the letter and still keep its information on
the device: ``cos(mm)`` and ``sin(mm)`` kept in place of an offloaded ``mm`` (8 KiB each,
on ``sin(x @ w) @ w`` with ``offload_ops(aten.mm)``). So the values computed from such a
value in the forward - within its region call or by a backward formula, through ops
without a save decision of their own - may not be kept on the device either: the backward recomputes them from the
reloaded value (or, under a memory budget, the cut may offload them too). A value that
cannot be recomputed (an effectful op, one whose inputs cannot be had in backward) stays
allowed on the device, and the report names it (:func:`kept_in_place`).

Applies only where the value can leave the device (an accelerator, torch's offload pass):
on the CPU an offload is a plain save, and nothing is banned.
"""
from __future__ import annotations

import torch.fx as fx

from .. import graph_meta
from .network import INF, FlowNetwork
from .roles import is_backward_formula

__all__ = ["keep_stand_ins_off_device", "kept_in_place"]


def _offloaded(net: FlowNetwork, i: int) -> bool:
    """The policy asked for the host, and the value can go there."""
    dec = graph_meta.decision(net.cls.nodes[i])
    return dec is not None and dec.offloads and dec.saves and net.save_cost[i] == INF \
        and net.offload_cost[i] != INF


def _derived(d: fx.Node, index: dict[fx.Node, int]) -> list[fx.Node]:
    """Forward-side values computed from ``d`` within its region call, or by the backward
    formulas of its ops, through values that have no save decision of their own (graph
    order)."""
    call = graph_meta.outer_region_id(d)
    out, seen, stack = [], {d}, list(d.users)
    while stack:
        u = stack.pop()
        if u in seen or u not in index or u.op != "call_function":
            continue
        seen.add(u)
        dec = graph_meta.decision(u)
        formula = is_backward_formula(u)  # a backward formula's value needing no tangent
        if call is None or not (formula or graph_meta.outer_region_id(u) == call) or \
                (dec is not None and dec.saves):
            continue
        out.append(u)
        stack.extend(u.users)
    return sorted(out, key=index.__getitem__)


def keep_stand_ins_off_device(net: FlowNetwork) -> dict[fx.Node, fx.Node]:
    """Make the device no option for the values computed from an offloaded value (see the
    module docstring); returns each such value and the offloaded value it comes from."""
    nodes, index = net.cls.nodes, net.cls.index
    memo: dict[int, bool] = {}

    def kept(i: int) -> bool:
        return nodes[i].op == "placeholder" or net.save_cost[i] != INF or \
            net.offload_cost[i] != INF

    def inputs(i: int) -> list[int]:
        return [index[u] for u in nodes[i].all_input_nodes if u in index]

    def available(i: int) -> bool:
        """Whether the backward can have node ``i``: kept (device or host) or recomputed
        from what it can have (iterative: a long chain needs no recursion)."""
        stack = [i]
        while stack:
            k = stack[-1]
            if kept(k) or k in memo:
                stack.pop()
                continue
            if net.recompute_cost[k] == INF:
                memo[k] = False
                stack.pop()
                continue
            pending = [j for j in inputs(k) if not kept(j) and j not in memo]
            if pending:
                stack.extend(pending)
                continue
            memo[k] = all(kept(j) or memo[j] for j in inputs(k))
            stack.pop()
        return kept(i) or memo[i]

    banned: dict[fx.Node, fx.Node] = {}
    for i, d in enumerate(nodes):
        if not _offloaded(net, i):
            continue
        for v in _derived(d, index):
            j = index[v]
            if net.save_cost[j] == INF or net.recompute_cost[j] == INF:
                continue
            if all(available(k) for k in inputs(j)):
                net.save_cost[j] = INF
                banned.setdefault(v, d)
    return banned


def kept_in_place(d: fx.Node, kept_on_device: set[str]) -> list[fx.Node]:
    """The values computed from ``d`` (as :func:`keep_stand_ins_off_device` follows them)
    that a split keeps on the device: ``kept_on_device`` names them."""
    index = {n: i for i, n in enumerate(d.graph.nodes)}
    return [v for v in _derived(d, index) if v.name in kept_on_device]
