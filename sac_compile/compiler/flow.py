"""The flow network and its minimum cut.

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

Memory budget (``SACPartitioner(memory_budget=...)``)
-----------------------------------------------------
``B`` = a float in [0, 1] (a fraction of the activation bytes the unconstrained cut saves)
or an int byte count, per forward/backward split. Activation bytes ``A(cut)`` are the saved
bytes of non-input values (inputs and parameters are excluded: they are alive anyway). With
``K(cut)`` = kept input bytes + recompute cost (the rest of the objective above), each solve
minimises the Lagrangian::

    A(cut)  +  w * K(cut),        0 < w <= 1

``w = 1`` is the unconstrained cut. Lowering ``w`` makes recomputing (and keeping inputs)
cheaper than keeping activations; ``A`` of an optimal cut is monotone in ``w`` (if ``w1 < w2``
then ``A1 <= A2``). :func:`solve_with_budget` solves ``w = 1`` (done when ``A <= B``), then
``w_min`` (``w_min * K`` below one byte: the least ``A`` reachable; above ``B`` ->
:class:`~sac_compile.CheckpointError` naming the values that cannot be recomputed), then
bisects ``log w`` (18 solves) for the largest ``w`` with ``A <= B``. Below ``w = 1``, recompute
costs are tilted by up to 5% in graph order, so that identical blocks give way one at a time. Infinite capacities (MUST
decisions, bans) stay infinite at every ``w``: a budget never breaks a MUST.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..policy import CheckpointPolicy
from . import costs

__all__ = ["CostModel", "FlowNetwork", "Classification", "classify", "build_flow_network",
           "solve", "solve_with_budget", "BudgetResult", "budget_label", "SOLVERS"]

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


def _is_primal(n: fx.Node) -> bool:
    return n.op == "placeholder" and "tangents" not in str(n.target) and \
        not str(n.target).startswith("bwd_")


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
        if (n.op == "placeholder" and not _is_primal(n)) or _must_be_in_backward(n) or \
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
    ban_reason: dict[fx.Node, str]

    @property
    def source(self) -> int:
        return 2 * len(self.cls.nodes)

    @property
    def sink(self) -> int:
        return 2 * len(self.cls.nodes) + 1


def _upstream_ban(node: fx.Node, op_types: Any) -> str | None:
    """Upstream's default reasons not to recompute an untagged op."""
    if costs.is_view(node) or node.target is operator.getitem:
        return None
    if op_types.is_random(node) or costs.is_random(node):
        return "random op"
    if op_types.is_compute_intensive(node):
        return "compute intensive op"
    if not op_types.is_recomputable(node):
        return "not in upstream's recomputable allowlist"
    ins = sum(costs.nbytes(a) for a in node.args if isinstance(a, fx.Node))
    if costs.nbytes(node) * 4 < ins:
        return "reduction op"
    return None


def _effectful_reason(node: fx.Node) -> str | None:
    target = node.target
    from ..runtime.effects import effect_reason  # one predicate for both modes
    reason = effect_reason(target)
    if reason is not None:
        return reason
    from torch._functorch._aot_autograd.utils import is_with_effects
    if is_with_effects(node):
        return "effectful op"
    base = node.args[0] if target is operator.getitem and node.args else None
    if isinstance(base, fx.Node) and is_with_effects(base):
        return "effectful op"
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
    bans: dict[fx.Node, str] = {}
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
        reason = None
        if v.op == "placeholder":
            reason = "graph input"
        elif v.op != "call_function":
            reason = None
        elif policy is not None and policy in (P.MUST_SAVE, P.MUST_CPU_OFFLOAD):
            reason = f"{dec.label} by {dec.source}"
        elif _must_be_in_forward(v):
            reason = "must run in forward"
        elif policy is not P.MUST_RECOMPUTE and _effectful_reason(v):
            reason = _effectful_reason(v)
        elif costs.is_random(v) and not rng_functionalized:
            reason = "random op (RNG not functionalised)"
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


# --------------------------------------------------------------------------------------
# Solvers: each returns the set of vertices on the source side of a minimum cut.
# --------------------------------------------------------------------------------------

class InfeasibleCut(RuntimeError):
    pass


def _solve_networkx(n_vertices: int, edges: Sequence[tuple[int, int, float]], s: int,
                    t: int) -> set[int]:
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(n_vertices))
    for u, v, c in edges:
        if g.has_edge(u, v):
            old = g[u][v].get("capacity", INF)
            g[u][v]["capacity"] = old + c
        elif c == INF:
            g.add_edge(u, v)
        else:
            g.add_edge(u, v, capacity=c)
    try:
        _, (reachable, _) = nx.minimum_cut(g, s, t)
    except nx.NetworkXUnbounded as e:
        raise InfeasibleCut(str(e)) from e
    return set(reachable)


def _solve_scipy(n_vertices: int, edges: Sequence[tuple[int, int, float]], s: int,
                 t: int) -> set[int]:
    import numpy as np
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    finite = [c for _, _, c in edges if c != INF]
    total = sum(finite) or 1.0
    # Integer capacities below 2**30: one unit is ``quantum`` of the objective; an
    # infinite edge is worth more than all finite ones together.
    big = 2 ** 30
    quantum = max(total / (big // 4), 1e-9)
    inf_cap = big
    rows = np.fromiter((u for u, _, _ in edges), dtype=np.int32, count=len(edges))
    cols = np.fromiter((v for _, v, _ in edges), dtype=np.int32, count=len(edges))
    caps = np.fromiter((inf_cap if c == INF else max(int(round(c / quantum)), 0)
                        for _, _, c in edges), dtype=np.int64, count=len(edges))
    keep = (caps > 0) & (rows != cols)
    mat = csr_array((caps[keep], (rows[keep], cols[keep])), shape=(n_vertices, n_vertices))
    mat.sum_duplicates()
    mat.data = np.minimum(mat.data, inf_cap).astype(np.int32)
    res = maximum_flow(mat, s, t, method="dinic")
    if res.flow_value >= inf_cap or res.flow_value < 0:
        raise InfeasibleCut("every cut crosses an infinite edge")
    flow = res.flow
    residual = (mat.astype(np.int64) - flow.astype(np.int64)).tocsr()
    residual.data = np.where(residual.data > 0, 1, 0).astype(np.int8)
    residual.eliminate_zeros()
    order = breadth_first_order(residual, s, directed=True, return_predecessors=False)
    return set(order.tolist())


SOLVERS = {"networkx": _solve_networkx, "scipy": _solve_scipy}


def default_solver() -> str:
    try:
        import scipy.sparse.csgraph  # noqa: F401
        return "scipy"
    except ImportError:
        return "networkx"


def solve(net: FlowNetwork, solver: str | None = None, *,
          edges: Sequence[tuple[int, int, float]] | None = None) -> tuple[list[fx.Node], float]:
    """The saved nodes of a minimum cut (graph order) and the solve time in seconds.
    ``edges``: capacities to use instead of ``net.edges`` (same vertices)."""
    name = solver or default_solver()
    fn = SOLVERS[name]
    t0 = time.perf_counter()
    try:
        source_side = fn(net.sink + 1, net.edges if edges is None else edges, net.source,
                         net.sink)
    except InfeasibleCut:
        from .tagging import CompiledCheckpointError
        raise CompiledCheckpointError(_explain_infeasible(net)) from None
    elapsed = time.perf_counter() - t0
    saved = [v for i, v in enumerate(net.cls.nodes)
             if 2 * i in source_side and 2 * i + 1 not in source_side]
    return saved, elapsed


def _explain_infeasible(net: FlowNetwork) -> str:
    # Values that can be neither saved nor recomputed; those backward uses directly first.
    stuck = [v for v in net.cls.nodes if v in net.ban_reason
             and net.save_cost[net.cls.index[v]] == INF]
    stuck.sort(key=lambda v: v not in net.cls.needed_in_bw)
    def where(v: fx.Node) -> str:
        path = v.meta.get("sac_region_path") or ()
        return f" in region {path[-1]!r}" if path else ""

    # A stuck graph input is forced by the ops that must recompute from it: name those.
    culprits = [u for v in stuck if v.op == "placeholder" for u in v.users
                if getattr(u.meta.get("sac_decision"), "policy", None) is P.MUST_RECOMPUTE]
    names = ", ".join([f"{costs.op_label(u)}{where(u)} (MUST_RECOMPUTE, reads a graph input "
                       f"the forward mutates, which cannot be saved)" for u in culprits[:3]]
                      + [f"{costs.op_label(v)}{where(v)} ({v.name}: {net.ban_reason[v]})"
                         for v in stuck[:5]])
    return ("no valid forward/backward split: a value the backward needs can be neither "
            "saved nor recomputed. Ops involved: " + (names or "see the joint graph") +
            ". Typical cause: MUST_RECOMPUTE on an op that cannot be recomputed (a random op "
            "without RNG functionalisation, an op that mutates its inputs such as a "
            "training-mode batch_norm, a collective). Make the policy return PREFER_RECOMPUTE "
            "(or None) for those ops")


# --------------------------------------------------------------------------------------
# Memory budget: a Lagrangian search on the weight of everything but activation bytes.
# --------------------------------------------------------------------------------------

BISECT_STEPS = 18


@dataclasses.dataclass
class BudgetResult:
    saved: list[fx.Node]                 # the chosen cut's saved nodes, graph order
    budget: float | int                  # as given
    budget_bytes: float                  # the cap on activation bytes for this split
    activation_bytes: int                # what the chosen cut saves (inputs excluded)
    unconstrained_bytes: int             # what the cut without a budget saves
    min_bytes: int                       # the least reachable
    weight: float                        # the chosen w (1.0: the unconstrained cut)
    evicted: list[fx.Node]               # saved without the budget, not with it
    solves: int
    seconds: float


def budget_label(budget: float | int) -> str:
    """``0.5`` -> ``"50%"``, ``65536`` -> ``"64 KiB"``."""
    from ..report import fmt_bytes
    if isinstance(budget, float):
        return f"{budget * 100:g}%"
    return fmt_bytes(budget)


def check_budget(budget: Any) -> float | int | None:
    """``None``, a float in [0, 1] or an int >= 0 (bytes); anything else: ValueError."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"memory_budget must be a float in (0, 1] (a fraction of the "
                         f"activation bytes saved without a budget) or an int byte count, got "
                         f"{budget!r} of type {type(budget).__name__}")
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise ValueError(f"memory_budget={budget!r}: a float is a fraction and must lie in "
                         f"(0, 1]; give bytes as an int (e.g. memory_budget={int(budget)})"
                         if budget > 1 else
                         f"memory_budget={budget!r}: a fraction must lie in (0, 1]")
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget={budget!r}: a byte count must be >= 0")
    return budget


def _is_activation(net: FlowNetwork, i: int) -> bool:
    v = net.cls.nodes[i]
    return v.op != "placeholder" and net.save_cost[i] != INF


# Identical blocks would all switch at the same ``w`` (the budget then met with much room to
# spare): recompute costs get a graph-order tilt of up to this much, later values cheaper.
TILT = 0.05


def _weighted_edges(net: FlowNetwork, w: float) -> list[tuple[int, int, float]]:
    """``net.edges`` with every finite capacity except activation bytes scaled by ``w``
    (recompute costs also tilted by graph order, see ``TILT``)."""
    out = []
    src = net.source
    n = max(len(net.cls.nodes), 1)
    for u, v, c in net.edges:
        if c == INF or c == 0:
            out.append((u, v, c))
        elif u == src:
            out.append((u, v, c * w * (1.0 - TILT * (v // 2) / n)))
        elif (v == u + 1 and u % 2 == 0 and u < src
              and net.cls.nodes[u // 2].op == "placeholder"):
            out.append((u, v, c * w))
        else:
            out.append((u, v, c))
    return out


def _activation_bytes(net: FlowNetwork, saved: list[fx.Node]) -> int:
    idx = net.cls.index
    return int(sum(net.save_cost[idx[v]] for v in saved if _is_activation(net, idx[v])))


def solve_with_budget(net: FlowNetwork, budget: float | int,
                      solver: str | None = None) -> BudgetResult:
    """The cut with the largest ``w`` whose activation bytes fit ``budget`` (see the module
    docstring); :class:`~sac_compile.CheckpointError` when no cut fits."""
    t0 = time.perf_counter()
    solves = 0

    def at(w: float) -> tuple[list[fx.Node], int]:
        nonlocal solves
        solves += 1
        saved, _ = solve(net, solver, edges=None if w == 1.0 else _weighted_edges(net, w))
        return saved, _activation_bytes(net, saved)

    base, base_bytes = at(1.0)
    cap = budget * base_bytes if isinstance(budget, float) else float(budget)

    def result(saved: list[fx.Node], nbytes: int, w: float, min_bytes: int) -> BudgetResult:
        kept = set(saved)
        evicted = [v for v in base if v not in kept and _is_activation(net, net.cls.index[v])]
        return BudgetResult(saved, budget, cap, nbytes, base_bytes, min_bytes, w, evicted,
                            solves, time.perf_counter() - t0)

    if base_bytes <= cap:
        return result(base, base_bytes, 1.0, base_bytes)
    # Everything but activation bytes together worth less than one byte at w_min.
    other = sum(c for u, v, c in net.edges if c not in (0, INF) and (
        u == net.source or (v == u + 1 and u % 2 == 0 and u < net.source
                            and net.cls.nodes[u // 2].op == "placeholder")))
    w_min = min(0.5 / other, 1e-3) if other > 0 else 1e-3
    low, low_bytes = at(w_min)
    if low_bytes > cap:
        # Keeps its type and message through Dynamo (a CheckpointError, not wrapped).
        from .tagging import CompiledCheckpointError
        raise CompiledCheckpointError(
            _explain_budget(net, low, budget, cap, low_bytes, base_bytes)) from None
    best, best_bytes, best_w = low, low_bytes, w_min
    lo, hi = math.log(w_min), 0.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        saved, nbytes = at(math.exp(mid))
        if nbytes <= cap:
            lo, best, best_bytes, best_w = mid, saved, nbytes, math.exp(mid)
        else:
            hi = mid
    return result(best, best_bytes, best_w, low_bytes)


def _explain_budget(net: FlowNetwork, saved: list[fx.Node], budget: float | int, cap: float,
                    min_bytes: int, base_bytes: int) -> str:
    from ..report import fmt_bytes
    idx = net.cls.index
    acts = sorted((v for v in saved if _is_activation(net, idx[v])),
                  key=lambda v: -net.save_cost[idx[v]])
    items = []
    for v in acts[:5]:
        path = v.meta.get("sac_region_path")
        where = f" in region {path[-1]!r}" if path else ""
        why = net.ban_reason.get(v, "kept so that others can be recomputed")
        items.append(f"{v.name} ({costs.op_label(v)}, {fmt_bytes(net.save_cost[idx[v]])}"
                     f"{where}: {why})")
    given = (f"{budget_label(budget)} of {fmt_bytes(base_bytes)} = {fmt_bytes(cap)}"
             if isinstance(budget, float) else fmt_bytes(cap))
    ratio = f"{min_bytes / base_bytes:.3g}" if base_bytes else ""
    need = f" (memory_budget={ratio if '.' in ratio else ratio + '.0'} or more)" if ratio else ""
    must = any("MUST_SAVE" in net.ban_reason.get(v, "") or "OFFLOAD" in net.ban_reason.get(v, "")
               for v in acts)
    fix = ("raise the budget to at least " + fmt_bytes(min_bytes) + need +
           (", or relax those MUST_SAVE decisions to PREFER_SAVE so they may be recomputed"
            if must else ", or let more of these values be recomputed"))
    return (f"sac_compile: memory budget {given} cannot be met: even with everything "
            f"recomputed that may be recomputed, this forward/backward split saves "
            f"{fmt_bytes(min_bytes)} of activations. Largest values it must still save: "
            f"{'; '.join(items) or 'none'}. To fix: {fix}.")
