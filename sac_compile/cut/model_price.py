"""A whole-model byte budget over graphs that each hold some of its blocks: blocks compiled
one by one (torchtitan's order, ``block.compile(fullgraph=True)`` per layer), or a model
compiled with graph breaks between its blocks.

The graphs arrive one at a time - block 0's compile happens before block 1's graph exists
- so the price per byte cannot be found from all of them at once. What is known from the
start is each block's *kind* (:func:`sac_compile.budgets.module_kind`: class, parameter
shapes, submodules), so how many blocks of each kind the model has:

* **One kind** (identical blocks, the common case): one price over N identical networks
  switches them all at the same price, and blocks sharing one split cannot switch one at a
  time (as :mod:`.shared_budget`'s regions do in the last price interval), so each block's
  share is the budget over N. The kind's one compiled graph is cut at ``budget / N`` per
  block it holds (the exact program: the cheapest cut within it) - one Dynamo compile, one
  partition, the total within the budget, at once.
* **Several kinds**: a kind's first graph is cut at the even split (``budget / N`` per
  block: the total is within the budget whatever the other kinds keep) and its network
  is recorded here. Once every kind was recorded, the price is found over them, each kind
  weighted by its number of blocks (:func:`price_over_kinds`), and each kind's share per
  block is that price's. The kinds cut at the even split are compiled once more at the
  next call of the model (:class:`sac_compile.regions.BudgetStep` changes their
  tokens between steps, so no step mixes the two splits): two compiles per kind, said in
  the log and counted in ``ModelBudget.recompiles``.

A block the model calls more than once per step runs its graph that many times: each call
keeps its share. The graphs' runs are counted per kind and step
(:mod:`sac_compile.compiler.budget_runs`); when a step made more calls of a kind than it has
blocks (:func:`count_step`, at the next call of the model), the shares are over the calls:
that step kept more than the budget (said in a warning), and the kinds are compiled again
at the next call, as above. A block that a step skips keeps its share reserved: the split
is over the blocks, never fewer, so a block first run in a later step finds its share.

The alternative - an eager first step that records every block before compiling - would
run the first step uncompiled whatever the user asked, and cannot see what only a compiled
graph holds; recording at the partition sees the very network the split is made on.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .budget import BISECT_STEPS, TILT, _cut
from .network import INF, FlowNetwork
from .solvers import source_side

__all__ = ["graph_cap", "price_over_kinds", "count_step"]


@dataclasses.dataclass
class KindNet:
    """A kind's recorded graph: its network, the indices of its blocks' values in it and
    how many of its blocks the graph holds."""

    net: FlowNetwork
    members: set[int]
    count: int


def graph_cap(net: FlowNetwork, model: Any, by_name: dict[str, set[int]],
              solver: str | None = None) -> tuple[float, bool, str]:
    """The cap on the bytes the blocks of ``model`` in this graph keep (``by_name``: the
    indices of each block's values), whether it is the even split before the price (then
    a cap below the least the blocks can keep is raised to it), and a line for the
    report. Records the graph's kinds and finds the price once every kind is recorded."""
    from ..budgets import budget_label
    n = model.step_calls()
    even = model.nbytes / n
    over = f"{n} blocks" if n == len(model.members) else \
        f"{n} calls of {len(model.members)} blocks"
    kinds: dict[str, list[str]] = {}
    for name in by_name:
        kinds.setdefault(model.kind_of(name), []).append(name)
    with model.lock:
        shares = model.kind_share
        single = len(set(model.kinds)) == 1
        if not single and shares is None:
            for kind, names in kinds.items():
                if kind not in model.kind_nets:
                    members = set().union(*(by_name[name] for name in names))
                    model.kind_nets[kind] = KindNet(net, members, len(names))
            model.provisional |= set(kinds)
            if set(model.kind_nets) >= set(model.kinds):
                found = price_over_kinds(model, solver)
                model.kind_share = found
                model.kind_nets = {}  # (the networks hold their graphs)
                model.rekey |= {k for k in model.provisional if abs(found[k] - even) >= 1}
        # A kind still waiting for its new token (BudgetStep) stays at the even split in
        # any graph made before then: no step mixes the two splits of a kind.
        if single or shares is None or set(kinds) & model.rekey:
            cap = even * len(by_name)
            how = (f"{len(set(model.kinds))} kinds: the even split until every kind was "
                   f"compiled (then the price per byte over the kinds; these blocks compile "
                   f"once more at their share)") if not single else \
                "identical blocks, one split: each the same share"
            line = (f"whole-model memory budget {budget_label(model.nbytes)} over {over}; "
                    f"this graph's {len(by_name)} at {budget_label(int(even))} each, "
                    f"{budget_label(int(cap))} ({how})")
            return cap, not single, line
        cap = sum(shares[model.kind_of(name)] for name in by_name)
    return cap, False, (
        f"whole-model memory budget {budget_label(model.nbytes)} over {over} of "
        f"{len(shares)} kinds; this graph's {len(by_name)} at their shares at the price "
        f"per byte ({', '.join(f'{budget_label(int(s))}' for s in shares.values())} per "
        f"block of each kind), {budget_label(int(cap))}")


def price_over_kinds(model: Any, solver: str | None = None) -> dict[str, float]:
    """Each kind's bytes per call at the largest price per byte ``w`` at which all the
    blocks together (each kind counted as often as a step calls it) keep at
    most the budget: the Lagrangian cut of each kind's network at one ``w``, as
    :func:`.shared_budget.solve_shared_price` does for networks of their own.
    ``CompiledCheckpointError`` when even the least the blocks can keep is above it."""
    from ..errors import CompiledCheckpointError
    from ..budgets import budget_label
    from .exact import ExactProblem, objective

    kinds = dict(model.kind_nets)
    problems = {k: ExactProblem.from_network(kn.net) for k, kn in kinds.items()}

    def per_block(w: float) -> dict[str, float]:
        out = {}
        for k, kn in kinds.items():
            net = kn.net
            edges = None if w == 1.0 else net.capacities(w, TILT)
            cut = _cut(net, problems[k], objective, source_side(net, solver, edges=edges), w)
            idx = net.cls.index
            kept = [v for v in cut.kept if idx[v] in kn.members]
            nbytes = sum(net.device_bytes(kept, cut.w)) + sum(
                net.recompute_bytes.get(i, 0.0) for i in cut.recomputed if i in kn.members)
            out[k] = nbytes / kn.count
        return out

    def total(shares: dict[str, float]) -> float:
        return sum(model.calls_of(k) * b for k, b in shares.items())

    cap = float(model.nbytes)
    best = per_block(1.0)
    if total(best) <= cap:  # (each kind's split then keeps what it keeps without a budget)
        return best
    other = max(sum(c for i, v in enumerate(kn.net.cls.nodes)
                    for c in (kn.net.recompute_cost[i], kn.net.offload_cost[i],
                              kn.net.save_cost[i] if v.op == "placeholder" else 0.0)
                    if c not in (0, INF)) for kn in kinds.values())
    w_min = min(0.5 / other, 1e-3) if other > 0 else 1e-3
    best = per_block(w_min)
    if total(best) > cap * (1 + 1e-9) + 1:
        raise CompiledCheckpointError(
            f"sac_compile: the whole-model memory budget {budget_label(model.nbytes)} of "
            f"apply_regions cannot be met: the least its {len(model.members)} blocks can keep "
            f"together is {int(total(best)):,} B, with everything recomputed or offloaded that "
            f"may be. To fix: raise the budget to at least that, or relax the policy's "
            f"MUST_SAVE decisions to PREFER_SAVE (policies.relaxed(policy))")
    lo, hi = math.log(w_min), 0.0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        shares = per_block(math.exp(mid))
        if total(shares) <= cap:
            lo, best = mid, shares
        else:
            hi = mid
    # A kind's blocks share one split, so they cannot switch one at a time in the last price
    # interval (as shared_budget's regions do): the slack left is poured evenly over the
    # blocks of the kinds still below what they keep without a budget, and each kind's
    # exact program may spend it.
    free = per_block(1.0)
    for _ in range(len(kinds)):
        open_kinds = [k for k in best if best[k] < free[k]]
        slack = cap - total(best)
        if not open_kinds or slack < 1:
            break
        add = slack / sum(model.calls_of(k) for k in open_kinds)
        best = {k: min(free[k], b + add) if k in open_kinds else b for k, b in best.items()}
    return best


def count_step(model: Any) -> set[str]:
    """A step is over (the model is called again): the kinds whose compiled graphs made
    more region calls in it than the split assumed. Their calls are learnt, a warning says
    the step kept more than the budget, and the kinds to compile again are returned (all of
    them when several kinds were priced: the price is found again over the new counts)."""
    import logging
    from ..budgets import budget_label
    with model.lock:
        runs, model.graph_runs = dict(model.graph_runs), type(model.graph_runs)()
        more = {k: n for k, n in runs.items() if n > model.calls_of(k)}
        if not more:
            return set()
        before = model.step_calls()
        model.calls.update(more)
        kinds = {k for k in set(model.kinds) if model.count(k)}
        if len(kinds) > 1:  # the price over the kinds is stale: the even split, then again
            model.kind_share, model.kind_nets, model.provisional = None, {}, set()
            again = kinds
        else:
            again = set(more)
        model.rekey |= again
        after = model.step_calls()
    logging.getLogger("sac_compile").warning(
        "sac_compile: whole-model memory budget %s: the step that ended made %s - more "
        "calls than the %d its compiled blocks' split assumed, each keeping a block's "
        "share: that step kept more than the budget (above the budget by up to the extra "
        "calls' shares). The blocks are compiled once more at the next call of the model, "
        "for %d calls per step", budget_label(model.nbytes),
        ", ".join(f"{n} calls of {model.count(k)} block{'s' if model.count(k) > 1 else ''} "
                  f"of one kind" for k, n in more.items()), before, after)
    return again
