"""A byte budget holds at every size, not only at the size hints (issue 27).

Under dynamic shapes a split is solved once, at the sizes' hints (the first sizes seen),
and Dynamo reuses it for every size that passes its guards: a budget of N bytes met at
batch 4 was silently exceeded at batch 8 (``PeakBudget(3_000_000)`` on issue 17's stack:
2,555,912 B measured at batch 4, 5,046,280 B at batch 8). Every byte the model counts
grows with the sizes (a tensor's bytes are monotone in each of its dimensions), so a split
whose modelled peak fits at the hints fits at any size up to them. :func:`guard_sizes_up_to_hints`
asks Dynamo for that guard (``size <= hint``) on every symbolic size of the graph's inputs:
a larger size fails it and is compiled again, solved under the budget at its own sizes;
smaller sizes keep the split. A fraction (``0.5``) scales with the sizes and needs none.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph_meta
from ..op_costs import hint

__all__ = ["guard_sizes_up_to_hints"]


def guard_sizes_up_to_hints(gm: fx.GraphModule) -> int:
    """Guard each symbolic size of ``gm``'s inputs at most its hint; returns how many."""
    seen: set[str] = set()
    count = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        val = graph_meta.val(node) if graph_meta.has_val(node) else None
        sizes = [val] if isinstance(val, torch.SymInt) else \
            list(val.shape) if isinstance(val, torch.Tensor) else []
        for size in sizes:
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                continue
            key = str(size.node.expr)
            if key in seen:
                continue
            seen.add(key)
            bound = hint(size, fallback=-1)
            if bound < 0:
                continue
            # bool() of a symbolic comparison is evaluated by the shape environment,
            # which records it as a guard of the compiled frame
            bool(size <= bound)
            count += 1
    return count
