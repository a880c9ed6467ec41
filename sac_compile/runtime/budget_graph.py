"""A recorded region as the compiler's flow network, so that an eager memory budget is
solved by the same code as a compiled one (:mod:`sac_compile.cut.network`,
:mod:`sac_compile.budgets.split`).

The region's recorded ops (:class:`~.graph.OpNode`) become an FX graph: a placeholder per
tensor from outside the region (parameters are static inputs: they cost nothing to keep),
a ``call_function`` node per op with its decision in ``meta["sac_decision"]`` as the
tagging mode writes it under compile, and a ``getitem`` per output of a multi-output op.
``meta["val"]`` holds the forward's own tensors (the first call of a budgeted region keeps
them until it is planned). What autograd packed (the handles) is what the backward needs.

What only eager mode sees, and so differs from a compiled split of the same region:

* the backward needs the tensors autograd saved; a compiled split may instead keep a value
  a backward formula computes from them without a tangent (``cos(mm)`` for ``sin``);
* in-place ops are recorded as such and replay into copies (so they may be recomputed);
  under compile the graph is functional;
* an output the region mutated later (``y = mm(); y.relu_()``) cannot be kept as it was,
  and a value whose tensor died before the plan (a plan that no longer matched the
  recorded ops) cannot be kept at all: both are recomputed.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta
from .graph import LeafRef, NodeOutput, OpNode, map_refs

__all__ = ["RegionGraph", "region_network"]


@dataclasses.dataclass
class RegionGraph:
    """The recorded region as a flow network; ``where`` maps each value's FX node to
    ``(op number, output index)``."""

    graph: fx.Graph
    net: Any                                    # cut.network.FlowNetwork
    where: dict[fx.Node, tuple[int, int]]
    stand_ins: dict[fx.Node, fx.Node]           # values kept off the device (offload)


def region_network(nodes: Sequence[OpNode], handles: Sequence[NodeOutput],
                   packed_bytes: dict[tuple[int, int], int]) -> RegionGraph:
    """The flow network of one recorded region call. ``packed_bytes``: the packed size of
    outputs saved with ``SaveWithHooks``, by ``(id(node), output index)``."""
    from ..cut.network import INF, Classification, CostModel, build_flow_network
    from ..cut.stand_ins import keep_stand_ins_off_device

    g = fx.Graph()
    leaves: dict[int, fx.Node] = {}
    outs: dict[tuple[int, int], fx.Node] = {}
    where: dict[fx.Node, tuple[int, int]] = {}
    ops: dict[fx.Node, OpNode] = {}
    static: set[fx.Node] = set()
    unkeepable: set[fx.Node] = set()
    device = None

    def leaf(ref: LeafRef) -> fx.Node:
        nonlocal device
        ph = leaves.get(id(ref))
        if ph is None:
            ph = leaves[id(ref)] = g.placeholder(f"input_{len(leaves)}")
            graph_meta.set_val(ph, ref.value)
            device = device or ref.value.device
            if ref.is_parameter:
                static.add(ph)
        return ph

    def out(node: OpNode, index: int) -> fx.Node:
        return outs[(id(node), index)]

    for node in nodes:
        args = tuple(map_refs(a, out, leaf) for a in node.args)
        kwargs = {k: map_refs(v, out, leaf) for k, v in (node.kwargs or {}).items()}
        call = g.call_function(node.op, args, kwargs)
        vals = []
        for facts in node.outs:
            if facts is None:
                vals.append(None)
                continue
            t = facts[0]()
            if t is None:  # died before the plan: a stand-in value, never kept
                t = torch.empty(facts[2], dtype=facts[3], device="meta")
            vals.append(t)
        _meta(call, node)
        single = len(node.outs) == 1 and node.outs[0] is not None
        values = [call] if single else []
        if single:
            graph_meta.set_val(call, vals[0])
            outs[(id(node), 0)] = call
            where[call], ops[call] = (node.seq, 0), node
        else:
            graph_meta.set_val(call, tuple(vals))
            for i, facts in enumerate(node.outs):
                if facts is None:
                    continue
                item = g.call_function(operator.getitem, (call, i))
                graph_meta.set_val(item, vals[i])
                _meta(item, node)
                outs[(id(node), i)] = item
                where[item], ops[item] = (node.seq, i), node
                values.append(item)
        for v in values:
            i = where[v][1]
            facts = node.outs[i]
            t = facts[0]()
            if t is None or t._version != facts[1]:
                unkeepable.add(v)  # dead, or changed in place later in the region
    nodes_fx = [n for n in g.nodes]
    needed = {outs[(id(h.node), h.index)] for h in handles
              if (id(h.node), h.index) in outs}
    cls = Classification(nodes_fx, {n: i for i, n in enumerate(nodes_fx)}, set(nodes_fx),
                         set(), needed, [], [])
    packed = {v: packed_bytes[(id(ops[v]), i)] for v, (_, i) in where.items()
              if (id(ops[v]), i) in packed_bytes}
    can_offload = any(isinstance(graph_meta.val(v), torch.Tensor)
                      and graph_meta.val(v).device.type not in ("cpu", "meta") for v in nodes_fx)
    net = build_flow_network(None, cls, CostModel(), static_inputs=static,
                             rng_functionalized=True, packed_bytes=packed,
                             can_offload=can_offload)
    for v in unkeepable:
        i = cls.index[v]
        net.save_cost[i] = net.offload_cost[i] = INF
    stand_ins = keep_stand_ins_off_device(net)
    return RegionGraph(g, net, where, stand_ins)


def _meta(v: fx.Node, node: OpNode) -> None:
    graph_meta.set_decision(v, node.decision)
    graph_meta.set_region_path(v, tuple(f.name for f in node.frames) or (node.ctx.name,))
    graph_meta.set_outer_region_id(v, 0)
    # An in-place op replays into copies here (compiled graphs are functional): not one
    # that must run in the forward (torch's rule for mutable ops in a joint graph).
    if getattr(node.op, "_schema", None) is not None and node.op._schema.is_mutable:
        graph_meta.set_partitioner_tag(v, "is_backward")


@dataclasses.dataclass
class Plan:
    """What one region call keeps under its budget, by op number: output indices kept on
    the device (``keep``) and on the host (``host``)."""

    signature: tuple
    keep: dict[int, tuple[int, ...]]
    host: dict[int, tuple[int, ...]]
    notes: list[str]
    evicted: list[tuple[int, int, int, str]]  # (op number, output, bytes, why): not kept
    kept_bytes: int = 0
    unconstrained_bytes: int = 0
    budget_bytes: float = 0.0
    final: bool = True   # False: a whole-model budget's call not at a price (not reused)
    gen: int = -1        # a whole-model budget: the price (runtime/model_budget.py) it is of


def plan_of_cut(rg: RegionGraph, kept: list[fx.Node], on_host: list[fx.Node], signature: tuple,
                notes: list[str], evicted: list[tuple[int, int, str]], kept_bytes: int,
                unconstrained: int, cap: float) -> Plan:
    """A plan from a cut's kept values (placeholders are the region's inputs: not ours)."""
    keep: dict[int, list[int]] = {}
    host: dict[int, list[int]] = {}
    off = set(on_host)
    for v in kept:
        if v not in rg.where:
            continue
        seq, i = rg.where[v]
        (host if v in off else keep).setdefault(seq, []).append(i)
    return Plan(signature, {s: tuple(i) for s, i in keep.items()},
                {s: tuple(i) for s, i in host.items()}, notes, evicted, kept_bytes,
                unconstrained, cap)
