"""The order Inductor's scheduler runs a graph's kernels in after its reordering for peak
memory (``config.reorder_for_peak_memory``, torch's ``_inductor/memory.py``): read off the
FX graph alone, so that :mod:`.inductor_alloc`'s walk is in that order.

After fusing, Inductor estimates the peak of its kernels' buffers in the graph's order,
orders them again greedily ("least peak memory first": of the kernels ready to run, one
whose buffers fit under the peak so far, the one that leaves the least alive; otherwise the
one that allocates the least), and keeps that order where its estimate finds it lower.
Its estimate: every buffer a kernel makes is alive from that kernel to its last reader
(the graph's outputs to the end), and the graph's inputs other than parameters and
tangents (the backward's saved activations) from the start to their last reader. It also
tries a breadth-first and a depth-first order; those depend on the exact graph of its
fused kernels, which the model does not have: on the GPT fixture's backward the model's
breadth-first order estimated 113,248 B against its own order's 114,720, Inductor's
117,536 against 114,720 (it kept its order), so they are left out.

Measured, issue 17's stack (6 blocks, ``relaxed(save_matmuls)``, Inductor), the cut keeping
the least with the region-boundary floor: in the graph's order each block's GELU is
recomputed, its weight gradient taken, and then its backward computed; reordered, the
GELU's backward runs first, so the recomputed GELU (256 KiB) is written in place into the
matrix product it reads, where before it was allocated beside it. The step measured
1,457,928 B; walked in the graph's order the model said 1,649,664 (Inductor's own
estimate before its reordering, to the byte).

A kernel here is a node that allocates a storage (neither computed inside its readers nor
folded into an ``addmm``: ``away``); what a kernel reads is what its inlined values read.
Not modelled: fusions (under our fusion veto, :mod:`.near_fusion`, only kernels next to
each other fuse), which Inductor orders as one.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch.fx as fx

from .inductor_order import schedule
from .storage_walk import Key, Walk, kernel_reads, kernel_storages

__all__ = ["peak_memory_order", "reorders_for_peak_memory"]

#: Graph inputs Inductor never counts as freed (``is_nonfreeable_buffers``): parameters,
#: the forward's inputs, RNG states and tangents.
_NOT_FREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


def reorders_for_peak_memory() -> bool:
    """Whether this torch's Inductor reorders its kernels for its peak estimate."""
    try:
        from ..torch_internals import inductor_config
    except Exception:  # noqa: BLE001 - no Inductor: nothing reorders
        return False
    return bool(getattr(inductor_config, "reorder_for_peak_memory", False))


class _Kernels:
    """The kernels of a walk, their buffers and what each reads (see the module docstring)."""

    def __init__(self, walk: Walk, away: set[Key], counted: Callable[[Key], bool]) -> None:
        self.walk = walk
        # what each kernel allocates, in the walk's order
        self.made = {n: ks for n in walk.nodes
                     if (ks := kernel_storages(walk, n, away, counted))}
        self.order = list(self.made)
        self.index = {n: i for i, n in enumerate(self.order)}
        self.readers: dict[Key, list[fx.Node]] = {}
        self.reads: dict[fx.Node, list[Key]] = {}
        for n in self.order:
            self.reads[n] = [k for k in kernel_reads(walk, n, away)[0] if walk.maker[k] is not n]
            for k in self.reads[n]:
                self.readers.setdefault(k, []).append(n)
        self.maker = {k: n for n, ks in self.made.items() for k in ks}
        self.freeable = [k for k in self.readers if k not in self.maker and
                         walk.maker[k].name in walk.given_names and walk.made_at[k] < 0 and
                         not walk.maker[k].name.startswith(_NOT_FREEABLE) and counted(k)]

    def size(self, k: Key) -> int:
        return self.walk.size[k]

    def estimate(self, order: list[fx.Node]) -> int:
        """Inductor's peak estimate of ``order`` (``estimate_peak_memory``)."""
        step = {n: i for i, n in enumerate(order)}
        delta = [0] * (len(order) + 1)
        outputs = self.walk.outputs
        for k in self.freeable:
            delta[0] += self.size(k)
            if k not in outputs:
                delta[max(step[r] for r in self.readers[k]) + 1] -= self.size(k)
        for n in order:
            for k in self.made[n]:
                delta[step[n]] += self.size(k)
                if k not in outputs:
                    end = max((step[r] for r in self.readers.get(k, ())), default=step[n])
                    delta[end + 1] -= self.size(k)
        peak = live = 0
        for d in delta:
            live += d
            peak = max(peak, live)
        return peak

    def least_peak_first(self) -> list[fx.Node]:
        """Inductor's greedy order (``topological_sort_lpmf``)."""
        preds = self._preds()
        succs: dict[fx.Node, set[fx.Node]] = {n: set() for n in self.order}
        for n, ps in preds.items():
            for p in ps:
                succs[p].add(n)
        indegree = {n: len(ps) for n, ps in preds.items()}
        outputs = self.walk.outputs
        outdegree = {k: len(set(self.readers.get(k, ()))) + (k in outputs)
                     for k in [*self.maker, *self.freeable]}
        size = {n: sum(self.size(k) for k in self.made[n]) for n in self.order}
        pred_buffers = {n: [k for k in dict.fromkeys(self.reads[n]) if k in outdegree]
                        for n in self.order}
        to_free = dict.fromkeys(self.order, 0)
        for n in self.order:
            to_free[n] += sum(self.size(k) for k in pred_buffers[n] if outdegree[k] == 1)
            to_free[n] += sum(self.size(k) for k in self.made[n] if outdegree[k] == 0)
        live = sum(self.size(k) for k in self.freeable)
        most = max(live, sum(self.size(k) for k in outdegree if k in outputs))
        gap = most - live
        ready = [n for n in self.order if indegree[n] == 0]
        out: list[fx.Node] = []
        while ready:
            n = min(ready, key=lambda m: (size[m] if size[m] > gap else 0,
                                          size[m] - to_free[m], self.index[m]))
            ready.remove(n)
            out.append(n)
            live += size[n]
            most = max(most, live)
            live -= to_free[n]
            gap = most - live
            for s in sorted(succs[n], key=self.index.__getitem__):
                indegree[s] -= 1
                if indegree[s] == 0:
                    ready.append(s)
            for k in pred_buffers[n]:
                outdegree[k] -= 1
                if outdegree[k] == 1:
                    for r in set(self.readers[k]):
                        to_free[r] += self.size(k)
        return out if len(out) == len(self.order) else self.order

    def _preds(self) -> dict[fx.Node, set[fx.Node]]:
        return {n: {self.maker[k] for k in self.reads[n] if k in self.maker} - {n}
                for n in self.order}


def peak_memory_order(walk: Walk, away: set[Key], counted: Callable[[Key], bool]
                      ) -> list[fx.Node]:
    """``walk``'s nodes in the order Inductor runs them after its reordering for peak
    memory (``walk.nodes`` itself where it keeps the graph's order); ``away``: the
    storages it does not allocate (computed inside their readers, folded), ``counted``:
    the storages its estimate counts."""
    kernels = _Kernels(walk, away, counted)
    if len(kernels.order) < 2:
        return walk.nodes
    # Inductor keeps the first of the lowest estimates, its own order first
    greedy = kernels.least_peak_first()
    if kernels.estimate(greedy) >= kernels.estimate(kernels.order):
        return walk.nodes
    return _placed(walk.nodes, greedy)


def _placed(nodes: list[fx.Node], kernels: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` with ``kernels`` in that order, each after what it reads (the values it
    computes inside, views) and followed by the items of its value; the rest after."""
    position = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.op == "placeholder"]
    for k in kernels:
        starts += [k, *sorted((u for u in k.users if u.target is operator.getitem and
                               u in position), key=position.__getitem__)]
    return schedule(nodes, {}, [*starts, *nodes])
