"""A whole-model byte budget over graphs that each hold some of its blocks: blocks compiled
one by one (torchtitan's order, ``block.compile(fullgraph=True)`` per layer), or a model
compiled with graph breaks between its blocks.

The graphs arrive one at a time - block 0's compile happens before block 1's graph exists
- so the price per byte cannot be found from all of them at once. What is known from the
start is each block's *kind* (:func:`.region.module_kind`: class, parameter
shapes, submodules), so how many blocks of each kind the model has:

* **One kind** (identical blocks, the common case): one price over N identical networks
  switches them all at the same price, and blocks sharing one split cannot switch one at a
  time (as :mod:`.shared`'s regions do in the last price interval), so each block's
  share is the budget over N. The kind's one compiled graph is cut at ``budget / N`` per
  block it holds (the exact program: the cheapest cut within it) - one Dynamo compile, one
  partition, the total within the budget, at once.
* **Several kinds**: a kind's first graph is cut at the even split (``budget / N`` per
  block: the total is within the budget whatever the other kinds keep) and its network
  is recorded here. Once every kind was recorded, the price is found over them, each kind
  weighted by its number of blocks (:func:`price_over_kinds`), and each kind's share per
  block is that price's. The kinds cut at the even split are compiled once more at the
  next call of the model (:class:`sac_compile.region_steps.BudgetStep` changes their
  tokens between steps, so no step mixes the two splits): two compiles per kind, said in
  the log and counted in ``ModelBudget.recompiles``.

A block the model calls more than once per step runs its graph that many times: each call
keeps its share. The graphs' runs are counted per kind and step
(:mod:`sac_compile.compiler.budget_runs`); when a step made more calls of a kind than it
has blocks (:meth:`.ModelBudget.count_step`, at the next call of the model), the shares are
over the calls: that step kept more than the budget (said in a warning), and the kinds are
compiled again at the next call, as above. A block that a step skips keeps its share
reserved: the split is over the blocks, never fewer, so a block first run in a later step
finds its share.

The alternative - an eager first step that records every block before compiling - would
run the first step uncompiled whatever the user asked, and cannot see what only a compiled
graph holds; recording at the partition sees the very network the split is made on.
"""
from __future__ import annotations

import dataclasses

from ..cut.exact import ExactProblem
from ..cut.network import FlowNetwork
from .model import ModelBudget
from .search import bisect_price, cut_at, least_price, other_cost
from .unreachable import unreachable_error
from .values import budget_label

__all__ = ["graph_cap", "price_over_kinds"]


@dataclasses.dataclass
class KindNet:
    """A kind's recorded graph: its network, the indices of its blocks' values in it and
    how many of its blocks the graph holds."""

    net: FlowNetwork
    members: set[int]
    count: int


def graph_cap(net: FlowNetwork, model: ModelBudget, by_name: dict[str, set[int]],
              solver: str | None = None) -> tuple[float, bool, str]:
    """The cap on the bytes the blocks of ``model`` in this graph keep (``by_name``: the
    indices of each block's values), whether it is the even split before the price (then
    a cap below the least the blocks can keep is raised to it), and a line for the
    report. Records the graph's kinds and finds the price once every kind is recorded."""
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
            model.record_kinds(
                {kind: KindNet(net, set().union(*(by_name[name] for name in names)),
                               len(names)) for kind, names in kinds.items()},
                lambda nets: price_over_kinds(model, nets, solver), even)
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


def price_over_kinds(model: ModelBudget, kinds: dict[str, KindNet],
                     solver: str | None = None) -> dict[str, float]:
    """Each kind's bytes per call at the largest price per byte ``w`` at which all the
    blocks together (each kind counted as often as a step calls it) keep at
    most the budget: the Lagrangian cut of each kind's network (``kinds``) at one ``w``,
    as :func:`.shared.solve_shared_price` does for networks of their own.
    :class:`~sac_compile.errors.BudgetUnreachableError` when even the least the blocks can
    keep is above it."""
    problems = {k: ExactProblem.from_network(kn.net) for k, kn in kinds.items()}

    def per_block(w: float) -> dict[str, float]:
        out = {}
        for k, kn in kinds.items():
            net = kn.net
            cut = cut_at(net, problems[k], w, solver)
            idx = net.cls.index
            kept = [v for v in cut.kept if idx[v] in kn.members]
            nbytes = sum(net.device_bytes(kept, cut.w)) + sum(
                net.recompute_bytes.get(i, 0.0) for i in cut.recomputed if i in kn.members)
            out[k] = nbytes / kn.count
        return out

    def total(shares: dict[str, float]) -> float:
        return sum(model.calls_of(k) * b for k, b in shares.items())

    cap = float(model.nbytes)
    free = per_block(1.0)
    if total(free) <= cap:  # (each kind's split then keeps what it keeps without a budget)
        return free
    w_min = least_price(max(other_cost(kn.net) for kn in kinds.values()))
    least = per_block(w_min)
    if total(least) > cap * (1 + 1e-9) + 1:
        raise unreachable_error(
            f"the whole-model memory budget {budget_label(model.nbytes)} of apply_regions",
            f"the least its {len(model.members)} blocks can keep together is "
            f"{int(total(least)):,} B, with everything recomputed or offloaded that may be",
            ["relax the policy's MUST_SAVE decisions to PREFER_SAVE "
             "(policies.relaxed(policy))"],
            budget=model.nbytes, least=total(least), unconstrained=total(free))
    best, _, _ = bisect_price(per_block, lambda shares: total(shares) <= cap, w_min,
                              least, free)
    # A kind's blocks share one split, so they cannot switch one at a time in the last price
    # interval (as .shared's regions do): the slack left is poured evenly over the
    # blocks of the kinds still below what they keep without a budget, and each kind's
    # exact program may spend it.
    for _ in range(len(kinds)):
        open_kinds = [k for k in best if best[k] < free[k]]
        slack = cap - total(best)
        if not open_kinds or slack < 1:
            break
        add = slack / sum(model.calls_of(k) for k in open_kinds)
        best = {k: min(free[k], b + add) if k in open_kinds else b for k, b in best.items()}
    return best
