"""A region's storage decisions stay in the region.

``SaveWithHooks`` and CPU offload say how *the region* keeps a value for *its* backward.
Under compile the value may also be read by code outside the region in the same graph
(``region(x, w1) @ w2``: the matmul's backward reads the region's output for ``w2.grad``),
and one saved copy serves every reader: packed to bf16 for the region, it would reach
``w2.grad`` as bf16 too, where the program without the region (and the eager runtime, whose
pack hook sees only the region's own saves) keeps it exact. So a value whose forward readers
reach outside its region (through views) keeps the save and loses the storage: hooks and
MUST_CPU_OFFLOAD become MUST_SAVE, PREFER_CPU_OFFLOAD becomes PREFER_SAVE. Hooks are
lossy, so a value of the region computed from a hooked value and read outside the region is
kept as it is (MUST_SAVE), never recomputed from the unpacked value for that reader.

The region is the outermost region call that made the value (nested regions share their
outermost call's saves). Backward nodes and the graph's outputs are not readers here: a
value handed to another graph is saved there by that graph, as that graph decides.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph_meta
from ..cut.costs import is_view
from ..cut.roles import is_backward_formula, node_role
from ..policy import CheckpointPolicy, Decision
from .tagging import write_decision

__all__ = ["keep_storage_in_region", "read_outside", "backward_nodes"]

P = CheckpointPolicy


def keep_storage_in_region(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Drop the storage part (hooks, offload) of the decision of every value read outside
    the region that made it. Returns the graph and how many nodes changed."""
    backward = backward_nodes(gm.graph)
    changed = 0
    for node in gm.graph.nodes:
        dec = graph_meta.decision(node)
        if node.op != "call_function" or dec is None or not dec.stored_off_device:
            continue
        if not read_outside(node, backward):
            continue
        _drop_storage(node, dec)
        changed += 1
    for node in list(gm.graph.nodes):
        dec = graph_meta.decision(node)
        if node.op == "call_function" and dec is not None and dec.hooks is not None:
            changed += _exact_where_read_outside(node, dec, backward)
    return gm, changed


def _drop_storage(node: fx.Node, dec: Decision) -> None:
    plain = P.PREFER_SAVE if dec.policy is P.PREFER_CPU_OFFLOAD else P.MUST_SAVE
    write_decision(node, dataclasses.replace(dec, policy=plain, hooks=None),
                   graph_meta.region_path(node))
    for user in node.users:  # a multi-output op's values: the same decision
        if graph_meta.decision(user) == dec:
            write_decision(user, graph_meta.decision(node), graph_meta.region_path(user))


def _exact_where_read_outside(hooked: fx.Node, dec: Decision, backward: set[fx.Node]) -> int:
    """Hooks are lossy: a value of the region computed from ``hooked`` and read outside it
    (the region's output: ``x + fc2(...)``) must not be recomputed from the unpacked value
    for that reader. It is kept (MUST_SAVE), as the program without the region keeps it for
    its reader; where its own decision is MUST_RECOMPUTE, ``hooked`` loses its hooks
    instead. Returns how many decisions changed."""
    region = graph_meta.outer_region_id(hooked)
    escaping, stack, seen = [], [hooked], {hooked}
    while stack:
        for user in stack.pop().users:
            if user in seen or user in backward or user.op != "call_function" or \
                    graph_meta.outer_region_id(user) != region or not _holds_tensors(user):
                continue
            seen.add(user)
            stack.append(user)
            if read_outside(user, backward):
                escaping.append(user)
    if any(getattr(graph_meta.decision(v), "policy", None) is P.MUST_RECOMPUTE
           for v in escaping):
        _drop_storage(hooked, dec)
        return 1
    changed = 0
    for value in escaping:
        own = graph_meta.decision(value)
        if own is not None and own.policy is P.MUST_SAVE and own.hooks is None:
            continue  # (a PREFER_SAVE the cut may still recompute from the hooked value)
        write_decision(value, Decision(P.MUST_SAVE, region=graph_meta.region(value),
                                       source="region storage"),
                       graph_meta.region_path(value))
        changed += 1
    return changed


def read_outside(node: fx.Node, backward: set[fx.Node]) -> bool:
    """Whether a forward op outside ``node``'s outermost region call reads it (or a view
    of it)."""
    region = graph_meta.outer_region_id(node)
    stack, seen = [node], {node}
    while stack:
        for user in stack.pop().users:
            if user in seen or user in backward or user.op == "output" or \
                    not _holds_tensors(user):
                continue  # (a size read under dynamic shapes reads no values)
            seen.add(user)
            if graph_meta.outer_region_id(user) != region:
                return True
            if is_view(user) or getattr(user.target, "__name__", "") == "getitem":
                stack.append(user)
    return False


def _holds_tensors(node: fx.Node) -> bool:
    val = graph_meta.val(node)
    if isinstance(val, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The joint graph's backward: the tangents, the nodes of backward formulas (marked by
    AOTAutograd: ``cos(mm)`` of sin's backward needs no tangent) and every node computed
    from them."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node_role(node).runs_in_backward:
                out.add(node)
        elif is_backward_formula(node) or any(arg in out for arg in node.all_input_nodes):
            out.add(node)
    return out
