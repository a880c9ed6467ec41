"""The exact cut under a memory budget: a mixed-integer program on the flow network.

:mod:`.budget`'s Lagrangian search only reaches the cuts that are optimal for some weight
``w``; between two of them the budget may leave slack that a cheaper cut would use. Here the
same network (:mod:`.network`) is solved exactly with scipy's ``milp`` (HiGHS):

* ``x[a]`` in {0, 1} per vertex (1: source side); ``x[source] = 1``, ``x[sink] = 0``;
  every infinite edge ``a -> b`` is ``x[a] <= x[b]``;
* node ``i`` is recomputed when ``x[in_i] = 0``: cost ``recompute_i * (1 - x[in_i])``;
* node ``i`` is kept when ``x[in_i] - x[out_i] = 1``: on the device (``d_i`` in {0, 1},
  ``save_i`` device bytes) or on the host (``h_i`` in [0, 1], cost ``offload_i``),
  ``d_i + h_i >= x[in_i] - x[out_i]``;
* budget: ``sum over activations of save_i * d_i`` + the RNG state bytes of recomputed
  random ops ``<= B``;
* minimise ``K`` = recompute + offload + kept input bytes (the rest of the objective), plus
  a tie-break of ``1e-9`` per device byte kept; the device bytes of the ``priced`` nodes
  (and the RNG states their recomputes keep) count in full instead: values under no cap
  (per-region budgets, :mod:`sac_compile.budgets.groups`) are kept as the cut without a budget would.

The arrays come from :meth:`ExactProblem.from_network`; :func:`brute_force` enumerates every
cut of a tiny problem, the test oracle for the formulation.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

__all__ = ["ExactProblem", "ExactSolution", "solve_exact", "brute_force", "objective"]

INF = math.inf
TIE_BREAK = 1e-9


@dataclasses.dataclass
class ExactProblem:
    """Node ``i`` has vertices ``2i`` (in) and ``2i+1`` (out); then source, sink."""

    structure: Sequence[tuple[int, int]]   # infinite edges
    save: Sequence[float]                  # device bytes to keep (INF: not on the device)
    offload: Sequence[float]               # cost of keeping on the host (INF: cannot)
    recompute: Sequence[float]             # cost of recomputing (INF: cannot; 0: free)
    is_input: Sequence[bool]               # a graph input: its bytes are cost, not budget
    recompute_bytes: dict[int, float] = dataclasses.field(default_factory=dict)  # RNG states

    @property
    def n(self) -> int:
        return len(self.save)

    @classmethod
    def from_network(cls, net: object) -> ExactProblem:
        """The network under a budget (upstream bans it lifts are recompute costs)."""
        recompute = list(net.recompute_cost)
        for i, c in net.lifted_under_budget.items():
            recompute[i] = c
        return cls(net.structure, net.save_cost, net.offload_cost, recompute,
                   [v.op == "placeholder" for v in net.cls.nodes], dict(net.recompute_bytes))


@dataclasses.dataclass
class ExactSolution:
    kept: list[int]          # node indices kept (device or host)
    on_host: list[int]       # of those, kept on the host
    recomputed: list[int]    # node indices recomputed (at a cost)
    cost: float              # K: recompute + offload + kept input bytes
    device_bytes: float      # activation bytes kept on the device
    optimal: bool            # proven optimal (False: the time limit hit first)


def objective(p: ExactProblem, kept: set[int], on_host: set[int],
              recomputed: set[int]) -> tuple[float, float]:
    """``(K, device bytes of activations)`` of a cut given by what it keeps and recomputes."""
    cost = sum(p.recompute[i] for i in recomputed)
    cost += sum(p.offload[i] for i in on_host)
    cost += sum(p.save[i] for i in kept - on_host if p.is_input[i])
    acts = sum(p.save[i] for i in kept - on_host if not p.is_input[i])
    acts += sum(p.recompute_bytes.get(i, 0.0) for i in recomputed)
    return cost, acts


def solve_exact(p: ExactProblem, budget_bytes: float | None, *, time_limit: float = 20.0,
                group_caps: Sequence[tuple[Sequence[int], float]] = (),
                priced: Sequence[int] = ()) -> ExactSolution | None:
    """The cheapest cut whose device activation bytes fit ``budget_bytes`` (None: no cap on
    all of them) and, for each ``(nodes, cap)`` of ``group_caps``, whose device bytes of
    those nodes fit ``cap`` (per-region budgets); None when no cut fits or the solver found
    none within ``time_limit`` seconds. The device bytes of the ``priced`` nodes are part of
    the objective (one unit per byte, as in the cut without a budget)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    from ..logs import get_logger, native_stdout_to_log

    n = p.n
    nv = 2 * n + 2
    src, snk = 2 * n, 2 * n + 1
    # variables: x[0..nv) | d[0..n) | h[0..n)
    nvar = nv + 2 * n
    D, H = nv, nv + n
    c = np.zeros(nvar)
    lo, hi = np.zeros(nvar), np.ones(nvar)
    lo[src] = 1.0
    hi[snk] = 0.0
    integrality = np.zeros(nvar)
    integrality[:nv] = 1
    integrality[D:D + n] = 1
    const = 0.0
    priced_set = set(priced)
    rows, cols, vals, rlo, rhi = [], [], [], [], []

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(rlo)
        for j, v in entries:
            rows.append(r)
            cols.append(j)
            vals.append(v)
        rlo.append(low)
        rhi.append(high)

    for a, b in p.structure:
        row([(a, 1.0), (b, -1.0)], -np.inf, 0.0)          # x[a] <= x[b]
    for i in range(n):
        vin, vout = 2 * i, 2 * i + 1
        rec, save, off = p.recompute[i], p.save[i], p.offload[i]
        if rec == INF:
            lo[vin] = 1.0
        elif rec > 0:
            rec += p.recompute_bytes.get(i, 0.0) if i in priced_set else 0.0
            const += rec
            c[vin] -= rec
        if save == INF:
            hi[D + i] = 0.0
        if off == INF:
            hi[H + i] = 0.0
        else:
            c[H + i] = off
        if save == INF and off == INF:
            row([(vin, 1.0), (vout, -1.0)], -np.inf, 0.0)  # never cut
            continue
        if p.is_input[i] or (i in priced_set and save != INF):
            c[D + i] = save
        elif save != INF:
            c[D + i] = TIE_BREAK * save
        row([(D + i, 1.0), (H + i, 1.0), (vin, -1.0), (vout, 1.0)], 0.0, np.inf)
    def budget_entries(members: Sequence[int]) -> tuple[list[tuple[int, float]], float]:
        # device bytes kept: save_i * d_i, and a recomputed random op's RNG state
        # rb_i * (1 - x[in_i]) = rb_i - rb_i * x[in_i] (the constant goes to the bound)
        entries = [(D + i, p.save[i]) for i in members
                   if not p.is_input[i] and p.save[i] not in (0, INF)]
        rng = [(2 * i, -p.recompute_bytes[i]) for i in members if i in p.recompute_bytes]
        return entries + rng, sum(p.recompute_bytes[i] for i in members
                                  if i in p.recompute_bytes)

    if budget_bytes is not None:
        entries, shift = budget_entries(range(n))
        if entries:
            row(entries, -np.inf, float(budget_bytes) - shift)
    for members, group_cap in group_caps:
        entries, shift = budget_entries(members)
        if entries:
            row(entries, -np.inf, float(group_cap) - shift)
    a = coo_array((vals, (rows, cols)), shape=(len(rlo), nvar)).tocsr()
    with native_stdout_to_log(get_logger("cut.exact"), "HiGHS"):  # its printf lines
        res = milp(c, integrality=integrality, bounds=Bounds(lo, hi),
                   constraints=LinearConstraint(a, rlo, rhi),
                   options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "disp": False})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    kept, on_host, recomputed = set(), set(), set()
    for i in range(n):
        if p.recompute[i] not in (0, INF) and x[2 * i] == 0:
            recomputed.add(i)
        if x[2 * i] == 1 and x[2 * i + 1] == 0:
            kept.add(i)
            if x[D + i] == 0 or p.save[i] == INF:
                on_host.add(i)
    cost, acts = objective(p, kept, on_host, recomputed)
    if budget_bytes is not None and acts > budget_bytes * (1 + 1e-9) + 1:
        return None
    return ExactSolution(sorted(kept), sorted(on_host), sorted(recomputed), cost, acts,
                         res.status == 0)


def brute_force(p: ExactProblem, budget_bytes: float) -> tuple[float, float] | None:
    """``(K, device bytes)`` of the best cut by enumerating every vertex assignment and
    every device/host choice (tiny problems only: ``2 ** (2n)`` assignments)."""
    n = p.n
    best: tuple[float, float] | None = None
    for bits in itertools.product((0, 1), repeat=2 * n):
        x = list(bits) + [1, 0]
        if any(x[a] > x[b] for a, b in p.structure):
            continue
        recomputed, kept = set(), []
        ok = True
        for i in range(n):
            rec = p.recompute[i]
            if x[2 * i] == 0:
                if rec == INF:
                    ok = False
                    break
                if rec > 0:
                    recomputed.add(i)
            if x[2 * i] == 1 and x[2 * i + 1] == 0:
                if p.save[i] == INF and p.offload[i] == INF:
                    ok = False
                    break
                kept.append(i)
        if not ok:
            continue
        choosable = [i for i in kept if p.save[i] != INF and p.offload[i] != INF]
        forced_host = {i for i in kept if p.save[i] == INF}
        for host_bits in itertools.product((0, 1), repeat=len(choosable)):
            on_host = forced_host | {i for i, b in zip(choosable, host_bits) if b}
            cost, acts = objective(p, set(kept), on_host, recomputed)
            if acts > budget_bytes:
                continue
            if best is None or (cost, acts) < best:
                best = (cost, acts)
    return best
