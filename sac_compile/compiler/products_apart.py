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

Kept apart where it lowers the step's peak: where the add runs after every other reader
of the product's operands and the operands that then die (made in the graph: kept values
and parameters are not counted) outweigh the product (:func:`candidates`), the product can
run right after those readers. From there to the add that holds less than the fold; at the
product's own run it holds its storage beside its operands, more than the fold does there.
So the peak model (:func:`.inductor_alloc.not_allocated`) keeps a candidate apart only where
the fold's peak lies between the two and the product's run stays below it; the partitioner
then moves the product and writes the add as ``prims.add``, which Inductor lowers and fuses
as ``aten.add`` but which its pattern (``aten.add`` of an ``aten.mm``) does not match
(:func:`keep_products_apart`). Same values: an add of the same two tensors, as eager's
autograd sums a gradient over two uses. Only where shapes and dtypes agree (``prims.add``
does not broadcast or promote). Without regions (every activation kept, the backward's
peak at its start) the fold stays: there the product's early run would raise the peak.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph_meta
from .storage_walk import Key, Walk

__all__ = ["candidates", "foldable", "keep_products_apart", "moved"]

_aten, _prims = torch.ops.aten, torch.ops.prims


def candidates(walk: Walk) -> dict[fx.Node, fx.Node]:
    """The products of ``walk`` (its order and last uses, before any fold extends them)
    that could be kept apart from their adds -> the node right after which each would
    run: a product of :func:`foldable` whose add runs later than its operands' other
    readers (nodes between), the operands that die there (made in the walk, not returned)
    outweighing the product. From that node to the add the fold holds those operands, apart
    the product's storage: less. At the product's own run apart holds its storage beside
    its operands, which the fold does at the add: more, if the walk is near its peak then
    (:func:`.inductor_alloc.not_allocated` decides on the walk's peak)."""
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
        if freed > walk.size[mine[0]] and between > 0 and after >= 0:
            out[product] = walk.nodes[after]
    return out


def moved(nodes: list[fx.Node], apart: dict[fx.Node, fx.Node]) -> list[fx.Node]:
    """``nodes`` with each product of ``apart`` right after its node."""
    seq = [n for n in nodes if n not in apart]
    for product, after in apart.items():
        seq.insert(seq.index(after) + 1, product)
    return seq


def keep_products_apart(gm: fx.GraphModule, apart: dict[str, str]) -> int:
    """Rewrites ``gm`` (a split's forward or backward, before Inductor compiles it): each
    product named in ``apart`` (product -> the node right after which it runs, as
    :func:`.inductor_alloc.not_allocated` decided on the split's walks) runs there, and its
    add is ``prims.add``. Returns how many."""
    if not apart:
        return 0
    by_name = {n.name: n for n in gm.graph.nodes}
    for product, after in apart.items():
        node = by_name[product]
        by_name[after].append(node)  # (moves it)
        (add,) = node.users
        add.target = _prims.add.default
    gm.graph.lint()
    gm.recompile()
    return len(apart)


def foldable(walk: Walk) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(product, add, the add's other operand) in ``walk`` that Inductor's pattern matches:
    an ``mm`` read only by an ``aten.add.Tensor`` of two tensors, no alpha; of two products
    added, the second (Inductor's pattern with the product second matches first)."""
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
