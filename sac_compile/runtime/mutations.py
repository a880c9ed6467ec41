"""In-place ops inside a recorded region: what the recorder does before one writes.

A region input (a leaf) or a saved value that an in-place op is about to overwrite is
copied first (copy-on-write), or, for a MUST-saved value, marked so that backward raises
(unless ``allow_cache_entry_mutation``). Ops that write into an argument without bumping
its version (``rrelu``'s noise) move the handles of the old value to the write. The
indexes by storage are built at a region's first mutation: most regions never mutate.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..policy import op_name
from ..tensor_memory import storage_key
from .graph import OpNode

if TYPE_CHECKING:
    from .record import RegionRecorder

__all__ = ["index_saved", "before_mutation", "follow_unversioned_write"]


def _index_storages(rec: RegionRecorder) -> None:
    rec.leaves_by_storage = {}
    for _, ref in rec.leaves.values():
        rec.leaves_by_storage.setdefault(storage_key(ref.value), []).append(ref)
    rec.saved_by_storage = {}
    for node in rec.decisions:
        index_saved(rec, node)


def index_saved(rec: RegionRecorder, node: OpNode) -> None:
    """Index a node's saved values by storage, once the region has mutated something."""
    if rec.saved_by_storage is None or node.value is None:
        return
    for v in node.value:
        if isinstance(v, torch.Tensor):
            rec.saved_by_storage.setdefault(storage_key(v), []).append(node)


def before_mutation(rec: RegionRecorder, m: torch.Tensor, func: Any) -> None:
    """``func`` is about to write into ``m``: copy the leaves and saved values on its storage."""
    if rec.leaves_by_storage is None:
        _index_storages(rec)
    key = storage_key(m)
    for leaf in rec.leaves_by_storage.get(key, ()):
        if not leaf.snapshot:
            leaf.value = leaf.value.clone()
            leaf.snapshot = True
    for node in rec.saved_by_storage.get(key, ()):
        if node.value is None:
            continue
        if _allows_mutation(rec, node):
            node.value = [v.clone() if isinstance(v, torch.Tensor) else v for v in node.value]
            node.versions = None
        elif not node.decision.is_must:
            # A PREFER_SAVE is a preference: recomputing the pre-mutation value is
            # right, keeping a copy would cost memory the policy did not ask for.
            node.value = node.versions = None
        elif node.mutated_by is None:
            node.mutated_by = op_name(func)


def _allows_mutation(rec: RegionRecorder, node: OpNode) -> bool:
    if rec.ctx.allow_cache_entry_mutation:
        return True
    allowing = rec.allowing_frames
    return bool(allowing) and any(id(f) in allowing for f in node.frames)


def follow_unversioned_write(rec: RegionRecorder, node: OpNode,
                             mutated: Sequence[torch.Tensor], prior: list,
                             outputs: list) -> None:
    """An op that writes into an argument without bumping its version (rrelu's
    ``noise``): autograd packed that argument before the write and reads the written
    value in backward, so handles to the old value follow the write."""
    for m, found in zip(mutated, prior):
        if found is None:
            continue
        index = next(i for i, o in enumerate(outputs) if o is m)
        for handle in rec.handles:
            if handle.node is found[0] and handle.index == found[1]:
                handle.node, handle.index, handle.outs = node, index, node.outs
