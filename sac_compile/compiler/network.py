"""The flow network whose minimum cut is the forward/backward split.

Formulation (one screen)
------------------------
Every forward-side node ``v`` (inputs, forward ops, and ops that only feed backward but
need no tangent) becomes two vertices ``v_in -> v_out``. After the cut, the source side
``S`` is what the forward computes; the sink side ``T`` is what the backward must have.

* ``v_in -> v_out``, capacity ``save(v)``: cut when ``v`` is computed in forward and needed
  in backward, i.e. **saved**. ``save(v)`` = bytes of ``v``'s output (0 for parameters).
* ``source -> v_in``, capacity ``recompute(v)``: cut when ``v_in`` is on the sink side, i.e.
  ``v`` is **recomputed** in backward.
* ``u_out -> v_in`` (infinite) for each data edge: what ``v`` needs must be there too.
* ``v_out -> sink`` (infinite) when a backward op (anything depending on a tangent) uses ``v``.

The cut minimises::

    saved bytes  +  sum over recomputed v of  w * (FLOPs(v) / flops_per_byte + traffic(v))

FLOPs by ``torch.utils.flop_counter`` rules, ``traffic`` = bytes read + written (for ops
without a FLOP formula this is the whole cost), ``w = recompute_weight``. Decisions enter as:

===================  ===============================  =========================
decision             ``save(v)``                      ``recompute(v)``
===================  ===============================  =========================
MUST_SAVE / offload  bytes                            infinite (hard)
MUST_RECOMPUTE       infinite (hard)                  discount * cost
PREFER_RECOMPUTE     bytes                            discount * cost
PREFER_SAVE          bytes                            cost
untagged             bytes                            cost, or infinite where
                                                      upstream bans recompute
===================  ===============================  =========================

``discount`` (default 0.01) makes PREFER_RECOMPUTE cheap to honour: the solver saves such
a node only when that saves bytes (its recompute would need a larger input kept). A
PREFER_SAVE node is recomputed only when that is cheaper than its bytes (a view or a
cheap pointwise op of something saved anyway). Views and ``getitem``s cost nothing to
recompute; inputs cannot be recomputed; random ops only with RNG functionalisation;
collectives and effectful ops never unless MUST_RECOMPUTE.

Solving it: :mod:`.solvers`. Under a memory budget, the same network with re-weighted
capacities: :mod:`.budget`.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.fx as fx

from ..policy import CheckpointPolicy
from . import costs
from .reasons import Reason, ReasonKind
from .roles import node_role

__all__ = ["CostModel", "Classification", "classify", "FlowNetwork", "build_flow_network",
           "INF"]

INF = math.inf
P = CheckpointPolicy


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Weights of the objective; part of :meth:`SACPartitioner.uuid`."""

    recompute_weight: float = 0.25
    flops_per_byte: float = 8.0
    prefer_recompute_discount: float = 0.01

    def recompute_cost(self, node: fx.Node) -> float:
        return self.recompute_weight * (costs.flops(node) / self.flops_per_byte
                                        + costs.traffic(node))


@dataclasses.dataclass
class Classification:
    """Which joint-graph nodes belong to the forward side and which the backward needs."""

    nodes: list[fx.Node]                # forward-side nodes, graph order
    index: dict[fx.Node, int]
    required_fw: set[fx.Node]           # needed to produce the forward outputs
    backward: set[fx.Node]              # depend on a tangent (or must run in backward)
    needed_in_bw: set[fx.Node]          # forward-side nodes a backward node uses
    fwd_outputs: list[Any]
    bwd_outputs: list[Any]
    mutated_inputs: set[fx.Node] = dataclasses.field(default_factory=set)


def classify(gm: fx.GraphModule, num_fwd_outputs: int) -> Classification:
    from torch._functorch.partitioners import _extract_fwd_bwd_outputs, _must_be_in_backward

    from torch._functorch._aot_autograd.descriptors import InputMutationAOTOutput

    fwd_outputs, bwd_outputs, fwd_descs, _ = _extract_fwd_bwd_outputs(
        gm, num_fwd_outputs=num_fwd_outputs)
    # Inputs the forward mutates hold other values by backward time: never saved as such.
    mutated_descs = [d.mutated_input for d in fwd_descs if isinstance(d, InputMutationAOTOutput)]
    mutated = {n for n in gm.graph.find_nodes(op="placeholder")
               if n.meta.get("desc") is not None and n.meta["desc"] in mutated_descs}
    backward: set[fx.Node] = set()
    nodes: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if node_role(n).runs_in_backward or _must_be_in_backward(n) or \
                any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        else:
            nodes.append(n)
    required_fw: set[fx.Node] = set()
    stack = [o for o in fwd_outputs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in required_fw:
            continue
        required_fw.add(n)
        stack.extend(n.all_input_nodes)
    needed = {n for n in nodes if any(u in backward for u in n.users)}
    needed.update(o for o in bwd_outputs if isinstance(o, fx.Node) and o not in backward)
    return Classification(nodes, {n: i for i, n in enumerate(nodes)}, required_fw, backward,
                          needed, fwd_outputs, bwd_outputs, mutated)


@dataclasses.dataclass
class FlowNetwork:
    """Vertices ``2i`` (in) and ``2i+1`` (out) for ``nodes[i]``; then source, sink."""

    cls: Classification
    edges: list[tuple[int, int, float]]
    save_cost: list[float]
    recompute_cost: list[float]
    ban_reason: dict[fx.Node, Reason]   # why a node cannot be recomputed (infinite edge)

    @property
    def source(self) -> int:
        return 2 * len(self.cls.nodes)

    @property
    def sink(self) -> int:
        return 2 * len(self.cls.nodes) + 1


def _upstream_ban(node: fx.Node, op_types: Any) -> Reason | None:
    """Upstream's default reasons not to recompute an untagged op."""
    if costs.is_view(node) or node.target is operator.getitem:
        return None
    text = None
    if op_types.is_random(node) or costs.is_random(node):
        text = "random op"
    elif op_types.is_compute_intensive(node):
        text = "compute intensive op"
    elif not op_types.is_recomputable(node):
        text = "not in upstream's recomputable allowlist"
    elif costs.nbytes(node) * 4 < sum(costs.nbytes(a) for a in node.args
                                      if isinstance(a, fx.Node)):
        text = "reduction op"
    return None if text is None else Reason(ReasonKind.UPSTREAM_BAN, text)


def _effectful_reason(node: fx.Node) -> Reason | None:
    target = node.target
    from ..runtime.effects import effect_reason  # one predicate for both modes
    text = effect_reason(target)
    if text is not None:
        return Reason(ReasonKind.EFFECTFUL, text)
    from torch._functorch._aot_autograd.utils import is_with_effects
    base = node.args[0] if target is operator.getitem and node.args else None
    if is_with_effects(node) or (isinstance(base, fx.Node) and is_with_effects(base)):
        return Reason(ReasonKind.EFFECTFUL, "effectful op")
    return None


def build_flow_network(gm: fx.GraphModule, cls: Classification, cost: CostModel, *,
                       static_inputs: set[fx.Node], rng_functionalized: bool) -> FlowNetwork:
    from torch._functorch.partitioners import _must_be_in_forward, get_default_op_list

    op_types = get_default_op_list()
    index = cls.index
    source, sink = 2 * len(cls.nodes), 2 * len(cls.nodes) + 1
    edges: list[tuple[int, int, float]] = []
    save_cost: list[float] = []
    recompute_cost: list[float] = []
    bans: dict[fx.Node, Reason] = {}
    for i, v in enumerate(cls.nodes):
        dec = v.meta.get("sac_decision")
        policy = dec.policy if dec is not None else None
        val = v.meta.get("val")
        # -- saving v
        if policy is P.MUST_RECOMPUTE or v in cls.mutated_inputs:
            save = INF
        elif v in static_inputs:
            save = 0.0
        elif isinstance(val, torch.Tensor) or costs.is_sym(v):
            save = float(costs.nbytes(v))
        elif costs.is_opaque(v):
            save = 0.0  # BackwardState, script/opaque objects: passed along, as upstream
        else:
            save = INF  # a tuple, or no value: only its getitems can be saved
        # -- recomputing v
        reason: Reason | None = None
        if v.op == "placeholder":
            reason = Reason(ReasonKind.GRAPH_INPUT, "graph input")
        elif v.op != "call_function":
            reason = None
        elif policy is not None and policy in (P.MUST_SAVE, P.MUST_CPU_OFFLOAD):
            reason = Reason(ReasonKind.MUST_SAVE, f"{dec.label} by {dec.source}")
        elif _must_be_in_forward(v):
            reason = Reason(ReasonKind.MUST_RUN_IN_FORWARD, "must run in forward")
        elif policy is not P.MUST_RECOMPUTE and _effectful_reason(v):
            reason = _effectful_reason(v)
        elif costs.is_random(v) and not rng_functionalized:
            reason = Reason(ReasonKind.RANDOM, "random op (RNG not functionalised)")
        elif policy is None:
            reason = _upstream_ban(v, op_types)
        if reason is not None and v.op != "get_attr":
            bans[v] = reason
            rec = INF
        elif v.op != "call_function" or v not in cls.required_fw or \
                v.target is operator.getitem or costs.is_view(v):
            rec = 0.0
        else:
            rec = cost.recompute_cost(v)
            if policy in (P.PREFER_RECOMPUTE, P.MUST_RECOMPUTE):
                rec *= cost.prefer_recompute_discount
        save_cost.append(save)
        recompute_cost.append(rec)
        vin, vout = 2 * i, 2 * i + 1
        edges.append((vin, vout, save))
        if rec > 0:
            edges.append((source, vin, rec))
        for u in v.users:
            j = index.get(u)
            if j is not None:
                edges.append((vout, 2 * j, INF))
        if v in cls.needed_in_bw:
            edges.append((vout, sink, INF))
    return FlowNetwork(cls, edges, save_cost, recompute_cost, bans)
