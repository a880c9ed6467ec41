"""The order Inductor runs a graph's kernels in, as far as its horizontal fusion moves them
(:mod:`.inductor_alloc`'s walk is in this order): read off the FX graph alone.

Inductor's scheduler fuses two kernels that depend on neither each other (horizontally)
when they read the same storage, loop over as many elements, and are at most 64 kernels
apart (``are_long_distant_nodes``); the best-scoring pairs first (the bytes they share, then
the nearer). A fused kernel runs where its earliest member ran, after everything any
member needs (``topological_sort_schedule``): what a later member reads is made earlier,
and what reads an earlier member waits for the later one. Measured on the bench models:
GPT-2's backward recomputes a layer's attention scores (2 MiB) in the next layer's
softmax kernel (both read the mask); Llama's recomputed RMSNorm output, read by the
logits' weight gradient, is made in the kernel of the norm's backward, after the input
gradient's matmul. Not modelled: vertical fusions (a kernel with its reader: they move
little). Inductor's reordering for its own peak estimate, after fusion, is
:mod:`.peak_memory_order`'s. Our backend's fusion veto
(:mod:`.near_fusion`) refuses these moves where they keep bytes alive: the model walks in
this order only on a torch without the veto's hooks.
"""
from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from .. import graph_meta
from .storage_walk import Key, Walk, kernel_reads, kernel_storages

__all__ = ["inductor_order", "schedule"]

WINDOW = 64      # config.max_fusion_buffer_group_pairwise_attempts, are_long_distant_nodes
MAX_FUSED = 64   # config.max_fusion_size
MIN_SHARED = 10  # config.score_fusion_memory_threshold (bytes)


def _numel(n: fx.Node) -> int | None:
    val = graph_meta.val(n) if graph_meta.has_val(n) else None
    if isinstance(val, (list, tuple)) and val:
        val = val[0]
    return val.numel() if hasattr(val, "numel") else None


def inductor_order(walk: Walk, away: set[Key], fusible: Callable[[fx.Node], bool]
                   ) -> list[fx.Node]:
    """``walk``'s nodes in the order Inductor's horizontal fusion runs them (see the
    module docstring); ``away``: the storages computed inside the kernels that read them."""
    nodes = walk.nodes
    kernels = [n for n in nodes if kernel_storages(walk, n, away)]
    index = {n: i for i, n in enumerate(kernels)}
    # ancestors (kernels) of every node, as bit sets; what each kernel reads, through the
    # values it computes inside; how many elements it loops over
    above: dict[fx.Node, int] = {}
    reads: dict[fx.Node, set[Key]] = {}
    loop: dict[fx.Node, int | None] = {}
    for n in nodes:
        mask = 0
        for a in n.all_input_nodes:
            mask |= above.get(a, 0) | (1 << index[a] if a in index else 0)
        above[n] = mask
        if n in index and fusible(n):
            found, seen = kernel_reads(walk, n, away)
            # a reduction loops over its input
            reads[n] = set(found)
            loop[n] = max([_numel(n) or 0, *(_numel(a) or 0 for a in seen)])
    by_storage: dict[Key, list[fx.Node]] = {}
    for n in kernels:
        for k in reads.get(n, ()):
            by_storage.setdefault(k, []).append(n)
    pairs: dict[tuple[fx.Node, fx.Node], int] = {}
    for k, readers in by_storage.items():
        for i, a in enumerate(readers):
            for b in readers[i + 1:i + 1 + WINDOW]:
                if index[b] - index[a] > WINDOW or loop[a] != loop[b] or \
                        above[b] >> index[a] & 1:
                    continue
                pairs[a, b] = pairs.get((a, b), 0) + walk.size[k]
    group = {n: [n] for n in kernels}
    ancestry = {n: above[n] for n in kernels}  # a group's ancestors
    bits = {n: 1 << index[n] for n in kernels}
    fused: dict[int, list[fx.Node]] = {}  # the groups of more than one, by their bits
    # Ties by the pair's place in the walk, never by ``pairs``' order: that follows sets of
    # storage keys (``reads``), whose order is the strings' hashes', which differ from one
    # process to the next (PYTHONHASHSEED), and so would the fusions and the peak modelled.
    for (a, b), shared in sorted(pairs.items(), key=lambda p: (-p[1], index[p[0][1]] -
                                                               index[p[0][0]],
                                                               index[p[0][0]])):
        ga, gb = group[a], group[b]
        if shared < MIN_SHARED or ga is gb or len(ga) + len(gb) > MAX_FUSED:
            continue
        members = ga + gb
        if max(index[m] for m in members) - min(index[m] for m in members) > WINDOW:
            continue
        if _reaches(ga, gb, fused, ancestry, bits) or _reaches(gb, ga, fused, ancestry, bits):
            continue
        members.sort(key=index.__getitem__)
        anc = ancestry[ga[0]] | ancestry[gb[0]]
        bit = bits[ga[0]] | bits[gb[0]]
        fused.pop(bits[ga[0]], None)
        fused.pop(bits[gb[0]], None)
        fused[bit] = members
        for m in members:
            group[m] = members
            ancestry[m], bits[m] = anc, bit
    if not fused:
        return nodes
    return schedule(nodes, group)


def _reaches(src: list[fx.Node], dst: list[fx.Node], fused: dict[int, list[fx.Node]],
             ancestry: dict[fx.Node, int], bits: dict[fx.Node, int]) -> bool:
    """Whether group ``dst`` depends on group ``src``, also through a fused group (one of
    whose members ``dst`` depends on runs with the others)."""
    target, seen, todo = bits[src[0]], 0, ancestry[dst[0]]
    while todo & ~seen:
        if todo & target:
            return True
        seen |= todo
        for b, g in fused.items():
            if b & todo and not b & target:
                todo |= ancestry[g[0]]
    return False


def schedule(nodes: list[fx.Node], group: dict[fx.Node, list[fx.Node]],
             starts: list[fx.Node] | None = None) -> list[fx.Node]:
    """``nodes`` placed from ``starts`` (by default ``nodes``) in turn, each fused group
    where its earliest member was, after what its members read (inputs in ``nodes``'
    order); the graph's output last."""
    placed: set[fx.Node] = set()
    opened: set[fx.Node] = set()  # (a cycle cannot happen: fusions that make one are refused)
    out: list[fx.Node] = []
    position = {n: i for i, n in enumerate(nodes)}
    for start in nodes if starts is None else starts:
        if start.op == "output":
            continue
        stack: list[tuple[fx.Node, bool]] = [(start, False)]
        while stack:
            n, ready = stack.pop()
            if n in placed:
                continue
            members = group.get(n, [n])
            if ready:
                for m in members:
                    if m not in placed:
                        placed.add(m)
                        out.append(m)
                continue
            if n in opened:
                continue
            opened.add(n)
            stack.append((n, True))
            inputs = {a for m in members for a in m.all_input_nodes
                      if a not in placed and a in position and a not in members}
            stack.extend((a, False) for a in sorted(inputs, key=position.__getitem__,
                                                    reverse=True))
    out.extend(n for n in nodes if n.op == "output")
    return out
