"""Inductor's ``addmm`` fold, kept apart where it would hold more memory.

Inductor's post-grad pattern computes a matrix product read only by an ``add`` as one
``addmm`` *where the add runs*: the product moves down to the add, and its operands stay
alive until then. In a backward that is often far: a weight used twice (GPT-2's tied
embedding, a block that runs twice per step) gets its gradient as the sum of two
products, and the first product's operands - activation-sized, the logits' gradient for a
tied embedding (8 MiB at the bench size, vocab x tokens at real sizes) - are held across
the whole backward instead of the weight-sized product. Measured on HF GPT-2 (bench,
every block recomputed, compiled whole): the step's peak 31.84 MB, the logits' gradient
alive from the head's backward to the embedding's.

Kept apart (:func:`kept_apart`): where the add runs after every other reader of the
product's operands, and the operands that then die (made in the graph: kept values and
parameters are not counted) outweigh the product's own storage, the product runs right
after those readers and the add is written as ``prims.add``, which Inductor lowers and
fuses as ``aten.add`` but which its pattern (``aten.add`` of an ``aten.mm``) does not
match. At no point does that hold more than the fold. Same values: an add of the same two
tensors, as eager's autograd sums a gradient over two uses. Only where shapes and dtypes
agree (``prims.add`` does not broadcast or promote). The peak model (:mod:`.inductor_alloc`)
folds by the same rule, so it models the graph Inductor gets.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph_meta
from .storage_walk import Key, Walk

__all__ = ["foldable", "keep_products_apart", "kept_apart"]

_aten, _prims = torch.ops.aten, torch.ops.prims


def kept_apart(walk: Walk) -> dict[fx.Node, int]:
    """The products of ``walk`` to keep apart from their adds -> the position after which
    each then runs (in ``walk``'s order and last uses, before any fold extends them): a
    product of :func:`foldable` whose add runs later than its operands' other readers, the
    operands that die there (made in the walk, not returned) outweighing the product. Run
    right after those readers and added apart, it holds at every point no more than the
    fold: before, neither has run; from there to the add, its own storage against the
    operands the fold would hold."""
    pairs = foldable(walk)
    if not pairs:
        return {}
    pos = {n: i for i, n in enumerate(walk.nodes)}
    readers: dict[Key, list[fx.Node]] = {}
    for n in walk.nodes:
        for a in n.all_input_nodes:
            for k in walk.keys.get(a, ()):
                if k is not None:
                    readers.setdefault(k, []).append(n)
    out = {}
    for product, add, other in pairs:
        mine = walk.keys.get(product, ())
        if len(mine) != 1 or mine[0] is None or product not in pos or add not in pos:
            continue
        val, inp = graph_meta.val(product), graph_meta.val(other)
        if tuple(inp.shape) != tuple(val.shape) or inp.dtype != val.dtype:
            continue  # (prims.add would not broadcast or promote: the fold stays)
        after, freed = max(pos.get(a, -1) for a in product.all_input_nodes), 0
        for k in {k for a in product.all_input_nodes for k in walk.keys.get(a, ())
                  if k is not None}:
            last = max((pos[r] for r in readers.get(k, ()) if r is not product), default=-1)
            if k[0] in walk.given_names or k in walk.outputs or last >= pos[add]:
                continue  # alive at the add either way
            freed += walk.size[k]
            after = max(after, last)
        between = pos[add] - after - 1 - (after < pos[product] < pos[add])
        if freed > walk.size[mine[0]] and between > 0:  # (none: the fold holds nothing)
            out[product] = after
    return out


def keep_products_apart(gm: fx.GraphModule) -> int:
    """Rewrites ``gm`` (a split's forward or backward, before Inductor compiles it): each
    product :func:`kept_apart` names runs where it says, and its add is ``prims.add``.
    Returns how many."""
    nodes = list(gm.graph.nodes)
    walk = Walk(nodes, given=[n for n in nodes if n.op == "placeholder"])
    apart = kept_apart(walk)
    for product, after in apart.items():
        walk.nodes[after].append(product)  # (moves it: right after its operands' readers)
        (add,) = product.users
        add.target = _prims.add.default
    if apart:
        gm.graph.lint()
        gm.recompile()
    return len(apart)


def foldable(walk: Walk) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(product, add, the add's other operand) of of ``walk`` that Inductor's pattern matches: an ``mm`` read
    only by an ``aten.add.Tensor`` of two tensors, no alpha; of two products added, the
    second (Inductor's pattern with the product second matches first)."""
    out = []
    for n in walk.nodes:
        if n.target is not _aten.mm.default or len(n.users) != 1 or \
                n.name in walk.given_names or not graph_meta.has_val(n):
            continue
        (add,) = n.users
        if add.target is not _aten.add.Tensor or add.kwargs or len(add.args) != 2:
            continue
        other = _other(add, n)
        if other is None:
            continue
        if add.args[0] is n and other.target is _aten.mm.default and len(other.users) == 1:
            continue  # the other product is the one folded
        out.append((n, add, other))
    return out


def _other(add: fx.Node, product: fx.Node) -> fx.Node | None:
    other = add.args[1] if add.args[0] is product else add.args[0]
    if other is product or not isinstance(other, fx.Node) or not graph_meta.has_val(other) \
            or not isinstance(graph_meta.val(other), torch.Tensor):
        return None
    return other
