"""Under Inductor, keep the values the forward allocates anyway rather than those it would
fuse away (issue 17: the forward graph's own peak).

Why: Inductor computes a fusible op whose readers are all fusible inside the kernels that
read it, and never allocates it - unless the forward hands it to the backward. The cut
prices a kept value by its bytes alone, so where two values of one size can be kept (the
logits a matmul makes, or the ``log_softmax`` of them that a fused cross-entropy never
writes out; the backward recomputes the other from the one kept) it takes the one that
needs no recompute: under Inductor that one is an extra buffer, alive from where it is made
to the forward's end, next to the value it was computed from (Hugging Face GPT-2 and Llama,
each decoder layer a region: +8 MiB, the forward's peak above torch's partitioner's, which
saves the logits).

What: after each solve (the plain one, and the floored one of :mod:`.boundaries`), each
kept value that Inductor would otherwise not allocate (:func:`fused_away_saves`; largest first, a few) is
banned from being kept (and, where the cut keeps another such value in its place, that
one too, a few rounds), the network solved again, and the new cut taken where the peak
model *as Inductor allocates* (:func:`.peak.cut_peaks` with ``fused=True``) is lower: the
forward and backward peaks together lower, the larger of them not higher by more than
1/256 (the small values kept instead, a softmax's max and sum, count in the backward too:
+1 KiB against -512 KiB in the forward in ``tests/test_fused_saves.py``). Elsewhere
the cut stays the cheapest one, so kept bytes and recompute FLOPs change only where the
peak asks for it. Only with ``compiler="inductor"`` (what Inductor passes the partitioner);
``aot_eager`` allocates every value.
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import TypeVar

import torch.fx as fx

from ..cut import costs
from ..cut.network import INF, FlowNetwork
from ..policy import CheckpointError
from .facts import Unfused
from .peak import cut_peaks
from .storage_walk import read_only_by_fusible, storage_base

__all__ = ["fused_away_saves", "solve_allocating_less"]

R = TypeVar("R")
TRIES = 3   # candidates tried per solve
ROUNDS = 6  # solves per candidate (each one more max-flow and peak walk)
SLACK = 1 / 256


def fused_away_saves(net: FlowNetwork, kept: list[fx.Node]) -> list[fx.Node]:
    """The kept values Inductor would not allocate in the forward were they not kept (or
    views of such values): made by a fusible op, read in the forward only by fusible ops
    (through views), not a forward output, and recomputable (so the backward can have
    them otherwise)."""
    from ..torch_internals import get_default_op_list

    fusible = get_default_op_list().is_fusible
    cls = net.cls
    outputs = {o for o in cls.fwd_outputs if isinstance(o, fx.Node)}
    out = []
    for v in kept:
        b = storage_base(v)  # a kept view keeps its base
        i = cls.index.get(b)
        if i is None or b.op != "call_function" or v in outputs or b in outputs or \
                b.target is operator.getitem or net.recompute_cost[i] == INF or \
                not fusible(b):
            continue
        if read_only_by_fusible(b, cls.index, fusible):
            out.append(v)
    return out


def _banned(net: FlowNetwork, nodes: set[fx.Node]) -> FlowNetwork:
    idx = net.cls.index
    save, offload = list(net.save_cost), list(net.offload_cost)
    for v in nodes:
        save[idx[v]] = offload[idx[v]] = INF
    return dataclasses.replace(net, save_cost=save, offload_cost=offload)


def _lower(peaks: tuple[int, int], than: tuple[int, int]) -> bool:
    """The forward and backward peaks together lower, the larger of them not higher by
    more than ``SLACK`` of itself (the few small values kept instead: a softmax's max and
    sum beside its input)."""
    return sum(peaks) < sum(than) and max(peaks) <= max(than) * (1 + SLACK)


def solve_allocating_less(gm: fx.GraphModule, net: FlowNetwork, res: R,
                          solve: Callable[[FlowNetwork], R],
                          kept_of: Callable[[R], list[fx.Node]]) -> tuple[R, Unfused]:
    """``res`` (the solve of ``net``), or the solve of ``net`` with some of its kept values
    Inductor would fuse away banned from being kept, where that lowers the peak as Inductor
    allocates (see the module docstring)."""
    cls = net.cls
    kept = first = kept_of(res)
    before = best = cut_peaks(gm.graph, cls, kept, fused=True)
    banned: set[fx.Node] = set()
    tried: set[fx.Node] = set()
    for _ in range(TRIES):
        todo = [v for v in fused_away_saves(net, kept) if v not in tried]
        if not todo:
            break
        v = max(todo, key=lambda n: (costs.nbytes(n), -cls.index[n]))
        ban, start = banned | {v}, set(kept)
        for _ in range(ROUNDS):  # the cut may keep another such value in v's place
            tried |= ban
            try:
                trial = solve(_banned(net, ban))
            except CheckpointError:  # e.g. a budget that cannot be met without them
                break
            trial_kept = kept_of(trial)
            peaks = cut_peaks(gm.graph, cls, trial_kept, fused=True)
            if _lower(peaks, best):
                res, kept, best, banned = trial, trial_kept, peaks, ban
            instead = set(fused_away_saves(net, trial_kept)) - start
            if not instead:
                break
            ban = ban | instead
    if not banned:
        return res, Unfused()
    dropped = tuple(v for v in first if v in banned and v not in set(kept))
    return res, Unfused(dropped, sum(costs.nbytes(v) for v in dropped), before, best)
