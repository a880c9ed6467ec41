"""A byte budget under dynamic shapes: the cut holds for sizes up to those it was chosen at.

Under ``torch.compile(dynamic=True)`` (or once Dynamo marks a size dynamic) the joint graph
has symbolic sizes, and the partitioner prices every value at its size *hint*, the sizes of
the call that compiled it. The cut chosen keeps at most the budget at those sizes; the same
cut run at a larger batch keeps proportionally more, with no word.

Three ways out were weighed:

* a cut valid for every size: a fixed byte budget is met at all sizes only by keeping no
  size-dependent value at all, far below what the budget allows at the hint;
* specialising (a guard ``size == hint``): correct, but every new size compiles again;
* **a range**: a guard ``size <= hint`` on each dimension of the values the budget covers.
  A value's bytes are the product of its dimensions, so no dimension above its hint means
  no value above its priced bytes, and the cut keeps at most what it kept at the hint: the
  budget holds for every smaller call too. A larger call fails the guard and Dynamo
  compiles again, at its sizes (a new hint, a new cut within the budget). Chosen.

The guards are added to the shape environment while the partitioner runs (after Dynamo's
own guards were made, as Inductor's are): Dynamo installs them with the graph. Unbacked
sizes (data-dependent) cannot be guarded and are left; the report says so.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx

from .. import graph_meta

__all__ = ["guard_sizes_at_most_hints"]


def guard_sizes_at_most_hints(values: Iterable[fx.Node]) -> tuple[list[str], list[str]]:
    """Guard each symbolic dimension of ``values``' tensors at most its hint. Returns the
    guards added (as text) and the dimensions that could not be guarded (unbacked)."""
    from torch.fx.experimental.symbolic_shapes import has_guarding_hint
    added: dict[str, None] = {}
    left: dict[str, None] = {}
    for v in values:
        for t in _tensors(graph_meta.val(v)):
            for d in t.shape:
                if not isinstance(d, torch.SymInt) or d.node.expr.is_number:
                    continue
                expr = str(d.node.expr)
                if expr in added or expr in left:
                    continue
                if not has_guarding_hint(d):
                    left[expr] = None
                    continue
                hint = int(d.node.hint) if d.node.hint is not None else None
                if hint is None:
                    left[expr] = None
                    continue
                if bool(d <= hint):  # (a guard: the graph serves these sizes only)
                    added[f"{expr} <= {hint}"] = None
    return list(added), list(left)


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for x in val for t in _tensors(x)]
    return []
