"""Nodes an Inductor joint-graph pass created inside one of our regions get that region back.

Inductor runs its joint-graph passes before any partitioner (``compile_fx.partition_fn``),
and its pattern matcher copies only torch's keys (``torch.fx.proxy._COPY_META_FIELDS``:
``recompute``, ``ac_graph_id``, ...) to the nodes of a replacement. ``replace_random``
turns a region's dropout draw (``aten.rand``, from the ``native_dropout`` decomposition)
into ``prims.inductor_lookup_seed`` + ``prims.inductor_random``: they carry the region's
``recompute`` and torch's ``ac_graph_id``, none of our keys. Taken for torch's own
checkpoint region (``adopt_torch_tags``), they were a region call of their own, and the
region-boundary floor (:mod:`.boundaries`) saw the random draw as another region's value
read by the mask's recompute: ``recompute_all`` kept every 512 B dropout mask instead of
recomputing it from its 8 B seed (GPT fixture: modelled peak 62.0 KiB, 61.0 recomputing).

:func:`adopt_rewritten_nodes` runs before ``adopt_torch_tags``: a node with ``recompute``
and no decision of ours, whose ``ac_graph_id`` only one call of our regions has, joins that
call (region ids and path) with the decision of the nearest node of that call it feeds (or
else reads) whose ``recompute`` and ``original_aten`` are the same - the op the rewritten
node was part of. Anything else is left to ``adopt_torch_tags`` as before.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.fx as fx

from .. import graph_meta
from .tagging import write_decision

__all__ = ["adopt_rewritten_nodes"]


def _aten(node: fx.Node) -> str | None:
    """The op the node came from, by name (two OpOverload objects of one op can differ)."""
    op = graph_meta.original_aten(node)
    return None if op is None else str(op)


def _call_of(node: fx.Node) -> tuple[Any, Any] | None:
    if graph_meta.decision(node) is None or graph_meta.region_id(node) is None:
        return None
    return graph_meta.region_id(node), graph_meta.outer_region_id(node)


def adopt_rewritten_nodes(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """See the module docstring. Returns the graph and how many nodes joined a region."""
    calls: dict[Any, set[tuple[Any, Any]]] = defaultdict(set)  # ac_graph_id -> our calls
    for n in gm.graph.nodes:
        call = _call_of(n)
        if call is not None and graph_meta.has_ac_graph_id(n):
            calls[graph_meta.ac_graph_id(n)].add(call)
    if not calls:
        return gm, 0
    changed = 0
    for node in reversed(list(gm.graph.nodes)):  # users first: a chain joins link by link
        if node.op != "call_function" or graph_meta.decision(node) is not None or \
                not graph_meta.has_recompute(node):
            continue
        ours = calls.get(graph_meta.ac_graph_id(node), set())
        if len(ours) != 1:
            continue  # torch's own region, or ambiguous: adopt_torch_tags decides
        source = _source(node, next(iter(ours)))
        if source is None:
            continue
        graph_meta.copy_call(node, source,
                             same_op=_aten(node) is not None and _aten(node) == _aten(source))
        write_decision(node, graph_meta.decision(source), graph_meta.region_path(source))
        changed += 1
    return gm, changed


def _source(node: fx.Node, call: tuple[Any, Any]) -> fx.Node | None:
    """The nearest node of region call ``call`` with the same ``recompute`` as ``node`` (and
    the same ``original_aten``, the op a decomposition or rewrite came from, where ``node``
    has one): among its users (through other rewritten nodes), else its inputs."""
    want, aten = graph_meta.recompute(node), _aten(node)
    for step in (lambda n: list(n.users), lambda n: n.all_input_nodes):
        seen, frontier = {node}, step(node)
        while frontier:
            nxt: list[fx.Node] = []
            for n in frontier:
                if n in seen:
                    continue
                seen.add(n)
                if _call_of(n) == call:
                    if graph_meta.recompute(n) == want and \
                            (aten is None or _aten(n) == aten):
                        return n
                elif graph_meta.decision(n) is None and graph_meta.has_recompute(n) and \
                        graph_meta.ac_graph_id(n) == graph_meta.ac_graph_id(node):
                    nxt.extend(step(n))  # another rewritten node of the same region
            frontier = nxt
    return None
