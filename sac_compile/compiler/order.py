"""The order the extracted graphs run in: recomputed forward ops just before the backward op
that first needs them (as autograd would run a checkpointed region), ``getitem``s right
after their producer.

Why it matters for memory: a recomputed value is alive from its recompute to its last
backward use, so recomputing it at the start of the backward (where extraction leaves it)
keeps it alive through every gradient before its own.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..cut.roles import Role, node_role

__all__ = ["raise_getitems_in_place", "reorder_like_autograd"]


def raise_getitems_in_place(gm: fx.GraphModule) -> None:
    """Each ``getitem`` right after its producer (as torch's ``raise_getitems``), no copy."""
    for node in reversed(list(gm.graph.find_nodes(op="call_function", target=operator.getitem))):
        node.all_input_nodes[0].append(node)
    gm.recompile()


def reorder_like_autograd(gm: fx.GraphModule) -> None:
    """Move recomputed forward ops next to the backward ops that need them, in place.

    Same order as torch's ``reordering_to_mimic_autograd_engine`` (each backward op, in
    order, preceded by its not yet placed inputs in graph order) but by moving nodes within
    the graph's linked list - O(nodes + edges) and no node copies - then raising getitems.
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    tangents = [n for n in nodes if node_role(n) is Role.TANGENT]
    users = [u for t in tangents for u in t.users]
    if not users:
        raise_getitems_in_place(gm)
        return
    first = min(order[u] for u in users)
    placed = {n for n in nodes if n.op == "placeholder"}
    cursor = [n for n in nodes if n.op == "placeholder"][-1] if placed else None

    def place(root: fx.Node) -> None:
        nonlocal cursor
        todo, stack = [], [root]
        while stack:
            n = stack.pop()
            if n in placed:
                continue
            placed.add(n)
            todo.append(n)
            stack.extend(n.all_input_nodes)
        for n in sorted(todo, key=order.__getitem__):
            if cursor is None:
                nodes[0].prepend(n)
            else:
                cursor.append(n)
            cursor = n

    for n in nodes[:first]:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            place(n)
    for n in nodes[first:]:
        place(n)
    for n in reversed(nodes):
        if n not in placed and not n.users:
            graph.erase_node(n)
    raise_getitems_in_place(gm)
