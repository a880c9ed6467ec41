"""``sac_region`` / ``checkpoint`` / ``tag`` / ``name`` while dynamo traces.

A region becomes torch's ``tag_activation_checkpoint`` higher-order op (through
``torch.utils.checkpoint.checkpoint`` with our ``context_fn``): dynamo traces the body once
into a subgraph, and while AOTAutograd traces it, :class:`.tagging.SACTaggingMode` writes
the decisions. Nested regions nest the modes; the innermost decides with all frames.

``tag`` and ``name`` become identity marker ops (no graph break), folded into the
producer's decision by :mod:`.normalize`.

If the body graph-breaks, dynamo cannot build the higher-order op and runs the region call
eagerly instead: the region then goes through the eager runtime (``regions.run_region``
sees ``is_compiling()`` false), which gives correct results; :func:`note_eager_fallback`
logs that once per region.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..policy import Opinion, RegionFrame
from .tagging import encode_opinion, name_op, region_contexts, tag_op

__all__ = ["run_region", "tag", "name", "note_eager_fallback"]

log = logging.getLogger("sac_compile")
_logged: set[str] = set()


def run_region(frame: RegionFrame, fn: Callable[..., Any], args: tuple, kwargs: dict,
               allow_cache_entry_mutation: bool = False) -> Any:
    # name and policy travel separately: dynamo guards them as constants (ID_MATCH for the
    # policy), which a RegionFrame built inside traced code could not be.
    context_fn = functools.partial(region_contexts, frame.name, frame.policy)
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                             context_fn=context_fn, **kwargs)


def tag(tensor: torch.Tensor, opinion: Opinion) -> torch.Tensor:
    return tag_op(tensor, encode_opinion(opinion))


def name(tensor: torch.Tensor, label: str) -> torch.Tensor:
    return name_op(tensor, label)


def note_eager_fallback(frame: RegionFrame) -> None:
    """Log once per region name that a compiled region ran through the eager runtime."""
    if frame.name not in _logged:
        _logged.add(frame.name)
        log.warning("sac_compile: region %r graph-broke under torch.compile; it runs through "
                    "the eager runtime (correct, but not compiled)", frame.name)
