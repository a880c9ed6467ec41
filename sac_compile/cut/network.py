"""The flow network whose minimum cut is the forward/backward split.

Formulation (one screen)
------------------------
Every forward-side node ``v`` (inputs, forward ops, and ops that only feed backward but
need no tangent) becomes two vertices ``v_in -> v_out``. After the cut, the source side
``S`` is what the forward computes; the sink side ``T`` is what the backward must have.

* ``v_in -> v_out``, capacity ``keep(v) = min(save(v), offload(v))``: cut when ``v`` is
  computed in forward and needed in backward, i.e. **kept**: on the device (``save(v)`` =
  its bytes, or its packed bytes under ``SaveWithHooks``; 0 for parameters) or on the host
  (``offload(v)`` = ``w * bytes * device_bw / host_bw``: its transfer time, in the units of
  the recompute cost; no device memory). A kept value is offloaded when that is cheaper.
* ``source -> v_in``, capacity ``recompute(v)``: cut when ``v_in`` is on the sink side, i.e.
  ``v`` is **recomputed** in backward (a random op adds the bytes of the RNG state kept to
  replay it).
* ``u_out -> v_in`` (infinite) for each data edge: what ``v`` needs must be there too.
* ``v_out -> sink`` (infinite) when a backward op (anything depending on a tangent) uses ``v``.

The cut minimises::

    device bytes kept  +  sum over offloaded v of offload(v)
                       +  sum over recomputed v of  w * (FLOPs(v) / flops_per_byte + traffic(v))

FLOPs by ``torch.utils.flop_counter`` rules, ``traffic`` = bytes read + written (for ops
without a FLOP formula this is the whole cost), ``w = recompute_weight``. Decisions enter as:

=================  =====================  ===================  =======================
decision           ``save(v)``            ``offload(v)``       ``recompute(v)``
=================  =====================  ===================  =======================
MUST_SAVE          bytes (packed: hooks)  infinite             infinite (hard)
MUST_CPU_OFFLOAD   infinite (a)           transfer             infinite (hard)
PREFER_CPU_OFFL.   infinite (a)           transfer             cost
MUST_RECOMPUTE     infinite (hard)        infinite             discount * cost
PREFER_RECOMPUTE   bytes                  transfer             discount * cost
PREFER_SAVE        bytes                  transfer             cost
untagged           bytes                  transfer             cost, or infinite where
                                                               upstream bans recompute
                                                               (cost under a budget)
=================  =====================  ===================  =======================

(a) bytes where the value cannot leave the device (on the CPU already, a view, a getitem,
non-contiguous, a forward output: torch's offload pass refuses those). ``offload`` is
infinite for those values too, for hooked values, and for unmarked values when
``CostModel.offload_unmarked`` is False. With the default bandwidths a transfer costs 20x the bytes:
an unmarked value is offloaded only under a memory budget (:mod:`.budget`), where kept
device bytes are what is capped.

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

from .. import graph_meta
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
    # Offload: a byte moved to the host and back costs its transfer time, in units of a
    # byte of device-memory traffic (the recompute cost's unit): device_bw / host_bw.
    # Defaults: ~2 TB/s HBM, ~25 GB/s effective PCIe (each way).
    device_memory_bandwidth: float = 2e12
    host_device_bandwidth: float = 25e9
    # False: only values the policy marks *_CPU_OFFLOAD may leave the device (as in eager
    # mode); True: a memory budget may also offload others, when cheaper than recomputing.
    offload_unmarked: bool = True
    # Under a memory budget, untagged ops that upstream's heuristics would never recompute
    # (compute intensive, reductions, off its allowlist) may be recomputed, at their cost.
    budget_lifts_upstream_bans: bool = True
    @classmethod
    def for_device(cls, device: Any, **overrides: Any) -> CostModel:
        """The cost model of a device's rates (:mod:`.device_rates`: a preset name such as
        ``"h100"``, or a ``torch.device`` detected by its product name). ``overrides``:
        other fields."""
        from .device_rates import DeviceRates, rates_for
        rates = device if isinstance(device, DeviceRates) else rates_for(device)
        if rates is None:
            raise ValueError(f"CostModel.for_device({device!r}): no rates for this device; "
                             f"pass a preset name (sac_compile.cut.device_rates.PRESETS) or "
                             f"a DeviceRates")
        fields = dict(flops_per_byte=rates.flops_per_byte,
                      device_memory_bandwidth=rates.memory_bandwidth,
                      host_device_bandwidth=rates.host_link)
        return cls(**{**fields, **overrides})

    def recompute_cost(self, node: fx.Node) -> float:
        return self.recompute_weight * (costs.flops(node) / self.flops_per_byte
                                        + costs.traffic(node))

    def offload_cost(self, nbytes: float) -> float:
        return self.recompute_weight * nbytes * (self.device_memory_bandwidth
                                                 / self.host_device_bandwidth)


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
    from ..torch_internals import (InputMutationAOTOutput, extract_fwd_bwd_outputs,
                                   must_be_in_backward)

    fwd_outputs, bwd_outputs, fwd_descs, _ = extract_fwd_bwd_outputs(
        gm, num_fwd_outputs=num_fwd_outputs)
    # Inputs the forward mutates hold other values by backward time: never saved as such.
    mutated_descs = [d.mutated_input for d in fwd_descs if isinstance(d, InputMutationAOTOutput)]
    mutated = {n for n in gm.graph.find_nodes(op="placeholder")
               if graph_meta.desc(n) is not None and graph_meta.desc(n) in mutated_descs}
    backward: set[fx.Node] = set()
    nodes: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if node_role(n).runs_in_backward or must_be_in_backward(n) or \
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
    structure: list[tuple[int, int]]    # the infinite edges (data edges, backward uses)
    save_cost: list[float]              # device bytes to keep v (INF: not on the device)
    offload_cost: list[float]           # cost of keeping v on the host (INF: cannot)
    recompute_cost: list[float]
    ban_reason: dict[fx.Node, Reason]   # why a node cannot be recomputed (infinite edge)
    # Untagged ops upstream would not recompute (heuristic bans): their recompute cost
    # under a memory budget (w < 1), where the budget asks for memory first.
    lifted_under_budget: dict[int, float] = dataclasses.field(default_factory=dict)
    # Device bytes that recomputing node i keeps: a random op's RNG state.
    recompute_bytes: dict[int, float] = dataclasses.field(default_factory=dict)

    @property
    def source(self) -> int:
        return 2 * len(self.cls.nodes)

    @property
    def sink(self) -> int:
        return 2 * len(self.cls.nodes) + 1

    @property
    def edges(self) -> list[tuple[int, int, float]]:
        return self.capacities()

    def capacities(self, w: float = 1.0, tilt: float = 0.0) -> list[tuple[int, int, float]]:
        """The edges with capacities for the Lagrangian weight ``w`` (:mod:`.budget`):
        device bytes of activations as they are; recompute, offload and keeping inputs
        scaled by ``w``; recompute costs tilted down by up to ``tilt`` in graph order."""
        edges: list[tuple[int, int, float]] = [(u, v, INF) for u, v in self.structure]
        n = max(len(self.cls.nodes), 1)
        src = self.source
        for i, node in enumerate(self.cls.nodes):
            save = self.save_cost[i]
            if node.op == "placeholder":
                save *= w
            keep = min(save, w * self.offload_cost[i])
            edges.append((2 * i, 2 * i + 1, keep))
            rec = self.recompute_cost[i]
            if w < 1.0 and i in self.lifted_under_budget:
                rec = self.lifted_under_budget[i]
            if rec > 0:
                rec = rec if w == 1.0 else rec * w * (1 - tilt * i / n)
                edges.append((src, 2 * i, rec + self.recompute_bytes.get(i, 0.0)))
        return edges

    def offloaded(self, kept: list[fx.Node], w: float = 1.0) -> list[fx.Node]:
        """Those of the kept values that the cut keeps on the host (cheaper than the
        device at weight ``w``)."""
        idx = self.cls.index
        return [v for v in kept if w * self.offload_cost[idx[v]] < self.save_cost[idx[v]]]

    def device_bytes(self, kept: list[fx.Node], w: float = 1.0) -> list[float]:
        """Device bytes of each kept value (0 for an offloaded one)."""
        idx = self.cls.index
        host = set(self.offloaded(kept, w))
        return [0.0 if v in host else self.save_cost[idx[v]] for v in kept]


def _upstream_ban(node: fx.Node, op_types: Any, *, needed_in_forward: bool) -> Reason | None:
    """Upstream's default reasons not to recompute an untagged op. As upstream, they apply
    only to a node the forward's outputs need (``is_required_fw``): one only the backward
    needs (an "unclaimed" node, e.g. the one-hot of Inductor's ``nll_loss_backward``) runs
    once either way, and is computed in backward unless keeping it is cheaper. A random op
    is banned either way: run in backward, it would draw other numbers."""
    if costs.is_view(node) or node.target is operator.getitem:
        return None
    text = None
    if costs.is_random(node):  # (not op_types.is_random: SDPA with dropout_p=0 is not)
        text = "random op"
    elif not needed_in_forward:
        return None
    elif op_types.is_compute_intensive(node):
        text = "compute intensive op"
    elif not op_types.is_recomputable(node):
        text = "not in upstream's recomputable allowlist"
    elif costs.nbytes(node) * 4 < sum(costs.nbytes(a) for a in node.args
                                      if isinstance(a, fx.Node)):
        text = "reduction op"
    return None if text is None else Reason(ReasonKind.UPSTREAM_BAN, text)


def _tie_break(v: fx.Node) -> float:
    """A one-byte nudge to ``v``'s keep cost where two cuts keep the same bytes and the
    max-flow would pick one by accident of graph order: the outputs of a split (views)
    against the matmul they split (+1: keep the base), and a view of a value to offload or
    pack against a same-size op of it (-1: keep the view, so the storage pass keeps its
    base). Nothing else is nudged: one byte outweighs a small discounted recompute."""
    base, storage = v, False
    while isinstance(base, fx.Node) and base.op == "call_function" and base.args and (
            costs.is_view(base) or (base.target is operator.getitem
                                    and isinstance(base.args[0], fx.Node)
                                    and costs.is_view(base.args[0]))):
        base = base.args[0]
        bdec = graph_meta.decision(base) if isinstance(base, fx.Node) else None
        storage = storage or (bdec is not None and bdec.stored_off_device)
    if base is v:
        return 0.0
    return -1.0 if storage else 1.0


def _effectful_reason(node: fx.Node) -> Reason | None:
    target = node.target
    from ..effects import effect_reason  # one predicate for both modes
    text = effect_reason(target)
    if text is not None:
        return Reason(ReasonKind.EFFECTFUL, text)
    from ..torch_internals import is_with_effects
    base = node.args[0] if target is operator.getitem and node.args else None
    if is_with_effects(node) or (isinstance(base, fx.Node) and is_with_effects(base)):
        return Reason(ReasonKind.EFFECTFUL, "effectful op")
    return None


def can_leave_device(v: fx.Node, forward_outputs: set[fx.Node]) -> bool:
    """What torch's offload pass accepts (its ``can_offload``), decided before the cut: a
    contiguous tensor computed on an accelerator, not a view or one output of a
    multi-output op, not an output of the compiled graph."""
    val = graph_meta.val(v)
    return (v.op == "call_function" and isinstance(val, torch.Tensor)
            and val.device.type != "cpu" and not costs.is_view(v)
            and v.target is not operator.getitem and v not in forward_outputs
            and bool(val.is_contiguous()))


def build_flow_network(gm: fx.GraphModule, cls: Classification, cost: CostModel, *,
                       static_inputs: set[fx.Node], rng_functionalized: bool,
                       packed_bytes: dict[fx.Node, int] | None = None,
                       can_offload: bool = True) -> FlowNetwork:
    """``packed_bytes``: the packed size of values saved with ``SaveWithHooks``
    (:func:`.storage.packed_sizes`); their device bytes. ``can_offload``: False where
    torch has no offload pass (every value stays on the device)."""
    from ..torch_internals import get_default_op_list, must_be_in_forward

    op_types = get_default_op_list()
    index = cls.index
    sink = 2 * len(cls.nodes) + 1
    packed_bytes = packed_bytes or {}
    fwd_outputs = {o for o in cls.fwd_outputs if isinstance(o, fx.Node)}
    structure: list[tuple[int, int]] = []
    soft: dict[int, float] = {}
    rng_bytes: dict[int, float] = {}
    save_cost: list[float] = []
    offload_cost: list[float] = []
    recompute_cost: list[float] = []
    bans: dict[fx.Node, Reason] = {}
    for i, v in enumerate(cls.nodes):
        dec = graph_meta.decision(v)
        policy = dec.policy if dec is not None else None
        val = graph_meta.val(v)
        # -- saving v
        if policy is P.MUST_RECOMPUTE or v in cls.mutated_inputs:
            save = INF
        elif v in static_inputs:
            save = 0.0
        elif v in packed_bytes:
            save = float(packed_bytes[v])
        elif isinstance(val, torch.Tensor) or costs.is_sym(v):
            save = float(costs.nbytes(v))
            if v.op == "call_function":
                save = max(save + _tie_break(v), 0.0)
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
        elif must_be_in_forward(v):
            reason = Reason(ReasonKind.MUST_RUN_IN_FORWARD, "must run in forward")
        elif policy is not P.MUST_RECOMPUTE and _effectful_reason(v):
            reason = _effectful_reason(v)
        elif costs.is_random(v) and not rng_functionalized:
            reason = Reason(ReasonKind.RANDOM, "random op (RNG not functionalised)")
        elif policy is None:
            reason = _upstream_ban(v, op_types, needed_in_forward=v in cls.required_fw)
        if reason is not None and v.op != "get_attr":
            bans[v] = reason
            rec = INF
            if reason.kind is ReasonKind.UPSTREAM_BAN and cost.budget_lifts_upstream_bans and \
                    v in cls.required_fw and not costs.is_random(v):
                soft[i] = cost.recompute_cost(v)
        elif v.op != "call_function" or v not in cls.required_fw or \
                v.target is operator.getitem or costs.is_view(v):
            rec = 0.0
        else:
            rec = cost.recompute_cost(v)
            if policy in (P.PREFER_RECOMPUTE, P.MUST_RECOMPUTE):
                rec *= cost.prefer_recompute_discount
            if costs.is_random(v):
                rng_bytes[i] = float(costs.rng_state_bytes(v))
        # -- keeping v on the host
        offload = INF
        marked = dec is not None and dec.offloads
        if can_offload and (marked or cost.offload_unmarked) and save != INF and v not in static_inputs and \
                (dec is None or (dec.hooks is None and policy is not P.MUST_SAVE)) and \
                can_leave_device(v, fwd_outputs):
            offload = cost.offload_cost(costs.nbytes(v))
            if marked:
                save = INF  # the policy asked for the host: the device is no option
        save_cost.append(save)
        offload_cost.append(offload)
        recompute_cost.append(rec)
        vout = 2 * i + 1
        for u in v.users:
            j = index.get(u)
            if j is not None:
                structure.append((vout, 2 * j))
        if v in cls.needed_in_bw:
            structure.append((vout, sink))
    return FlowNetwork(cls, structure, save_cost, offload_cost, recompute_cost, bans, soft,
                       rng_bytes)
