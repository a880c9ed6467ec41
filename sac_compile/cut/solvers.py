"""Max-flow solvers for the flow network (:mod:`.network`) and the minimum cut they give.

Each solver takes the vertex count, the edges ``(u, v, capacity)`` and the source and sink,
and returns the vertices on the source side of a minimum cut:

* ``"scipy"`` (the default when scipy is installed): ``scipy.sparse.csgraph.maximum_flow``
  (compiled Dinic) on integer capacities, then a breadth-first search of the residual graph;
* ``"networkx"``: ``networkx.minimum_cut``, pure Python, the fallback.

:func:`solve` turns the source side into the saved nodes: ``v_in`` on the source side and
``v_out`` on the sink side is a cut ``v_in -> v_out`` edge, i.e. ``v`` is saved. A network
whose every cut crosses an infinite edge (a value the backward needs that can be neither
saved nor recomputed) is a :class:`~sac_compile.CheckpointError` naming the ops involved.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch.fx as fx

from .. import graph_meta
from ..errors import CompiledCheckpointError
from ..policy import CheckpointPolicy
from . import costs
from .network import INF, FlowNetwork

__all__ = ["SOLVERS", "default_solver", "solve", "source_side", "kept_nodes", "InfeasibleCut"]

P = CheckpointPolicy


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


def source_side(net: FlowNetwork, solver: str | None = None, *,
                edges: Sequence[tuple[int, int, float]] | None = None) -> set[int]:
    """The vertices on the source side of a minimum cut (``v_in`` of node ``i`` is ``2i``:
    off the source side, ``i`` is recomputed). ``edges``: capacities to use instead of
    ``net.edges`` (same vertices)."""
    fn = SOLVERS[solver or default_solver()]
    try:
        return fn(net.sink + 1, net.edges if edges is None else edges, net.source, net.sink)
    except InfeasibleCut:
        raise CompiledCheckpointError(_explain_infeasible(net)) from None


def kept_nodes(net: FlowNetwork, side: set[int]) -> list[fx.Node]:
    """The nodes a cut keeps for the backward (``v_in`` in, ``v_out`` out), graph order."""
    return [v for i, v in enumerate(net.cls.nodes)
            if 2 * i in side and 2 * i + 1 not in side]


def solve(net: FlowNetwork, solver: str | None = None, *,
          edges: Sequence[tuple[int, int, float]] | None = None) -> tuple[list[fx.Node], float]:
    """The saved nodes of a minimum cut (graph order) and the solve time in seconds."""
    t0 = time.perf_counter()
    side = source_side(net, solver, edges=edges)
    return kept_nodes(net, side), time.perf_counter() - t0


def _explain_infeasible(net: FlowNetwork) -> str:
    # Values that can be neither saved nor recomputed; those backward uses directly first.
    stuck = [v for v in net.cls.nodes if v in net.ban_reason
             and net.save_cost[net.cls.index[v]] == INF]
    stuck.sort(key=lambda v: v not in net.cls.needed_in_bw)
    def where(v: fx.Node) -> str:
        path = graph_meta.region_path(v) or ()
        return f" in region {path[-1]!r}" if path else ""

    # A stuck graph input is forced by the ops that must recompute from it: name those.
    culprits = [u for v in stuck if v.op == "placeholder" for u in v.users
                if getattr(graph_meta.decision(u), "policy", None) is P.MUST_RECOMPUTE]
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
